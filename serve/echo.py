"""Completions' `echo` and the prompt logprobs of both endpoints, in the shapes clients parse.

- OpenAI's legacy completions with `echo: true`: the choice's text is the prompt followed by the
  completion; with `logprobs: k` its logprobs cover the prompt's tokens first (`token_logprobs` null
  for the first token, `top_logprobs` null there too), then the generated ones, `text_offset`
  counting through both (as vLLM: offsets from each token's text). `max_tokens: 0` with echo is the
  prompt alone (lm-evaluation-harness' loglikelihood requests): the engine draws one token that is
  not returned, as vLLM does.
- vLLM's `prompt_logprobs` extension: a list with null for the first prompt token, then per token
  {"<token id>": {"logprob", "rank", "decoded_token"}} holding the prompt token and the top-k; on
  each completions choice, and at the top level of a chat completion (vLLM's places).

The values come from the engine (SamplingParams.prompt_logprobs, jaxinfer/prompt_logprobs.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

TokenStr = Callable[[int], str]


def _lp(v: float) -> float:
    """JSON has no infinities: OpenAI reports an impossible token's logprob as -9999.0."""
    return v if math.isfinite(v) else -9999.0


def first_prompt_logprobs(deltas: list) -> list | None:
    """A choice's prompt logprobs (they ride on its first delta that has tokens)."""
    return next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)


def vllm_prompt_logprobs(entries: list, prompt_ids: list[int], token_str: TokenStr) -> list:
    """vLLM's prompt_logprobs JSON: None, then {token id: {logprob, rank, decoded_token}} per token,
    the prompt token first, then the top-k (ranked 1..k) not already in it."""
    out: list = [None]
    for tok, entry in zip(prompt_ids[1:], entries[1:]):
        lp, rank, top = entry
        d = {str(tok): {"logprob": _lp(lp), "rank": rank, "decoded_token": token_str(tok)}}
        for r, (t, v) in enumerate(top, 1):
            d.setdefault(str(t), {"logprob": _lp(v), "rank": r, "decoded_token": token_str(t)})
        out.append(d)
    return out


def echo_logprobs(entries: list | None, prompt_ids: list[int], token_str: TokenStr) -> dict:
    """The prompt's part of a legacy logprobs object: tokens, token_logprobs (null first),
    top_logprobs (null first; then the top-k and the prompt token itself, as vLLM), text_offset."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for i, tok in enumerate(prompt_ids):
        s = token_str(tok)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if i == 0 or entries is None:
            lps.append(None)
            tops.append(None)
            continue
        lp, _, top = entries[i]
        top_d = {token_str(t): _lp(v) for t, v in top}
        top_d.setdefault(s, _lp(lp))
        lps.append(_lp(lp))
        tops.append(top_d)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(head: dict, tail: dict | None, tail_offset: int) -> dict:
    """head's lists followed by tail's, tail's text offsets moved past the prompt."""
    if tail is None:
        return head
    return {"tokens": head["tokens"] + tail["tokens"],
            "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
            "top_logprobs": head["top_logprobs"] + tail["top_logprobs"],
            "text_offset": head["text_offset"] + [o + tail_offset for o in tail["text_offset"]]}


@dataclass
class Echo:
    """What a completions request asked of its prompts: echo them (their text and ids, per prompt),
    echo_only (max_tokens 0: nothing generated is returned), vLLM's prompt_logprobs."""
    texts: list[str]
    prompt_ids: list[list[int]]
    echo: bool
    echo_only: bool
    prompt_logprobs: bool

    def prompt_of(self, choice: int, n: int) -> tuple[str, list[int]]:
        """(the prompt's text, echo only: else "", its token ids) of a choice."""
        i = choice // n
        return (self.texts[i] if self.echo else ""), self.prompt_ids[i]

    def apply(self, body: dict, groups: list[list], token_str: TokenStr, logprobs: bool, n: int) -> dict:
        """A non-streaming completions body with the prompts echoed / their logprobs added."""
        if not (self.echo or self.prompt_logprobs):
            return body
        for i, (choice, g) in enumerate(zip(body["choices"], groups)):
            text, ids = self.prompt_of(i, n)
            entries = first_prompt_logprobs(g)
            if self.prompt_logprobs:
                choice["prompt_logprobs"] = None if entries is None else vllm_prompt_logprobs(entries, ids, token_str)
            if not self.echo:
                continue
            gen_text = "" if self.echo_only else choice["text"]
            if logprobs:
                tail = None if self.echo_only else choice["logprobs"]
                prompt_part = echo_logprobs(entries, ids, token_str)
                choice["logprobs"] = join_logprobs(prompt_part, tail, sum(len(t) for t in prompt_part["tokens"]))
            choice["text"] = text + gen_text
        if self.echo_only:
            u = body["usage"]
            u["completion_tokens"], u["total_tokens"] = 0, u["prompt_tokens"]
        return body

    def stream_choice(self, chunk: dict, d, started: set, token_str: TokenStr, logprobs: bool, n: int) -> dict | None:
        """A streamed chunk of choice chunk["index"] with the prompt in front on its first chunk (and,
        echo_only, nothing generated); None: the chunk carries nothing to send."""
        i = chunk["index"]
        first = i not in started
        started.add(i)
        if self.echo_only:
            chunk["text"] = ""
            chunk["logprobs"] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} \
                if logprobs else None
        if first:
            text, ids = self.prompt_of(i, n)
            entries = d.prompt_logprobs
            if self.prompt_logprobs:
                chunk["prompt_logprobs"] = None if entries is None else vllm_prompt_logprobs(entries, ids, token_str)
            if self.echo:
                if logprobs:
                    head = echo_logprobs(entries, ids, token_str)
                    chunk["logprobs"] = join_logprobs(head, chunk["logprobs"], sum(len(t) for t in head["tokens"]))
                chunk["text"] = text + chunk["text"]
        elif self.echo and logprobs and chunk["logprobs"] is not None and self.offset.get(i):
            chunk["logprobs"]["text_offset"] = [o + self.offset[i] for o in chunk["logprobs"]["text_offset"]]
        if first and self.echo and logprobs:
            self.offset[i] = sum(len(token_str(t)) for t in self.prompt_of(i, n)[1])
        if self.echo_only and not chunk["finish_reason"] and not first:
            return None
        return chunk

    def __post_init__(self) -> None:
        self.offset: dict[int, int] = {}   # streaming: a choice's prompt characters (its text offsets start there)
