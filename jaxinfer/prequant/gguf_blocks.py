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
        if ".experts." in module:   # stacked experts: stacked_param's
            return False
        kind = self._type(module)
        if kind not in EXACT:
            return False
        head, _, last = module.rpartition(".")
        siblings = next((group for group in _FUSED if last in group), (last,))
        return all(self._type(f"{head}.{s}") == kind for s in siblings)

    def linear(self, module: str) -> QuantizedWeight:
        name = f"{module}.weight"
        t = self.st.file.tensors[self.st.stored(name)][0]
        w = self.st.get(name)                              # float32 [N, K], llama.cpp's rows turned back
        codes, scales = _codes(t, w, np.asarray(t.data, np.uint8), lambda x: self.st.rows(name, x))
        bits, g = EXACT[t.tensor_type.name][:2]
        return int_weight(codes.T, scales.T, None, bits, g)

    def stacked_param(self, ours: str, hf_names: tuple[str, ...], transform, expected: tuple[int, ...]):
        """A mixture's experts (one stacked tensor in the file, llama.cpp's ffn_*_exps) as one batch=1
        QuantizedWeight when their type is exact (and gate's and up's agree: one fused matmul here);
        None otherwise (the loader reads them as floats)."""
        from jaxinfer.gguf_file import expert_stack
        stack = expert_stack(hf_names[0]) if hf_names else None
        if stack is None or stack not in self.st.file.tensors:
            return None
        t = self.st.file.tensors[stack][0]
        kind = t.tensor_type.name
        pair = [f"blk.{stack.split('.')[1]}.ffn_{p}_exps.weight" for p in ("gate", "up")]
        if kind not in EXACT or (stack in pair and any(
                n not in self.st.file.tensors or self.st.file.tensors[n][0].tensor_type.name != kind for n in pair)):
            return None
        w = self.st.file.tensor(stack)                     # float32 [E, N, K]
        e, n, k = w.shape
        if len(hf_names) != e or tuple(expected) != (e, k, n):
            raise QuantConfigError(f"GGUF tensor {stack!r} of shape {list(w.shape)} does not give {ours} of shape "
                                   f"{tuple(expected)}")
        raw = np.asarray(t.data, np.uint8).reshape(e, n, -1)
        bits, g = EXACT[kind][:2]
        parts = [int_weight(*(a.T for a in _codes(t, w[j], raw[j], lambda x: x)), None, bits, g) for j in range(e)]
        stackq = lambda leaf: jnp.stack([getattr(p, leaf) for p in parts])  # noqa: E731
        return dataclasses.replace(parts[0], q=stackq("q"), scales=stackq("scales"), shape=(e, k, n), contract=1,
                                   batch=1)


_NBYTES = {"Q8_0": 34, "Q4_0": 18, "Q5_0": 22, "Q6_K": 210}


def _codes(t, w: np.ndarray, raw: np.ndarray, rows) -> tuple[np.ndarray, np.ndarray]:
    """(int32 codes [N, K], float32 scales [N, K/g]) of one [N, K] matrix of GGUF tensor t: w its
    dequantized values (rows in transformers' order), raw its blocks' bytes as stored, rows() the
    same row reordering for the scales."""
    kind = t.tensor_type.name
    _, g, d_at, sub, limit = EXACT[kind]
    n, k = w.shape
    blocks = raw.reshape(n, -1, _NBYTES[kind])
    d = np.ascontiguousarray(blocks[:, :, d_at:d_at + 2]).view(np.float16)[..., 0].astype(np.float32)
    if sub is not None:
        sc = np.ascontiguousarray(blocks[:, :, sub[0]:sub[0] + sub[1]]).view(np.int8).astype(np.float32)
        scales = (d[..., None] * sc).reshape(n, -1)
    else:
        scales = d
    scales = rows(scales)
    if scales.shape != (n, k // g):
        raise QuantConfigError(f"GGUF tensor {t.name!r} ({kind}) has {scales.shape[1]} groups per row; "
                               f"expected {k // g} for {k} weights")
    safe = np.where(scales == 0, 1.0, scales)[..., None]
    codes = np.rint(w.reshape(n, k // g, g) / safe)
    if (np.abs(codes).max(initial=0) > limit
            or not np.array_equal((codes * scales[..., None]).astype(np.float32), w.reshape(n, k // g, g))):
        raise QuantConfigError(f"GGUF tensor {t.name!r} ({kind}): its blocks are not scale x integer code "
                               "(a damaged tensor)")
    return codes.reshape(n, k).astype(np.int32), scales
