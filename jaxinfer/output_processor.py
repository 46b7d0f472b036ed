"""What a client sees of a request: incremental detokenization, stop strings and the per-token deltas.

The engine core schedules, runs and updates token ids; this module turns each sample's new ids
into text (the tokenizer's IncrementalDetokenizer), says when that text completes a stop string
(the scheduler asks through `stop_check` while it applies a step's tokens, so a stop string ends a
request at the token that completes it), and cuts the text a step made visible into one
RequestOutput per token (vLLM v1's output_processor.py and detokenizer.py). Text that may still
turn out to start a stop string is held back until it cannot.

Pure Python over the host's Requests: it never imports jax and never touches the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from jaxinfer.host.request import Request
from jaxinfer.prompt_logprobs import PromptEntry, prompt_logprob_list
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, hold_back

__all__ = ["OutputProcessor", "RequestOutput"]


@dataclass
class RequestOutput:
    """What one step added to one sample of a request (a streaming delta)."""
    request_id: str             # the request as the caller named it
    sample_index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when the request was admitted
    # SamplingParams.prompt_logprobs, on a sample's first delta: None for the first prompt token, then
    # (logprob, rank, [(token id, logprob)] top-N) per prompt token
    prompt_logprobs: list[PromptEntry | None] | None = None
    embedding: Any = None       # an embedding request's final delta: the pooled vector (np.float32 [D])
    # the final delta of a request a stop string or a stop_token_ids entry ended: that string or id
    # (vLLM's stop_reason; None for an EOS, max_tokens or an abort)
    stop_reason: str | int | None = None


@dataclass
class _TextState:
    detok: IncrementalDetokenizer | None
    stops: tuple[str, ...]
    text: str = ""              # all text decoded so far (after stop truncation)
    emitted: int = 0            # how much of text has been handed out
    marks: list[int] = field(default_factory=list)   # len(text) after each token of this step
    stopped: str | None = None  # the stop string that completed (text is cut before it)
    keep_stop: bool = False     # include_stop_str_in_output: the text is cut after it instead
    min_tokens: int = 0         # no stop string ends before the text of this many tokens (vLLM's rule:
    checked_from: int = 0       # one may start inside it): len(text) after the min_tokens-th token


class OutputProcessor:
    """Each live sample's text, keyed by the sample's request id ("rid", "rid#1", ...)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer   # None: token ids only, no text and no stop strings
        self._text: dict[str, _TextState] = {}
        self._groups: dict[str, list[str]] = {}   # request id -> ids of its n samples

    def add_request(self, request_id: str, sample_ids: list[str], prompt_ids: list[int],
                    stops: tuple[str, ...], skip_special_tokens: bool = True, keep_stop: bool = False,
                    min_tokens: int = 0) -> None:
        """Start the text of a request's samples (each detokenizes after the same prompt); keep_stop:
        SamplingParams.include_stop_str_in_output; min_tokens: SamplingParams.min_tokens."""
        self._groups[request_id] = list(sample_ids)
        for rid in sample_ids:
            detok = (IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens)
                     if self.tokenizer is not None else None)
            self._text[rid] = _TextState(detok, stops, keep_stop=keep_stop, min_tokens=min_tokens)

    def sample_ids(self, request_id: str) -> list[str]:
        """A live request's samples' ids ("rid", "rid#1", ...), in sample order."""
        return list(self._groups[request_id])

    def is_live(self, sample_id: str) -> bool:
        """Whether a sample ("rid", "rid#1", ...) of an unfinished request, forked yet or not, has this id."""
        return sample_id in self._text

    def pop_samples(self, request_id: str) -> list[str]:
        """Forget a request's sample group (an abort); returns its samples' ids, leader first."""
        return self._groups.pop(request_id, [])

    def begin_step(self, sample_ids: Iterable[str]) -> None:
        """A step's tokens are about to be applied: its per-token text marks start afresh."""
        for rid in sample_ids:
            st = self._text.get(rid)
            if st is not None:
                st.marks.clear()

    def stop_check(self, req: Request) -> bool:
        """Detokenize the request's newest token; True when that completes one of its stop strings
        (the text is cut where the stop string begins)."""
        st = self._text[req.request_id]
        if st.detok is None:
            return False
        checked = len(st.text)
        # (the scheduler asks only about tokens that did not end the request: a stop token id or an
        # EOS that ends it is never text, while an EOS under ignore_eos is, as in vLLM)
        token = req.output_ids[-1]
        st.text += st.detok.add(token)
        st.marks.append(len(st.text))
        if not st.stops:
            return False
        if len(req.output_ids) <= st.min_tokens:
            st.checked_from = len(st.text)
            return False
        cut = find_stop(st.text, st.stops, max(checked, st.emitted, st.checked_from))
        if cut is None:
            return False
        st.stopped = _stop_at(st.text, cut, st.stops)
        st.text = st.text[:cut + (len(st.stopped) if st.keep_stop else 0)]
        return True

    def delta(self, req: Request, new_tokens: int) -> RequestOutput:
        """The request's last delta of this step (abort: no tokens, finished)."""
        return self.deltas(req, new_tokens)[-1]

    def deltas(self, req: Request, new_tokens: int) -> list[RequestOutput]:
        """One RequestOutput per new token (at least one): its text is what became visible with it;
        text that may still turn out to start a stop string is held back until it cannot."""
        st = self._text[req.request_id]
        if req.finished and st.detok is not None and not st.stopped:
            st.text += st.detok.flush()
            if st.stops:   # the flushed tail may still hold a stop string
                cut = find_stop(st.text, st.stops, max(st.emitted, st.checked_from))
                if cut is not None:
                    st.stopped = _stop_at(st.text, cut, st.stops)
                    st.text = st.text[:cut + (len(st.stopped) if st.keep_stop else 0)]
        visible = len(st.text) if req.finished or not st.stops else len(st.text) - hold_back(st.text, st.stops)
        new_ids = req.output_ids[len(req.output_ids) - new_tokens:] if new_tokens else []
        lps = req.output_logprobs[len(req.output_logprobs) - new_tokens:] if new_tokens else []
        tops = req.output_top_logprobs[-new_tokens:] if new_tokens and req.params.logprobs else []
        rid, _, _ = req.request_id.partition("#")
        first = req.prompt_logprobs is not None and len(req.output_ids) == new_tokens and new_tokens > 0
        prompt = prompt_logprob_list(req) if first else None
        outs = []
        for j in range(max(new_tokens, 1)):
            last = j >= new_tokens - 1
            end = visible if last or j >= len(st.marks) else min(st.marks[j], visible)
            end = max(end, st.emitted)
            text, st.emitted = st.text[st.emitted:end], end
            outs.append(RequestOutput(rid, req.sample_index, text, new_ids[j:j + 1], lps[j:j + 1], tops[j:j + 1],
                                      req.finished and last, req.finish_reason if last else None,
                                      req.num_cached_tokens or 0, prompt if j == 0 else None,
                                      _embedding(req) if req.finished and last else None,
                                      (st.stopped or req.stop_reason) if req.finished and last else None))
        if req.finished:
            del self._text[req.request_id]
            group = self._groups.get(rid)
            if group is not None and all(g not in self._text for g in group):
                del self._groups[rid]
        return outs


def _stop_at(text: str, cut: int, stops: tuple[str, ...]) -> str:
    """The stop string found at text[cut:] (find_stop's earliest; the longest where several start there)."""
    return max((s for s in stops if s and text.startswith(s, cut)), key=len)


def _embedding(req: Request):
    """A finished embedding request's vector (None: it generates, or it was aborted)."""
    if req.pooling is None or req.finish_reason == "abort":
        return None
    return req.pooling.embedding()
