"""Tokenizers shipped as a tiktoken vocabulary (`tiktoken.model`, no tokenizer.json): Kimi K2 / K2.5,
Moonlight and the other Moonshot models, whose repositories load it through remote code
(tokenization_kimi.TikTokenTokenizer, named by tokenizer_config.json's auto_map).

tiktoken.model lists each token's bytes (base64) and its rank. tiktoken encodes a text by splitting
it with a regex (the tokenizer's pat_str), taking a piece whole when it is a token, else merging its
bytes pairwise, the pair whose join has the lowest rank first; special tokens (allowed_special="all")
are matched in the text whole. The same computation in the `tokenizers` library: a byte-level BPE
whose vocabulary is the tokens (GPT-2's byte-to-unicode alphabet) and whose merges are, in rank
order, each token split where tiktoken's merging of its bytes below its own rank last joined it
(tokens no merge reaches are kept whole only), with whole pieces taken first (ignore_merges), the
regex split before the byte-level step, and the special tokens added at their ids. Kimi's specials:
the 256 ids from the vocabulary's size on (TikTokenTokenizer.num_reserved_special_tokens: Kimi K2's
163 584 tokens + 256 = its 163 840 embeddings), named by tokenizer_config.json's added_tokens_decoder
(with its `special` flag: a special one is dropped by decode's skip_special_tokens), the unnamed
ones <|reserved_token_ID|>, and any id past those that added_tokens_decoder names (copies of the
code that reserve 2 more).

Deriving the merges walks every token (seconds for Kimi's 163 840), so the result is kept as a
tokenizer.json in the cache, keyed by the vocabulary's and tokenizer_config.json's bytes and this
module's source. Other tiktoken vocabularies (another auto_map) are refused: their regex is in code
jaxinfer does not run.

Never imports jax.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from jaxinfer.cache_dir import cache_dir

KIMI_CLASS = "tokenization_kimi.TikTokenTokenizer"
# tokenization_kimi.py's TikTokenTokenizer.pat_str (Kimi K2 / Moonlight)
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
KIMI_RESERVED = 256   # TikTokenTokenizer.num_reserved_special_tokens: ids past the vocabulary


class TikTokenError(ValueError):
    pass


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken.model: one `base64-token rank` per line; every rank 0..n-1 once."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise TikTokenError(f"{path}: line {n} is not 'base64-token rank' ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TikTokenError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def _split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's merging of `token`'s bytes, stopped before any join of rank >= max_rank."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best, at = max_rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts


def kimi_specials(path: Path, tok_cfg: dict[str, Any], base: int) -> dict[int, tuple[str, bool]]:
    """Kimi's special tokens: id -> (text, whether decode drops it): added_tokens_decoder's (its
    `special` flag; true when absent), <|reserved_token_ID|> for the other reserved ids (dropped)."""
    named: dict[int, tuple[str, bool]] = {}
    for i, d in (tok_cfg.get("added_tokens_decoder") or {}).items():
        try:
            named[int(i)] = (d["content"], bool(d.get("special", True))) if isinstance(d, dict) else (str(d), True)
        except (KeyError, TypeError, ValueError):
            raise TikTokenError(f"{path.with_name('tokenizer_config.json')}: added_tokens_decoder entry {i!r} is not "
                                "an id with a content") from None
    below = [i for i in named if i < base]
    if below:
        raise TikTokenError(f"{path.with_name('tokenizer_config.json')}: added_tokens_decoder names id {below[0]}, "
                            f"a vocabulary token (the specials start at {base})")
    ids = sorted(set(range(base, base + KIMI_RESERVED)) | set(named))
    return {i: named.get(i, (f"<|reserved_token_{i}|>", True)) for i in ids}


def build(path: Path, tok_cfg: dict[str, Any]):
    """The tokenizers.Tokenizer computing what tiktoken computes with Kimi's pattern and specials."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    ranks = read_ranks(path)
    table = byte_alphabet()
    text = lambda b: "".join(table[x] for x in b)  # noqa: E731
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = _split(ranks, token, rank)
            if len(parts) == 2:
                merges.append((text(parts[0]), text(parts[1])))
    specials = kimi_specials(path, tok_cfg, len(ranks))
    vocab = {text(t): r for t, r in ranks.items()}
    for i, (s, _) in specials.items():
        if s in vocab:
            raise TikTokenError(f"{path}: special token {s!r} (id {i}) also spells vocabulary token {vocab[s]}")
        vocab[s] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(s, special=special, normalized=False) for _, (s, special) in sorted(specials.items())]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok


def load(folder: Path):
    """(the tokenizers.Tokenizer, tiktoken.model's path) of a folder whose tokenizer is a tiktoken
    vocabulary, built once and cached (module docstring)."""
    import tokenizers
    from tokenizers import Tokenizer
    path = Path(folder) / "tiktoken.model"
    cfg_file = Path(folder) / "tokenizer_config.json"
    try:
        tok_cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TikTokenError(f"{cfg_file}: not readable JSON ({e})") from None
    auto = (tok_cfg.get("auto_map") or {}).get("AutoTokenizer") or []
    if KIMI_CLASS not in (auto if isinstance(auto, list) else [auto]):
        raise TikTokenError(f"{path}: a tiktoken vocabulary without tokenizer.json whose tokenizer class "
                            f"(tokenizer_config.json auto_map {auto!r}) is not {KIMI_CLASS!r}, the one jaxinfer "
                            "rebuilds (its splitting regex lives in the model's own code); give --tokenizer a "
                            "folder with a tokenizer.json")
    key = hashlib.sha256()
    for part in (path.read_bytes(), cfg_file.read_bytes() if cfg_file.is_file() else b"", Path(__file__).read_bytes(),
                 tokenizers.__version__.encode()):
        key.update(hashlib.sha256(part).digest())
    cache = cache_dir("tiktoken") / f"{key.hexdigest()[:24]}.json"
    if cache.is_file():
        try:
            return Tokenizer.from_file(str(cache)), path
        except Exception:  # noqa: BLE001   a damaged cache file (the Rust side raises bare Exception): rebuilt
            pass
    tok = build(path, tok_cfg)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, cache)
    return tok, path
