"""Prefix caching (host/block_manager.py, host/scheduler.py): requests that share a prompt prefix
reuse its cached KV blocks and see exactly what they would see recomputing it.

References: the same engine with enable_prefix_caching=False (itself proven equal to HF
transformers in test_hf_parity.py); hand-computed block hashes (hashlib), block counts and an
LRU eviction order worked out by hand on scripted sequences.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from jaxinfer import Generator, SamplingParams
from jaxinfer.host.block_manager import BlockManager, block_hash
from jaxinfer.host.request import Request
from jaxinfer.host.scheduler import MAX_PASSED_OVER, Scheduler, SchedulerConfig, StepSample

SMALL = dict(dtype="float32", max_model_len=96, max_num_batched_tokens=32, max_num_seqs=8, block_size=8,
             warmup=False)


def _small(**kw) -> dict:
    """SMALL with overrides and, unless given, an explicit pool of max_num_seqs sequences of
    max_model_len (+ the null block: what CPU sizes by itself), so that on a GPU an engine built while
    another is alive (the module's `warm`) does not find the device's memory taken by its pool."""
    kw = {**SMALL, **kw}
    kw.setdefault("num_blocks", kw["max_num_seqs"] * -(-kw["max_model_len"] // kw["block_size"]) + 1)
    # one step size, the budget: a program per engine instead of one per power of two up to it (the
    # suite's time; the buckets themselves are tested in test_engine.py)
    kw.setdefault("token_buckets", [kw["max_num_batched_tokens"]])
    return kw


def _shared_prompts(vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two rounds: the first fills the cache, the second reuses it (same 37-token prefix with new
    suffixes, a prompt repeated exactly, one exactly block aligned, and a 'next chat turn' that
    extends the first round's first prompt)."""
    rng = np.random.RandomState(seed)
    prefix = rng.randint(3, vocab, 37).tolist()
    first = [prefix + rng.randint(3, vocab, 5).tolist(), rng.randint(3, vocab, 20).tolist()]
    second = [prefix + rng.randint(3, vocab, 9).tolist(),     # the shared prefix, a new suffix
              list(first[1]),                                  # the same prompt again
              prefix[:32],                                     # exactly 4 cached blocks: computes its last
              first[0] + rng.randint(3, vocab, 12).tolist()]   # a longer prompt behind the whole first one
    return first, second


def _run(gen: Generator, prompts, params) -> list:
    """Per prompt, per sample: (token ids, finish reason, logprobs)."""
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.samples] for o in gen.generate(prompts, params)]


def _alone(gen: Generator, prompts, params) -> list:
    """The reference: each prompt alone from an empty prefix cache, so nothing is reused (the same
    compiled programs as the cached runs; the seeded draws depend on (seed, position) only)."""
    out = []
    for p, sp in zip(prompts, params if isinstance(params, list) else [params] * len(prompts)):
        gen.reset_prefix_cache()
        hits = gen.stats()["prefix_cache_hits"]
        out += _run(gen, [p], sp)
        assert gen.stats()["prefix_cache_hits"] == hits
    gen.reset_prefix_cache()
    return out


def _same(a: list, b: list) -> None:
    """Identical tokens and finish reasons; logprobs equal to float32 rounding. The cached K/V were
    computed in other steps than the recomputed ones (other rows beside them), so the logits may
    differ in their last bits: O(1) logits of these tiny models carry ~1e-7 absolute rounding per
    operation, a few hundred operations deep -> 1e-5 bounds it with room."""
    assert [[(t, f) for t, f, _ in x] for x in a] == [[(t, f) for t, f, _ in x] for x in b]
    for x, y in zip(a, b):
        for (_, _, lx), (_, _, ly) in zip(x, y):
            np.testing.assert_allclose(lx, ly, rtol=0, atol=1e-5)


def _drained(gen: Generator) -> bool:
    """Every block is free or cached-and-evictable: nothing is held once the requests end."""
    s = gen.stats()
    return s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


PARAMS = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1),
          SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, n=2),
          SamplingParams(max_tokens=9, temperature=1.0, seed=3, ignore_eos=True, repetition_penalty=1.2),
          SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)]


def _two_rounds(gen: Generator, seed: int, ample_pool: bool = True) -> None:
    """Round one fills the cache, round two reuses it; both equal the uncached reference."""
    first, second = _shared_prompts(gen.model_cfg.vocab_size, seed)
    ref = [_alone(gen, first, PARAMS[:2]), _alone(gen, second, PARAMS)]
    hits = gen.stats()["prefix_cache_hits"]
    _same(_run(gen, first, PARAMS[:2]), ref[0])
    _same(_run(gen, second, PARAMS), ref[1])
    # round two: 32 of the 46-token prompt, 16 of the repeated 20 (its last token is computed), 24 of
    # the block-aligned 32 (ditto), 40 of the 54-token next turn (a small pool may evict some first)
    assert gen.stats()["prefix_cache_hits"] - hits >= (32 + 16 + 24 + 40 if ample_pool else 1)
    assert gen.stats()["prefix_cache_blocks"] > 0 and _drained(gen)


def _evicting_workload(g: Generator) -> None:
    """Six requests behind a 24-token prefix, growing to ~60 tokens each, in a 14-block pool of 8
    tokens: cached blocks are evicted and running requests preempted."""
    rng = np.random.RandomState(11)
    vocab = g.model_cfg.vocab_size
    prefix = rng.randint(3, vocab, 24).tolist()
    prompts = [prefix + rng.randint(3, vocab, int(k)).tolist() for k in rng.randint(2, 12, 6)]
    params = [SamplingParams(max_tokens=28, temperature=0.8, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)] * 3
    ref = _alone(g, prompts, params)
    before = g.stats()
    _same(_run(g, prompts, params), ref)
    s = g.stats()
    assert s["num_preemptions"] > before["num_preemptions"] and s["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert s["prefix_cache_evictions"] > before["prefix_cache_evictions"] and _drained(g)


@pytest.mark.parametrize("name", ["llama-gqa-llama3", "mistral-window", "gpt2", "bloom-6heads-postnorm"])
def test_outputs_identical_with_and_without_reuse(name, hf_model_dir):
    # the fifth family (qwen2) runs the same check warmed up, in test_zero_compilations_after_warmup;
    # llama runs in a pool so small (14 blocks) that the cache evicts and requests are preempted
    small_pool = {"num_blocks": 15, "max_num_seqs": 6} if name == "llama-gqa-llama3" else {}
    g = Generator.from_pretrained(hf_model_dir(name), **_small(**small_pool))
    _two_rounds(g, seed=5, ample_pool=not small_pool)
    if small_pool:
        _evicting_workload(g)


@pytest.mark.parametrize("kw", [pytest.param(dict(attention="pallas"), marks=pytest.mark.device, id="pallas"),
                                pytest.param(dict(kv_dtype="int8"), id="int8-kv")])
def test_other_attention_paths_identical_with_caching(kw, hf_model_dir):
    g = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"),
                                  **_small(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4), **kw)
    rng = np.random.RandomState(1)
    prefix = rng.randint(3, 131, 19).tolist()
    prompts = [prefix + [5, 6], prefix + [7], prefix + [8, 9, 10]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = _alone(g, prompts, params)
    _same(_run(g, prompts, params), ref)
    assert g.stats()["prefix_cache_hits"] >= 2 * 16 and _drained(g)


@pytest.fixture(scope="module")
def warm(hf_model_dir):
    return Generator.from_pretrained(hf_model_dir("qwen2-window"), **_small(warmup=True, max_model_len=64))


def test_zero_compilations_after_warmup(warm):
    _two_rounds(warm, seed=9)
    assert warm.stats()["compilations_after_warmup"] == 0


def test_cache_salt_and_reset(warm):
    g = warm
    prompt = list(range(10, 50))            # 40 tokens: 4 blocks may be reused (the 5th holds the last)
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    g.reset_prefix_cache()
    a = g.generate([prompt], sp, cache_salt="tenant-a")[0]
    assert a.num_cached_tokens == 0
    assert g.generate([prompt], sp, cache_salt="tenant-b")[0].num_cached_tokens == 0   # another salt
    assert g.generate([prompt], sp)[0].num_cached_tokens == 0                          # no salt
    again = g.generate([prompt], sp, cache_salt="tenant-a")[0]
    assert again.num_cached_tokens == 32 and again.token_ids == a.token_ids
    assert g.reset_prefix_cache() > 0 and g.stats()["prefix_cache_blocks"] == 0
    assert g.generate([prompt], sp, cache_salt="tenant-a")[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="cache_salt"):
        g.engine.add_request(prompt, sp, cache_salt=3)
    assert g.stats()["compilations_after_warmup"] == 0 and _drained(g)


# ------------------------------------------------------------------ the host side alone (no model)

def _hand_hash(parent: bytes | None, tokens, salt: str = "") -> bytes:
    """The documented chain, written out: SHA-256 over the parent's hash (or the salt for the first
    block) and the block's token ids as int64, truncated to 16 bytes."""
    h = hashlib.sha256((b"root:" + salt.encode() + b"\x00") if parent is None else parent)
    h.update(np.asarray(tokens, "<i8").tobytes())
    return h.digest()[:16]


def test_block_hash_is_chained_and_salted():
    x = [7, 8, 9, 10]
    h1, h2 = _hand_hash(None, [1, 2, 3, 4]), _hand_hash(None, [5, 6, 7, 8])
    assert block_hash(None, [1, 2, 3, 4]) == h1
    assert block_hash(h1, x) == _hand_hash(h1, x)
    assert block_hash(h1, x) != block_hash(h2, x)                  # the same tokens behind another prefix
    assert block_hash(None, x, "a") == _hand_hash(None, x, "a") != block_hash(None, x, "b") != block_hash(None, x)


def test_no_cache_salt_spells_an_adapters_namespace():
    """The salt and the adapter salt the first block's hash as a pair: a base-model request whose
    cache_salt is what the adapter's part once was ("\\x00lora:1") never starts from blocks adapter
    1 computed, while the same adapter, or the same salt, does."""
    from jaxinfer.host.lora_slots import LoraSlots
    bm = BlockManager(32, 4, enable_caching=True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), bm, lora_slots=LoraSlots(2))
    prompt, p = list(range(10, 23)), SamplingParams(max_tokens=1, ignore_eos=True)   # 3 full blocks

    def start(**kw) -> int:   # the first token the request computes (its cached prefix), then run it
        req = Request(f"r{len(s.requests)}-{kw}", list(prompt), p, 0, **kw)
        s.add(req)
        out = s.schedule()
        first = next(q.start for q in out.seqs if q.request is req)
        while s.has_unfinished():
            s.update(out, {q.request.request_id: StepSample(5, 0.0) for q in out.seqs if q.sample})
            out = s.schedule() if s.has_unfinished() else out
        return first

    assert start(lora_id=1) == 0
    assert start(cache_salt="\x00lora:1") == 0 and start(cache_salt="[null, 1]") == 0
    assert start(lora_id=1) == 12 and start(cache_salt="\x00lora:1") == 12


def _scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
               caching: bool = True):
    bm = BlockManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(SchedulerConfig(policy="continuous", max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=64), bm), bm


def _req(rid: str, prompt: list[int], max_tokens: int = 2, n: int = 1, salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, n=n)
    req = Request(rid, list(prompt), params, seed=0, cache_salt=salt)
    # what Engine.add_request does for n > 1: the samples fork after the prompt's last full block
    req.pending_forks = [Request(f"{rid}#{i}", list(prompt), params, seed=0, sample_index=i, cache_salt=salt)
                         for i in range(1, n)]
    req.fork_at = (len(prompt) - 1) // 4 * 4
    return req


def _step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update(out, {q.request.request_id: StepSample(token, 0.0) for q in out.seqs if q.sample})
    return out


def _drain(s: Scheduler) -> list:
    plans = []
    while s.has_unfinished():
        plans.append(_step(s))
    return plans


def test_scheduler_reuses_the_longest_cached_chain_and_computes_the_last_token():
    s, bm = _scheduler()
    prompt = list(range(10, 22))                       # 12 tokens: 3 full blocks of 4
    s.add(_req("a", prompt))
    _drain(s)
    assert bm.num_cached == 3 and bm.num_used == 0     # a's prompt blocks (its output block is partial)
    # the whole prompt is cached: its last block is recomputed (the last token's logits are needed)
    s.add(_req("b", prompt))
    plan = s.schedule()
    assert [(q.start, q.num_tokens) for q in plan.seqs] == [(8, 4)]
    s.update(plan, {"b": StepSample(7, 0.0)})
    _drain(s)
    # 13 tokens: all 3 blocks reused, 1 token computed
    s.add(_req("c", prompt + [30]))
    assert [(q.start, q.num_tokens) for q in s.schedule().seqs] == [(12, 1)]
    # the same tokens behind a different first block match nothing after it
    s2, _ = _scheduler()
    s2.add(_req("x", prompt))
    _drain(s2)
    s2.add(_req("y", [99, 98, 97, 96] + prompt[4:]))
    assert [(q.start, q.num_tokens) for q in s2.schedule().seqs] == [(0, 12)]
    # a salt enters the first block: the same prompt under another salt matches nothing
    s2.add(_req("z", prompt, salt="other"))
    plan = s2.schedule()
    assert [(q.request.request_id, q.start) for q in plan.seqs if q.request.request_id == "z"] == [("z", 0)]
    assert s2.prefix_hits == 0 and s2.prefix_queries == 12 + 12 + 12
    # caching off: nothing is registered, looked up or counted
    s3, bm3 = _scheduler(caching=False)
    for rid in ("p", "q"):
        s3.add(_req(rid, prompt))
        assert [(q.start, q.num_tokens) for q in _drain(s3)[0].seqs] == [(0, 12)]
    assert bm3.num_cached == 0 and s3.prefix_queries == s3.prefix_hits == 0


def test_n_samples_share_their_prompt_blocks():
    s, bm = _scheduler()
    prompt = list(range(10, 27))                       # 17 tokens: 4 full blocks, the 5th holds the last
    s.add(_req("a", prompt, max_tokens=3, n=3))
    out = s.schedule()
    s.update(out, {q.request.request_id: StepSample(7, 0.0) for q in out.seqs if q.sample})
    out = s.schedule()                                 # the two forked samples compute the last token
    tables = {r: list(bm.table(r)) for r in ("a", "a#1", "a#2")}
    assert tables["a#1"][:4] == tables["a#2"][:4] == tables["a"][:4]
    # 4 shared + one last-token block each: 7 blocks, not 15
    assert len({b for t in tables.values() for b in t}) == 4 + 3
    assert all(bm.ref_counts[b] == 3 for b in tables["a"][:4])
    s.update(out, {q.request.request_id: StepSample(7, 0.0) for q in out.seqs if q.sample})
    _drain(s)
    # a second n=3 request for the same prompt: every sample starts from the first one's cached blocks
    s.add(_req("b", prompt, max_tokens=2, n=3))
    out = s.schedule()
    assert sorted((q.request.request_id, q.start, q.num_tokens) for q in out.seqs) == \
        [("b", 16, 1), ("b#1", 16, 1), ("b#2", 16, 1)]
    assert bm.table("b")[:4] == bm.table("b#1")[:4] == tables["a"][:4]
    s.update(out, {q.request.request_id: StepSample(7, 0.0) for q in out.seqs})
    _drain(s)
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks - 1


def test_eviction_order_is_lru_deepest_first():
    bm = BlockManager(9, 4, enable_caching=True)      # blocks 1..8
    hA = [b"A0", b"A1", b"A2"]
    hB = [b"B0", b"B1"]
    assert bm.allocate("A", 12) and bm.table("A") == [1, 2, 3]
    bm.register("A", hA, 3)
    assert bm.allocate("B", 10) and bm.table("B") == [4, 5, 6]
    bm.register("B", hB, 2)                            # B's third block is partial: never cached
    bm.free("A")                                       # deepest first to the tail: 3, 2, 1
    bm.free("B")                                       # its partial block 6 to the head; then 5, 4
    assert bm.free_blocks == [6, 7, 8, 3, 2, 1, 5, 4]
    assert bm.num_free == 8 and bm.num_cached == 5
    # C hits A's first two blocks: they leave the queue; its two new blocks come from the head
    hits = bm.lookup([b"A0", b"A1", b"Zz"])
    assert hits == [1, 2]
    assert bm.allocate("C", 16, prefix=hits) and bm.table("C") == [1, 2, 6, 7]
    assert bm.free_blocks == [8, 3, 5, 4]
    # D needs three blocks: 8 (never cached), then 3 (A's deepest block, evicted), then 5 (B's second)
    assert bm.allocate("D", 12) and bm.table("D") == [8, 3, 5]
    assert bm.num_evictions == 2 and sorted(bm.cached) == [b"A0", b"A1", b"B0"]
    assert bm.lookup(hA) == [1, 2] and bm.lookup(hB) == [4]
    # not enough blocks for E with a prefix: nothing changes
    before = (bm.free_blocks, dict(bm.tables), bm.ref_counts.copy())
    assert not bm.allocate("E", 12, prefix=[4])
    assert (bm.free_blocks, dict(bm.tables)) == before[:2] and (bm.ref_counts == before[2]).all()
    bm.free("C")                                       # 7, 6 uncached to the head; 2, 1 to the tail
    assert bm.free_blocks == [6, 7, 4, 2, 1]
    assert bm.reset_cache() == 3 and bm.num_cached == 0 and bm.free_blocks == [6, 7, 4, 2, 1]
    assert bm.lookup(hA) == [] and bm.allocate("F", 4) and bm.table("F") == [6] and bm.num_evictions == 2


def test_cache_aware_admission_prefers_cached_prefixes_without_starving():
    # one sequence at a time: admission order is all that differs
    s, bm = _scheduler(max_num_seqs=1)
    cached = list(range(10, 30))                     # 20 tokens, 5 blocks of 4
    s.add(_req("warm", cached, max_tokens=1))
    _drain(s)
    s.add(_req("cold", list(range(50, 70)), max_tokens=1))
    for i in range(MAX_PASSED_OVER + 2):
        s.add(_req(f"hit{i}", cached + [i], max_tokens=1))
    order = []
    while s.has_unfinished():
        out = _step(s)
        order += [q.request.request_id for q in out.seqs if q.start == 0 or q.request.request_id.startswith("hit")]
    order = list(dict.fromkeys(order))
    # the cached ones go first, until "cold" has been passed over MAX_PASSED_OVER times
    assert order == [f"hit{i}" for i in range(MAX_PASSED_OVER)] + ["cold", "hit4", "hit5"]
    # without caching: plain FCFS
    s, _ = _scheduler(max_num_seqs=1, caching=False)
    for rid, p in (("cold", list(range(50, 70))), ("hit0", cached)):
        s.add(_req(rid, p, max_tokens=1))
    assert [q.request.request_id for q in s.schedule().seqs] == ["cold"]


def test_async_launch_registers_blocks_for_the_next_step():
    """A prompt's full blocks are cached when the step computing them is dispatched: the next step,
    planned before its tokens come back, already reuses them (it runs after on the device)."""
    s, bm = _scheduler(budget=8)
    prefix = list(range(10, 26))                      # 16 tokens
    s.add(_req("a", prefix + [1, 2]))
    p1 = s.schedule()
    s.launched(p1)                                    # 8 tokens dispatched: blocks 0-1 written in flight
    assert bm.num_cached == 2
    s.add(_req("b", prefix + [3]))
    p2 = s.schedule()
    assert [(q.request.request_id, q.start, q.num_tokens) for q in p2.seqs] == [("a", 8, 8)]
    s.launched(p2)
    s.update(p1, {})
    p3 = s.schedule()                                 # a's last 2 tokens; b starts after 4 cached blocks
    assert [(q.request.request_id, q.start, q.num_tokens) for q in p3.seqs] == [("a", 16, 2), ("b", 16, 1)]
