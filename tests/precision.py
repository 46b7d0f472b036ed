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


def dot_chain_rtol(*contractions: int, dtype="float32") -> float:
    """Bound on max|a - b| / max|b| for two evaluations of the same float computation that differ
    only in the order of their sums (tiling, fusion, a grouped vs a looped matmul): each K-long dot
    carries up to K * u of the sum of its terms' magnitudes (Higham, Lemma 3.1, first order), and the
    terms here (random weights of initializer scale, no planted cancellation) sum to the order of the
    largest output, so each dot on the path adds K * u of the tensor's scale. A later norm rescales
    the error with the signal, so the errors of the dots a value passed through add up: pass every
    contraction length on the path (each layer's K of its projections, the LM head's d_model).
    Two evaluations can round opposite ways, hence the factor 2."""
    return 2 * sum(contractions) * unit_roundoff(dtype)


def assert_rel_close(actual, desired, rtol: float, what: str = "") -> None:
    """max|actual - desired| <= rtol * max|desired|: rounding errors of sums scale with the tensor's
    magnitude, not with each element (an element near 0 carries its neighbours' absolute error)."""
    err = rel_err(actual, desired)
    assert err <= rtol, f"{what}: max|a - b| / max|b| = {err:.3g} > {rtol:.3g}"
