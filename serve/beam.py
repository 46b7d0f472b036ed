"""vLLM's `use_beam_search: true` on /v1/completions and /v1/chat/completions: `n` is the beam width,
`length_penalty` the final ranking's exponent, with `max_tokens`, `ignore_eos`,
`include_stop_str_in_output`, `logprobs` / `top_logprobs` and `skip_special_tokens` (vLLM's
BeamSearchParams; jaxinfer/host/beam_search.py says how the search runs). Each round is one ordinary
submission through the bridge (one one-token request per live beam of every prompt), so beams share
the engine's steps and prefix cache with other traffic, and a client gone between rounds stops the
search. The best hypotheses then become deltas, one per token as the engine's are, on a Submission
of their own, and the routes build their response from it as from any other (non-streaming, or
streamed once the search has ended; vLLM streams it as one chunk per choice). Every round is
admitted like any request: a full queue is a 429 at the round that meets it. Sampling fields the search would not honour (stop strings,
top-p, penalties, a grammar, ...) are 400s naming them, where vLLM drops them silently; temperature
is accepted and, as in vLLM v1 (raw logprobs), does not change the search.
"""
from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from jaxinfer.client import SubmitError, advance_all, beam_outputs
from jaxinfer.config import SamplingParams
from jaxinfer.config.sampling import SamplingParamsError
from jaxinfer.host.beam_search import BeamSearch, BeamSearchParams
from serve.bridge import Submission
from serve.protocol import OpenAIError, new_id
from serve.stream import respond

# SamplingParams fields the search does not honour, at their defaults (anything else is refused)
UNHONOURED = {name: getattr(SamplingParams(), name) for name in (
    "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
    "stop_token_ids", "logit_bias", "structured_outputs", "prompt_logprobs", "min_tokens", "allowed_token_ids",
    "bad_words")}


def beam_params(req, params: SamplingParams) -> BeamSearchParams:
    """The request's BeamSearchParams (n = beam width); a field the search would drop is a 400 naming it."""
    for name, default in UNHONOURED.items():
        if getattr(params, name) != default:
            field = req.request_field(name)
            what = "prompt logprobs (prompt_logprobs, or echo with logprobs)" if name == "prompt_logprobs" else field
            raise OpenAIError(400, f"{what} is not available with use_beam_search", param=field)
    try:
        return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                length_penalty=req.length_penalty, logprobs=params.logprobs,
                                include_stop_str_in_output=params.include_stop_str_in_output,
                                skip_special_tokens=params.skip_special_tokens)
    except SamplingParamsError as e:
        field = {"beam_width": "n"}.get(e.fields[0], e.fields[0])
        raise OpenAIError(400, str(e), param=req.request_field(field)) from None


async def beam_submission(state, request: Request, prompts: list[list[int]], params: SamplingParams, req,
                          lora: str | None) -> Submission | Response:
    """Run the search over every prompt; its best hypotheses as a finished Submission (request ids
    of its own, one per prompt), or the 499 Response of a client that left meanwhile."""
    bp = beam_params(req, params)
    if len(prompts) * bp.beam_width > state.engine.max_queue:   # what a plain request of n samples is told
        raise OpenAIError(400, f"this request has {len(prompts) * bp.beam_width} beams ({len(prompts)} prompt(s) x "
                               f"n={bp.beam_width}) but the server queues at most {state.engine.max_queue}; split it",
                          param="n")
    try:
        state.gen.client.check_beam_fits(prompts, bp)
    except SubmitError as e:
        raise OpenAIError(400, e.message, param=req.request_field(e.param), code=e.code) from None
    searches = [BeamSearch(p, bp, state.gen.client.eos_ids) for p in prompts]
    while live := [s for s in searches if not s.done]:
        sub = state.engine.submit([seq for s in live for seq in s.prompts()], bp.round_params(),
                                  cache_salt=req.cache_salt, request_field=req.request_field, priority=req.priority,
                                  lora=lora)
        groups = await respond(state.engine, sub, request, lambda g: g)
        if isinstance(groups, Response):
            return groups
        # each beam's one token: its delta's top logprobs, best first
        advance_all(live, [next(d.top_logprobs[0] for d in deltas if d.top_logprobs) for deltas in groups])
    queue: asyncio.Queue = asyncio.Queue()
    base = new_id("beam")
    rids = [f"{base}-{i}" for i in range(len(searches))]
    for rid, s in zip(rids, searches):
        for d in beam_outputs(s, rid, state.tokenizer):
            queue.put_nowait(d)
    return Submission(rids, queue, bp.beam_width)
