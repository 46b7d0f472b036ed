"""Shared fixtures: tiny random HF models saved locally (never from a hub), one folder per config.

Backends: `make test` runs everything on CPU (JAX_PLATFORMS=cpu unless set). `make test-gpu` runs the
tests marked `device` (kernels, the Pallas engine, quantized / fp8 / W8A8 matmuls) compiled on a GPU
(JAX_PLATFORMS=cuda, JAXINFER_TEST_GPU=1: the session stops at once if jax finds no GPU). Tests
marked `cpu_only(reason)` are skipped on any other backend, with their reason.
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ON_CPU = os.environ["JAX_PLATFORMS"] == "cpu"
if not ON_CPU:
    # the quantized-matmul autotuner would time up to 16 launch configs of every shape the tests
    # touch; the tests of the autotuner itself set their own environment
    os.environ.setdefault("JAXINFER_AUTOTUNE", "0")
# jaxinfer's own persistent compilation cache (~/.cache/jaxinfer/xla) is off in this process and in
# the servers and workers it starts: nothing is carried from one run, or one process, to another.
# Within one test run a cache of its own (pytest_configure below: a fresh temporary folder per
# run, shared by its xdist workers, removed at its end) lets an engine whose step programs another engine of the same run
# already compiled load them (XLA's own executables for the same HLO and flags): tests/
# test_speculative.py alone ran in 300 s instead of 362 s. Subprocesses never use it (only this
# conftest reads the folder's variable), so the worker
# tests that compare compilation counts between runs (sharding, multihost) count what they compile.
os.environ["JAXINFER_COMPILATION_CACHE"] = "off"
# The suite compiles far more than it runs (tiny models, a few steps per engine): LLVM's backend
# optimisation is most of XLA:CPU's compile time, so tests compile at level 0 (~25% less wall time
# for the suite, measured on engine tests; compute-heavy tests such as the model card's perplexity
# ran no slower). XLA's HLO passes, hence every program's operations and their float32 semantics,
# are unchanged; workers and servers started by tests inherit it (fake_devices.py appends to it).
# Benchmarks and users run the default level.
if ON_CPU and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import pytest

from tests.hf_models import CONFIGS, save_hf_model


_OWN_XLA_CACHE: list[str] = []     # folders this process made, removed at its end
SHARED_XLA_CACHE_ENV = "JAXINFER_TEST_SHARED_XLA_CACHE"


def pytest_configure(config):
    """One XLA cache folder for the whole run: made by the process that starts (the xdist
    controller, or the only process), inherited by the xdist workers through the environment (they
    are spawned after this hook), removed by the process that made it. The two workers of
    `make test` compile many of the same step programs (the bundled model's engines appear in a
    dozen files, and --dist loadfile sends the files to either worker), so each program compiled
    by one worker is loaded by the other. jax writes an entry with one write_bytes and reads it
    back through decompression, which fails on a half-written entry: jax then warns and compiles
    (jax/_src/compiler.py, _cache_read), so a race between the workers costs one compile, never
    a wrong executable."""
    if not ON_CPU or os.environ.get("JAXINFER_TEST_NO_XLA_CACHE"):
        return
    folder = os.environ.get(SHARED_XLA_CACHE_ENV)
    if not folder or not os.path.isdir(folder):
        import tempfile
        folder = tempfile.mkdtemp(prefix="jaxinfer-test-xla-")
        _OWN_XLA_CACHE.append(folder)
        os.environ[SHARED_XLA_CACHE_ENV] = folder
    import jax
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_unconfigure(config):
    import shutil
    for folder in _OWN_XLA_CACHE:
        shutil.rmtree(folder, ignore_errors=True)


FILE_SECONDS = os.path.join(os.path.dirname(__file__), "file_seconds.json")


def pytest_collection_modifyitems(config, items):
    """The test files heaviest first, each file's tests in their own order. `make test` runs
    pytest-xdist's --dist loadfile with --no-loadscope-reorder, so its two workers take the files
    in this order, each its next one when it runs low: longest first, the light files last fill
    the gap between the workers (xdist's own order, most tests first, handed out last the heavy
    files of few tests, test_eval_clients, test_speculative_tp, test_batch, and one worker waited
    112 s of a 37-minute run for the other). Seconds from tests/file_seconds.json
    (scripts/test_file_seconds.py rebuilds it); a file it does not list goes first, where
    whatever it costs cannot leave a worker idle at the end. The order changes nothing a test
    checks: each file's module fixtures are still built once, in one process."""
    try:
        with open(FILE_SECONDS) as f:
            seconds = json.load(f)["seconds"]
    except (OSError, ValueError, KeyError):
        return
    def heaviest_first(item):
        path = item.nodeid.split("::")[0]
        return -seconds.get(path, float("inf")), path

    items.sort(key=heaviest_first)


def pytest_sessionstart(session):
    if os.environ.get("JAXINFER_TEST_GPU"):
        import jax
        if jax.default_backend() != "gpu":
            pytest.exit(f"make test-gpu needs a GPU; jax's backend is {jax.default_backend()!r} ({jax.devices()})",
                        returncode=3)


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("cpu_only")
    if marker is not None:
        import jax
        if jax.default_backend() != "cpu":
            pytest.skip(f"CPU only: {marker.args[0] if marker.args else marker.kwargs.get('reason', '')}")


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """hf_model_dir(name) -> folder with config.json + model.safetensors of CONFIGS[name] (cached)."""
    cache: dict[str, str] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = save_hf_model(name, tmp_path_factory.mktemp(name))
        return cache[name]
    return get
