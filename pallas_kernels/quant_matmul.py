"""Weight-only quantized matmul (int8 per-channel, 8-bit and int4 group-wise) as a Pallas (Triton-style) kernel.

    y[M, N] = x[M, K] @ dequant(w)[K, N]      (f32 accumulation, output in x's dtype)

Weight formats (the kernel reads the weights at 1 or 0.5 bytes per element and dequantizes them
inside the tile; nothing is dequantized in HBM):

* ``bits=8`` -- per output channel, symmetric: ``w`` int8 ``[K, N]`` in [-127, 127], ``scales`` f32
  ``[N]``; ``dequant(w) = w * scales[None, :]``. The per-channel scale is constant along K, so the
  kernel converts the int8 tile exactly to the activation dtype, accumulates ``x @ q`` in f32, and
  multiplies the accumulator by the scale once (mathematically identical, fewer multiplies).
* ``bits=8`` with ``group_size=g`` -- grouped 8-bit, the pre-quantized checkpoints' formats
  (GPTQ 8-bit, llama.cpp's Q8_0 / Q6_K / Q5_K / Q5_0 / IQ4 as loaded, fine-grained fp8): ``w`` int8 or
  float8_e4m3fn ``[K, N]``, ``scales`` f32 ``[K // g, N]`` (K % g == 0, g even);
  ``dequant = (q - zero[k // g]) * scale[k // g]`` with ``zeros`` None (no zero point), integers
  ``[K // g, N]`` (subtracted in int32: exact) or float32 (llama.cpp's offsets, subtracted in f32).
  e4m3 codes take no zero points. Codes and zero points convert exactly to f32; the tile is
  dequantized in f32 and rounded once to the activation dtype for the dot, as XLA's path does.
* ``bits=4`` -- group-wise along K with group size ``g`` (32, 64 or 128; K % g == 0):
  ``scales`` f32 ``[K // g, N]``.

  Packing: two 4-bit values per byte along K, ``w`` uint8 ``[K // 2, N]``:
  ``w[r, n] = nib(q[2r, n]) | (nib(q[2r + 1, n]) << 4)`` -- the LOW nibble holds the EVEN k,
  the HIGH nibble the ODD k.

  - symmetric (``zeros=None``): ``q`` is signed int4 in [-8, 7], stored as its 4-bit two's
    complement (``nib(q) = q & 0xF``); ``dequant = q * scale[k // g]``.
  - asymmetric (``zeros`` ``[K // g, N]``, any int dtype, values in [0, 15]; uint8 recommended):
    ``q`` unsigned in [0, 15]; ``dequant = (q - zero[k // g]) * scale[k // g]``.
  - asymmetric with float zero points (``zeros`` float32 ``[K // g, N]``: llama.cpp's Q4_K / Q2_K,
    ``w = scale * q - offset`` held as ``zero = offset / scale``): the same, ``q - zero`` in f32.

Tiling: grid over (M / block_m, N / block_n); each program loops over K in blocks of ``block_k``
(fori_loop) with an f32 ``[block_m, block_n]`` accumulator. M is zero-padded up to a multiple of
block_m (activations only; the padding rows are sliced off). N % block_n == 0 and K % block_k == 0
are required (block sizes are clamped to N and K first). For int4, block_k must be a multiple of
group_size or divide it (grouped 8-bit too). On GPU (Triton) all block sizes must be powers of two >= 16
(block_k >= 32 for int4, because each nibble half is a dot with K = block_k / 2).

For int4 the activations are viewed (free reshape) as ``[M, K/2, 2]`` and passed twice, once for
the even and once for the odd columns, so that the kernel never has to interleave the two nibble
halves: ``y = x_even @ dequant(lo) + x_odd @ dequant(hi)``.

Split-K decode kernel (``quant_matmul_splitk``, every format above, small M): the
tiled grid has only N / block_n programs when M fits one block_m (e.g. 32 for N = 4096 at
block_n = 128 -- a quarter of an H200's 132 SMs streams all the weights), so this one also splits K:
grid (N / block_n, num_splits), program (j, s) reduces K / num_splits rows of the weight in block_k
steps and writes an f32 partial ``[Mp, block_n]`` of ``partials [num_splits, Mp, N]``; the wrapper
sums the partials in XLA (and multiplies int8's per-channel scale there; group scales are
applied in the kernel as above, each split holding whole groups). Every M row lives in one tile. Two inner products (static flag):

* ``inner="dot"``: the tensor-core dot, M zero-padded to Mp = max(16, next power of two) rows;
  int4 as two dots (even and odd k) per K block, like the tiled kernel.
* ``inner="reduce"``: ``(x[:, :, None] * w[None]).sum(1)`` in f32 on the CUDA cores, M padded only
  to the next power of two (Triton's tile shapes), for M <= 8: no 16-row padding; int4 adds both
  nibble halves' products before one reduction.

The weights are dequantized in registers either way, never in HBM.

W8A8 (``w8a8_matmul``): int8 activations times int8 weights, the SmoothQuant format. The caller
quantizes x (per token, or with one calibrated scale and zero point) into ``xq`` int8 ``[M, K]``
with row scales ``x_scale`` f32 ``[M]``; the weights are int8 ``[K, N]`` with ``w_scale`` f32 ``[N]``:

    y[m, n] = (sum_k (xq[m, k] - azp) * w[k, n]) * x_scale[m] * w_scale[n]

The products accumulate in int32 on the integer tensor cores (Triton's dot of two int8 tiles), so
the sum is exact; an asymmetric activation grid (zero point ``azp``) subtracts azp times the
weights' column sums, which the kernel adds up from the weight tiles it has already loaded (no
second pass over the weights). Then one f32 rescale per output, in that order.

This module imports jax only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = [
    "quant_matmul",
    "quant_matmul_reference",
    "quant_matmul_splitk",
    "SPLITK_INNER",
    "SPLITK_MAX_M",
    "REDUCE_MAX_M",
    "splitk_rows",
    "w8a8_matmul",
    "w8a8_matmul_reference",
    "dequantize_weight",
    "grouped8_name",
    "pack_int4",
    "unpack_int4",
    "default_block_m",
]


# --------------------------------------------------------------------------------------------
# Packing helpers (pure jnp, shared with the load-time quantizer).
# --------------------------------------------------------------------------------------------

@jax.jit
def pack_int4(q: jax.Array) -> jax.Array:
    """q [K, N] ints in [-8, 7] (two's complement nibble) or [0, 15] -> uint8 [K // 2, N].

    Low nibble = even k (row 2r), high nibble = odd k (row 2r + 1).
    """
    if q.ndim != 2 or q.shape[0] % 2:
        raise ValueError(f"pack_int4 expects [K, N] with even K, got {q.shape}")
    u = q.astype(jnp.int32) & 0xF
    return (u[0::2] | (u[1::2] << 4)).astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("signed",))
def unpack_int4(packed: jax.Array, *, signed: bool) -> jax.Array:
    """uint8 [K // 2, N] -> int32 [K, N]; signed: nibbles are two's complement in [-8, 7]."""
    p = packed.astype(jnp.int32)
    lo, hi = p & 0xF, (p >> 4) & 0xF
    if signed:
        lo, hi = (lo ^ 8) - 8, (hi ^ 8) - 8
    k2, n = packed.shape
    return jnp.stack([lo, hi], axis=1).reshape(2 * k2, n)


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def dequantize_weight(w, scales, zeros=None, *, bits: int, group_size: int | None = None) -> jax.Array:
    """Kernel-format weight -> f32 [K, N] (the definition the kernel implements)."""
    if bits == 8 and group_size is None:
        return w.astype(jnp.float32) * scales.astype(jnp.float32)[None, :]
    if bits == 8:
        k, n = w.shape
        return _grouped_dequant(w.reshape(k // group_size, group_size, n), scales[:, None, :],
                                None if zeros is None else zeros[:, None, :]).reshape(k, n)
    if bits == 4:
        q = unpack_int4(w, signed=zeros is None)
        k, n = q.shape
        g = group_size
        return _grouped_dequant(q.reshape(k // g, g, n), scales[:, None, :],
                                None if zeros is None else zeros[:, None, :]).reshape(k, n)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def _grouped_dequant(q, scale, zero):
    """Codes q (ints or e4m3) -> f32 (q - zero) * scale, broadcasting scale / zero (None: no zero
    point; integer zeros subtracted in int32, float ones in f32). The kernels' and the references'
    one definition."""
    return _minus_zero(q if zero is None or _zero_dtype(zero) == jnp.float32 else q.astype(jnp.int32),
                       None if zero is None else zero.astype(_zero_dtype(zero))) * scale.astype(jnp.float32)


def quant_matmul_reference(x, w, scales, zeros=None, *, bits: int, group_size: int | None = None):
    """Pure-jnp reference: dequantize to f32, then x @ w in f32 (HIGHEST precision); x's dtype out."""
    wf = dequantize_weight(w, scales, zeros, bits=bits, group_size=group_size)
    y = jnp.dot(x.astype(jnp.float32), wf, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


# --------------------------------------------------------------------------------------------
# Kernels.
# --------------------------------------------------------------------------------------------

def _int8_kernel(x_ref, w_ref, s_ref, o_ref, *, block_k, num_k, compute_dtype, precision):
    bm, bn = o_ref.shape

    def body(kb, acc):
        ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        x = x_ref[:, ks].astype(compute_dtype)
        w = w_ref[ks, :].astype(compute_dtype)  # int8 is exact in bf16/f16/f32
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision)

    acc = lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), jnp.float32))
    scale = s_ref[...].astype(jnp.float32)
    o_ref[...] = (acc * scale[None, :]).astype(o_ref.dtype)


def _zero_dtype(z_ref):
    """Integer zero points are subtracted from the codes in int32, float ones (GGUF's) in float32."""
    return jnp.float32 if jnp.issubdtype(z_ref.dtype, jnp.floating) else jnp.int32


def _minus_zero(q, zero):
    """Codes q - zero (None: q) as float32: int32 codes minus integer zero points exactly, float
    zero points (or e4m3 codes) with one rounding."""
    if zero is None:
        return q.astype(jnp.float32)
    if jnp.issubdtype(zero.dtype, jnp.floating):
        return q.astype(jnp.float32) - zero
    return (q - zero).astype(jnp.float32)


def _group_slice(s_ref, z_ref, kb, *, block_k, group_size):
    """K block kb's group scales, f32 [n_s, bn], and zero points (None, or int32 / f32 [n_s, bn]):
    n_s = block_k / group_size groups, or 1 where the block lies inside one group."""
    if block_k >= group_size:
        n_s = block_k // group_size
        s_start = kb * n_s
    else:
        n_s = 1
        s_start = lax.div(kb, group_size // block_k)
    ss = pl.ds(s_start, n_s)
    scale = s_ref[ss, :].astype(jnp.float32)
    return scale, None if z_ref is None else z_ref[ss, :].astype(_zero_dtype(z_ref))


def _dequant_tile(q, scale, zero):
    """One K block's codes q [rows, bn] (int32, or e4m3) -> f32 (q - zero) * scale, its rows in
    scale.shape[0] equal groups (_group_slice)."""
    n_s = scale.shape[0]
    if n_s == 1:                                          # one group per K block: [1, bn] broadcasts
        return _minus_zero(q, zero) * scale               # (no reshape for Triton)
    rows, bn = q.shape
    q = q.reshape(n_s, rows // n_s, bn)                   # [n_s, rows / n_s, bn]: one scale per group
    return (_minus_zero(q, None if zero is None else zero[:, None, :]) * scale[:, None, :]).reshape(rows, bn)


def _grouped8_codes(w_ref, ks, zero):
    """A K block of grouped 8-bit codes, as _minus_zero takes them: int32 beside integer zero
    points, else as stored (int8 or e4m3, converted to f32 there)."""
    q = w_ref[ks, :]
    return q.astype(jnp.int32) if zero is not None and zero.dtype == jnp.int32 else q


def _int4_kernel(xe_ref, xo_ref, w_ref, s_ref, *rest, block_k, num_k, group_size, symmetric,
                 compute_dtype, precision):
    z_ref, o_ref = (None, rest[0]) if symmetric else rest
    bm, bn = o_ref.shape

    def body(kb, acc):
        lo, hi = _int4_halves(w_ref, s_ref, z_ref, kb, block_k=block_k, group_size=group_size)
        ks = pl.ds(pl.multiple_of(kb * (block_k // 2), block_k // 2), block_k // 2)
        xe = xe_ref[:, ks].astype(compute_dtype)
        xo = xo_ref[:, ks].astype(compute_dtype)
        acc = acc + jnp.dot(xe, lo.astype(compute_dtype), preferred_element_type=jnp.float32, precision=precision)
        acc = acc + jnp.dot(xo, hi.astype(compute_dtype), preferred_element_type=jnp.float32, precision=precision)
        return acc

    acc = lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _grouped8_kernel(x_ref, w_ref, s_ref, *rest, block_k, num_k, group_size, compute_dtype, precision):
    z_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    bm, bn = o_ref.shape

    def body(kb, acc):
        ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        scale, zero = _group_slice(s_ref, z_ref, kb, block_k=block_k, group_size=group_size)
        w = _dequant_tile(_grouped8_codes(w_ref, ks, zero), scale, zero).astype(compute_dtype)
        x = x_ref[:, ks].astype(compute_dtype)
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision)

    acc = lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


# --------------------------------------------------------------------------------------------
# Wrapper.
# --------------------------------------------------------------------------------------------

def _w8a8_kernel(x_ref, w_ref, sx_ref, sw_ref, *rest, block_k, num_k, asymmetric):
    o_ref = rest[-1]
    bm, bn = o_ref.shape

    def body(kb, carry):
        acc, csum = carry
        ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        w = w_ref[ks, :]
        acc = acc + lax.dot_general(x_ref[:, ks], w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        if asymmetric:
            csum = csum + jnp.sum(w.astype(jnp.int32), axis=0)
        return acc, csum

    acc, csum = lax.fori_loop(0, num_k, body, (jnp.zeros((bm, bn), jnp.int32), jnp.zeros((bn,), jnp.int32)))
    if asymmetric:
        acc = acc - rest[0][0] * csum[None, :]
    o_ref[...] = (acc.astype(jnp.float32) * sx_ref[...][:, None] * sw_ref[...][None, :]).astype(o_ref.dtype)


def w8a8_matmul_reference(xq, w, x_scale, w_scale, azp=None, out_dtype=jnp.float32):
    """The same product in plain XLA: an exact int32 dot, the zero-point correction, the rescale."""
    acc = lax.dot_general(xq, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    if azp is not None:
        acc = acc - jnp.asarray(azp, jnp.int32) * jnp.sum(w.astype(jnp.int32), axis=0)[None, :]
    return (acc.astype(jnp.float32) * x_scale[:, None] * w_scale[None, :]).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret", "out_dtype"))
def _w8a8_matmul(xq, w, x_scale, w_scale, azp, *, block_m, block_n, block_k, num_warps, num_stages,
                 interpret, out_dtype):
    m, k = xq.shape
    n = w.shape[1]
    mp = pl.cdiv(m, block_m) * block_m
    if mp != m:
        xq = jnp.pad(xq, ((0, mp - m), (0, 0)))
        x_scale = jnp.pad(x_scale, (0, mp - m), constant_values=1.0)
    asymmetric = azp is not None
    in_specs = [pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
                pl.BlockSpec((block_m,), lambda i, j: (i,)),
                pl.BlockSpec((block_n,), lambda i, j: (j,))]
    args = [xq, w, x_scale.astype(jnp.float32), w_scale.astype(jnp.float32)]
    if asymmetric:
        in_specs.append(pl.BlockSpec((1,), lambda i, j: (0,)))
        args.append(jnp.reshape(azp, (1,)).astype(jnp.int32))
    out = pl.pallas_call(
        functools.partial(_w8a8_kernel, block_k=block_k, num_k=k // block_k, asymmetric=asymmetric),
        grid=(mp // block_m, n // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="w8a8_matmul_asym" if asymmetric else "w8a8_matmul",
    )(*args)
    return out[:m] if mp != m else out


def w8a8_matmul(xq, w, x_scale, w_scale, azp=None, *, out_dtype=jnp.float32, block_m: int | None = None,
                block_n: int = 128, block_k: int = 128, num_warps: int = 4, num_stages: int = 3,
                interpret: bool | None = None):
    """xq int8 [M, K], w int8 [K, N], x_scale f32 [M], w_scale f32 [N], azp None or an int scalar
    (the activations' zero point) -> [M, N] in out_dtype (module docstring). Block sizes as in
    quant_matmul (block_k >= 16 on GPU; N % block_n == 0, K % block_k == 0 after clamping)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if xq.ndim != 2 or w.ndim != 2 or xq.shape[1] != w.shape[0]:
        raise ValueError(f"w8a8_matmul expects xq [M, K] and w [K, N], got {xq.shape} and {w.shape}")
    if xq.dtype != jnp.int8 or w.dtype != jnp.int8:
        raise TypeError(f"w8a8_matmul expects int8 activations and weights, got {xq.dtype} and {w.dtype}")
    m, k = xq.shape
    n = w.shape[1]
    if x_scale.shape != (m,) or w_scale.shape != (n,):
        raise ValueError(f"x_scale must be [M]={m} and w_scale [N]={n}, got {x_scale.shape} and {w_scale.shape}")
    bm = default_block_m(m) if block_m is None else int(block_m)
    bn, bk = min(int(block_n), n), min(int(block_k), k)
    if bm <= 0 or bn <= 0 or bk <= 0:
        raise ValueError("block sizes must be positive")
    if n % bn or k % bk:
        raise ValueError(f"N={n} and K={k} must be multiples of block_n={bn} and block_k={bk}")
    if not interpret:
        for name, b in (("block_m", bm), ("block_n", bn), ("block_k", bk)):
            if b < 16 or b & (b - 1):
                raise ValueError(f"on GPU {name} must be a power of two >= 16, got {b}")
    return _w8a8_matmul(xq, w, x_scale, w_scale, None if azp is None else jnp.asarray(azp, jnp.int32),
                        block_m=bm, block_n=bn, block_k=bk, num_warps=int(num_warps), num_stages=int(num_stages),
                        interpret=bool(interpret), out_dtype=jnp.dtype(out_dtype))


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def default_block_m(m: int) -> int:
    """16 (the smallest Triton dot tile) .. 64, by M."""
    return min(64, max(16, _next_pow2(m)))


def _compute_dtype(dtype):
    return dtype if dtype in (jnp.bfloat16, jnp.float16, jnp.float32) else jnp.dtype(jnp.float32)


@functools.partial(jax.jit, static_argnames=(
    "bits", "group_size", "block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret"))
def _quant_matmul(x, w, scales, zeros, *, bits, group_size, block_m, block_n, block_k,
                  num_warps, num_stages, interpret):
    m, k = x.shape
    n = w.shape[1]
    mp = pl.cdiv(m, block_m) * block_m
    if mp != m:
        x = jnp.pad(x, ((0, mp - m), (0, 0)))
    cdt = _compute_dtype(x.dtype)
    precision = lax.Precision.HIGHEST if cdt == jnp.float32 else lax.Precision.DEFAULT
    grid = (mp // block_m, n // block_n)
    num_k = k // block_k
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out_shape = jax.ShapeDtypeStruct((mp, n), x.dtype)
    out_spec = pl.BlockSpec((block_m, block_n), lambda i, j: (i, j))

    if bits == 8 and group_size is not None:
        kernel = functools.partial(_grouped8_kernel, block_k=block_k, num_k=num_k, group_size=group_size,
                                   compute_dtype=cdt, precision=precision)
        ng = k // group_size
        in_specs = [pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                    pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
                    pl.BlockSpec((ng, block_n), lambda i, j: (0, j))]
        args = (x, w, scales)
        if zeros is not None:
            in_specs.append(pl.BlockSpec((ng, block_n), lambda i, j: (0, j)))
            args = args + (zeros,)
        name = grouped8_name(w.dtype, zeros)
    elif bits == 8:
        kernel = functools.partial(_int8_kernel, block_k=block_k, num_k=num_k,
                                   compute_dtype=cdt, precision=precision)
        in_specs = [
            pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
            pl.BlockSpec((block_n,), lambda i, j: (j,)),
        ]
        args = (x, w, scales)
        name = "quant_matmul_int8"
    else:
        symmetric = zeros is None
        kernel = functools.partial(_int4_kernel, block_k=block_k, num_k=num_k,
                                   group_size=group_size, symmetric=symmetric,
                                   compute_dtype=cdt, precision=precision)
        x3 = x.reshape(mp, k // 2, 2)   # free view: [..., 0] = even k, [..., 1] = odd k
        ng = k // group_size
        in_specs = [
            pl.BlockSpec((block_m, k // 2, None), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((block_m, k // 2, None), lambda i, j: (i, 0, 1)),
            pl.BlockSpec((k // 2, block_n), lambda i, j: (0, j)),
            pl.BlockSpec((ng, block_n), lambda i, j: (0, j)),
        ]
        args = (x3, x3, w, scales)
        if not symmetric:
            in_specs.append(pl.BlockSpec((ng, block_n), lambda i, j: (0, j)))
            args = args + (zeros,)
        name = "quant_matmul_int4_sym" if symmetric else "quant_matmul_int4_asym"

    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name=name,
    )(*args)
    return out[:m] if mp != m else out


def grouped8_name(codes_dtype, zeros) -> str:
    """The grouped 8-bit kernels' name stem: by code type and zero points."""
    codes = "fp8" if jnp.dtype(codes_dtype) == jnp.float8_e4m3fn else "int8"
    kind = "sym" if zeros is None else "fzero" if jnp.issubdtype(zeros.dtype, jnp.floating) else "asym"
    return f"quant_matmul_{codes}_grouped_{kind}"


def _check_groups(k: int, n: int, scales, zeros, group_size, bits: int) -> None:
    """Group-wise scales [K/g, N] and zero points (integers, or float32) of the grouped formats
    (int4's groups even: two codes a byte)."""
    if group_size is None or group_size <= 0 or (bits == 4 and group_size % 2):
        raise ValueError(f"group-wise weights need a positive group_size (int4: even), got {group_size}")
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    if scales.shape != (k // group_size, n):
        raise ValueError(f"scales must be [K//g, N]={(k // group_size, n)}, got {scales.shape}")
    if zeros is not None and zeros.shape != scales.shape:
        raise ValueError(f"zeros must be [K//g, N]={scales.shape}, got {zeros.shape}")
    if zeros is not None and not (jnp.issubdtype(zeros.dtype, jnp.integer) or zeros.dtype == jnp.float32):
        raise TypeError(f"zeros must be integers or float32 (the kernel subtracts them from the codes), "
                        f"got {zeros.dtype}")


def _check_operands(x, w, scales, zeros, bits: int, group_size: int | None) -> None:
    """The weight-only formats' shape and dtype checks (quant_matmul's docstring), one error each."""
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D, got shape {w.shape}")
    m, k = x.shape
    n = w.shape[1]
    if bits == 8 and group_size is not None:
        if w.dtype not in (jnp.int8, jnp.float8_e4m3fn):
            raise TypeError(f"grouped bits=8 expects int8 or float8_e4m3fn codes, got {w.dtype}")
        if w.shape[0] != k:
            raise ValueError(f"K mismatch: x {x.shape} vs w {w.shape}")
        _check_groups(k, n, scales, zeros, group_size, bits)
        if zeros is not None and w.dtype == jnp.float8_e4m3fn:
            raise ValueError("float8_e4m3fn codes take no zero points")
    elif bits == 8:
        if w.dtype != jnp.int8:
            raise TypeError(f"bits=8 expects int8 weights, got {w.dtype}")
        if w.shape[0] != k:
            raise ValueError(f"K mismatch: x {x.shape} vs w {w.shape}")
        if scales.shape != (n,):
            raise ValueError(f"bits=8 expects scales [N]={n}, got {scales.shape}")
        if zeros is not None:
            raise ValueError("per-channel bits=8 is symmetric: zeros must be None")
    elif bits == 4:
        if w.dtype != jnp.uint8:
            raise TypeError(f"bits=4 expects packed uint8 weights, got {w.dtype}")
        if k % 2 or w.shape[0] != k // 2:
            raise ValueError(f"K mismatch: x {x.shape} vs packed w {w.shape} (expects [K//2, N])")
        _check_groups(k, n, scales, zeros, group_size, bits)
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")


def quant_matmul(x, w, scales, zeros=None, *, bits: int, group_size: int | None = None,
                 block_m: int | None = None, block_n: int = 128, block_k: int = 128,
                 num_warps: int = 4, num_stages: int = 3, interpret: bool | None = None):
    """x [M, K] (bf16/f16/f32) @ dequant(w) -> [M, N] in x's dtype, f32 accumulation.

    bits=8: w int8 [K, N], scales [N], zeros None, group_size None (per channel); or grouped
            (group_size=g): w int8 / float8_e4m3fn [K, N], scales [K // g, N], zeros None or
            [K // g, N] integers or float32 (int8 codes only).
    bits=4: w uint8 [K // 2, N] (low nibble = even k), scales [K // g, N], group_size=g,
            zeros None (symmetric, signed nibbles) or [K // g, N]: integers in [0, 15] or float32
            (asymmetric; float zero points subtracted in float32).
    block_m=None picks ``default_block_m(M)``; block_n / block_k are clamped to N / K.
    interpret=None means ``jax.default_backend() == "cpu"``.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    _check_operands(x, w, scales, zeros, bits, group_size)
    m, k = x.shape
    n = w.shape[1]
    bm = default_block_m(m) if block_m is None else int(block_m)
    bn = min(int(block_n), n)
    bk = min(int(block_k), k)
    if bm <= 0 or bn <= 0 or bk <= 0:
        raise ValueError("block sizes must be positive")
    if n % bn:
        raise ValueError(f"N={n} is not a multiple of block_n={bn}")
    if k % bk:
        raise ValueError(f"K={k} is not a multiple of block_k={bk}")
    if bits == 4 and bk % 2:
        raise ValueError(f"block_k={bk} must be even for int4")
    if group_size is not None and not (bk % group_size == 0 or group_size % bk == 0):
        raise ValueError(f"block_k={bk} must be a multiple or a divisor of group_size={group_size}")
    if not interpret:
        min_k = 32 if bits == 4 else 16
        for name, b, lo in (("block_m", bm, 16), ("block_n", bn, 16), ("block_k", bk, min_k)):
            if b < lo or b & (b - 1):
                raise ValueError(f"on GPU {name} must be a power of two >= {lo}, got {b}")

    return _quant_matmul(x, w, scales, zeros, bits=bits, group_size=group_size,
                         block_m=bm, block_n=bn, block_k=bk, num_warps=int(num_warps),
                         num_stages=int(num_stages), interpret=bool(interpret))


# --------------------------------------------------------------------------------------------
# Split-K decode kernel (module docstring).
# --------------------------------------------------------------------------------------------

SPLITK_INNER = ("dot", "reduce")     # the inner products quant_matmul_splitk offers
REDUCE_MAX_M = 8                     # inner="reduce" holds [Mp, block_k, block_n] f32 products in registers
SPLITK_MAX_M = 64                    # every M row lives in one tile


def splitk_rows(m: int, inner: str) -> int:
    """Mp, the rows a split-K tile holds for M rows: a power of two (Triton's tile shapes), at least
    16 for the tensor-core dot (its smallest tile)."""
    return _next_pow2(m) if inner == "reduce" else max(16, _next_pow2(m))


def _inner_product(x, w, inner, compute_dtype, precision):
    """x [Mp, bk] @ w [bk, bn] -> f32 [Mp, bn]: a tensor-core dot in compute_dtype, or an f32
    broadcast multiply and a reduction over k."""
    if inner == "dot":
        return jnp.dot(x.astype(compute_dtype), w.astype(compute_dtype), preferred_element_type=jnp.float32,
                       precision=precision)
    return jnp.sum(x.astype(jnp.float32)[:, :, None] * w.astype(jnp.float32)[None, :, :], axis=1)


def _splitk_int8_kernel(x_ref, w_ref, o_ref, *, block_k, num_k, inner, compute_dtype, precision):
    # x_ref [Mp, K/S], w_ref [K/S, bn]: this split's rows; o_ref [Mp, bn] its f32 partial (unscaled)
    mp, bn = o_ref.shape

    def body(kb, acc):
        ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        return acc + _inner_product(x_ref[:, ks], w_ref[ks, :], inner, compute_dtype, precision)

    o_ref[...] = lax.fori_loop(0, num_k, body, jnp.zeros((mp, bn), jnp.float32))


def _int4_halves(w_ref, s_ref, z_ref, kb, *, block_k, group_size):
    """K block kb of a packed int4 tile -> its even-k and odd-k halves dequantized, f32 [bk/2, bn]
    each (s_ref / z_ref: the same rows' group scales and zero points, [rows / g, bn])."""
    hk = block_k // 2
    packed = w_ref[pl.ds(pl.multiple_of(kb * hk, hk), hk), :].astype(jnp.int32)   # [hk, bn] in 0..255
    lo, hi = packed & 0xF, (packed >> 4) & 0xF            # even k, odd k
    if z_ref is None:
        lo, hi = (lo ^ 8) - 8, (hi ^ 8) - 8               # 4-bit two's complement -> [-8, 7]
    scale, zero = _group_slice(s_ref, z_ref, kb, block_k=block_k, group_size=group_size)
    return _dequant_tile(lo, scale, zero), _dequant_tile(hi, scale, zero)


def _splitk_grouped8_kernel(x_ref, w_ref, s_ref, *rest, block_k, num_k, group_size, inner, compute_dtype,
                            precision):
    # x_ref [Mp, K/S], w_ref [K/S, bn], s_ref / z_ref [K/(S g), bn]: this split's rows; o_ref [Mp, bn]
    z_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    mp, bn = o_ref.shape

    def body(kb, acc):
        ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        scale, zero = _group_slice(s_ref, z_ref, kb, block_k=block_k, group_size=group_size)
        w = _dequant_tile(_grouped8_codes(w_ref, ks, zero), scale, zero)
        return acc + _inner_product(x_ref[:, ks], w, inner, compute_dtype, precision)

    o_ref[...] = lax.fori_loop(0, num_k, body, jnp.zeros((mp, bn), jnp.float32))


def _splitk_int4_kernel(xe_ref, xo_ref, w_ref, s_ref, *rest, block_k, num_k, group_size, inner,
                        compute_dtype, precision):
    # xe_ref / xo_ref [Mp, K/2S]: the split's even / odd k of x; w_ref [K/2S, bn]; o_ref [Mp, bn]
    z_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    mp, bn = o_ref.shape
    hk = block_k // 2

    def body(kb, acc):
        ks = pl.ds(pl.multiple_of(kb * hk, hk), hk)
        lo, hi = _int4_halves(w_ref, s_ref, z_ref, kb, block_k=block_k, group_size=group_size)
        xe, xo = xe_ref[:, ks], xo_ref[:, ks]
        if inner == "dot":
            return (acc + _inner_product(xe, lo, inner, compute_dtype, precision)
                    + _inner_product(xo, hi, inner, compute_dtype, precision))
        prod = (xe.astype(jnp.float32)[:, :, None] * lo[None, :, :]
                + xo.astype(jnp.float32)[:, :, None] * hi[None, :, :])   # [Mp, hk, bn]: both halves
        return acc + jnp.sum(prod, axis=1)

    o_ref[...] = lax.fori_loop(0, num_k, body, jnp.zeros((mp, bn), jnp.float32))


@functools.partial(jax.jit, static_argnames=(
    "bits", "group_size", "num_splits", "block_n", "block_k", "inner", "num_warps", "num_stages", "interpret"))
def _quant_matmul_splitk(x, w, scales, zeros, *, bits, group_size, num_splits, block_n, block_k, inner,
                         num_warps, num_stages, interpret):
    m, k = x.shape
    n = w.shape[1]
    mp = splitk_rows(m, inner)
    if mp != m:
        x = jnp.pad(x, ((0, mp - m), (0, 0)))
    cdt = _compute_dtype(x.dtype)
    precision = lax.Precision.HIGHEST if cdt == jnp.float32 else lax.Precision.DEFAULT
    ks = k // num_splits                                   # K rows per split
    common = dict(block_k=block_k, num_k=ks // block_k, inner=inner, compute_dtype=cdt, precision=precision)
    if bits == 8 and group_size is not None:
        kernel = functools.partial(_splitk_grouped8_kernel, group_size=group_size, **common)
        gs = ks // group_size                              # groups per split
        in_specs = [pl.BlockSpec((mp, ks), lambda j, s: (0, s)),
                    pl.BlockSpec((ks, block_n), lambda j, s: (s, j)),
                    pl.BlockSpec((gs, block_n), lambda j, s: (s, j))]
        args = (x, w, scales)
        if zeros is not None:
            in_specs.append(pl.BlockSpec((gs, block_n), lambda j, s: (s, j)))
            args = args + (zeros,)
        name = grouped8_name(w.dtype, zeros).replace("quant_matmul_", "quant_matmul_splitk_")
    elif bits == 8:
        kernel = functools.partial(_splitk_int8_kernel, **common)
        in_specs = [pl.BlockSpec((mp, ks), lambda j, s: (0, s)),
                    pl.BlockSpec((ks, block_n), lambda j, s: (s, j))]
        args = (x, w)
        name = "quant_matmul_splitk_int8"
    else:
        kernel = functools.partial(_splitk_int4_kernel, group_size=group_size, **common)
        x3 = x.reshape(mp, k // 2, 2)                      # free view: [..., 0] = even k, [..., 1] = odd k
        gs = ks // group_size                              # groups per split
        in_specs = [pl.BlockSpec((mp, ks // 2, None), lambda j, s: (0, s, 0)),
                    pl.BlockSpec((mp, ks // 2, None), lambda j, s: (0, s, 1)),
                    pl.BlockSpec((ks // 2, block_n), lambda j, s: (s, j)),
                    pl.BlockSpec((gs, block_n), lambda j, s: (s, j))]
        args = (x3, x3, w, scales)
        if zeros is not None:
            in_specs.append(pl.BlockSpec((gs, block_n), lambda j, s: (s, j)))
            args = args + (zeros,)
        name = f"quant_matmul_splitk_int4_{'sym' if zeros is None else 'asym'}"
    partials = pl.pallas_call(
        kernel,
        grid=(n // block_n, num_splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, mp, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((num_splits, mp, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"{name}_{inner}",
    )(*args)
    y = jnp.sum(partials[:, :m], axis=0)                   # [M, N] f32: the splits' sum (real rows only), in XLA
    if bits == 8 and group_size is None:
        y = y * scales.astype(jnp.float32)[None, :]
    return y.astype(x.dtype)


def _check_splitk_blocks(m: int, k: int, n: int, bits: int, group_size: int | None, num_splits,
                         block_n: int, block_k: int, inner: str, interpret: bool) -> tuple[int, int]:
    """quant_matmul_splitk's launch checks, one error each -> (block_n, block_k) clamped to N, K/S."""
    if inner not in SPLITK_INNER:
        raise ValueError(f"inner must be one of {SPLITK_INNER}, got {inner!r}")
    limit = REDUCE_MAX_M if inner == "reduce" else SPLITK_MAX_M
    if m > limit:
        raise ValueError(f"split-K with inner={inner!r} holds every row in one tile: M={m} > {limit}; "
                         f"use quant_matmul")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive integer, got {num_splits!r}")
    if k % num_splits:
        raise ValueError(f"K={k} is not divisible by num_splits={num_splits}")
    ks = k // num_splits
    bn, bk = min(int(block_n), n), min(int(block_k), ks)
    if bn <= 0 or bk <= 0:
        raise ValueError("block sizes must be positive")
    if n % bn:
        raise ValueError(f"N={n} is not a multiple of block_n={bn}")
    if ks % bk:
        raise ValueError(f"K/num_splits={ks} is not a multiple of block_k={bk}")
    if group_size is not None:
        if ks % group_size:
            raise ValueError(f"K/num_splits={ks} is not a multiple of group_size={group_size} "
                             f"(each split must hold whole groups)")
        if (bits == 4 and bk % 2) or not (bk % group_size == 0 or group_size % bk == 0):
            raise ValueError(f"block_k={bk} must be a multiple or a divisor of group_size={group_size}"
                             + (" and even" if bits == 4 else ""))
    if not interpret:
        for name, b, lo in (("block_n", bn, 16), ("block_k", bk, 32 if bits == 4 else 16)):
            if b < lo or b & (b - 1):
                raise ValueError(f"on GPU {name} must be a power of two >= {lo}, got {b}")
    return bn, bk


def quant_matmul_splitk(x, w, scales, zeros=None, *, bits: int, group_size: int | None = None,
                        num_splits: int, block_n: int = 64, block_k: int = 128, inner: str = "dot",
                        num_warps: int = 4, num_stages: int = 3, interpret: bool | None = None):
    """The split-K decode kernel (module docstring): the operands and result of quant_matmul, for
    M <= 64 (inner="dot") or M <= 8 (inner="reduce").

    num_splits must divide K; block_n / block_k are clamped to N / (K / num_splits), and
    N % block_n == 0, (K / num_splits) % block_k == 0 are required; for int4 each split holds whole
    groups ((K / num_splits) % group_size == 0) and block_k is a multiple or a divisor of group_size
    (grouped 8-bit too).
    On GPU block_n and block_k are powers of two >= 16 (int4: block_k >= 32).
    interpret=None means ``jax.default_backend() == "cpu"``.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    _check_operands(x, w, scales, zeros, bits, group_size)
    m, k = x.shape
    bn, bk = _check_splitk_blocks(m, k, w.shape[1], bits, group_size, num_splits, block_n, block_k, inner,
                                  bool(interpret))
    return _quant_matmul_splitk(x, w, scales, zeros, bits=bits, group_size=group_size,
                                num_splits=num_splits, block_n=bn, block_k=bk, inner=inner,
                                num_warps=int(num_warps), num_stages=int(num_stages), interpret=bool(interpret))
