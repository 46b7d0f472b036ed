"""Structured outputs on the host: grammars compiled by llguidance, one matcher per sample, and the
packed token masks a step reads. jax-free, like the rest of host/.

Why llguidance (not xgrammar): it is a self-contained wheel with no dependencies (xgrammar's wheel
requires torch, triton and transformers at run time, gigabytes this stack does not otherwise need),
it computes a mask in tens of microseconds by walking the token trie against an Earley parser with
lazily built lexer automata (no per-grammar precompilation pass), it takes JSON schema, regex, Lark
and GBNF, and vLLM, SGLang and llama.cpp ship it as a backend.

The contract with the step (jaxinfer/sampling.py): each sampling row has a packed mask of
ceil(V / 32) int32 words, bit j of word w allowing token 32 w + j; -1 everywhere means "no
constraint". The sampler sets disallowed logits to -inf before penalties, temperature, logprobs
and truncation, so the logprobs reported are those of the constrained distribution.

Each draw of a constrained row needs its previous token on the host (the mask depends on it), so
such rows draw one token per step, and the engine waits for the step in flight before planning a
step that continues a constrained row (engine.step), as it does for penalties.

Speculative decoding: proposals made on the host (n-gram lookup, a Medusa tree) are known before
the step, so the host walks the matcher along each proposal's path, fills the mask that applies
after it (Grammars.fill_paths) and rolls the matcher back; the verify step draws position j under
the mask after t0, d_1..d_j, so the accepted tokens follow the constrained target distribution
exactly. A chain is cut where the grammar rejects a proposal (Guide.valid_prefix): it could never
be accepted. The n-gram proposer starts a constrained row's chain with the tokens its grammar
forces next (Guide.forced: a JSON key, the rest of a choice), then looks up what follows them:
forced text then costs one step for up to k tokens instead of one step per token (SGLang's
"jump-forward", made exact by the verification: where the forced bytes can be spelled more than
one way, the model's own choice wins). The draft model proposes inside the step, where no matcher
runs: constrained rows of a draft-model engine decode one token per step.

JSON stays finite under any sampling. llguidance's JSON compiler bounds a number's value (minimum,
maximum) but not its digits: `{"type": "number"}`, and even a bounded range, admit
`0.1900601700016192611194...` forever, and its options (separators, whitespace, oneOf coercion,
lenient) say nothing about numbers. So a JSON output also walks a second, regular grammar over the
whole text (number_bound_regex: strings pass untouched, every number outside them is bounded) and a
row's mask is the AND of the two. An integer has at most MAX_INTEGER_DIGITS digits (u64 and i64
fit); a number with a fraction or an exponent at most MAX_MANTISSA_DIGITS digits before its
exponent (what a float64 round-trips; a leading "0." not counted; a fraction using all 17 does not
end in 0) and an exponent of at most MAX_EXPONENT_DIGITS digits. Where a grammar needs more digits
the two masks share no token: the grammar wins, that row's bound is dropped and a warning logged
(no JSON schema llguidance 1.9 compiles needs more: it refuses ranges past 64-bit integers, and 17
digits tell any two float64 apart).
Whitespace between tokens is none (compact JSON) or, with whitespace_flexible, one run of at most
MAX_JSON_WHITESPACE characters (llguidance's whitespace_pattern, matched once per position); the
schema's own "x-guidance" separators and whitespace are overridden, so neither can run on. Strings
without maxLength, arrays without maxItems and objects open to additional properties remain
unbounded: the schema allows them.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..config import StructuredOutputs

log = logging.getLogger("jaxinfer")

GRAMMAR_CACHE = 256   # compiled grammars kept per engine (a server sees the same schema many times)
# llguidance builds a grammar by recursion on the calling thread's stack: a chain of 3000 $refs or
# Lark rules (40 KB of request) overflowed an 8 MiB stack and killed the server (SIGSEGV). Every
# grammar is built and checked on one worker thread whose stack holds ~3 KiB per level for far more
# levels than a grammar of MAX_GRAMMAR_CHARS can have (~12 characters per level at the least).
MAX_GRAMMAR_CHARS = 1 << 20
GRAMMAR_STACK_BYTES = 512 << 20
_worker = None
_worker_lock = threading.Lock()


def on_grammar_stack(fn, *args):
    """fn(*args) on the grammar worker thread (its large stack), for llguidance's recursive builds."""
    global _worker
    with _worker_lock:
        if _worker is None:
            from concurrent.futures import ThreadPoolExecutor
            old = threading.stack_size(GRAMMAR_STACK_BYTES)
            try:   # the executor starts its thread with the first task, under this stack size
                _worker = ThreadPoolExecutor(1, thread_name_prefix="grammar")
                _worker.submit(int).result()
            finally:
                threading.stack_size(old)
    return _worker.submit(fn, *args).result()

MAX_INTEGER_DIGITS = 20    # an integer in JSON output (every u64 and i64 fits)
MAX_MANTISSA_DIGITS = 17   # a number with a fraction or an exponent: a float64's round-trip digits
MAX_EXPONENT_DIGITS = 3    # float64's exponent runs to 308
MAX_JSON_WHITESPACE = 16   # whitespace_flexible: one run of up to this many between tokens


class StructuredOutputError(ValueError):
    """A schema, regex or grammar that does not compile; the message says what is wrong."""
    param = "structured_outputs"


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def number_bound_regex() -> str:
    """A regular language over a whole JSON text (any text that llguidance's JSON grammar allows),
    in which every number outside a string has the bounded digits above; strings, literals and
    punctuation pass as they are. A number must be followed by one of `,]}` or whitespace (or end
    the text), so one number cannot continue as a second."""
    m = MAX_MANTISSA_DIGITS

    def digits(n: int) -> str:
        # up to n fraction digits, the n-th not 0: llguidance writes a number in a range without
        # trailing zeros, so a fraction ending in 0 at the limit could neither go on nor end
        return rf"[0-9]{{{n - 1}}}[1-9]" + (rf"|[0-9]{{1,{n - 1}}}" if n > 1 else "")

    integer = rf"-?(?:0|[1-9][0-9]{{0,{MAX_INTEGER_DIGITS - 1}}})"
    # a fraction: at most m digits in all (a leading "0." not counted); k + 1 of them before the point
    fraction = "|".join([rf"0\.(?:{digits(m)})"] +
                        [rf"[1-9][0-9]{{{k}}}\.(?:{digits(m - 1 - k)})" for k in range(m - 1)])
    exponent = rf"[eE][+-]?[0-9]{{1,{MAX_EXPONENT_DIGITS}}}"
    decimal = rf"-?(?:(?:{fraction})(?:{exponent})?|(?:0|[1-9][0-9]{{0,{m - 1}}}){exponent})"
    number = rf"(?:{integer}|{decimal})"
    string = r'"(?:[^"\\]|\\.)*"'
    return rf'(?:[^"0-9\-]|{string}|{number}[,\]}}\x20\x0A\x0D\x09])*(?:{number})?'


def json_options(whitespace_flexible: bool) -> dict:
    """llguidance's JSON compile options, applied over the schema's own "x-guidance": compact
    separators, and whitespace none or one bounded run."""
    ws = rf"[\x20\x0A\x0D\x09]{{1,{MAX_JSON_WHITESPACE}}}" if whitespace_flexible else None
    return {"item_separator": ",", "key_separator": ":", "whitespace_flexible": bool(whitespace_flexible),
            "whitespace_pattern": ws}


@dataclass(frozen=True)
class Grammar:
    """A compiled spec: llguidance's grammar text, and whether its output is JSON (and so also walks
    the number bound); matcher: a fresh matcher of it, which each sample's guide copies (building one
    parses the grammar again, on the grammar thread)."""
    text: str
    json: bool
    prefix: str | None = None   # StructuredOutputs.prefix: the number bound then starts after it too
    matcher: Any = None


def with_prefix(prefix: str | None, grammar: str) -> str:
    """llguidance's grammar for `prefix` (a Lark grammar referring to `@answer`) followed by the
    text `grammar` (a grammar as grammar_text makes it) accepts; `grammar` itself when no prefix."""
    if prefix is None:
        return grammar
    inner = json.loads(grammar)
    parts = [dict(g) for g in inner["grammars"]]
    parts[0]["name"] = "answer"
    return json.dumps({"grammars": [{"name": "prefix", "lark_grammar": prefix}] + parts})


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) for a spec; StructuredOutputError when it cannot be built.
    Not yet checked against a tokenizer (Grammars.compile does that)."""
    try:
        return with_prefix(spec.prefix, _grammar_text(spec))
    except (ValueError, KeyError, IndexError) as e:
        if isinstance(e, StructuredOutputError):
            raise
        raise StructuredOutputError(f"invalid {spec.kind}: {e}") from None


_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    """text as a regex (Rust regex syntax, llguidance's) that matches exactly it."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _grammar_text(spec: StructuredOutputs) -> str:
    import llguidance as llg
    options = json_options(spec.whitespace_flexible)
    try:
        if spec.json is not None or spec.json_object:
            schema: Any = {"type": "object"} if spec.json_object else json.loads(spec.json)
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputError(f"a JSON schema must be an object, got {type(schema).__name__}")
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if spec.regex is not None:
            return llg.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            # one regex of the escaped choices: the lexer's automaton takes them all (as a Lark
            # alternation each choice was an Earley item, and llguidance stops a row at 2000 items:
            # 2000 choices ended every output after one token, as if complete)
            return llg.LLMatcher.grammar_from_regex("(?:" + "|".join(map(_regex_literal, spec.choice)) + ")")
        return llg.grammar_from("grammar", spec.grammar)   # Lark, or GBNF converted to Lark
    except StructuredOutputError:
        raise
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        raise StructuredOutputError(f"invalid {spec.kind}: {e}") from None


def token_bytes(tokenizer) -> tuple[list[bytes], list[int]]:
    """Every token's bytes and the ids of special tokens, for a sentencepiece tokenizer (jaxinfer's
    Tokenizer): '▁' is a space, <0xNN> byte-fallback pieces are that byte, control and unknown pieces
    are special (they never match grammar text)."""
    sp = tokenizer.backend
    special = [i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    return [tokenizer.token_bytes(i) for i in range(sp.get_piece_size())], special


class _SentencePieceWrapper:
    """What llguidance's TokenizerWrapper reads from a tokenizer: tokens (bytes per id), eos/bos ids,
    special ids, and __call__(text) -> ids spelling exactly those bytes.

    llguidance tokenizes the text a grammar forces (the rest of a choice, a JSON key) with __call__.
    SentencePiece's own encode cannot serve: it prepends its dummy-prefix space ("ight" -> "▁", "i",
    "ght"), so a forced continuation would start with a space the grammar then rejects. Instead: the
    longest token spelling the next bytes, repeatedly (byte-fallback pieces cover any byte); forced
    tokens need not be the canonical tokenization, only spell the forced bytes."""

    def __init__(self, tokenizer, eos_id: int):
        self.tokens, self.special_token_ids = token_bytes(tokenizer)
        self.eos_token_id, self.bos_token_id = eos_id, tokenizer.bos_id
        special = set(self.special_token_ids)
        self._by_bytes: dict[bytes, int] = {}
        # a piece beats the byte-fallback token with the same bytes (SentencePiece's own choice)
        for i in sorted(range(len(self.tokens)), key=lambda i: not tokenizer.backend.is_byte(i)):
            if i not in special and self.tokens[i]:
                self._by_bytes[self.tokens[i]] = i
        self._longest = max(map(len, self._by_bytes), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else bytes(text)
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                t = self._by_bytes.get(data[i:i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:   # no token spells this byte (no byte fallback): a grammar cannot force it either
                i += 1
        return out


def _and_static(words: np.ndarray, static: np.ndarray | None) -> None:
    """words &= static (Guide.static) in place, unless that allows no token."""
    if static is not None:
        n = min(len(words), len(static))
        both = words[:n] & static[:n]
        if both.any():
            words[:n] = both
            words[n:] = 0


class Guide:
    """One sample's grammar matcher, fed the sample's tokens as they are drawn; a JSON output's also
    has the number bound's matcher (`bound`, None otherwise or once the schema needed more digits).
    static: the request's own packed token mask (allowed_token_ids, one-token bad_words) that every
    grammar mask is ANDed with, unless that leaves no token (the grammar's mask alone then: it may
    need a token the request bans to finish)."""

    def __init__(self, matcher, bound=None, static: np.ndarray | None = None):
        self.matcher = matcher
        self.bound = bound
        self.static = static
        self.done: list[bool] = []   # per output token consumed: did it end the output

    @property
    def consumed(self) -> int:
        return len(self.done)

    def consume(self, token: int) -> bool:
        """Advance past a drawn token; True when the output is complete (the grammar accepts and
        admits nothing more) or the matcher failed (logged): either way the sample is over."""
        m = self.matcher
        if not m.consume_token(token) or m.is_error():   # (its first line: the rest dumps the grammar)
            log.warning("structured output: token %d rejected by the grammar (%s)", token,
                        (m.get_error() or "").splitlines()[0][:300] if m.get_error() else "")
            self.done.append(True)
        else:
            self.done.append(m.is_stopped())
        b = self.bound
        if b is not None and (not b.consume_token(token) or b.is_error()):
            # drawn under the grammar's mask alone (Grammars.fill found no token both allow)
            log.warning("structured output: the schema needs a number longer than the digit bounds; "
                        "this output's numbers are no longer bounded")
            self.bound = None
        return self.done[-1]

    def at(self, index: int, token: int) -> bool:
        """consume() for output token `index`, unless it was consumed already (the engine feeds a
        step's tokens to the matchers early, to fill the next masks): its recorded answer then."""
        if index < len(self.done):
            return self.done[index]
        assert index == len(self.done), (index, len(self.done))
        return self.consume(token)

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens: its forced bytes,
        e.g. a JSON object's next key, spelled by the tokenizer); [] when the next token is free."""
        return self.matcher.compute_ff_tokens()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar (and the number bound) accept from the current
        state (the state is unchanged)."""
        if not tokens:
            return 0
        n = self.matcher.validate_tokens(list(tokens))
        if self.bound is not None and n:
            n = self.bound.validate_tokens(list(tokens[:n]))
        return n


class Grammars:
    """Per engine: the llguidance tokenizer (built on first use: ~1 s for a 100k vocabulary), a
    cache of compiled grammars, and the thread pool that fills masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._lltok = None
        self._executor = None
        self._cache: OrderedDict[StructuredOutputs, Grammar] = OrderedDict()
        self._number_bound: dict[str | None, str] = {}   # number_bound_regex (after a prefix) for llguidance
        self._lock = threading.Lock()

    @property
    def lltokenizer(self):
        if self._lltok is None:
            import llguidance as llg
            tok = self._tokenizer
            if tok is None:
                raise StructuredOutputError("structured outputs need the model's tokenizer; this engine has none")
            eos = self.eos_ids or ([tok.eos_ids[0]] if tok.eos_ids else [])
            if tok.kind == "sentencepiece":
                self._lltok = llg.LLTokenizer(llg.TokenizerWrapper(_SentencePieceWrapper(tok, eos[0])),
                                              n_vocab=self.vocab_size, eos_token=eos)
            else:   # a HF `tokenizers` Tokenizer: llguidance reads its JSON (byte-level BPE and all)
                self._lltok = llg.LLTokenizer(tok.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
            self._executor = llg.LLExecutor()
        return self._lltok

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """The spec's grammar, checked against this tokenizer (cached); StructuredOutputError if not.
        Thread-safe: a server compiles on its worker threads before the request reaches the engine."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        grammar = on_grammar_stack(self._build, spec)
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > GRAMMAR_CACHE:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, spec: StructuredOutputs) -> Grammar:
        import llguidance as llg
        size = len(spec.json or "") + len(spec.regex or "") + len(spec.grammar or "") + sum(map(len, spec.choice or ()))
        if size > MAX_GRAMMAR_CHARS:
            raise StructuredOutputError(f"the {spec.kind} is too large ({size} characters; at most {MAX_GRAMMAR_CHARS})")
        text = grammar_text(spec)
        if len(text) > 4 * MAX_GRAMMAR_CHARS:
            raise StructuredOutputError(f"the {spec.kind}'s grammar is too large ({len(text)} characters)")
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, self.lltokenizer)
        if is_error:
            raise StructuredOutputError(f"invalid {spec.kind}: {messages[0] if messages else 'does not compile'}")
        m = llg.LLMatcher(self.lltokenizer, text, log_level=0)
        if not m.is_error():
            m.compute_bitmask()   # the first mask: where the parser's limits fail (a row of 2000+ choices)
        if m.is_error():
            raise StructuredOutputError(f"the {spec.kind} is beyond what the grammar engine can run: "
                                        f"{m.get_error().splitlines()[0][:300]}")
        m.reset()
        return Grammar(text, json=spec.json is not None or spec.json_object, prefix=spec.prefix, matcher=m)

    def guide(self, grammar: Grammar) -> Guide:
        import llguidance as llg
        m = grammar.matcher.deep_copy()
        if not grammar.json:
            return Guide(m)
        bound = self._number_bound.get(grammar.prefix)
        if bound is None:
            bound = with_prefix(grammar.prefix, llg.LLMatcher.grammar_from_regex(number_bound_regex()))
            self._number_bound[grammar.prefix] = bound
        return Guide(m, llg.LLMatcher(self.lltokenizer, bound, log_level=0))

    def fill(self, guides: list[tuple[Guide, int]], mask: np.ndarray) -> None:
        """mask[row] = the next-token mask of each (guide, row), computed in parallel (llguidance's
        thread pool, outside the GIL): the grammar's, AND the number bound's where the guide has one
        and the two share a token. Rows not listed are left as they are."""
        import llguidance.numpy as lln
        words = mask_words(self.lltokenizer.vocab_size)
        bounded = [(i, g.bound) for i, (g, _) in enumerate(guides) if g.bound is not None]
        n = len(guides)
        tmp = np.full((n + len(bounded), words), -1, np.int32)
        lln.fill_next_token_bitmask_par(
            self._executor, [(g.matcher, i) for i, (g, _) in enumerate(guides)] +
            [(b, n + j) for j, (_, b) in enumerate(bounded)], tmp)
        for j, (i, _) in enumerate(bounded):
            both = tmp[i] & tmp[n + j]
            if both.any():   # else the schema needs more digits: its mask alone (Guide.consume drops the bound)
                tmp[i] = both
        for i, (g, _) in enumerate(guides):
            _and_static(tmp[i], g.static)
        # the model's vocabulary may differ from the tokenizer's (padded embeddings): ids past the
        # tokenizer's are never allowed
        rows = [row for _, row in guides]
        w = min(words, mask.shape[1])
        mask[rows] = 0
        mask[rows, :w] = tmp[:n, :w]

    def fill_paths(self, jobs: list[tuple[Guide, int, list[list[int]]]], table: np.ndarray) -> None:
        """Speculation under a grammar: for each (guide, slot, paths), table[slot, n] = the guide's
        next-token mask (as fill makes it) after consuming paths[n] (the proposals from the row's last
        token to node n + 1); the matchers are rolled back after each, so their state is as it was. A
        path the grammar rejects part of leaves -1 (all allowed): its node has
        probability 0 under the mask of the node before the rejected token, so it is never accepted
        and its own mask never read. A path only the number bound rejects gets the grammar's mask
        alone (as fill does where the two share no token). table [C, N, W] int32."""
        import llguidance.numpy as lln
        words = mask_words(self.lltokenizer.vocab_size)
        w = min(words, table.shape[2])
        tmp = np.empty((2, words), np.int32)
        for guide, slot, paths in jobs:
            m, b = guide.matcher, guide.bound
            for n, path in enumerate(paths):
                table[slot, n] = -1
                taken = m.try_consume_tokens(list(path))
                bound_taken = b.try_consume_tokens(list(path)) if b is not None else 0
                if taken == len(path) and not m.is_error():
                    lln.fill_next_token_bitmask(m, tmp, 0)
                    if b is not None and bound_taken == len(path):
                        lln.fill_next_token_bitmask(b, tmp, 1)
                        both = tmp[0] & tmp[1]
                        if both.any():
                            tmp[0] = both
                    _and_static(tmp[0], guide.static)
                    table[slot, n] = 0
                    table[slot, n, :w] = tmp[0, :w]
                if taken:
                    m.rollback(taken)
                if bound_taken:
                    b.rollback(bound_taken)
