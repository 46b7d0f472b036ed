"""FP8 checkpoints of transformers' quant_method "fp8" (DeepSeek-V3, Qwen3-*-FP8: fine-grained blocks;
Ministral 3, Devstral 2, Mistral Medium: per tensor), as transformers writes them
(integrations/finegrained_fp8.py Fp8Quantize, FP8Linear) and reads them (Fp8Dequantize._dequantize_one):
* `weight` float8_e4m3fn [out, in];
* `weight_scale_inv` f32 [out / bn, in / bk] for weight_block_size [bn, bk]: the multiplier of each
  block (the inverse of the scale the weight was divided by), w = e4m3 * scale_inv[block]; with no
  weight_block_size, one multiplier for the whole tensor (FP8Linear's per-tensor scalar).
Per tensor, the weight loads as compressed-tensors' per-tensor FP8 does (jaxinfer fp8, codes [N, K]
layout "nk", the one scale repeated per output column); the static `activation_scale` beside it
(activation_scheme "static") is not read: activations are quantized per token dynamically on the GPU
path and not at all on the XLA (CPU) path, as for compressed-tensors' static FP8. Per-tensor experts
are refused.
Onto jaxinfer: grouped fp8 (quant/format.py): codes [in, out] (transposed once at load), one scale
per group of bk inputs and output column (the block scale repeated over its bn columns; an output
dimension that is not a multiple of bn has a last, partial block row, as DeepSeek-V3's do), the
product the Pallas kernels' grouped 8-bit format (e4m3 codes) or XLA's dequantize-and-dot, whichever
the tuner measures faster on a GPU (qdot), activations not quantized (the checkpoints' dynamic per-token-group
e4m3 activations are a GPU-kernel choice: this path computes with the exact activations).
Refused naming the field: activation_scheme "static" with blocks, scale_fmt "ue8m0", expert_dtype
"fp4", a weight_block_size that is not two positive sizes; an in dimension that is not a multiple of
bk, naming the tensor.
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
        block = qc.get("weight_block_size")
        self.per_tensor = block is None
        if str(qc.get("activation_scheme", "dynamic")).lower() not in (("dynamic", "static") if self.per_tensor
                                                                       else ("dynamic",)):
            raise refuse(METHOD, "activation_scheme", qc.get("activation_scheme"),
                         "static activation scales load with per-tensor weights (no weight_block_size) only")
        if qc.get("scale_fmt", "float") not in (None, "float"):
            raise refuse(METHOD, "scale_fmt", qc.get("scale_fmt"), "power-of-two (ue8m0) scales are not implemented")
        if qc.get("expert_dtype", "fp8") not in (None, "fp8"):
            raise refuse(METHOD, "expert_dtype", qc.get("expert_dtype"), "FP4 experts are not implemented")
        if qc.get("fmt", "e4m3") not in (None, "e4m3"):
            raise refuse(METHOD, "fmt", qc.get("fmt"), "jaxinfer loads e4m3 codes")
        self.st = st
        if self.per_tensor:
            return
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise refuse(METHOD, "weight_block_size", block, "two positive block sizes [out, in]")
        self.bn, self.bk = block
        if self.bk % 2:
            raise refuse(METHOD, "weight_block_size", block, "an even input block")

    def quantized(self, module: str) -> bool:
        return self.st.has(f"{module}.weight_scale_inv")

    def linear(self, module: str) -> QuantizedWeight:
        w = self.st.get(f"{module}.weight")
        if w.dtype != ml_dtypes.float8_e4m3fn or w.ndim != 2:
            raise QuantConfigError(f"tensor {module}.weight is {w.dtype} {w.shape}; fine-grained fp8 stores "
                                   "float8_e4m3fn [out, in]")
        out, inp = w.shape
        s = self.st.get(f"{module}.weight_scale_inv")
        if self.per_tensor:
            if s.size != 1:
                raise QuantConfigError(f"tensor {module}.weight_scale_inv has shape {tuple(s.shape)}; per-tensor fp8 "
                                       "(no weight_block_size) stores one scale")
            scale = np.full((out,), np.float32(np.asarray(s, np.float32).reshape(())))
            return QuantizedWeight(jnp.asarray(np.ascontiguousarray(w)), jnp.asarray(scale), None, bits=8,
                                   group_size=None, shape=(inp, out), layout="nk")
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
