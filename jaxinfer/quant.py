"""Weight-only quantization: the load-time quantizer, the QuantizedWeight pytree, and qdot.

    qw = quantize_int4(w, group_size=128, symmetric=True)     # w [d, h, hd] float
    y = qdot(x, qw)                                           # x [..., d] -> [..., h, hd]

An N-D weight is quantized as the 2-D matrix [K, N], K = prod(shape[:contract]) (the contracted,
leading dims) and N = prod(shape[contract:]); ``contract`` is stored with the weight.

Formats (see pallas_kernels.quant_matmul for the kernel side):
* int8: per output channel, symmetric. q int8 [K, N] in [-127, 127], scales f32 [N] = max|w[:, n]| / 127.
* int4: per group of ``group_size`` consecutive k, packed two per byte along K (uint8 [K//2, N],
  low nibble = even k, high nibble = odd k), scales f32 [K//g, N].
  - symmetric: scale = max|w_group| / 7, q = clip(round(w / scale), -8, 7) stored as a 4-bit two's
    complement nibble; zeros None.
  - asymmetric: the group's range [min(w_min, 0), max(w_max, 0)] (0 is always included so that the
    integer zero point lies in [0, 15] and 0.0 is exact), scale = range / 15,
    zero = clip(round(-min / scale), 0, 15) (uint8 [K//g, N]), q = clip(round(w / scale) + zero, 0, 15).
* int3 (calibrated methods, jaxinfer.quantize): per group along K like int4, codes packed eight per
  three bytes along K (uint8 [3K/8, N]; within each run of 8 k, code j occupies bits 3j..3j+2 of
  the little-endian 24-bit word), symmetric codes in [-4, 3] (scale = max|w| / 3, 3-bit two's
  complement) or asymmetric codes in [0, 7] with zero points as for int4.
* per channel at 4 or 3 bits: one group spanning all of K (group_size = K, scales [1, N]).
* experts (batch=1, quantize_experts): a mixture of experts' stacked weights [E, K-dims, N-dims], each
  expert quantized on its own in any format above, every leaf stacked on a leading E axis (q [E, K, N]
  or [E, K/2, N], scales [E, N] or [E, K/g, N]); `shape` is the whole (E, ...) shape. qdot refuses
  them: jaxinfer.moe multiplies them expert by expert (expert_weight).
* fp8 (e4m3, OCP "fn": finite, max 448, 3 mantissa bits): per output channel like int8,
  codes w / scale cast to e4m3 (round to nearest even), scales f32 [N] = max|w[:, n]| / 448;
  bits=8 with q's dtype telling it from int8 (QuantizedWeight.fp8). The codes are stored
  transposed, q float8_e4m3fn [N, K] (layout "nk": K contiguous), transposed once here at quantize
  time: cuBLASLt's fp8 GEMM takes only the "TN" layout (both operands K-major), so a [K, N] weight
  made XLA transpose the whole weight on every call (the 2026-11-26 H200 run: fp8 decode no faster
  than bf16, and an allocator peak 8 GB above in-use for fp8 only). Stacked experts (quantize_experts)
  keep [E, K, N] (layout "kn"): jaxinfer.moe multiplies their codes as [K, N] matrices. On the
  XLA path (the CPU default) it is dequantized per call: y = (x @ e4m3(q) as f32) * scales. On the
  GPU path (qdot impl "pallas", the GPU default; the Pallas kernel has no fp8 format) it runs as
  vLLM's fp8 checkpoints do on Hopper: each row of x is scaled to e4m3 too (sx = max|x_m| / 448,
  dynamic per token) and the fp8 x fp8 dot accumulates in f32 (precision HIGHEST: XLA lowers it to
  cuBLASLt's fp8 GEMM on sm_89+ without the GEMM's reduced-precision "fast accumulation", which it
  allows at DEFAULT; elsewhere it converts and runs the same arithmetic; not yet run on a GPU), then
  y * sx[m] * scales[n] (fp8_native_matmul). Error: |w - dequant(w)| <=
  2^-4 |w| for |w| / scale >= 2^-6 (normal e4m3 numbers), <= 2^-10 scale below (subnormals).
* W8A8 (act_bits=8, SmoothQuant): int8 weights as above, and at run time each row (token) of x is
  quantized symmetrically to int8 with the scale sx = max|x_t| / 127 of its own (dynamic), or with
  one scale per weight calibrated offline (static, act_scale f32 []); y = (xq @ q as int32)
  * sx * scales[n]. Static activations may be asymmetric (act_zero int32 [] in [-128, 127]):
  xq = clip(round(x / sx) + z, -128, 127) and y = (xq @ q - z * colsum(q)) * sx * scales[n], the
  column sums coming out of the same int32 dot (a row of ones appended to xq), so q is read once.
  XLA only (the Pallas kernel is weight-only).
All rounding is round-to-nearest (ties to even); an all-zero column/group gets scale 1.0 (q = 0).
Error bound (symmetric and asymmetric): |w - dequant(w)| <= scale / 2 elementwise (plus f32 rounding),
hence |x @ w - x @ dequant(w)| <= sum_k |x_k| * scale_k / 2 per output (see the *_bound helpers).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.config import resolve_impl_name
from pallas_kernels import autotune as _autotune
from pallas_kernels.quant_matmul import (
    REDUCE_MAX_M,
    SPLITK_INNER,
    SPLITK_MAX_M,
    default_block_m,
    dequantize_weight,
    pack_int4,
    quant_matmul,
    quant_matmul_splitk,
    splitk_rows,
    unpack_int4,
    w8a8_matmul,
)

__all__ = [
    "QuantizedWeight",
    "quantize",
    "quantize_int8",
    "quantize_int4",
    "quantize_fp8",
    "quantize_experts",
    "expert_weight",
    "dequantize",
    "qdot",
    "pack_int4",
    "unpack_int4",
    "pack_int3",
    "unpack_int3",
    "grid_params",
    "grid_codes",
    "from_codes",
    "elementwise_error_bound",
    "matmul_error_bound",
    "pallas_block_candidates",
    "splitk_candidates",
    "select_blocks",
    "XLA_MATMUL",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [K, N] matrix standing for a float weight of logical shape `shape`.

    Data (pytree leaves): q (int8 [K, N] or packed uint8 [K//2, N]), scales (f32 [N] or [K//g, N]),
    zeros (uint8 [K//g, N] for asymmetric int4, else None).
    Static metadata: bits (8 | 4), group_size (None for int8), shape (logical N-D shape),
    contract (number of leading dims of `shape` that are contracted, i.e. K = prod(shape[:contract])),
    layout ("kn", or "nk" for fp8 codes stored [N, K]: q_kn() is always the [K, N] view).
    """
    q: Any
    scales: Any
    zeros: Any
    bits: int
    group_size: int | None
    shape: tuple[int, ...]
    contract: int = 1
    impl: str = "auto"      # what qdot(impl="auto") runs: the engine's resolved matmul implementation
    act_bits: int | None = None     # 8: W8A8 (SmoothQuant), activations quantized to int8 at run time
    act_scale: Any = None   # W8A8 static: f32 [] activation scale (x -> round(x / act_scale)); None: per token
    act_zero: Any = None    # W8A8 static asymmetric: int32 [] zero point (x -> round(x / act_scale) + act_zero)
    batch: int = 0          # 1: stacked experts, shape[0] of them, each its own [K, N] (quantize_experts)
    layout: str = "kn"      # "nk": q stored [N, K] (fp8 codes, module docstring); "kn": every other format

    @property
    def k(self) -> int:
        return math.prod(self.shape[self.batch:self.batch + self.contract])

    @property
    def n(self) -> int:
        return math.prod(self.shape[self.batch + self.contract:])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def fp8(self) -> bool:
        """e4m3 codes (bits=8) instead of int8."""
        return jnp.dtype(self.q.dtype) == FP8_DTYPE

    def q_kn(self) -> jax.Array:
        """The codes as [K, N] (a transpose for layout "nk"; the stored array otherwise)."""
        return self.q.T if self.layout == "nk" else self.q

    @property
    def nbytes(self) -> int:
        return sum(int(a.size) * a.dtype.itemsize
                   for a in (self.q, self.scales, self.zeros, self.act_scale, self.act_zero) if a is not None)


jax.tree_util.register_dataclass(
    QuantizedWeight,
    data_fields=["q", "scales", "zeros", "act_scale", "act_zero"],
    meta_fields=["bits", "group_size", "shape", "contract", "impl", "act_bits", "batch", "layout"],
)


def _as_2d(w, contract: int) -> tuple[jax.Array, tuple[int, ...], int, int]:
    shape = tuple(int(d) for d in w.shape)
    if not 1 <= contract <= len(shape):
        raise ValueError(f"contract={contract} must be in [1, {len(shape)}] for shape {shape}")
    k, n = math.prod(shape[:contract]), math.prod(shape[contract:])
    return jnp.asarray(w, jnp.float32).reshape(k, n), shape, k, n


FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0


def symmetric_codes(x: jax.Array, dtype, axis: int) -> tuple[jax.Array, jax.Array]:
    """Symmetric scaled codes of x, one scale per slice along `axis`: scale = max|x| / qmax over it
    (qmax 127 for int8, 448 for e4m3; 1 where the slice is all zero; the smallest normal f32 where
    max|x| / qmax underflows) and codes of x / scale clipped at +-qmax: int8 rounds to nearest,
    e4m3 casts (round to nearest even; e4m3fn has no infinity). -> (codes, f32 scales [x's shape
    without `axis`]). Weights per output channel (axis 0 of [K, N]), activations per token (axis 1
    of [M, K]) and KV pages per token and head (the last axis) all use it."""
    d = jnp.dtype(dtype)
    qmax = 127.0 if d == jnp.int8 else FP8_MAX
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=axis)
    scale = jnp.where(amax > 0, jnp.maximum(amax / qmax, jnp.finfo(jnp.float32).tiny), 1.0)
    y = jnp.clip(xf / jnp.expand_dims(scale, axis), -qmax, qmax)
    return (jnp.round(y) if d == jnp.int8 else y).astype(d), scale


def quantize_int8(w, *, contract: int = 1) -> QuantizedWeight:
    """Per-output-channel symmetric int8: scale[n] = max_k |w[k, n]| / 127, q = round(w / scale)."""
    w2, shape, _, _ = _as_2d(w, contract)
    q, scale = symmetric_codes(w2, jnp.int8, axis=0)
    return QuantizedWeight(q, scale, None, bits=8, group_size=None, shape=shape, contract=contract)


def quantize_fp8(w, *, contract: int = 1, layout: str = "nk") -> QuantizedWeight:
    """Per-output-channel e4m3: scale[n] = max_k |w[k, n]| / 448, codes e4m3(w / scale) (nearest even),
    stored [N, K] (layout "nk", the default: the native fp8 dot's layout) or [K, N] ("kn")."""
    if layout not in ("nk", "kn"):
        raise ValueError(f"fp8 layout must be 'nk' or 'kn', got {layout!r}")
    w2, shape, _, _ = _as_2d(w, contract)
    q, scale = symmetric_codes(w2, FP8_DTYPE, axis=0)                  # [K, N]
    return QuantizedWeight(q.T if layout == "nk" else q, scale, None, bits=8, group_size=None, shape=shape,
                           contract=contract, layout=layout)


def quantize_int4(w, group_size: int = 128, symmetric: bool = True, *, contract: int = 1) -> QuantizedWeight:
    """Group-wise (along K) int4, packed two per byte along K (low nibble = even k)."""
    w2, shape, k, n = _as_2d(w, contract)
    g = int(group_size)
    if g <= 0 or g % 2:
        raise ValueError(f"group_size must be a positive even number, got {group_size}")
    if k % g:
        raise ValueError(f"K={k} (shape {shape}, contract={contract}) is not a multiple of group_size={g}")
    wg = w2.reshape(k // g, g, n)
    if symmetric:
        amax = jnp.max(jnp.abs(wg), axis=1)
        scale = jnp.where(amax > 0, amax / 7.0, 1.0).astype(jnp.float32)
        q = jnp.clip(jnp.round(wg / scale[:, None, :]), -8, 7)
        zeros = None
    else:
        lo = jnp.minimum(jnp.min(wg, axis=1), 0.0)
        hi = jnp.maximum(jnp.max(wg, axis=1), 0.0)
        rng = hi - lo
        scale = jnp.where(rng > 0, rng / 15.0, 1.0).astype(jnp.float32)
        zero = jnp.clip(jnp.round(-lo / scale), 0, 15)
        q = jnp.clip(jnp.round(wg / scale[:, None, :]) + zero[:, None, :], 0, 15)
        zeros = zero.astype(jnp.uint8)
    packed = pack_int4(q.astype(jnp.int32).reshape(k, n))
    return QuantizedWeight(packed, scale, zeros, bits=4, group_size=g, shape=shape, contract=contract)


def quantize(w, bits: int, *, group_size: int | None = 128, symmetric: bool = True,
             contract: int = 1) -> QuantizedWeight:
    """Round-to-nearest. bits=8: per output channel, symmetric (group_size is not used).
    bits=4 or 3: groups of group_size along K; None or -1 = one group over all of K (per channel)."""
    if bits == 8:
        if not symmetric:
            raise ValueError("int8 quantization is symmetric only")
        return quantize_int8(w, contract=contract)
    if bits not in (4, 3):
        raise ValueError(f"bits must be 8, 4 or 3, got {bits}")
    w2, shape, k, n = _as_2d(w, contract)
    g = k if group_size in (None, -1) else int(group_size)
    if bits == 4 and g % 2 == 0:
        return quantize_int4(w, g, symmetric, contract=contract)
    if g <= 0 or k % g:
        raise ValueError(f"K={k} (shape {shape}, contract={contract}) is not a multiple of group_size={g}")
    scale, zero = grid_params(w2.reshape(k // g, g, n), bits, symmetric, axis=1, xp=jnp)
    codes = grid_codes(w2, jnp.repeat(scale, g, axis=0), None if zero is None else jnp.repeat(zero, g, axis=0),
                       bits, xp=jnp)
    return from_codes(codes, scale, zero, bits=bits, group_size=g, shape=shape, contract=contract)


def quantize_experts(w, method: str, group_size: int = 128, *, contract: int = 1) -> QuantizedWeight:
    """A mixture's stacked expert weights w [E, K-dims, N-dims] -> one QuantizedWeight with batch=1:
    each expert quantized on its own as quantize / quantize_fp8 would ("int8", "fp8", or "int4" in
    groups of group_size along K, shrinking to 64 or 32 where K needs it, else int8)."""
    k = math.prod(w.shape[1:1 + contract])
    g = next((g for g in (group_size, 64, 32) if k % g == 0 and g <= group_size), None)   # int4's group
    if method == "fp8":   # [K, N] codes per expert: jaxinfer.moe multiplies them as such
        one = lambda e: quantize_fp8(e, contract=contract, layout="kn")  # noqa: E731
    elif method == "int4" and g:
        one = lambda e: quantize(e, 4, group_size=g, contract=contract)  # noqa: E731
    elif method in ("int8", "int4"):   # int4 where no group fits K: int8, as quantize_decoder does
        one = lambda e: quantize_int8(e, contract=contract)  # noqa: E731
    else:
        raise ValueError(f"experts quantize to int8, int4 or fp8, not {method!r}")
    qw = jax.vmap(one)(jnp.asarray(w))
    return dataclasses.replace(qw, shape=(int(w.shape[0]), *qw.shape), batch=1)


def expert_weight(qw: QuantizedWeight, e) -> QuantizedWeight:
    """Expert e (an int or a traced index) of a batch=1 QuantizedWeight, as an ordinary [K, N] one."""
    assert qw.batch == 1, "expert_weight takes stacked experts (quantize_experts)"
    take = lambda a: None if a is None else a[e]  # noqa: E731
    return dataclasses.replace(qw, q=take(qw.q), scales=take(qw.scales), zeros=take(qw.zeros),
                               shape=qw.shape[1:], batch=0)


def grid_params(w, bits: int, symmetric: bool, *, axis: int, xp=np):
    """The RTN grid of each slice of w reduced over `axis` -> (scale, zero or None), float32.

    symmetric: scale = max|w| / qmax, codes in [-qmax - 1, qmax] (int8: [-127, 127]), qmax = 2^(b-1) - 1.
    asymmetric: range [min(w_min, 0), max(w_max, 0)], scale = range / (2^b - 1),
    zero = clip(round(-min / scale), 0, 2^b - 1). All-zero slices get scale 1. (xp: numpy or jax.numpy.)"""
    if symmetric:
        amax = xp.max(xp.abs(w), axis=axis)
        return xp.where(amax > 0, amax / (2 ** (bits - 1) - 1), 1.0).astype(np.float32), None
    maxq = 2 ** bits - 1
    lo = xp.minimum(xp.min(w, axis=axis), 0.0)
    hi = xp.maximum(xp.max(w, axis=axis), 0.0)
    scale = xp.where(hi - lo > 0, (hi - lo) / maxq, 1.0).astype(np.float32)
    return scale, xp.clip(xp.round(-lo / scale), 0, maxq).astype(np.float32)


def grid_codes(w, scale, zero, bits: int, xp=np):
    """Integer codes of w on the grid (scale, zero broadcast against w): round(w / scale) (+ zero), clipped."""
    if zero is None:
        qmax = 2 ** (bits - 1) - 1
        return xp.clip(xp.round(w / scale), -qmax if bits == 8 else -qmax - 1, qmax)
    return xp.clip(xp.round(w / scale) + zero, 0, 2 ** bits - 1)


def grid_dequant(codes, scale, zero):
    """The float value of codes on the grid: (codes - zero) * scale."""
    return (codes - (0 if zero is None else zero)) * scale


def from_codes(codes, scales, zeros, *, bits: int, group_size: int | None, shape: tuple[int, ...],
               contract: int = 1) -> QuantizedWeight:
    """Integer codes [K, N] (grid_codes) + scales ([N] for int8, [K/g, N] otherwise) + zeros (or None)
    -> a packed QuantizedWeight; how GPTQ and AWQ, which choose their own codes, make weights."""
    codes = jnp.asarray(codes, jnp.int32)
    scales = jnp.asarray(scales, jnp.float32)
    if bits == 8:
        assert zeros is None and scales.ndim == 1, "int8 is symmetric per output channel"
        return QuantizedWeight(codes.astype(jnp.int8), scales, None, bits=8, group_size=None,
                               shape=tuple(shape), contract=contract)
    packed = pack_int4(codes) if bits == 4 else pack_int3(codes)
    zeros = None if zeros is None else jnp.asarray(zeros).astype(jnp.uint8)
    return QuantizedWeight(packed, scales, zeros, bits=bits, group_size=int(group_size),
                           shape=tuple(shape), contract=contract)


def pack_int3(q: jax.Array) -> jax.Array:
    """q [K, N] ints in [-4, 3] (3-bit two's complement) or [0, 7] -> uint8 [3K/8, N]: each run of
    8 rows k..k+7 becomes the 24-bit little-endian word sum_j (q[k + j] & 7) << 3j (3 bytes)."""
    if q.ndim != 2 or q.shape[0] % 8:
        raise ValueError(f"pack_int3 expects [K, N] with K a multiple of 8, got {q.shape}")
    k, n = q.shape
    u = (jnp.asarray(q, jnp.int32) & 7).reshape(k // 8, 8, n)                      # (K/8, 8, N)
    word = jnp.sum(u << (3 * jnp.arange(8, dtype=jnp.int32))[None, :, None], axis=1)  # (K/8, N)
    b = jnp.stack([(word >> s) & 0xFF for s in (0, 8, 16)], axis=1)               # (K/8, 3, N)
    return b.reshape(3 * k // 8, n).astype(jnp.uint8)


def unpack_int3(packed: jax.Array, *, signed: bool) -> jax.Array:
    """uint8 [3K/8, N] -> int32 [K, N] (the inverse of pack_int3); signed: codes in [-4, 3]."""
    k3, n = packed.shape
    b = packed.astype(jnp.int32).reshape(k3 // 3, 3, n)
    word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)                              # (K/8, N)
    u = (word[:, None, :] >> (3 * jnp.arange(8, dtype=jnp.int32))[None, :, None]) & 7  # (K/8, 8, N)
    if signed:
        u = (u ^ 4) - 4
    return u.reshape(8 * (k3 // 3), n)


def _dequantize_2d(qw: QuantizedWeight) -> jax.Array:
    """-> f32 [K, N]; int8 and int4 as the kernel defines them, int3 here (no kernel)."""
    if qw.bits != 3:
        return dequantize_weight(qw.q_kn(), qw.scales, qw.zeros, bits=qw.bits, group_size=qw.group_size)
    q = unpack_int3(qw.q, signed=qw.zeros is None)
    k, n = q.shape
    g = qw.group_size
    q = q.reshape(k // g, g, n)                                                    # (K/g, g, N)
    if qw.zeros is not None:
        q = q - qw.zeros.astype(jnp.int32)[:, None, :]
    return (q.astype(jnp.float32) * qw.scales.astype(jnp.float32)[:, None, :]).reshape(k, n)


def dequantize(qw: QuantizedWeight) -> jax.Array:
    """-> f32 array of the logical shape (stacked experts: each dequantized on its own)."""
    if qw.batch:
        return jax.vmap(lambda e: _dequantize_2d(expert_weight(qw, e)))(jnp.arange(qw.shape[0])).reshape(qw.shape)
    return _dequantize_2d(qw).reshape(qw.shape)


# --------------------------------------------------------------------------------------------
# Error bounds (used by the tests; numpy in, numpy out).
# --------------------------------------------------------------------------------------------

def _scale_per_element(qw: QuantizedWeight) -> np.ndarray:
    s = np.asarray(qw.scales, np.float64)
    if qw.bits == 8:
        return np.broadcast_to(s[None, :], (qw.k, qw.n))
    return np.repeat(s, qw.group_size, axis=0)


def elementwise_error_bound(qw: QuantizedWeight, rel_slack: float = 2.0 ** -14) -> np.ndarray:
    """[K, N] bound on |w - dequant(w)|: scale / 2 (round to nearest), plus `rel_slack * scale`
    for the f32 rounding of w / scale and of q * scale (|q| <= 15 or 127, so ~2^-16 * scale)."""
    return _scale_per_element(qw) * (0.5 + rel_slack)


def matmul_error_bound(x, qw: QuantizedWeight) -> np.ndarray:
    """[..., N] bound on |x @ w - x @ dequant(w)|: sum_k |x_k| * scale_k / 2 (no rounding slack)."""
    x2 = np.abs(np.asarray(x, np.float64)).reshape(-1, qw.k)
    b = x2 @ (_scale_per_element(qw) * 0.5)
    return b.reshape(tuple(np.shape(x)[:np.ndim(x) - qw.contract]) + (qw.n,))


# --------------------------------------------------------------------------------------------
# qdot.
# --------------------------------------------------------------------------------------------

def _compute_dtype(dtype):
    dtype = jnp.dtype(dtype)
    return dtype if dtype in (jnp.bfloat16, jnp.float16, jnp.float32) else jnp.dtype(jnp.float32)


def dot_precision(dtype) -> lax.Precision:
    """float32 operands are multiplied in float32 (HIGHEST): XLA's DEFAULT rounds them to TF32
    (10-bit mantissa) on a GPU, so a float32 engine would not compute what it does on CPU or
    what transformers computes. bfloat16 / float16 operands keep DEFAULT (nothing to lose)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _xla_matmul(x2: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """Dequantize per call in XLA (always works): int8 scales the f32 accumulator, int4 dequantizes."""
    cdt = _compute_dtype(x2.dtype)
    xc = x2.astype(cdt)
    if qw.act_bits == 8:
        y = _w8a8_matmul(x2, qw)
    elif qw.bits == 8:   # int8 / fp8 codes, [K, N] or (fp8) [N, K]: contract q's K dim
        y = lax.dot_general(xc, qw.q.astype(cdt), (((1,), (_k_axis(qw),)), ((), ())),
                            preferred_element_type=jnp.float32, precision=dot_precision(cdt))
        y = y * qw.scales.astype(jnp.float32)[None, :]
    else:
        w = _dequantize_2d(qw).astype(cdt)
        y = jnp.dot(xc, w, preferred_element_type=jnp.float32, precision=dot_precision(cdt))
    return y.astype(x2.dtype)


def quantize_rows_int8(x2: jax.Array, act_scale=None, act_zero=None) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (int8 [M, K], f32 scales [M]): symmetric, sx = max|x_m| / 127 per row (dynamic),
    or the calibrated act_scale [] for every row (static; values beyond 127 * act_scale clip), with
    the zero point act_zero [] if given (static asymmetric: codes round(x / sx) + z in [-128, 127])."""
    if act_scale is None:
        if act_zero is not None:
            raise ValueError("an activation zero point needs a static act_scale")
        return symmetric_codes(x2, jnp.int8, axis=1)
    xf = x2.astype(jnp.float32)
    sx = jnp.broadcast_to(jnp.asarray(act_scale, jnp.float32), xf.shape[:1])
    if act_zero is None:
        return jnp.clip(jnp.round(xf / sx[:, None]), -127, 127).astype(jnp.int8), sx
    z = jnp.asarray(act_zero, jnp.float32)
    return jnp.clip(jnp.round(xf / sx[:, None]) + z, -128, 127).astype(jnp.int8), sx


def _k_axis(qw: QuantizedWeight) -> int:
    """The axis of q that runs along K: 1 for layout "nk" ([N, K]), else 0."""
    return 1 if qw.layout == "nk" else 0


def fp8_native_matmul(x2: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """fp8 weights with x quantized per row to e4m3: e4m3 x e4m3 -> f32 dot, rescaled by the row
    and column scales -> x2's dtype [M, N]. With the codes [N, K] (layout "nk") both operands are
    K-major, the layout cuBLASLt's fp8 GEMM takes, so XLA need not transpose the weight."""
    xq, sx = symmetric_codes(x2, FP8_DTYPE, axis=1)                   # per token
    y = lax.dot_general(xq, qw.q, (((1,), (_k_axis(qw),)), ((), ())), preferred_element_type=jnp.float32,
                        precision=lax.Precision.HIGHEST)   # f32 accumulation (no fp8 fast accumulation)
    return (y * sx[:, None] * qw.scales.astype(jnp.float32)[None, :]).astype(x2.dtype)


def _w8a8_matmul(x2: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """int8 x int8 -> int32 dot (exact), rescaled by the row and column scales (f32 [M, N])."""
    xq, sx = quantize_rows_int8(x2, qw.act_scale, qw.act_zero)
    dims = (((1,), (0,)), ((), ()))
    if qw.act_zero is None:
        acc = lax.dot_general(xq, qw.q, dims, preferred_element_type=jnp.int32)
    else:    # the column sums of q from the same dot: one more row of ones
        xa = jnp.concatenate([xq, jnp.ones((1, xq.shape[1]), jnp.int8)], axis=0)
        acc = lax.dot_general(xa, qw.q, dims, preferred_element_type=jnp.int32)
        acc = acc[:-1] - jnp.asarray(qw.act_zero, jnp.int32) * acc[-1:]
    return acc.astype(jnp.float32) * sx[:, None] * qw.scales.astype(jnp.float32)[None, :]


_BLOCK_NK = (256, 128, 64, 32, 16)
XLA_MATMUL = {"kernel": "xla"}     # the launch config "XLA's dequantize-and-dot" (_xla_matmul)


def _valid_bk(bk: int, k: int, bits: int, g: int | None) -> bool:
    if k % bk:
        return False
    if bits == 4:
        return bk >= 32 and (bk % g == 0 or g % bk == 0)
    return True


def _tiled_candidates(m: int, k: int, n: int, bits: int, group_size: int | None) -> list[dict]:
    """quant_matmul's (tiled) launch configs valid on GPU; [0] its default. [] if none fits."""
    if bits not in (8, 4):
        return []
    bns = [b for b in _BLOCK_NK if n % b == 0]
    bks = [b for b in _BLOCK_NK if _valid_bk(b, k, bits, group_size)]
    if not bns or not bks:
        return []
    bm0 = default_block_m(m)
    bn0 = next((b for b in bns if b <= 128), bns[-1])
    bk0 = next((b for b in bks if b <= 128), bks[-1])
    default = dict(block_m=bm0, block_n=bn0, block_k=bk0, num_warps=4, num_stages=3)
    cands = [default]
    bms = [bm0, 128] if m > 64 else [bm0]      # bm0 = 16/32/64 by M (<= 64 for m > 64)

    def add(**kw):
        c = dict(default, **kw)
        if c not in cands:
            cands.append(c)

    for bm in bms:
        for bn in bns[:3]:
            for bk in bks[:3]:
                add(block_m=bm, block_n=bn, block_k=bk)
    add(num_warps=8)
    add(num_stages=4)
    add(num_stages=2)
    return cands[:16]


# The split-K kernel's untuned default (what runs when nothing is measured) -- a prediction from SM
# occupancy, not yet measured on a GPU. A decode matmul (M <= 16) reads K * N weight bytes once and
# does next to no arithmetic: its speed is the HBM bandwidth the programs in flight can draw. The
# tiled kernel launches N / block_n programs (32 for N = 4096 at block_n = 128), a quarter of an
# H200's 132 SMs, and the H200 run measured it at 0.43-0.57x of the bf16 dot (int8, M = 1). Split-K
# multiplies the programs by num_splits: the default takes the smallest power of two with
# N / block_n * num_splits >= 2 * 132 (two programs per SM, so one's loads overlap the other's
# arithmetic), keeping >= 4 block_k steps per program (num_stages = 3 needs a few to pipeline) and
# num_splits * Mp <= 64 (each split writes, and the wrapper reads back, an f32 [Mp, N] partial: 64
# rows are 512 bytes per column against K / 2 = 2 KiB of int4 codes at K = 4096; most of it stays
# in the 50 MB L2). block_n = 64: an int8 [128, 64] step is 8 KiB per program, 3 stages in flight
# 24 KiB, two programs ~48 KiB per SM, about what Little's law asks of ~4.8 TB/s at ~1 us latency
# over 132 SMs (~36 KiB per SM). inner = "dot" (M padded to 16): the same Triton operations as the
# tiled kernel, which compiled and ran on the H200, so an untuned engine cannot fail on a lowering
# the tiled kernel never used; the multiply-reduce ("reduce", no padding; block_k = 128 / Mp keeps
# 64 f32 products per thread) is the next candidate for M <= 8 and the tuner keeps it where it wins.
# With Mp = 16 the cap is num_splits <= 4. For the 8B projections at M = 1..16 that gives
# qkv 96 x 4 = 384 programs, o 64 x 4 = 256, gate_up 448 x 1 = 448, down 64 x 4 = 256 (K/S = 3584),
# against 48, 32, 224 and 32 programs of the tiled default. The same H200 run is the evidence that
# programs are the lever: the tiled int8 kernel drew 1718 GB/s (51% of the 3360 GB/s copy) on
# gate_up's 224 programs and 421-607 GB/s on 32-48. Predicted (untested): int8 at M = 1 reaches
# ~1.7-2 TB/s on every projection, about the 1.6-1.95 TB/s that 1.65x the bf16 dot needs; int4
# (unpacking and two dots per K block) ~1-1.3 TB/s (gate_up's 224 tiled programs drew 947 GB/s):
# ~1.6-2.1x bf16, short of 2.6x, which needs ~1.6 TB/s of packed codes.
SPLITK_TARGET_PROGRAMS = 2 * 132
SPLITK_DEFAULT_MAX_M = 16        # the default is split-K up to here, the tiled kernel above


def _splitk_config(m: int, k: int, n: int, bits: int, g: int | None, bn: int, bk: int, inner: str,
                   splits: int | None = None) -> dict | None:
    """A valid split-K config (num_splits by the occupancy rule above unless given), or None."""
    ks_ok = lambda s: k % s == 0 and (k // s) % bk == 0 and (bits != 4 or (k // s) % g == 0)  # noqa: E731
    if n % bn or not _valid_bk(bk, k, bits, g) or (splits is not None and not ks_ok(splits)):
        return None
    if splits is None:
        mp = splitk_rows(m, inner)
        ok = [s for s in (1, 2, 4, 8, 16, 32, 64)
              if ks_ok(s) and (s == 1 or ((k // s) // bk >= 4 and s * mp <= 64))]
        if not ok:
            return None
        splits = next((s for s in ok if n // bn * s >= SPLITK_TARGET_PROGRAMS), ok[-1])
    return dict(kernel="splitk", num_splits=splits, block_n=bn, block_k=bk, inner=inner, num_warps=4,
                num_stages=3)


def splitk_candidates(m: int, k: int, n: int, bits: int, group_size: int | None) -> list[dict]:
    """quant_matmul_splitk launch configs valid on GPU for M <= 64 ([] above); [0] its default."""
    if bits not in (8, 4) or m > SPLITK_MAX_M:
        return []
    inners = [i for i in SPLITK_INNER if i == "dot" or m <= REDUCE_MAX_M]      # "dot" first: the default
    cands: list[dict] = []

    def add(c):
        if c is not None and c not in cands:
            cands.append(c)

    def bk_for(inner):   # reduce: Mp * block_k = 128 products per column and step (>= 32 for int4)
        return max(128 // splitk_rows(m, inner), 32 if bits == 4 else 16) if inner == "reduce" else 128
    for inner in inners:
        for bn in (64, 128, 32):
            add(_splitk_config(m, k, n, bits, group_size, bn, bk_for(inner), inner))
    if not cands:
        return []
    d = cands[0]
    for s in (d["num_splits"] * 2, d["num_splits"] // 2):
        if s >= 1:
            add(_splitk_config(m, k, n, bits, group_size, d["block_n"], d["block_k"], d["inner"], s))
    for bk in (2 * d["block_k"], d["block_k"] // 2):
        add(_splitk_config(m, k, n, bits, group_size, d["block_n"], bk, d["inner"], d["num_splits"]))
    for kw in (dict(num_warps=8), dict(num_warps=2), dict(num_stages=4), dict(num_stages=2)):
        add(dict(d, **kw))
    return cands


def pallas_block_candidates(m: int, k: int, n: int, bits: int, group_size: int | None, *,
                            weight_only: bool = True) -> list[dict]:
    """Launch configs valid on GPU for this problem, at most 16; [0] is the default. [] if no kernel
    can run it (no int3 format: qdot then takes the XLA path, or refuses impl="pallas").

    A config is quant_matmul's keywords (the tiled kernel; what `blocks=` has always taken), or
    {"kernel": "splitk", ...} (quant_matmul_splitk's keywords), or XLA_MATMUL (XLA's dequantize-and-
    dot, so that the tuner keeps it where it is fastest). M <= 16: the split-K configs first (the
    default: the occupancy rule above), then XLA, then the tiled default and one more; larger M:
    the tiled configs first, then up to 3 split-K ones (M <= 64), then XLA. weight_only=False (W8A8):
    the tiled w8a8_matmul configs only.
    """
    tiled = _tiled_candidates(m, k, n, bits, group_size)
    if not weight_only or not tiled:
        return tiled
    split = splitk_candidates(m, k, n, bits, group_size)
    if m <= SPLITK_DEFAULT_MAX_M and split:
        cands = split[:13] + [dict(XLA_MATMUL)] + tiled[:2]
    else:
        cands = tiled[:12] + split[:3] + [dict(XLA_MATMUL)]
    return cands[:16]


def matmul_class(m: int) -> int:
    """The autotuner's M bucket: M <= 16 by power of two (1, 2, 4, 8, 16: the split-K tile heights
    and inner-product choices change there), larger M by power of two up to 512."""
    return min(_next_pow2(m), 512)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _launch(x2: jax.Array, q, scales, zeros, qw: QuantizedWeight, cfg: dict, interpret: bool | None = None):
    """x2 [M, K] @ (q, scales, zeros) in qw's format with the launch config cfg (tiled, split-K or
    XLA; pallas_block_candidates) -> [M, N] in x2's dtype."""
    kind = cfg.get("kernel", "tiled")
    params = {key: v for key, v in cfg.items() if key != "kernel"}
    if kind == "xla":
        return _xla_matmul(x2, dataclasses.replace(qw, q=q, scales=scales, zeros=zeros))
    if qw.act_bits is not None:
        xq, sx = quantize_rows_int8(x2, qw.act_scale, qw.act_zero)
        return w8a8_matmul(xq, q, sx, scales, qw.act_zero, out_dtype=x2.dtype, interpret=interpret, **params)
    if kind == "splitk":
        return quant_matmul_splitk(x2, q, scales, zeros, bits=qw.bits, group_size=qw.group_size,
                                   interpret=interpret, **params)
    if kind != "tiled":
        raise ValueError(f"unknown quantized matmul kernel {kind!r} in launch config {cfg}")
    return quant_matmul(x2, q, scales, zeros, bits=qw.bits, group_size=qw.group_size, interpret=interpret,
                        **params)


def select_blocks(m: int, k: int, n: int, qw: QuantizedWeight, dtype, *, cache_path: str | None = None,
                  force: bool = False, max_candidates: int | None = None) -> dict | None:
    """Launch config for quant_matmul: autotuned (cached on disk) on GPU, the default elsewhere.

    None if no config is valid. Measuring runs the kernel on synthetic inputs of the same
    shapes/dtypes (eagerly, also when called while tracing), within the autotuner's per-process
    budget ($JAXINFER_AUTOTUNE_BUDGET_S); JAXINFER_AUTOTUNE=0 disables measuring.
    Keys: M by matmul_class (weight-only: 1, 2, 4, 8, 16, then powers of two up to 512, where the
    split-K tiles and inner products change; W8A8, tiled only: M <= 64 by default_block_m), K and N
    by power of two, the weight format and the activation dtype. The candidates
    (pallas_block_candidates) are tiled, split-K and XLA configs; qdot runs whichever wins.
    """
    cands = pallas_block_candidates(m, k, n, qw.bits, qw.group_size, weight_only=qw.act_bits is None)
    if max_candidates is not None:
        cands = cands[:max_candidates]
    if not cands:
        return None
    if os.environ.get("JAXINFER_AUTOTUNE", "1") == "0" and not force:
        return cands[0]
    m_class = matmul_class(m) if qw.act_bits is None else min(default_block_m(m) if m <= 64 else m, 512)
    kname = f"quant_matmul_int{qw.bits}" + (
        "" if qw.bits == 8 else f"_g{qw.group_size}_{'sym' if qw.symmetric else 'asym'}")
    if qw.act_bits is not None:
        kname = "w8a8_matmul" + ("" if qw.act_zero is None else "_asym")
    key = f"{_autotune.shape_class(m_class, k, n)}_{jnp.dtype(dtype).name}"
    compiled: dict[str, Any] = {}
    operands: list = []

    def synthetic_operands() -> tuple:
        # Made only when something is measured (a key the cache or this process already settled,
        # the usual case for all but the first layer and step shape, allocates nothing), and
        # concretely even while tracing (ensure_compile_time_eval).
        if not operands:
            with jax.ensure_compile_time_eval():
                if qw.act_bits is not None:   # W8A8: int8 rows, their scales, the weights' scales, the zero point
                    operands.extend((jnp.ones((m, k), jnp.int8), jnp.zeros(qw.q.shape, qw.q.dtype),
                                     jnp.ones((m,), jnp.float32), jnp.ones(qw.scales.shape, jnp.float32),
                                     None if qw.act_zero is None else jnp.int32(0)))
                else:
                    operands.extend((jnp.ones((m, k), dtype), jnp.zeros(qw.q.shape, qw.q.dtype),
                                     jnp.ones(qw.scales.shape, jnp.float32),
                                     None if qw.zeros is None else jnp.zeros(qw.zeros.shape, qw.zeros.dtype)))
        return tuple(operands)

    def run(cfg):
        # each candidate is compiled ahead of time (lower().compile() traces in its own context, so
        # it is not staged into an enclosing jit), then the executable runs eagerly
        args = synthetic_operands()
        key_ = repr(sorted(cfg.items()))
        if key_ not in compiled:
            if qw.act_bits is not None:
                fn = jax.jit(lambda x, w, sx, sw, z: w8a8_matmul(x, w, sx, sw, z, out_dtype=dtype, **cfg))
            else:
                fn = jax.jit(lambda x, w, s, z: _launch(x, w, s, z, qw, cfg))
            compiled[key_] = fn.lower(*args).compile()
        return compiled[key_](*args)

    try:
        return _autotune.autotune(kname, key, cands, run, cache_path=cache_path, force=force)
    except Exception as e:  # noqa: BLE001 -- tuning must never break inference
        log.warning("autotune for %s %s failed (%s); using defaults", kname, key, e)
        return cands[0]


def _resolve_impl(impl: str) -> str:
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl must be 'auto', 'pallas' or 'xla', got {impl!r}")
    return resolve_impl_name(impl, jax.default_backend())


def qdot(x: jax.Array, w, contract: int = 1, impl: str = "auto", *, blocks: dict | None = None,
         interpret: bool | None = None) -> jax.Array:
    """x [..., K-dims] @ w [K-dims, N-dims] -> [..., N-dims] (`contract` = number of K dims).

    w: a float array (plain lax.dot_general, like layers.dense) or a QuantizedWeight
    (its `contract` must match). impl: "pallas" (quant_matmul kernel; W8A8 weights: x quantized
    per row in XLA, then the w8a8_matmul kernel; fp8 weights: x quantized per row to e4m3, then
    XLA's fp8 dot), "xla" (dequantize per call),
    "auto" (pallas on GPU when the shapes fit the kernel, else xla; fp8 weights take the native
    fp8 dot on GPU whatever their shapes). Leading dims of x are
    flattened to M; the output has x's dtype. blocks: an explicit launch config, one of
    pallas_block_candidates' kinds: quant_matmul's keywords (tiled), {"kernel": "splitk", ...}
    or XLA_MATMUL (default: select_blocks).
    """
    if not isinstance(w, QuantizedWeight):
        x_axes = tuple(range(x.ndim - contract, x.ndim))
        return lax.dot_general(x, w, ((x_axes, tuple(range(contract))), ((), ())), precision=dot_precision(x.dtype))
    if w.batch:
        raise ValueError("stacked expert weights (batch=1) multiply expert by expert: jaxinfer.moe, or expert_weight")
    if contract != w.contract:
        raise ValueError(f"qdot contract={contract} but the weight was quantized with contract={w.contract}")
    kdims, ndims = w.shape[:contract], w.shape[contract:]
    if tuple(x.shape[x.ndim - contract:]) != tuple(kdims) or x.ndim < contract:
        raise ValueError(f"x {x.shape} does not end with the contracted dims {kdims} of weight {w.shape}")
    lead = tuple(x.shape[:x.ndim - contract])
    m = math.prod(lead)
    x2 = x.reshape(m, w.k)
    mode = w.impl if impl == "auto" else impl
    if mode not in ("pallas", "xla"):   # decided per call only for a weight no engine set (ResolvedConfig.matmul)
        mode = _resolve_impl(mode)
    if w.fp8:   # the GPU path: XLA's native fp8 dot (no Pallas kernel); else dequantized
        y2 = fp8_native_matmul(x2, w) if mode == "pallas" and m > 0 else _xla_matmul(x2, w)
        return y2.reshape(lead + tuple(ndims))
    cfg = None
    if mode == "pallas" and m > 0:
        cfg = blocks if blocks is not None else select_blocks(m, w.k, w.n, w, x.dtype)
        if cfg is None:
            if impl == "pallas" and w.bits == 3:
                raise ValueError("the Pallas quant_matmul kernel has no int3 format; use impl='xla'")
            if impl == "pallas":
                raise ValueError(f"quant_matmul cannot tile K={w.k}, N={w.n} "
                                 f"(bits={w.bits}, group_size={w.group_size}); use impl='xla'")
            mode = "xla"
    if mode == "pallas" and m > 0:
        y2 = _launch(x2, w.q, w.scales, w.zeros, w, cfg, interpret)
    else:
        y2 = _xla_matmul(x2, w)
    return y2.reshape(lead + tuple(ndims))
