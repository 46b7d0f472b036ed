"""AWQ checkpoints (quant_method "awq", AutoAWQ), version "gemm" only, as AutoAWQ writes them
(awq/modules/linear/gemm.py WQLinear_GEMM.from_linear) and reads them (awq/utils/packing_utils.py
dequantize_gemm):
* `qweight` int32 [in, out / 8]: packed along the output dimension, 8 codes a word in AutoAWQ's
  interleaved order: nibble i of word c holds column c * 8 + [0, 2, 4, 6, 1, 3, 5, 7][i];
* `qzeros` int32 [in / g, out / 8], packed the same way; `scales` fp16 [in / g, out].
  w[i, o] = (q[i, o] - zeros[i // g, o]) * scales[i // g, o] (no offset on the zeros).
Onto jaxinfer: asymmetric int4 in groups of g (codes and zeros unsigned in [0, 15]).
`modules_to_not_convert` is honoured (those modules are read as float). Refused, naming the field:
versions gemv, gemv_fast, marlin, exllama and ipex (other layouts), bits other than 4, zero_point false.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from jaxinfer.prequant.common import QuantConfigError, int_weight, refuse, unpack_rows
from jaxinfer.quant import QuantizedWeight

METHOD = "awq"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_INERT = {"quant_method", "bits", "w_bit", "group_size", "q_group_size", "zero_point", "version",
          "modules_to_not_convert", "backend", "do_fuse", "fuse_max_seq_len", "modules_to_fuse",
          "exllama_config",
          # what transformers 5's AwqConfig (a GPTQConfig) writes on save_pretrained: its calibration
          # settings, and `format` for `version`; none changes how the gemm codes are stored
          "format", "damp_percent", "act_group_aware", "sym", "true_sequential", "batch_size",
          "cache_block_outputs"}


class AWQReader:
    method = METHOD

    def __init__(self, qc: dict[str, Any], st):
        for key, value in qc.items():
            if key not in _INERT and value not in (None, False, {}, [], ""):
                raise refuse(METHOD, key, value, "a field jaxinfer does not know")
        if "format" in qc and "version" in qc and str(qc["format"]).lower() != str(qc["version"]).lower():
            raise refuse(METHOD, "format", qc["format"], f"it disagrees with version {qc['version']!r}")
        version = str(qc.get("version", qc.get("format", "gemm"))).lower()
        if version != "gemm":
            raise refuse(METHOD, "version", qc.get("version"), "jaxinfer loads AutoAWQ's 'gemm' layout only "
                         "(gemv, gemv_fast, marlin, exllama and ipex pack the codes differently)")
        self.bits = qc.get("bits", qc.get("w_bit", 4))
        if self.bits != 4:
            raise refuse(METHOD, "bits", self.bits, "AWQ gemm checkpoints load at 4 bits")
        if qc.get("zero_point", True) is not True:
            raise refuse(METHOD, "zero_point", qc.get("zero_point"), "the gemm layout stores zero points")
        g = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(g, int) or not (g == -1 or (g > 0 and g % 2 == 0)):
            raise refuse(METHOD, "group_size", g, "-1 or a positive even group size")
        self.group_size = g
        self.skip = list(qc.get("modules_to_not_convert") or [])
        self.st = st

    def quantized(self, module: str) -> bool:
        return self.st.has(f"{module}.qweight") and not any(s in module for s in self.skip)

    def linear(self, module: str) -> QuantizedWeight:
        get = self.st.get
        scales = np.asarray(get(f"{module}.scales"), np.float32)
        groups, out = scales.shape
        qweight = get(f"{module}.qweight")
        inp = qweight.shape[0]
        g = inp if self.group_size == -1 else self.group_size
        if out % 8 or inp % g or groups != inp // g:
            raise QuantConfigError(f"tensor {module}.scales has shape {scales.shape}; expected "
                                   f"({max(1, inp // g)}, out_features) with out_features a multiple of 8 for "
                                   f"in_features {inp} and group_size {self.group_size}")
        for name, want in (("qweight", (inp, out // 8)), ("qzeros", (groups, out // 8))):
            t = get(f"{module}.{name}")
            if t.shape != want or t.dtype != np.int32:
                raise QuantConfigError(f"tensor {module}.{name} has shape {t.shape} {t.dtype}; expected int32 {want} "
                                       f"for bits 4, group_size {self.group_size}, in_features {inp}, "
                                       f"out_features {out}")
        return int_weight(_deinterleave(unpack_rows(qweight, 4, axis=1)), scales,
                          _deinterleave(unpack_rows(get(f"{module}.qzeros"), 4, axis=1)), 4, g)


def _deinterleave(nibbles: np.ndarray) -> np.ndarray:
    """[R, out] codes in packing order (nibble i of word c at c * 8 + i) -> columns in order."""
    r, n = nibbles.shape
    out = np.empty_like(nibbles)
    order = np.asarray(AWQ_ORDER)
    out.reshape(r, n // 8, 8)[:, :, order] = nibbles.reshape(r, n // 8, 8)
    return out
