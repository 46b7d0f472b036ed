"""dtype="auto" (the default): float32 on CPU, where XLA:CPU runs bfloat16 matmuls about 2x
slower (bench/profile_step.py), bfloat16 on accelerators; the KV pages follow the weights unless
kv_dtype says otherwise."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import Generator
from jaxinfer.config import EngineConfig


def _float_dtypes(tree) -> set:
    return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_auto_dtype_is_float32_on_cpu_bfloat16_elsewhere(hf_model_dir):
    """The weights and KV pages in the dtype "auto" means on the backend at hand."""
    want = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    gen = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), max_num_seqs=2, warmup=False)
    assert gen.cfg.dtype == want
    assert _float_dtypes(gen._params) == {np.dtype(jnp.dtype(want))}
    assert _float_dtypes(gen.engine.runner.kv_pages) == {np.dtype(jnp.dtype(want))}


def test_explicit_bfloat16_is_kept(hf_model_dir):
    gen = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), dtype="bfloat16", max_num_seqs=2, warmup=False)
    assert gen.cfg.dtype == "bfloat16"
    assert _float_dtypes(gen.engine.runner.kv_pages) == {np.dtype(jnp.bfloat16)}


def test_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="dtype='fp8'"):
        EngineConfig(dtype="fp8")


def test_auto_kv_pages_follow_a_bfloat16_model(hf_model_dir):
    from jaxinfer.weights import load_model
    model, _ = load_model(hf_model_dir("llama-gqa-llama3"), "bfloat16")
    gen = Generator(model, None, EngineConfig(max_num_seqs=2), warmup=False)   # dtype="auto"
    assert _float_dtypes(gen.engine.runner.kv_pages) == {np.dtype(jnp.bfloat16)}
