"""The structural half of issue 14: one engine client, validation in one place, one resolved
configuration, one jax-free module of device datasheets and byte/FLOP/MBU formulas.

References: greedy decoding by repeated full forwards (`gen.logits`), hand arithmetic for the
formulas, SamplingParams itself for what the server must accept, the jaxpr for which matmul runs.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import time
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from jaxinfer import Generator, SamplingParams
from jaxinfer.client import SubmitError
from jaxinfer.config import ConfigError, EngineConfig, ModelConfig, PoolInputs, ResolvedConfig, resolve_config

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(dtype="float32", max_model_len=96, max_num_batched_tokens=32, token_buckets=[32], max_num_seqs=8,
             block_size=8)
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gen(hf_model_dir) -> Generator:
    return Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **SMALL, warmup=False)


def _greedy_reference(gen: Generator, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by repeated full forwards (no cache): numpy argmax of gen.logits."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(gen.logits(ids)[-1])))
    return ids[len(prompt):]


def _all_free(gen: Generator) -> bool:
    s = gen.stats()
    return s["kv_blocks_used"] == 0 and s["num_waiting"] == 0 and s["num_running"] == 0


# --------------------------------------------------------------------------- 1. one engine client
def test_submit_is_all_or_nothing(gen):
    vocab = gen.model_cfg.vocab_size
    with pytest.raises(SubmitError) as e:
        gen.client.submit([[5, 6, 7], [8, 9], [1, vocab + 3]], GREEDY)
    assert e.value.index == 2 and "outside the vocabulary" in e.value.message
    assert not gen.client.has_unfinished() and gen.client.queued_sequences() == 0 and _all_free(gen)
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):   # Generator names the prompt
        gen.generate([[5, 6, 7], []], GREEDY)
    assert _all_free(gen)


def test_deltas_are_routed_per_request_and_match_naive_greedy(gen):
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17]]
    queues = [deque(), deque()]
    rids = [gen.client.submit([p], GREEDY, route=q.append)[0] for p, q in zip(prompts, queues)]
    assert gen.client.queued_sequences() == 2
    traces = []
    gen.client.add_step_observer(traces.append)
    try:
        gen.client.run_until_done()
    finally:
        gen.client.remove_step_observer(traces.append)
    # both prompts fit the 32-token budget: the first step prefills both whole (a trace names the
    # step whose tokens its call applied: under async scheduling the first call applies none)
    assert [t.spans for t in traces if t.spans][0] == ((0, 5), (0, 7))
    for rid, prompt, q in zip(rids, prompts, queues):
        assert {d.request_id for d in q} == {rid}
        tokens = [t for d in q for t in d.token_ids]
        assert tokens == _greedy_reference(gen, prompt, GREEDY.max_tokens)
        assert [d.finished for d in q][-1] and sum(d.finished for d in q) == 1
        [m] = gen.client.release(rid, abort=False)
        assert (m.num_prompt_tokens, m.num_output_tokens, m.finish_reason) == (len(prompt), 5, "length")
        times = np.array(m.token_times)
        assert len(times) == 5 and m.ttft == m.first_token_time - m.arrival_time >= 0
        assert m.tpot == pytest.approx(float(np.diff(times).mean()), rel=1e-12)
    assert _all_free(gen)


def test_generate_and_stream_aggregate_the_same_tokens(gen):
    prompt = [21, 22, 23, 24]
    out = gen.generate([prompt], SamplingParams(max_tokens=6, temperature=0.8, seed=7, n=2, ignore_eos=True))[0]
    streamed = {0: [], 1: []}
    for d in gen.stream(prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=7, n=2, ignore_eos=True)):
        streamed[d.sample_index] += d.token_ids
    assert [s.token_ids for s in out.samples] == [streamed[0], streamed[1]]
    assert all(len(s.token_ids) == 6 and s.finish_reason == "length" for s in out.samples)
    assert _all_free(gen)


def test_abandoned_stream_is_aborted_and_frees_its_blocks(gen):
    it = gen.stream([31, 32, 33], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    next(it)
    it.close()
    assert _all_free(gen)


# The engine's internals: what no adapter (serve/, bench/, scripts/, the Generator, the CLI) may
# reach. Modules: the runner, the step functions, the scheduler and the block manager (a host-only
# benchmark of the scheduler, bench/bench_policies.py's step-count simulation, may build them: it
# runs no engine), and jaxinfer.debug (its StepDebugger reaches the engine's parts: adapters use the
# client's, `client.debug`, which holds the client's lock). Attributes: the engine's parts and
# counters, the client's lock, a request's forks, the raw or resolved config read past the client
# (EngineClient.resolved is the door); and any private name of another module or object.
INTERNAL_MODULES = ("jaxinfer.runner", "jaxinfer.step", "jaxinfer.host.scheduler", "jaxinfer.host.block_manager",
                    "jaxinfer.debug")
HOST_ONLY_SCHEDULER_BENCHMARKS = {"bench/bench_policies.py": ("jaxinfer.host.scheduler", "jaxinfer.host.block_manager")}
INTERNAL_ATTRS = {"runner", "scheduler", "blocks", "block_manager", "stats_", "kv_pages", "fault_injector",
                  "pending_forks", "num_unfinished", "requests", "publish_step", "token_buckets", "grammars"}
ENGINE_CONFIG_ATTRS = {"cfg", "resolved"}   # engine.cfg / engine.resolved: read client.resolved instead
THIRD_PARTY_PRIVATE = {"_attn_implementation"}   # transformers' own config attribute (bench/gpu/parts.py)


def test_abort_from_another_thread_ends_the_waiting_caller(gen):
    """gen.abort(rid) while another thread waits on rid's deltas: that thread gets the final delta
    (finish_reason "abort") and returns (the final delta was dropped and the waiter spun forever)."""
    import threading
    queue: deque = deque()
    gen.engine.fault_injector = lambda: time.sleep(0.2)   # >= 2 s of steps: the abort lands mid-request
    [rid] = gen.client.submit([[41, 42, 43]], SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True),
                              route=queue.append)
    got: list = []
    waiter = threading.Thread(target=lambda: got.extend(gen.client.stream_deltas(rid, 1, queue)), daemon=True)
    waiter.start()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:      # the request runs: it has produced a delta
        time.sleep(0.01)
    gen.abort(rid)
    waiter.join(timeout=60)
    gen.engine.fault_injector = None
    assert not waiter.is_alive() and got[-1].finished and got[-1].finish_reason == "abort"
    assert _all_free(gen)


def test_an_abort_waiting_for_the_lock_ends_its_request_at_the_next_step(gen):
    """A thread that steps back to back re-takes the client's lock before a waiting abort() is
    scheduled on a loaded machine (the lock is not fair: the request above once ran to its length,
    its abort starved). Here this thread holds the lock while another calls abort(): the next step
    this thread takes ends the request with finish_reason "abort", before abort() has returned."""
    import threading
    queue: deque = deque()
    [rid] = gen.client.submit([[41, 42, 43]], SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True),
                              route=queue.append)
    for _ in range(5):   # until the request has produced a token
        if not queue:
            gen.client.step()
    assert queue and not queue[-1].finished

    def steps_while_abort_waits() -> tuple[list, bool]:
        aborter = threading.Thread(target=gen.abort, args=(rid,), daemon=True)
        aborter.start()
        deadline = time.monotonic() + 30
        while not queue[-1].finished and time.monotonic() < deadline:
            time.sleep(0.01)   # (abort() records the request, then waits for the lock this thread holds)
            gen.client.step()
        return list(queue), aborter.is_alive()
    try:
        deltas, abort_waiting = gen.client.locked(steps_while_abort_waits)
    finally:
        gen.client.release(rid)
    assert abort_waiting and deltas[-1].finish_reason == "abort" and len(deltas) < 40
    assert _all_free(gen)


def test_a_step_that_raises_fails_every_caller_and_every_later_one(hf_model_dir):
    """A one-off exception inside a step (its in-flight state and donated KV pages are gone): the
    caller that stepped gets it, every other caller an EngineFailedError naming it, and so does
    every later call; none waits forever or returns a silently shortened output (a request could
    hang or lose a token)."""
    import threading
    from jaxinfer.client import EngineFailedError
    g = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **SMALL, warmup=False)
    steps = []

    def fault():
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("injected")
    g.engine.fault_injector = fault
    results: dict = {}

    def run(i):
        try:
            results[i] = g.generate([[5 + i, 6, 7]], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        except BaseException as e:   # noqa: BLE001 (the test sorts them below)
            results[i] = e
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and len(results) == 2
    kinds = sorted(type(r).__name__ for r in results.values())
    assert kinds == ["EngineFailedError", "RuntimeError"], results
    with pytest.raises(EngineFailedError, match="injected"):
        g.generate([[9, 9, 9]], GREEDY)


def internal_reaches(source: str, allowed_modules: tuple[str, ...] = ()) -> list[str]:
    """Every place `source` reaches an engine internal (an AST scan: imports and attribute reads)."""
    import ast

    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for m in modules:
                if m in INTERNAL_MODULES and m not in allowed_modules:
                    hits.append(f"{node.lineno}: imports {m}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("jaxinfer", "pallas_kernels")):
                hits += [f"{node.lineno}: imports private {node.module}.{a.name}" for a in node.names
                         if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute):
            base, name = node.value, node.attr
            own = (isinstance(base, ast.Name) and base.id in ("self", "cls")) or (
                isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super")
            if own:
                continue
            if name in INTERNAL_ATTRS or (name.startswith("_") and not name.startswith("__")
                                          and name not in THIRD_PARTY_PRIVATE):
                hits.append(f"{node.lineno}: .{name} of {ast.unparse(base)}")
            elif name in ENGINE_CONFIG_ATTRS and isinstance(base, ast.Attribute) and base.attr == "engine":
                hits.append(f"{node.lineno}: .engine.{name}")
    return hits


def test_the_internals_scan_finds_each_kind_of_reach():
    """Control: a snippet reaching each kind of internal is caught, the client's doors are not."""
    bad = textwrap.dedent("""
        from jaxinfer.runner import ModelRunner
        import jaxinfer.step
        from jaxinfer.debug import StepDebugger
        from jaxinfer.attention import _gather_context
        gen.engine.runner.token_buckets = [1]
        gen.engine.scheduler.waiting
        gen.client._lock
        x = gen.engine.cfg.block_size
    """)
    assert len(internal_reaches(bad)) == 9
    good = "gen.client.debug.kv_pool_bytes()\nb = gen.client.resolved.block_size\nself._forward = f\n"
    assert internal_reaches(good) == []
    assert internal_reaches("from jaxinfer.host.scheduler import Scheduler", ("jaxinfer.host.scheduler",)) == []


def test_adapters_do_not_reach_into_engine_internals():
    """serve/, bench/, scripts/, the Generator and the CLI drive the engine through EngineClient only."""
    files = [ROOT / "jaxinfer" / "generator.py", ROOT / "jaxinfer" / "cli.py",
             *[f for folder in ("serve", "bench", "scripts") for f in sorted((ROOT / folder).glob("*.py"))]]
    hits = [f"{f.relative_to(ROOT)}:{hit}" for f in files
            for hit in internal_reaches(f.read_text(), HOST_ONLY_SCHEDULER_BENCHMARKS.get(
                f.relative_to(ROOT).as_posix(), ()))]
    assert hits == []


@pytest.mark.parametrize("name", ["tensor_parallel", "pipeline_parallel", "max_num_seqs"])
def test_integer_settings_refuse_other_types_by_name(name):
    """A string or None where an integer belongs is refused naming the setting (a TypeError from a
    comparison before)."""
    for bad in ("2", None, 2.0, True):
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 1, got {bad!r}"):
            EngineConfig(**{name: bad})


def test_max_model_len_past_the_models_positions_is_refused():
    """max_model_len beyond the positions the model has is refused by name, as vLLM refuses it (it
    was accepted: RoPE ran past its trained range, a learned position table clamped silently). The
    limit, by vLLM's rule: max_position_embeddings, times a linear scaling's factor, or YaRN's
    factor times its original length."""
    from jaxinfer.config.model import RopeScaling
    base = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                       max_position_embeddings=128)
    linear = dataclasses.replace(base, rope_scaling=RopeScaling(kind="linear", factor=2.0))
    yarn = dataclasses.replace(base, rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=64))
    learned = dataclasses.replace(base, position="learned")
    for mc, longest in ((base, 128), (linear, 256), (yarn, 256), (learned, 128)):
        resolve_config(EngineConfig(num_blocks=40, block_size=16, max_model_len=longest), mc, backend="cpu")
        with pytest.raises(ConfigError, match=f"max_model_len {longest + 1} is longer than the model's context "
                                              f"\\({longest} positions"):
            resolve_config(EngineConfig(num_blocks=40, block_size=16, max_model_len=longest + 1), mc, backend="cpu")


def test_settings_flow_down_from_the_resolved_config():
    """The scheduler's and runner's settings are pure functions of the ResolvedConfig, and the pool
    of several processes is the smallest any of them fits (one global array)."""
    from jaxinfer.engine import runner_config, scheduler_config

    mc = ModelConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=64,
                     max_position_embeddings=512)
    r = resolve_config(EngineConfig(num_blocks=40, block_size=16, max_num_seqs=3, max_num_batched_tokens=5,
                                    batching="dynamic", kv_dtype="int8", max_decode_steps=4), mc, backend="cpu")
    assert (r.max_num_seqs, r.max_num_batched_tokens, r.block_size, r.kv_dtype) == (3, 8, 16, "int8")  # budget >= 8
    sc = scheduler_config(r)
    assert (sc.policy, sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len, sc.max_decode_steps) == \
        ("dynamic", 3, 8, 512, 4)
    rc = runner_config(r, (2,))
    assert (rc.num_blocks, rc.max_num_seqs, rc.max_num_batched_tokens, rc.kv_dtype, rc.eos_ids) == (40, 3, 8, "int8", (2,))
    assert r.token_buckets == rc.token_buckets == (8,)    # the budget, raised to 8, is the one bucket
    # two processes, 8 GiB devices (TPU: the limit is the device), 1 and 3 GiB in use: the second bounds the pool
    gib = 2**30
    stats = ({"bytes_limit": 8 * gib, "bytes_in_use": 1 * gib}, {"bytes_limit": 8 * gib, "bytes_in_use": 3 * gib})
    r = resolve_config(EngineConfig(block_size=16, memory_fraction=0.5), mc, backend="tpu",
                       memory=PoolInputs(stats=stats, platform="tpu", host_ram=0))
    block = 16 * 2 * 2 * 2 * 2 * 16                                  # bfloat16 K and V of 16 tokens
    assert r.num_blocks == (4 * gib - 3 * gib - r.pool.reserve) // block and r.pool.in_use == 1 * gib


# --------------------------------------------------------------------------- 2. validation in one place
# (SamplingParams field, value, the request body's field, its value): each pair must be accepted by
# both front doors or refused by both; refusals are 400s naming the request's field.
CASES = [
    ("temperature", 3.0, "temperature", 3.0),              # the server capped it at 2 before
    ("repetition_penalty", 50.0, "repetition_penalty", 50.0),   # the server capped it at 10
    ("n", 17, "n", 17),                                    # the server capped it at 16
    ("n", 129, "n", 129),
    ("seed", -1, "seed", -1),
    ("seed", 2**63, "seed", 2**63),
    ("seed", 2**40, "seed", 2**40),
    ("top_p", 0.0, "top_p", 0.0),
    ("min_p", 1.5, "min_p", 1.5),
    ("presence_penalty", -2.5, "presence_penalty", -2.5),
    ("logprobs", 21, "logprobs", 21),
    ("max_tokens", 0, "max_tokens", 0),
    ("stop", tuple("abcdefghijklmnopq"), "stop", list("abcdefghijklmnopq")),
]


def _python_accepts(field: str, value) -> bool:
    try:
        SamplingParams(**{field: value})
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("field,value,body_field,body_value", CASES)
def test_server_and_python_api_accept_the_same_values(gen, field, value, body_field, body_value):
    from serve.app import ServerState
    from serve.protocol import CompletionRequest, OpenAIError

    state = ServerState(gen, "tiny", None, max_queue=1 << 20)
    req = CompletionRequest.model_validate({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4,
                                            body_field: body_value})
    try:
        _, params = state.completion_inputs(req)
        server_ok, param = True, None
    except OpenAIError as e:
        server_ok, param = False, e.param
        assert e.status == 400
    assert server_ok == _python_accepts(field, value)
    if not server_ok:
        assert param == body_field
    else:
        assert getattr(params, field) == value


def test_chat_maps_its_field_names(gen):
    from serve.app import ServerState
    from serve.protocol import ChatCompletionRequest, OpenAIError

    state = ServerState(gen, "tiny", None, max_queue=1 << 20)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    with pytest.raises(OpenAIError) as e:
        req = ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 21})
        req.sampling_params(4, req.top_logprobs)
    assert e.value.param == "top_logprobs"
    req = ChatCompletionRequest.model_validate({**chat, "max_completion_tokens": 0})
    with pytest.raises(OpenAIError) as e:
        req.sampling_params(0, None)
    assert e.value.param == "max_completion_tokens" and state is not None


def test_context_length_rule_lives_in_the_engine(gen):
    """One rule, in Engine.add_request: the prompt must leave room for a token; with
    max_tokens_must_fit (the server's and the batch script's OpenAI contract) prompt + max_tokens
    must fit too, refused naming the field; otherwise generation stops at the context's end."""
    from jaxinfer.engine import RequestError

    limit = gen.client.max_model_len                       # 96
    prompt = list(range(5, 5 + limit - 3))                 # 93 tokens: room for 3
    long = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with pytest.raises(SubmitError) as e:
        gen.client.submit([prompt], long, max_tokens_must_fit=True)
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    assert f"maximum context length is {limit} tokens" in e.value.message and "103 tokens" in e.value.message
    with pytest.raises(SubmitError) as e:
        gen.client.submit([list(range(5, 5 + limit))], GREEDY, max_tokens_must_fit=True)
    assert e.value.param == "prompt"
    out = gen.generate([prompt], long)[0]                   # the Python API: up to the context's end
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.token_ids == _greedy_reference(gen, prompt, 3)
    with pytest.raises(RequestError, match="too long"):
        gen.engine.add_request(list(range(5, 5 + limit)), GREEDY)
    assert _all_free(gen)


# --------------------------------------------------------------------------- 3. one resolved configuration
def test_resolve_config_decides_every_setting_once():
    mc = ModelConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=64,
                     max_position_embeddings=512)
    r = resolve_config(EngineConfig(attention="xla", num_blocks=9, block_size=16, max_model_len=128), mc, backend="gpu")
    assert (r.dtype, r.kv_dtype, r.attention, r.matmul) == ("bfloat16", "bfloat16", "xla", "xla")
    assert r.max_model_len == (9 - 1) * 16   # exactly what the pool holds (block 0 is the null block)
    r = resolve_config(EngineConfig(num_blocks=100), mc, backend="gpu", weight_dtype="float16")
    assert (r.dtype, r.attention, r.matmul, r.max_model_len) == ("float16", "pallas", "pallas", 512)
    # a host pool: a quarter of the RAM holds 3 + 512 // 16 int8 blocks of 16 tokens, each token
    # 2 (K, V) x 2 layers x 2 kv heads x (16 int8 + one f32 scale) = 160 bytes
    ram = 4 * (3 + 512 // 16) * 16 * (2 * 2 * 2 * (16 + 4))
    r = resolve_config(EngineConfig(kv_dtype="int8"), mc, backend="cpu",
                       memory=PoolInputs(stats=(None,), platform="cpu", host_ram=ram))
    assert (r.dtype, r.kv_dtype, r.attention, r.num_blocks) == ("float32", "int8", "xla", 3 + 512 // 16)
    assert r.max_decode_steps == 8
    assert resolve_config(EngineConfig(num_blocks=33), mc, backend="cpu", pipelined=True).max_decode_steps == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.attention = "pallas"


def test_pallas_on_a_gpu_only_for_shapes_its_kernels_take():
    """Triton needs power-of-two tiles and head_dim >= 16: on a GPU "auto" then picks the XLA attention
    (and matmuls), an explicit "pallas" is refused naming the reason; interpret mode on CPU takes any."""
    mc = ModelConfig(vocab_size=100, d_model=48, n_layers=2, n_heads=6, n_kv_heads=6, head_dim=8, ffn_dim=64,
                     max_position_embeddings=64)
    r = resolve_config(EngineConfig(num_blocks=9, block_size=8), mc, backend="gpu")
    assert (r.attention, r.matmul) == ("xla", "xla")
    with pytest.raises(ConfigError, match='attention="pallas" cannot run this model on a GPU: head_dim 8 is not a power'):
        resolve_config(EngineConfig(attention="pallas", num_blocks=9, block_size=8), mc, backend="gpu")
    assert resolve_config(EngineConfig(attention="pallas", num_blocks=9, block_size=8), mc, backend="cpu").attention == "pallas"
    mc16 = dataclasses.replace(mc, head_dim=16)
    assert resolve_config(EngineConfig(num_blocks=9, block_size=8), mc16, backend="gpu").attention == "pallas"
    with pytest.raises(ConfigError, match="block_size 12 is not a power of two"):
        resolve_config(EngineConfig(attention="pallas", num_blocks=9, block_size=12), mc16, backend="gpu")


def test_attention_xla_governs_quantized_matmuls(hf_model_dir, monkeypatch):
    import jax
    import jax.numpy as jnp

    from jaxinfer.layers import dense
    from jaxinfer.models.decoder import quantize_decoder
    from jaxinfer.quant import QuantizedWeight
    from jaxinfer.weights import load_model
    from flax import nnx

    monkeypatch.setenv("JAXINFER_AUTOTUNE", "0")   # the Pallas control below takes the default tiles
    model, _ = load_model(hf_model_dir("llama-gqa-llama3"), "float32")
    quantize_decoder(model, "int8")
    g = Generator(model, None, EngineConfig(dtype="float32", attention="xla", quantize="int8", num_blocks=16,
                                            max_num_seqs=2, block_size=8, max_model_len=120), 16, warmup=False)
    assert isinstance(g.engine.resolved, ResolvedConfig) and g.engine.resolved.matmul == "xla"
    weights = [v.get_value() for _, v in nnx.state(model, nnx.Param).flat_state()
               if isinstance(v.get_value(), QuantizedWeight)]
    assert weights and {n.matmul for _, n in nnx.iter_graph(model) if hasattr(n, "matmul")} == {"xla"}
    tokens, positions = jnp.arange(16, dtype=jnp.int32) % 100, jnp.arange(16, dtype=jnp.int32)
    forward = jax.make_jaxpr(lambda t, p: model(t, p, impl=g.engine.resolved.attention)[0])(tokens, positions)
    assert "pallas_call" not in str(forward)
    # control: the same weight with the Pallas implementation does stage a pallas_call
    w = weights[0]
    x = jnp.ones((16, w.k), jnp.float32)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda a: dense(a, w, None))(x))
    assert "pallas_call" in str(jax.make_jaxpr(lambda a: dense(a, w, None, impl="pallas"))(x))
    assert g.generate([[5, 6, 7]], GREEDY)[0].token_ids   # and it runs


# --------------------------------------------------------------------------- 4. one jax-free perf module
def test_perf_and_plan_import_without_jax():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "flax", "numpy"):
                    raise ImportError(f"blocked: {name}")
        sys.meta_path.insert(0, Block())
        import jaxinfer.perf, jaxinfer.plan
        assert not any(m.split(".")[0] in ("jax", "numpy") for m in sys.modules), sorted(sys.modules)
        print(jaxinfer.perf.kv_bytes_per_token(2, 2, 8, "bfloat16"))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(2 * 2 * 2 * 2 * 8)


def test_formulas_match_hand_calculation():
    from jaxinfer import perf

    # L=2, H_kv=2, h=8: 2 (K, V) * bytes * L * H_kv * h, int8 adds 2 * 4-byte scales per layer per head
    assert perf.kv_bytes_per_token(2, 2, 8, "bfloat16") == 128
    assert perf.kv_bytes_per_token(2, 2, 8, "float32") == 256
    assert perf.kv_bytes_per_token(2, 2, 8, "int8") == 64 + 32
    # 2 iterations read 1000 weight bytes each, plus 9 context tokens of 128 bytes
    assert perf.bytes_read(1000, 128, 9, iterations=2) == 2000 + 1152
    assert perf.mbu(3152 / 0.5, 1e9) == 3152 / 0.5 / 1e9 and perf.mbu(1.0, None) is None
    # queries at positions 3 and 4 see 4 + 5 keys (full) or 2 + 2 (window 2):
    # 2*P*T + 2*V*d*S + 4*H*h*keys = 2*1000*2 + 2*100*32*1 + 4*4*8*(9 + 4)
    assert perf.forward_flops(1000, 100, 32, 4, 8, [(3, 2)], [None, 2]) == 4000 + 6400 + 128 * 13


def test_one_table_and_one_kv_formula_everywhere(gen):
    from jaxinfer import perf, plan
    from jaxinfer.perf import ModelCost, table_peaks

    h100 = perf.device_for_kind("NVIDIA H100 80GB HBM3")
    assert h100 is plan.get_device("h100") is perf.DEVICES["h100"]
    assert perf.device_for_kind("NVIDIA A100-SXM4-40GB") is plan.get_device("a100-40gb")
    # the datasheet of each kind, not a neighbour's (a GH200 read as an H200, an H100 NVL as an SXM)
    for kind, bandwidth in (("NVIDIA GH200 480GB", 4.0e12), ("NVIDIA GH200 144G HBM3e", 4.9e12), ("NVIDIA H200", 4.8e12),
                            ("NVIDIA H100 NVL", 3.9e12), ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA A100 80GB PCIe", 1.935e12),
                            ("NVIDIA A100-SXM4-80GB", 2.039e12)):
        assert perf.device_for_kind(kind).bandwidth == bandwidth, kind
    assert table_peaks("NVIDIA H100 80GB HBM3", "float32")["bandwidth_Bps"] == h100.bandwidth == 3.35e12
    assert table_peaks("NVIDIA H100 80GB HBM3", "float32")["flops"] == h100.flops_tf32
    mc = gen.model_cfg
    hand = 2 * 4 * mc.n_layers * mc.n_kv_heads * mc.head_dim    # float32 pages
    st = gen.stats()
    assert st["kv_bytes_per_token"] == hand == plan.kv_bytes_per_token(mc, "float32")
    assert ModelCost.from_stats(mc, st).kv_bytes_per_token == hand
    assert ModelCost.from_config(mc, 4, 4).kv_bytes_per_token == hand
