"""One cost model (jaxinfer.perf): Engine.stats() (served on /metrics), the benchmark's metrics
(bench/metrics.py) and `jaxinfer plan` count the same bytes and MBU for the same run, and those
bytes are what the model's shapes give when counted by hand here.

A step observer (the benchmark's StepLog) is told which step each engine.step() call applied and how
many iterations the device ran each of its sequences (a multi-step decode runs several), as the
engine counts them: the workloads run with one iteration per step and with multi-step decoding
under async scheduling.
"""
from __future__ import annotations

import pytest

from bench.metrics import StepLog, utilization
from jaxinfer import Generator, SamplingParams, perf, plan
from jaxinfer.perf import ModelCost, StepRecord

PEAK = 1e9   # bytes/s, the datasheet bandwidth of a made-up device (JAXINFER_PEAK_BANDWIDTH)


def _generator(hf_model_dir, **kw) -> Generator:
    kw = {"max_decode_steps": 1, **kw}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXINFER_PEAK_BANDWIDTH", str(PEAK))
        return Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), dtype="float32", max_model_len=64,
                                         max_num_batched_tokens=16, max_num_seqs=4, block_size=8,
                                         num_blocks=4 * 64 // 8 + 1, warmup=False, **kw)


@pytest.fixture(scope="module")
def gen(hf_model_dir) -> Generator:
    return _generator(hf_model_dir)


def _hand_cost(mc) -> tuple[int, int, int]:
    """(weights read whole per step, bytes one token gathers, KV bytes per token) of the float32
    model, from its shapes: every weight but the untied token table, one row of it per token."""
    d, hd, L = mc.d_model, mc.head_dim, mc.n_layers
    attn = d * hd * (mc.n_heads + 2 * mc.n_kv_heads) + mc.n_heads * hd * d     # q, k, v, o
    mlp = 3 * d * mc.ffn_dim                                                    # gate, up, down
    params = L * (attn + mlp + 2 * d) + d + 2 * mc.vocab_size * d              # + norms, final norm, embed, head
    assert params == mc.num_params() and not mc.tie_embeddings and mc.sliding_window is None
    return 4 * (params - mc.vocab_size * d), 4 * d, 2 * 4 * L * mc.n_kv_heads * hd


def _hand_bytes(mc, steps: list[StepRecord]) -> int:
    """Per iteration: the weights, a row per token, the KV of each live sequence's context (one token
    longer each iteration of a multi-step decode)."""
    weights, row, kv = _hand_cost(mc)
    total = 0
    for s in steps:
        its = s.iterations or [1] * s.num_seqs
        for j in range(max(its, default=0)):
            live = [(start + n + j, n) for (start, n), k in zip(s.spans, its) if k > j]
            total += weights + sum(n for _, n in live) * row + sum(c for c, _ in live) * kv
    return total


def _run(gen: Generator, prompts: list[list[int]], max_tokens: int) -> tuple[list[StepRecord], dict, dict]:
    """The benchmark's way: a step log on the client, every request submitted at once, stepped to the end."""
    client = gen.client
    before = client.stats()
    log = StepLog(client)
    try:
        rids = client.submit(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        while client.has_unfinished():
            log.step()
    finally:
        log.detach()
    for rid in rids:
        client.release(rid)
    return log.steps, before, client.stats()


def test_engine_benchmark_and_plan_count_the_same_bytes(gen):
    mc = gen.model_cfg
    prompts = [list(range(3, 3 + n)) for n in (5, 21, 9)]        # 21 > 16 tokens: a chunked prefill
    steps, before, after = _run(gen, prompts, max_tokens=4)
    assert len(steps) > 4 and any(s.is_decode for s in steps) and any(not s.is_decode for s in steps)
    engine = after["bytes_read"] - before["bytes_read"]
    bench = sum(ModelCost.from_stats(mc, after).step_bytes(s) for s in steps)
    planned = sum(plan.model_cost(mc, "float32", "float32").step_bytes(s) for s in steps)
    assert engine == bench == planned == _hand_bytes(mc, steps)


def test_multi_step_decode_under_async_scheduling_counts_the_same_bytes(hf_model_dir):
    """max_decode_steps 4 with async scheduling: the device runs up to 4 iterations per decode step
    and a step() call applies the step launched by the call before; the log still counts what the
    engine counts."""
    gen = _generator(hf_model_dir, max_decode_steps=4, async_scheduling=True)
    mc = gen.model_cfg
    prompts = [list(range(3, 3 + n)) for n in (5, 21, 9)]
    steps, before, after = _run(gen, prompts, max_tokens=9)
    applied = [s for s in steps if s.spans]
    assert any(max(s.iterations) > 1 for s in applied)                     # multi-step decodes ran
    assert len(applied) < len(steps)                                        # a call that applied nothing
    engine = after["bytes_read"] - before["bytes_read"]
    bench = sum(ModelCost.from_stats(mc, after).step_bytes(s) for s in steps)
    assert engine == bench == _hand_bytes(mc, applied)


def test_engine_benchmark_and_plan_give_the_same_mbu(hf_model_dir):
    gen = _generator(hf_model_dir)         # a fresh engine: its live MBU is over the recent steps, here one
    mc = gen.model_cfg
    steps, before, after = _run(gen, [list(range(3, 14))], max_tokens=1)   # one prefill step
    [step] = [s for s in steps if s.spans]         # (under async scheduling the first call applies none)
    seconds = after["device_time_s"] - before["device_time_s"]             # the engine's device time of it
    timed = StepRecord(seconds, step.spans)
    expected = _hand_bytes(mc, [step]) / seconds / PEAK
    assert after["mbu"] == pytest.approx(expected, rel=1e-12)               # Engine.stats(): one recent step
    bench = utilization([timed], ModelCost.from_stats(mc, after), PEAK, None)["mbu"]
    planned = perf.mbu(plan.model_cost(mc, "float32", "float32").step_bytes(timed) / seconds, PEAK)
    assert bench == planned == pytest.approx(expected, rel=1e-12)


def test_plan_batch1_decode_reads_what_a_one_token_step_reads(gen):
    mc = gen.model_cfg
    device = perf.Device("test", "test", 2**30, PEAK, 1e12, 1e12, 0.0)
    p = plan.plan(mc, device, dtype="float32", context=40)
    one_token = StepRecord(0.0, [(39, 1)])                                   # the 40th token of a sequence
    assert p.decode_tokens_per_s_bs1 == PEAK / _hand_bytes(mc, [one_token])
    assert p.decode_tokens_per_s_bs1 == PEAK / plan.model_cost(mc, "float32").step_bytes(one_token)


def test_loaded_weights_split_as_the_shapes_say(hf_model_dir):
    """The engine's weight bytes (from the loaded arrays) equal the planner's (from the shapes): dense
    untied, tied, and a mixture of experts."""
    from jaxinfer.models.decoder import weight_bytes
    from jaxinfer.weights import load_model

    for name in ("llama-gqa-llama3", "qwen2-tied", "qwen3moe-gqa"):
        model, cfg = load_model(hf_model_dir(name), "float32")
        assert weight_bytes(model) == perf.WeightBytes.of_float(cfg, 4), name
        kv = plan.kv_bytes_per_token(cfg, "float32")
        assert ModelCost.build(cfg, weight_bytes(model), kv) == plan.model_cost(cfg, "float32"), name


def test_a_lone_token_reads_its_experts_more_tokens_read_all(hf_model_dir):
    from jaxinfer.models.hf_configs import model_config_from_hf

    cfg = model_config_from_hf(hf_model_dir("qwen3moe-gqa"))     # 4 experts, top-2, MoE in layers 0 and 2
    c = cfg.param_counts()
    expert = 3 * cfg.d_model * cfg.expert_ffn_dim
    assert (c["moe_layers"], c["expert"], c["experts"]) == (2, expert, 2 * 4 * expert)
    cost = ModelCost.from_config(cfg, 4, 4)
    decode1, decode2 = StepRecord(0.0, [(7, 1)]), StepRecord(0.0, [(7, 1), (9, 1)])
    kv = cost.kv_bytes_per_token
    assert cost.step_bytes(decode1) == cost.weight_bytes_read + cost.row_bytes + 2 * 2 * 4 * expert + 8 * kv
    assert cost.step_bytes(decode2) == cost.weight_bytes_read + 2 * cost.row_bytes + 2 * 4 * 4 * expert + 18 * kv
    assert cost.weight_bytes_read == 4 * (cfg.num_params() - cfg.vocab_size * cfg.d_model * (not cfg.tie_embeddings)
                                          - 2 * 4 * expert)


@pytest.mark.parametrize("vocab, width, ffn", [(128256, 256, 512), (32000, 1024, 3584)])
def test_activation_reserve_covers_the_compiled_step(vocab, width, ffn):
    """perf.step_activation_bytes, the KV pool's reserve for a step's temporaries, is at least what
    XLA's buffer assignment gives the engine's largest step (its compiled memory analysis: 512
    tokens, 256 rows, a 2-layer bfloat16 model). At the 8B's vocabulary the logits dominate: XLA holds
    ~7 float32 [rows, vocab] copies at once (933 MB), where an estimate of 4 gave 800 MB; at a
    32,000-token vocabulary and width 1,024, 440 MB against 429."""
    from bench.gpu.parts import random_decoder
    from bench.gpu.workload import TINY_LLAMA
    from jaxinfer.config import EngineConfig

    hf = dict(TINY_LLAMA, vocab_size=vocab, hidden_size=width, intermediate_size=ffn, num_hidden_layers=2,
              num_attention_heads=width // 64, num_key_value_heads=max(1, width // 256))
    g = Generator(random_decoder(hf), None, EngineConfig(dtype="bfloat16", attention="xla", max_num_seqs=256,
                                                         block_size=16, num_blocks=64, max_model_len=512,
                                                         enable_prefix_caching=False),
                  max_num_batched_tokens=512, warmup=False)
    runner, mc = g.engine.runner, g.model_cfg
    t, b = max(runner.token_buckets), max(runner.block_buckets)
    temp = runner.compiled_step(runner.empty_inputs(t, b)).memory_analysis().temp_size_in_bytes
    reserve = perf.step_activation_bytes(tokens=512, rows=256, d_model=mc.d_model, ffn_dim=mc.ffn_dim,
                                         n_heads=mc.n_heads, head_dim=mc.head_dim, vocab_size=mc.vocab_size,
                                         dtype_bytes=2)
    assert reserve >= temp, (reserve, temp)


def test_each_live_sequence_reads_its_recurrent_state(hf_model_dir):
    """The Granite 4.0-H shape of tests/hf_models.py ("granitemoehybrid": 3 Mamba-2 layers of 8 heads
    of 16, 2 groups of state size 8, 4 taps): each sequence live in an iteration reads its state once,
    by hand 3 x (8 float32 [8, 16] matrices + 3 convolution inputs of 8 x 16 + 2 x 2 x 8 = 160 float32
    channels), beside the weights and KV (a multi-step decode's sequence once per iteration it runs);
    the float32 engine's stats() report the same, which ModelCost.from_stats reads back."""
    import dataclasses

    from jaxinfer.models.hf_configs import model_config_from_hf
    folder = hf_model_dir("granitemoehybrid")
    cfg = model_config_from_hf(folder)
    state = 3 * (4 * 8 * 8 * 16 + 3 * 160 * 4)
    cost = ModelCost.from_config(cfg, 4, 4)
    stateless = dataclasses.replace(cost, state_bytes_per_sequence=0)
    assert cost.state_bytes_per_sequence == state
    for step, live in ((StepRecord(0.0, [(7, 1)]), 1), (StepRecord(0.0, [(7, 1), (9, 16)]), 2),
                       (StepRecord(0.0, [(7, 1), (9, 1)], iterations=[3, 1]), 4)):
        assert cost.step_bytes(step) - stateless.step_bytes(step) == live * state
    g = Generator.from_pretrained(folder, dtype="float32", max_model_len=64, max_num_seqs=2, block_size=8,
                                  num_blocks=9, max_num_batched_tokens=16, warmup=False)
    stats = g.stats()
    assert stats["state_bytes_per_sequence"] == state
    assert ModelCost.from_stats(g.model_cfg, stats).state_bytes_per_sequence == state
