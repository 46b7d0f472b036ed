"""gpt-oss's MXFP4 experts (quant_method "mxfp4", the only form gpt-oss is published in), as
transformers reads them (integrations/mxfp4.py convert_moe_packed_tensors):
* `{experts}.gate_up_proj_blocks` uint8 [E, 2F, D/32, 16] and `down_proj_blocks` [E, D, F/32, 16]:
  per output row, the input dimension in blocks of 32 e2m1 codes, two per byte, the low nibble first
  (value 2j of a block in byte j's low nibble, 2j+1 in its high nibble);
* `{experts}.gate_up_proj_scales` uint8 [E, 2F, D/32], `down_proj_scales` [E, D, F/32]: one e8m0
  exponent per block, w = e2m1 * 2^(scale - 127);
* gate_up rows interleave gate (even) and up (odd), as the bf16 checkpoints' columns do.
Onto jaxinfer: stacked-expert QuantizedWeights (batch=1) in the mxfp4 format (quant/format.py):
each output row's bytes are already int4's packing along K, so the codes are only transposed to
[E, D/2, N] (and the gate / up rows selected): 4 bits a weight plus a byte per 32, as published.
The MoE layer dequantizes each used expert in XLA on the grouped matmul (jaxinfer/moe.py).
Attention, router, embeddings and biases are plain tensors (bf16 as published) and load as such.
Refused naming the field: anything but quant_method, modules_to_not_convert and dequantize.
"""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from jaxinfer.prequant.common import QuantConfigError, refuse
from jaxinfer.quant import QuantizedWeight

METHOD = "mxfp4"
_INERT = {"quant_method", "modules_to_not_convert", "dequantize"}


class MXFP4Reader:
    method = METHOD

    def __init__(self, qc: dict[str, Any], st):
        for key, value in qc.items():
            if key not in _INERT and value not in (None, False, {}, [], ""):
                raise refuse(METHOD, key, value, "a field jaxinfer does not know")
        self.st = st

    def quantized(self, module: str) -> bool:      # no Linear is quantized: the experts are (stacked_param)
        return False

    def stacked_param(self, ours: str, hf_names: tuple[str, ...], transform: Callable,
                      expected: tuple[int, ...]) -> QuantizedWeight | None:
        """A mixture's stacked experts from `{name}_blocks` / `{name}_scales`; None for other parameters."""
        if len(hf_names) != 1 or not self.st.has(f"{hf_names[0]}_blocks"):
            return None
        name = hf_names[0]
        blocks, scales = self.st.get(f"{name}_blocks"), self.st.get(f"{name}_scales")
        if blocks.ndim != 4 or blocks.shape[-1] != 16 or blocks.dtype != np.uint8:
            raise QuantConfigError(f"tensor {name}_blocks has shape {blocks.shape} {blocks.dtype}; expected uint8 "
                                   "[experts, out, in / 32, 16]")
        e, rows, nb, _ = blocks.shape
        k = nb * 32
        if tuple(scales.shape) != (e, rows, nb) or scales.dtype != np.uint8:
            raise QuantConfigError(f"tensor {name}_scales has shape {scales.shape} {scales.dtype}; expected uint8 "
                                   f"{(e, rows, nb)}")
        cols = np.asarray(transform(np.arange(rows).reshape(1, 1, rows))).reshape(-1)
        if len(expected) != 3 or expected[0] != e or expected[1] != k or expected[2] != len(cols):
            raise QuantConfigError(f"tensor {name}_blocks of shape {blocks.shape} (experts {e}, in {k}, out {rows}) "
                                   f"does not give {ours} of shape {expected}")
        return stacked_mxfp4(np.asarray(blocks).reshape(e, rows, k // 2)[:, cols], np.asarray(scales)[:, cols])

    def linear(self, module: str) -> QuantizedWeight:
        raise AssertionError("mxfp4 checkpoints quantize no Linear")


def stacked_mxfp4(codes: np.ndarray, exponents: np.ndarray) -> QuantizedWeight:
    """Stacked experts in the OCP layout, row by output: codes uint8 [E, N, K/2] (value 2i of a row in
    byte i's low nibble) and e8m0 exponent bytes [E, N, K/32] -> the batch=1 mxfp4 QuantizedWeight
    [E, K, N] (quant/format.py), the bytes only transposed. The GGUF reader builds its MXFP4 experts
    with it too (prequant/gguf_blocks.py)."""
    e, n, half = codes.shape
    return QuantizedWeight(jnp.asarray(np.ascontiguousarray(codes.transpose(0, 2, 1))),
                           jnp.asarray(np.ascontiguousarray(exponents.transpose(0, 2, 1))), None,
                           bits=4, group_size=32, shape=(e, 2 * half, n), contract=1, batch=1)
