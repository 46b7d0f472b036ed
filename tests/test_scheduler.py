"""The host tier (Request, BlockManager, Scheduler) driven by a fake model: no jax, no weights.

A small harness plays the engine: schedule() -> a fake "execute" that keeps a fake KV cache
(every slot remembers the (token, position) written there, so a request reading a block it does
not own, or a shared block being overwritten, is caught) -> a fake sampler whose token is a pure
function of (request_id, position) -> update(). Every step the harness checks the scheduler's
invariants (token budget, max_num_seqs, block accounting, over-allocation, queue order).
The clock is fake, so everything is deterministic.
"""
from __future__ import annotations

import dataclasses
import random
import zlib
from dataclasses import dataclass

import numpy as np
import pytest

from jaxinfer.config import SamplingParams
from jaxinfer.host.block_manager import BlockManager
from jaxinfer.host.request import Request, RequestStatus
from jaxinfer.host.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, StepSample

EOS = 2
DT = 1 / 64          # one fake step, exactly representable


def token_of(request_id: str, position: int) -> int:
    """The fake sampler: a deterministic token in [100, 1000) (never EOS)."""
    return 100 + zlib.crc32(f"{request_id}@{position}".encode()) % 900


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_request(rid: str, prompt: list[int], block_size: int, priority: int = 0, arrival: float = 0.0,
                 **params) -> Request:
    """What Engine.add_request builds: a leader plus its n - 1 pending forks."""
    p = SamplingParams(**params)
    mk = lambda i, r: Request(r, list(prompt), p, 1234, sample_index=i, priority=priority,  # noqa: E731
                              arrival_time=arrival)
    leader = mk(0, rid)
    leader.pending_forks = [mk(i, f"{rid}#{i}") for i in range(1, p.n)]
    leader.fork_at = (len(prompt) - 1) // block_size * block_size
    return leader


def prompt_of(n: int, base: int = 10) -> list[int]:
    return [base + (i % 50) for i in range(n)]


@dataclass
class StepRecord:
    t: float
    seqs: list[tuple[str, int, int, bool]]     # (request_id, start, num_tokens, sample)
    preempted: list[str]
    running_after: list[str]

    def ids(self) -> list[str]:
        return [s[0] for s in self.seqs]


class Harness:
    def __init__(self, policy="continuous", num_blocks=256, block_size=4, max_num_seqs=8, budget=32,
                 max_model_len=512, window=4 * DT, eos_ids=(EOS,), token_fn=token_of, ridge=0.0):
        self.clock = FakeClock()
        self.bm = BlockManager(num_blocks, block_size)
        # ridge > 0: the engine's padding-aware chunking, with power-of-two token buckets up to the budget
        buckets = tuple(2 ** i for i in range(3, 16) if 2 ** i <= budget) if ridge else ()
        self.cfg = SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                   max_model_len=max_model_len, batch_window_s=window, token_buckets=buckets,
                                   compute_bound_tokens=ridge)
        self.s = Scheduler(self.cfg, self.bm, eos_ids=eos_ids, clock=self.clock)
        self.kv = np.full((num_blocks * block_size, 2), -1, np.int64)   # (token, position) per slot
        self.token_fn = token_fn
        self.steps: list[StepRecord] = []
        self.reqs: dict[str, Request] = {}                              # every sample ever added

    # ---------------------------------------------------------------- requests
    def add(self, rid, prompt_len_or_ids, priority=0, arrival=None, **params) -> Request:
        prompt = prompt_of(prompt_len_or_ids) if isinstance(prompt_len_or_ids, int) else prompt_len_or_ids
        req = make_request(rid, prompt, self.bm.block_size, priority,
                           self.clock() if arrival is None else arrival, **params)
        for r in [req, *req.pending_forks]:
            self.reqs[r.request_id] = r
        self.s.add(req)
        return req

    # ---------------------------------------------------------------- one step
    def step(self, before_update=None) -> SchedulerOutput:
        self.check_state()
        out = self.s.schedule()
        self.check_plan(out)
        self.execute(out)
        samples = {q.request.request_id: StepSample(self.token_fn(q.request.request_id, q.start + q.num_tokens),
                                                    -0.5, None)
                   for q in out.seqs if q.sample}
        if before_update is not None:
            before_update(out)
        self.s.update(out, samples)
        self.steps.append(StepRecord(self.clock(), [(q.request.request_id, q.start, q.num_tokens, q.sample)
                                                    for q in out.seqs],
                                     [r.request_id for r in out.preempted],
                                     [r.request_id for r in self.s.running]))
        self.clock.t += DT
        self.check_state()
        return out

    def run(self, max_steps=5000, on_step=None) -> None:
        """Step until nothing is unfinished; on_step(i) may add/abort requests before step i."""
        for i in range(max_steps):
            if on_step is not None:
                on_step(i)
            if not self.s.has_unfinished() and (on_step is None or i > getattr(on_step, "last", -1)):
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: "
                             f"waiting={[r.request_id for r in self.s.waiting]} "
                             f"running={[r.request_id for r in self.s.running]}")

    # ---------------------------------------------------------------- the fake device
    def execute(self, out: SchedulerOutput) -> None:
        """Check each sequence's context is in its blocks, then write its new tokens' K/V."""
        bs = self.bm.block_size
        for q in out.seqs:
            req, rid = q.request, q.request.request_id
            table = self.bm.table(rid)
            ids = req.all_ids
            for p in range(q.start):
                slot = self.bm.slot(rid, p)
                assert tuple(self.kv[slot]) == (ids[p], p), f"{rid}: stale/foreign K/V at position {p}"
            for p in range(q.start, q.start + q.num_tokens):
                b = table[p // bs]
                assert b != 0, f"{rid} writes the null block"
                assert self.bm.ref_counts[b] == 1, f"{rid} writes shared block {b} (ref {self.bm.ref_counts[b]})"
                self.kv[self.bm.slot(rid, p)] = (ids[p], p)

    # ---------------------------------------------------------------- invariants
    def check_plan(self, out: SchedulerOutput) -> None:
        s, bm, cfg = self.s, self.bm, self.cfg
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.seqs) <= cfg.max_num_seqs
        assert len(s.running) <= cfg.max_num_seqs
        ids = [q.request.request_id for q in out.seqs]
        assert len(ids) == len(set(ids)), f"scheduled twice in one step: {ids}"
        scheduled = {}
        for q in out.seqs:
            r = q.request
            assert r in s.running and r.status is RequestStatus.RUNNING
            assert q.start == r.num_computed_tokens
            assert q.num_tokens >= 1 and q.start + q.num_tokens <= r.num_tokens
            if r.pending_forks:
                assert q.start + q.num_tokens <= r.fork_at
            assert q.sample == (q.start + q.num_tokens == r.num_tokens and not r.pending_forks)
            scheduled[r.request_id] = q.num_tokens
        for r in out.preempted:
            assert r.status is RequestStatus.PREEMPTED and r in s.waiting and r not in s.running
            assert r.num_computed_tokens == 0 and not bm.table(r.request_id)
            assert r.request_id not in scheduled
        # memory: allocated-but-unused slots < one block per sequence holding blocks
        for rid, table in bm.tables.items():
            if not table:
                continue
            r = self.reqs[rid]
            assert not r.finished, f"finished {rid} still holds blocks"
            used = r.num_computed_tokens + scheduled.get(rid, 0)
            unused = len(table) * bm.block_size - used
            assert 0 <= unused < bm.block_size, f"{rid}: {len(table)} blocks for {used} tokens"
            if r not in s.running:      # only a forked sample, not yet admitted, may hold blocks
                assert r in s.waiting and r.num_computed_tokens > 0 and unused == 0

    def check_state(self) -> None:
        s, bm = self.s, self.bm
        counts = np.zeros(bm.num_blocks, np.int64)
        for table in bm.tables.values():
            for b in table:
                counts[b] += 1
        assert counts[0] == 0 and bm.ref_counts[0] == 0, "the null block was handed out"
        assert np.array_equal(counts, bm.ref_counts), "ref counts disagree with the tables"
        free = np.fromiter(bm.free_blocks, np.int64, len(bm.free_blocks))
        is_free = np.zeros(bm.num_blocks, bool)
        is_free[free] = True
        assert int(is_free.sum()) == len(free) and not is_free[0], "a block is free twice, or the null block is"
        assert np.array_equal(is_free[1:], counts[1:] == 0), "leaked block, or a free block still in a table"
        keys = [s._key(r) for r in s.waiting]
        assert keys == sorted(keys), "waiting queue out of order"
        assert not set(map(id, s.waiting)) & set(map(id, s.running))
        for r in s.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        for r in s.running:
            assert r.status is RequestStatus.RUNNING
        for r in self.reqs.values():
            if r.finished:
                assert r not in s.waiting and r not in s.running and not bm.table(r.request_id)

    def assert_all_free(self) -> None:
        assert not self.s.waiting and not self.s.running
        assert self.bm.num_free == self.bm.num_blocks - 1
        assert self.bm.num_used == 0
        assert not self.bm.ref_counts.any()
        assert not any(self.bm.tables.values())
        assert all(r.finished for r in self.reqs.values())

    # ---------------------------------------------------------------- queries
    def first_step(self, rid) -> int:
        return next(i for i, st in enumerate(self.steps) if rid in st.ids())

    def last_step(self, rid) -> int:
        return max(i for i, st in enumerate(self.steps) if rid in st.ids())

    def chunks(self, rid) -> list[tuple[int, int, bool]]:
        return [(q[1], q[2], q[3]) for st in self.steps for q in st.seqs if q[0] == rid]


def expected_output(req: Request, max_model_len: int, token_fn=token_of) -> list[int]:
    n = min(req.params.max_tokens, max_model_len - len(req.prompt_ids))
    return [token_fn(req.request_id, len(req.prompt_ids) + k) for k in range(n)]


# ====================================================================== BlockManager
def test_block_manager_initial_state_reserves_null_block():
    bm = BlockManager(8, 4)
    assert bm.num_free == 7 and bm.num_used == 0
    assert 0 not in bm.free_blocks
    assert bm.table("x") == []
    with pytest.raises(AssertionError):
        BlockManager(1, 4)


def test_block_manager_blocks_for_and_num_new_blocks():
    bm = BlockManager(8, 4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert bm.num_new_blocks("a", 5) == 2
    assert bm.allocate("a", 5)
    assert bm.num_new_blocks("a", 8) == 0 and bm.num_new_blocks("a", 9) == 1 and bm.num_new_blocks("a", 1) == 0


def test_block_manager_allocate_grows_and_fails_without_change():
    bm = BlockManager(6, 4)                       # 5 usable
    assert bm.allocate("a", 6)                    # 2 blocks
    assert len(bm.table("a")) == 2 and bm.num_free == 3
    assert bm.allocate("a", 8) and len(bm.table("a")) == 2   # still fits
    assert bm.allocate("a", 9) and len(bm.table("a")) == 3 and bm.num_free == 2
    before = (list(bm.table("a")), bm.num_free, bm.ref_counts.copy())
    assert not bm.allocate("b", 9)                # needs 3, has 2: no change, no empty table
    assert not bm.allocate("a", 21)
    assert (list(bm.table("a")), bm.num_free) == before[:2]
    np.testing.assert_array_equal(bm.ref_counts, before[2])
    assert bm.table("b") == []
    assert all(bm.ref_counts[b] == 1 for b in bm.table("a"))
    assert bm.allocate("b", 8) and bm.num_free == 0
    assert 0 not in bm.table("a") + bm.table("b")
    assert len(set(bm.table("a") + bm.table("b"))) == 5


def test_block_manager_fork_ref_counts_and_free():
    bm = BlockManager(10, 4)
    assert bm.allocate("p", 10)                   # 3 blocks
    p = list(bm.table("p"))
    bm.fork("p", "c1", 2)
    bm.fork("p", "c2", 2)
    assert bm.table("c1") == p[:2] and bm.table("c2") == p[:2]
    assert [bm.ref_counts[b] for b in p] == [3, 3, 1]
    assert bm.num_free == 6                       # sharing takes no new blocks
    assert bm.allocate("c1", 9)                   # grows past the shared prefix with a private block
    assert bm.table("c1")[:2] == p[:2] and bm.ref_counts[bm.table("c1")[2]] == 1
    bm.free("p")
    assert [bm.ref_counts[b] for b in p] == [2, 2, 0] and bm.num_free == 6   # only p's private block
    bm.free("c1")
    assert [bm.ref_counts[b] for b in p[:2]] == [1, 1] and bm.num_free == 7
    bm.free("c2")
    assert bm.num_free == 9 and not bm.ref_counts.any() and not bm.tables
    bm.free("c2")                                 # freeing an unknown/freed id is a no-op
    assert bm.num_free == 9


def test_block_manager_fork_zero_blocks_and_misuse():
    bm = BlockManager(6, 4)
    assert bm.allocate("p", 4)
    bm.fork("p", "c", 0)
    assert bm.table("c") == [] and bm.ref_counts[bm.table("p")[0]] == 1
    with pytest.raises(AssertionError):
        bm.fork("p", "d", 2)                      # p has only one block
    bm.fork("p", "e", 1)
    with pytest.raises(AssertionError):
        bm.fork("p", "e", 1)                      # fork into a non-empty table


def test_block_manager_slot():
    bm = BlockManager(10, 4)
    for _ in range(3):                            # make the table non-trivial: blocks 4, 5, ...
        bm.free_queue.move_to_end(next(iter(bm.free_queue)))
    assert bm.allocate("a", 9)
    t = bm.table("a")
    assert t == [4, 5, 6]
    assert [bm.slot("a", p) for p in range(9)] == [t[p // 4] * 4 + p % 4 for p in range(9)]
    assert bm.slot("a", 0) == 16 and bm.slot("a", 5) == 21 and bm.slot("a", 8) == 24
    with pytest.raises(IndexError):
        bm.slot("a", 12)


# ====================================================================== continuous batching
def test_chunked_prefill_then_single_token_decodes():
    h = Harness(block_size=16, budget=32)
    req = h.add("a", 100, max_tokens=5)
    h.run()
    assert h.chunks("a") == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True),
                             (100, 1, True), (101, 1, True), (102, 1, True), (103, 1, True)]
    assert req.output_ids == expected_output(req, 512) and req.finish_reason == "length"
    h.assert_all_free()


def test_decodes_before_prefills_and_mixed_step():
    h = Harness(block_size=4, budget=8)
    h.add("a", 4, max_tokens=6)
    h.step()                                          # a: whole prompt, samples
    assert h.steps[-1].seqs == [("a", 0, 4, True)]
    h.add("b", 20, max_tokens=3)
    h.step()
    # a's decode token comes first, b's prefill gets the rest of the budget
    assert h.steps[-1].seqs == [("a", 4, 1, True), ("b", 0, 7, False)]
    h.add("c", 3, max_tokens=2)
    h.step()
    assert h.steps[-1].seqs == [("a", 5, 1, True), ("b", 7, 7, False)]   # c waits for budget
    h.step()
    assert h.steps[-1].seqs == [("a", 6, 1, True), ("b", 14, 6, True), ("c", 0, 1, False)]
    h.run()
    for r in h.reqs.values():
        assert r.output_ids == expected_output(r, 512)
    h.assert_all_free()


def test_budget_and_max_num_seqs_never_exceeded_under_load():
    h = Harness(block_size=4, budget=24, max_num_seqs=3)
    for i in range(10):
        h.add(f"r{i}", 5 + 7 * i, max_tokens=3 + i)
    h.run()                                            # check_plan asserts the limits each step
    assert max(len(st.seqs) for st in h.steps) == 3
    assert max(sum(q[2] for q in st.seqs) for st in h.steps) == 24
    assert any(any(q[3] for q in st.seqs) and any(not q[3] for q in st.seqs) for st in h.steps)
    for r in h.reqs.values():
        assert r.output_ids == expected_output(r, 512)
    h.assert_all_free()


def test_fcfs_order():
    h = Harness(max_num_seqs=1)
    for rid in ["x", "y", "z", "w"]:
        h.add(rid, 6, arrival=0.0, max_tokens=2)          # equal arrival times: the order they came in
    h.add("late", 6, arrival=1.0, max_tokens=2)
    h.add("early", 6, arrival=-1.0, max_tokens=2)      # an earlier arrival_time goes first
    h.run()
    order = sorted(h.reqs, key=h.first_step)
    assert order == ["early", "x", "y", "z", "w", "late"]
    # with max_num_seqs=1 one request runs to completion before the next starts
    for a, b in zip(order, order[1:]):
        assert h.last_step(a) < h.first_step(b)
    h.assert_all_free()


def test_priority_lower_value_admitted_first():
    h = Harness(max_num_seqs=1)
    h.add("low", 6, priority=5, arrival=0.0, max_tokens=2)
    h.add("high", 6, priority=-1, arrival=3.0, max_tokens=2)
    h.add("mid_late", 6, priority=0, arrival=2.0, max_tokens=2)
    h.add("mid_early", 6, priority=0, arrival=1.0, max_tokens=2)
    h.run()
    assert sorted(h.reqs, key=h.first_step) == ["high", "mid_early", "mid_late", "low"]
    h.assert_all_free()


def test_priority_arrival_while_running_jumps_the_queue():
    h = Harness(max_num_seqs=1)
    h.add("a", 6, max_tokens=4)
    h.add("b", 6, max_tokens=4)
    h.step()
    h.add("urgent", 6, priority=-5, max_tokens=4)      # arrives later, but lower priority value
    h.run()
    assert sorted(h.reqs, key=h.first_step) == ["a", "urgent", "b"]
    h.assert_all_free()


def test_running_requests_are_not_displaced_by_priority():
    """Priority decides admission; it does not preempt a running request while blocks remain."""
    h = Harness(max_num_seqs=2, budget=64)
    h.add("a", 6, priority=9, max_tokens=5)
    h.step()
    h.add("b", 6, priority=0, max_tokens=5)
    h.add("c", 6, priority=-9, max_tokens=5)
    h.run()
    assert not any(st.preempted for st in h.steps)
    assert h.first_step("c") == 1 and h.first_step("b") > h.first_step("c")
    h.assert_all_free()


def test_timestamps_use_the_injected_clock():
    h = Harness(block_size=4, budget=4)
    req = h.add("a", 8, max_tokens=3)                  # 2 prefill steps, then 2 decodes
    h.run()
    assert req.arrival_time == 0.0
    assert req.first_token_time == 1 * DT and req.token_times == [1 * DT, 2 * DT, 3 * DT]
    assert req.ttft == DT and req.tpot == DT and req.itl == [DT, DT]
    assert req.finish_time == 3 * DT


# ====================================================================== preemption
def _preemption_setup(num_blocks):
    h = Harness(block_size=4, num_blocks=num_blocks, budget=64, max_num_seqs=8)
    h.add("A", 4, max_tokens=8)
    h.add("B", 4, max_tokens=8)

    def on_step(i):
        if i == 3:
            h.add("C", 4, max_tokens=3)
    on_step.last = 3
    return h, on_step


def test_preemption_frees_newest_and_requeues_it_ahead_of_later_arrivals():
    h = Harness(block_size=4, num_blocks=5, budget=64)   # 4 usable blocks of 4 tokens
    A = h.add("A", 4, max_tokens=8)
    B = h.add("B", 4, max_tokens=8)
    for i in range(5):
        if i == 3:
            C = h.add("C", 4, max_tokens=3)              # a later arrival that finds no free block
        h.step()
    assert not any(st.preempted for st in h.steps)
    assert h.bm.num_free == 0 and [r.request_id for r in h.s.waiting] == ["C"]
    assert A.num_computed_tokens == 8 and B.num_computed_tokens == 8
    out = h.step()                                        # A needs its third block: B, the newest, goes
    assert [r.request_id for r in out.preempted] == ["B"]
    assert [(q.request.request_id, q.start, q.num_tokens) for q in out.seqs] == [("A", 8, 1)]
    assert B.status is RequestStatus.PREEMPTED and B.num_computed_tokens == 0 and B.num_preemptions == 1
    assert h.bm.table("B") == [] and len(h.bm.table("A")) == 3 and h.bm.num_free == 1
    assert h.s.num_preemptions == 1 and B not in h.s.running
    assert [r.request_id for r in h.s.waiting] == ["B", "C"]       # ahead of the later arrival
    assert len(B.output_ids) == 5                                   # its output so far is kept
    h.run()
    for r in (A, B, C):
        assert r.output_ids == expected_output(r, 512) and r.finish_reason == "length"
    assert h.first_step("C") > h.last_step("A")
    h.assert_all_free()


def test_preemption_outputs_match_ample_run():
    runs = {}
    for blocks in (5, 1000):
        h, on_step = _preemption_setup(blocks)
        h.run(on_step=on_step)
        runs[blocks] = ({r: q.output_ids for r, q in h.reqs.items()},
                        {r: q.finish_reason for r, q in h.reqs.items()}, h.s.num_preemptions)
        h.assert_all_free()
    assert runs[5][0] == runs[1000][0] and runs[5][1] == runs[1000][1]
    assert runs[5][2] > 0 and runs[1000][2] == 0


def test_preempted_request_recomputes_prompt_and_outputs_in_chunks():
    h = Harness(block_size=4, num_blocks=7, budget=8, max_num_seqs=4)   # 6 usable blocks
    h.add("A", 8, max_tokens=12)
    h.add("B", 8, max_tokens=12)
    h.run()
    A, B = h.reqs["A"], h.reqs["B"]
    assert B.num_preemptions >= 1 and A.num_preemptions == 0
    last = max(i for i, st in enumerate(h.steps) if "B" in st.preempted)
    sampled_before = sum(q[3] for st in h.steps[:last] for q in st.seqs if q[0] == "B")
    after = [(q[1], q[2], q[3]) for st in h.steps[last + 1:] for q in st.seqs if q[0] == "B"]
    # it restarts at position 0 and recomputes prompt + the outputs it already had, chunked by the budget,
    # then samples its next token (the kept outputs are not re-sampled)
    assert after[0][0] == 0
    assert all(a[0] + a[1] == b[0] for a, b in zip(after, after[1:]))
    first_sample = next(k for k, c in enumerate(after) if c[2])
    assert after[first_sample][0] + after[first_sample][1] == 8 + sampled_before
    assert all(n <= 8 for _, n, _ in after)
    assert all(r.output_ids == expected_output(r, 512) for r in h.reqs.values())
    h.assert_all_free()


def test_priority_decides_the_preemption_victim():
    h = Harness(block_size=4, num_blocks=5, budget=64)
    h.add("vip", 4, priority=-1, arrival=1.0, max_tokens=8)
    h.add("old", 4, priority=0, arrival=0.0, max_tokens=8)
    h.run()
    victims = [v for st in h.steps for v in st.preempted]
    assert victims and set(victims) == {"old"}
    assert h.reqs["vip"].num_preemptions == 0
    assert all(r.output_ids == expected_output(r, 512) for r in h.reqs.values())
    h.assert_all_free()


def test_self_preemption_when_nothing_newer_to_evict():
    """The oldest running request keeps its blocks; a newer one that cannot grow preempts itself."""
    h = Harness(block_size=4, num_blocks=6, budget=64, max_num_seqs=4)   # 5 usable
    h.add("A", 8, max_tokens=8)                        # needs 4 blocks at the end
    h.add("B", 8, max_tokens=4)                        # needs 3
    h.run()
    assert h.reqs["A"].num_preemptions == 0 and h.reqs["B"].num_preemptions >= 1
    assert all(r.output_ids == expected_output(r, 512) for r in h.reqs.values())
    h.assert_all_free()


def _random_workload(rng: random.Random, h: Harness, num: int, max_prompt: int, max_out: int,
                     max_n: int = 3, priorities=(0,)):
    arrivals: dict[int, list[dict]] = {}
    for k in range(num):
        n = rng.randint(1, max_n)
        spec = dict(rid=f"q{k}", prompt=[rng.randrange(3, 90) for _ in range(rng.randint(1, max_prompt))],
                    priority=rng.choice(priorities), max_tokens=rng.randint(1, max_out), n=n)
        arrivals.setdefault(rng.randrange(0, 3 * num), []).append(spec)
    last = max(arrivals)

    def on_step(i):
        for sp in arrivals.get(i, []):
            h.add(sp["rid"], sp["prompt"], priority=sp["priority"], max_tokens=sp["max_tokens"], n=sp["n"],
                  ignore_eos=True)
    on_step.last = last
    return on_step


def _run_random(seed: int, max_n: int, pool_factor: int, ridge: float = 0.0) -> dict:
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    max_model_len = 64
    cfgs = dict(block_size=bs, budget=rng.choice([8, 16, 32]), max_num_seqs=rng.choice([2, 4, 8]),
                max_model_len=max_model_len, ridge=ridge)
    results = {}
    # "small": room for pool_factor requests of the longest possible length (the engine rejects
    # requests that need more than the whole pool); "ample": never preempts
    for pool in ("small", "ample"):
        per_request = max_model_len // bs + 1
        h = Harness(num_blocks=(pool_factor if pool == "small" else 12 * max_n) * per_request + 1, **cfgs)
        on_step = _random_workload(random.Random(seed), h, num=12, max_prompt=30, max_out=30, max_n=max_n,
                                   priorities=(0, 0, 1, -1))
        h.run(on_step=on_step, max_steps=4000)
        for r in h.reqs.values():
            assert r.finished and r.finish_reason == "length"
            assert r.output_ids == expected_output(r, max_model_len), r.request_id
        h.assert_all_free()
        results[pool] = ({rid: r.output_ids for rid, r in h.reqs.items()}, h.s.num_preemptions)
    assert results["small"][0] == results["ample"][0]
    assert results["ample"][1] == 0
    return results


@pytest.mark.parametrize("seed", range(16))
def test_random_workloads_tight_pool_match_ample_pool(seed):
    """n = 1, a pool that holds just one maximal request: lots of preemption, same outputs."""
    _run_random(seed, max_n=1, pool_factor=1)


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_with_n_samples_match_ample_pool(seed):
    """n <= 3 with a pool of two maximal requests (a pool of one: see the livelock regression below)."""
    _run_random(seed, max_n=3, pool_factor=2)


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_with_bucket_cuts_match_ample_pool(seed):
    """Padding-aware chunking on (a ridge of 4 tokens: under a 32-token budget, steps of 17-24
    tokens are cut back to 16), n <= 3, tight pool: the same outputs, every invariant of the harness (one
    block of over-allocation at most: a cut row gives back the blocks it no longer needs)."""
    _run_random(seed, max_n=3, pool_factor=2, ridge=4.0)


def test_bucket_cut_hand_worked():
    """Four 40-token prompts at once, buckets 8..256, compute-bound from 40 tokens a step (a step of
    T tokens costs c(T) = max(40, its bucket)): 160 tokens would pad to 256. Cutting the newest row
    to 8 runs 128 (no padding): c(160) - c(128) = 128 saved now against c(32) = 40 for the 32 left
    over (no decode rows yet), so the cut is made. Next step: three decodes beside those 32, 35
    tokens: c(35) - c(32) = 64 - 40 = 24 saved by cutting 3 against c(6) - c(3) = 0 (they fit in
    the decodes' bucket of 8), so 29 go now and 3 with the last decodes."""
    h = Harness(block_size=16, budget=256, max_num_seqs=8, ridge=40.0)
    reqs = [h.add(r, prompt_of(40, base=10 + i), max_tokens=3) for i, r in enumerate("abcd")]
    h.step()
    assert h.steps[-1].seqs == [("a", 0, 40, True), ("b", 0, 40, True), ("c", 0, 40, True), ("d", 0, 8, False)]
    assert len(h.bm.table("d")) == 1          # 8 tokens: one block of 16, the other two given back
    h.step()
    assert h.steps[-1].seqs == [("a", 40, 1, True), ("b", 40, 1, True), ("c", 40, 1, True), ("d", 8, 29, False)]
    h.step()
    assert h.steps[-1].seqs == [("a", 41, 1, True), ("b", 41, 1, True), ("c", 41, 1, True), ("d", 37, 3, True)]
    h.run()
    for r in reqs:
        assert r.output_ids == expected_output(r, 512)
    h.assert_all_free()


@pytest.mark.parametrize("lens, ridge, want", [
    ([40], 40.0, [40]),            # 40 pads to 64: c(40) - c(32) = 24 saved against the 8's own step, c(8) = 40
    ([100, 100], 40.0, [100, 100]),  # 200: b = 128 leaves 72, whose own step (128) costs what the cut saves
    ([100, 40], 40.0, [100, 28]),  # 140: cut 12 (its own step: max(40, 16) < 256 - 128)
    ([130], 200.0, [130]),         # a GPU-like ridge: 256 - max(200, 128) = 56 < 200, no cut
])
def test_bucket_cut_only_where_it_cannot_lose(lens, ridge, want):
    h = Harness(block_size=16, budget=256, max_num_seqs=8, ridge=ridge)
    for i, n in enumerate(lens):
        h.add(f"r{i}", prompt_of(n, base=10 + i), max_tokens=2)
    h.step()
    assert [q[2] for q in h.steps[-1].seqs] == want


def test_bucket_cut_never_creeps_beside_a_full_decode_batch():
    """31 rows decoding (a budget of 64, buckets 8..64, compute-bound from 4 tokens) when a 9-token
    prompt arrives: 40 tokens pad to 64. Cutting 8 would run 32 now, but the 8 left over go beside
    the same 31 decodes next step, 39 tokens, padded to 64 again: c(40) - c(32) = 32 saved against
    c(39) - c(31) = 32 spent. No cut: the prompt is prefilled whole (a cut would have moved it on by
    one token a step, each step decoding every row once)."""
    h = Harness(block_size=4, budget=64, max_num_seqs=32, ridge=4.0)
    for i in range(31):
        h.add(f"d{i}", prompt_of(1, base=10 + i), max_tokens=20)
    h.step()                                  # 31 one-token prompts: 31 tokens, bucket 32, nothing to cut
    h.step()                                  # 31 decodes
    h.add("p", prompt_of(9, base=60), max_tokens=2)
    h.step()
    assert h.steps[-1].seqs[-1] == ("p", 0, 9, True)
    assert sum(q[2] for q in h.steps[-1].seqs) == 40
    h.run()
    h.assert_all_free()


def test_random_workloads_do_preempt():
    assert any(_run_random(seed, max_n=1, pool_factor=1)["small"][1] > 0 for seed in range(4))


# ====================================================================== aborts
def test_aborts_everywhere_leave_every_block_free():
    h = Harness(block_size=4, budget=16, max_num_seqs=3)
    h.add("run", 6, max_tokens=40)
    h.add("lead1", 30, max_tokens=5, n=3)              # aborted mid-prefill, before it forks
    h.add("prefilling", 40, max_tokens=5)              # aborted mid-prefill while its step runs
    h.add("waiting", 10, max_tokens=5)                 # aborted before it was ever admitted
    h.add("lead2", 30, max_tokens=30, n=3)             # a sample aborted before the fork, the leader after
    h.step()
    assert h.steps[-1].seqs == [("run", 0, 6, True), ("lead1", 0, 10, False)]
    h.s.abort("waiting")
    assert h.reqs["waiting"].finish_reason == "abort" and h.reqs["waiting"] not in h.s.waiting

    # abort an n>1 leader mid-prefill, before it forked: its pending samples end too, nothing leaks
    lead1 = h.reqs["lead1"]
    assert lead1 in h.s.running and lead1.pending_forks and h.bm.table("lead1")
    h.s.abort("lead1")
    for rid in ("lead1", "lead1#1", "lead1#2"):
        assert h.reqs[rid].finish_reason == "abort" and h.reqs[rid].finished
        assert rid not in h.s.requests and h.bm.table(rid) == []
    assert h.bm.num_used == 2                          # only "run"'s blocks

    # abort a running request mid-prefill while its step is "on the device"
    def abort_prefilling(out):
        assert any(q.request.request_id == "prefilling" and not q.sample for q in out.seqs)
        h.s.abort("prefilling")
    h.step(before_update=abort_prefilling)
    p = h.reqs["prefilling"]
    assert p.finish_reason == "abort" and p.num_computed_tokens < 40 and not p.output_ids
    assert h.bm.table("prefilling") == [] and p not in h.s.running

    # lead2: abort one sample before the fork, then the leader right after the fork
    while "lead2" not in [r.request_id for r in h.s.running]:
        h.step()
    assert h.reqs["lead2"].pending_forks
    h.s.abort("lead2#1")
    assert h.reqs["lead2#1"].finish_reason == "abort"
    while h.reqs["lead2"].pending_forks:
        h.step()
    assert h.reqs["lead2#1"] not in h.s.waiting and h.bm.table("lead2#1") == []
    c2 = h.reqs["lead2#2"]
    assert c2 in h.s.waiting + h.s.running and len(h.bm.table("lead2#2")) == 28 // 4
    shared = h.bm.table("lead2#2")
    assert all(h.bm.ref_counts[b] == 2 for b in shared)            # leader + the one live sample
    h.s.abort("lead2")
    assert all(h.bm.ref_counts[b] == 1 for b in shared)            # the sample keeps its prefix
    h.step()
    h.step()
    assert c2.output_ids                                            # and still decodes from it
    # abort the remaining forked sample while its decode step runs
    h.step(before_update=lambda out: h.s.abort("lead2#2"))
    assert c2.finish_reason == "abort"
    h.s.abort("lead2#2")                                            # aborting twice is harmless
    assert h.s.abort("no-such-request") is None
    h.run()
    assert h.reqs["run"].finish_reason == "length"
    h.assert_all_free()


def test_abort_of_forked_sample_before_admission():
    h = Harness(block_size=4, budget=64, max_num_seqs=2)
    h.add("L", 9, max_tokens=6, n=4)
    h.step()                                            # leader computes 8 tokens and forks
    kids = [h.reqs[f"L#{i}"] for i in (1, 2, 3)]
    assert all(k in h.s.waiting and k.num_computed_tokens == 8 for k in kids)
    assert all(h.bm.ref_counts[b] == 4 for b in h.bm.table("L")[:2])
    h.s.abort("L#2")
    h.s.abort("L#3")
    assert all(h.bm.ref_counts[b] == 2 for b in h.bm.table("L")[:2])
    h.run()
    assert kids[0].output_ids == expected_output(kids[0], 512)
    h.assert_all_free()


@pytest.mark.parametrize("seed", range(8))
def test_random_aborts_leave_every_block_free(seed):
    rng = random.Random(100 + seed)
    h = Harness(block_size=4, num_blocks=24, budget=16, max_num_seqs=4, max_model_len=64)
    wl = _random_workload(rng, h, num=14, max_prompt=30, max_out=25)

    def on_step(i):
        wl(i)
        live = [rid for rid, r in h.reqs.items() if not r.finished]
        if live and rng.random() < 0.25:
            h.s.abort(rng.choice(live))
    on_step.last = wl.last
    for i in range(4000):
        on_step(i)
        if not h.s.has_unfinished() and i > wl.last:
            break
        mid = (lambda out: h.s.abort(rng.choice([q.request.request_id for q in out.seqs]))) \
            if rng.random() < 0.15 else None
        out = h.step(before_update=lambda out: mid and out.seqs and mid(out))
        del out
    else:
        raise AssertionError("did not finish")
    h.assert_all_free()
    assert not h.s.requests
    assert all(r.finish_reason in ("length", "abort") for r in h.reqs.values())


# ====================================================================== memory
def test_over_allocation_at_most_one_block_per_sequence_each_step():
    """Explicitly: allocated slots - used slots <= block_size for every sequence, every step."""
    h = Harness(block_size=8, budget=20, max_num_seqs=4)
    for i in range(6):
        h.add(f"m{i}", 3 + 11 * i, max_tokens=9, n=1 + i % 2)
    worst = 0
    while h.s.has_unfinished():
        out = h.s.schedule()
        scheduled = {q.request.request_id: q.num_tokens for q in out.seqs}
        for r in h.s.running:
            alloc = len(h.bm.table(r.request_id)) * h.bm.block_size
            used = r.num_computed_tokens + scheduled.get(r.request_id, 0)
            assert used <= alloc <= used + h.bm.block_size - 1
            worst = max(worst, alloc - used)
        total_alloc = h.bm.num_used * h.bm.block_size
        total_used = sum(r.num_computed_tokens + scheduled.get(r.request_id, 0) for r in h.s.running)
        assert total_alloc - total_used <= h.bm.block_size * max(1, len(h.s.running))
        h.execute(out)
        h.s.update(out, {q.request.request_id: StepSample(token_of(q.request.request_id, q.start + q.num_tokens), 0.0)
                         for q in out.seqs if q.sample})
    assert worst > 0
    h.assert_all_free()


# ====================================================================== stop conditions
def test_max_tokens_finishes_with_length():
    h = Harness()
    r = h.add("a", 5, max_tokens=7)
    h.run()
    assert len(r.output_ids) == 7 and r.finish_reason == "length" and r.finished
    h.assert_all_free()


def _eos_at(k, tok=EOS, prompt_len=5):
    return lambda rid, pos: tok if pos == prompt_len + k else token_of(rid, pos)


def test_eos_finishes_with_stop():
    h = Harness(eos_ids=(EOS, 3), token_fn=_eos_at(3, tok=3))
    r = h.add("a", 5, max_tokens=50)
    h.run()
    assert len(r.output_ids) == 4 and r.output_ids[-1] == 3 and r.finish_reason == "stop"
    h.assert_all_free()


def test_ignore_eos_keeps_going_until_length():
    h = Harness(token_fn=_eos_at(3))
    r = h.add("a", 5, max_tokens=10, ignore_eos=True)
    h.run()
    assert len(r.output_ids) == 10 and r.output_ids[3] == EOS and r.finish_reason == "length"


def test_eos_ids_are_the_schedulers_not_a_default():
    h = Harness(eos_ids=(), token_fn=_eos_at(3))
    r = h.add("a", 5, max_tokens=6)
    h.run()
    assert len(r.output_ids) == 6 and r.finish_reason == "length"


def test_stop_token_ids_finish_with_stop_even_with_ignore_eos():
    h = Harness(token_fn=_eos_at(2, tok=77))
    r = h.add("a", 5, max_tokens=10, stop_token_ids=[77], ignore_eos=True)
    h.run()
    assert r.output_ids[-1] == 77 and len(r.output_ids) == 3 and r.finish_reason == "stop"
    h.assert_all_free()


def test_stop_on_the_last_allowed_token_is_stop():
    h = Harness(token_fn=_eos_at(3))
    r = h.add("a", 5, max_tokens=4)
    h.run()
    assert len(r.output_ids) == 4 and r.finish_reason == "stop"


def test_max_model_len_caps_generation():
    h = Harness(max_model_len=20, block_size=4)
    r = h.add("a", 12, max_tokens=100)
    h.run()
    assert len(r.output_ids) == 8 and r.num_tokens == 20 and r.finish_reason == "length"
    assert max(s + n for s, n, _ in h.chunks("a")) == 19     # never computes past the context
    h.assert_all_free()


def test_finished_request_gets_no_more_steps_and_update_returns_sampled():
    h = Harness(budget=64)
    h.add("a", 4, max_tokens=1)
    h.add("b", 4, max_tokens=3)
    out = h.s.schedule()
    got = h.s.update(out, {q.request.request_id: StepSample(5, -1.0, [(5, -1.0)]) for q in out.seqs})
    assert [r.request_id for r in got] == ["a", "b"]
    assert h.reqs["a"].finished and h.reqs["a"] not in h.s.running
    assert h.reqs["a"].output_top_logprobs == [[(5, -1.0)]] and h.reqs["a"].output_logprobs == [-1.0]
    out = h.s.schedule()
    assert [q.request.request_id for q in out.seqs] == ["b"]


# ====================================================================== static / dynamic
def test_static_next_batch_waits_for_whole_previous_batch():
    runs = {}
    for policy in ("static", "continuous"):
        h = Harness(policy=policy, max_num_seqs=2, budget=64)
        h.add("a", 5, max_tokens=2)
        h.add("b", 5, max_tokens=12)
        h.add("c", 5, max_tokens=3)
        h.add("d", 5, max_tokens=3)
        h.add("e", 5, max_tokens=3)
        h.run()
        assert max(len(st.running_after) for st in h.steps) <= 2
        h.assert_all_free()
        runs[policy] = h
    st = runs["static"]
    assert st.first_step("c") > st.last_step("b")           # not when a finished: when all did
    assert st.first_step("d") > st.last_step("b")
    assert st.first_step("e") > max(st.last_step("c"), st.last_step("d"))
    co = runs["continuous"]
    assert co.first_step("c") < co.last_step("b")           # continuous would have admitted c


def test_static_late_arrivals_do_not_join_the_running_batch():
    h = Harness(policy="static", max_num_seqs=4, budget=64)
    h.add("a", 5, max_tokens=6)
    h.step()
    h.add("b", 5, max_tokens=2)                             # room in the batch, but it started
    h.run()
    assert h.first_step("b") > h.last_step("a")
    h.assert_all_free()


def test_static_batch_with_n_samples_and_preemption_completes():
    h = Harness(policy="static", max_num_seqs=3, budget=16, block_size=4, num_blocks=12)
    h.add("a", 9, max_tokens=10, n=2)
    h.add("b", 9, max_tokens=10)
    h.add("c", 5, max_tokens=4)
    h.add("d", 5, max_tokens=4)
    h.run()
    first_batch = ["a", "a#1", "b"]
    assert h.first_step("c") > max(h.last_step(r) for r in first_batch) or \
        h.first_step("d") > max(h.last_step(r) for r in first_batch)
    for r in h.reqs.values():
        assert r.output_ids == expected_output(r, 512)
    h.assert_all_free()


def test_dynamic_waits_for_window_then_runs_batch_to_completion():
    h = Harness(policy="dynamic", max_num_seqs=3, budget=64, window=4 * DT)

    def on_step(i):
        if i == 0:
            h.add("a", 5, max_tokens=4)
        if i == 2:
            h.add("b", 5, max_tokens=6)
        if i == 5:
            h.add("c", 5, max_tokens=2)                      # arrives while a+b run
    on_step.last = 5
    h.run(on_step=on_step)
    start = h.first_step("a")
    assert all(not st.seqs for st in h.steps[:start])
    assert h.steps[start].t == 4 * DT                        # exactly when a has waited the window
    assert h.steps[start].ids() == ["a", "b"]
    ab_end = max(h.last_step("a"), h.last_step("b"))
    # c arrived at 5*DT: its window ends at 9*DT, but the a+b batch runs until ab_end
    assert h.first_step("c") == max(ab_end + 1, 9)
    assert h.steps[h.first_step("c")].t >= 5 * DT + 4 * DT
    h.assert_all_free()


def test_dynamic_forms_batch_at_once_when_max_num_seqs_wait():
    h = Harness(policy="dynamic", max_num_seqs=3, budget=64, window=1000.0)
    for r in ("a", "b"):
        h.add(r, 5, max_tokens=2)
    for _ in range(3):
        h.step()
    assert not any(st.seqs for st in h.steps)                # 2 < max_num_seqs and the window is huge
    h.add("c", 5, max_tokens=2)
    h.add("d", 5, max_tokens=2)
    h.step()
    assert h.steps[-1].ids() == ["a", "b", "c"]              # a full batch: no waiting for the window
    for _ in range(3):
        h.step()
    assert "d" not in [q for st in h.steps for q in st.ids()]   # d alone: waits for its window
    assert not h.s.running and h.s.waiting == [h.reqs["d"]]


# ====================================================================== n > 1
def test_n_samples_fork_and_share_prompt_blocks():
    h = Harness(block_size=4, budget=64)
    L = h.add("L", 10, max_tokens=5, n=3)
    assert L.fork_at == 8 and len(L.pending_forks) == 2
    assert h.s.num_unfinished() == 3 and h.s.has_unfinished()
    h.step()
    assert h.steps[-1].seqs == [("L", 0, 8, False)]          # the leader stops at the fork point
    kids = [h.reqs["L#1"], h.reqs["L#2"]]
    shared = h.bm.table("L")[:2]
    assert all(h.bm.table(k.request_id) == shared for k in kids)
    assert all(h.bm.ref_counts[b] == 3 for b in shared)      # ref count == n
    assert all(k.num_computed_tokens == 8 and k.status is RequestStatus.WAITING for k in kids)
    assert not L.pending_forks and not L.output_ids
    h.step()
    assert sorted(h.steps[-1].seqs) == [("L", 8, 2, True), ("L#1", 8, 2, True), ("L#2", 8, 2, True)]
    firsts = [r.output_ids[0] for r in (L, *kids)]
    assert firsts == [token_of(rid, 10) for rid in ("L", "L#1", "L#2")]   # each sample draws its own
    assert len(set(firsts)) == 3
    assert all(h.bm.ref_counts[b] == 3 for b in shared)
    assert all(h.bm.ref_counts[h.bm.table(r.request_id)[2]] == 1 for r in (L, *kids))   # private tails
    h.run()
    for r in (L, *kids):
        assert r.output_ids == expected_output(r, 512) and r.sample_index == int(r.request_id[2:] or 0)
    h.assert_all_free()


def test_n_samples_leader_prefill_chunked_before_fork():
    h = Harness(block_size=4, budget=6)
    h.add("L", 17, max_tokens=3, n=2)                        # fork_at = 16
    h.run()
    assert h.chunks("L")[:3] == [(0, 6, False), (6, 6, False), (12, 4, False)]
    assert h.chunks("L#1")[0] == (16, 1, True)
    assert h.first_step("L#1") == 3
    for r in h.reqs.values():
        assert r.output_ids == expected_output(r, 512)
    h.assert_all_free()


def test_n_samples_short_prompt_fork_immediately_without_sharing():
    h = Harness(block_size=4, budget=64)
    L = h.add("L", 4, max_tokens=3, n=3)                     # fork_at = 0
    assert L.fork_at == 0 and not L.pending_forks
    assert [r.request_id for r in h.s.waiting] == ["L", "L#1", "L#2"]
    h.step()
    assert h.steps[-1].seqs == [("L", 0, 4, True), ("L#1", 0, 4, True), ("L#2", 0, 4, True)]
    assert len({b for r in ("L", "L#1", "L#2") for b in h.bm.table(r)}) == 3
    h.run()
    h.assert_all_free()


def test_n_samples_block_aligned_prompt_keeps_last_block_private():
    h = Harness(block_size=4, budget=64)
    L = h.add("L", 8, max_tokens=2, n=2)
    assert L.fork_at == 4                                    # the block with the last prompt token is not shared
    h.step()
    assert h.bm.table("L#1") == h.bm.table("L")[:1]
    h.run()
    assert all(r.output_ids == expected_output(r, 512) for r in h.reqs.values())
    h.assert_all_free()


def test_n_samples_preempted_leader_and_samples_recover():
    h = Harness(block_size=4, budget=32, num_blocks=10, max_num_seqs=4)   # 9 usable
    h.add("L", 13, max_tokens=16, n=3)
    h.run()
    assert h.s.num_preemptions > 0
    for r in h.reqs.values():
        assert r.output_ids == expected_output(r, 512)
    h.assert_all_free()


# ============================================================ regressions (bugs found by these tests)
@pytest.mark.parametrize("policy,jump", [("static", "priority"), ("static", "arrival"), ("dynamic", "priority")])
def test_batch_member_not_blocked_by_request_that_sorts_ahead(policy, jump):
    h = Harness(policy=policy, max_num_seqs=2, budget=8, window=0.0)
    h.add("a", 8, max_tokens=3)
    h.add("b", 8, max_tokens=3)
    h.step()                                                 # batch {a, b}; only a fits the budget
    assert h.steps[-1].ids() == ["a"] and h.s.batch == {"a", "b"}
    if jump == "priority":
        h.add("vip", 4, priority=-1, max_tokens=2)
    else:
        h.add("vip", 4, arrival=-1.0, max_tokens=2)          # Engine.add_request(arrival_time=...)
    h.run(max_steps=200)


def test_abort_finish_time_uses_injected_clock():
    h = Harness()
    r = h.add("a", 5, max_tokens=5)
    h.step()
    h.s.abort("a")
    assert r.finish_time == h.clock()


def test_num_unfinished_excludes_aborted_pending_fork():
    h = Harness(block_size=4, budget=4)
    h.add("L", 20, max_tokens=3, n=3)
    h.step()
    h.s.abort("L#1")
    assert h.s.num_unfinished() == 2


def test_waiting_forked_sample_does_not_livelock_a_tight_pool():
    h = Harness(block_size=4, num_blocks=7, budget=4, max_num_seqs=2)   # 6 usable blocks
    h.add("A", 4, max_tokens=20)                       # needs all 6 blocks at the end: admissible
    h.add("L", 9, max_tokens=15, n=2)                  # L#1 forks at 8 and waits (max_num_seqs)
    h.run(max_steps=400)


def test_host_tier_never_imports_jax():
    import subprocess
    import sys

    code = ("import sys, jaxinfer.host.scheduler, jaxinfer.host.block_manager, jaxinfer.host.request; "
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_forks_continuing_a_cached_prompt_run_in_one_step():
    """n=3 samples of a 20-token prompt (block 16): after the leader's first 16 tokens, the leader
    and both forks each need 4 more tokens on top of a cached context. The attention takes any
    number of such chunks in a step, so all three run in the same one."""
    bm = BlockManager(64, 16)
    s = Scheduler(SchedulerConfig(policy="continuous", max_num_seqs=8, max_num_batched_tokens=16,
                                  max_model_len=128), bm)
    s.add(make_request("a", prompt_of(20), 16, n=3, max_tokens=3, ignore_eos=True))
    per_step, outputs = [], {}
    for _ in range(50):
        if not s.has_unfinished():
            break
        out = s.schedule()
        per_step.append(sum(q.start > 0 and q.num_tokens > 1 for q in out.seqs))
        for q in out.seqs:
            if q.sample:
                outputs.setdefault(q.request.request_id, 0)
                outputs[q.request.request_id] += 1
        s.update(out, {q.request.request_id: StepSample(7, 0.0) for q in out.seqs if q.sample})
    assert not s.has_unfinished() and sorted(outputs.values()) == [3, 3, 3]
    assert per_step[:3] == [0, 3, 0]   # first chunk; then the leader and both forks together
    assert sum(per_step) == 3          # each of the three samples continued its prompt once
    assert bm.num_used == 0


def test_speculation_load_policy_counts_waiting_sequences():
    """spec_k: K proposals while at most spec_max_batch sequences run or wait, none above; a burst
    counts as soon as it arrives (max_num_seqs 2 here: the third request waits), and speculation
    returns once the queue has drained."""
    h = Harness(max_num_seqs=2)
    h.s.cfg = dataclasses.replace(h.cfg, spec_tokens=3, spec_max_batch=2)
    h.s.propose = lambda req, k, depth: [-1] * k
    h.add("a", 5, max_tokens=4)
    h.add("b", 5, max_tokens=4)
    assert h.s.spec_k() == 3                       # two waiting
    h.add("c", 5, max_tokens=2)
    assert h.s.spec_k() == 0                       # three: off, though at most two will run at once
    h.step()
    assert len(h.s.running) == 2 and len(h.s.waiting) == 1 and h.s.spec_k() == 0
    while h.s.waiting or len(h.s.running) > 2:
        h.step()
    assert h.s.spec_k() == 3


def test_may_propose_whom_the_proposer_proposes_for():
    """may_propose (the engine waits for a row's last token only if its next step may hold
    proposals): while the policy speculates, the draft model's proposer proposes for a free row and
    never for one under a grammar; n-gram (and Medusa) propose under a grammar too; a bare callable
    may propose for anyone; with the policy off nobody is proposed for."""
    from types import SimpleNamespace
    from jaxinfer.host.speculative import Proposer
    h = Harness(max_num_seqs=2)
    h.s.cfg = dataclasses.replace(h.cfg, spec_tokens=3, spec_max_batch=1)
    free, guided = SimpleNamespace(guide=None), SimpleNamespace(guide=object())
    h.s.propose = Proposer("draft")
    assert h.s.may_propose(free) and not h.s.may_propose(guided)
    h.s.propose = Proposer("ngram")
    assert h.s.may_propose(free) and h.s.may_propose(guided)
    h.s.propose = lambda req, k, depth: [-1] * k
    assert h.s.may_propose(guided)
    h.add("a", 5, max_tokens=4)
    h.add("b", 5, max_tokens=4)                    # two sequences: above spec_max_batch, policy off
    assert h.s.spec_k() == 0 and not h.s.may_propose(free)


def _lazy_draft_harness(max_num_seqs: int = 4) -> Harness:
    """A draft-model engine's scheduler (proposals made on the device: -1 placeholders), one decode
    iteration per step, speculating while at most one sequence runs or waits."""
    h = Harness(max_num_seqs=max_num_seqs, budget=32, block_size=4)
    h.bm.enable_caching = True
    h.s.cfg = dataclasses.replace(h.cfg, spec_tokens=2, spec_max_batch=1, lazy_draft=True)
    h.s.propose = lambda req, k, depth: [-1] * k
    return h


def _spec_step(h: Harness) -> SchedulerOutput:
    """schedule -> one token per sampling row (every proposal rejected) -> update."""
    out = h.s.schedule()
    h.s.update(out, {q.request.request_id: StepSample(token_of(q.request.request_id, q.start + q.num_tokens), -0.5)
                     for q in out.seqs if q.sample})
    return out


def _rows(out: SchedulerOutput) -> list[tuple]:
    return [(q.request.request_id, q.start, q.num_tokens, q.draft_only, len(q.spec), q.sample) for q in out.seqs]


def test_lazy_draft_skips_steps_without_speculation_then_catches_up():
    """lazy_draft: while two sequences run (the policy keeps speculation off) no step runs the draft,
    prefill included, and its K/V lags; once one is left, a step of its catch-up chunk alone runs the
    draft only (the target has the K/V of those positions), then it speculates. Block size 4,
    prompts of 6: worked by hand below."""
    h = _lazy_draft_harness()
    a = h.add("a", 6, max_tokens=12)
    h.add("b", 6, max_tokens=3)
    out = _spec_step(h)                                # both prefill: no draft while speculation is off
    assert not out.run_draft and out.run_target and a.num_draft_computed == 0
    out = _spec_step(h)                                # two decode rows
    assert not out.run_draft and a.num_computed_tokens == 7 and a.num_draft_computed == 0
    assert h.bm.draft_stale[h.bm.table("a")].tolist() == [True, True]    # positions 0..6 lag
    out = _spec_step(h)                                # b draws its third token and finishes
    assert _rows(out) == [("a", 7, 1, 0, 0, True), ("b", 7, 1, 0, 0, True)] and not out.run_draft
    assert h.reqs["b"].finished and h.s.running == [a] and a.num_computed_tokens == 8 and a.num_draft_computed == 0
    out = _spec_step(h)                                # a alone: the draft catches up over 0..7
    assert _rows(out) == [("a", 0, 8, 8, 0, False)] and out.run_draft and not out.run_target
    assert a.num_draft_computed == a.num_computed_tokens == 8 and a.draft_catchup_end == 0
    assert not h.bm.draft_stale[h.bm.table("a")].any() and h.s.num_draft_catchup_tokens == 8
    out = _spec_step(h)                                # and speculates: its last token + 2 proposals
    assert _rows(out) == [("a", 8, 3, 0, 2, True)] and out.run_draft and out.run_target
    assert a.num_draft_computed == a.num_computed_tokens == 9     # one token drawn: the rest rolled back


def test_lazy_draft_cached_blocks_the_draft_never_wrote_are_recomputed():
    """A request that decoded without the draft leaves cached blocks holding the target's K/V but
    not the draft's: a later request that starts from them trusts the draft only up to the first
    stale block and catches up from there (a draft-only step: the shared blocks' target K/V is
    not written)."""
    h = _lazy_draft_harness()
    a = h.add("a", 6, max_tokens=6)
    out = _spec_step(h)                                # a alone: its prefill feeds the draft
    assert out.run_draft and a.num_draft_computed == 6
    h.add("b", 6, max_tokens=6)
    while h.s.has_unfinished():
        _spec_step(h)
    # a: 12 tokens, 11 computed, the draft's 6: block 0 (positions 0..3) valid, block 1 (4..7) stale
    assert a.num_draft_computed == 6 and h.bm.num_used == 0
    d = h.add("d", a.all_ids + [5, 6], max_tokens=4)
    out = _spec_step(h)                                # hits blocks 0 and 1; the draft trusts block 0
    assert _rows(out) == [("d", 8, 6, 0, 0, True)] and d.num_draft_computed == 4
    out = _spec_step(h)
    assert _rows(out) == [("d", 4, 10, 10, 0, False)] and not out.run_target
    assert [h.bm.ref_counts[b] for b in h.bm.table("d")[:2]] == [1, 1] and d.num_draft_computed == 14
    out = _spec_step(h)
    assert _rows(out) == [("d", 14, 3, 0, 2, True)]


def test_lazy_draft_rows_without_proposals_skip_the_draft():
    """A row the draft makes no proposals for (a row under a grammar: host/speculative.Proposer)
    decodes without the draft even while speculation is on, and never catches up."""
    h = _lazy_draft_harness()
    h.s.propose = lambda req, k, depth: []
    c = h.add("c", 6, max_tokens=5)
    out = _spec_step(h)
    assert out.run_draft and c.num_draft_computed == 6            # its prompt, while speculation is on
    for _ in range(4):
        out = _spec_step(h)
        (q,) = out.seqs
        assert out.speculating and not out.run_draft and (q.num_tokens, q.draft_only) == (1, 0)
    assert c.finished and c.num_draft_computed == 6 and h.s.num_draft_catchup_tokens == 0


def _harness_with(scheduling_policy: str, **kw) -> Harness:
    h = Harness(**kw)
    h.cfg = dataclasses.replace(h.cfg, scheduling_policy=scheduling_policy)
    h.s = Scheduler(h.cfg, h.bm, eos_ids=(EOS,), clock=h.clock)
    return h


@pytest.mark.parametrize("scheduling_policy,order", [
    # arrivals: low 0.0, mid_early 1.0, mid_late 2.0, high 3.0; one runs at a time
    ("fcfs", ["low", "mid_early", "mid_late", "high"]),           # arrival order, priorities ignored
    ("priority", ["high", "mid_early", "mid_late", "low"]),       # -1, then the two 0s by arrival, then 5
])
def test_scheduling_policy_orders_waiting_requests(scheduling_policy, order):
    h = _harness_with(scheduling_policy, max_num_seqs=1)
    h.add("low", 6, priority=5, arrival=0.0, max_tokens=2)
    h.add("high", 6, priority=-1, arrival=3.0, max_tokens=2)
    h.add("mid_late", 6, priority=0, arrival=2.0, max_tokens=2)
    h.add("mid_early", 6, priority=0, arrival=1.0, max_tokens=2)
    h.run()
    assert sorted(h.reqs, key=h.first_step) == order
    h.assert_all_free()


@pytest.mark.parametrize("scheduling_policy,order", [
    ("fcfs", ["a", "b", "urgent"]),          # urgent arrived last: it waits behind b
    ("priority", ["a", "urgent", "b"]),      # urgent's -5 goes before b's 0 (a already runs)
])
def test_scheduling_policy_for_a_late_urgent_request(scheduling_policy, order):
    h = _harness_with(scheduling_policy, max_num_seqs=1)
    h.add("a", 6, max_tokens=4)
    h.add("b", 6, max_tokens=4)
    h.step()
    h.add("urgent", 6, priority=-5, max_tokens=4)
    h.run()
    assert sorted(h.reqs, key=h.first_step) == order
    h.assert_all_free()


@pytest.mark.parametrize("scheduling_policy", ["fcfs", "priority"])
def test_scheduling_policy_is_arrival_order_without_priorities(scheduling_policy):
    """Requests that carry no priority run in arrival order under either policy (today's behaviour)."""
    h = _harness_with(scheduling_policy, max_num_seqs=1)
    h.add("second", 6, arrival=1.0, max_tokens=2)
    h.add("third", 6, arrival=2.0, max_tokens=2)
    h.add("first", 6, arrival=0.0, max_tokens=2)
    h.run()
    assert sorted(h.reqs, key=h.first_step) == ["first", "second", "third"]


def test_engine_passes_its_scheduling_policy_to_the_scheduler():
    """EngineConfig (default fcfs) -> ResolvedConfig -> the scheduler's config."""
    from jaxinfer.config import EngineConfig, ModelConfig, resolve_config
    from jaxinfer.engine import scheduler_config

    mc = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=8, ffn_dim=32,
                     max_position_embeddings=64)
    for given, want in ((None, "fcfs"), ("fcfs", "fcfs"), ("priority", "priority")):
        cfg = EngineConfig(num_blocks=9) if given is None else EngineConfig(num_blocks=9, scheduling_policy=given)
        assert scheduler_config(resolve_config(cfg, mc, backend="cpu")).scheduling_policy == want
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")


def test_waiting_forks_give_back_blocks_when_the_head_cannot_be_admitted():
    """Forked samples wait with their prompt's blocks; the request at the head of the queue (by
    priority; by the cache-aware admission's anti-starvation rule under the defaults) needs more
    blocks than are free, and nothing runs: the waiting samples' blocks come back (they recompute)
    instead of every later step scheduling nothing."""
    h = Harness(num_blocks=9, block_size=4, max_num_seqs=1, budget=32, max_model_len=64)   # 8 usable
    h.add("L", 17, max_tokens=3, n=3, ignore_eos=True)          # its samples fork at 16: 4 shared blocks
    for _ in range(3):
        h.step()
    h.add("X", 20, priority=-1, max_tokens=4, ignore_eos=True)  # its prompt needs 5 blocks
    h.run(max_steps=100)
    bm = BlockManager(9, 4, enable_caching=True)    # the defaults: prefix caching, cache-aware admission
    s = Scheduler(SchedulerConfig(policy="continuous", max_num_seqs=1, max_num_batched_tokens=32,
                                  max_model_len=32), bm)
    prompt = list(range(10, 27))
    for i, (rid, ids, n, max_tokens) in enumerate([("A", prompt, 1, 2), ("X", list(range(40, 60)), 1, 4),
                                                   ("L", prompt, 6, 3)]):
        s.add(make_request(rid, ids, 4, arrival=float(i > 0), n=n, max_tokens=max_tokens, ignore_eos=True))
        if rid == "A":   # A runs first and caches the prompt's 4 full blocks; L is admitted past X
            out = s.schedule()
            s.update(out, {q.request.request_id: StepSample(7, 0.0) for q in out.seqs if q.sample})
    for _ in range(300):
        if not s.has_unfinished():
            break
        out = s.schedule()
        s.update(out, {q.request.request_id: StepSample(7, 0.0) for q in out.seqs if q.sample})
    assert not s.has_unfinished() and bm.num_used == 0
