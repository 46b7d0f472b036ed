"""Weight-only (and W8A8) quantization, in three parts:

* format.py      the QuantizedWeight pytree (int8 / int4 / int3 / fp8 codes, scales, zero points),
                 the load-time quantizers, dequantize and the error bounds the tests use;
* dispatch.py    qdot: x @ QuantizedWeight on the Pallas kernels or in XLA, the implementation
                 chosen by the caller ("pallas" | "xla" | "auto"), the launch config autotuned;
* candidates.py  the launch configs the autotuner measures, built from the per-device tables of
                 untuned defaults in pallas_kernels/quant_matmul_tuned.py.

Every name of the former jaxinfer/quant.py is importable from here.
"""
from __future__ import annotations

from jaxinfer.quant.candidates import (SPLITK_DEFAULT_MAX_M, SPLITK_TARGET_PROGRAMS, XLA_MATMUL, matmul_class,
                                       pallas_block_candidates, splitk_candidates)
from jaxinfer.quant.dispatch import (dot_precision, fp8_native_matmul, qdot, quantize_rows_int8, select_blocks,
                                     tuning_key)
from jaxinfer.quant.format import (FP8_DTYPE, FP8_MAX, QuantizedWeight, dequantize, elementwise_error_bound,
                                   expert_weight, from_codes, grid_codes, grid_dequant, grid_params,
                                   matmul_error_bound, pack_int3, quantize, quantize_experts, quantize_fp8,
                                   quantize_int4, quantize_int8, symmetric_codes, unpack_int3)
from pallas_kernels.quant_matmul import (REDUCE_MAX_M, SPLITK_INNER, SPLITK_MAX_M, default_block_m,
                                         dequantize_weight, pack_int4, quant_matmul, quant_matmul_splitk,
                                         splitk_rows, unpack_int4, w8a8_matmul)

__all__ = [
    "QuantizedWeight", "quantize", "quantize_int8", "quantize_int4", "quantize_fp8", "quantize_experts",
    "expert_weight", "dequantize", "qdot", "pack_int4", "unpack_int4", "pack_int3", "unpack_int3",
    "grid_params", "grid_codes", "grid_dequant", "from_codes", "elementwise_error_bound",
    "matmul_error_bound", "pallas_block_candidates", "splitk_candidates", "select_blocks", "XLA_MATMUL",
    "FP8_DTYPE", "FP8_MAX", "symmetric_codes", "dot_precision", "quantize_rows_int8", "fp8_native_matmul",
    "matmul_class", "SPLITK_TARGET_PROGRAMS", "SPLITK_DEFAULT_MAX_M", "tuning_key",
    # the kernels' names, as the former jaxinfer/quant.py re-exported them
    "REDUCE_MAX_M", "SPLITK_INNER", "SPLITK_MAX_M", "default_block_m", "dequantize_weight", "quant_matmul",
    "quant_matmul_splitk", "splitk_rows", "w8a8_matmul",
]
