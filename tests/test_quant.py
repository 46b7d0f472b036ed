"""Weight-only quantization: Pallas quant_matmul (interpreted on CPU, compiled on a GPU) vs reference,
the load-time quantizer's error bounds, int4 packing, qdot on N-D weights, and the on-disk autotuner.

The tests of device code (the quant_matmul / w8a8_matmul kernels, qdot with impl="pallas", the fp8
native dot) are marked `device`: `make test-gpu` runs them compiled on a GPU."""
from __future__ import annotations

import json
import zlib
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import quant
from jaxinfer.quant import QuantizedWeight, dequantize, qdot, quantize_int4, quantize_int8
from pallas_kernels import autotune as at
from pallas_kernels.quant_matmul import (
    pack_int4,
    quant_matmul,
    quant_matmul_reference,
    unpack_int4,
)
from tests.precision import assert_rel_close, dot_chain_rtol

F32_RTOL = 1e-5
BF16_RTOL = 1e-2


@pytest.fixture(autouse=True)
def _isolated_autotune_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXINFER_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    # these tests time real launches: no budget (tests/test_autotune.py tests it on a fake clock)
    monkeypatch.setenv("JAXINFER_AUTOTUNE_BUDGET_S", "inf")
    at.clear_memory_cache()
    yield
    at.clear_memory_cache()


# ------------------------------------------------------------------------------------------------
# numpy helpers written independently of the code under test
# ------------------------------------------------------------------------------------------------

def np_pack(q: np.ndarray) -> np.ndarray:
    """[K, N] ints -> uint8 [K/2, N]: low nibble = even k, high nibble = odd k."""
    u = q.astype(np.int64) & 0xF
    return (u[0::2] | (u[1::2] << 4)).astype(np.uint8)


def np_unpack(p: np.ndarray, signed: bool) -> np.ndarray:
    p = p.astype(np.int64)
    lo, hi = p & 0xF, p >> 4
    if signed:
        lo = np.where(lo >= 8, lo - 16, lo)
        hi = np.where(hi >= 8, hi - 16, hi)
    out = np.empty((2 * p.shape[0], p.shape[1]), np.int64)
    out[0::2], out[1::2] = lo, hi
    return out


def np_dequant(qw: QuantizedWeight) -> np.ndarray:
    """[K, N] float64 dequantized weight from the raw QuantizedWeight fields."""
    s = np.asarray(qw.scales, np.float64)
    if qw.bits == 8 and qw.group_size is None:
        return np.asarray(qw.q, np.float64) * s[None, :]
    if qw.bits == 8:     # grouped 8-bit: int8 or e4m3 codes (ml_dtypes converts e4m3 exactly)
        q = np.asarray(qw.q).astype(np.float64)
    else:
        q = np_unpack(np.asarray(qw.q), signed=qw.zeros is None).astype(np.float64)
    s_el = np.repeat(s, qw.group_size, axis=0)
    if qw.zeros is not None:
        q = q - np.repeat(np.asarray(qw.zeros, np.float64), qw.group_size, axis=0)
    return q * s_el


def np_scale_per_element(qw: QuantizedWeight) -> np.ndarray:
    s = np.asarray(qw.scales, np.float64)
    if qw.bits == 8 and qw.group_size is None:
        return np.broadcast_to(s[None, :], (qw.k, qw.n))
    return np.repeat(s, qw.group_size, axis=0)


def rel_err(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))


U_F32, U_BF16 = 2.0 ** -24, 2.0 ** -8    # unit roundoff of float32 and bfloat16 (round to nearest)


def dot_error_bound(x64: np.ndarray, w64: np.ndarray, operands_bf16: bool, out_bf16: bool,
                    float_zeros: bool = False) -> np.ndarray:
    """Per-element bound on |computed - exact| for x @ w ([M, K] @ [K, N], exact in float64) as the
    kernels and the reference compute it. Standard floating-point error analysis (Higham, ch. 3):
    - the weight is dequantized in float32 ((q - z) * s: one rounding; two with a float zero point,
      q - z rounding too) and, with bf16 operands, rounded again to bfloat16: relative error u32
      (2 u32) (+ u_bf16) per weight;
    - each product of two bf16 (or f32 at HIGHEST) operands is accumulated in float32 in some order,
      with int8's per-column scale applied after the sum: |error| <= gamma_{K+2} * sum_k |x_k w_k|,
      gamma_n = n u32 / (1 - n u32), whatever the blocking or summation order;
    - a bfloat16 output is rounded once more: u_bf16 * |y|.
    The bound is worst case (realised errors are ~sqrt(K) smaller) but never flaky: it holds for
    every input and every accumulation order."""
    n_ops = x64.shape[1] + 2 + (1 if float_zeros else 0)
    gamma = n_ops * U_F32 / (1 - n_ops * U_F32)
    sum_abs = np.abs(x64) @ np.abs(w64)
    exact = x64 @ w64
    bound = (gamma + (U_BF16 if operands_bf16 else 0.0)) * sum_abs
    if out_bf16:
        bound = bound + U_BF16 * (np.abs(exact) + bound)
    return bound


def assert_within(y, exact: np.ndarray, bound: np.ndarray) -> None:
    err = np.abs(np.asarray(y, np.float64) - exact)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


def weight_matrix(rng, k, n):
    """Gaussian weights with a few outlier columns and one all-zero column."""
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    w[:, 1] *= 20.0
    w[3, 2] = 1.5
    w[:, 0] = 0.0
    return w


# ------------------------------------------------------------------------------------------------
# kernel vs reference
# ------------------------------------------------------------------------------------------------

# (name, bits, group_size, symmetric, K, block_k) -- K has >= 3 blocks of block_k everywhere;
# g=32 has 2 groups per K block, g=64 one, g=128 a K block inside a group (block_k < g).
KINDS = [
    ("int8", 8, None, True, 96, 32),
    ("int4_g32_sym", 4, 32, True, 192, 64),
    ("int4_g32_asym", 4, 32, False, 192, 64),
    ("int4_g64_sym", 4, 64, True, 192, 64),
    ("int4_g64_asym", 4, 64, False, 192, 64),
    ("int4_g128_sym", 4, 128, True, 384, 64),
    ("int4_g128_asym", 4, 128, False, 384, 64),
]
N, BLOCK_N = 48, 16                 # 3 blocks along N
# M=64: 4 blocks of 16; M=5: 3 blocks of 2, the last one partial; M=1: decode (padded to 16).
M_BLOCKS = [(1, None), (5, 2), (64, 16)]
# Triton's smallest tile: a GPU takes block sizes that are powers of two >= 16 (int4: block_k >= 32),
# the interpreter any divisor
TRITON_MIN_BLOCK = 16


def random_kernel_operands(rng, bits, g, symmetric, k, n):
    if bits == 8 and g is None:
        w = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
        return w, jnp.asarray(rng.uniform(1e-3, 2e-2, n), jnp.float32), None
    if bits == 8:       # grouped 8-bit (symmetric: True, "int" zero points, "float" ones, or "fp8" codes)
        return grouped8_operands(rng, g, symmetric, k, n)
    q = rng.integers(-8, 8, (k, n)) if symmetric is True else rng.integers(0, 16, (k, n))
    w = jnp.asarray(np_pack(q))
    s = jnp.asarray(rng.uniform(1e-3, 5e-2, (k // g, n)), jnp.float32)
    if symmetric == "float":   # GGUF's Q4_K / Q2_K: a float32 zero point per group
        return w, s, jnp.asarray(rng.uniform(0.0, 15.0, (k // g, n)), jnp.float32)
    z = None if symmetric else jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8)
    return w, s, z


def grouped8_operands(rng, g, kind, k, n):
    """Grouped 8-bit codes [K, N] with f32 scales [K/g, N]: int8 codes with no zero point (kind
    True: GGUF's Q8_0 / Q6_K, GPTQ's symmetric 8-bit), int8 zero points ("int": GPTQ's asymmetric
    8-bit, codes and zeros shifted into int8), float32 ones ("float": GGUF's Q5_K), or e4m3 codes
    from normal draws, saturated at 448 ("fp8": fine-grained FP8 checkpoints)."""
    import ml_dtypes
    s = jnp.asarray(rng.uniform(1e-3, 2e-2, (k // g, n)), jnp.float32)
    if kind == "fp8":
        codes = np.clip(rng.standard_normal((k, n)) * 100.0, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        return jnp.asarray(codes), s, None
    w = jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)
    if kind == "int":
        return w, s, jnp.asarray(rng.integers(-128, 128, (k // g, n)), jnp.int8)
    if kind == "float":
        return w, s, jnp.asarray(rng.uniform(-20.0, 20.0, (k // g, n)), jnp.float32)
    return w, s, None


# f32 over every (kind, M); bf16 activations over every kind at M=5 (partial last M block) --
# the full cross product would double the interpret-mode compile time for no new code path. block_m=2
# is below Triton's tile, so on a GPU bf16 also runs at M=37 (3 blocks of 16, the last one partial)
# for int8, a K block holding two groups (g32 asym) and one inside a group (g128 sym).
# float zero points (symmetric "float": GGUF's Q4_K in groups of 32, Q2_K in groups of 16, 4 a K block;
# one group a K block too, the kernel's other branch)
FLOAT_ZERO_KINDS = [("int4_g32_fzero", 4, 32, "float", 192, 64), ("int4_g16_fzero", 4, 16, "float", 192, 64),
                    ("int4_g32_fzero_bk32", 4, 32, "float", 192, 32)]
# grouped 8-bit (the pre-quantized checkpoints' formats): Q8_0 (g32, 2 groups a K block), Q6_K (g16,
# 4), GPTQ 8-bit with zero points (g128, a K block inside a group), Q5_K's float zero points (g32),
# fine-grained FP8 (e4m3 codes, g128, one group a K block)
GROUPED8_KINDS = [("int8_g32_sym", 8, 32, True, 192, 64), ("int8_g16_sym", 8, 16, True, 192, 64),
                  ("int8_g128_asym", 8, 128, "int", 384, 64), ("int8_g32_fzero", 8, 32, "float", 192, 64),
                  ("fp8_g128", 8, 128, "fp8", 384, 128)]
KERNEL_CASES = ([(kind, m, bm, "float32") for kind in KINDS for m, bm in M_BLOCKS]
                + [(kind, m, bm, "float32") for kind in GROUPED8_KINDS for m, bm in M_BLOCKS[:2]]
                + [(kind, 37, 16, "bfloat16") for kind in GROUPED8_KINDS[2:]]
                + [(kind, 5, 2, "bfloat16") for kind in KINDS]
                + [(kind, 37, 16, "bfloat16") for kind in KINDS
                   if kind[0] in ("int8", "int4_g32_asym", "int4_g128_sym")]
                + [(FLOAT_ZERO_KINDS[0], m, bm, "float32") for m, bm in M_BLOCKS]
                + [(FLOAT_ZERO_KINDS[1], 5, 2, "float32"), (FLOAT_ZERO_KINDS[1], 37, 16, "bfloat16"),
                   (FLOAT_ZERO_KINDS[2], 5, 2, "float32")])


def _kernel_case(c):
    small = c[2] is not None and c[2] < TRITON_MIN_BLOCK
    return pytest.param(*c, id=f"{c[0][0]}-M{c[1]}-{c[3]}",
                        marks=[pytest.mark.cpu_only("block sizes below Triton's minimum tile")] if small else [])


@pytest.mark.device
@pytest.mark.parametrize("kind,m,block_m,dtype", [_kernel_case(c) for c in KERNEL_CASES])
def test_kernel_matches_reference(kind, m, block_m, dtype):
    name, bits, g, sym, k, bk = kind
    rng = np.random.default_rng(zlib.crc32(f"{name}-{m}-{dtype}".encode()))   # hash() of str varies per run
    w, s, z = random_kernel_operands(rng, bits, g, sym, k, N)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    y = quant_matmul(x, w, s, z, bits=bits, group_size=g, block_m=block_m, block_n=BLOCK_N, block_k=bk)
    assert y.shape == (m, N) and y.dtype == x.dtype
    # reference in f32 from the same (possibly bf16-rounded) activations, not cast back
    ref = quant_matmul_reference(x.astype(jnp.float32), w, s, z, bits=bits, group_size=g)
    # and independently in numpy float64 (exact up to float64 rounding, ~1e-16: negligible here)
    qw = QuantizedWeight(w, s, z, bits=bits, group_size=g, shape=(k, N))
    x64, w64 = np.asarray(x, np.float64), np_dequant(qw)
    exact = x64 @ w64
    # each against the exact product, within what its float32/bfloat16 arithmetic can lose
    fz = sym == "float"
    assert_within(ref, exact, dot_error_bound(x64, w64, operands_bf16=False, out_bf16=False, float_zeros=fz))
    bf16 = dtype == "bfloat16"
    assert_within(y, exact, dot_error_bound(x64, w64, operands_bf16=bf16, out_bf16=bf16, float_zeros=fz))


@pytest.mark.cpu_only("an odd group and blocks below Triton's tile: interpret mode only")
def test_grouped8_kernels_take_an_odd_group():
    """Grouped 8-bit codes need no even group (int4's two codes a byte do): GPTQ 8-bit per channel
    with zero points is one group of K, K odd here (45 rows, 2 groups), tiled and split-K."""
    from pallas_kernels.quant_matmul import quant_matmul_splitk
    rng = np.random.default_rng(45)
    w, s, z = grouped8_operands(rng, 45, "int", 90, 32)
    x = jnp.asarray(rng.standard_normal((3, 90)), jnp.float32)
    x64, w64 = np.asarray(x, np.float64), np_dequant(QuantizedWeight(w, s, z, bits=8, group_size=45, shape=(90, 32)))
    bound = dot_error_bound(x64, w64, operands_bf16=False, out_bf16=False)
    assert_within(quant_matmul(x, w, s, z, bits=8, group_size=45, block_k=45, block_n=16), x64 @ w64, bound)
    assert_within(quant_matmul_splitk(x, w, s, z, bits=8, group_size=45, num_splits=2, block_k=15, block_n=16,
                                      inner="reduce"), x64 @ w64, bound)


@pytest.mark.device
@pytest.mark.parametrize("m,block_m,azp", [(5, 16, None), (37, 16, -29), (64, 32, 11)])
def test_w8a8_kernel_is_exact(m, block_m, azp):
    """The int8 x int8 kernel over several M, N and K blocks (a partial last M block): the integer
    sum (xq - azp) @ w computed in int64 numpy, then the same two f32 multiplies, bit for bit;
    the zero point's column sums come from the weight tiles the kernel loaded."""
    from pallas_kernels.quant_matmul import w8a8_matmul
    rng = np.random.default_rng(m)
    k, n = 96, 48
    xq = rng.integers(-128, 128, (m, k)).astype(np.int8)
    w = rng.integers(-127, 128, (k, n)).astype(np.int8)
    sx = rng.uniform(1e-3, 1e-1, m).astype(np.float32)
    sw = rng.uniform(1e-4, 1e-2, n).astype(np.float32)
    y = w8a8_matmul(jnp.asarray(xq), jnp.asarray(w), jnp.asarray(sx), jnp.asarray(sw), azp, block_m=block_m,
                    block_n=16, block_k=32)
    acc = (xq.astype(np.int64) - (azp or 0)) @ w.astype(np.int64)
    assert np.abs(acc).max() < 2 ** 31                     # what an int32 accumulator holds exactly
    want = acc.astype(np.float32) * sx[:, None] * sw[None, :]
    assert y.shape == (m, n) and y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), want)
    yb = w8a8_matmul(jnp.asarray(xq), jnp.asarray(w), jnp.asarray(sx), jnp.asarray(sw), azp, out_dtype=jnp.bfloat16,
                     block_n=16, block_k=32)
    np.testing.assert_array_equal(np.asarray(yb), np.asarray(jnp.asarray(want, jnp.bfloat16)))
    with pytest.raises(ValueError, match="multiples"):
        w8a8_matmul(jnp.asarray(xq), jnp.asarray(w), jnp.asarray(sx), jnp.asarray(sw), block_n=32)
    with pytest.raises(TypeError, match="int8"):
        w8a8_matmul(jnp.asarray(xq, jnp.int32), jnp.asarray(w), jnp.asarray(sx), jnp.asarray(sw))


@pytest.mark.device
def test_kernel_default_blocks_and_interpret_default():
    """interpret=None: interpret mode on CPU, compiled on a GPU; default blocks clamp to the problem
    (block_n 128 -> N = 32, block_k 128 -> K = 64, block_m 16 for M = 3: a GPU takes them)."""
    rng = np.random.default_rng(1)
    w, s, z = random_kernel_operands(rng, 4, 32, False, 64, 32)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    y = quant_matmul(x, w, s, z, bits=4, group_size=32)
    ref = quant_matmul_reference(x, w, s, z, bits=4, group_size=32)
    assert rel_err(y, ref) < F32_RTOL


def test_kernel_rejects_bad_arguments():
    rng = np.random.default_rng(2)
    w, s, _ = random_kernel_operands(rng, 4, 32, True, 96, 48)
    x = jnp.ones((2, 96), jnp.float32)
    with pytest.raises(ValueError, match="block_n"):
        quant_matmul(x, w, s, bits=4, group_size=32, block_n=32, interpret=True)    # 48 % 32
    with pytest.raises(ValueError, match="group_size"):
        quant_matmul(x, w, s, bits=4, group_size=32, block_k=48, block_n=16, interpret=True)
    with pytest.raises(TypeError):
        quant_matmul(x, w.astype(jnp.int8), s, bits=4, group_size=32, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        quant_matmul(x, w, s, bits=4, group_size=32, block_n=48, block_k=32, interpret=False)
    # grouped 8-bit: int8 / e4m3 codes only, no zero points with e4m3, whole groups, blocks that hold
    # whole groups or lie inside one
    q8, s8, _ = grouped8_operands(rng, 32, True, 96, 48)
    f8, sf, _ = grouped8_operands(rng, 32, "fp8", 96, 48)
    with pytest.raises(TypeError, match="int8 or float8_e4m3fn"):
        quant_matmul(x, q8.astype(jnp.int16), s8, bits=8, group_size=32, interpret=True)
    with pytest.raises(ValueError, match="no zero points"):
        quant_matmul(x, f8, sf, jnp.zeros_like(sf), bits=8, group_size=32, interpret=True)
    with pytest.raises(ValueError, match=r"scales must be \[K//g, N\]"):
        quant_matmul(x, q8, s8[:2], bits=8, group_size=32, interpret=True)
    with pytest.raises(ValueError, match="K=96 is not a multiple of group_size=64"):
        quant_matmul(x, q8, s8, bits=8, group_size=64, interpret=True)
    with pytest.raises(ValueError, match="multiple or a divisor of group_size=32"):
        quant_matmul(x, q8, s8, bits=8, group_size=32, block_k=48, block_n=16, interpret=True)
    with pytest.raises(ValueError, match="per-channel bits=8 is symmetric"):
        quant_matmul(x, q8, s8[0], jnp.zeros((48,), jnp.int8), bits=8, interpret=True)


# ------------------------------------------------------------------------------------------------
# quantizer
# ------------------------------------------------------------------------------------------------

QUANTIZERS = [
    ("int8", lambda w: quantize_int8(w)),
    ("int4_g32_sym", lambda w: quantize_int4(w, 32, True)),
    ("int4_g32_asym", lambda w: quantize_int4(w, 32, False)),
    ("int4_g64_sym", lambda w: quantize_int4(w, 64, True)),
    ("int4_g64_asym", lambda w: quantize_int4(w, 64, False)),
    ("int4_g128_sym", lambda w: quantize_int4(w, 128, True)),
    ("int4_g128_asym", lambda w: quantize_int4(w, 128, False)),
]


@pytest.mark.parametrize("name,fn", QUANTIZERS, ids=[q[0] for q in QUANTIZERS])
def test_quantizer_round_trip_within_bound(name, fn):
    k, n = 256, 24
    w = weight_matrix(np.random.default_rng(3), k, n)
    qw = fn(w)
    assert qw.shape == (k, n) and qw.contract == 1
    w64 = w.astype(np.float64)
    dq = np.asarray(dequantize(qw), np.float64)
    np.testing.assert_allclose(dq, np_dequant(qw), rtol=1e-6, atol=1e-9)
    s_el = np_scale_per_element(qw)
    # round to nearest: |w - dq| <= scale/2, plus f32 rounding of w/scale and q*scale
    # (|q| <= 127 -> at most ~128 * 2^-24 * scale each); checked for every element.
    bound = s_el * 0.5 + s_el * 2.0 ** -14
    err = np.abs(w64 - dq)
    assert np.all(err <= bound), (name, float(np.max(err / bound)))
    np.testing.assert_array_equal(quant.elementwise_error_bound(qw) >= s_el * 0.5, True)
    assert float(np.max(np.abs(dq[:, 0]))) == 0.0                # all-zero column is exact
    s = np.asarray(qw.scales, np.float64)
    if qw.bits == 8:
        q = np.asarray(qw.q)
        assert qw.q.dtype == jnp.int8 and q.min() >= -127 and q.max() <= 127
        amax = np.abs(w64).max(axis=0)
        np.testing.assert_allclose(s[1:], amax[1:] / 127, rtol=1e-6)
    else:
        g = qw.group_size
        assert qw.q.dtype == jnp.uint8 and qw.q.shape == (k // 2, n) and s.shape == (k // g, n)
        q = np_unpack(np.asarray(qw.q), signed=qw.symmetric)
        amax = np.abs(w64).reshape(k // g, g, n).max(axis=1)
        if qw.symmetric:
            assert qw.zeros is None and q.min() >= -8 and q.max() <= 7
            np.testing.assert_allclose(s[:, 1:], amax[:, 1:] / 7, rtol=1e-6)
        else:
            z = np.asarray(qw.zeros)
            assert qw.zeros.dtype == jnp.uint8 and z.shape == (k // g, n)
            assert q.min() >= 0 and q.max() <= 15 and z.max() <= 15
            lo = np.minimum(w64.reshape(k // g, g, n).min(axis=1), 0)
            hi = np.maximum(w64.reshape(k // g, g, n).max(axis=1), 0)
            np.testing.assert_allclose(s[:, 1:], (hi - lo)[:, 1:] / 15, rtol=1e-6)


def test_quantizer_rejects_bad_group():
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_int4(np.ones((96, 8), np.float32), 64)


# ------------------------------------------------------------------------------------------------
# packing
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("signed", [True, False])
def test_int4_packing_matches_numpy(signed):
    rng = np.random.default_rng(4)
    q = rng.integers(-8, 8, (64, 10)) if signed else rng.integers(0, 16, (64, 10))
    packed = np.asarray(pack_int4(jnp.asarray(q)))
    assert packed.dtype == np.uint8 and packed.shape == (32, 10)
    np.testing.assert_array_equal(packed, np_pack(q))
    # low nibble = even k, high nibble = odd k
    np.testing.assert_array_equal(packed & 0xF, q[0::2] & 0xF)
    np.testing.assert_array_equal(packed >> 4, q[1::2] & 0xF)
    np.testing.assert_array_equal(np_unpack(packed, signed), q)
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed), signed=signed)), q)


def test_quantized_int4_storage_matches_numpy_pack():
    """The quantizer's packed bytes are np_pack of the integer codes round(w/s) (+ zero)."""
    w = weight_matrix(np.random.default_rng(5), 64, 8)
    for sym in (True, False):
        qw = quantize_int4(w, 32, sym)
        q = np_unpack(np.asarray(qw.q), signed=sym)
        np.testing.assert_array_equal(np_pack(q), np.asarray(qw.q))
        s = np.repeat(np.asarray(qw.scales), 32, axis=0)
        codes = np.round(w / s) if sym else np.round(w / s) + np.repeat(np.asarray(qw.zeros), 32, axis=0)
        codes = np.clip(codes, -8, 7) if sym else np.clip(codes, 0, 15)
        # float32 division may land exactly on a .5 tie differently; allow those rare off-by-one codes
        assert np.mean(codes == q) > 0.999 and np.max(np.abs(codes - q)) <= 1


# ------------------------------------------------------------------------------------------------
# qdot
# ------------------------------------------------------------------------------------------------

QDOT_WEIGHTS = [
    ("int8", lambda w, c: quantize_int8(w, contract=c)),
    ("int4_g32_sym", lambda w, c: quantize_int4(w, 32, True, contract=c)),
    ("int4_g32_asym", lambda w, c: quantize_int4(w, 32, False, contract=c)),
]


@pytest.mark.parametrize("impl", [pytest.param("pallas", marks=pytest.mark.device), "xla"])
@pytest.mark.parametrize("name,fn", QDOT_WEIGHTS, ids=[q[0] for q in QDOT_WEIGHTS])
def test_qdot_nd_weights_match_einsum(name, fn, impl):
    rng = np.random.default_rng(6)
    d, h, hd = 96, 3, 16
    # q/k/v projection: [d, h, hd], contract=1: K = 96, N = 48 (3 blocks of 32 / 16)
    w_qkv = rng.standard_normal((d, h, hd)).astype(np.float32) * 0.1
    qw = fn(w_qkv, 1)
    assert qw.shape == (d, h, hd) and (qw.k, qw.n) == (96, 48)
    x = rng.standard_normal((2, 3, d)).astype(np.float32)        # M = 6
    y = qdot(jnp.asarray(x), qw, 1, impl=impl)
    dq = np.asarray(dequantize(qw), np.float64)
    assert dq.shape == (d, h, hd)
    ref = np.einsum("btd,dhk->bthk", x.astype(np.float64), dq)
    assert y.shape == (2, 3, h, hd) and y.dtype == jnp.float32
    assert rel_err(y, ref) < F32_RTOL
    # output projection: [h, hd2, d], contract=2: K = 96, N = 48
    hd2, d2 = 32, 48
    w_o = rng.standard_normal((h, hd2, d2)).astype(np.float32) * 0.1
    qo = fn(w_o, 2)
    xo = rng.standard_normal((5, h, hd2)).astype(np.float32)    # M = 5
    yo = qdot(jnp.asarray(xo), qo, 2, impl=impl)
    ref_o = np.einsum("thk,hkd->td", xo.astype(np.float64), np.asarray(dequantize(qo), np.float64))
    assert yo.shape == (5, d2)
    assert rel_err(yo, ref_o) < F32_RTOL
    # bf16 activations
    yb = qdot(jnp.asarray(xo, jnp.bfloat16), qo, 2, impl=impl)
    ref_b = np.einsum("thk,hkd->td", np.asarray(jnp.asarray(xo, jnp.bfloat16), np.float64),
                      np.asarray(dequantize(qo), np.float64))
    assert yb.dtype == jnp.bfloat16 and rel_err(yb, ref_b) < BF16_RTOL


@pytest.mark.device
@pytest.mark.parametrize("name,fn", QDOT_WEIGHTS, ids=[q[0] for q in QDOT_WEIGHTS])
def test_qdot_error_vs_float_within_bound(name, fn):
    """|x @ w - qdot(x, q(w))| <= sum_k |x_k| scale_k / 2 (+ f32 rounding slack), every output."""
    rng = np.random.default_rng(7)
    d, f = 96, 64                                                 # MLP up projection [d, ffn]
    w = weight_matrix(rng, d, f)
    qw = fn(w, 1)
    x = rng.standard_normal((4, 5, d)).astype(np.float32)
    y = np.asarray(qdot(jnp.asarray(x), qw, impl="pallas"), np.float64)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    xa = np.abs(x.astype(np.float64))
    bound = xa @ (np_scale_per_element(qw) / 2)
    # f32 slack: quantizer rounding (2^-14 * scale per element) and the f32 accumulation.
    slack = xa @ (np_scale_per_element(qw) * 2.0 ** -14) + 1e-5 * (xa @ np.abs(w.astype(np.float64)))
    err = np.abs(y - exact)
    assert np.all(err <= bound + slack), float(np.max(err / (bound + slack)))
    np.testing.assert_allclose(quant.matmul_error_bound(x, qw), bound, rtol=1e-12)
    assert np.mean(err) < np.mean(bound)                          # the bound is not vacuous


def test_error_bounds_follow_stored_row_order_and_refuse_fp8():
    """matmul_error_bound pairs x's logical column k with the scale of the row that holds it (rows
    stored in `perm` order: stored row i is logical row perm[i]), checked on a grouped int8 weight
    by hand; fp8, whose error is relative to the value, is refused (it got the integer grids' half
    step, 32x too small)."""
    k, n, g = 8, 2, 4
    scales = np.array([[1.0, 2.0], [10.0, 20.0]], np.float32)        # groups of stored rows 0-3, 4-7
    perm = np.array([7, 6, 5, 4, 3, 2, 1, 0], np.int32)               # reversed: logical 0 is stored 7
    qw = QuantizedWeight(jnp.zeros((k, n), jnp.int8), jnp.asarray(scales), None, bits=8, group_size=g,
                         shape=(k, n), perm=jnp.asarray(perm))
    x = np.zeros((1, k), np.float32)
    x[0, 0] = 1.0                                                      # logical column 0: stored row 7, group 1
    assert quant.matmul_error_bound(x, qw).tolist() == [[5.0, 10.0]]
    with pytest.raises(ValueError, match="fp8"):
        quant.matmul_error_bound(x, quant.quantize_fp8(jnp.ones((k, n), jnp.float32)))


def test_qdot_float_weights_auto_and_pytree():
    rng = np.random.default_rng(8)
    w = rng.standard_normal((3, 32, 48)).astype(np.float32)
    x = rng.standard_normal((5, 3, 32)).astype(np.float32)
    y = qdot(jnp.asarray(x), jnp.asarray(w), 2)
    np.testing.assert_allclose(np.asarray(y), np.einsum("thk,hkd->td", x, w), rtol=1e-4, atol=1e-4)

    qw = quantize_int4(w, 32, False, contract=2)
    leaves, treedef = jax.tree_util.tree_flatten(qw)
    assert len(leaves) == 3 and len(jax.tree_util.tree_leaves(quantize_int4(w, 32, True, contract=2))) == 2
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (rebuilt.bits, rebuilt.group_size, rebuilt.shape, rebuilt.contract) == (4, 32, (3, 32, 48), 2)
    assert rebuilt.q is leaves[0] and rebuilt.zeros is leaves[2]
    # a QuantizedWeight passes through jit as an argument (static metadata, array leaves)
    from jaxinfer.config import resolve_impl_name
    f = jax.jit(lambda x, w: qdot(x, w, 2))
    y_auto = f(jnp.asarray(x), qw)                     # auto == xla on CPU, the Pallas kernel on a GPU
    y_xla = qdot(jnp.asarray(x), qw, 2, impl=resolve_impl_name("auto", jax.default_backend()))
    # jit and eager calls may fuse (and so sum) the 3 x 32-long contraction in other orders
    assert_rel_close(y_auto, y_xla, dot_chain_rtol(3 * 32), "jit(qdot) vs qdot")
    with pytest.raises(ValueError, match="contract"):
        qdot(jnp.asarray(x), qw, 1)
    with pytest.raises(ValueError):
        qdot(jnp.asarray(x), qw, 2, impl="triton")


# ------------------------------------------------------------------------------------------------
# autotune
# ------------------------------------------------------------------------------------------------

def test_shape_class_buckets_to_powers_of_two():
    assert at.shape_class(1, 5, 96, 4096) == "1x8x128x4096"
    assert at.shape_class(17, 33) == "32x64"


def _sleepy(delays, calls):
    def run(cfg):
        calls.append(cfg["v"])
        time.sleep(delays[cfg["v"]])
        return jnp.zeros(())
    return run


def test_autotune_measures_caches_and_rereads(tmp_path, monkeypatch):
    # measuring is what this test checks (tests/conftest.py turns it off for test runs off CPU)
    monkeypatch.delenv("JAXINFER_AUTOTUNE", raising=False)
    at.clear_memory_cache()      # this process's measuring budget, as a fresh process has it
    path = str(tmp_path / "sub" / "cache.json")
    cands = [{"v": 0}, {"v": 1}, {"v": 2}]
    # gaps of 40 and 80 ms between the candidates' sleeps: more than a loaded machine's oversleep
    # (a scheduler quantum of a few ms), so the order the medians give is the sleeps' order
    delays = {0: 0.12, 1: 0.001, 2: 0.04}

    # CPU (the key of this process's device on CPU, on any backend): the defaults, nothing measured,
    # nothing written
    calls: list[int] = []
    assert at.autotune("k", "8x128", cands, _sleepy(delays, calls), cache_path=path, device_key="cpu:cpu") == {"v": 0}
    assert calls == [] and not (tmp_path / "sub").exists()

    # forced: every candidate warmed up and timed; the fastest wins and is written to disk
    winner = at.autotune("k", "8x128", cands, _sleepy(delays, calls), cache_path=path, force=True, iters=3)
    assert winner == {"v": 1}
    assert sorted(set(calls)) == [0, 1, 2] and len(calls) == 3 * (1 + 3)
    data = json.loads(open(path).read())
    key = at.cache_key("k", "8x128")
    assert list(data["entries"]) == [key]
    assert at.device_kind() in key and jax.__version__ in key and "|k|" in key and key.endswith("8x128")
    assert data["entries"][key]["config"] == {"v": 1}
    assert data["entries"][key]["jax_version"] == jax.__version__

    # re-read from disk (fresh process simulated by dropping the in-memory memo): no measuring
    at.clear_memory_cache()

    def boom(cfg):
        raise AssertionError("must not measure on a cache hit")
    assert at.autotune("k", "8x128", cands, boom, cache_path=path, force=True) == {"v": 1}

    # a fake non-CPU device key measures too, under its own key; candidates that fail are skipped
    calls.clear()
    fake = "gpu:Fake H100"

    def partly_broken(cfg):
        if cfg["v"] == 1:
            raise RuntimeError("does not compile")
        return _sleepy(delays, calls)(cfg)
    assert at.autotune("k", "8x128", cands, partly_broken, cache_path=path, device_key=fake, iters=2) == {"v": 2}
    entries = at.load_cache(path)
    fake_key = at.cache_key("k", "8x128", device_key=fake)
    assert set(entries) == {key, fake_key} and fake in fake_key and jax.__version__ in fake_key
    assert entries[fake_key]["failed"] == 1

    # a cached winner that is no longer a candidate is re-measured
    at.clear_memory_cache()
    assert at.autotune("k", "8x128", [{"v": 0}, {"v": 2}], _sleepy(delays, calls), cache_path=path,
                       force=True, iters=2) == {"v": 2}
    with pytest.raises(RuntimeError, match="every candidate failed"):
        at.autotune("k2", "1", cands, boom, cache_path=path, force=True)


def test_autotune_default_cache_path_and_concurrent_writers(tmp_path, monkeypatch):
    path = tmp_path / "env_cache.json"
    monkeypatch.setenv("JAXINFER_AUTOTUNE_CACHE", str(path))
    assert at.default_cache_path() == str(path)
    cands = [{"v": 0}, {"v": 1}]
    errors = []

    def worker(i):
        try:
            at.autotune(f"kern{i}", "1x1", cands, lambda c: jnp.zeros(()), force=True, warmup=0, iters=1)
        except Exception as e:  # pragma: no cover
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 8 and all(e["config"] in cands for e in entries.values())
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.device
def test_select_blocks_tunes_while_tracing(tmp_path, monkeypatch):
    """The quant_matmul tuning closure runs eagerly even when qdot is being traced under jit (it
    launches the kernel: interpreted on CPU, compiled on a GPU)."""
    path = str(tmp_path / "qm.json")
    qw = quantize_int4(np.random.default_rng(9).standard_normal((96, 48)).astype(np.float32), 32)
    # not measuring (CPU, or JAXINFER_AUTOTUNE=0 on any backend): candidates[0], valid for the shape
    monkeypatch.setenv("JAXINFER_AUTOTUNE", "0")
    cfg0 = quant.select_blocks(5, 96, 48, qw, jnp.float32)
    assert cfg0 == quant.pallas_block_candidates(5, 96, 48, 4, 32)[0]
    assert cfg0["block_n"] == 16 and cfg0["block_k"] == 32 and cfg0["block_m"] == 16
    seen = []

    @jax.jit
    def traced(x):
        seen.append(quant.select_blocks(5, 96, 48, qw, jnp.float32, cache_path=path, force=True,
                                        max_candidates=2))
        return x * 2

    traced(jnp.ones(3))
    assert seen and seen[0] in quant.pallas_block_candidates(5, 96, 48, 4, 32)[:2]
    (entry,) = at.load_cache(path).values()
    assert entry["failed"] == 0 and len(entry["measured"]) == 2
    assert entry["kernel"] == "quant_matmul_int4_g32_sym"


# ------------------------------------------------------------------------------ fp8 (e4m3)

def _e4m3_bound(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """|w - dequant(w)| for e4m3 codes of w / scale, round to nearest: half a unit in the last place.
    Normal numbers (|w / scale| >= 2^-6) keep 3 mantissa bits: <= 2^-4 |w|; subnormals are spaced
    2^-9: <= 2^-10 scale. Plus the f32 rounding of w / scale and of code * scale (2^-23 relative)."""
    return np.maximum(2.0 ** -4 * np.abs(w), 2.0 ** -10 * scale) * (1 + 2.0 ** -20) + 2.0 ** -22 * np.abs(w)


def test_fp8_weights_match_ml_dtypes_and_bound():
    import ml_dtypes
    rng = np.random.default_rng(21)
    w = (rng.standard_normal((96, 40)) * 10.0 ** rng.uniform(-4, 0, (96, 40))).astype(np.float32)
    w[:, 3] = 0.0                                              # an all-zero column: scale 1, codes 0
    qw = quant.quantize_fp8(jnp.asarray(w))
    assert qw.fp8 and qw.bits == 8 and qw.q.dtype == jnp.float8_e4m3fn and qw.zeros is None
    # stored [N, K] (K contiguous: the native fp8 dot's layout), the codes of w [K, N] transposed
    assert qw.layout == "nk" and qw.q.shape == (40, 96) and qw.q_kn().shape == (96, 40)
    amax = np.abs(w).max(0)
    scale = np.where(amax > 0, amax / np.float32(448), 1).astype(np.float32)
    # XLA:CPU divides by the constant 448 as a multiply by its reciprocal: within an ulp; then exact
    np.testing.assert_allclose(np.asarray(qw.scales), scale, rtol=2.0 ** -23, atol=0)
    scale = np.asarray(qw.scales)
    want = (w / scale).astype(ml_dtypes.float8_e4m3fn)          # ml_dtypes' round-to-nearest-even cast
    np.testing.assert_array_equal(np.asarray(qw.q).view(np.uint8), want.T.view(np.uint8))
    kn = quant.quantize_fp8(jnp.asarray(w), layout="kn")        # the [K, N] layout (stacked experts')
    assert kn.layout == "kn" and kn.q.shape == (96, 40)
    np.testing.assert_array_equal(np.asarray(kn.q).view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(dequantize(kn)), np.asarray(dequantize(qw)))
    deq = np.asarray(dequantize(qw))
    np.testing.assert_array_equal(deq, want.astype(np.float32) * scale)          # one f32 product
    deq = deq.astype(np.float64)
    assert np.all(np.abs(deq - w) <= _e4m3_bound(w, scale[None, :]))
    assert np.abs(deq - w).max() > 0                           # (it does round)
    x = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)
    # the dequantized path (impl "auto" would take the native fp8 dot on a GPU: the test below)
    ref = np.asarray(x, np.float64) @ deq
    for layout_qw in (qw, kn):
        y = np.asarray(qdot(x, layout_qw, impl="xla"), np.float64)
        # f32 accumulation over K = 96 products: |error| <= 96 * 2^-24 * sum |x_k w_k| (a loose multiple)
        assert np.all(np.abs(y - ref) <= 96 * 2.0 ** -24 * (np.abs(np.asarray(x, np.float64)) @ np.abs(deq)) + 1e-30)


@pytest.mark.device
def test_fp8_native_path_matches_ml_dtypes_reference():
    """The GPU path of fp8 weights (qdot impl="pallas"): each row of x scaled to e4m3 by
    max|x_m| / 448, the e4m3 x e4m3 dot in f32, times the row and column scales; against numpy
    with ml_dtypes' e4m3 casts. Each product of two e4m3 values (4 significant bits each) is exact
    in f32, so the only differences are the f32 sum over K and the two final f32 products."""
    import ml_dtypes
    rng = np.random.default_rng(22)
    k, n = 96, 40
    w = (rng.standard_normal((k, n)) * 10.0 ** rng.uniform(-3, 0, (k, n))).astype(np.float32)
    x = (rng.standard_normal((7, k)) * 10.0 ** rng.uniform(-2, 1, (7, 1))).astype(np.float32)
    x[2] = 0.0                                                  # an all-zero row: scale 1, output 0
    x[4, 5] = 300.0                                             # an outlier sets its row's scale
    qw = quant.quantize_fp8(jnp.asarray(w))
    assert qw.layout == "nk"                                    # the dot contracts dim 1 of both operands
    y = np.asarray(qdot(jnp.asarray(x), qw, impl="pallas"), np.float64)
    # the row scales and codes: max|x_m| / 448 (XLA:CPU multiplies by the reciprocal: within an ulp),
    # then exactly ml_dtypes' round-to-nearest-even cast of x / sx with those scales
    codes, sx = (np.asarray(a) for a in quant.symmetric_codes(jnp.asarray(x), quant.FP8_DTYPE, axis=1))
    amax = np.abs(x).max(1)
    np.testing.assert_allclose(sx, np.where(amax > 0, amax / np.float32(448), 1), rtol=2.0 ** -23, atol=0)
    want = np.clip(x / sx[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(codes.view(np.uint8), want.view(np.uint8))
    xq = want.astype(np.float64)
    wq = np.asarray(qw.q).T.astype(np.float64)                  # [K, N]
    scales = np.asarray(qw.scales, np.float64)
    sx = sx.astype(np.float64)
    ref = (xq @ wq) * sx[:, None] * scales[None, :]
    # Whatever order a GPU's fp8 GEMM sums in (tiles, split K, a tree), a float32 sum of K exact terms
    # makes K - 1 roundings: |error| <= gamma_{K-1} sum |xq wq| (Higham, Lemma 3.1 and eq. 3.5, any
    # order), gamma_n = n u / (1 - n u), u = 2^-24; the two f32 rescales add a rounding each, so
    # (1 + gamma_{K-1})(1 + u)^2 - 1 <= gamma_{K+1}. An accumulator narrower than float32 (fp8 "fast
    # accumulation") would exceed it.
    u32 = 2.0 ** -24
    gamma = (k + 1) * u32 / (1 - (k + 1) * u32)
    bound = gamma * (np.abs(xq) @ np.abs(wq)) * sx[:, None] * scales[None, :]
    assert np.all(np.abs(y - ref) <= bound + 1e-30), np.max(np.abs(y - ref) - bound)
    assert np.all(y[2] == 0)
    # the [K, N] layout (contracting dim 0 of the codes): the same arithmetic, within the same bound
    kn = quant.quantize_fp8(jnp.asarray(w), layout="kn")
    y_kn = np.asarray(qdot(jnp.asarray(x), kn, impl="pallas"), np.float64)
    assert np.all(np.abs(y_kn - ref) <= bound + 1e-30), np.max(np.abs(y_kn - ref) - bound)
    # against the float product: e4m3's relative error on each x and w element (2^-4 for normal
    # numbers; x's subnormal codes are spaced 2^-9 sx) bounds how far the native path may move
    deq_w = wq * scales[None, :]
    err_x = np.maximum(2.0 ** -4 * np.abs(x), 2.0 ** -10 * sx[:, None]) * (1 + 2.0 ** -20)
    dev = (err_x @ np.abs(deq_w)) + np.abs(x) @ np.abs(deq_w - w) + bound     # (x^ - x) w^ + x (w^ - w)
    assert np.all(np.abs(y - x.astype(np.float64) @ w) <= dev + 1e-30)
    # and it is not the dequantized path: x's own rounding shows
    assert np.abs(y - np.asarray(qdot(jnp.asarray(x), qw, impl="xla"), np.float64)).max() > 0


def test_fp8_codes_shard_with_their_axes_swapped():
    """quantize_decoder(..., "fp8") stores each linear's codes [N, K]; sharding.quantized_sharding
    splits them as the [K, N] codes of int8 would be split, axes swapped: a column-parallel q
    [d, heads, hd] over "tensor" on the codes' first axis, the row-parallel o on their last axis."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxinfer.config import ModelConfig
    from jaxinfer.models.decoder import Decoder, quantize_decoder
    from jaxinfer.sharding import make_mesh, shard_decoder
    cfg = ModelConfig(vocab_size=136, d_model=32, n_layers=1, n_heads=8, n_kv_heads=2, head_dim=4, ffn_dim=64)
    model = quantize_decoder(Decoder(cfg, rngs=None), "fp8")
    mesh = make_mesh()
    shard_decoder(model, mesh)
    q, o = model.layers[0].attn.q.get_value(), model.layers[0].attn.o.get_value()
    assert q.layout == o.layout == "nk" and q.q.shape == (32, 32) and o.q.shape == (32, 32)
    assert q.q.sharding == NamedSharding(mesh, P("tensor", None))            # column-parallel, [N, K]
    assert q.scales.sharding == NamedSharding(mesh, P("tensor"))
    assert o.q.sharding == NamedSharding(mesh, P(None, "tensor"))            # row-parallel, [N, K]


def test_fp8_kv_pages_match_ml_dtypes_and_bound():
    import ml_dtypes
    from jaxinfer.kv_cache import init_kv_pages, kv_bytes_per_token, kv_storage_dtype, quantize_kv, write_kv
    rng = np.random.default_rng(22)
    x = (rng.standard_normal((7, 2, 16)) * 10.0 ** rng.uniform(-3, 1, (7, 2, 16))).astype(np.float32)
    x[4, 1] = 0.0
    q, s = quantize_kv(jnp.asarray(x), kv_storage_dtype("fp8"))
    amax = np.abs(x).max(-1)
    scale = np.where(amax > 0, amax / np.float32(448), 1).astype(np.float32)
    np.testing.assert_allclose(np.asarray(s), scale, rtol=2.0 ** -23, atol=0)   # (as for the weights)
    scale = np.asarray(s)
    want = (x / scale[..., None]).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want.view(np.uint8))
    deq = (want.astype(np.float32) * scale[..., None]).astype(np.float64)
    assert np.all(np.abs(deq - x) <= _e4m3_bound(x, scale[..., None]))
    # pages: one byte per element plus a float32 scale per token per KV head, as int8 pages
    pages = init_kv_pages(1, 2, 16, 4, 8, kv_storage_dtype("fp8"))[0]
    assert pages.k.dtype == jnp.float8_e4m3fn and pages.k_scale.shape == (2, 4, 8)
    assert kv_bytes_per_token(3, 2, 16, kv_storage_dtype("fp8")) == kv_bytes_per_token(3, 2, 16, jnp.int8) \
        == 2 * 3 * 2 * 16 + 2 * 4 * 3 * 2
    slots = jnp.asarray([9, 10, 11, 12, 13, 14, 15], jnp.int32)
    after = write_kv(pages, jnp.asarray(x), jnp.asarray(x), slots)
    got_q = np.asarray(after.k).transpose(1, 2, 0, 3).reshape(32, 2, 16)[9:16]
    got_s = np.asarray(after.k_scale).transpose(1, 2, 0).reshape(32, 2)[9:16]
    np.testing.assert_array_equal(got_q.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(got_s, scale)


def test_native_checkpoint_ignores_a_stored_impl(hf_model_dir, tmp_path):
    """The matmul implementation is no part of the weight format: a native checkpoint whose quantized
    weights' records name one (as a QuantizedWeight field once could) loads to the same arrays and
    logits, and the loaded model's layers run the backend default until an engine sets theirs."""
    from flax import nnx

    from jaxinfer.models.decoder import matmul_impl, quantize_decoder
    from jaxinfer.weights import load_model, save_native

    model, _ = load_model(hf_model_dir("llama-gqa-llama3"), "float32")
    quantize_decoder(model, "int8")
    save_native(model, tmp_path / "native", "float32")
    config = tmp_path / "native" / "config.json"
    meta = json.loads(config.read_text())
    for record in meta["quantized_weights"].values():
        record["impl"] = "pallas"
    config.write_text(json.dumps(meta))
    loaded, _ = load_model(tmp_path / "native", "float32")
    assert matmul_impl(loaded) == "auto"
    want, got = nnx.state(model, nnx.Param).flat_state(), nnx.state(loaded, nnx.Param).flat_state()
    for (p, a), (_, b) in zip(want, got):
        assert not hasattr(b.get_value(), "impl")
        for x, y in zip(jax.tree.leaves(a.get_value()), jax.tree.leaves(b.get_value())):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(p))
    ids, pos = jnp.arange(3, 20, dtype=jnp.int32), jnp.arange(17, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(loaded(ids, pos)[0]), np.asarray(model(ids, pos)[0]))
