"""llama.cpp's block quantizations that are jaxinfer formats exactly, kept packed (GGUF files).

A block of these types is a float16 scale d (times an int8 sub-scale for Q6_K's 16-weight groups)
and signed integer codes, w = scale * code: the same arithmetic as jaxinfer's symmetric grouped
formats (quant/format.py), so they load as QuantizedWeights with no rounding:

| GGML type | block | codes | jaxinfer format |
|---|---|---|---|
| Q8_0 | 32 weights, d | int8 | grouped int8, group 32 |
| Q4_0 | 32 weights, d | q - 8 in [-8, 7] | int4 symmetric, group 32 |
| Q5_0 | 32 weights, d | q - 16 in [-16, 15] | grouped int8, group 32 |
| Q6_K | 256 weights, d and 16 int8 scales | q - 32 in [-32, 31] | grouped int8, group 16 (scale d * sc) |

The scales are read from the blocks' bytes (ggml-common.h's layouts: d first in the 32-weight
blocks; Q6_K's 16 scales at byte 192 and d at byte 208), the codes from the gguf package's
dequantized values divided by them, and every code times its scale must give that value back
exactly (else the tensor is refused by name). The other types (Q4_1, Q5_1, the other K-quants:
offsets that are not integer zero points; the IQ types: lattice codebooks) are dequantized to
floats by the loader. Projections served as one fused matmul (q, k, v; gate, up) stay packed only
when the file stores them in the same type; otherwise all of them load as floats. Embeddings and a
quantized LM head are dequantized (they are not matmul weights of the quantized path).
"""
from __future__ import annotations

import numpy as np

from jaxinfer.prequant.common import QuantConfigError, int_weight
from jaxinfer.quant import QuantizedWeight

METHOD = "gguf"
# GGML type -> (bits of jaxinfer's format, group size, byte of the float16 d, (byte, count) of int8
# sub-scales or None, largest |code|)
EXACT = {"Q8_0": (8, 32, 0, None, 128), "Q4_0": (4, 32, 0, None, 8), "Q5_0": (8, 32, 0, None, 16),
         "Q6_K": (8, 16, 208, (192, 16), 32)}
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class GGUFBlockReader:
    """jaxinfer.prequant's reader protocol (quantized, linear) over a GGUF file's tensors."""
    method = METHOD

    def __init__(self, st):
        self.st = st   # jaxinfer.gguf_file.GGUFTensors

    def _type(self, module: str) -> str | None:
        stored = self.st.stored(f"{module}.weight")
        return None if stored is None else self.st.file.tensors[stored][0].tensor_type.name

    def quantized(self, module: str) -> bool:
        if ".experts." in module:   # stacked experts: dequantized (jaxinfer.moe's experts are one array)
            return False
        kind = self._type(module)
        if kind not in EXACT:
            return False
        head, _, last = module.rpartition(".")
        siblings = next((group for group in _FUSED if last in group), (last,))
        return all(self._type(f"{head}.{s}") == kind for s in siblings)

    def linear(self, module: str) -> QuantizedWeight:
        name = f"{module}.weight"
        kind = self._type(name[:-len(".weight")])
        bits, g, d_at, sub, limit = EXACT[kind]
        w = self.st.get(name)                              # float32 [N, K], llama.cpp's rows turned back
        t = self.st.file.tensors[self.st.stored(name)][0]
        n, k = w.shape
        raw = np.asarray(t.data, np.uint8).reshape(n, -1)
        nbytes = {"Q8_0": 34, "Q4_0": 18, "Q5_0": 22, "Q6_K": 210}[kind]
        blocks = raw.reshape(n, raw.shape[1] // nbytes, nbytes)
        d = np.ascontiguousarray(blocks[:, :, d_at:d_at + 2]).view(np.float16)[..., 0].astype(np.float32)
        if sub is not None:
            sc = np.ascontiguousarray(blocks[:, :, sub[0]:sub[0] + sub[1]]).view(np.int8).astype(np.float32)
            scales = (d[..., None] * sc).reshape(n, -1)
        else:
            scales = d
        scales = self.st.rows(name, scales)                # the same row order as w
        if scales.shape != (n, k // g):
            raise QuantConfigError(f"GGUF tensor {t.name!r} ({kind}) has {scales.shape[1]} groups per row; "
                                   f"expected {k // g} for {k} weights")
        safe = np.where(scales == 0, 1.0, scales)[..., None]
        codes = np.rint(w.reshape(n, k // g, g) / safe)
        if (np.abs(codes).max(initial=0) > limit
                or not np.array_equal((codes * scales[..., None]).astype(np.float32), w.reshape(n, k // g, g))):
            raise QuantConfigError(f"GGUF tensor {t.name!r} ({kind}): its blocks are not scale x integer code "
                                   "(a damaged tensor)")
        return int_weight(codes.reshape(n, k).T.astype(np.int32), scales.T, None, bits, g)
