"""Checkpoints published already quantized: config.json's `quantization_config` read, each format's
tensors mapped onto jaxinfer's QuantizedWeight (quant/format.py) and kept packed.

    reader = reader_for(raw_config, st)          # None without a quantization_config
    value = load_param(reader, ours, hf_names, transform, expected)   # a QuantizedWeight, an array, or None

Every quantization_config is either fully understood or refused at load, the message naming the
method and the field (a compressed-tensors W8A8 folder once loaded silently, its int8 codes read as
numbers). The formats (each module's docstring gives its layout and the producer it follows):
* compressed_tensors.py  quant_method "compressed-tensors": pack-quantized W4A16 / W8A16,
                         int-quantized W8A8 / int8, float-quantized FP8.
* gptq.py                quant_method "gptq" (checkpoint_format gptq / gptq_v2), bits 4 and 8.
* awq.py                 quant_method "awq", version gemm.
* fp8_block.py           quant_method "fp8" (fine-grained: weight_block_size, weight_scale_inv).
* mxfp4.py               quant_method "mxfp4": gpt-oss's experts.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jaxinfer.models.hf_configs import quantization_config
from jaxinfer.prequant.common import QuantConfigError, as_float, place, refuse

__all__ = ["QuantConfigError", "reader_for", "load_param", "SUPPORTED_METHODS"]

SUPPORTED_METHODS = ("compressed-tensors", "gptq", "awq", "fp8", "mxfp4")
# the decoder's matmul weights (models/decoder.py CONTRACTED_DIMS): these stay packed
_CONTRACT = {"q": 1, "k": 1, "v": 1, "o": 2, "up": 1, "gate": 1, "down": 1, "out_gate": 1, "in_proj": 1, "out_proj": 1,
             "in_proj_qkv": 1, "in_proj_z": 1}


def reader_for(raw: dict[str, Any], st) -> Any | None:
    """The reader for config.json's quantization_config (None when it has none); refuses, naming
    the method and the field, every configuration it does not fully understand."""
    qc = quantization_config(raw)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantConfigError(f"config.json quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        from jaxinfer.prequant.compressed_tensors import CompressedTensorsReader
        return CompressedTensorsReader(qc, st)
    if method == "gptq":
        from jaxinfer.prequant.gptq import GPTQReader
        return GPTQReader(qc, st)
    if method == "fp8":
        from jaxinfer.prequant.fp8_block import FineGrainedFP8Reader
        return FineGrainedFP8Reader(qc, st)
    if method == "mxfp4":
        from jaxinfer.prequant.mxfp4 import MXFP4Reader
        return MXFP4Reader(qc, st)
    if method == "awq":
        from jaxinfer.prequant.awq import AWQReader
        return AWQReader(qc, st)
    raise refuse(method, "quant_method", method, f"jaxinfer loads the methods {list(SUPPORTED_METHODS)}")


def _module(hf_name: str) -> str | None:
    return hf_name[:-len(".weight")] if hf_name.endswith(".weight") else None


def load_param(reader, ours: str, hf_names: tuple[str, ...], transform: Callable,
               expected: tuple[int, ...]) -> Any | None:
    """Parameter `ours` from a quantized checkpoint: a QuantizedWeight for a matmul weight whose
    module the checkpoint stores quantized, the dequantized float array for any other parameter
    made from a quantized module (an lm_head not in the ignore list), None when no quantized
    module is involved (the caller reads the float tensors)."""
    stacked = getattr(reader, "stacked_param", None)   # a format that quantizes stacked experts
    if stacked is not None:
        value = stacked(ours, hf_names, transform, expected)
        if value is not None:
            return value
    modules = [_module(n) for n in hf_names]
    quantized = [m is not None and reader.quantized(m) for m in modules]
    if not any(quantized):
        return None
    if (len(hf_names) > 1 and reader.method == "fp8" and not reader.per_tensor and all(quantized)
            and _stacks_experts(transform)):
        return _stacked_experts([reader.linear(m) for m in modules], ours, expected)
    if len(hf_names) != 1:
        raise QuantConfigError(f"tensors {list(hf_names)} make parameter {ours} (one tensor per expert "
                               f"or a fused tensor); quantized, they are supported only in fine-grained fp8 "
                               f"checkpoints, every expert quantized (this is {reader.method}"
                               f"{' per tensor' if getattr(reader, 'per_tensor', False) else ''})")
    qw = reader.linear(modules[0])
    name = ours.rsplit("/", 1)[-1]
    if name in _CONTRACT:
        return place(qw, transform, expected, _CONTRACT[name], f"tensor {modules[0]!r} for {ours}")
    value = np.asarray(transform(as_float(qw)))
    if value.shape != tuple(expected):
        raise QuantConfigError(f"tensor {modules[0]!r} dequantizes to {as_float(qw).shape}, which does not "
                               f"give {ours} of shape {expected}")
    return value


def _stacks_experts(transform) -> bool:
    """The transform stacks one torch Linear per expert (hf_maps._stack_t)."""
    from jaxinfer.models.hf_maps import _stack_t
    return transform is _stack_t


def _stacked_experts(qws: list, ours: str, expected: tuple[int, ...]):
    """Per-expert [K, N] QuantizedWeights (fine-grained FP8: e4m3 codes, a scale per block) as one
    stacked [E, K, N] (quant.quantize_experts' layout, batch 1: moe.py takes expert e's as they are)."""
    import dataclasses

    import jax.numpy as jnp
    first = qws[0]
    if any(q.shape != first.shape or q.group_size != first.group_size for q in qws):
        raise QuantConfigError(f"the experts of {ours} are quantized in different shapes or blocks")
    shape = (len(qws), *first.shape)
    if shape != tuple(expected):
        raise QuantConfigError(f"the experts of {ours} stack to {shape}; expected {tuple(expected)}")
    return dataclasses.replace(first, q=jnp.stack([q.q for q in qws]), scales=jnp.stack([q.scales for q in qws]),
                               zeros=None, shape=shape, batch=1)
