"""The prefix cache's host tier (host/host_tier.py, host/block_manager.py, jaxinfer/kv_transfer.py;
EngineConfig.kv_offload_bytes): cached blocks evicted from the device pool kept in host memory and
restored on a hit.

References: LRU orders, slots and transfer lists worked out by hand; the scheduler test harness's
fake device (tests/test_scheduler.py), whose every slot records the (token, position) written there,
so a restored block with foreign or stale K/V fails the read check; numpy indexing of the pages for
the byte moves; and the same engine with the tier off (greedy outputs; itself equal to HF
transformers in test_hf_parity.py and to recomputation in test_prefix_cache.py).
"""
from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from jaxinfer import Generator, SamplingParams
from jaxinfer.host.block_manager import BlockManager, block_hash
from jaxinfer.host.host_tier import HostHit, HostTier
from jaxinfer.host.scheduler import Scheduler
from tests.test_scheduler import EOS, Harness, expected_output

# ------------------------------------------------------------------ the host side alone (no jax)


def _chain(tokens: list[int], bs: int, salt: str | None = None) -> list[bytes]:
    out = []
    for i in range(len(tokens) // bs):
        out.append(block_hash(out[-1] if out else None, tokens[i * bs: (i + 1) * bs], salt))
    return out


def test_host_tier_lru_by_bytes_and_transfer_lists():
    """4 usable blocks of 4 tokens, a tier of 2.5 blocks' bytes (2 slots). a's 3 cached blocks are
    evicted by b (4 blocks): the tier keeps the last two offloaded, h3's entry (the least recently
    used) giving its slot to h1. Worked by hand: free queue [4, 3, 2, 1] after a; b takes 4 (no hash),
    then 3, 2, 1; slots are handed out 0, 1, then 0 again."""
    tier = HostTier(budget_bytes=250, block_bytes=100)
    assert tier.num_slots == 2
    bm = BlockManager(5, 4, enable_caching=True, host_tier=tier)
    prompt = list(range(10, 22))
    h1, h2, h3 = _chain(prompt, 4)
    assert bm.allocate("a", 12) and bm.table("a") == [1, 2, 3]
    bm.register("a", [h1, h2, h3], 3)
    bm.free("a")
    assert bm.lookup([h1, h2, h3]) == [1, 2, 3]
    assert bm.allocate("b", 16) and bm.table("b") == [4, 3, 2, 1]
    assert bm.lookup([h1, h2]) == []                   # being offloaded: not in the slots yet
    t = bm.take_transfers()
    assert t.offload == [(3, 0), (2, 1), (1, 0)] and t.restore == []
    assert list(tier.entries.items()) == [(h2, 1), (h1, 0)] and tier.bytes_held == 200
    assert bm.lookup([h1, h2, h3]) == [HostHit(h1, 0), HostHit(h2, 1)]
    bm.free("b")                                       # no hashes: back at the head, [4, 3, 2, 1]
    hits = bm.lookup([h1, h2])
    assert bm.allocate("c", 12, prefix=hits) and bm.table("c") == [4, 3, 2]
    t = bm.take_transfers()
    assert t.restore == [(0, 4), (1, 3)] and t.offload == []
    assert bm.lookup([h1, h2]) == [4, 3]               # cached on the device again
    assert list(tier.entries) == [h1, h2]              # inclusive: the host copies stay (h2 most recent)
    tier.check()
    # a re-eviction of a block the tier holds costs no copy
    bm.free("c")
    assert bm.allocate("d", 16) and bm.take_transfers().offload == []
    assert bm.reset_cache() == 2 and tier.num_held == 0
    tier.check()


def test_host_tier_hashes_are_salted_and_pins_hold():
    """Tenants: an entry is keyed by the salted chain, so another salt (or none) never finds it.
    A 1-slot tier whose only entry is being restored keeps it: an eviction in the same step is not
    offloaded (its slot is pinned until the step's transfers are taken)."""
    tier = HostTier(budget_bytes=100, block_bytes=100)
    bm = BlockManager(3, 4, enable_caching=True, host_tier=tier)
    [ha], [hb] = _chain([5, 6, 7, 8], 4, "tenant-a"), _chain([9, 9, 9, 9], 4)
    assert bm.allocate("a", 4) and bm.allocate("b", 4)
    bm.register("a", [ha], 1), bm.register("b", [hb], 1)
    bm.free("a"), bm.free("b")                         # queue [1 (ha), 2 (hb)]
    assert bm.allocate("x", 4)                         # evicts ha -> slot 0
    assert bm.take_transfers().offload == [(1, 0)]
    assert bm.lookup(_chain([5, 6, 7, 8], 4, "tenant-b")) == [] and bm.lookup(_chain([5, 6, 7, 8], 4)) == []
    assert bm.lookup([ha]) == [HostHit(ha, 0)]
    bm.free("x")
    # restoring ha takes a block: queue [1, 2 (hb)] -> 1; then one more block evicts hb, whose
    # offload finds the only slot pinned by ha's restore
    assert bm.allocate("y", 8, prefix=[HostHit(ha, 0)]) and bm.table("y") == [1, 2]
    t = bm.take_transfers()
    assert t.restore == [(0, 1)] and t.offload == [] and tier.offload_skipped == 1
    assert bm.lookup([hb]) == [] and list(tier.entries) == [ha]
    tier.check()


def test_budget_smaller_than_a_block_is_refused():
    with pytest.raises(ValueError, match=r"smaller than one KV block \(4096 bytes"):
        HostTier(budget_bytes=4095, block_bytes=4096)


class TierHarness(Harness):
    """The scheduler harness with a host tier: each step's transfers move the fake device's slots
    (token, position) to and from a fake host array in the documented order; restores fail at
    random when fail_rate > 0 (the failed blocks are scribbled over: reading them fails the check)."""

    def __init__(self, slots: int, fail_rate: float = 0.0, seed: int = 0, **kw):
        super().__init__(**kw)
        bs = self.bm.block_size
        self.bm = BlockManager(self.bm.num_blocks, bs, enable_caching=True, host_tier=HostTier(slots, 1))
        self.s = Scheduler(self.cfg, self.bm, eos_ids=(EOS,), clock=self.clock)
        self.host = np.full((slots, bs, 2), -1, np.int64)
        self.fail_rate, self.rng = fail_rate, random.Random(seed)
        self.restored = self.failed = 0

    def execute(self, out) -> None:
        bs, t = self.bm.block_size, self.bm.take_transfers()
        kv = self.kv.reshape(-1, bs, 2)
        staged = [(slot, kv[block].copy()) for block, slot in t.offload]       # 1. read the offloads
        failed = []
        for slot, block in t.restore:                                          # 2. write the restores
            if self.rng.random() < self.fail_rate:
                failed.append(block)
                kv[block] = -7
                self.bm.host.drop([slot])
            else:
                kv[block] = self.host[slot]
        for slot, rows in staged:                                              # 3. store the offloads
            self.host[slot] = rows
        self.restored += len(t.restore) - len(failed)
        self.failed += len(failed)
        if failed:
            self.bm.restore_failed(failed)
            self.s.recompute(out, failed)
        super().execute(out)

    def check_state(self) -> None:
        super().check_state()
        self.bm.host.check()


def _conversations(h: Harness, rng: random.Random, convs: int, turns: int, system: int):
    """Multi-turn, in rounds: once every conversation's turn has ended, each sends its next, which
    resends a shared system prompt, its whole history (prompts and outputs) and a new message; so
    a conversation returns after the others' turns have run (and evicted its blocks)."""
    system_ids = [rng.randrange(3, 90) for _ in range(system)]
    history = [list(system_ids) for _ in range(convs)]
    live: list = []

    def on_step(i):
        if live and not all(r.finished for r in live):
            return
        for c, req in enumerate(live):
            history[c] = req.prompt_ids + req.output_ids
        turn = len(on_step.rounds)
        if turn == turns:
            on_step.last = -1
            return
        live[:] = [h.add(f"c{c}t{turn}", history[c] + [rng.randrange(3, 90) for _ in range(rng.randint(2, 8))],
                         max_tokens=rng.randint(1, 4), ignore_eos=True) for c in range(convs)]
        on_step.rounds.append(i)
    on_step.rounds, on_step.last = [], 10**9
    return on_step


@pytest.mark.parametrize("seed", range(6))
def test_random_multiturn_restores_the_right_kv(seed):
    """Random multi-turn workloads in a pool that holds about a quarter of the histories: blocks are
    evicted to the tier and restored; every position any step reads holds the (token, position) its
    request wrote there (the harness's check), outputs are the fake sampler's, nothing leaks
    (blocks, host slots), and with failing restores (odd seeds: a quarter fail) the requests
    recompute instead."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    h = TierHarness(slots=rng.choice([3, 8, 40]), fail_rate=0.25 if seed % 2 else 0.0, seed=seed,
                    num_blocks=64 // bs + 1, block_size=bs, budget=rng.choice([8, 16]), max_num_seqs=4,
                    max_model_len=64)
    h.run(on_step=_conversations(h, rng, convs=5, turns=4, system=rng.randint(6, 10)), max_steps=4000)
    for r in h.reqs.values():
        assert r.finished and r.output_ids == expected_output(r, 64), r.request_id
    h.assert_all_free()
    assert h.restored > 0 and (h.failed > 0) == bool(seed % 2)
    assert h.bm.host.hits == h.restored + h.failed


# ------------------------------------------------------------------ the bytes (jax, no model)

@pytest.mark.parametrize("kv_dtype,copy", [("float32", "in_program"), ("int8", "in_program"), ("bfloat16", "in_program"),
                                           ("fp8", "in_program"), ("int8", "before"), ("float32", "fallback")])
def test_transfers_move_every_leaf_in_order(kv_dtype, copy, caplog):
    """HostKVStore on a (target, draft) pair of page lists with random contents (int8 and fp8: codes
    and float32 scales, packed into one host row per block, each leaf in its own dtype's bytes): block
    3 goes to slot 0 while slot 0's earlier contents (block 5's) come back into block 3 in the same
    step, and slot 1 (block 6) into block 7: numpy's indexing of the pages before the step is the
    reference. The rows are held in pinned host memory; a restore copies them to the device in the
    scatter program ("in_program"), before it ("before": copy_in_program=False), or before it because
    warm-up found the program's own copies failing ("fallback": a scatter that refuses pinned rows).
    The draft's pages are latent attention's (K pages only: its V leaves are empty)."""
    import jax

    from jaxinfer.kv_cache import init_kv_pages, kv_storage_dtype
    from jaxinfer.host.host_tier import KVTransfers
    from jaxinfer.kv_transfer import HostKVStore

    rng = np.random.default_rng(0)
    dt = kv_storage_dtype(kv_dtype)
    # the draft's pages shared-value (latent attention's: V and its scales empty, nothing of them moved)
    pages = (init_kv_pages(2, 2, 8, 9, 4, dt), init_kv_pages(1, 1, 8, 9, 4, dt, value_dim=0))

    def fill(x):
        vals = rng.standard_normal(x.shape) * 50
        return jax.device_put(np.asarray(vals).astype(x.dtype), jax.devices()[0])
    pages = jax.tree.map(fill, pages)
    store = HostKVStore(pages, num_slots=2, copy_in_program=copy != "before")
    assert store.block_bytes == sum(x.nbytes // 9 for x in jax.tree.leaves(pages))
    if copy == "fallback":
        real = store._scatter

        def refuses_pinned(pages, blocks, rows):
            if any(r.sharding.memory_kind == "pinned_host" for per_block in rows for r in per_block):
                raise RuntimeError("host memory space not supported here")
            return real(pages, blocks, rows)
        store._scatter = refuses_pinned
    pages = store.warmup(pages)
    assert [g.copied_in_program for g in store.groups] == [copy == "in_program"]
    assert ("cannot copy from pinned host memory itself" in caplog.text) == (copy == "fallback")
    before = [np.asarray(x) for x in jax.tree.leaves(pages)]
    pages, res = store.run(pages, KVTransfers(offload=[(5, 0), (6, 1)]))
    assert not res.failed_slots and not res.failed_blocks
    assert all(r.sharding.memory_kind == "pinned_host" for r in jax.tree.leaves(store.rows))
    pages, res = store.run(pages, KVTransfers(offload=[(3, 0)], restore=[(0, 3), (1, 7)]))
    after = [np.asarray(x) for x in jax.tree.leaves(pages)]
    for b, a in zip(before, after):
        want = b.copy()
        want[:, 3], want[:, 7] = b[:, 5], b[:, 6]
        np.testing.assert_array_equal(a, want)
    pages, _ = store.run(pages, KVTransfers(restore=[(0, 1)]))      # slot 0 now holds block 3's old bytes
    for b, a in zip(before, (np.asarray(x) for x in jax.tree.leaves(pages))):
        np.testing.assert_array_equal(a[:, 1], b[:, 3])
    assert store.bytes_offloaded == 3 * store.block_bytes and store.bytes_restored == 3 * store.block_bytes


# ------------------------------------------------------------------ the engine

ENGINE = dict(dtype="float32", max_model_len=88, max_num_batched_tokens=16, token_buckets=[16], max_num_seqs=4,
              block_size=8, num_blocks=12, warmup=False)   # 11 blocks of 8: the conversations hold ~3x that
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)


def _multiturn(gen: Generator, convs: int = 4, turns: int = 3, seed: int = 0) -> list:
    """Turns in rounds (bench/multiturn.py's shape): each resends a shared 20-token system prompt,
    the conversation's history and a new message; one request at a time, so each conversation
    returns after the others have evicted its blocks from the 11-block pool. Per turn: (prompt
    length, output tokens, cached tokens, logprobs)."""
    rng = np.random.RandomState(seed)
    vocab = gen.model_cfg.vocab_size
    system = rng.randint(3, vocab, 20).tolist()
    history = [list(system) for _ in range(convs)]
    out = []
    for _ in range(turns):
        for c in range(convs):
            prompt = history[c] + rng.randint(3, vocab, 6).tolist()
            o = gen.generate([prompt], GREEDY)[0]
            out.append((len(prompt), o.samples[0].token_ids, o.num_cached_tokens, o.samples[0].logprobs))
            history[c] = prompt + o.samples[0].token_ids
    return out


def _same_tokens(a: list, b: list) -> None:
    """Identical greedy tokens; logprobs equal to float32 rounding (cached K/V were computed in other
    steps than recomputed ones: test_prefix_cache._same's bound)."""
    assert [x[1] for x in a] == [x[1] for x in b]
    for x, y in zip(a, b):
        np.testing.assert_allclose(x[3], y[3], rtol=0, atol=1e-5)


def _no_leak(gen: Generator) -> None:
    s = gen.stats()
    assert s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
    gen.engine.blocks.host.check()


@pytest.fixture(scope="module")
def llama(hf_model_dir):
    return hf_model_dir("llama-gqa-llama3")


@pytest.fixture(scope="module")
def reference(llama):
    """The tier off (today's engine: prefix caching with the device pool only)."""
    g = Generator.from_pretrained(llama, **ENGINE)
    return _multiturn(g), g.stats()


def test_greedy_identical_with_the_tier_and_restored_tokens_count_as_cached(llama, reference):
    """The tier on (room for every block) in the 11-block pool: the greedy outputs of the tier off,
    and every turn finds as many tokens cached as the tier-off engine does in a pool that never
    evicts (64 blocks): what the pool evicted comes back from the host, and counts as cached.
    Nothing compiled after warm-up; the stats agree with each other and with a block's bytes by
    hand (2 layers x K,V x 2 KV heads x head_dim 16 x 4 bytes x 8 tokens)."""
    ref, ref_stats = reference
    ample = _multiturn(Generator.from_pretrained(llama, **{**ENGINE, "num_blocks": 64}))
    g = Generator.from_pretrained(llama, **{**ENGINE, "warmup": True}, kv_offload_gb=1 / 1024)
    out = _multiturn(g)
    _same_tokens(out, ref)
    _same_tokens(out, ample)
    block_bytes = 2 * 2 * 2 * 16 * 4 * 8
    assert g.engine.blocks.host.block_bytes == block_bytes
    assert [t[2] for t in out] == [t[2] for t in ample]
    s = g.stats()
    assert s["compilations_after_warmup"] == 0
    assert s["kv_host_hits"] > 0 and s["kv_host_bytes_restored"] == s["kv_host_hits"] * block_bytes
    assert s["kv_host_bytes"] == s["kv_host_blocks"] * block_bytes > 0
    assert s["kv_host_bytes_offloaded"] >= s["kv_host_bytes"] and s["kv_host_restore_time_s"] > 0
    assert s["kv_host_budget_bytes"] == 2**20 and s["kv_host_blocks_dropped"] == 0
    assert sum(t[2] for t in out) > sum(t[2] for t in ref) and s["prompt_tokens"] < ref_stats["prompt_tokens"]
    assert ref_stats["prefix_cache_evictions"] > 0 and ref_stats["kv_host_hits"] == 0
    _no_leak(g)
    from prometheus_client import generate_latest

    from serve.metrics import ServerMetrics
    m = ServerMetrics("m")
    m.observe_step(s)
    text = generate_latest(m.registry).decode()
    assert f'jaxinfer_kv_host_hits_total{{model_name="m"}} {float(s["kv_host_hits"])}' in text
    assert f'jaxinfer_kv_host_bytes{{model_name="m"}} {float(s["kv_host_bytes"])}' in text


def test_failed_transfers_fall_back_to_recompute(llama, reference, monkeypatch):
    """Every restore fails (its host staging raises), then every offload: the entries are dropped,
    the requests recompute, and the outputs are the tier-off ones; nothing leaks."""
    from jaxinfer import kv_transfer

    ref, _ = reference
    g = Generator.from_pretrained(llama, **ENGINE, kv_offload_gb=1 / 1024)

    def broken(*a, **k):
        raise RuntimeError("injected transfer failure")
    monkeypatch.setattr(kv_transfer.HostKVStore, "_stage", broken)
    _same_tokens(_multiturn(g), ref)
    s = g.stats()
    assert s["kv_host_blocks_dropped"] > 0 and s["kv_host_bytes_restored"] == 0 and s["num_preemptions"] > 0
    _no_leak(g)
    monkeypatch.setattr(kv_transfer.HostKVStore, "_gather_blocks", broken)
    g.reset_prefix_cache()
    _same_tokens(_multiturn(g), ref)
    assert g.stats()["kv_host_blocks"] == 0
    _no_leak(g)


def test_int8_kv_and_draft_model_pages_restored(llama):
    """int8 KV (codes and scales move) with a draft model (its pages move with the target's; the
    draft is the target itself, so its proposals are accepted): the same greedy tokens with the tier
    as without, blocks restored. Without: the same engine with its block manager's tier detached
    (today's block manager exactly; one engine instead of two keeps the test's compilations down)."""
    kw = dict(ENGINE, kv_dtype="int8", speculative_method="draft", speculative_model=llama,
              num_speculative_tokens=2, speculative_max_batch=4)
    g = Generator.from_pretrained(llama, **kw, kv_offload_gb=1 / 1024)
    assert len(g.engine.runner.kv_pages) == 2       # (target, draft)
    host, g.engine.blocks.host = g.engine.blocks.host, None
    ref = _multiturn(g, turns=2)
    assert g.stats()["prefix_cache_evictions"] > 0
    g.reset_prefix_cache()
    g.engine.blocks.host = host
    _same_tokens(_multiturn(g, turns=2), ref)
    s = g.stats()
    assert s["kv_host_hits"] > 0 and s["spec_decode_num_drafts"] > 0
    _no_leak(g)


def test_latent_attention_pages_restored(hf_model_dir):
    """DeepSeek-V3's latent attention caches one vector per token, in the K pages only (its V pages
    and their scales are empty; the attention reads the values from the K pages): int8 KV under the
    host tier gives the tier-off engine's greedy tokens (one engine, its tier detached for the
    reference, as above), blocks restored, and a block's bytes are the K pages' alone by hand
    (3 layers x (latent 24 + RoPE 8 int8 codes + one float32 scale) x 8 tokens)."""
    g = Generator.from_pretrained(hf_model_dir("deepseekv3-mla"), **ENGINE, kv_dtype="int8", kv_offload_gb=1 / 1024)
    leaves = jax.tree.leaves(g.engine.runner.kv_pages)
    assert [x.size == 0 for x in leaves] == [False, True, False, True] * 3   # k, v, k_scale, v_scale per layer
    assert g.engine.blocks.host.block_bytes == 3 * (24 + 8 + 4) * 8 == g.stats()["kv_bytes_per_token"] * 8
    host, g.engine.blocks.host = g.engine.blocks.host, None
    ref = _multiturn(g)
    assert g.stats()["prefix_cache_evictions"] > 0
    g.reset_prefix_cache()
    g.engine.blocks.host = host
    _same_tokens(_multiturn(g), ref)
    assert g.stats()["kv_host_hits"] > 0
    _no_leak(g)


def test_budget_and_flags(llama):
    """kv_offload_gb / --kv-offload-gb (or vLLM's --kv-offloading-size) in GiB become kv_offload_bytes;
    a budget under one block is refused at start naming the block's bytes (here K,V x 2 layers x 2
    heads x 16 x 4 B x 8 tokens = 4096); 0 is no tier."""
    from jaxinfer.cli import build_parser
    from jaxinfer.config.engine import engine_config
    from jaxinfer.config.flags import engine_kwargs

    for cmd in (["serve"], ["batch", "in.jsonl", "out.jsonl"], ["generate", "hi"]):
        for flag in ("--kv-offload-gb", "--kv-offloading-size"):
            assert engine_kwargs(build_parser().parse_args([*cmd, flag, "0.5"]))["kv_offload_bytes"] == 2**29
    assert engine_config("from_pretrained", {"kv_offload_gb": 2}).kv_offload_bytes == 2 * 2**30
    assert engine_config("from_pretrained", {}).kv_offload_bytes == 0
    with pytest.raises(ValueError, match="kv_offload_gb must be a number >= 0"):
        engine_config("from_pretrained", {"kv_offload_gb": -1})
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        engine_config("from_pretrained", {"kv_offload_gb": 1, "enable_prefix_caching": False})
    with pytest.raises(ValueError, match=r"smaller than one KV block \(4096 bytes"):
        Generator.from_pretrained(llama, **ENGINE, kv_offload_bytes=4095)
    assert Generator.from_pretrained(llama, **ENGINE).engine.blocks.host is None


def test_tensor_parallel_restores_per_device_shards(tmp_path_factory):
    """TP 2 on fake devices with a draft model (tests/kv_offload_worker.py): the one-device engine's
    greedy tokens with the tier off, both times the workload runs (the second from an empty cache:
    recompiling nothing); blocks restored; the target's leaves held per device in pinned host memory
    (1 KV head each: no gather, one row of every target leaf's half of a block per device), the
    replicated draft's once."""
    from tests.fake_devices import run_worker
    from tests.sharding_worker import save_llama

    tmp = tmp_path_factory.mktemp("kv-offload-tp")
    save_llama("vocab136", tmp / "vocab136")
    r = run_worker("tests.kv_offload_worker", tmp)
    tokens = lambda run: [t for t, _ in run]   # noqa: E731
    assert tokens(r["tier"]) == tokens(r["tier_again"]) == tokens(r["ref"])
    assert r["stats"]["kv_host_hits"] > 0 and r["stats"]["kv_host_bytes_restored"] > 0
    assert r["stats"]["spec_decode_num_drafts"] > 0 and r["compiles_again"] == 0 and r["kv_blocks_used"] == 0
    target_bytes, draft_bytes = r["block_bytes"]
    target = [g for g in r["groups"] if g["target"]]
    draft = [g for g in r["groups"] if g["draft"]]
    assert len(target) == len(draft) == 1 and len(r["groups"]) == 2
    # a block's rows in pinned host memory: the target's one per device, the replicated draft's once
    assert target[0]["parts"] == [[1, target_bytes // 2, "pinned_host", True]] * 2
    assert draft[0]["parts"] == [[2, draft_bytes, "pinned_host", True]]
    assert 0 < r["slots_held"][0] <= r["slots_held"][1] == 2**30 // 1024 // (target_bytes + draft_bytes)
