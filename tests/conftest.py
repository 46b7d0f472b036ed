"""Shared fixtures: tiny random HF models saved locally (never from a hub), one folder per config."""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# no persistent compilation cache (jaxinfer.cli): every test compiles what it runs, in this process
# and in the servers and workers it starts
os.environ["JAXINFER_COMPILATION_CACHE"] = "off"

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
