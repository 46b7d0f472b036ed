"""A submission's deltas -> the HTTP response: server-sent events as they arrive, or one JSON body once
every choice has finished.

One helper, `stream_response`, writes every SSE event of both streaming routes and the ending: the
usage chunk when asked for, then `data: [DONE]`; an engine that dies mid-stream ends the stream with
the error event, then `data: [DONE]`. What differs between the routes is only how one delta becomes
choice chunks (`CompletionChoices`, `ChatChoices`), so the endings cannot drift apart. Whatever the
way out (done, engine dead, client gone), the submission is released: its requests are aborted unless
they finished. Everything goes through serve.bridge.AsyncEngine; nothing here touches the engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from jaxinfer.client import RequestOutput
from serve.bridge import AsyncEngine, EngineDeadError, Submission
from serve.guard import error_bytes
from serve.protocol import OpenAIError, chat_logprobs, completion_logprobs, usage
from serve.reasoning import OutputParsers, in_reasoning
from serve.tools import ToolPlan, ToolStream

DISCONNECT_POLL_S = 0.2
SSE_DONE = "data: [DONE]\n\n"


async def next_delta(sub: Submission) -> RequestOutput:
    d = await sub.queue.get()
    if isinstance(d, EngineDeadError):
        raise d
    return d


async def collect(sub: Submission) -> list[list[RequestOutput]]:
    """Every delta of every sample, grouped per (prompt, sample)."""
    per = {rid: [[] for _ in range(sub.n)] for rid in sub.request_ids}
    remaining = len(sub.request_ids) * sub.n
    while remaining:
        d = await next_delta(sub)
        per[d.request_id][d.sample_index].append(d)
        remaining -= d.finished
    return [samples for rid in sub.request_ids for samples in per[rid]]


async def respond(engine: AsyncEngine, sub: Submission, request: Request,
                  build: Callable[[list[list[RequestOutput]]], dict]) -> dict | Response:
    """Wait for every choice, release the submission, and build the response body from the deltas.
    A client that hangs up first gets its request aborted (its KV blocks freed) within a poll."""
    collecting = asyncio.ensure_future(collect(sub))
    finished = False
    try:
        while not collecting.done():
            await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_S)
            if not collecting.done() and await request.is_disconnected():
                return Response(status_code=499)   # nobody reads it; nginx's "client closed request"
        groups, finished = collecting.result(), True
    finally:
        if not collecting.done():
            collecting.cancel()
        engine.release(sub, finished=finished)
    return build(groups)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_error(e: OpenAIError) -> str:
    return f"data: {error_bytes(e).decode()}\n\n"


def stream_response(engine: AsyncEngine, sub: Submission, base: dict, prompt_lens: Sequence[int],
                    stream_options, choices: Callable[[RequestOutput], list[dict]], head: Sequence[dict] = (),
                    count_output: bool = True, prompt_ids: Sequence[list[int]] | None = None) -> StreamingResponse:
    """The SSE response of a streaming route: each choice in `head` first, then each delta's choices
    (a delta with no text, no tokens and no end sends nothing), each as {**base, "choices": [one]};
    base is the chunk's id, object, created and model; prompt_lens: the tokens of each prompt of
    sub. stream_options (protocol.StreamOptions or None): include_usage ends the stream with a
    usage chunk; with continuous_usage_stats too, every chunk carries its choice's usage so far
    (vLLM's extension: its prompt's tokens and the tokens that choice has produced). count_output
    False: no completion tokens are counted (echo with max_tokens 0: the one token the engine draws
    is never returned). prompt_ids (vLLM's return_token_ids): each prompt's ids, sent with the first
    chunk (chat: at the top level; completions: on each choice's first chunk), and each delta's token
    ids on its first chunk (an empty chunk carries them where the delta's text is held back)."""
    include = bool(stream_options and stream_options.include_usage)
    continuous = include and bool(stream_options.continuous_usage_stats)
    return StreamingResponse(_events(engine, sub, base, prompt_lens, include, continuous, choices, head, count_output,
                                     prompt_ids), media_type="text/event-stream")


def _with_ids(out: list[dict], d: RequestOutput, index: int, chat: bool, prompt: list[int] | None) -> list[dict]:
    """A delta's chunks with its token ids on the first (an empty chunk where it has none to show)."""
    if not out and d.token_ids:
        out = [{"index": index, **({"delta": {}} if chat else {"text": ""}), "logprobs": None, "finish_reason": None}]
    for j, c in enumerate(out):
        c["token_ids"] = list(d.token_ids) if j == 0 else []
        if prompt is not None and j == 0:
            c["prompt_token_ids"] = prompt
    return out


async def _events(engine: AsyncEngine, sub: Submission, base: dict, prompt_lens: Sequence[int], include_usage: bool,
                  continuous: bool, choices: Callable[[RequestOutput], list[dict]], head: Sequence[dict],
                  count_output: bool, prompt_ids: Sequence[list[int]] | None = None) -> AsyncIterator[str]:
    # finished: every sample ended, so releasing must not abort (a client gone during the usage
    # chunk or [DONE] leaves nothing running)
    finished, n_out, cached = False, 0, {}
    produced: dict[tuple[str, int], int] = {}     # (request, sample) -> completion tokens so far
    prompt_len = dict(zip(sub.request_ids, prompt_lens))

    chat = base["object"] == "chat.completion.chunk"
    started: set[int] = set()        # completion choices whose prompt_token_ids went out
    top = [prompt_ids is not None and chat]    # chat: the prompt's ids still to go, on the first chunk

    def chunk(choice: dict, prompt: int, completion: int) -> str:
        body = {**base, "choices": [choice]}
        if top[0]:
            top[0], body["prompt_token_ids"] = False, prompt_ids[0]
        if continuous:
            body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
        return sse(body)
    try:
        for choice in head:
            yield chunk(choice, prompt_lens[0], 0)
        remaining = len(sub.request_ids) * sub.n
        while remaining:
            d = await next_delta(sub)
            remaining -= d.finished
            new = len(d.token_ids) if count_output else 0
            n_out += new
            key = (d.request_id, d.sample_index)
            produced[key] = produced.get(key, 0) + new
            # once per prompt: its first sample's (the others fork its blocks, protocol.cached_tokens)
            cached[d.request_id] = min(cached.get(d.request_id, d.num_cached_tokens), d.num_cached_tokens)
            if not (d.text or d.token_ids or d.finished):
                continue
            out = choices(d)
            if prompt_ids is not None:
                if not count_output:          # (echo with max_tokens 0: its one drawn token is no output)
                    d = dataclasses.replace(d, token_ids=[])
                i = sub.request_ids.index(d.request_id)
                index = i * sub.n + d.sample_index
                first = not chat and index not in started
                started.add(index)
                out = _with_ids(out, d, index, chat, prompt_ids[i] if first else None)
            for choice in out:
                yield chunk(choice, prompt_len[d.request_id], produced[key])
        finished = True
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(sum(prompt_lens), n_out, sum(cached.values()),
                                                               getattr(choices, "reasoning_tokens", None))})
        yield SSE_DONE
    except EngineDeadError as e:   # the stream ends with the error, then [DONE]
        yield sse_error(e)
        yield SSE_DONE
    finally:
        engine.release(sub, finished)


class CompletionChoices:
    """Streamed /v1/completions: one delta -> its choice. Choices are numbered prompt-major (prompt i's
    sample j is i * n + j), and logprobs' text_offset keeps counting across a choice's chunks."""

    def __init__(self, sub: Submission, token_str: Callable[[int], str], logprobs: bool, echo=None):
        self.sub, self.token_str, self.logprobs = sub, token_str, logprobs
        self.offsets: dict[int, int] = {}   # choice index -> characters sent so far
        self.echo = echo                     # serve.echo.Echo: the prompt in front of each choice
        self.started: set[int] = set()

    def __call__(self, d: RequestOutput) -> list[dict]:
        index = self.sub.request_ids.index(d.request_id) * self.sub.n + d.sample_index
        lp = None
        if self.logprobs:
            lp = completion_logprobs([d], self.token_str)
            lp["text_offset"] = [o + self.offsets.get(index, 0) for o in lp["text_offset"]]
        self.offsets[index] = self.offsets.get(index, 0) + len(d.text)
        chunk = {"index": index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason if d.finished else None}
        if d.finished:          # vLLM's: the stop string or stop token id that ended it
            chunk["stop_reason"] = d.stop_reason
        if self.echo is not None and (self.echo.echo or self.echo.prompt_logprobs):
            chunk = self.echo.stream_choice(chunk, d, self.started, self.token_str, self.logprobs, self.sub.n)
        return [] if chunk is None else [chunk]


class ChatChoices:
    """Streamed /v1/chat/completions: the opening role chunk of each sample (`head`, then with vLLM's
    chat echo the text it echoes), then one delta ->
    its choice chunks. With a reasoning parser, each sample's text is split first (reasoning_content
    deltas apart from content); under a tool plan that parses, the answer goes through a ToolStream
    in the family's format. reasoning_tokens: the usage chunk's count (None without a parser)."""

    def __init__(self, n: int, plan: ToolPlan | None, token_str: Callable[[int], str], logprobs: bool,
                 parsers: OutputParsers | None = None, token_bytes: Callable[[int], list[int]] | None = None,
                 role: str = "assistant", echo: str = ""):
        self.token_str, self.logprobs, self.token_bytes = token_str, logprobs, token_bytes
        parsers = parsers or OutputParsers()
        self.tools = [ToolStream(plan, parsers.tools) if plan is not None and plan.parses else None for _ in range(n)]
        self.reasoners = [parsers.reasoning_parser() for _ in range(n)]
        self._reasoning_counts = [0] * n
        self.answer_logprobs: list[dict] = []
        first = {"role": role, "content": None if plan is not None and plan.constrained else ""}
        self.head = [{"index": i, "delta": first, "logprobs": None, "finish_reason": None} for i in range(n)]
        if echo:   # vLLM's chat echo: the last message's content, one chunk per choice after the roles
            self.head += [{"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}
                          for i in range(n)]

    def _tail_tokens(self, ids: list[int], n_chars: int) -> int:
        """How many of a delta's last tokens write its last n_chars characters (a delta of several
        tokens, as speculative decoding makes, can end the reasoning and begin the answer)."""
        k = used = 0
        for t in reversed(ids if n_chars else []):
            used += len(self.token_str(t))
            if used > n_chars:
                break
            k += 1
        return k

    @property
    def reasoning_tokens(self) -> int | None:
        """As serve.reasoning.reasoning_tokens counts them, summed over the samples."""
        if self.reasoners[0] is None:
            return None
        return sum(c for c, rp in zip(self._reasoning_counts, self.reasoners) if rp.saw_reasoning)

    def __call__(self, d: RequestOutput) -> list[dict]:
        lp = chat_logprobs([d], self.token_str, self.token_bytes) if self.logprobs else None
        ts, rp = self.tools[d.sample_index], self.reasoners[d.sample_index]
        text, head, answer = d.text, [], len(d.token_ids)
        if rp is not None:
            before = in_reasoning(rp)
            reasoning, text = rp.feed(d.text)
            if d.finished:
                r2, c2 = rp.finish()
                reasoning, text = reasoning + r2, text + c2
            if before or in_reasoning(rp):     # (usage's count: serve.reasoning.reasoning_tokens' rule)
                self._reasoning_counts[d.sample_index] += len(d.token_ids)
            if in_reasoning(rp):
                answer = 0
            elif before:       # the reasoning ended in this delta: the answer is its last tokens
                answer = self._tail_tokens(d.token_ids, len(text))
            if reasoning:
                head = [{"reasoning_content": reasoning}]
        # this delta's tokens that are the answer's (content or calls), not reasoning (Responses'
        # output_text logprobs)
        self.answer_logprobs = lp["content"][len(d.token_ids) - answer:] if lp is not None else []
        deltas = [{"content": text} if text else {}] if ts is None else ts.feed(text, d.finished, d.finish_reason)
        if head:
            deltas = head + [x for x in deltas if x]
            deltas = deltas or [{}]
        finish = (ts.finish_reason(d.finish_reason) if ts else d.finish_reason) if d.finished else None
        out = []
        for j, delta in enumerate(deltas):
            last = j == len(deltas) - 1
            # an empty delta only where it carries something (plain streams keep one per step)
            if not delta and not (last and (ts is None or d.finished or lp is not None)):
                continue
            out.append({"index": d.sample_index, "delta": delta, "logprobs": lp if j == 0 else None,
                        "finish_reason": finish if last else None})
            if last and finish is not None:      # vLLM's: the stop string or stop token id that ended it
                out[-1]["stop_reason"] = d.stop_reason
        return out
