"""Text <-> token ids for jaxinfer: loading a checkpoint's tokenizer, streaming detokenization
and stop-string matching.

Three on-disk formats are supported: a HuggingFace fast tokenizer (``tokenizer.json``, via the
``tokenizers`` library), Kimi's tiktoken vocabulary (``tiktoken.model``, rebuilt in the ``tokenizers``
library by jaxinfer/tiktoken_file.py) and a SentencePiece model (``tokenizer.model``). Special-token ids and the
chat template come from the HF side files (``tokenizer_config.json``, ``special_tokens_map.json``,
``generation_config.json``, ``config.json``) when present.

This module is imported by the CLI and the server before any device work starts, so it must stay
cheap: it never imports jax, and the tokenizer libraries are imported only when a file is loaded.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxinfer.errors import FieldError

__all__ = [
    "Tokenizer",
    "TokenizerError",
    "IncrementalDetokenizer",
    "load_tokenizer",
    "find_stop",
    "hold_back",
]

_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
_TEMPLATE_FILE = "chat_template.jinja"  # newer transformers write the template here instead
_PROCESSOR_TEMPLATE_FILE = "chat_template.json"   # a multimodal processor's, older transformers
_TEMPLATE_DIR = "additional_chat_templates"   # and the named ones other than "default" here
_REPLACEMENT = "\ufffd"
# How many prompt tokens seed the detokenizer window (vLLM uses the same number): enough for the
# decoders to see the context a leading-space marker or a split multi-byte char depends on.
_PROMPT_CONTEXT = 5
_ANCHOR = "\u263a"     # text whose pieces a word-marker-free encode is read after (mistral_common's)
_UNK_TEXT = "<unk>"    # the second choice


class TokenizerError(ValueError):
    """A tokenizer file exists but cannot be read or parsed."""


def cut_ids(ids: Sequence[int], keep: int | None, side: str) -> list[int]:
    """Token ids cut as vLLM cuts a token-id prompt (truncate_prompt_tokens): the first `keep`
    ("right") or the last `keep` ("left"); keep None: all of them."""
    if keep is None:
        return list(ids)
    return list(ids[:keep]) if side == "right" else list(ids[-keep:])


def longest_first(lengths: Sequence[int], budget: int) -> list[int]:
    """How many tokens each of one text or a pair keeps under transformers' longest_first
    truncation to `budget` tokens (special tokens already taken out), as the tokenizers library
    computes it (its truncate_encodings): the longer text is cut first, down to the shorter one's
    length; where both must be cut, the first keeps budget // 2 and the second the rest."""
    if len(lengths) == 1 or sum(lengths) <= budget:
        return [min(n, budget) for n in lengths] if len(lengths) == 1 else list(lengths)
    n1, n2 = lengths
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    n2 = n1 if n1 > budget else max(n1, budget - n1)
    if n1 + n2 > budget:
        n1 = budget // 2
        n2 = n1 + budget % 2
    return [n2, n1] if swap else [n1, n2]


class Tokenizer:
    """A loaded tokenizer; build it with :func:`load_tokenizer`.

    Wraps either a ``sentencepiece.SentencePieceProcessor`` (``kind == "sentencepiece"``) or a
    ``tokenizers.Tokenizer`` (``kind == "hf"``).
    """

    def __init__(
        self,
        backend: Any,
        kind: str,
        files: list[Path],
        *,
        bos_id: int | None,
        eos_ids: tuple[int, ...],
        pad_id: int | None,
        chat_template: str | None,
        add_bos: bool,
        chat_templates: dict[str, str] | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self.kind = kind
        self.files = files
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        # every template by name, as transformers keeps them ("default", "tool_use", ...; the one
        # template is "default"), and the special tokens' text that templates read (bos_token, ...)
        self.chat_templates: dict[str, str] = dict(chat_templates or ({"default": chat_template} if chat_template else {}))
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.add_bos = add_bos
        # a copy of the backend that truncates (_truncated): made on first use, under the lock
        self._twin: Any = None
        self._twin_lock = threading.Lock()
        if kind == "sentencepiece":
            self.vocab_size: int = backend.get_piece_size()
        else:
            self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The default chat template (None: the checkpoint has none, or only named ones without a default)."""
        return self.chat_templates.get("default")

    @property
    def backend(self) -> Any:
        """The sentencepiece processor or `tokenizers.Tokenizer` underneath (grammar engines read it)."""
        return self._backend

    def __repr__(self) -> str:
        return (f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={self.eos_ids}, pad_id={self.pad_id})")

    def encode(self, text: str, add_special_tokens: bool = True, *, truncate: int | None = None,
               side: str = "right") -> list[int]:
        """truncate: at most that many ids, special tokens included, as transformers' tokenizer(text,
        truncation=True, max_length=truncate) with truncation_side `side` ("right" keeps the text's
        start, "left" its end; the special tokens stay)."""
        if truncate is not None:
            return self._truncated((text,), add_special_tokens, truncate, side)
        if self.kind == "hf":
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        ids: list[int] = self._backend.encode(text, out_type=int)
        if add_special_tokens and self._adds_bos:
            ids.insert(0, self.bos_id)
        return ids

    def encode_pair(self, text: str, pair: str, *, truncate: int | None = None, side: str = "right") -> list[int]:
        """Two texts as one sequence with special tokens, as transformers' tokenizer(text,
        text_pair) makes it (a cross-encoder's input): tokenizer.json's post-processor places the
        pair (its TemplateProcessing "pair", e.g. "<s> $A </s></s> $B </s>"; a ByteLevel-only
        processor, Qwen's, just joins the two); for a SentencePiece model, transformers' Llama rule,
        each text after its own BOS where the model adds BOS. truncate: transformers' truncation=True
        (longest_first: the longer text loses tokens first) to at most that many ids."""
        if truncate is not None:
            return self._truncated((text, pair), True, truncate, side)
        if self.kind == "hf":
            return list(self._backend.encode(text, pair, add_special_tokens=True).ids)
        return self.encode(text) + self.encode(pair)

    @property
    def _adds_bos(self) -> bool:
        return self.add_bos and self.bos_id is not None

    def _truncated(self, texts: tuple[str, ...], add_special_tokens: bool, max_length: int, side: str) -> list[int]:
        """One text or a pair encoded with transformers' truncation (strategy longest_first): the
        tokenizers library's own truncation on a twin of the backend (this one's settings are never
        changed, so concurrent encodes are unaffected); for SentencePiece the same rule by hand."""
        if side not in ("left", "right"):
            raise FieldError("truncation_side", f"truncation side must be 'left' or 'right', got {side!r}")
        pair = len(texts) == 2
        if self.kind == "hf":
            n_special = self._backend.num_special_tokens_to_add(pair) if add_special_tokens else 0
        else:
            n_special = len(texts) if add_special_tokens and self._adds_bos else 0
        if max_length < n_special:
            raise FieldError("truncate_prompt_tokens", f"cannot truncate to {max_length} tokens: the model adds "
                             f"{n_special} special token(s) around {'each pair' if pair else 'each text'}")
        if self.kind == "hf":
            with self._twin_lock:
                if self._twin is None:
                    import tokenizers
                    self._twin = tokenizers.Tokenizer.from_str(self._backend.to_str())
                self._twin.enable_truncation(max_length, strategy="longest_first", direction=side)
                return list(self._twin.encode(*texts, add_special_tokens=add_special_tokens).ids)
        bodies = [self._backend.encode(t, out_type=int) for t in texts]
        keep = longest_first([len(b) for b in bodies], max_length - n_special)
        bos = [self.bos_id] if add_special_tokens and self._adds_bos else []
        return [i for b, k in zip(bodies, keep) for i in bos + (b[:k] if side == "right" else b[len(b) - k:])]


    def encode_rendered(self, text: str, special_texts: Sequence[str] = ()) -> list[int]:
        """A rendered chat (a template wrote its special tokens out as text: bos_token, eos_token, ...)
        -> ids, with no special token added, as transformers encodes apply_chat_template's text. The
        tokenizers library finds special tokens in text itself; SentencePiece reads "<s>" as three
        characters, so here each of `special_texts` that names a control piece becomes its id, and
        the text between them is encoded plainly, a piece after a special token without the word
        marker (transformers' Llama tokenizer, legacy=False: the marker goes before the first piece
        of the text only)."""
        if self.kind == "hf":
            return self.encode(text, add_special_tokens=False)
        sp = self._backend
        ids_of = {t: i for t in special_texts if t and (i := self.token_to_id(t)) is not None and sp.is_control(i)}
        if not ids_of:
            return self.encode(text, add_special_tokens=False)
        out: list[int] = []
        pos = 0
        for m in re.finditer("|".join(re.escape(t) for t in sorted(ids_of, key=len, reverse=True)), text):
            out += self.encode_piece(text[pos:m.start()], pos == 0)
            out.append(ids_of[m.group()])
            pos = m.end()
        return out + self.encode_piece(text[pos:], pos == 0)

    def encode_piece(self, text: str, first: bool = True) -> list[int]:
        """Ids of a stretch of text with no special token added, as SentencePiece's encoders of
        infilling prompts make them (Meta's CodeLlama, mistral_common): as a text of its own (first:
        one word marker before it where the tokenizer adds a dummy prefix, even before a space), or
        as text that goes on after other tokens (no marker: _after_anchor, their encode_infilling).
        A tokenizer with no marker (byte-level) gives its plain ids either way."""
        if not text:
            return []
        if self.kind == "hf":
            enc = lambda t: self.encode(t, add_special_tokens=False)   # noqa: E731
        else:
            enc = lambda t: self._backend.encode(t, out_type=int)      # noqa: E731
        if not self._dummy_prefix or (first and self.kind != "hf"):    # (SentencePiece's own dummy prefix)
            return enc(text)
        # first, for a tokenizer.json: the marker even before a space (Metaspace adds none there)
        found = _after_anchor(enc, " " + text if first else text)
        return found if found is not None else enc(text)

    @functools.cached_property
    def adds_bos_token(self) -> bool:
        """Whether encode(text) puts BOS first (tokenizer.json's post-processor; for SentencePiece,
        add_bos_token)."""
        if self.kind == "hf":
            return self.bos_id is not None and self._backend.encode("", add_special_tokens=True).ids[:1] == [self.bos_id]
        return self._adds_bos

    @functools.cached_property
    def fim(self) -> Any:
        """The model's fill-in-the-middle tokens (jaxinfer.fim.FimTokens), or None."""
        from jaxinfer.fim import find_fim_tokens
        return find_fim_tokens(self)

    @functools.cached_property
    def _dummy_prefix(self) -> bool:
        """Whether the tokenizer puts a word marker before a text: SentencePiece's add_dummy_prefix,
        a tokenizer.json's Metaspace or Prepend("\u2581") normalizer (a byte-level one has none)."""
        if self.kind == "hf":
            return self._backend.encode("a", add_special_tokens=False).tokens[:1] != ["a"]
        return self._backend.encode("a", out_type=str)[0].startswith("\u2581")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.kind == "hf":
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        sp = self._backend
        # A model's embedding table is often padded past the tokenizer's vocabulary, so sampled ids
        # can be out of range; drop them (as the tokenizers library does) instead of raising.
        ids = [int(i) for i in ids if 0 <= i < self.vocab_size]
        text_ids = [i for i in ids if not sp.is_control(i)]
        text: str = sp.decode(text_ids)
        if skip_special_tokens or len(text_ids) == len(ids):
            return text
        # SentencePiece always renders control pieces (<s>, </s>, <pad>) as "". Decoding the runs
        # between them separately would drop each run's leading-space marker, so decode the whole
        # text once and splice the pieces in at the offsets where their prefixes end.
        parts: list[str] = []
        prev = n_text = 0
        for i in ids:
            if sp.is_control(i):
                cut = min(max(prev, len(sp.decode(text_ids[:n_text]))), len(text))
                parts += [text[prev:cut], sp.id_to_piece(i)]
                prev = cut
            else:
                n_text += 1
        parts.append(text[prev:])
        return "".join(parts)

    def id_to_piece(self, i: int) -> str:
        """The vocabulary entry for ``i`` ("" when out of range, see ``decode``)."""
        if self.kind == "hf":
            piece = self._backend.id_to_token(int(i))
            return piece if piece is not None else ""
        return self._backend.id_to_piece(int(i)) if 0 <= i < self.vocab_size else ""

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for (OpenAI's logprobs `bytes`; a multi-byte character split
        over tokens comes back whole from their concatenation): a byte-fallback piece ``<0xNN>`` is
        that byte, a byte-level BPE piece (GPT-2's alphabet: one character per byte) the bytes its
        characters stand for, the SentencePiece word marker a space; special tokens their text."""
        piece = self.id_to_piece(i)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self.kind == "hf" and self._byte_level:
            table = _byte_level_table()
            if all(c in table for c in piece):   # else an added token written as plain text
                return bytes(table[c] for c in piece)
        return piece.replace("\u2581", " ").encode()

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the HF tokenizer's decoder is byte-level (GPT-2, Llama 3, Qwen), read once."""
        decoder = json.loads(self._backend.to_str()).get("decoder") or {}
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        return any(d.get("type") == "ByteLevel" for d in parts)

    def token_to_id(self, token: str) -> int | None:
        return _token_id(self._backend, self.kind, token)

    @functools.cached_property
    def _added_tokens(self) -> dict[str, int]:
        if self.kind != "hf":
            return {}
        return {t["content"]: t["id"] for t in json.loads(self._backend.to_str()).get("added_tokens") or []}

    def added_token_id(self, text: str) -> int | None:
        """The id of `text` where it is one of tokenizer.json's added tokens (which llguidance, reading
        that file, matches only as that token, never as text), else None."""
        return self._added_tokens.get(text)

    def save(self, out_dir: str | Path) -> None:
        """Copy the files this tokenizer was loaded from into ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for f in self.files:
            dst = out / f.parent.name / f.name if f.parent.name == _TEMPLATE_DIR else out / f.name
            # Re-saving into the source folder is a no-op, not an error.
            if dst.exists() and dst.resolve() == f.resolve():
                continue
            dst.parent.mkdir(exist_ok=True)
            shutil.copyfile(f, dst)


def _after_anchor(encode, text: str) -> list[int] | None:
    """The ids of `text` encoded after an anchor, less the anchor's: text that goes on after other
    tokens, without the word marker a SentencePiece-style tokenizer puts before a text (Meta's and
    mistral_common's encode_infilling use "\u263a"). Only where the anchor's ids come out unchanged
    (no piece merged across the boundary: "<unk>" + ">=" could make ">="); None where neither does."""
    for anchor in (_ANCHOR, _UNK_TEXT):
        lead, joined = encode(anchor), encode(anchor + text)
        if joined[:len(lead)] == lead:
            return joined[len(lead):]
    return None


def _token_id(backend: Any, kind: str, token: str) -> int | None:
    if kind == "hf":
        return backend.token_to_id(token)
    # piece_to_id answers unk_id for unknown pieces, so check the round trip.
    i = backend.piece_to_id(token)
    return i if backend.id_to_piece(i) == token else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read tokenizer side file: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_str(v: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as plain strings or as serialized
    # AddedToken dicts ({"content": "</s>", "lstrip": false, ...}).
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _id_list(v: Any) -> list[int]:
    if isinstance(v, bool):
        return []
    if isinstance(v, int):
        return [v]
    if isinstance(v, list):
        return [x for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


def _chat_templates(folder: Path, cfg: dict[str, Any]) -> tuple[dict[str, str], list[Path]]:
    """The chat templates by name and the files they came from, found as transformers finds them:
    chat_template.jinja ("default") and additional_chat_templates/NAME.jinja where either exists,
    else tokenizer_config's chat_template (a string: "default"; a list of {name, template}), else a
    vision-language checkpoint's processor template (chat_template.json: {"chat_template": ...}),
    as vLLM falls back to the processor's."""
    paths = [folder / _TEMPLATE_FILE] if (folder / _TEMPLATE_FILE).is_file() else []
    if (folder / _TEMPLATE_DIR).is_dir():
        paths += sorted((folder / _TEMPLATE_DIR).glob("*.jinja"))
    if paths:
        return {("default" if p.parent == folder else p.name.removesuffix(".jinja")): p.read_text(encoding="utf-8")
                for p in paths}, paths
    t = cfg.get("chat_template")
    if isinstance(t, str):
        return {"default": t}, []
    if isinstance(t, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        return {e["name"]: e["template"] for e in t if isinstance(e, dict) and isinstance(e.get("name"), str)
                and isinstance(e.get("template"), str)}, []
    processor = folder / _PROCESSOR_TEMPLATE_FILE
    if processor.is_file():
        t = _read_json(processor).get("chat_template")
        if isinstance(t, str):
            return {"default": t}, [processor]
    return {}, []


# the special tokens transformers hands a chat template by name (its special_tokens_map)
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _special_token_texts(tok_cfg: dict, st_map: dict) -> dict[str, str]:
    """name -> text of the special tokens tokenizer_config / special_tokens_map name (the first wins)."""
    out: dict[str, str] = {}
    for cfg in (tok_cfg, st_map):
        for name in _TEMPLATE_TOKENS:
            text = _token_str(cfg.get(name))
            if text is not None:
                out.setdefault(name, text)
    return out


def _load_backend(folder: Path) -> tuple[str, Path, Any] | None:
    """(kind, main file, backend) of the tokenizer in `folder`, or None: tokenizer.json (the
    `tokenizers` library) when present, as transformers prefers it, else a tiktoken.model (Kimi's:
    jaxinfer/tiktoken_file.py rebuilds it in the `tokenizers` library), else tokenizer.model
    (SentencePiece)."""
    hf_file, sp_file = folder / "tokenizer.json", folder / "tokenizer.model"
    if hf_file.is_file():
        try:
            import tokenizers

            backend = tokenizers.Tokenizer.from_file(str(hf_file))
        except Exception as e:  # the Rust side raises bare Exception subclasses
            raise TokenizerError(f"{hf_file}: cannot load tokenizer: {e}") from e
        # a truncation or padding saved in tokenizer.json applies only where a call asks for it in
        # transformers (tokenizer(text) truncates and pads nothing): never by default here either
        backend.no_truncation()
        backend.no_padding()
        return "hf", hf_file, backend
    if (folder / "tiktoken.model").is_file():
        from jaxinfer import tiktoken_file
        try:
            backend, main = tiktoken_file.load(folder)
        except tiktoken_file.TikTokenError as e:
            raise TokenizerError(str(e)) from None
        return "hf", main, backend
    if sp_file.is_file():
        try:
            import sentencepiece

            return "sentencepiece", sp_file, sentencepiece.SentencePieceProcessor(model_file=str(sp_file))
        except Exception as e:
            raise TokenizerError(f"{sp_file}: cannot load tokenizer: {e}") from e
    return None


def _special_ids(backend: Any, kind: str, tok_cfg: dict, st_map: dict, gen_cfg: dict,
                 model_cfg: dict) -> tuple[int | None, tuple[int, ...], int | None]:
    """(bos_id, eos_ids, pad_id) from every place a checkpoint may name them."""
    def named_id(key: str) -> list[int]:
        out = []
        for cfg in (tok_cfg, st_map):
            s = _token_str(cfg.get(key))
            i = _token_id(backend, kind, s) if s is not None else None
            if i is not None:
                out.append(i)
        return out

    def model_id(getter: str) -> list[int]:
        if kind != "sentencepiece":
            return []
        i = getattr(backend, getter)()
        return [i] if i >= 0 else []

    def candidates(key: str) -> list[int]:
        # Tokenizer files first: they name the token the text actually uses; the model configs
        # and the SentencePiece model only fill gaps.
        return (named_id(f"{key}_token") + _id_list(gen_cfg.get(f"{key}_token_id"))
                + _id_list(model_cfg.get(f"{key}_token_id")) + model_id(f"{key}_id"))

    bos = candidates("bos")
    pad = candidates("pad")
    # All eos sources are kept: generation_config often lists several ids (e.g. end-of-text and
    # end-of-turn) and stopping on any of them is what the model's authors intend.
    eos_ids = tuple(dict.fromkeys(_id_list(gen_cfg.get("eos_token_id")) + candidates("eos")))
    return (bos[0] if bos else None), eos_ids, (pad[0] if pad else None)


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's alphabet, character -> the byte it stands for: the 188 printable bytes stand
    for themselves (as Latin-1 characters), the other 68 for U+0100 onwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    table = {chr(b): b for b in printable}
    rest = [b for b in range(256) if b not in set(printable)]
    table.update({chr(256 + k): b for k, b in enumerate(rest)})
    return table


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """Load the tokenizer in folder ``path``; None when it has neither tokenizer.json nor
    tokenizer.model. Prefers tokenizer.json: when both exist it is the one transformers uses."""
    folder = Path(path)
    loaded = _load_backend(folder)
    if loaded is None:
        return None
    kind, main, backend = loaded
    files = [main]
    cfgs: dict[str, dict[str, Any]] = {}
    for name in _SIDE_FILES:
        if (folder / name).is_file():
            cfgs[name] = _read_json(folder / name)
            files.append(folder / name)
    # config.json describes the model, not the tokenizer: read for special ids but never copied.
    model_cfg = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    tok_cfg = cfgs.get("tokenizer_config.json", {})
    bos_id, eos_ids, pad_id = _special_ids(backend, kind, tok_cfg, cfgs.get("special_tokens_map.json", {}),
                                           cfgs.get("generation_config.json", {}), model_cfg)

    templates, template_files = _chat_templates(folder, tok_cfg)
    files += template_files
    special = _special_token_texts(tok_cfg, cfgs.get("special_tokens_map.json", {}))
    # a checkpoint that names none (a bare tokenizer.model): the ids' pieces
    piece = backend.id_to_piece if kind == "sentencepiece" else backend.id_to_token
    for name, i in (("bos_token", bos_id), ("eos_token", eos_ids[0] if eos_ids else None)):
        if name not in special and i is not None:
            special[name] = piece(i)

    if kind == "hf":
        # The post-processor in tokenizer.json decides whether BOS is added; probe it rather than
        # trusting tokenizer_config's add_bos_token, which the fast tokenizer does not read.
        probe = backend.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and probe[:1] == [bos_id]
    else:
        flag = tok_cfg.get("add_bos_token")
        add_bos = bos_id is not None and (flag if isinstance(flag, bool) else True)
    return Tokenizer(backend, kind, files, bos_id=bos_id, eos_ids=eos_ids, pad_id=pad_id,
                     chat_template=templates.get("default"), add_bos=add_bos, chat_templates=templates,
                     special_tokens=special)


class IncrementalDetokenizer:
    """Streaming detokenization (the vLLM prefix_offset/read_offset scheme): decode a window of the
    ids so that SentencePiece's leading-space marker and byte-fallback pieces come out right, and
    never emit text that ends in an incomplete UTF-8 sequence (U+FFFD at the end means: wait for
    more ids).

    ``ids[prefix_offset:read_offset]`` is the context already emitted; each step decodes it with
    and without the new ids and emits the difference. The prompt seeds that context but is never
    emitted.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = [int(i) for i in prompt_ids]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _PROMPT_CONTEXT, 0)
        # The context must not start inside a character: byte-fallback decoders turn a whole run of
        # byte pieces into U+FFFD when any of it is not UTF-8, so a window that began mid-character
        # would garble every byte piece generated after it. Start up to 3 ids earlier (a character
        # is at most 4 bytes) until the context decodes whole.
        for _ in range(3):
            if self.prefix_offset == 0 or _REPLACEMENT not in tokenizer.decode(
                    self.ids[self.prefix_offset:self.read_offset], skip_special_tokens):
                break
            self.prefix_offset -= 1
        self.text = ""

    def _window_start(self) -> int:
        """Where this step's decode starts: prefix_offset, or earlier where a SentencePiece control
        token (kept in the text) would open the window. SentencePiece drops the word marker of a
        window's first text piece, so "<s>" + "▁good" would decode as "<s>good" where the whole
        output has "<s> good"; the text piece before it keeps the space."""
        start = self.prefix_offset
        tok = self.tokenizer
        if tok.kind == "sentencepiece" and not self.skip_special_tokens:
            while start > 0 and 0 <= self.ids[start] < tok.vocab_size and tok.backend.is_control(self.ids[start]):
                start -= 1
        return start

    def _step(self, force: bool) -> str:
        dec = self.tokenizer.decode
        start = self._window_start()
        prefix = dec(self.ids[start:self.read_offset], self.skip_special_tokens)
        full = dec(self.ids[start:], self.skip_special_tokens)
        # A trailing U+FFFD is (almost always) a multi-byte char whose remaining bytes are still
        # to come; emitting it now would put a replacement char into the stream for good.
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not force):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes (may be "")."""
        self.ids.append(int(token_id))
        return self._step(force=False)

    def flush(self) -> str:
        """At end of stream: emit whatever is held back, even a trailing replacement char."""
        return self._step(force=True)


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index where the earliest stop string in ``text`` begins, or None.

    Only occurrences that end at or after ``start`` count: ``start`` is the length of the text
    already checked, so a stop spanning the previous delta and the new one is still found, while
    the search stays proportional to the delta rather than the whole text.
    """
    best: int | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def hold_back(text: str, stops: Sequence[str]) -> int:
    """Number of trailing chars of ``text`` that are a proper prefix of some stop string; a stream
    must hold them back until it knows whether the stop string completes.

    Only the last ``len(s) - 1`` chars can hold a proper prefix of ``s``, so each stop costs
    O(len(s)) C-level work per call however long ``text`` grows (stop lengths are bounded by
    SamplingParams)."""
    best = 0
    for s in stops:
        if len(s) < 2:
            continue
        tail = text[-(len(s) - 1):]
        # the longest suffix of tail that starts s: try start positions left to right (longest first)
        i = tail.find(s[0])
        while 0 <= i < len(tail) - best:
            if s.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(s[0], i + 1)
    return best
