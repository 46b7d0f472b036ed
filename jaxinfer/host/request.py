"""A request's state on the host: its tokens, progress, status and timestamps (for TTFT/TPOT).

vLLM-v1 style: there is no prefill or decode phase. A request has `all_ids` (prompt + output)
and `num_computed_tokens` (how many of them have K/V in the cache); each step the scheduler
gives it some of the missing tokens. With async scheduling a step is dispatched before the
previous one's tokens reach the host: those tokens are `num_inflight` placeholders at the end
(counted in num_tokens, not in all_ids), fed to the next step from the device. Never imports jax.
"""
from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..config import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class LatencyMetrics:
    """The field's per-request metrics (seconds) from arrival_time, first_token_time and
    token_times: shared by Request and the client's RequestMetrics snapshot."""
    arrival_time: float
    first_token_time: float | None
    token_times: list[float] | tuple[float, ...]

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last - first) / (n - 1)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass(eq=False)
class Request(LatencyMetrics):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                          # resolved seed (random when the user gave none)
    sample_index: int = 0              # which of the n samples of its group this is
    priority: int = 0                  # lower runs first; FCFS within a priority
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_computed_tokens: int = 0
    # speculative_method="draft": tokens whose K/V the draft model has in its pages (a prefix of the
    # computed ones: decode steps the load policy keeps from speculating skip the draft), and while
    # the draft catches up, the num_computed_tokens the target had (its K/V below stays as it is)
    num_draft_computed: int = 0
    draft_catchup_end: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    stop_reason: int | None = None     # the stop_token_ids entry that ended it (an EOS is not one, as vLLM)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    # n > 1: the other samples wait here until this one has computed the shared prompt prefix
    pending_forks: list["Request"] = field(default_factory=list)
    fork_at: int = 0                   # prompt tokens to compute before forking (block aligned)
    # tokens drawn by dispatched steps whose values the host has not seen yet (async scheduling)
    num_inflight: int = 0
    # where the device holds the last in-flight token: an index into the previous step's
    # StepOutputs.next_tokens, which the next step reads its input token from
    inflight_index: int = -1
    # speculative_method="medusa": (len(all_ids) when proposed, the tree's tokens) from the row's last step
    proposals: tuple[int, list[int]] | None = None
    # prefix caching: the salt that enters the first block's hash (tenants that must not share),
    # the chained hashes of the request's full known blocks, the prompt tokens found cached when
    # it was first admitted (usage.prompt_tokens_details.cached_tokens), and how many times a
    # request with a longer cached prefix was admitted ahead of it (cache-aware admission)
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None
    num_passed_over: int = 0
    # structured outputs: this sample's grammar matcher (host/structured.Guide), fed each drawn token
    guide: Any = None
    # allowed_token_ids and one-token bad_words: the packed token mask the row samples under (numpy
    # int32 [W], bit t % 32 of word t // 32 allows token t), None: no such constraint; multi-token
    # bad_words: [B, L] int32 sequences left-padded with -1 (sampling.apply_bad_words), None: none.
    # Built once by the engine, shared by the request's samples
    static_mask: Any = None
    bad_word_ids: Any = None
    # params.prompt_logprobs: position p -> the logprob entry of prompt token p + 1 (one dict shared by
    # the request's n samples; jaxinfer/prompt_logprobs.py), else None
    prompt_logprobs: dict | None = None
    # multi-LoRA: the adapter's load id (None: the base model) and, while it runs, its device slot
    # (host/lora_slots.py; -1 when it holds none)
    lora_id: int | None = None
    lora_slot: int = -1
    # embeddings: a prefill-only request's pooling (host/pooling.PoolingState); None: it generates
    pooling: Any = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, the in-flight ones included (what scheduling plans with)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def num_known_tokens(self) -> int:
        """Prompt + output tokens the host holds (len(all_ids))."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        if start >= n:
            return self.output_ids[start - n:stop - n]
        return self.prompt_ids[start:] + self.output_ids[:stop - n]

    @property
    def prefix_salt(self) -> str | None:
        """What salts the first block's hash: the cache salt and the adapter (two adapters, or an
        adapter and the base model, never share K/V), as a JSON pair: no salt a client chooses can
        spell another salt's or an adapter's pair."""
        if self.lora_id is None and not self.cache_salt:
            return None
        return json.dumps([self.cache_salt or None, self.lora_id])

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int, logprob: float, top: list[tuple[int, float]] | None,
                     now: float) -> None:
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)

    def finish(self, reason: str, now: float | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.monotonic() if now is None else now

