"""What every pre-quantized checkpoint reader shares: the refusal message, bit unpacking, and
placing a checkpoint's [in, out] QuantizedWeight under one of the decoder's parameters."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from jaxinfer.quant import QuantizedWeight, dequantize


class QuantConfigError(ValueError):
    """A quantization_config (or a quantized tensor) jaxinfer does not load; weights.CheckpointError
    re-raises it with the folder."""


def refuse(method: str, field: str, value: Any, why: str) -> QuantConfigError:
    return QuantConfigError(f"config.json quantization_config (quant_method {method!r}): field {field!r} = "
                            f"{value!r} is not supported: {why}")


def unpack_rows(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words holding 32 / bits unsigned codes each, code j in bits [j * bits, (j + 1) * bits),
    unpacked along `axis` (word w's codes become entries w * 32/bits + j) -> int32 codes in [0, 2^bits)."""
    assert 32 % bits == 0, bits
    per = 32 // bits
    u = np.asarray(words).astype(np.int64) & 0xFFFFFFFF                   # the words as unsigned
    shifts = (np.arange(per, dtype=np.int64) * bits)
    w = np.moveaxis(u, axis, -1)
    codes = (w[..., None] >> shifts) & ((1 << bits) - 1)                  # [..., W, per]
    codes = codes.reshape(*w.shape[:-1], w.shape[-1] * per)
    return np.moveaxis(codes, -1, axis).astype(np.int32)


def pack_int4_np(q: np.ndarray) -> np.ndarray:
    """numpy twin of pallas_kernels.quant_matmul.pack_int4: [K, N] -> uint8 [K/2, N], low nibble = even k."""
    # bytes (a negative code wraps to its two's complement), row-major: a transposed view's strides made one pass
    u = np.ascontiguousarray(np.asarray(q).astype(np.uint8)) & np.uint8(0xF)
    return u[0::2] | (u[1::2] << np.uint8(4))


def int_weight(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, bits: int,
               group_size: int) -> QuantizedWeight:
    """A linear's integer codes [K, N] (signed, w = codes * scale, when zeros is None; else unsigned
    in [0, 2^bits), w = (codes - zero) * scale), scales [K/g, N] and zeros [K/g, N] -> jaxinfer's
    int4 / int8 QuantizedWeight of shape (K, N) (quant/format.py), packed: int4 two per byte, int8
    one byte each, per output channel or grouped. Integer zero points are int4's only; float ones
    (GGUF's K-quants: quant/format.py's float_zeros) stay float32, for int4 or grouped int8."""
    k, n = codes.shape
    scales = np.asarray(scales, np.float32)
    floats = zeros is not None and np.issubdtype(np.asarray(zeros).dtype, np.floating)
    zeros_ = None if zeros is None else jnp.asarray(np.asarray(zeros).astype(np.float32 if floats else np.uint8))
    if bits == 8:   # per channel: jaxinfer's int8; grouped: grouped int8 (quant/format.py)
        assert zeros is None or (floats and scales.shape[0] > 1), "8-bit zero points: grouped, float"
        per_channel = scales.shape[0] == 1
        return QuantizedWeight(jnp.asarray(codes.astype(np.int8)), jnp.asarray(scales[0] if per_channel else scales),
                               zeros_, bits=8, group_size=None if per_channel else group_size, shape=(k, n))
    assert bits == 4, bits
    return QuantizedWeight(jnp.asarray(pack_int4_np(codes)), jnp.asarray(scales), zeros_, bits=4,
                           group_size=group_size, shape=(k, n))


def _columns(transform: Callable, k: int, n: int, expected: tuple[int, ...], contract: int) -> np.ndarray | None:
    """Which columns of the [K, N] (= HF [out, in] transposed) matrix `transform` keeps, in order, when
    it only transposes, reshapes and takes whole output rows (hf_maps' linear transforms): applied to
    the index matrix it must give index[k, cols[j]] at [k, j] once viewed as [K, -1]. None: it does
    something else (the weight cannot stay packed)."""
    idx = np.arange(n * k, dtype=np.int64).reshape(n, k)        # HF [out, in]: entry o * k + i
    try:
        out = np.asarray(transform(idx))
    except ValueError:
        return None
    if out.shape != tuple(expected) or math.prod(expected[:contract]) != k:
        return None
    out = out.reshape(k, -1)
    cols = out[0] // k
    if not np.array_equal(out, cols[None, :] * k + np.arange(k)[:, None]):
        return None
    return cols


def place(qw: QuantizedWeight, transform: Callable, expected: tuple[int, ...], contract: int,
          what: str) -> QuantizedWeight:
    """qw [K, N] (a checkpoint's linear, K = in, N = out) as the parameter of shape `expected` that
    `transform` makes of the float weight [out, in]: its output columns selected (a fused tensor's
    slice) and the logical shape set; the codes stay packed."""
    cols = _columns(transform, qw.k, qw.n, expected, contract)
    if cols is None:
        raise QuantConfigError(f"{what}: the parameter of shape {expected} is not a column selection of the "
                               f"quantized [in={qw.k}, out={qw.n}] weight; it cannot stay packed")
    if not np.array_equal(cols, np.arange(qw.n)):
        take = lambda a, ax: None if a is None else jnp.take(a, jnp.asarray(cols), axis=ax)  # noqa: E731
        n_axis = lambda a: 0 if a.ndim == 1 else a.ndim - 1  # noqa: E731
        q_axis = 0 if qw.layout == "nk" else 1
        qw = dataclasses.replace(qw, q=take(qw.q, q_axis), scales=take(qw.scales, n_axis(qw.scales)),
                                 zeros=None if qw.zeros is None else take(qw.zeros, 1), shape=(qw.k, len(cols)))
    return dataclasses.replace(qw, shape=tuple(expected), contract=contract)


def as_float(qw: QuantizedWeight) -> np.ndarray:
    """The float [out, in] matrix a quantized linear stands for (for parameters that are not matmul
    weights of the quantized path: an lm_head or embedding the checkpoint quantized)."""
    return np.asarray(dequantize(qw), np.float32).T
