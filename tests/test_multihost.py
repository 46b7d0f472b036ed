"""Multi-host serving (jaxinfer/distributed.py) through jax.distributed on 127.0.0.1.

The end-to-end check spawns two processes (tests/multihost_worker.py), each with 4 virtual CPU
devices, forming one TP=8 mesh with gloo collectives between them: process 0 serves
Generator.generate (greedy, seeded sampling with n=2, penalties with logprobs) and gen.logits,
process 1 follows. Its outputs must equal the same model in this (one-device, one-process) pytest
process: identical text and token ids, logprobs and logits to float rounding. A second group
pairs the worker with `jaxinfer serve` under different settings: both refuse before any step.
Each group is bounded in time and its processes are killed in a finally block.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxinfer import distributed
from jaxinfer.distributed import ENV_VARS, decode, encode, step_arrays, step_inputs
from jaxinfer.step import MAX_STOP_IDS, StepInputs
from jaxinfer.kv_cache import StepRow, build_attention_metadata
from jaxinfer.sampling import SamplingBatch
from tests.multihost_worker import LOGITS_PROMPT, PROMPTS, SETTINGS, run_requests

ROOT = Path(__file__).resolve().parent.parent
GROUP_TIMEOUT_S = 240


@pytest.fixture(autouse=True)
def _no_group_env(monkeypatch):
    for var in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)


# ------------------------------------------------------------------------------ one process

def test_initialize_without_a_group_is_a_single_process():
    assert distributed.initialize() is None
    assert distributed.initialize("127.0.0.1:1", num_processes=1, process_id=0) is None


def test_group_from_arguments_and_env_vars(monkeypatch):
    g = distributed._resolve("10.0.0.1:1234", 2, 1)
    assert (g.coordinator_address, g.num_processes, g.process_id, g.is_leader) == ("10.0.0.1:1234", 2, 1, False)
    monkeypatch.setenv("JAXINFER_COORDINATOR_ADDRESS", "10.0.0.2:99")
    monkeypatch.setenv("JAXINFER_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAXINFER_PROCESS_ID", "0")
    assert distributed._resolve(None, None, None) == distributed.ProcessGroup("10.0.0.2:99", 4, 0)
    assert distributed._resolve(None, None, 3).process_id == 3          # an argument beats its env var


@pytest.mark.parametrize("args, message", [
    (("127.0.0.1:5", 2, None), r"missing: process_id \(--process-id or \$JAXINFER_PROCESS_ID\)"),
    ((None, 2, 0), "missing: coordinator_address"),
    (("127.0.0.1:5", 2, 2), r"process_id must be in \[0, num_processes\)"),
    (("127.0.0.1:5", 0, 0), r"process_id must be in \[0, num_processes\)"),
    (("127.0.0.1:5", "two", 0), "num_processes must be an integer, got 'two'"),
    (("127.0.0.1", 2, 0), "must be host:port"),
])
def test_group_errors_name_the_setting(args, message):
    with pytest.raises(ValueError, match=message):
        distributed.initialize(*args)


def test_mesh_must_span_every_process():
    from jaxinfer.sharding import make_mesh
    with pytest.raises(ValueError, match="set tensor_parallel to 1 .*got a mesh over 1 device"):
        distributed.check_mesh_spans_processes(None)
    distributed.check_mesh_spans_processes(make_mesh())     # one process: its one device is all of them


def test_messages_round_trip_exactly():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-5, 5, 7).astype(np.int32), None, rng.random((3, 4)).astype(np.float32),
              np.full(0, -1, np.int32), np.array([True, False]), rng.integers(0, 2**32, 5, dtype=np.uint32),
              np.full((64, 2048), -1, np.int32)]             # a penalty history: compressed
    kind, back = decode(encode("step", arrays))
    assert kind == "step" and len(back) == len(arrays)
    for a, b in zip(arrays, back):
        if a is None:
            assert b is None
        else:
            assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
    assert len(encode("step", arrays)) < 64 * 2048 * 4 // 50
    assert decode(encode("stop", [])) == ("stop", [])


def test_step_inputs_round_trip():
    s, t, b = 4, 8, 2
    meta = build_attention_metadata([StepRow(0, 3, [1]), StepRow(17, 1, [2, 3])], 16, t, s, b)
    f = np.linspace(0, 1, s, dtype=np.float32)
    hist = jax.device_put(np.full((s, 16), -1, np.int32))     # the runner's cached empty history
    sb = SamplingBatch(f, np.arange(s, dtype=np.int32), f + 1, f, f, f, f, np.arange(s, dtype=np.uint32) * 7,
                       np.zeros(s, np.int32), np.arange(s, dtype=np.int32) + 5, np.full(s, 2, np.int32),
                       hist, hist > 0, np.full((s, 2), -1, np.int32), np.full((s, 3), -1, np.int32),
                       np.zeros((s, 3), np.float32), np.full((s, 2), -1, np.int32), np.zeros(s, np.int32),
                       np.full((s, 1, 3), -1, np.int32), np.zeros(s, bool))
    tokens, positions = np.arange(t, dtype=np.int32) * 3, np.arange(t, dtype=np.int32)
    logits_indices = np.array([2, 3, 0, 0], np.int32)
    stop_ids, max_new = np.full((s, MAX_STOP_IDS), -1, np.int32), np.array([1, 4, 0, 0], np.int32)
    inputs = StepInputs(tokens, positions, meta, logits_indices, sb, stop_ids, max_new, np.int32(4),
                        np.full(t, -1, np.int32))
    _, sent = decode(encode("step", step_arrays(inputs)))
    got = step_inputs(sent, jax.tree.structure(inputs))
    tk, ps, m2, li, sb2 = got.tokens, got.positions, got.meta, got.logits_indices, got.sampling
    assert np.array_equal(tk, tokens) and np.array_equal(ps, positions) and np.array_equal(li, logits_indices)
    assert np.array_equal(got.stop_ids, stop_ids) and np.array_equal(got.max_new, max_new)
    assert got.num_iters.shape == () and got.num_iters == 4      # a scalar stays a scalar
    for field in ("seq_ids", "slot_mapping", "block_tables", "context_lens", "query_start_loc", "decode_tokens",
                  "decode_items", "chunk_tiles", "chunk_items", "num_items"):
        assert np.array_equal(getattr(m2, field), getattr(meta, field)), field
    for field in ("temperature", "top_k", "top_p", "seed", "position", "num_logprobs"):
        assert np.array_equal(getattr(sb2, field), getattr(sb, field)), field
    assert sb2.history is None and sb2.history_is_output is None    # device arrays are not sent


# ------------------------------------------------------------------------------ two processes

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _group(commands: list[tuple[list[str], dict]], logs: Path):
    """Start every process (4 CPU devices each); on leaving, kill whichever is still running."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip())
    procs = []
    try:
        for i, (cmd, extra_env) in enumerate(commands):
            with open(logs / f"process{i}.log", "w") as out:
                procs.append(subprocess.Popen(["nice", "-n", "10", *cmd], cwd=ROOT, env=dict(env, **extra_env),
                                              stdout=out, stderr=subprocess.STDOUT))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _wait(procs, deadline: float, logs: Path) -> list[int]:
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    if any(p.poll() is None for p in procs):
        tails = "\n".join(f"--- process {i}\n{_log(logs, i)}" for i in range(len(procs)))
        pytest.fail(f"the process group did not finish within {GROUP_TIMEOUT_S}s\n{tails}")
    return [p.returncode for p in procs]


def _run_group(commands: list[tuple[list[str], dict]], logs: Path) -> list[int]:
    """Run the processes to completion within GROUP_TIMEOUT_S; their exit codes."""
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    with _group(commands, logs) as procs:
        return _wait(procs, deadline, logs)


def _log(logs: Path, i: int) -> str:
    return (logs / f"process{i}.log").read_text()[-4000:]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.hf_models import save_text_model
    return save_text_model(tmp_path_factory.mktemp("mh") / "model")


@pytest.fixture(scope="module")
def group_result(model_dir, tmp_path_factory):
    if getattr(jax.config, "jax_cpu_collectives_implementation", None) is None:
        pytest.skip(f"jax {jax.__version__} has no cross-process CPU collectives (jax_cpu_collectives_implementation)")
    tmp = tmp_path_factory.mktemp("group")
    port = _free_port()
    worker = [sys.executable, "-m", "tests.multihost_worker", str(model_dir)]
    codes = _run_group([   # process 0 from arguments, process 1 from the JAXINFER_* env vars
        (worker + [str(tmp / "p0.json"), "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
                   "--process-id", "0"], {}),
        (worker + [str(tmp / "p1.json")], {"JAXINFER_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                                           "JAXINFER_NUM_PROCESSES": "2", "JAXINFER_PROCESS_ID": "1"}),
    ], tmp)
    assert codes == [0, 0], f"exit codes {codes}\n{_log(tmp, 0)}\n{_log(tmp, 1)}"
    return [json.loads((tmp / f"p{i}.json").read_text()) for i in range(2)]


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model and settings in this process, on one device."""
    from jaxinfer import Generator
    gen = Generator.from_pretrained(model_dir, **SETTINGS)
    assert gen.is_leader and gen.process_group is None
    return {"outputs": run_requests(gen), "logits": gen.logits(LOGITS_PROMPT), "gen": gen}


def test_two_processes_form_one_tp8_mesh(group_result):
    for pid, r in enumerate(group_result):
        assert (r["process_index"], r["process_count"], r["device_count"], r["local_device_count"]) == (pid, 2, 8, 4)
        assert r["is_leader"] == (pid == 0)
        # weights went straight into their shards: a global [64, 96] matrix split over 8 devices by
        # its mlp axis, of which this process holds 4 slices of 96 / 8 columns on its own devices
        assert r["up_shape"] == [64, 96] and r["up_spec"] == "P(None, 'tensor')" and not r["up_fully_addressable"]
        assert r["up_local_shard_bytes"] == [r["up_nbytes"] // 8] * 4
        assert len(r["up_local_devices"]) == 4
        assert r["kv_pages_spec"] == "P()"      # 2 KV heads < 8 devices: replicated pages
        assert r["num_blocks"] == SETTINGS["num_blocks"]
    assert set(group_result[0]["up_local_devices"]).isdisjoint(group_result[1]["up_local_devices"])


@pytest.mark.cpu_only("the process group runs on CPU devices; its one-process reference must too (1e-5)")
def test_two_processes_generate_like_one(group_result, reference):
    leader, follower = group_result
    got, ref = leader["outputs"], reference["outputs"]
    assert set(got) == set(ref) == {"greedy", "seeded", "penalties", "constrained"}
    for name in ref:
        assert len(got[name]) == len(PROMPTS)
        for p, (g_samples, r_samples) in enumerate(zip(got[name], ref[name])):
            assert len(g_samples) == len(r_samples) == (2 if name == "seeded" else 1)
            for (g_text, g_ids, g_reason, g_lps), (r_text, r_ids, r_reason, r_lps) in zip(g_samples, r_samples):
                assert (g_text, g_ids, g_reason) == (r_text, r_ids, r_reason), (name, p)
                np.testing.assert_allclose(g_lps, r_lps, rtol=0, atol=1e-5)
    assert all(re.fullmatch(r"[a-z]+( [a-z]+){0,3}", s[0][0]) or s[0][2] == "length" for s in ref["constrained"])
    greedy_ids = [s[0][1] for s in ref["greedy"]]
    assert all(len(set(ids)) > 3 for ids in greedy_ids)                  # not a degenerate repeat
    seeded = ref["seeded"]
    assert any(s[0][1] != s[1][1] for s in seeded)                        # n=2 samples really differ
    logits, ref_logits = np.asarray(leader["logits"], np.float32), reference["logits"]
    assert logits.shape == ref_logits.shape == (len(LOGITS_PROMPT), 400)
    assert np.max(np.abs(logits - ref_logits)) <= 1e-5 * np.max(np.abs(ref_logits))


def test_follower_runs_every_step_and_compiles_nothing_new(group_result):
    leader, follower = group_result
    stats = leader["stats"]
    assert stats["compilations_after_warmup"] == 0
    assert stats["kv_blocks_used"] == 0
    # one program per engine step plus the gen.logits forward, then "stop"
    assert follower["programs_followed"] == stats["num_steps"] + 1
    # after warm-up both compiled only the gen.logits forward, the same on each process
    assert follower["compiles_after_warmup"] == leader["compiles_after_warmup"] <= 2
    assert "process 1 of 2 takes no requests" in follower["follower_generate_error"]
    assert "generator is closed" in leader["after_close_error"]


def test_single_process_generator_has_no_followers(reference):
    gen = reference["gen"]
    gen.close()                                   # no-op
    with pytest.raises(RuntimeError, match="follow\\(\\) is for multi-host processes other than 0"):
        gen.follow()


def _serve_cmd(model_dir: Path, coordinator: str, num_seqs: int = SETTINGS["max_num_seqs"]) -> list[str]:
    return [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", str(model_dir), "--dtype", "float32",
            "--max-num-seqs", str(num_seqs), "--block-size", "8", "--num-blocks", "64", "--max-model-len", "32",
            "--max-num-batched-tokens", "8", "--tensor-parallel", "8", "--coordinator-address", coordinator,
            "--num-processes", "2"]


def test_processes_with_different_settings_refuse_to_start(model_dir, tmp_path):
    """Process 0 (the worker, max_num_seqs 4) and process 1 (`jaxinfer serve --max-num-seqs 8`):
    both stop with the differing setting named, before loading or compiling anything."""
    port = _free_port()
    serve = _serve_cmd(model_dir, f"127.0.0.1:{port}", num_seqs=8) + ["--process-id", "1"]
    codes = _run_group([
        ([sys.executable, "-m", "tests.multihost_worker", str(model_dir), str(tmp_path / "p0.json"),
          "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"], {}),
        (serve, {}),
    ], tmp_path)
    assert codes == [3, 2], f"exit codes {codes}\n{_log(tmp_path, 0)}\n{_log(tmp_path, 1)}"
    err0 = json.loads((tmp_path / "p0.json").read_text())["error"]
    assert "multi-host: settings differ" in err0 and "'max_num_seqs': 8" in err0
    assert "jaxinfer serve: error: multi-host: settings differ" in _log(tmp_path, 1)
    assert "'process 1': {'max_num_seqs': 8}" in _log(tmp_path, 1)


@pytest.mark.cpu_only("the process group runs on CPU devices; its one-process reference must too")
def test_jaxinfer_serve_on_two_processes(model_dir, reference, tmp_path):
    """`jaxinfer serve` on two processes (flags on process 0, env vars on process 1): process 0 answers
    HTTP like the one-process reference, process 1 binds no port; Ctrl-C on process 0 stops both."""
    assert SETTINGS == dict(dtype="float32", max_num_seqs=4, block_size=8, num_blocks=64, max_model_len=32,
                            max_num_batched_tokens=8)   # what _serve_cmd spells out as flags
    coordinator, http = f"127.0.0.1:{_free_port()}", _free_port()
    follower_http = _free_port()
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    with _group([(_serve_cmd(model_dir, coordinator) + ["--process-id", "0", "--port", str(http)], {}),
                 (_serve_cmd(model_dir, coordinator)[:-4] + ["--port", str(follower_http)],
                  {"JAXINFER_COORDINATOR_ADDRESS": coordinator, "JAXINFER_NUM_PROCESSES": "2",
                   "JAXINFER_PROCESS_ID": "1"})], tmp_path) as procs:
        while True:
            assert all(p.poll() is None for p in procs), f"{_log(tmp_path, 0)}\n{_log(tmp_path, 1)}"
            assert time.monotonic() < deadline, "the server did not come up in time"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        body = json.dumps({"model": "model", "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                     {"content-type": "application/json"})
        choice = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{follower_http}/health", timeout=2)
        procs[0].send_signal(signal.SIGINT)
        codes = _wait(procs, deadline, tmp_path)
    ref_text, _, ref_reason, _ = reference["outputs"]["greedy"][0][0]
    assert (choice["text"], choice["finish_reason"]) == (ref_text, ref_reason)
    assert codes == [0, 0], f"exit codes {codes}\n{_log(tmp_path, 0)}\n{_log(tmp_path, 1)}"
    assert "process 1 of 2: following process 0" in _log(tmp_path, 1)
    assert "process 1: process 0 closed after" in _log(tmp_path, 1)
