"""Which requests get how many tokens this step. Pure Python; never imports jax.

There is no prefill or decode phase (vLLM v1): each running request has tokens whose K/V are
not yet in the cache (a prompt chunk, or the one token sampled last step), and `schedule()`
hands them out under a per-step token budget, running requests first, then waiting ones.
When KV blocks run out, the newest (lowest-priority) running request is preempted: its blocks
are freed and it is recomputed later. Three policies:
  - continuous: iteration-level scheduling; every step admits waiting requests;
  - static: a fixed batch of up to max_num_seqs requests runs to completion before the next;
  - dynamic: like static, but a batch is formed only once max_num_seqs requests are waiting or
    the oldest has waited batch_window_s (what arrived within the window).
n > 1: the first sample computes the prompt up to the last full block, then the other samples
fork from it, sharing those blocks and computing only the rest.
Multi-step decoding: when every scheduled row decodes one token and nobody waits for admission,
the step may run up to max_decode_steps decode iterations on the device (step.py). Each row gets
blocks for all its draws up front (`max_draws`); if they do not fit, the step runs one iteration.
While requests wait (or prefill runs) a step is one iteration, so TTFT does not pay for it.
Every finish condition is decided in `update`, token by token: stop ids and EOS, stop strings
(through the engine's `stop_check`, which owns the detokenizer), max_tokens and the context
length, in that order of precedence; tokens drawn after a finish are discarded, never counted.
A step's results come back in two calls: `launched(sched)` when the step is on the device
(progress advances as if every row drew all it may; the draws are in-flight placeholders) and
`update(sched, samples)` when its tokens reach the host. Synchronous engines call them back to back;
with async scheduling the next step is planned and dispatched in between, its decode rows fed the
in-flight tokens on the device. A waiting request with in-flight tokens is not admitted until
they arrive (it needs them to recompute), and a row that has drawn all it may is not scheduled.

Prefix caching (when the block manager has it on): a request being admitted with no blocks looks up
the longest chain of cached full blocks of its known tokens, leaving at least its last token to
compute (its logits are needed), and starts after them. Full blocks are registered as soon as the
step writing their K/V is dispatched (`launched`) and their tokens are known: a later step runs
after it on the device, so it reads them written. Registration stops one token short of the
known tokens: the last token drawn has not been fed to a step yet.
Cache-aware admission (continuous policy): among the first ADMIT_WINDOW waiting requests of the
head's priority, the one with the most cached blocks is admitted first (the fewest tokens to
compute, as SGLang's longest-prefix-match policy); ties go to the earlier arrival, so with no cache
hits the order is plain FCFS. A request passed over MAX_PASSED_OVER times is admitted next
whatever its prefix, so nobody starves; priorities are never crossed.
Multi-LoRA: a request with an adapter is admitted only once its adapter holds a device slot
(host/lora_slots.py, LRU); while every slot is held it waits and others are admitted past it. Its
blocks' hashes are salted by the adapter (Request.prefix_salt).
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .block_manager import BlockManager, block_hash
from .lora_slots import LoraSlots
from .request import Request, RequestStatus
from .speculative import MAX_GUIDED_ROWS


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    policy: str = "continuous"          # continuous | static | dynamic
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    batch_window_s: float = 0.05        # dynamic batching: how long the oldest request may wait
    max_decode_steps: int = 1           # decode iterations one step may run when every row decodes
    spec_tokens: int = 0                # speculative decoding: proposals per decoding row (K)
    spec_max_batch: int = 0             # ... while at most this many sequences run or wait (the load policy)
    spec_rounds: int = 1                # rounds one step may run on the device when every row speculates
    # a draft model whose pages may lag the target's: steps where nobody speculates (the load
    # policy's) skip it, and a lagging row catches up before it speculates again (see schedule())
    lazy_draft: bool = False
    # Medusa: the step proposes each row's next tree from its last token's hidden state, so while the
    # policy speculates a step runs one decode iteration (none would be proposed after the first)
    step_proposes: bool = False
    # fcfs: arrival order; priority: lower Request.priority first, then arrival. The engine passes
    # EngineConfig's (fcfs); a scheduler built alone orders by priority, as it always has
    scheduling_policy: str = "priority"
    # the runner's token buckets (a step is padded to the smallest that holds it) and the tokens per
    # step at which a step turns compute-bound on this device (perf.compute_bound_tokens; 0: unknown).
    # With both, a step that overshoots a compute-bound bucket by a little is cut back to it
    # (_fit_bucket); the engine fills them in, a scheduler built alone never cuts
    token_buckets: tuple[int, ...] = ()
    compute_bound_tokens: float = 0.0


@dataclass
class ScheduledSeq:
    request: Request
    start: int          # num_computed_tokens before this step
    num_tokens: int     # tokens computed this step: all_ids[start : start + num_tokens]
    sample: bool        # the chunk ends at the request's last token: draw the next one
    max_draws: int = 1  # tokens the row may draw this step (> 1: multi-step decoding or speculation)
    spec: list[int] = field(default_factory=list)   # proposed tokens after the last one (-1: the draft
                                                     # model proposes on the device); num_tokens counts them
    draft_only: int = 0  # the chunk's first tokens whose target K/V is cached: only the draft writes them
    round_draws: int = 0  # speculation: the most one round draws (0: 1 + len(spec), a chain's)

    @property
    def lookahead(self) -> int:
        """Positions past the chunk whose K/V later iterations of the step write: multi-step
        decoding, speculation rounds after the first (a Medusa tree draws at most round_draws of its
        1 + len(spec) tokens a round, and each later round writes all of its nodes: the last one's
        reach past its root's slot as far as the first round's past the chunk's start)."""
        return max(0, self.max_draws - (self.round_draws or 1 + len(self.spec)))


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_decode_iters: int = 1   # > 1: every row decodes, up to this many iterations on device
    launched: bool = False      # Scheduler.launched has applied it
    speculating: bool = False   # the load policy lets rows speculate (Medusa: propose the next trees)
    run_draft: bool = True      # the draft model runs over the step's tokens (lazy_draft: see schedule())
    run_target: bool = True     # False: every row is a draft catch-up chunk, the target does not run

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@dataclass
class StepSample:
    token: int
    logprob: float
    top: list[tuple[int, float]] | None = None


ADMIT_WINDOW = 16       # cache-aware admission looks this far down the waiting queue
MAX_PASSED_OVER = 4     # ... and never passes one request over more often than this


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, block_manager: BlockManager, eos_ids: tuple[int, ...] = (),
                 clock=time.monotonic, propose: Callable[[Request, int, int], list[int]] | None = None,
                 spec_draws: Callable[[int], int] | None = None, lora_slots: LoraSlots | None = None):
        assert cfg.policy in ("continuous", "static", "dynamic"), cfg.policy
        assert cfg.scheduling_policy in ("fcfs", "priority"), cfg.scheduling_policy
        self.cfg, self.blocks, self.eos_ids, self.clock = cfg, block_manager, tuple(eos_ids), clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.batch: set[str] | None = None      # static/dynamic: the batch being run
        self.num_preemptions = 0
        self.num_draft_catchup_tokens = 0   # lazy_draft: tokens only the draft recomputed
        self.prefix_queries = 0     # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0        # ... of which were found cached
        self._scores: dict[str, int] = {}   # cache-aware admission: cached blocks per candidate (one schedule())
        self._order = 0
        self._keys: dict[str, tuple] = {}
        # speculative decoding: propose(req, k, depth) -> up to k token ids following req's tokens
        # (-1: the draft model proposes them on the device) from which at most depth can be accepted
        # (a chain: min(k, depth) tokens; a Medusa tree: its nodes up to that depth); spec_draws(n):
        # the most tokens a row with n proposals draws (default, a chain: 1 + n). The engine passes both.
        self.propose = propose
        self.spec_draws: Callable[[int], int] = spec_draws or (lambda n: 1 + n)
        # multi-LoRA: the device slots' LRU; a request with an adapter is admitted only with a slot
        self.lora_slots = lora_slots

    # ------------------------------------------------------------------ queue
    def _key(self, req: Request) -> tuple:
        return self._keys[req.request_id]

    def _rank(self, req: Request) -> int:
        """The request's priority as this policy counts it: fcfs puts everyone at one level."""
        return req.priority if self.cfg.scheduling_policy == "priority" else 0

    def add(self, req: Request) -> None:
        self._order += 1
        self._keys[req.request_id] = (self._rank(req), req.arrival_time, self._order)
        self.requests[req.request_id] = req
        for child in req.pending_forks:
            self._order += 1
            self._keys[child.request_id] = (self._rank(child), child.arrival_time, self._order)
            self.requests[child.request_id] = child
        if req.pending_forks and req.fork_at == 0:
            self._fork(req)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        keys = [self._key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, self._key(req)), req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + sum(
            not c.finished for r in self.requests.values() for c in r.pending_forks)

    # ------------------------------------------------------------------ schedule
    def _num_new_tokens(self, req: Request, budget: int) -> int:
        if req.num_inflight and (req.status is not RequestStatus.RUNNING or self.draws_left(req) == 0):
            return 0   # recompute needs the in-flight tokens; or nothing is left to draw
        end = req.fork_at if req.pending_forks else req.num_tokens
        end = min(end, self.cfg.max_model_len)
        return max(0, min(end - req.num_computed_tokens, budget))

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.lora_slots.release(req.lora_id)
            req.lora_slot = -1

    def _acquire_lora(self, req: Request) -> bool:
        """Whether req may run: no adapter, or its adapter holds a slot (LRU; False: every slot is
        held by running requests, so req waits)."""
        if req.lora_id is None or req.lora_slot >= 0:
            return True
        slot = self.lora_slots.acquire(req.lora_id)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _preempt(self, req: Request) -> None:
        self._release_lora(req)
        self.blocks.free(req.request_id)
        req.num_computed_tokens = req.num_draft_computed = req.draft_catchup_end = 0
        if req.pooling is not None:   # an embedding's sum restarts with its recomputed positions
            req.pooling.reset()
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self._enqueue(req)

    def _reclaim_waiting(self, keep: Request | None = None) -> bool:
        """Free the blocks of the newest waiting request that holds some (a forked sample that
        shares its prompt's blocks), other than `keep`; it will recompute. False if no waiting
        request holds blocks."""
        for req in reversed(self.waiting):
            if req is not keep and self.blocks.table(req.request_id):
                self.blocks.free(req.request_id)
                req.num_computed_tokens = req.num_draft_computed = req.draft_catchup_end = 0
                if req.pooling is not None:
                    req.pooling.reset()
                self.num_preemptions += 1
                return True
        return False

    def _form_batch(self) -> None:
        """static / dynamic: start the next batch when the previous one has finished."""
        if self.batch is not None and any(rid in self.batch for rid in
                                          (r.request_id for r in self.waiting + self.running)):
            return
        self.batch = None
        if not self.waiting:
            return
        if self.cfg.policy == "dynamic" and len(self.waiting) < self.cfg.max_num_seqs:
            oldest = min(r.arrival_time for r in self.waiting)
            if self.clock() - oldest < self.cfg.batch_window_s:
                return
        self.batch = {r.request_id for r in self.waiting[: self.cfg.max_num_seqs]}

    def spec_k(self) -> int:
        """Proposals per decoding row this step: the load policy speculates with K tokens while at
        most spec_max_batch sequences run or wait and not at all above (bench/speculative.py;
        README). Waiting ones count: a burst of requests is a large batch as soon as it arrives,
        before its prompts are all prefilled (counting only the running ones, 16 requests at once
        speculated while the first 8 were admitted and ran at 0.90x of no speculation)."""
        if (not self.cfg.spec_tokens or self.propose is None
                or len(self.running) + len(self.waiting) > self.cfg.spec_max_batch):
            return 0
        return self.cfg.spec_tokens

    def may_propose(self, req: Request) -> bool:
        """Whether req's next step may hold proposals, which follow its last drawn token (so that
        token must be on the host first): the policy speculates and the proposer proposes for such
        a row at all (the draft model never does under a grammar: its rows decode as without
        speculation and keep async scheduling's overlap)."""
        proposes_for = getattr(self.propose, "proposes_for", None)   # any callable may propose
        return bool(self.spec_k()) and (proposes_for is None or proposes_for(req))

    def _proposals(self, req: Request, n: int, budget: int, k: int, guided: int) -> list[int]:
        """A decoding row's proposed tokens: one token to compute, whose draw is the next one,
        nothing in flight; under a grammar (guided: constrained rows speculating so far this step)
        at most MAX_GUIDED_ROWS such rows (what a proposer may propose under one: Proposer)."""
        if (k <= 0 or n != 1 or req.num_inflight or req.pending_forks
                or req.num_computed_tokens + 1 != req.num_tokens
                or (req.guide is not None and guided >= MAX_GUIDED_ROWS)):
            return []
        # every proposal takes its own KV slot after the root's, and the slots end at max_model_len (a
        # Medusa tree's nodes outnumber its depth: 4 heads with 2 positions left overran the table)
        k, depth = min(k, budget - 1, self.cfg.max_model_len - req.num_tokens), self.draws_left(req) - 1
        return list(self.propose(req, k, depth))[:k] if k > 0 and depth > 0 else []

    def schedule(self) -> SchedulerOutput:
        """This step's plan: running requests first (their next chunk or token, with proposals while
        the load policy speculates), preempting the newest when blocks run out; then waiting ones
        admitted under what is left of the token budget; then how many iterations it may run."""
        out = SchedulerOutput()
        self._scores: dict[str, int] = {}
        queue = sorted(self.running, key=self._key)
        spec_k = self.spec_k()
        budget = self.cfg.max_num_batched_tokens
        if spec_k and self.cfg.lazy_draft and self._catch_up_draft(out, queue, budget):
            return out
        budget = self._schedule_running(out, queue, budget, spec_k)
        if out.preempted:
            return out
        self._schedule_waiting(out, budget)
        self._fit_bucket(out)
        if not (spec_k and self.cfg.step_proposes):
            self._plan_decode_iters(out)
        self._plan_spec_rounds(out)
        out.speculating = spec_k > 0
        # lazy_draft: the draft model runs where some row speculates or catches up, and over prefill
        # chunks while the policy speculates (their prompts are about to be speculated on); steps
        # where nobody speculates skip it (XLA's ragged attention costs a draft layer about what it
        # costs a target layer: a 3-layer draft added ~50% to a 128-token prefill step of the
        # bundled 8-layer model on CPU)
        out.run_draft = not self.cfg.lazy_draft or any(seq.spec or seq.draft_only for seq in out.seqs) or (
            out.speculating and any(seq.num_tokens > 1 for seq in out.seqs))
        return out

    def _schedule_running(self, out: SchedulerOutput, queue: list[Request], budget: int, spec_k: int) -> int:
        """Running requests in priority order, each its next tokens (and proposals); when blocks run
        out the newest not yet scheduled is preempted (or a waiting request's blocks reclaimed).
        Returns the budget left."""
        guided = 0
        i = 0
        while i < len(queue) and budget > 0:
            req = queue[i]
            n = self._num_new_tokens(req, budget)
            if n == 0:
                i += 1
                continue
            spec = self._proposals(req, n, budget, spec_k, guided)
            guided += bool(spec) and req.guide is not None
            n += len(spec)
            while not self.blocks.allocate(req.request_id, req.num_computed_tokens + n):
                if queue[-1] is req and self._reclaim_waiting():
                    continue
                victim = queue.pop()               # the newest / lowest-priority not yet scheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.seqs.append(self._scheduled(req, n, spec))
                budget -= n
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests (the current batch's only, under static / dynamic batching) while
        budget, sequence slots and blocks last, each starting after its cached prefix."""
        if self.cfg.policy != "continuous":
            self._form_batch()
        no_slot: set[str] = set()   # waiting for a LoRA slot: the others may still be admitted
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            if self.cfg.policy != "continuous":
                # only members of the current batch; later arrivals may sort ahead of them
                req = next((r for r in self.waiting if self.batch and r.request_id in self.batch
                            and r.request_id not in no_slot), None)
            else:
                req = self._next_waiting(no_slot)
            if req is None:
                break
            if not self._acquire_lora(req):
                no_slot.add(req.request_id)
                continue
            hits, start, n = self._admission(req, budget)
            looked_up = self._looks_up(req)
            # with nothing running, no one else will give blocks back: forked samples parked in the
            # queue with their prompt's blocks return them first (they recompute), else the request
            # at the head could wait for them forever while they wait behind it
            while n and not self.blocks.allocate(req.request_id, start + n, prefix=hits):
                if self.running or not self._reclaim_waiting(keep=req):
                    n = 0
                    break
                hits, start, n = self._admission(req, budget)   # its cached prefix may have moved
            if n == 0:
                self._release_lora(req)
                break
            if looked_up:
                self.prefix_queries += req.num_known_tokens
                self.prefix_hits += start
                if self.blocks.host is not None:
                    self.blocks.host.count_lookup(hits, (req.num_known_tokens - 1) // self.blocks.block_size)
            if hits and self.cfg.lazy_draft:   # the draft's pages hold the cached prefix up to a stale block
                req.num_draft_computed = min(start, self.blocks.draft_valid_blocks(hits) * self.blocks.block_size)
            self._admitted(req, start)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.pending_forks and start >= req.fork_at:
                self._fork(req)     # its samples' shared prompt blocks were all cached
            out.seqs.append(self._scheduled(req, n))
            budget -= n

    def _fit_bucket(self, out: SchedulerOutput) -> None:
        """Padding-aware chunking. The runner pads a step of n tokens to the smallest bucket B >= n.
        When n overshoots the bucket b below B by o = n - b, cutting o prompt tokens (the newest
        rows' chunks first, each row keeps one) runs this step at b and leaves them to a later one.
        On the roofline a step of T tokens costs c(T) = max(R, bucket(T)) (c(0) = 0), R the
        compute-bound tokens: the cut saves c(n) - c(b) now. The o tokens go in a later step beside
        that step's decode rows, which this step's d decode tokens foretell: they add
        c(d + o) - c(d) there. So the cut is made only when it cannot lose:
        c(n) - c(b) > c(d + o) - c(d), which needs bucket(n) > R (a bandwidth-bound step costs the
        same at any size: never cut there). With no decode rows the right side is the o tokens' own
        step; where they fit in the decode rows' padding it is 0. With many decode rows (d + o
        past b) the next step would overshoot just as this one does: the two sides are equal and
        nothing is cut (a cut there moved the prompt on by one token a step: 255 decode rows
        beside a 65-token chunk gave 40 steps of one prompt token each and 40% more steps for the
        whole batch, before the d term). The rows that keep their chunk get their first token a
        step sooner; the cut row gets it after steps that together cost less than the padded one."""
        r, buckets = self.cfg.compute_bound_tokens, self.cfg.token_buckets
        n = out.num_batched_tokens
        if not r or not buckets or n > buckets[-1] or n <= buckets[0]:
            return
        def cost(t: int) -> float:
            return max(r, next(x for x in buckets if x >= t)) if t else 0.0
        b = max(x for x in buckets if x < n)
        o = n - b
        rows = [seq for seq in out.seqs if seq.num_tokens > 1 and not seq.spec and not seq.draft_only]
        d = n - sum(seq.num_tokens for seq in rows)          # decode (and speculation) tokens
        if sum(seq.num_tokens - 1 for seq in rows) < o:      # the prompt rows cannot give o back
            return
        if not cost(n) - cost(b) > cost(d + o) - cost(d):     # d + o < n: within the buckets
            return
        for seq in reversed(rows):
            cut = min(o, seq.num_tokens - 1)
            seq.num_tokens -= cut
            seq.sample = False
            self.blocks.shrink(seq.request.request_id, seq.start + seq.num_tokens)
            o -= cut
            if not o:
                break

    def recompute(self, out: SchedulerOutput, blocks) -> None:
        """The host tier's restore copies into these blocks failed (their K/V is not the cached one):
        every request holding one starts over, its rows leave this not yet launched step, and its
        tokens are recomputed later; nothing is lost and nothing reads the bad blocks."""
        bad = set(blocks)
        for req in list(self.running) + list(self.waiting):
            if not bad & set(self.blocks.table(req.request_id)):
                continue
            out.seqs = [seq for seq in out.seqs if seq.request is not req]
            req.num_cached_tokens = None
            if req in self.running:
                self._preempt(req)
            else:                   # a forked sample sharing its prompt's blocks
                self.blocks.free(req.request_id)
                req.num_computed_tokens = req.num_draft_computed = req.draft_catchup_end = 0

    def _catch_up_draft(self, out: SchedulerOutput, queue: list[Request], budget: int) -> bool:
        """lazy_draft, while the policy speculates: rows whose draft pages lag (they decoded or
        prefilled while the policy kept speculation off, or started from cached blocks the draft never
        wrote) recompute the gap first, in a step of their catch-up chunks alone that runs the draft
        model only (out.run_target False: every row's tokens are draft_only, the target's K/V is
        cached); the other rows wait that one step. Only rows the draft proposes for (not a row
        under a grammar) with tokens left to speculate on. True if it planned such a step."""
        for req in queue:
            if budget <= 0:
                break
            if not req.draft_catchup_end:
                if (req.num_draft_computed >= req.num_computed_tokens or req.num_inflight or req.pending_forks
                        or self.draws_left(req) < 2 or not self.propose(req, 1, 1)):
                    continue
                req.draft_catchup_end = req.num_computed_tokens
                self.num_draft_catchup_tokens += req.num_computed_tokens - req.num_draft_computed
                req.num_computed_tokens = req.num_draft_computed
            n = min(req.draft_catchup_end - req.num_computed_tokens, budget)
            out.seqs.append(self._scheduled(req, n))
            budget -= n
        out.run_target = not out.seqs
        out.speculating = out.run_draft = bool(out.seqs)
        return bool(out.seqs)

    def _plan_spec_rounds(self, out: SchedulerOutput) -> None:
        """Several rounds of speculation on the device when every row speculates with proposals
        made there (placeholders: the draft model, n-gram lookup; Medusa: each round's heads propose
        the next round's tree) and nobody waits: each row may draw up to rounds * (1 + k) tokens
        (Medusa: rounds * (1 + the tree's depth)), blocks taken up front. Not for a row under a
        grammar: its masks are filled on the host, one round's."""
        r = self.cfg.spec_rounds
        medusa = self.cfg.step_proposes
        if r <= 1 or self.waiting or not out.seqs or not all(
                seq.spec and (seq.request.guide is None if medusa else seq.spec[0] == -1) for seq in out.seqs):
            return
        per = [seq.round_draws or 1 + len(seq.spec) for seq in out.seqs]
        draws = [min(r * k, self.draws_left(seq.request)) for seq, k in zip(out.seqs, per)]
        if max(d // k for d, k in zip(draws, per)) <= 1:
            return
        # a later round's tree writes all 1 + len(spec) of its tokens from its root on
        ends = [seq.start + max(d, k) + 1 + len(seq.spec) - k for seq, d, k in zip(out.seqs, draws, per)]
        if max(ends) > self.cfg.max_model_len:
            return
        for seq, end in zip(out.seqs, ends):
            if not self.blocks.allocate(seq.request.request_id, end):
                return
        for seq, d, k in zip(out.seqs, draws, per):
            seq.max_draws = max(d, k)
        out.num_decode_iters = r

    # ------------------------------------------------------------------ prefix cache
    @property
    def caching(self) -> bool:
        return self.blocks.enable_caching

    def _hashes(self, req: Request) -> list[bytes]:
        """The chained hashes of the request's full known blocks (extended as tokens arrive)."""
        bs, hashes = self.blocks.block_size, req.block_hashes
        for i in range(len(hashes), req.num_known_tokens // bs):
            hashes.append(block_hash(hashes[-1] if hashes else None, req.token_ids(i * bs, (i + 1) * bs),
                                     req.prefix_salt))
        return hashes

    def _looks_up(self, req: Request) -> bool:
        """A request admitted with no blocks and nothing computed starts from the prefix cache."""
        return (self.caching and not self.blocks.table(req.request_id) and not req.num_computed_tokens
                and not req.num_inflight and not (req.pooling is not None and req.pooling.needs_every_token))

    def _cache_hits(self, req: Request) -> list[int]:
        """Cached blocks a request with no blocks can start from: its longest cached prefix, short
        of its last known token (whose logits are needed)."""
        if not self._looks_up(req) or req.params.prompt_logprobs is not None:
            return []   # prompt logprobs need every prompt position's logits: a cached block has none
        usable = (req.num_known_tokens - 1) // self.blocks.block_size
        return self.blocks.lookup(self._hashes(req)[:usable])

    def _admission(self, req: Request, budget: int) -> tuple[list[int], int, int]:
        """(cached blocks it starts from, its first token to compute, tokens to compute this step)."""
        hits = self._cache_hits(req)
        if not hits:
            return hits, req.num_computed_tokens, self._num_new_tokens(req, budget)
        start = len(hits) * self.blocks.block_size
        end = req.fork_at if req.pending_forks and start < req.fork_at else req.num_tokens
        return hits, start, max(0, min(min(end, self.cfg.max_model_len) - start, budget))

    def _admitted(self, req: Request, start: int) -> None:
        req.num_computed_tokens = start
        if req.num_cached_tokens is None:
            req.num_cached_tokens = min(start, len(req.prompt_ids))
        if self.caching and self.cfg.policy == "continuous":
            head = self._rank(self.waiting[0])
            for r in self.waiting[:ADMIT_WINDOW]:
                if r is req:
                    break
                if self._rank(r) == head:
                    r.num_passed_over += 1

    def _next_waiting(self, skip: set[str] = frozenset()) -> Request | None:
        """Continuous policy: the next request to admit (cache-aware; see the module docstring), of
        those not in `skip` (waiting for a LoRA slot)."""
        waiting = [r for r in self.waiting if r.request_id not in skip] if skip else self.waiting
        if not waiting:
            return None
        head = waiting[0]
        if not self.caching:
            return head
        window = [r for r in waiting[:ADMIT_WINDOW] if self._rank(r) == self._rank(head)]
        starved = next((r for r in window if r.num_passed_over >= MAX_PASSED_OVER), None)
        if starved is not None:
            return starved
        scores = self._scores          # per schedule() call: a window's lookups are not repeated

        def score(r: Request) -> int:
            if r.request_id not in scores:
                scores[r.request_id] = max(len(self._cache_hits(r)), r.num_computed_tokens // self.blocks.block_size)
            return scores[r.request_id]
        return max(window, key=score)  # the first of the best: FCFS among equals

    def _register(self, req: Request) -> None:
        """Cache the request's full blocks whose K/V a dispatched step writes and whose tokens are
        known (not the last drawn token: it has not been fed to a step yet)."""
        if not self.caching or req.finished:
            return
        limit = min(req.num_computed_tokens, req.num_known_tokens - (1 if req.output_ids else 0))
        full = limit // self.blocks.block_size
        if full > 0:
            self.blocks.register(req.request_id, self._hashes(req), full)

    def draws_left(self, req: Request) -> int:
        """Tokens the request may still draw: max_tokens and the context length both bound it."""
        return max(0, min(req.params.max_tokens - len(req.output_ids) - req.num_inflight,
                          self.cfg.max_model_len - req.num_tokens))

    def _plan_decode_iters(self, out: SchedulerOutput) -> None:
        """Several decode iterations in one step when every row decodes and nobody waits."""
        k = self.cfg.max_decode_steps
        # a constrained row's next mask needs its previous token on the host: one draw per step
        if k <= 1 or self.waiting or not out.seqs or any(
                seq.num_tokens != 1 or not seq.sample or seq.request.params.constrained or seq.spec
                for seq in out.seqs):
            return
        draws = [min(k, self.draws_left(seq.request)) for seq in out.seqs]
        if max(draws) <= 1:
            return
        for seq, d in zip(out.seqs, draws):
            # blocks taken here and not used (a later row did not fit) serve the request's next steps
            if not self.blocks.allocate(seq.request.request_id, seq.start + d):
                return
        for seq, d in zip(out.seqs, draws):
            seq.max_draws = max(d, 1)
        out.num_decode_iters = max(draws)

    def _scheduled(self, req: Request, n: int, spec: list[int] | None = None) -> ScheduledSeq:
        start = req.num_computed_tokens
        if spec:   # the last token and its proposals: up to 1 + k draws
            k = self.spec_draws(len(spec))
            return ScheduledSeq(req, start, n, sample=True, max_draws=k, spec=spec, round_draws=k)
        return ScheduledSeq(req, start, n, sample=start + n == req.num_tokens and not req.pending_forks,
                            draft_only=max(0, min(start + n, req.draft_catchup_end) - start))

    # ------------------------------------------------------------------ update
    def launched(self, sched: SchedulerOutput) -> None:
        """The scheduled step is on the device: every row's K/V will be written, so progress advances
        now; a sampling row's draws become in-flight placeholders (update resolves them)."""
        sched.launched = True
        for seq in sched.seqs:
            req = seq.request
            if req.finished:        # aborted before the step was dispatched
                continue
            req.num_computed_tokens = seq.start + seq.num_tokens
            self._register(req)
            if req.pending_forks and req.num_computed_tokens >= req.fork_at:
                self._fork(req)
            if seq.sample:
                # multi-step: draw j > 0 is made after the K/V of position start + num_tokens + j - 1
                # is written; speculation: as if every proposal is accepted (update rolls back)
                req.num_computed_tokens += seq.lookahead
                req.num_inflight += seq.max_draws
            if self.cfg.lazy_draft:
                self._track_draft(req, seq, sched.run_draft)

    def _track_draft(self, req: Request, seq: ScheduledSeq | None = None, ran: bool = False) -> None:
        """lazy_draft: the draft's K/V covers a prefix of the computed positions; it grows when the
        draft ran over a chunk that continues it, and the blocks in the gap are marked stale."""
        if seq is not None and ran and req.num_draft_computed >= seq.start:
            req.num_draft_computed = req.num_computed_tokens
        req.num_draft_computed = min(req.num_draft_computed, req.num_computed_tokens)
        if req.num_computed_tokens >= req.draft_catchup_end:
            req.draft_catchup_end = 0
        self.blocks.mark_draft(req.request_id, req.num_draft_computed, req.num_computed_tokens)

    def update(self, sched: SchedulerOutput, samples: dict[str, list[StepSample]], now: float | None = None,
               stop_check: Callable[[Request], bool] | None = None) -> list[Request]:
        """Apply one step's results (per row: its drawn tokens in order, or one StepSample) until a
        token finishes the row; the rest are discarded. stop_check(req), called after each appended
        token, says whether a stop string has just completed. Returns the requests that got tokens."""
        if not sched.launched:
            self.launched(sched)
        now = self.clock() if now is None else now
        updated: list[Request] = []
        for seq in sched.seqs:
            req = seq.request
            if not seq.sample:
                continue
            req.num_inflight -= seq.max_draws
            if req.finished:        # aborted, or finished by an earlier step's tokens
                continue
            drawn = samples[req.request_id]
            for j, s in enumerate([drawn] if isinstance(drawn, StepSample) else drawn):
                req.append_token(s.token, s.logprob, s.top, now)
                if j == 0:
                    updated.append(req)
                reason = self._stop_reason(req, s.token, stop_check)
                if reason:
                    self.finish(req, reason, now)
                    break
            if seq.spec and not req.finished:
                # rejected proposals: their K/V slots are rewritten by later steps
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_known_tokens - 1)
                if self.cfg.lazy_draft:
                    self._track_draft(req)
            self._register(req)
        return updated

    def _stop_reason(self, req: Request, token: int, stop_check: Callable[[Request], bool] | None) -> str | None:
        p = req.params
        if not p.ignore_eos and token in self.eos_ids:
            return "stop"
        if token in p.stop_token_ids:
            req.stop_reason = token
            return "stop"
        if stop_check is not None and stop_check(req):
            return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_known_tokens >= self.cfg.max_model_len:
            return "length"
        return None

    def _fork(self, parent: Request) -> None:
        for child in parent.pending_forks:
            if child.finished:      # aborted before it forked
                continue
            if parent.fork_at:
                self.blocks.fork(parent.request_id, child.request_id, parent.fork_at // self.blocks.block_size)
            child.num_computed_tokens = parent.fork_at
            child.num_draft_computed = min(parent.num_draft_computed, parent.fork_at)
            if self.batch is not None and parent.request_id in self.batch:
                self.batch.add(child.request_id)
            self._enqueue(child)
        parent.pending_forks = []

    def finish(self, req: Request, reason: str, now: float | None = None) -> None:
        """Finish (or abort) a request wherever it is, freeing its blocks and its pending forks."""
        now = self.clock() if now is None else now
        for child in req.pending_forks:
            child.finish(reason, now)
            self.requests.pop(child.request_id, None)
            self._keys.pop(child.request_id, None)
        req.pending_forks = []
        self._release_lora(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req.request_id)
        req.finish(reason, now)
        self.requests.pop(req.request_id, None)
        self._keys.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self.finish(req, "abort")
        return req
