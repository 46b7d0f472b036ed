"""float32 is computed in float32 on every backend (no TF32): every dot of float32 operands in the
engine's step, the full forward, the kernels and their references asks for HIGHEST precision (a
GPU's DEFAULT rounds float32 operands to TF32's 10-bit mantissa, XLA's cuBLAS dots and Triton's
tl.dot alike), and bfloat16 programs keep DEFAULT. The jaxpr checks hold on any backend; the probes
at the end show on the backend at hand that HIGHEST is IEEE float32 (compiled on a GPU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxinfer import Generator
from jaxinfer.kv_cache import attention_buckets

HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
ENGINE = dict(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4, block_size=8, num_blocks=33,
              warmup=False)


def dots(jaxpr, kinds: tuple[str, ...] = ("dot_general", "ragged_dot_general")) -> list[tuple[tuple, object]]:
    """(operand dtypes, precision) of every dot_general and ragged_dot_general (the grouped matmul of
    mixture-of-experts layers) in a (closed) jaxpr, sub-jaxprs included: jit, cond branches, loops,
    Pallas kernel bodies. kinds: the primitives to list."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in kinds:
            operands = eqn.invars[:2]     # ragged_dot_general's third operand is the group sizes
            found.append((tuple(str(v.aval.dtype) for v in operands), eqn.params["precision"]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    found += dots(sub, kinds)
    return found


def f32_dots_not_highest(jaxpr) -> list:
    return [d for d in dots(jaxpr) if d[0] == ("float32", "float32") and d[1] != HIGHEST]


def step_jaxpr(gen: Generator, t: int):
    r = gen.engine.runner
    b = next(b for tt, b in attention_buckets(r.token_buckets, r.block_buckets) if tt == t)
    return jax.make_jaxpr(r.step)(r.params, r.kv_pages, r.empty_inputs(t, b), r._no_prev)


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_float32_engine_asks_for_float32_dots(hf_model_dir, attention):
    gen = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), dtype="float32", attention=attention, **ENGINE)
    step = step_jaxpr(gen, 16)
    assert len(dots(step)) >= 10                       # projections, attention, LM head found
    assert f32_dots_not_highest(step) == []
    tokens = jnp.zeros(16, jnp.int32)
    forward = jax.make_jaxpr(gen._forward)(gen._params, tokens, jnp.arange(16, dtype=jnp.int32))
    assert dots(forward) and f32_dots_not_highest(forward) == []


@pytest.mark.parametrize("moe_impl", ["tiles", "ragged_dot"])
def test_float32_moe_engine_asks_for_float32_dots(hf_model_dir, moe_impl, monkeypatch):
    """gpt-oss (experts with biases, sinks): the tile loop's dots and ragged_dot's alike."""
    import jaxinfer.moe
    monkeypatch.setattr(jaxinfer.moe, "default_impl", lambda: moe_impl)
    gen = Generator.from_pretrained(hf_model_dir("gpt-oss"), dtype="float32", attention="xla", **ENGINE)
    step = step_jaxpr(gen, 16)
    assert len(dots(step, ("ragged_dot_general",))) == (8 if moe_impl == "ragged_dot" else 0)  # 4 layers x 2
    assert f32_dots_not_highest(step) == []


def test_bfloat16_engine_keeps_default_precision(hf_model_dir):
    """Nothing of a bfloat16 model pays for HIGHEST (the XLA attention's float32 einsums hold values
    that came from bfloat16, which TF32 represents exactly)."""
    gen = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), dtype="bfloat16", attention="xla", **ENGINE)
    found = dots(step_jaxpr(gen, 16))
    assert found and all(p in (None, (lax.Precision.DEFAULT,) * 2) for _, p in found), found


def test_kernels_and_references_ask_for_float32_dots():
    from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
    from pallas_kernels.quant_matmul import quant_matmul, quant_matmul_reference

    q = jnp.zeros((16, 4, 16), jnp.float32)
    kv = jnp.zeros((16, 2, 16), jnp.float32)
    pages = jnp.zeros((2, 5, 8, 16), jnp.float32)
    bt, lens = jnp.ones((16, 2), jnp.int32), jnp.ones((16,), jnp.int32)
    ids, qsl = jnp.arange(16, dtype=jnp.int32), jnp.arange(17, dtype=jnp.int32)
    programs = {
        "flash": lambda: flash_attention(q, kv, kv, scale=0.25, block_q=16, block_k=16),
        "flash_reference": lambda: flash_attention_reference(q, kv, kv, scale=0.25),
        "ragged": lambda: ragged_paged_attention(q, pages, pages, ids, ids, qsl, bt, lens, scale=0.25, block_q=16),
        "ragged_reference": lambda: ragged_paged_attention_reference(q, pages, pages, ids, ids, qsl, bt, lens, scale=0.25),
        "quant_matmul": lambda: quant_matmul(jnp.zeros((16, 32), jnp.float32), jnp.zeros((32, 16), jnp.int8),
                                             jnp.ones((16,), jnp.float32), bits=8, block_n=16, block_k=16),
        "quant_matmul_reference": lambda: quant_matmul_reference(jnp.zeros((16, 32), jnp.float32),
                                                                 jnp.zeros((32, 16), jnp.int8), jnp.ones((16,), jnp.float32),
                                                                 bits=8),
    }
    for name, fn in programs.items():
        jaxpr = jax.make_jaxpr(fn)()
        assert dots(jaxpr), name
        assert f32_dots_not_highest(jaxpr) == [], name


# --------------------------------------------------------------------------- probes on the backend at hand
# x = (1 + 2^-20, -1): x . (1, 1) is 2^-20 in float32 and 0 once x is rounded to TF32 (10-bit mantissa)
EPS = 2.0 ** -20


def _probe_operands(m: int, k: int, n: int):
    x = np.zeros((m, k), np.float32)
    x[:, 0], x[:, 1] = 1 + EPS, -1
    w = np.zeros((k, n), np.int8)
    w[:2] = 1
    return x, w


@pytest.mark.device
def test_float32_dots_are_ieee_on_this_backend():
    from jaxinfer.layers import dense
    from pallas_kernels.quant_matmul import quant_matmul

    x, w = _probe_operands(16, 32, 16)
    want = np.full((16, 16), EPS, np.float32)
    y = jax.jit(lambda a, b: dense(a, b, None))(jnp.asarray(x), jnp.asarray(w, jnp.float32))
    np.testing.assert_array_equal(np.asarray(y), want)                  # XLA's dot (cuBLAS on a GPU)
    y = quant_matmul(jnp.asarray(x), jnp.asarray(w), jnp.ones((16,), jnp.float32), bits=8, block_n=16, block_k=16)
    np.testing.assert_array_equal(np.asarray(y), want)                  # the Pallas kernel's tl.dot


@pytest.mark.device
def test_float32_attention_kernel_is_ieee_on_this_backend():
    """Two keys whose scores differ by 8 * 2^-14 (q . k over 16 dims, scale 1): in float32 the
    softmax weights differ by that much, so the output (v = +-1) is tanh(4 * 2^-14) ~ 2.4e-4; with
    TF32 scores (1 + 2^-14 rounds to 1) both weights are equal and the output is 0."""
    eps = 2.0 ** -14
    from pallas_kernels.flash_attention import flash_attention

    q = np.zeros((16, 1, 16), np.float32)
    q[:, 0, :] = 1
    k = np.zeros((16, 1, 16), np.float32)
    k[0, 0, :8] = 1 + eps                       # key 0: score 8 + 8 * 2^-14
    k[1:, 0, :8] = 1                            # every other key: score 8
    v = np.zeros((16, 1, 16), np.float32)
    v[0], v[1:] = 1, -1
    out = np.asarray(flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=1.0, causal=True,
                                     block_q=16, block_k=16))
    # query 1 sees keys 0 and 1: weights e^a, e^b with a - b = 8 * 2^-14 -> out = tanh((a - b) / 2)
    # (float32's rounding of the weights, ~6e-8, is 0.03% of the 4.9e-4 gap)
    np.testing.assert_allclose(out[1, 0, 0], np.tanh(4 * eps), rtol=1e-3)
