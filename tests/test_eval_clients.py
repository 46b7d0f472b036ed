"""Real clients against `jaxinfer serve` (issue 57): lm-evaluation-harness' `local-completions`
model (echo + logprobs, max_tokens 1) and guidellm's benchmark runs, on the bundled model.

References: lm-eval's own `hf` backend on the same weights exported with `jaxinfer export-hf`
(accuracy and each sample's loglikelihood, within 1e-3: float32 on both sides, so the two differ by
the rounding of a few hundred float32 dot products and sums per token, ~1e-5 of a loglikelihood of
order 100), and guidellm's own request accounting (zero errored requests).

The task is tests/lm_eval_tasks (local JSON: 16 multiple-choice items and 6 loglikelihood_rolling
passages from the bundled model's held-out text). lm-eval's API models need its `api` extra
(tenacity), which the test extras install (`lm-eval[api]` in pyproject.toml).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.fake_devices import HANG_GUARD_S
from tests.prometheus import metric_sum

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "checkpoints" / "jaxinfer-tiny-llama"
TASKS = ["jaxinfer_verses_mc", "jaxinfer_verses_rolling"]
# the longest task request (a passage, BOS first) is ~150 tokens; a 64-token budget with two token
# buckets keeps warm-up to two step shapes: 8 for guidellm's decoding, 64 for lm-eval's prompts
SERVE_FLAGS = ["--dtype", "float32", "--max-model-len", "320", "--max-num-batched-tokens", "64", "--token-buckets", "8",
               "--max-num-seqs", "8", "--log-level", "warning"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory) -> Path:
    from jaxinfer.cli import main
    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["export-hf", str(out), "--model", str(BUNDLED)]) == 0
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`jaxinfer serve` on the bundled model, as a user starts it; yields its base URL."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", "serve", "--model", str(BUNDLED),
                             "--port", str(port), *SERVE_FLAGS], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while True:
            assert proc.poll() is None, f"server exited: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "server did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def test_lm_eval_local_completions_matches_its_hf_backend(server, hf_export):
    import lm_eval
    from lm_eval.tasks import TaskManager
    tasks = TaskManager(include_path=str(ROOT / "tests" / "lm_eval_tasks"))
    # both tokenize with the exported tokenizer and put BOS first (the bundled model's training)
    api = lm_eval.simple_evaluate(
        model="local-completions", tasks=TASKS, task_manager=tasks, log_samples=True,
        model_args=f"base_url={server}/v1/completions,model=jaxinfer-tiny-llama,tokenizer={hf_export},"
                   "tokenizer_backend=huggingface,add_bos_token=True,num_concurrent=4,max_length=320")
    hf = lm_eval.simple_evaluate(model="hf", tasks=TASKS, task_manager=tasks, log_samples=True, batch_size=8,
                                 model_args=f"pretrained={hf_export},dtype=float32,device=cpu,add_bos_token=True")
    assert api["results"]["jaxinfer_verses_mc"]["acc,none"] == hf["results"]["jaxinfer_verses_mc"]["acc,none"]
    for task in TASKS:
        ours = [s["filtered_resps"] for s in sorted(api["samples"][task], key=lambda s: s["doc_id"])]
        ref = [s["filtered_resps"] for s in sorted(hf["samples"][task], key=lambda s: s["doc_id"])]
        assert len(ours) == len(ref) > 0
        for a, b in zip(ours, ref):
            for x, y in zip(a, b):      # (loglikelihood, is_greedy) per choice; rolling: the loglikelihood
                x, y = (x, y) if isinstance(x, (list, tuple)) else ((x,), (y,))
                assert abs(x[0] - y[0]) <= 1e-3, (task, x, y)
                assert tuple(x[1:]) == tuple(y[1:]), (task, x, y)


def test_guidellm_synchronous_and_concurrent_profiles(server, hf_export, tmp_path):
    # its own process, as a user runs it (guidellm forks workers: not from a process that runs jax)
    for profile, count in (("kind=synchronous", 4), ("kind=concurrent,streams=4", 8)):
        report = tmp_path / f"{profile.split(',')[0][5:]}.json"
        before = metric_sum(server, "jaxinfer_request_success_total")
        proc = subprocess.run([
            sys.executable, "-m", "guidellm", "run",
            "--backend", f"kind=openai_http,target={server},model=jaxinfer-tiny-llama",
            "--profile", profile, "--constraint", f"kind=max_requests,count={count}",
            "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
            "--tokenizer", f"kind=hf_auto,model={hf_export}",     # a local folder: no hub
            "--output", f"kind=json,path={report}", "--disable-console-interactive"],
            capture_output=True, text=True, timeout=HANG_GUARD_S, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        [bench] = json.loads(report.read_text())["benchmarks"]
        state = bench["scheduler_state"]
        # guidellm sent `count` requests and saw no error and no cancellation
        assert (state["created_requests"], state["errored_requests"], state["cancelled_requests"]) == (count, 0, 0), state
        # and the server finished every one of them (its counter moves when the HTTP side releases a
        # request, just after the response: wait for it, with a deadline far beyond that)
        deadline = time.monotonic() + 60
        while metric_sum(server, "jaxinfer_request_success_total") - before < count and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric_sum(server, "jaxinfer_request_success_total") - before == count
        # guidellm's own tallies are views of the same run, each short of `count` in a known way: its
        # coordinator drops a completion that arrives before that request's earlier status updates
        # (worker_group._finalize_terminal_request, "already finalized by a racing terminal update":
        # a concurrent run's successful_requests was once 7 of 8), and `metrics.request_totals` counts
        # only the requests inside its measurement window, whose end is a timestamp taken in another
        # process (CI: 3 of 4). Neither ever counts an error or an incomplete request here.
        assert 0 < state["successful_requests"] <= count, state
        totals = bench["metrics"]["request_totals"]
        assert totals["errored"] == 0 and totals["incomplete"] == 0 and 0 < totals["successful"] <= count, totals
