"""One request's decoding knobs: SamplingParams and its structured-output constraint
(StructuredOutputs), validated here once; every front door maps its field names onto them.
Never imports jax.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# Stop strings: at most this many per request, each at most this many characters. The engine looks
# for them in each step's new text plus the last MAX_STOP_LENGTH - 1 characters, so a step's stop
# check costs O(MAX_STOP_STRINGS * (new text + MAX_STOP_LENGTH)), never the output length.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 512
# logit_bias: at most this many token ids per request (OpenAI's limit), each biased within +-100.
MAX_LOGIT_BIAS = 300
# top-N per prompt token at most (the step computes this many for every prompt position asked for;
# sampling.MAX_LOGPROBS, vLLM's default max_logprobs)
MAX_PROMPT_LOGPROBS = 20
# vLLM's floor for a positive temperature: logits / T overflow float32 (logprobs of +-inf) below it,
# so 0 < T < MIN_TEMPERATURE runs at MIN_TEMPERATURE (all but greedy; T = 0 is greedy)
MIN_TEMPERATURE = 0.01
# min_tokens bans a row's stop ids (EOS and stop_token_ids) on device until it has drawn min_tokens:
# at most this many ids (sampling.SamplingBatch.stop_ban)
MAX_MIN_TOKENS_STOP_IDS = 16
# bad_words of more than one token are matched on device against the row's last tokens: at most this
# many token sequences (a word gives one or two: with and without a leading space) of at most this
# many tokens each; one-token words join the row's static token mask and are not counted
MAX_BAD_WORD_SEQUENCES = 16
MAX_BAD_WORD_TOKENS = 8


class SamplingParamsError(ValueError):
    """Invalid SamplingParams; `fields` names the offending fields in order, so every front door
    can name its own field (the server's 400 `param`)."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__("; ".join(msg for _, msg in problems))
        self.fields = tuple(f for f, _ in problems)


@dataclass(frozen=True, kw_only=True)
class StructuredOutputs:
    """Constrain a request's output to a language (vLLM's StructuredOutputsParams; exactly one of):
      json: a JSON schema (dict or its JSON text); json_object: any JSON object;
      regex: a regular expression the whole output matches; choice: one of these strings;
      grammar: a context-free grammar, Lark syntax (llguidance's) or GBNF (llama.cpp's, with `::=`).
    Compiled and checked against the tokenizer when the request is added (host/structured.py, with
    llguidance); a grammar that does not compile is refused naming the problem.
    whitespace_flexible (JSON only): allow any whitespace between tokens; off by default, so JSON comes
    out compact (`,` and `:` separators, no spaces) and a model cannot stall in endless whitespace."""
    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False
    # a Lark grammar (llguidance's) for what precedes the constrained text, referring to it as
    # `@answer`: a thinking model's reasoning section (serve.reasoning), so that the constraint applies
    # to the answer after it and never inside it. None: the whole output is constrained.
    prefix: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, dict):   # stored as text: the params stay hashable
            object.__setattr__(self, "json", json.dumps(self.json))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise SamplingParamsError([("structured_outputs", "structured outputs take exactly one of json, "
                                        f"json_object, regex, choice or grammar, got {given or 'none'}")])
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise SamplingParamsError([("structured_outputs", "choice must be a non-empty list of non-empty strings")])
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise SamplingParamsError([("structured_outputs", f"{k} must be a non-empty string")])
        if self.json is not None and not isinstance(self.json, str):
            raise SamplingParamsError([("structured_outputs", "json must be a JSON schema object")])
        if self.prefix is not None and (not isinstance(self.prefix, str) or "@answer" not in self.prefix):
            raise SamplingParamsError([("structured_outputs", "prefix must be a Lark grammar that uses @answer")])

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None) \
            if not self.json_object else "json_object"


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request decodes. temperature 0 means greedy; a positive one below MIN_TEMPERATURE
    runs at MIN_TEMPERATURE (vLLM's rule)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0                      # 0 (or -1, vLLM's): off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None         # top-N logprobs per generated token
    # every prompt token's logprob (the first has none) and its top-N, from the prefill step itself
    # (vLLM's prompt_logprobs; such a request does not start from the prefix cache: jaxinfer/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    n: int = 1
    # token id -> bias added to its logit on device, before everything else but the structured-output
    # mask (OpenAI's logit_bias: -100 bans a token, +100 all but forces it); stored as sorted pairs
    logit_bias: Any = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's name: False keeps special tokens in the text (a tool-call or reasoning parser that reads
    # them, e.g. Mistral's [TOOL_CALLS] or gpt-oss's harmony markers); the end-of-sequence or stop
    # token that ends the output is never text
    skip_special_tokens: bool = True
    # vLLM's: a stop string that ends the output stays in its text (it is cut after the string)
    include_stop_str_in_output: bool = False
    # vLLM's: no EOS or stop_token_ids (banned on device) and no stop string before this many tokens
    min_tokens: int = 0
    # vLLM's: the only tokens the output may hold (a static mask on device)
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: strings the output must not contain as token sequences, each tokenized with and without
    # a leading space; the last token of a sequence is banned where the output ends with the rest of it
    bad_words: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the params stay hashable and immutable.
        # None (vLLM's default for both) is none
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        problems: list[tuple[str, str]] = []   # (field, message)
        problems += self._token_ban_problems()
        if any(not 0 <= t < 2**31 for t in self.stop_token_ids):
            problems.append(("stop_token_ids", "stop_token_ids must be token ids (integers >= 0), got "
                                               f"{[t for t in self.stop_token_ids if not 0 <= t < 2**31][:3]}"))
        if self.logit_bias is not None:
            bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
            try:   # one entry per token, the last one given (a dict's rule: {5: 1, "05": 2} is {5: 2})
                pairs = tuple(sorted({int(k): float(v) for k, v in bias}.items()))
            except (TypeError, ValueError):
                pairs = None
                problems.append(("logit_bias", "logit_bias must map token ids (integers) to numbers"))
            if pairs is not None:
                object.__setattr__(self, "logit_bias", pairs or None)
                if len(pairs) > MAX_LOGIT_BIAS:
                    problems.append(("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, "
                                                   f"got {len(pairs)}"))
                elif any(not -100.0 <= v <= 100.0 for _, v in pairs):
                    problems.append(("logit_bias", "logit_bias values must be in [-100, 100], got "
                                                   f"{[v for _, v in pairs if not -100.0 <= v <= 100.0][:3]}"))
                elif any(k < 0 for k, _ in pairs):
                    problems.append(("logit_bias", f"logit_bias token ids must be >= 0, got "
                                                   f"{[k for k, _ in pairs if k < 0][:3]}"))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            problems.append(("structured_outputs", "structured_outputs must be a StructuredOutputs"))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"))
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            problems.append(("temperature", f"temperature must be >= 0, got {self.temperature!r}"))
        elif 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if not isinstance(self.top_k, int) or self.top_k < -1:
            problems.append(("top_k", f"top_k must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}"))
        elif self.top_k == -1:   # vLLM's "off", which its clients send
            object.__setattr__(self, "top_k", 0)
        if not 0.0 < self.top_p <= 1.0:
            problems.append(("top_p", f"top_p must be in (0, 1], got {self.top_p!r}"))
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(("min_p", f"min_p must be in [0, 1], got {self.min_p!r}"))
        if not 0.01 <= self.repetition_penalty <= 100:
            problems.append(("repetition_penalty",
                             f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty!r}"))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                problems.append((name, f"{name} must be in [-2, 2], got {getattr(self, name)!r}"))
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            problems.append(("seed", f"seed must be an integer in [0, 2**63), got {self.seed!r}"))
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            problems.append(("logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs!r}"))
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int)
                                                     and 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS):
            problems.append(("prompt_logprobs", f"prompt_logprobs must be an integer in [0, {MAX_PROMPT_LOGPROBS}] "
                                                f"(the server's limit), got {self.prompt_logprobs!r}"))
        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            problems.append(("n", f"n must be an integer in [1, 128], got {self.n!r}"))
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(("stop", f"stop must be non-empty strings, got {self.stop!r}"))
        elif len(self.stop) > MAX_STOP_STRINGS:
            problems.append(("stop", f"stop must be at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"))
        elif any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            problems.append(("stop", f"stop strings must be at most {MAX_STOP_LENGTH} characters each, got one of "
                                     f"{max(map(len, self.stop))}"))
        if problems:
            raise SamplingParamsError(problems)

    def _token_ban_problems(self) -> list[tuple[str, str]]:
        """vLLM's bounds on min_tokens, allowed_token_ids and bad_words (allowed_token_ids stored as
        a tuple of ints)."""
        problems = []
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            problems.append(("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"))
        elif isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            problems.append(("min_tokens", f"min_tokens must be at most max_tokens={self.max_tokens}, "
                                           f"got {self.min_tokens}"))
        if self.allowed_token_ids is not None:
            try:
                object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
            except (TypeError, ValueError):
                return problems + [("allowed_token_ids", "allowed_token_ids must be a list of token ids")]
            if not self.allowed_token_ids:
                problems.append(("allowed_token_ids", "allowed_token_ids must not be empty"))
            elif any(not 0 <= t < 2**31 for t in self.allowed_token_ids):
                problems.append(("allowed_token_ids", "allowed_token_ids must be token ids (integers >= 0), got "
                                                      f"{[t for t in self.allowed_token_ids if not 0 <= t < 2**31][:3]}"))
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            problems.append(("bad_words", f"bad_words must be non-empty strings, got {list(self.bad_words)[:3]!r}"))
        return problems

    @property
    def uses_history(self) -> bool:
        """The penalties read the request's token history (so do multi-token bad words:
        Request.bad_word_ids, known once tokenized)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def min_tokens_stop_ids(self, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The ids min_tokens bans: the model's EOS ids (under ignore_eos too, as vLLM does) and
        stop_token_ids, each once."""
        return tuple(dict.fromkeys((*eos_ids, *self.stop_token_ids)))

    @property
    def constrained(self) -> bool:
        """A grammar masks each draw: the next mask needs the previous token on the host."""
        return self.structured_outputs is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
