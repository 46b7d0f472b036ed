"""llama.cpp's block quantizations that are jaxinfer formats exactly, kept packed (GGUF files).

A block of these types is a float16 scale d (times a sub-scale per group: Q6_K's int8 ones, Q3_K's
and IQ4_XS's 6-bit ones minus 32) and signed integer codes (IQ4's: the int8 values of its 16-entry
table), w = scale * code: the same arithmetic as jaxinfer's symmetric grouped formats
(quant/format.py), so they load as QuantizedWeights with no rounding; the K-quants with an offset
below hold it as a float zero point:

| GGML type | block | codes | jaxinfer format |
|---|---|---|---|
| Q8_0 | 32 weights, d | int8 | grouped int8, group 32 |
| Q4_0 | 32 weights, d | q - 8 in [-8, 7] | int4 symmetric, group 32 |
| Q5_0 | 32 weights, d | q - 16 in [-16, 15] | grouped int8, group 32 |
| Q6_K | 256 weights, d and 16 int8 scales | q - 32 in [-32, 31] | grouped int8, group 16 (scale d * sc) |
| Q3_K | 256 weights, d and 16 6-bit scales sc | q - 4 in [-4, 3] | int4 symmetric, group 16 (scale d * (sc - 32)) |
| IQ4_NL | 32 weights, d | kvalues[q], int8 of a 16-value table | grouped int8, group 32 |
| IQ4_XS | 256 weights, d and 8 6-bit scales sc | kvalues[q] | grouped int8, group 32 (scale d * (sc - 32)) |
| Q4_K | 256 weights, d, dmin, 8 6-bit scales and mins | q in [0, 15] | int4, group 32, float zero points |
| Q5_K | the same, 5-bit codes | q in [0, 31] | grouped int8, group 32, float zero points |
| Q2_K | 256 weights, d, dmin, 16 4-bit scales and mins | q in [0, 3] | int4, group 16, float zero points |
| MXFP4 | 32 weights, an e8m0 exponent | e2m1 | mxfp4 (gpt-oss's experts; the nibbles reordered) |

Q4_K, Q5_K and Q2_K subtract an offset: w = (d sc) q - (dmin m) is held as (q - z) s with s = d sc and the
zero point z = dmin m / s a float (quant/format.py's float_zeros: subtracted in float32 by the Pallas
kernels, int4's and grouped int8's alike, and by XLA's dequantization), equal
to the file's value to float32 rounding (within 16 eps of the tensor's largest |w|: the tests check it);
a group with s = 0 (the constant -o) is held as code 0, zero point 1 and scale o, exactly.

The scales are read from the blocks' bytes (ggml-common.h's layouts: d first in the 32-weight
blocks; Q6_K's 16 scales at byte 192 and d at byte 208; Q3_K's 6-bit scales packed in the 12 bytes
at byte 96 and d at byte 108; Q2_K's 16 bytes of scale and min nibbles first, d and dmin at 80;
IQ4_XS's 6-bit scales as a uint16 of high bits at byte 2 and 4 bytes of low nibbles at byte 4; the
IQ4 types' non-linear table is int8 values, so their weights are int8 codes times a scale), the codes
from the blocks themselves: a copy of them with every scale set to 1 and every offset to 0 (_UNIT),
dequantized by the gguf package, is each weight's integer code (its layouts stay the gguf package's;
nothing is divided or rounded: 1.2-2.1x faster than dividing the dequantized values by the scales). A
scale that is not finite is refused naming the tensor. The other types (Q4_1, Q5_1; the other IQ types:
lattice codebooks) are dequantized to floats by the loader. Projections served as one fused matmul (q, k, v; gate, up) stay packed only
when the file stores them in the same type; otherwise all of them load as floats. A mixture's
experts (stacked in the file) load as one batch=1 QuantizedWeight per layer and matrix, expert by
expert. Embeddings and a quantized LM head are dequantized (they are not matmul weights of the
quantized path).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxinfer.prequant.common import QuantConfigError, int_weight
from jaxinfer.prequant.mxfp4 import stacked_mxfp4
from jaxinfer.quant import QuantizedWeight

METHOD = "gguf"
# GGML type -> (bits of jaxinfer's format, group size, byte of the float16 d, sub-scales (_sub_scales:
# int8 bytes at a byte, Q3_K's / IQ4_XS's packed 6-bit ones) or None)
EXACT = {"Q8_0": (8, 32, 0, None), "Q4_0": (4, 32, 0, None), "Q5_0": (8, 32, 0, None),
         "Q6_K": (8, 16, 208, ("int8", 192)), "Q3_K": (4, 16, 108, ("q3_k", 96)),
         "IQ4_NL": (8, 32, 0, None), "IQ4_XS": (8, 32, 0, ("iq4_xs", 2))}
# K-quants with an offset per group, w = d * sc * q - dmin * m (_k_scales: Q4_K / Q5_K's 6-bit sc and m
# per 32 packed in 12 bytes at byte 4, ggml's get_scale_min_k4; Q2_K's 4-bit ones per 16, a byte each):
# unsigned codes with a float zero point m*dmin / (sc*d) -> (bits of jaxinfer's format, group size)
OFFSET = {"Q4_K": (4, 32), "Q5_K": (8, 32), "Q2_K": (4, 16)}
_NBYTES = {"Q8_0": 34, "Q4_0": 18, "Q5_0": 22, "Q6_K": 210, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q2_K": 84,
           "IQ4_NL": 18, "IQ4_XS": 136}
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# (byte, bytes) to write into a copy of each block so that its scales are 1 and its offsets 0: the gguf
# package then dequantizes the copy to the integer codes. f16 1.0 is 00 3c; Q4_K / Q5_K's 12 bytes of
# 6-bit scales and mins: sc 1 in bytes 0-3 and the low nibbles of 8-11, m 0; Q3_K's and IQ4_XS's
# 6-bit scales 33 (= 1 + 32): low nibbles 1, top bits 2 (0xaa); Q6_K's int8 scales 1; Q2_K's nibbles sc 1, m 0
_ONE = b"\x00\x3c"
_UNIT = {"Q8_0": ((0, _ONE),), "Q4_0": ((0, _ONE),), "Q5_0": ((0, _ONE),), "IQ4_NL": ((0, _ONE),),
         "Q6_K": ((192, b"\x01" * 16), (208, _ONE)), "Q3_K": ((96, b"\x11" * 8 + b"\xaa" * 4), (108, _ONE)),
         "IQ4_XS": ((0, _ONE + b"\xaa\xaa" + b"\x11" * 4),),
         "Q4_K": ((0, _ONE + b"\x00\x00" + b"\x01" * 4 + b"\x00" * 4 + b"\x01" * 4),),
         "Q5_K": ((0, _ONE + b"\x00\x00" + b"\x01" * 4 + b"\x00" * 4 + b"\x01" * 4),),
         "Q2_K": ((0, b"\x01" * 16), (80, _ONE + b"\x00\x00"))}


class GGUFBlockReader:
    """jaxinfer.prequant's reader protocol (quantized, linear) over a GGUF file's tensors."""
    method = METHOD

    def __init__(self, st):
        self.st = st   # jaxinfer.gguf_file.GGUFTensors

    def _type(self, module: str) -> str | None:
        stored = self.st.stored(f"{module}.weight")
        return None if stored is None else self.st.file.tensors[stored][0].tensor_type.name

    def quantized(self, module: str) -> bool:
        name = f"{module}.weight"
        if ".experts." in module or ".block_sparse_moe.output_linear" in module or self.st.latent_parts(name) is not None or self.st.qkvz_parts(name) is not None \
                or self.st.granite_parts(name) is not None or self.st.columns_reordered(name):
            # stacked experts: stacked_param's; DeepSeek's kv_b and Qwen3-Next's in_proj_qkvz from two tensors,
            # Qwen3.5's out_proj with its columns reordered, Granite 4.0-H's fused MLPs from two and its
            # stacked experts' output_linear: floats
            return False
        kind = self._type(module)
        head, _, last = module.rpartition(".")
        # the projections fused with it: stored ones only (an ungated MLP's up has no gate to agree with)
        siblings = [s for s in next((group for group in _FUSED if last in group), (last,))
                    if s == last or self._type(f"{head}.{s}") is not None]
        return _packable(kind) and all(self._type(f"{head}.{s}") == kind for s in siblings)

    def linear(self, module: str) -> QuantizedWeight:
        name = f"{module}.weight"
        t = self.st.file.tensors[self.st.stored(name)][0]
        return _weight(t, np.asarray(t.data, np.uint8), lambda x: self.st.rows(name, x))

    def stacked_param(self, ours: str, hf_names: tuple[str, ...], transform, expected: tuple[int, ...]):
        """A mixture's experts (one stacked tensor in the file, llama.cpp's ffn_*_exps) as one batch=1
        QuantizedWeight when their type is exact (and gate's and up's agree where the file has both: one
        fused matmul here; Nemotron 3's ungated experts have up alone); None otherwise (the loader reads
        them as floats)."""
        if len(hf_names) == 1 and not hf_names[0].endswith("_bias") and self.st.oss_parts(hf_names[0]) is not None:
            return self._oss_param(ours, hf_names[0], transform, expected)
        found = self.st.expert_rows(hf_names[0]) if hf_names else None
        if found is None:
            return None
        stack, rows = found
        t = self.st.file.tensors[stack][0]
        kind = t.tensor_type.name
        pair = [f"blk.{stack.split('.')[1]}.ffn_{p}_exps.weight" for p in ("gate", "up")]
        if not _packable(kind) or (stack in pair and pair[0] in self.st.file.tensors and any(
                n not in self.st.file.tensors or self.st.file.tensors[n][0].tensor_type.name != kind for n in pair)):
            return None
        raw = _row_bytes(t, rows)
        if len(hf_names) != raw.shape[0]:
            raise QuantConfigError(f"GGUF tensor {stack!r} holds {raw.shape[0]} experts; {ours} has {len(hf_names)}")
        return _stack(t, raw, ours, expected)

    def _oss_param(self, ours: str, name: str, transform, expected: tuple[int, ...]):
        """gpt-oss's experts (transformers' gate_up_proj, gate's and up's columns interleaved: which of
        them `transform` takes tells gate from up; down_proj) from llama.cpp's tensors: MXFP4 as
        jaxinfer's mxfp4 format (the codes' nibbles moved, nothing computed), the exact and offset
        types as the other experts; None for other types or a selection that is neither."""
        if self.st.stored(name) is None:   # a tensor missing: the loader names it
            return None
        if name.endswith("down_proj"):
            part = "down"
        else:
            f = int(expected[-1])
            cols = np.asarray(transform(np.arange(2 * f).reshape(1, 1, -1))).reshape(-1)
            part = next((p for p, j in (("gate", 0), ("up", 1)) if np.array_equal(cols, np.arange(j, 2 * f, 2))), None)
            if part is None:
                return None
        tensor, rows = self.st.oss_rows(name, part)
        t = self.st.file.tensors[tensor][0]
        kinds = {self.st.file.tensors[self.st.oss_rows(name, p)[0]][0].tensor_type.name
                 for p in ((part,) if part == "down" else ("gate", "up"))}
        if len(kinds) != 1 or not (kinds <= {"MXFP4"} or _packable(t.tensor_type.name)):
            return None
        raw = _row_bytes(t, rows)
        if t.tensor_type.name == "MXFP4":
            return _mxfp4(tensor, raw, ours, expected)
        return _stack(t, raw, ours, expected)


def _packable(kind: str | None) -> bool:
    return kind in EXACT or kind in OFFSET


def _row_bytes(t, rows: slice) -> np.ndarray:
    """The blocks' bytes [E, N, bytes of a row] of stacked-experts tensor t, rows `rows` of each expert."""
    raw = np.asarray(t.data, np.uint8)
    return raw.reshape(-1, int(t.shape[1]), raw.shape[-1])[:, rows]


def _stack(t, raw: np.ndarray, ours: str, expected: tuple[int, ...]) -> QuantizedWeight:
    """Stacked experts [E, N, K] of GGUF tensor t (raw their blocks' bytes [E, N, bytes]) as one batch=1
    QuantizedWeight [E, K, N], expert by expert."""
    kind = t.tensor_type.name
    e, n, k = raw.shape[0], raw.shape[1], raw.shape[2] // _NBYTES[kind] * _block_size(kind)
    if tuple(expected) != (e, k, n):
        raise QuantConfigError(f"GGUF tensor {t.name!r} of shape {[e, n, k]} does not give {ours} of shape "
                               f"{tuple(expected)}")
    parts = [_weight(t, raw[j], lambda x: x) for j in range(e)]
    stackq = lambda leaf: None if getattr(parts[0], leaf) is None else jnp.stack(  # noqa: E731
        [getattr(p, leaf) for p in parts])
    return dataclasses.replace(parts[0], q=stackq("q"), scales=stackq("scales"), zeros=stackq("zeros"),
                               shape=(e, k, n), contract=1, batch=1)


def _mxfp4(name: str, raw: np.ndarray, ours: str, expected: tuple[int, ...]) -> QuantizedWeight:
    """MXFP4 blocks [E, N, K/32 * 17] (ggml's block_mxfp4: the e8m0 exponent byte, then 16 bytes whose
    low nibbles are the block's values 0-15 and high nibbles 16-31) as jaxinfer's mxfp4 format
    (quant/format.py: value 2i in byte i's low nibble, 2i+1 in its high, [E, K/2, N]; exponent bytes
    [E, K/32, N]). ggml's value is kvalues[code] * 2^(e - 128) with kvalues twice the e2m1 values,
    i.e. e2m1 * 2^(e - 127): the same exponent byte and code as the OCP layout."""
    e, n, nbytes = raw.shape
    if nbytes % 17:
        raise QuantConfigError(f"GGUF tensor {name!r} (MXFP4): rows of {nbytes} bytes are not whole 17-byte blocks")
    k = nbytes // 17 * 32
    if tuple(expected) != (e, k, n):
        raise QuantConfigError(f"GGUF tensor {name!r} of shape [{e}, {n}, {k}] does not give {ours} of shape "
                               f"{tuple(expected)}")
    blocks = raw.reshape(e, n, k // 32, 17)
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)                   # [E, N, K/32, 32] in k order
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8).reshape(e, n, k // 2)
    return stacked_mxfp4(packed, blocks[..., 0])


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(scale, offset) float32 [..., groups] of Q4_K / Q5_K / Q2_K blocks: s = d * sc_j, o = dmin * m_j.
    Q4_K / Q5_K: 8 groups of 32, d and dmin first, sc_j and m_j unpacked from the 12 bytes at byte 4
    (ggml-common.h: groups 0-3 take the low 6 bits of bytes j and j + 4; groups 4-7 the nibbles of
    byte j + 4 with the top 2 bits of bytes j - 4 and j). Q2_K: 16 groups of 16, byte j's low nibble
    sc_j and high nibble m_j, d and dmin at bytes 80 and 82."""
    blocks = raw.reshape(*raw.shape[:-1], -1, _NBYTES[kind])
    if kind == "Q2_K":
        d, dmin = _f16(blocks, 80), _f16(blocks, 82)
        sc, m = (blocks[..., :16] & 0xF).astype(np.int32), (blocks[..., :16] >> 4).astype(np.int32)
    else:
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        b = blocks[..., 4:16].astype(np.int32)
        sc = np.concatenate([b[..., 0:4] & 63, (b[..., 8:12] & 0xF) | ((b[..., 0:4] >> 6) << 4)], axis=-1)
        m = np.concatenate([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], axis=-1)
    scale = (d[..., None] * sc.astype(np.float32)).reshape(*raw.shape[:-1], -1)
    offset = (dmin[..., None] * m.astype(np.float32)).reshape(*raw.shape[:-1], -1)
    return scale, offset


def _block_size(kind: str) -> int:
    import gguf
    return int(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0])


def _unit_codes(raw: np.ndarray, kind: str) -> np.ndarray:
    """The integer codes float32 [N, K] of blocks raw [N, bytes]: the gguf package's dequantization of a
    copy of them whose scales are 1 and offsets 0 (_UNIT)."""
    import gguf
    blocks = raw.reshape(raw.shape[0], -1, _NBYTES[kind]).copy()
    for at, value in _UNIT[kind]:
        blocks[..., at:at + len(value)] = np.frombuffer(value, np.uint8)
    return gguf.quants.dequantize(blocks.reshape(raw.shape), gguf.GGMLQuantizationType[kind])


def _finite(t, kind: str, *arrays: np.ndarray) -> None:
    if not all(np.isfinite(a).all() for a in arrays):
        raise QuantConfigError(f"GGUF tensor {t.name!r} ({kind}): a block's scale is not finite (a damaged tensor)")


def _weight(t, raw: np.ndarray, rows) -> QuantizedWeight:
    """One [N, K] matrix of GGUF tensor t (raw its blocks' bytes [N, bytes] as stored) as jaxinfer's
    [K, N] QuantizedWeight; rows() turns a [N, ...] array from llama.cpp's rows into transformers'
    (Llama's Q and K reordered, GPT-NeoX's fused q / k / v per head, one of Phi-2's fused q / k / v):
    applied to the blocks' bytes, each row's blocks being its own."""
    kind = t.tensor_type.name
    raw = np.ascontiguousarray(rows(raw))
    codes = _unit_codes(raw, kind)                           # float32 [N, K], integers
    n, k = codes.shape
    blocks = raw.reshape(n, -1, _NBYTES[kind])
    if kind in EXACT:
        bits, g, d_at, sub = EXACT[kind]
        d = _f16(blocks, d_at)
        scales = d if sub is None else (d[..., None] * _sub_scales(blocks, *sub)).reshape(n, -1)
        _finite(t, kind, scales)
        return int_weight(codes.T.astype(np.int32), scales.T, None, bits, g)
    bits, g = OFFSET[kind]
    scale, offset = _k_scales(raw, kind)
    _finite(t, kind, scale, offset)
    # a group with scale 0 is the constant -offset: code 0, zero point 1 and the offset as its scale
    flat = scale == 0
    scale = np.where(flat, np.where(offset == 0, np.float32(1), offset), scale).astype(np.float32)
    zeros = np.where(flat, np.where(offset == 0, np.float32(0), np.float32(1)), offset / scale).astype(np.float32)
    codes[np.repeat(flat, g, axis=1)] = 0
    return int_weight(codes.T.astype(np.int32), scale.T, zeros.T, bits, g)


def _sub_scales(blocks: np.ndarray, how: str, at: int) -> np.ndarray:
    """The sub-scales float32 [..., 16 or 8] of each Q6_K / Q3_K / IQ4_XS block: Q6_K's int8 bytes at `at`;
    Q3_K's 6-bit values packed in the 12 bytes at `at`, minus 32 (ggml-common.h: scale j's low 4 bits in
    byte j's low nibble for j < 8, byte j - 8's high one after; its top 2 bits in byte 8 + j % 4, bits
    2 (j // 4)); IQ4_XS's 8, minus 32: low 4 bits in the nibble j % 2 of byte at + 2 + j // 2, top 2
    bits at bit 2j of the uint16 at `at`."""
    if how == "int8":
        return np.ascontiguousarray(blocks[..., at:at + 16]).view(np.int8).astype(np.float32)
    if how == "iq4_xs":
        high = np.ascontiguousarray(blocks[..., at:at + 2]).view(np.uint16).astype(np.int32)   # [..., 1]
        low = blocks[..., at + 2:at + 6].astype(np.int32)
        low = np.stack([low & 0xF, low >> 4], axis=-1).reshape(*low.shape[:-1], 8)
        return ((low | (((high >> (2 * np.arange(8))) & 3) << 4)) - 32).astype(np.float32)
    b = blocks[..., at:at + 12].astype(np.int32)
    low = np.concatenate([b[..., 0:8] & 0xF, b[..., 0:8] >> 4], axis=-1)
    high = np.concatenate([(b[..., 8:12] >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    return ((low | (high << 4)) - 32).astype(np.float32)
