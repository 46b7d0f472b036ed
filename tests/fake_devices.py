"""Run a test worker module in a subprocess with 8 fake CPU devices and return its RESULT json
(the pytest process has already initialised jax with one device)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A subprocess's time limit in the tests guards against a hang, never measures speed: the workers and
# smoke runs take 1-7 min alone on the 2-core machine and several times that beside other jobs (on a
# loaded machine three workers ran past the 400-600 s limits they had, and failed a correct suite)
HANG_GUARD_S = 1800


def run_worker(module: str, arg: Path, timeout_s: int = HANG_GUARD_S, devices: int = 8) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip())
    cmd = ["nice", "-n", "10", sys.executable, "-m", module, str(arg)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{module} exceeded {timeout_s}s; stderr tail:\n{(e.stderr or '')[-3000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{module} failed (rc {proc.returncode}):\n{proc.stderr[-5000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["n_devices"] == devices
    return result


def run_model_runs(module: str, runs: dict[str, list[dict]], tmp: Path, timeout_s: int = HANG_GUARD_S) -> dict[str, dict]:
    """Save each model of `runs` ({name: [engine kwargs, ...]}) under tmp/<name>, run the worker
    module over them on fake devices, check it reported every run, and return its runs by label."""
    from tests.hf_models import save_hf_model

    for name in runs:
        save_hf_model(name, tmp / name)
    result = run_worker(module, tmp, timeout_s=timeout_s)
    assert len(result["runs"]) == sum(len(r) for r in runs.values())
    return result["runs"]
