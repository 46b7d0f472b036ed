"""Test tolerances derived from the arithmetic, the same on every backend.

Every float32 dot in jaxinfer and its kernels runs at float32's precision (HIGHEST: IEEE, not the
TF32 a GPU's DEFAULT would use; tests/test_precision.py checks each program for it), so a float32
result differs from a float64 computation of the same definition only by float32 rounding, and
bfloat16 results by rounding their operands and outputs to bfloat16. u(dtype) is the unit roundoff
(half an ulp at 1): 2^-24 for float32, 2^-8 for bfloat16, 2^-11 for float16. (TF32 would be 2^-11:
the 4e-4 errors a GPU's TF32 references showed are 20x over the float32 bounds below.)
"""
from __future__ import annotations

import numpy as np


def unit_roundoff(dtype) -> float:
    """2^-(p) for a dtype with p - 1 stored mantissa bits."""
    import jax.numpy as jnp
    return float(2.0 ** -(jnp.finfo(jnp.dtype(dtype)).nmant + 1))


def attention_rtol(dtype, keys: int, head_dim: int) -> float:
    """Bound on max|out - ref| / max|ref| for softmax attention of unit-variance q, k, v computed
    with float32 scores, softmax and accumulation, with `keys` visible keys and head_dim d:
      - the score q.k (d products, scaled by d^-1/2: |score| <= ~4 for these inputs) carries up to
        d * u32 * 4 of absolute error, which exp turns into that relative error of each weight;
      - the weighted sum over the keys adds up to keys * u32 (the recursive-summation bound, Higham
        Lemma 3.1, first order);
      - each side's output is rounded to dtype (u each), and in bfloat16 / float16 the probabilities
        are rounded to dtype before the PV dot, relative to a running maximum in the kernels and to the
        row's maximum in the references (u more).
    """
    u32 = unit_roundoff("float32")
    u = unit_roundoff(dtype)
    narrow = 0.0 if u == u32 else u
    return (4 * head_dim + keys) * u32 + 2 * u + narrow


def rel_err(a, b) -> float:
    """max|a - b| / max|b| in float64 (a and b finite and of the same shape)."""
    import jax.numpy as jnp
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.isfinite(a).all()
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
