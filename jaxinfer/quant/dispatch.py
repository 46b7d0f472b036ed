"""Quantized matmul dispatch: qdot runs x @ QuantizedWeight on the Pallas kernels or in XLA.

    y = qdot(x, qw, contract=1, impl="pallas")     # x [..., K-dims] -> [..., N-dims]

The implementation is the caller's argument: "pallas" | "xla", or "auto" for the backend's default
(config.resolve_impl_name: Pallas on GPU). The layers pass the model-wide choice the engine resolved
(ResolvedConfig.matmul; models.decoder.set_matmul_impl); a weight carries none. With "pallas" the
launch config (tiled kernel, split-K kernel or XLA's own dot) is autotuned per shape class and cached
(select_blocks; the candidates and their untuned defaults: candidates.py and
pallas_kernels/quant_matmul_tuned.py). Per-channel fp8 weights take XLA's native fp8 dot on the
Pallas path, W8A8 weights the w8a8_matmul kernel, grouped 8-bit ones (int8 or e4m3 codes) the
launch configs as int4 does, XLA first (the formats: format.py).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer.config import resolve_impl_name
from jaxinfer.quant.candidates import matmul_class, pallas_block_candidates
from jaxinfer.quant.format import FP8_DTYPE, QuantizedWeight, _dequantize_2d, symmetric_codes
from pallas_kernels import autotune as _autotune
from pallas_kernels.quant_matmul import default_block_m, quant_matmul, quant_matmul_splitk, w8a8_matmul

__all__ = ["qdot", "select_blocks", "tuning_key", "dot_precision", "quantize_rows_int8", "fp8_native_matmul"]

log = logging.getLogger(__name__)

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
    elif qw.bits == 8 and not qw.grouped8:   # int8 / fp8 codes, [K, N] or (fp8) [N, K]: contract q's K dim
        y = lax.dot_general(xc, qw.q.astype(cdt), (((1,), (_k_axis(qw),)), ((), ())),
                            preferred_element_type=jnp.float32, precision=dot_precision(cdt))
        y = y * qw.scales.astype(jnp.float32)[None, :]
    else:
        w = _dequantize_2d(qw).astype(cdt)
        y = jnp.dot(xc, w, preferred_element_type=jnp.float32, precision=dot_precision(cdt))
    return y.astype(x2.dtype)


def quantize_rows_int8(x2: jax.Array, act_scale=None, act_zero=None) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (int8 [M, K], f32 scales [M]): symmetric, sx = max|x_m| / 127 per row (dynamic,
    codes in [-127, 127]), or the calibrated act_scale [] for every row (static: codes round(x / sx)
    clipped to [-128, 127], as compressed-tensors' quantizer and vLLM's static int8 kernel clip), with
    the zero point act_zero [] if given (static asymmetric: codes round(x / sx) + z in [-128, 127])."""
    if act_scale is None:
        if act_zero is not None:
            raise ValueError("an activation zero point needs a static act_scale")
        return symmetric_codes(x2, jnp.int8, axis=1)
    xf = x2.astype(jnp.float32)
    sx = jnp.broadcast_to(jnp.asarray(act_scale, jnp.float32), xf.shape[:1])
    if act_zero is None:
        return jnp.clip(jnp.round(xf / sx[:, None]), -128, 127).astype(jnp.int8), sx
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
    Keys (tuning_key): M by matmul_class (weight-only: 1, 2, 4, 8, 16, then powers of two up to 512,
    where the split-K tiles and inner products change; W8A8, tiled only: M <= 64 by default_block_m),
    K and N by power of two, the weight format and the activation dtype. With measuring off, a
    config shipped for the key in quant_matmul_tuned.TUNED (measured on that device kind) is the
    default where it is one of the candidates, else the first candidate. The candidates
    (pallas_block_candidates) are tiled, split-K and XLA configs; qdot runs whichever wins.
    """
    cands = pallas_block_candidates(m, k, n, qw.bits, qw.group_size, weight_only=qw.act_bits is None)
    if max_candidates is not None:
        cands = cands[:max_candidates]
    if not cands:
        return None
    kname, key = tuning_key(m, k, n, dtype, bits=qw.bits, group_size=qw.group_size, symmetric=qw.symmetric,
                            w8a8=qw.act_bits is not None, act_zero=qw.act_zero is not None,
                            float_zeros=qw.float_zeros, fp8_codes=qw.fp8)
    if os.environ.get("JAXINFER_AUTOTUNE", "1") == "0" and not force:
        return _autotune.untuned_config(kname, key, cands)
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


def tuning_key(m: int, k: int, n: int, dtype, *, bits: int, group_size: int | None = None, symmetric: bool = True,
               w8a8: bool = False, act_zero: bool = False, float_zeros: bool = False,
               fp8_codes: bool = False) -> tuple[str, str]:
    """(kernel name, shape class) under which the autotuner caches, and quant_matmul_tuned.TUNED
    ships, a quantized matmul's launch config: 'quant_matmul_int8' / 'quant_matmul_int4_g128_sym' /
    '..._g32_fzero' (float zero points: float32 zeros, a float subtract) / grouped 8-bit
    'quant_matmul_int8_g32_sym' (or '_asym', '_fzero'; e4m3 codes 'quant_matmul_fp8_g128_sym') /
    'w8a8_matmul[_asym]', and 'M x K x N' by class (select_blocks) with the activation dtype."""
    m_class = min(default_block_m(m) if m <= 64 else m, 512) if w8a8 else matmul_class(m)
    if w8a8:
        kname = "w8a8_matmul" + ("_asym" if act_zero else "")
    else:
        kind = "sym" if symmetric else "fzero" if float_zeros else "asym"
        codes = "fp8" if fp8_codes else f"int{bits}"
        kname = f"quant_matmul_{codes}" + ("" if group_size is None else f"_g{group_size}_{kind}")
    return kname, f"{_autotune.shape_class(m_class, k, n)}_{jnp.dtype(dtype).name}"


def _resolve_impl(impl: str) -> str:
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl must be 'auto', 'pallas' or 'xla', got {impl!r}")
    return resolve_impl_name(impl, jax.default_backend())


def qdot(x: jax.Array, w, contract: int = 1, impl: str = "auto", *, blocks: dict | None = None,
         interpret: bool | None = None, fallback: bool = False) -> jax.Array:
    """x [..., K-dims] @ w [K-dims, N-dims] -> [..., N-dims] (`contract` = number of K dims).

    w: a float array (plain lax.dot_general, like layers.dense) or a QuantizedWeight
    (its `contract` must match). impl: "pallas" (quant_matmul kernel; W8A8 weights: x quantized
    per row in XLA, then the w8a8_matmul kernel; fp8 weights: x quantized per row to e4m3, then
    XLA's fp8 dot), "xla" (dequantize per call),
    "auto" (pallas on GPU when the shapes fit the kernel, else xla; per-channel fp8 weights take the
    native fp8 dot on GPU whatever their shapes, grouped e4m3 codes the launch configs). Leading dims of x are
    flattened to M; the output has x's dtype. blocks: an explicit launch config, one of
    pallas_block_candidates' kinds: quant_matmul's keywords (tiled), {"kernel": "splitk", ...}
    or XLA_MATMUL (default: select_blocks). fallback: a weight no kernel can run (int3, or shapes
    no launch config tiles) takes the XLA path where impl="pallas" would otherwise raise; the
    layers pass it with their model-wide choice (layers.dense), which holds for every weight.
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
    if w.perm is not None:   # rows stored in perm order (format.py): gather x's columns the same way
        x2 = jnp.take(x2, w.perm, axis=1)
    mode = impl if impl in ("pallas", "xla") else _resolve_impl(impl)   # "auto": the backend's default
    if w.mxfp4 or (w.grouped8 and w.layout != "kn"):   # formats with no kernel: XLA
        if impl == "pallas" and not fallback:
            raise ValueError("the Pallas quant_matmul kernel has no MXFP4 format (nor grouped codes stored "
                             "[N, K]); use impl='xla'")
        return _xla_matmul(x2, w).reshape(lead + tuple(ndims))
    if w.fp8 and not w.grouped8:   # the GPU path: XLA's native fp8 dot (no Pallas kernel); else dequantized
        y2 = fp8_native_matmul(x2, w) if mode == "pallas" and m > 0 else _xla_matmul(x2, w)
        return y2.reshape(lead + tuple(ndims))
    cfg = None
    if mode == "pallas" and m > 0:
        cfg = blocks if blocks is not None else select_blocks(m, w.k, w.n, w, x.dtype)
        if cfg is None:
            strict = impl == "pallas" and not fallback
            if strict and w.bits == 3:
                raise ValueError("the Pallas quant_matmul kernel has no int3 format; use impl='xla'")
            if strict:
                raise ValueError(f"quant_matmul cannot tile K={w.k}, N={w.n} "
                                 f"(bits={w.bits}, group_size={w.group_size}); use impl='xla'")
            mode = "xla"
    if mode == "pallas" and m > 0:
        y2 = _launch(x2, w.q, w.scales, w.zeros, w, cfg, interpret)
    else:
        y2 = _xla_matmul(x2, w)
    return y2.reshape(lead + tuple(ndims))
