"""The quantized weight format: the QuantizedWeight pytree, the load-time quantizers and dequantize.

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
* grouped int8 (pre-quantized checkpoints only: GPTQ and compressed-tensors W8A16 with groups, or
  GPTQ's asymmetric 8-bit): q int8 [K, N], scales f32 [K/g, N], group_size g (K: per channel with
  zero points), zeros None or int8 [K/g, N] (w = (q - zero) * scale). On a GPU the Pallas kernels'
  grouped 8-bit format or XLA's dequantize-and-dot, whichever the tuner measures faster (qdot).
* grouped fp8 (fine-grained FP8 checkpoints, quant_method "fp8", DeepSeek-V3 / Qwen3-FP8): e4m3 codes
  [K, N] (layout "kn") with scales f32 [K/g, N]: each [bk, bn] block's scale repeated over its bn
  columns (the checkpoint's [N/bn, K/bk] table, 1/bn of a float per weight); the kernels' grouped
  8-bit format (e4m3 codes) or XLA, as grouped int8.
* mxfp4 (gpt-oss experts as published, OCP MX): e2m1 codes packed two per byte along K exactly as
  int4 (low nibble = even k), scales uint8 [K/32, N] e8m0 exponents (group_size 32): w = e2m1(code)
  * 2^(scale - 127); told from int4 by the scales' dtype; dequantized in XLA (no kernel), expert by
  expert on the MoE path. Stored 4.25 bits a weight.
* float zero points (GGUF's Q4_K and Q2_K as int4, groups of 32 and 16, Q5_K as grouped int8: w =
  scale * q - offset, stored as zeros = offset / scale, float32 [K/g, N], unsigned codes;
  QuantizedWeight.float_zeros): through the Pallas kernels (q - zero in float32), int4's and
  grouped int8's.
* row order (perm, pre-quantized GPTQ with desc_act only): the rows of q, scales and zeros are stored
  in the order perm (int32 [K]), chosen at load so that each group's rows are contiguous; the
  product is x[:, perm] @ dequant(q) (a gather of x's K columns per call, qdot), the logical weight
  w[perm[i]] = dequant(q)[i].
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
  made XLA transpose the whole weight on every call (fp8 decode no faster than bf16, and a larger
  allocator peak for fp8 only). Stacked experts (quantize_experts)
  keep [E, K, N] (layout "kn"): jaxinfer.moe multiplies their codes as [K, N] matrices. On the
  XLA path (the CPU default) it is dequantized per call: y = (x @ e4m3(q) as f32) * scales. On the
  GPU path (qdot impl "pallas", the GPU default; per-channel e4m3 codes have no Pallas kernel) it runs as
  vLLM's fp8 checkpoints do on Hopper: each row of x is scaled to e4m3 too (sx = max|x_m| / 448,
  dynamic per token) and the fp8 x fp8 dot accumulates in f32 (precision HIGHEST: XLA lowers it to
  cuBLASLt's fp8 GEMM on sm_89+ without the GEMM's reduced-precision "fast accumulation", which it
  allows at DEFAULT; elsewhere it converts and runs the same arithmetic; not yet run on a GPU), then
  y * sx[m] * scales[n] (fp8_native_matmul). Error: |w - dequant(w)| <=
  2^-4 |w| for |w| / scale >= 2^-6 (normal e4m3 numbers), <= 2^-10 scale below (subnormals).
* W8A8 (act_bits=8, SmoothQuant): int8 weights as above, and at run time each row (token) of x is
  quantized symmetrically to int8 with the scale sx = max|x_t| / 127 of its own (dynamic), or with
  one scale per weight calibrated offline (static, act_scale f32 []; codes clipped to [-128, 127]
  as compressed-tensors and vLLM clip them); y = (xq @ q as int32) * sx * scales[n]. Static
  activations may be asymmetric (act_zero int32 [] in [-128, 127]): xq = clip(round(x / sx) + z,
  -128, 127) and y = (xq @ q - z * colsum(q)) * sx * scales[n], the
  column sums coming out of the same int32 dot (a row of ones appended to xq), so q is read once.
  XLA's int8 dot, or the Pallas w8a8_matmul kernel (qdot's launch configs).
All rounding is round-to-nearest (ties to even); an all-zero column/group gets scale 1.0 (q = 0).
Error bound (symmetric and asymmetric): |w - dequant(w)| <= scale / 2 elementwise (plus f32 rounding),
hence |x @ w - x @ dequant(w)| <= sum_k |x_k| * scale_k / 2 per output (see the *_bound helpers).

How these weights are multiplied (qdot, the kernels or XLA) is dispatch.py's business; the weight
carries no choice of implementation.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant_matmul import dequantize_weight, pack_int4, unpack_int4

__all__ = [
    "QuantizedWeight", "FP8_DTYPE", "FP8_MAX", "symmetric_codes", "quantize", "quantize_int8", "quantize_int4",
    "quantize_fp8", "quantize_experts", "expert_weight", "dequantize", "pack_int4", "unpack_int4",
    "pack_int3", "unpack_int3", "grid_params", "grid_codes", "grid_dequant", "from_codes",
    "elementwise_error_bound", "matmul_error_bound",
]


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
    act_bits: int | None = None     # 8: W8A8 (SmoothQuant), activations quantized to int8 at run time
    act_scale: Any = None   # W8A8 static: f32 [] activation scale (x -> round(x / act_scale)); None: per token
    act_zero: Any = None    # W8A8 static asymmetric: int32 [] zero point (x -> round(x / act_scale) + act_zero)
    batch: int = 0          # 1: stacked experts, shape[0] of them, each its own [K, N] (quantize_experts)
    layout: str = "kn"      # "nk": q stored [N, K] (fp8 codes, module docstring); "kn": every other format
    perm: Any = None        # int32 [K] or None: rows stored in this order, x @ w = x[:, perm] @ q (module docstring)

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

    @property
    def mxfp4(self) -> bool:
        """OCP MXFP4 (gpt-oss experts): e2m1 codes packed like int4, e8m0 scale bytes per 32 k."""
        return self.bits == 4 and jnp.dtype(self.scales.dtype) == jnp.uint8

    @property
    def float_zeros(self) -> bool:
        """Zero points that are floats (GGUF's Q4_K / Q5_K / Q2_K: w = scale * q - offset, zero = offset /
        scale): subtracted in float32 (the Pallas kernels, and XLA's dequantization)."""
        return self.zeros is not None and jnp.issubdtype(jnp.dtype(self.zeros.dtype), jnp.floating)

    @property
    def grouped8(self) -> bool:
        """int8 or e4m3 codes with one scale (and, int8, zero point, if any) per group of group_size
        k (scales [K/g, N]; pre-quantized checkpoints, jaxinfer.prequant): the kernels' grouped
        8-bit format on a GPU (pallas_kernels.quant_matmul), else dequantized in XLA."""
        return self.bits == 8 and self.group_size is not None and self.batch == 0

    def q_kn(self) -> jax.Array:
        """The codes as [K, N] (a transpose for layout "nk"; the stored array otherwise)."""
        return self.q.T if self.layout == "nk" else self.q

    @property
    def nbytes(self) -> int:
        return sum(int(a.size) * a.dtype.itemsize
                   for a in (self.q, self.scales, self.zeros, self.act_scale, self.act_zero, self.perm)
                   if a is not None)


jax.tree_util.register_dataclass(
    QuantizedWeight,
    data_fields=["q", "scales", "zeros", "act_scale", "act_zero", "perm"],
    meta_fields=["bits", "group_size", "shape", "contract", "act_bits", "batch", "layout"],
)


def _as_2d(w, contract: int) -> tuple[jax.Array, tuple[int, ...], int, int]:
    shape = tuple(int(d) for d in w.shape)
    if not 1 <= contract <= len(shape):
        raise ValueError(f"contract={contract} must be in [1, {len(shape)}] for shape {shape}")
    k, n = math.prod(shape[:contract]), math.prod(shape[contract:])
    return jnp.asarray(w, jnp.float32).reshape(k, n), shape, k, n


# the 16 e2m1 (FP4) values by code: sign bit 3, then exponent and mantissa (OCP MX spec; the table
# transformers' integrations/mxfp4.py FP4_VALUES holds)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0


@functools.partial(jax.jit, static_argnames=("dtype", "axis"))
def symmetric_codes(x: jax.Array, dtype, axis: int) -> tuple[jax.Array, jax.Array]:
    """Symmetric scaled codes of x, one scale per slice along `axis`: scale = max|x| / qmax over it
    (qmax 127 for int8, 448 for e4m3; 1 where the slice is all zero; the smallest normal f32 where
    max|x| / qmax underflows) and codes of x / scale clipped at +-qmax: int8 rounds to nearest,
    e4m3 casts (round to nearest even; e4m3fn has no infinity). -> (codes, f32 scales [x's shape
    without `axis`]). Weights per output channel (axis 0 of [K, N]), activations per token (axis 1
    of [M, K]) and KV pages per token and head (the last axis) all use it. One program per shape
    (jitted: a weight quantized at load is one dispatch, not seven, and compiles once per shape)."""
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


@functools.partial(jax.jit, static_argnames=("g", "symmetric"))
def _int4_codes(w2: jax.Array, g: int, symmetric: bool) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """quantize_int4's arithmetic on w2 [K, N] float32, one program per shape -> (packed, scale, zeros)."""
    k, n = w2.shape
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
    return packed, scale, zeros


def quantize_int4(w, group_size: int = 128, symmetric: bool = True, *, contract: int = 1) -> QuantizedWeight:
    """Group-wise (along K) int4, packed two per byte along K (low nibble = even k)."""
    w2, shape, k, n = _as_2d(w, contract)
    g = int(group_size)
    if g <= 0 or g % 2:
        raise ValueError(f"group_size must be a positive even number, got {group_size}")
    if k % g:
        raise ValueError(f"K={k} (shape {shape}, contract={contract}) is not a multiple of group_size={g}")
    packed, scale, zeros = _int4_codes(w2, g, bool(symmetric))
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
    """-> f32 [K, N]; int8, grouped 8-bit and int4 as the kernel defines them, int3 and mxfp4 here."""
    if qw.mxfp4:
        k, n = qw.k, qw.n
        g = qw.group_size
        u = unpack_int4(qw.q, signed=False)                                       # [K, N] e2m1 codes
        v = jnp.asarray(E2M1_VALUES, jnp.float32)[u].reshape(k // g, g, n)
        scale = jnp.exp2(qw.scales.astype(jnp.float32) - 127.0)                    # e8m0: 2^(byte - 127)
        return (v * scale[:, None, :]).reshape(k, n)
    if qw.bits != 3:   # grouped 8-bit and float zero points too (the kernel's definition: float32)
        return dequantize_weight(qw.q_kn(), qw.scales, qw.zeros, bits=qw.bits, group_size=qw.group_size)
    q = unpack_int3(qw.q, signed=qw.zeros is None)
    k, n = q.shape
    g = qw.group_size
    q = q.reshape(k // g, g, n)                                                    # (K/g, g, N)
    if qw.zeros is not None:
        q = q - qw.zeros.astype(jnp.int32)[:, None, :]
    return (q.astype(jnp.float32) * qw.scales.astype(jnp.float32)[:, None, :]).reshape(k, n)


def dequantize(qw: QuantizedWeight) -> jax.Array:
    """-> f32 array of the logical shape (stacked experts: each dequantized on its own; rows stored
    in `perm` order put back in place)."""
    if qw.batch:
        return jax.vmap(lambda e: _dequantize_2d(expert_weight(qw, e)))(jnp.arange(qw.shape[0])).reshape(qw.shape)
    w = _dequantize_2d(qw)
    if qw.perm is not None:
        w = jnp.zeros_like(w).at[qw.perm].set(w)
    return w.reshape(qw.shape)


# --------------------------------------------------------------------------------------------
# Error bounds (used by the tests; numpy in, numpy out).
# --------------------------------------------------------------------------------------------

def _scale_per_element(qw: QuantizedWeight) -> np.ndarray:
    """[K, N] each logical weight's scale (rows stored in `perm` order put back in place). The
    bounds below are round-to-nearest integer grids': fp8's error is relative to the value, not
    half a step, so fp8 weights are refused."""
    if qw.fp8 or qw.batch or np.asarray(qw.scales).dtype == np.uint8:
        raise ValueError("the error bounds cover unstacked integer formats (fp8's error is 2^-4 |w|, "
                         "MXFP4's scales are exponents)")
    s = np.asarray(qw.scales, np.float64)
    per = np.broadcast_to(s[None, :], (qw.k, qw.n)) if qw.group_size is None else np.repeat(s, qw.group_size, axis=0)
    if qw.perm is None:
        return per
    out = np.empty_like(per)
    out[np.asarray(qw.perm)] = per          # stored row i is logical row perm[i]
    return out


def elementwise_error_bound(qw: QuantizedWeight, rel_slack: float = 2.0 ** -14) -> np.ndarray:
    """[K, N] bound on |w - dequant(w)|: scale / 2 (round to nearest), plus `rel_slack * scale`
    for the f32 rounding of w / scale and of q * scale (|q| <= 15 or 127, so ~2^-16 * scale)."""
    return _scale_per_element(qw) * (0.5 + rel_slack)


def matmul_error_bound(x, qw: QuantizedWeight) -> np.ndarray:
    """[..., N] bound on |x @ w - x @ dequant(w)|: sum_k |x_k| * scale_k / 2 (no rounding slack)."""
    x2 = np.abs(np.asarray(x, np.float64)).reshape(-1, qw.k)
    b = x2 @ (_scale_per_element(qw) * 0.5)
    return b.reshape(tuple(np.shape(x)[:np.ndim(x) - qw.contract]) + (qw.n,))
