"""GPTQ checkpoints (quant_method "gptq": AutoGPTQ, GPTQModel, optimum), checkpoint_format "gptq"
(v1) or "gptq_v2", as GPTQModel writes them (gptqmodel/nn_modules/qlinear/__init__.py pack_original,
gptqmodel/utils/model.py convert_gptq_v2_to_v1_format_module) and dequantizes them
(PackableQuantLinear.dequantize_weight):
* `qweight` int32 [in * bits / 32, out]: packed along the input dimension, row r's word holding
  codes of inputs r * 32/bits + j at bits [j * bits, (j + 1) * bits); unsigned codes in [0, 2^bits).
* `qzeros` int32 [groups, out * bits / 32]: packed along the output dimension the same way. v1
  ("gptq") stores zero - 1: GPTQModel subtracts 0x11111111 (4-bit) / 0x01010101 (8-bit) from each
  whole word, borrows included, so the exact inverse (GPTQModel's convert_gptq_v1_to_v2) adds it
  back modulo 2^32 before unpacking; "gptq_v2" stores the zeros as they are.
* `scales` fp16 [groups, out]; `g_idx` int32 [in]: the group of each input row.
  w[i, o] = scales[g_idx[i], o] * (q[i, o] - zeros[g_idx[i], o]).
Onto jaxinfer: 4-bit -> int4 (symmetric when every zero is 2^(bits-1), GPTQ's sym=True grid: codes
q - 8; else asymmetric with the zeros), 8-bit -> int8 (per channel) or grouped int8, zero points
shifted by 128 when not symmetric. desc_act (g_idx an activation order, each group's rows scattered
over the input): the rows are reordered ONCE AT LOAD, stably sorted by g_idx, so that every group is
a contiguous run again and the weight keeps jaxinfer's packed format (codes, one scale and zero per
group: the same bytes as the checkpoint); the permutation is kept with the weight (QuantizedWeight.perm)
and qdot gathers x's K columns by it per call, K values per row of x, against the alternative of
gathering scales and zeros per input row (a [K, N] f32 table per weight: 8x the int4 codes' bytes,
read on every call). vLLM's GPTQ kernels reorder the same way (exllama's shuffle + input gather).
Projections fused from one input (q/k/v, gate/up) must share the permutation, which GPTQ's
activation order (argsort of the shared Hessian's diagonal) gives them. Bits 2 and 3 (GPTQ's 3-bit words span three int32) are refused
naming the bit width, as are `dynamic` per-module overrides and other checkpoint formats.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxinfer.prequant.common import QuantConfigError, int_weight, refuse, unpack_rows
from jaxinfer.quant import QuantizedWeight

METHOD = "gptq"
# fields GPTQModel / AutoGPTQ / optimum record about how the codes were chosen, not how they are stored
_INERT = {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "damp_percent",
          "damp_auto_increment", "true_sequential", "static_groups", "model_name_or_path", "model_file_base_name",
          "meta", "quantizer", "mse", "v2", "v2_alpha", "act_group_aware", "format", "pack_dtype", "lm_head",
          "dynamic", "modules_in_block_to_quantize", "use_exllama", "exllama_config", "use_cuda_fp16",
          "batch_size", "pad_token_id", "tokenizer", "dataset", "module_name_preceding_first_block",
          "block_name_to_quantize", "cache_block_outputs", "max_input_length", "backend", "hyb_act",
          "fail_safe", "offload_to_disk", "offload_to_disk_path", "rotation", "is_marlin_format",
          "damp_percent_auto", "device", "adapter", "gar",
          "model_seqlen", "disable_exllama", "inside_layer_modules"}   # transformers' / optimum's GPTQConfig
_V1_OFFSET = {4: 0x11111111, 8: 0x01010101}


class GPTQReader:
    method = METHOD

    def __init__(self, qc: dict[str, Any], st):
        for key, value in qc.items():
            if key not in _INERT and value not in (None, False, {}, [], ""):
                raise refuse(METHOD, key, value, "a field jaxinfer does not know")
        self.bits = qc.get("bits")
        if self.bits not in (4, 8):
            raise refuse(METHOD, "bits", self.bits, f"{self.bits}-bit GPTQ is not implemented; jaxinfer loads "
                         "bits 4 and 8")
        g = qc.get("group_size", -1)
        if not isinstance(g, int) or not (g == -1 or (g > 0 and g % 2 == 0)):
            raise refuse(METHOD, "group_size", g, "-1 (per channel) or a positive even group size")
        self.group_size = g
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise refuse(METHOD, "checkpoint_format", fmt, "jaxinfer loads the layouts 'gptq' and 'gptq_v2'")
        if qc.get("is_marlin_format"):
            raise refuse(METHOD, "is_marlin_format", True, "the Marlin layout is not implemented")
        self.v1 = fmt == "gptq"
        if qc.get("dynamic"):
            raise refuse(METHOD, "dynamic", qc["dynamic"], "per-module bit widths and group sizes are not implemented")
        if qc.get("pack_dtype") not in (None, "int32"):
            raise refuse(METHOD, "pack_dtype", qc["pack_dtype"], "jaxinfer loads int32 words")
        if qc.get("modules_in_block_to_quantize") not in (None, []):
            pass   # which modules are quantized is read from the tensors present (qweight)
        self.st = st

    def quantized(self, module: str) -> bool:
        return self.st.has(f"{module}.qweight")

    def linear(self, module: str) -> QuantizedWeight:
        get, b = self.st.get, self.bits
        scales = np.asarray(get(f"{module}.scales"), np.float32)
        groups, out = scales.shape
        g_idx = np.asarray(get(f"{module}.g_idx")).astype(np.int64) if self.st.has(f"{module}.g_idx") else None
        inp = g_idx.shape[0] if g_idx is not None else get(f"{module}.qweight").shape[0] * 32 // b
        g = inp if self.group_size == -1 else self.group_size
        if inp % g or groups != inp // g:
            raise QuantConfigError(f"tensor {module}.scales has shape {scales.shape}; expected "
                                   f"({max(1, inp // g)}, {out}) for in_features {inp} and group_size {self.group_size}")
        for name, want in (("qweight", (inp * b // 32, out)), ("qzeros", (groups, out * b // 32))):
            t = get(f"{module}.{name}")
            if t.shape != want or t.dtype != np.int32:
                raise QuantConfigError(f"tensor {module}.{name} has shape {t.shape} {t.dtype}; expected int32 {want} "
                                       f"for bits {b}, group_size {self.group_size}, in_features {inp}, "
                                       f"out_features {out}")
        perm = None
        if g_idx is not None and not np.array_equal(g_idx, np.arange(inp) // g):
            # desc_act: rows reordered once here so that each group is a contiguous run (qdot gathers x)
            if g_idx.min() < 0 or g_idx.max() >= groups or np.any(np.bincount(g_idx, minlength=groups) != g):
                raise QuantConfigError(f"tensor {module}.g_idx does not assign {g} input rows to each of the "
                                       f"{groups} groups (group_size {self.group_size}, in_features {inp})")
            perm = np.argsort(g_idx, kind="stable").astype(np.int32)
        codes = unpack_rows(get(f"{module}.qweight"), b, axis=0)                  # [in, out] in [0, 2^b)
        if perm is not None:
            codes = codes[perm]
        qz = np.asarray(get(f"{module}.qzeros")).astype(np.int64) & 0xFFFFFFFF
        if self.v1:   # GPTQModel's convert_gptq_v1_to_v2: the whole word + 0x11111111, modulo 2^32
            qz = (qz + _V1_OFFSET[b]) & 0xFFFFFFFF
        zeros = unpack_rows(qz, b, axis=1)                                         # [groups, out]
        half = 1 << (b - 1)
        if np.all(zeros == half):     # GPTQ's symmetric grid: signed codes, no zero points
            qw = int_weight(codes - half, scales, None, b, g)
        elif b == 8:    # grouped int8 with zero points: codes and zeros shifted into int8 by 128
            qw = int_weight_asym8(codes - half, scales, zeros - half, g)
        else:
            qw = int_weight(codes, scales, zeros, b, g)
        if perm is not None:
            import jax.numpy as jnp
            qw = dataclasses.replace(qw, perm=jnp.asarray(perm))
        return qw


def int_weight_asym8(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, g: int) -> QuantizedWeight:
    """8-bit codes and zeros both in [-128, 127] (the unsigned ones minus 128: their difference is
    unchanged) -> grouped int8 with zero points (quant/format.py)."""
    import jax.numpy as jnp
    k, n = codes.shape
    return QuantizedWeight(jnp.asarray(codes.astype(np.int8)), jnp.asarray(scales.astype(np.float32)),
                           jnp.asarray(zeros.astype(np.int8)), bits=8, group_size=g, shape=(k, n))
