"""Shared fixtures: tiny random HF models saved locally (never from a hub), one folder per config."""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# no persistent compilation cache (jaxinfer.cli): every test compiles what it runs, in this process
# and in the servers and workers it starts
os.environ["JAXINFER_COMPILATION_CACHE"] = "off"
# The suite compiles far more than it runs (tiny models, a few steps per engine): LLVM's backend
# optimisation is most of XLA:CPU's compile time, so tests compile at level 0 (~25% less wall time
# for the suite, measured on engine tests; compute-heavy tests such as the model card's perplexity
# ran no slower). XLA's HLO passes, hence every program's operations and their float32 semantics,
# are unchanged; workers and servers started by tests inherit it (fake_devices.py appends to it).
# Benchmarks and users run the default level.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import pytest

from tests.hf_models import CONFIGS, save_hf_model


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """hf_model_dir(name) -> folder with config.json + model.safetensors of CONFIGS[name] (cached)."""
    cache: dict[str, str] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = save_hf_model(name, tmp_path_factory.mktemp(name))
        return cache[name]
    return get
