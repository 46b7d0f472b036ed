"""compressed-tensors checkpoints (llm-compressor's output; quant_method "compressed-tensors").

The layouts, as compressed_tensors 0.20 writes them (compressors/pack_quantized, naive_quantized;
quantization/quant_scheme.py for the presets):
* pack-quantized (W4A16, W8A16): `weight_packed` int32 [out, ceil(in * b / 32)], the signed codes
  c in [-2^(b-1), 2^(b-1)) offset by 2^(b-1) and packed densely along `in` (code j of a word at bits
  j*b); `weight_scale` [out, in / g] (group) or [out, 1] (channel); asymmetric: `weight_zero_point`
  [ceil(out * b / 32), in / g] packed the same way along `out`, also offset; `weight_shape` [out, in].
  w = (c - zp) * scale. b = 4 -> jaxinfer int4 (codes c symmetric, or c + 8 with zeros zp + 8);
  b = 8 symmetric -> jaxinfer int8 per channel, or grouped int8 (quant/format.py) with groups.
* int-quantized (W8A8 and int8 weight-only): `weight` int8 [out, in], `weight_scale` [out, 1]
  (channel) or [1] (tensor): jaxinfer int8, with act_bits=8 when the activations are quantized to
  int8 per token, dynamically (jaxinfer's W8A8: the same rounding, sx = max|x_t| / 127), or with one
  static scale (`input_scale`, symmetric).
* float-quantized (FP8, FP8_DYNAMIC): `weight` float8_e4m3fn [out, in], `weight_scale` [out, 1] or [1]:
  jaxinfer fp8 (codes [N, K], layout "nk": the stored layout). Activations (e4m3 per token dynamic or
  per tensor static in the checkpoint) are quantized the way jaxinfer's fp8 path does it: per token,
  dynamic, on the GPU path; not at all on the XLA (CPU) path.
`ignore` (usually lm_head) and each group's `targets` ("Linear", exact module names, "re:" regexes,
re.match as compressed_tensors.utils.match does) choose the modules. Anything else is refused
naming the field: other formats, bit widths, strategies (block, tensor_group, token weights),
asymmetric int8, activation orders that store g_idx, output or KV-cache quantization,
sparsity and transforms.
"""
from __future__ import annotations

import re
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxinfer.prequant.common import QuantConfigError, int_weight, refuse, unpack_rows
from jaxinfer.quant import QuantizedWeight

METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
# top-level fields that describe, and do not change, the stored tensors
_INERT = {"quant_method", "version", "global_compression_ratio", "format", "config_groups", "ignore",
          "quantization_status", "provider"}
_EMPTY_OK = ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config")
_WEIGHT_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}


def _get(args: dict, key: str, default=None):
    v = args.get(key, default)
    return default if v is None else v


class _Scheme:
    """One config group: its targets, weight arguments, activation handling and format."""

    def __init__(self, name: str, group: dict, default_format: str | None):
        f = f"config_groups.{name}"
        self.targets = list(group.get("targets") or [])
        self.format = group.get("format") or default_format
        if self.format not in FORMATS:
            raise refuse(METHOD, f"{f}.format" if group.get("format") else "format", self.format,
                         f"jaxinfer loads the formats {list(FORMATS)}")
        if group.get("output_activations"):
            raise refuse(METHOD, f"{f}.output_activations", group["output_activations"],
                         "output quantization is not implemented")
        w = group.get("weights")
        if not w:
            raise refuse(METHOD, f"{f}.weights", w, "a group without weight quantization")
        for key in w:
            if key not in _WEIGHT_KEYS and w[key] not in (None, False, {}, []):
                raise refuse(METHOD, f"{f}.weights.{key}", w[key], "an argument jaxinfer does not know")
        self.bits, self.type = int(_get(w, "num_bits", 8)), _get(w, "type", "int")
        self.symmetric, self.strategy = bool(_get(w, "symmetric", True)), _get(w, "strategy", "tensor")
        self.group_size = w.get("group_size")
        if _get(w, "dynamic", False):
            raise refuse(METHOD, f"{f}.weights.dynamic", w["dynamic"], "weights quantized at run time")
        if _get(w, "actorder", None) == "group":
            raise refuse(METHOD, f"{f}.weights.actorder", "group",
                         "activation-ordered groups (weight_g_idx) are not implemented for compressed-tensors")
        wants = {"pack-quantized": ("int", (4, 8), ("group", "channel")),
                 "int-quantized": ("int", (8,), ("channel", "tensor")),
                 "naive-quantized": ("int", (8,), ("channel", "tensor")),
                 "float-quantized": ("float", (8,), ("channel", "tensor"))}[self.format]
        if self.type != wants[0]:
            raise refuse(METHOD, f"{f}.weights.type", self.type, f"{self.format} loads {wants[0]} weights")
        if self.bits not in wants[1]:
            raise refuse(METHOD, f"{f}.weights.num_bits", self.bits,
                         f"{self.format} {self.type} weights load with num_bits {list(wants[1])}")
        if self.strategy not in wants[2]:
            raise refuse(METHOD, f"{f}.weights.strategy", self.strategy,
                         f"{self.format} weights load with strategy {list(wants[2])}")
        if self.bits == 8 and not self.symmetric:
            raise refuse(METHOD, f"{f}.weights.symmetric", False, "8-bit weights load symmetric only")
        if self.strategy == "group" and not (isinstance(self.group_size, int) and self.group_size > 0
                                             and self.group_size % 2 == 0):
            raise refuse(METHOD, f"{f}.weights.group_size", self.group_size, "a positive even group size")
        self.act = self._activations(f, group.get("input_activations"))

    def _activations(self, f: str, a: dict | None) -> str | None:
        """None (weight-only), "int8_dynamic", "int8_static" or "fp8" (module docstring)."""
        if not a:
            return None
        field = f"{f}.input_activations"
        bits, typ = int(_get(a, "num_bits", 8)), _get(a, "type", "int")
        strategy, dynamic, sym = _get(a, "strategy", "tensor"), bool(_get(a, "dynamic", False)), _get(a, "symmetric", True)
        if self.format == "pack-quantized":
            raise refuse(METHOD, field, a, "pack-quantized weights load weight-only (W4A16, W8A16)")
        if bits != 8 or typ != ("float" if self.format == "float-quantized" else "int"):
            raise refuse(METHOD, f"{field}.type", f"{typ}{bits}",
                         f"{self.format} weights load with 8-bit {'float' if self.type == 'float' else 'int'} "
                         "activations")
        if not sym:
            raise refuse(METHOD, f"{field}.symmetric", False, "asymmetric activations are not implemented")
        if (strategy, dynamic) == ("token", True):
            return "fp8" if typ == "float" else "int8_dynamic"
        if (strategy, dynamic) == ("tensor", False):
            return "fp8" if typ == "float" else "int8_static"
        if typ == "float" and strategy == "tensor" and dynamic is True:
            return "fp8"
        raise refuse(METHOD, f"{field}.strategy", f"{strategy} (dynamic={dynamic})",
                     "activations load per token dynamic or per tensor static")


def _match(module: str, target: str) -> bool:
    """compressed_tensors.utils.match: "re:" + a regex (re.match), a class name ("Linear": every
    linear layer hf_maps reads), or the exact module name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or target == module


class CompressedTensorsReader:
    method = METHOD

    def __init__(self, qc: dict[str, Any], st):
        for key, value in qc.items():
            if key in _EMPTY_OK:
                if value not in (None, {}, []):
                    raise refuse(METHOD, key, value, "jaxinfer loads quantized weights only (no KV-cache "
                                 "quantization, sparsity or transforms)")
            elif key not in _INERT:
                raise refuse(METHOD, key, value, "a field jaxinfer does not know")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise refuse(METHOD, "quantization_status", status, "only compressed checkpoints load")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise refuse(METHOD, "config_groups", groups, "no quantization scheme")
        self.schemes = [_Scheme(name, g, qc.get("format")) for name, g in groups.items()]
        # compressed-tensors' precedence where targets overlap (utils.match.match_targets, then the
        # first target's scheme): exact module names, then regexes, each in string order, then the
        # class "Linear"; a target named by two groups is the later group's
        self.by_target = {t: s for s in self.schemes for t in s.targets}
        self.name_targets = sorted((t for t in self.by_target if t != "Linear"), key=lambda t: ("re:" in t, t))
        self.ignore = list(qc.get("ignore") or [])
        self.st = st

    def scheme(self, module: str) -> _Scheme | None:
        if any(_match(module, t) for t in self.ignore):
            return None
        target = next((t for t in self.name_targets if _match(module, t)), None)
        return self.by_target[target] if target is not None else self.by_target.get("Linear")

    def quantized(self, module: str) -> bool:
        """The module's weight is stored quantized (checked against the scheme in linear())."""
        if self.st.has(f"{module}.weight_packed") or self.st.has(f"{module}.weight_scale"):
            return True
        if self.scheme(module) is not None and self.st.has(f"{module}.weight"):
            return self.st.dtype(f"{module}.weight") in (np.int8, ml_dtypes.float8_e4m3fn)
        return False

    def linear(self, module: str) -> QuantizedWeight:
        """The module's weight as a [in, out] QuantizedWeight (module docstring)."""
        s = self.scheme(module)
        if s is None:
            raise QuantConfigError(f"tensor {module!r} is stored quantized but no config_groups target "
                                   "matches it (or it is in ignore)")
        if self.st.has(f"{module}.weight_g_idx"):
            raise QuantConfigError(f"tensor {module}.weight_g_idx: activation-ordered groups are not "
                                   "implemented for compressed-tensors")
        get = self.st.get
        if s.format == "pack-quantized":
            out, inp = (int(v) for v in np.asarray(get(f"{module}.weight_shape")).reshape(-1))
            packed = get(f"{module}.weight_packed")
            want = (out, -(-inp * s.bits // 32))
            if packed.shape != want or packed.dtype != np.int32:
                raise QuantConfigError(f"tensor {module}.weight_packed has shape {packed.shape} {packed.dtype}; "
                                       f"expected int32 {want} for weight_shape [{out}, {inp}] at {s.bits} bits")
            if inp * s.bits % 32:
                raise QuantConfigError(f"tensor {module}.weight_packed: in_features {inp} does not fill whole "
                                       f"int32 words at {s.bits} bits")
            half = 1 << (s.bits - 1)
            codes = unpack_rows(packed, s.bits, axis=1).T - half               # [in, out] signed
            g = inp if s.strategy == "channel" else s.group_size
            if inp % g:
                raise QuantConfigError(f"tensor {module}.weight_packed: in_features {inp} is not a multiple "
                                       f"of group_size {g}")
            scales = self._scales(module, (out, inp // g)).T                   # [in/g, out]
            zeros = None
            if not s.symmetric:
                zp = get(f"{module}.weight_zero_point")
                zwant = (-(-out * s.bits // 32), inp // g)
                if zp.shape != zwant:
                    raise QuantConfigError(f"tensor {module}.weight_zero_point has shape {zp.shape}; "
                                           f"expected {zwant}")
                zeros = (unpack_rows(zp, s.bits, axis=0)[:out] - half).T + half    # [in/g, out] in [0, 2^b)
                codes = codes + half
            return int_weight(codes, scales, zeros, s.bits, g)
        w = get(f"{module}.weight")
        want_dtype = np.int8 if s.format != "float-quantized" else ml_dtypes.float8_e4m3fn
        if w.dtype != want_dtype or w.ndim != 2:
            raise QuantConfigError(f"tensor {module}.weight is {w.dtype} {w.shape}; {s.format} stores "
                                   f"{np.dtype(want_dtype).name} [out, in]")
        out, inp = w.shape
        scale = self._scales(module, (out, 1) if s.strategy == "channel" else (1,)).reshape(-1)
        scale = np.broadcast_to(scale, (out,)).astype(np.float32)
        if s.format == "float-quantized":     # codes [N, K] = [out, in]: jaxinfer's fp8 layout "nk"
            return QuantizedWeight(jnp.asarray(np.ascontiguousarray(w)), jnp.asarray(scale), None, bits=8,
                                   group_size=None, shape=(inp, out), layout="nk")
        act_scale = None
        if s.act == "int8_static":
            act_scale = jnp.asarray(np.asarray(get(f"{module}.input_scale"), np.float32).reshape(()))
        return QuantizedWeight(jnp.asarray(np.ascontiguousarray(w.T)), jnp.asarray(scale), None, bits=8,
                               group_size=None, shape=(inp, out),
                               act_bits=8 if s.act in ("int8_dynamic", "int8_static") else None,
                               act_scale=act_scale)

    def _scales(self, module: str, want: tuple[int, ...]) -> np.ndarray:
        sc = self.st.get(f"{module}.weight_scale")
        if sc.size != int(np.prod(want)) or (len(want) == 2 and sc.shape != want):
            raise QuantConfigError(f"tensor {module}.weight_scale has shape {sc.shape}; expected {want}")
        return np.asarray(sc, np.float32).reshape(want)
