"""Fine-grained FP8 checkpoints (quant_method "fp8": DeepSeek-V3, Qwen3-*-FP8; transformers'
FineGrainedFP8Config), as transformers writes them (integrations/finegrained_fp8.py Fp8Quantize)
and reads them (Fp8Dequantize._dequantize_one):
* `weight` float8_e4m3fn [out, in];
* `weight_scale_inv` f32 [out / bn, in / bk] for weight_block_size [bn, bk]: the multiplier of each
  block (the inverse of the scale the weight was divided by), w = e4m3 * scale_inv[block].
Onto jaxinfer: grouped fp8 (quant/format.py): codes [in, out] (transposed once at load), one scale
per group of bk inputs and output column (the block scale repeated over its bn columns; an output
dimension that is not a multiple of bn has a last, partial block row, as DeepSeek-V3's do), the
product the Pallas kernels' grouped 8-bit format (e4m3 codes) or XLA's dequantize-and-dot, whichever
the tuner measures faster on a GPU (qdot), activations not quantized (the checkpoints' dynamic per-token-group
e4m3 activations are a GPU-kernel choice: this path computes with the exact activations).
Refused naming the field: activation_scheme "static", scale_fmt "ue8m0", expert_dtype "fp4", a
missing weight_block_size (per-tensor FP8 is compressed-tensors' float-quantized here); an in
dimension that is not a multiple of bk, naming the tensor.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxinfer.prequant.common import QuantConfigError, refuse
from jaxinfer.quant import QuantizedWeight

METHOD = "fp8"
_INERT = {"quant_method", "activation_scheme", "weight_block_size", "modules_to_not_convert", "dequantize",
          "scale_fmt", "expert_dtype", "modules_to_convert", "fmt"}


class FineGrainedFP8Reader:
    method = METHOD

    def __init__(self, qc: dict[str, Any], st):
        for key, value in qc.items():
            if key not in _INERT and value not in (None, False, {}, [], ""):
                raise refuse(METHOD, key, value, "a field jaxinfer does not know")
        if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
            raise refuse(METHOD, "activation_scheme", qc.get("activation_scheme"),
                         "static activation scales are not implemented")
        if qc.get("scale_fmt", "float") not in (None, "float"):
            raise refuse(METHOD, "scale_fmt", qc.get("scale_fmt"), "power-of-two (ue8m0) scales are not implemented")
        if qc.get("expert_dtype", "fp8") not in (None, "fp8"):
            raise refuse(METHOD, "expert_dtype", qc.get("expert_dtype"), "FP4 experts are not implemented")
        if qc.get("fmt", "e4m3") not in (None, "e4m3"):
            raise refuse(METHOD, "fmt", qc.get("fmt"), "jaxinfer loads e4m3 codes")
        block = qc.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise refuse(METHOD, "weight_block_size", block, "two positive block sizes [out, in]")
        self.bn, self.bk = block
        if self.bk % 2:
            raise refuse(METHOD, "weight_block_size", block, "an even input block")
        self.st = st

    def quantized(self, module: str) -> bool:
        return self.st.has(f"{module}.weight_scale_inv")

    def linear(self, module: str) -> QuantizedWeight:
        w = self.st.get(f"{module}.weight")
        if w.dtype != ml_dtypes.float8_e4m3fn or w.ndim != 2:
            raise QuantConfigError(f"tensor {module}.weight is {w.dtype} {w.shape}; fine-grained fp8 stores "
                                   "float8_e4m3fn [out, in]")
        out, inp = w.shape
        s = self.st.get(f"{module}.weight_scale_inv")
        want = (-(-out // self.bn), -(-inp // self.bk))
        if tuple(s.shape) != want:
            raise QuantConfigError(f"tensor {module}.weight_scale_inv has shape {tuple(s.shape)}; expected {want} "
                                   f"for weight [{out}, {inp}] in blocks {[self.bn, self.bk]}")
        if inp % self.bk:
            raise QuantConfigError(f"tensor {module}.weight: in_features {inp} is not a multiple of the input block "
                                   f"{self.bk}")
        scales = np.repeat(np.asarray(s, np.float32), self.bn, axis=0)[:out].T        # [in / bk, out]
        return QuantizedWeight(jnp.asarray(np.ascontiguousarray(w.T)), jnp.asarray(np.ascontiguousarray(scales)),
                               None, bits=8, group_size=self.bk, shape=(inp, out))
