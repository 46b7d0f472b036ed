"""Checkpoints in and out: HF safetensors folders -> Decoder, and the native format (orbax).

HF folders: config.json + model.safetensors, or sharded model-0000x-of-0000y.safetensors with
model.safetensors.index.json. Tensors are read one at a time through a memory map
(jaxinfer/safetensors_file.py parses each header, so that bfloat16 maps to numpy via ml_dtypes and a
damaged file is reported by file and tensor name), transformed into our layout, shape-checked, cast.

Native folders: config.json ({"format": "jaxinfer", "model": ModelConfig, "dtype"}),
params/ (an orbax-checkpoint of the parameter tree), and the tokenizer files. A quantized weight
(jaxinfer.quant.QuantizedWeight) is stored as its arrays NAME/q, NAME/scales[, NAME/zeros]
[, NAME/act_scale[, NAME/act_zero]][, NAME/perm] and described in config.json under "quantized_weights" (bits,
group_size, shape, contract, symmetric, act_bits, format: int | fp8_e4m3, act_scales: dynamic |
static, act_symmetric, batch: 1 for a mixture's stacked experts, whose every array leads with E,
layout: "nk" for fp8 codes stored [N, K], "kn" (or absent, in older folders) for [K, N]);
`jaxinfer quantize` adds the method and its settings under "quantization".
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ConfigError, ModelConfig, resolve_dtype_name
from jaxinfer.models.hf_configs import model_config_from_hf
from jaxinfer.models.decoder import Decoder, abstract_decoder, unfuse_decoder
from jaxinfer.models.hf_maps import LANGUAGE_MODEL_PREFIXES, OPTIONAL_PREFIXES, hf_weight_map
from jaxinfer.errors import CheckpointError  # noqa: F401  (raised here; defined jax-free for jaxinfer.hub)
from jaxinfer.safetensors_file import SafetensorsFile
from jaxinfer.quant import QuantizedWeight

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def stored_name(name: str, present) -> str | None:
    """`name`, or `name` without one of OPTIONAL_PREFIXES (a bare model's, e.g. an embedding model's
    "layers.0..." for "model.layers.0..."), or under a vision-language checkpoint's language model
    (LANGUAGE_MODEL_PREFIXES), whichever `present` holds; None if none."""
    for candidate in (name, *(name[len(p):] for p in OPTIONAL_PREFIXES if name.startswith(p)),
                      *(theirs + name[len(ours):] for ours, theirs in LANGUAGE_MODEL_PREFIXES if name.startswith(ours))):
        if candidate in present:
            return candidate
    return None


class SafetensorsFolder:
    """All tensors of an HF checkpoint folder, sharded or not, by name."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(p.name for p in folder.glob("*.safetensors"))
        if not names:
            raise CheckpointError(f"{folder}: no *.safetensors files (and no model.safetensors.index.json)")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}
        for n in names:
            p = folder / n
            if not p.exists():
                raise CheckpointError(f"{p}: listed in {index.name} but missing" if index.exists()
                                      else f"{p}: missing")
            f = self.files[n] = SafetensorsFile(p)
            for t in f.tensors:
                self.where[t] = f

    def stored(self, name: str) -> str | None:
        """The name a tensor has in these files (stored_name). Every reader looks tensors up through
        here, the quantized formats' too."""
        return stored_name(name, self.where)

    def has(self, name: str) -> bool:
        return self.stored(name) is not None

    def dtype(self, name: str) -> np.dtype:
        """The stored dtype of a tensor that exists (numpy's or ml_dtypes': int8, float8_e4m3fn, ...)."""
        stored = self.stored(name)
        return self.where[stored].tensors[stored][0]

    def get(self, name: str) -> np.ndarray:
        stored = self.stored(name)
        if stored is None:
            raise CheckpointError(f"tensor {name!r} not found in {sorted(self.files)} "
                                  f"({len(self.where)} tensors present)")
        return self.where[stored].get(stored)

    def source(self, name: str) -> str:
        stored = self.stored(name)
        return str(self.where[stored].path) if stored is not None else "?"


def _set_params(model: Decoder, arrays: dict[str, jax.Array]) -> Decoder:
    """Put a flat {'layers/0/attn/q': array} dict into an (abstract) Decoder."""
    graphdef, state = nnx.split(model)
    flat = state.flat_state()
    missing = [p for p, _ in flat if "/".join(map(str, p)) not in arrays]
    assert not missing, f"parameters not provided: {missing[:5]}"
    for path, var in flat:
        var.set_value(arrays["/".join(map(str, path))])
    return nnx.merge(graphdef, nnx.State.from_flat_path(flat))


def tensor_source(folder: Path):
    """The tensors of an HF folder by name: its safetensors, or the GGUF file a folder prepared by
    jaxinfer.gguf_file describes (dequantized to float32)."""
    from jaxinfer.gguf_file import GGUFTensors, gguf_source
    gguf_path = gguf_source(folder)
    if gguf_path is None:
        return SafetensorsFolder(folder)
    return GGUFTensors(gguf_path, json.loads((folder / "config.json").read_text()))


def hf_value(st: SafetensorsFolder, ours: str, hf_names: tuple[str, ...], transform,
             expected: tuple[int, ...]) -> np.ndarray:
    """Parameter `ours` in our layout from its HF tensors (memmap views where the transform allows),
    shape-checked against `expected`."""
    tensors = [st.get(n) for n in hf_names]
    for n, t in zip(hf_names, tensors):   # a float parameter never comes from quantized codes
        if t.dtype.kind in "iub" or t.dtype.itemsize == 1:
            raise CheckpointError(
                f"{st.source(n)}: tensor {n!r} stores {t.dtype} values, not floats: quantized codes whose "
                f"scheme config.json does not describe (quantization_config) or jaxinfer does not read")
    try:
        value = np.asarray(transform(*tensors))
    except ValueError as e:  # a reshape that does not fit: the tensor has the wrong shape
        raise CheckpointError(
            f"{st.source(hf_names[0])}: tensor {hf_names[0]!r} has shape {tensors[0].shape}, "
            f"which does not fit parameter {ours} of shape {expected} ({e})") from None
    if value.shape != expected:
        raise CheckpointError(
            f"{st.source(hf_names[0])}: tensor {hf_names[0]!r} has shape {tensors[0].shape}; "
            f"expected a tensor giving {ours} of shape {expected} for this config.json")
    return value


def load_hf(folder: str | Path, dtype: str = "float32", cfg: ModelConfig | None = None,
            mesh=None, rules=None, gguf_blocks: bool = True, tensors=None) -> Decoder:
    """Load an HF safetensors folder into a Decoder in `dtype`, checking every shape. With a mesh,
    each parameter is read from the memmap shard by shard straight onto its devices
    (sharding.load_sharded; rules default to sharding.rules_for(cfg, mesh)). gguf_blocks: a GGUF
    file's exact blocks stay packed (jaxinfer/prequant/gguf_blocks.py); False: every weight a float
    (to quantize it all again with quantize=). tensors: read the weights from this source (the
    interface of SafetensorsFolder: weight_update.DictTensors) instead of the folder's files, which
    then gives config.json only."""
    folder = Path(folder)
    cfg = cfg or model_config_from_hf(folder)
    st = tensor_source(folder) if tensors is None else tensors
    jdtype = DTYPES[dtype]
    model = abstract_decoder(cfg, jdtype)
    flat = nnx.state(model, nnx.Param).flat_state()
    expected = {"/".join(map(str, p)): tuple(v.get_value().shape) for p, v in flat}
    keep32 = _always_float32(cfg)
    dtypes = {name: jnp.float32 if name in keep32 else jdtype for name in expected}
    if mesh is not None:
        from jaxinfer.sharding import load_sharded, param_sharding, rules_for
        rules = rules if rules is not None else rules_for(cfg, mesh)
        shardings = {"/".join(map(str, p)): param_sharding(v.get_metadata().get("logical_axes"), rules, mesh,
                                                           tuple(v.get_value().shape)) for p, v in flat}
    arrays: dict[str, jax.Array] = {}
    reader = _prequant_reader(folder, st, gguf_blocks)
    for ours, (hf_names, transform) in hf_weight_map(cfg, st.has).items():
        if reader is not None:   # a pre-quantized checkpoint (jaxinfer/prequant): packed weights stay packed
            value = _prequant_param(folder, reader, ours, hf_names, transform, expected[ours])
            if isinstance(value, QuantizedWeight):
                arrays[ours] = value
                continue
        if reader is None or value is None:
            value = hf_value(st, ours, hf_names, transform, expected[ours])
        if mesh is None:
            arrays[ours] = jnp.asarray(value.astype(np.float32) if value.dtype != np.float32 else value,
                                       dtype=dtypes[ours])
        else:   # value is (a view of) the memmap: each device's callback reads only its slice
            arrays[ours] = load_sharded(lambda idx, v=value: v[idx].astype(np.float32), expected[ours],
                                        shardings[ours], dtype=dtypes[ours])
    return _set_params(model, arrays)


def _prequant_reader(folder: Path, st: SafetensorsFolder, gguf_blocks: bool = True):
    """jaxinfer.prequant's reader for config.json's quantization_config (None without one); a
    configuration it does not fully understand is refused here, before any tensor is read."""
    from jaxinfer.gguf_file import GGUFTensors
    from jaxinfer.prequant import QuantConfigError, reader_for
    if isinstance(st, GGUFTensors):   # llama.cpp's blocks that are jaxinfer formats stay packed
        from jaxinfer.prequant.gguf_blocks import GGUFBlockReader
        return GGUFBlockReader(st) if gguf_blocks else None
    raw = json.loads((folder / "config.json").read_text())
    try:
        return reader_for(raw, st)
    except QuantConfigError as e:
        raise CheckpointError(f"{folder}: {e}") from None


def _prequant_param(folder: Path, reader, ours: str, hf_names, transform, expected):
    from jaxinfer.prequant import QuantConfigError, load_param
    try:
        return load_param(reader, ours, hf_names, transform, expected)
    except QuantConfigError as e:
        raise CheckpointError(f"{folder}: {e}") from None


# ------------------------------------------------------------------------------- native format

NATIVE_FORMAT = "jaxinfer"


def is_native(folder: str | Path) -> bool:
    cfg = Path(folder) / "config.json"
    try:
        return json.loads(cfg.read_text()).get("format") == NATIVE_FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def save_native(model: Decoder, out_dir: str | Path, dtype: str, tokenizer=None,
                extra: dict[str, Any] | None = None) -> None:
    """Write config.json + params/ (orbax) + tokenizer files into out_dir. A fused model
    (models.decoder.fuse_decoder) is written unfused: the format has one tensor per projection."""
    import orbax.checkpoint as ocp

    model = unfuse_decoder(model)
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    jdtype = DTYPES[dtype]
    params, quantized = {}, {}
    keep32 = _always_float32(model.cfg)
    for p, v in nnx.state(model, nnx.Param).flat_state():
        name, value = "/".join(map(str, p)), v.get_value()
        if isinstance(value, QuantizedWeight):   # stored as name/q, name/scales[, name/zeros] as they are
            quantized[name] = _quantized_meta(value)
            params.update({f"{name}/{leaf}": getattr(value, leaf) for leaf in _QW_LEAVES
                           if getattr(value, leaf) is not None})
        else:   # a parameter the model keeps in float32 whatever its dtype (a sigmoid router) stays so
            params[name] = value if name in keep32 else value.astype(jdtype)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(out_dir / "params", params, force=True)
    ckptr.wait_until_finished()
    meta = {"format": NATIVE_FORMAT, "version": 1, "dtype": dtype, "model": model.cfg.to_dict(), **(extra or {})}
    if quantized:
        meta["quantized_weights"] = quantized
    (out_dir / "config.json").write_text(json.dumps(meta, indent=2))
    if tokenizer is not None:
        tokenizer.save(out_dir)


_QW_LEAVES = ("q", "scales", "zeros", "act_scale", "act_zero", "perm")


def _always_float32(cfg: ModelConfig) -> set[str]:
    """The parameters the model declares float32 whatever its dtype (a sigmoid router and its choice
    correction, as transformers keeps them)."""
    return {"/".join(map(str, p)) for p, v in nnx.state(abstract_decoder(cfg, jnp.bfloat16), nnx.Param).flat_state()
            if v.get_value().dtype == jnp.float32}


def _quantized_meta(qw: QuantizedWeight) -> dict[str, Any]:
    """What config.json records of a QuantizedWeight besides its arrays (leaf shapes follow from it)."""
    return {"bits": qw.bits, "group_size": qw.group_size, "shape": list(qw.shape), "contract": qw.contract,
            "symmetric": qw.symmetric, "act_bits": qw.act_bits,
            "format": "fp8_e4m3" if qw.fp8 else "mxfp4" if qw.mxfp4 else "int",
            "act_scales": None if qw.act_bits is None else ("static" if qw.act_scale is not None else "dynamic"),
            "act_symmetric": qw.act_zero is None, "batch": qw.batch, "layout": qw.layout,
            **({"perm": True} if qw.perm is not None else {}),
            **({"zeros": "float32"} if qw.float_zeros else {})}


def _quantized_leaves(m: dict[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """The stored arrays of a quantized weight described by _quantized_meta (jaxinfer/quant/format.py)."""
    b = m.get("batch", 0)
    if b:   # stacked experts: each expert's arrays, with a leading E axis
        one = _quantized_leaves({**m, "shape": m["shape"][b:], "batch": 0})
        return {k: jax.ShapeDtypeStruct((*m["shape"][:b], *v.shape), v.dtype) for k, v in one.items()}
    k, n = math.prod(m["shape"][:m["contract"]]), math.prod(m["shape"][m["contract"]:])
    if m.get("perm"):     # rows stored in a permuted order (quant/format.py)
        return {**_quantized_leaves({**m, "perm": False}), "perm": jax.ShapeDtypeStruct((k,), jnp.int32)}
    bits, g = m["bits"], m["group_size"]
    if bits == 8:
        q = jnp.float8_e4m3fn if m.get("format") == "fp8_e4m3" else jnp.int8
        nk = m.get("layout", "kn") == "nk"        # fp8 codes stored [N, K] (quant.quantize_fp8)
        out = {"q": jax.ShapeDtypeStruct((n, k) if nk else (k, n), q),
               "scales": jax.ShapeDtypeStruct((n,) if g is None else (k // g, n), jnp.float32)}
        if g is not None and not m["symmetric"]:     # grouped int8 with zero points (quant/format.py)
            out["zeros"] = jax.ShapeDtypeStruct((k // g, n), _zeros_dtype(m, jnp.int8))
        if m.get("act_scales") == "static":
            out["act_scale"] = jax.ShapeDtypeStruct((), jnp.float32)
            if not m.get("act_symmetric", True):
                out["act_zero"] = jax.ShapeDtypeStruct((), jnp.int32)
        return out
    out = {"q": jax.ShapeDtypeStruct((k * bits // 8, n), jnp.uint8),
           "scales": jax.ShapeDtypeStruct((k // g, n), jnp.uint8 if m.get("format") == "mxfp4" else jnp.float32)}
    if not m["symmetric"]:
        out["zeros"] = jax.ShapeDtypeStruct((k // g, n), _zeros_dtype(m, jnp.uint8))
    return out


def _zeros_dtype(m: dict[str, Any], integer):
    """The stored zero points' dtype: float32 where config.json says so (GGUF's Q4_K / Q5_K / Q2_K), else the
    format's integer one."""
    return jnp.float32 if m.get("zeros") == "float32" else integer


def read_native_config(folder: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    path = Path(folder) / "config.json"
    meta = json.loads(path.read_text())
    try:
        return ModelConfig.from_dict(meta["model"]), meta
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{path}: invalid native config ({e})") from None


def load_native(folder: str | Path, dtype: str | None = None, mesh=None, rules=None) -> Decoder:
    import orbax.checkpoint as ocp

    folder = Path(folder).resolve()
    cfg, meta = read_native_config(folder)
    stored = DTYPES[meta.get("dtype", "float32")]
    target = abstract_decoder(cfg, stored)
    sharding = lambda v: None  # noqa: E731
    if mesh is not None:   # orbax restores each shard straight onto its device
        from jaxinfer.sharding import param_sharding, rules_for
        rules = rules if rules is not None else rules_for(cfg, mesh)
        sharding = lambda v: param_sharding(v.get_metadata().get("logical_axes"), rules, mesh,  # noqa: E731
                                            tuple(v.get_value().shape))
    # float32 where the model keeps a parameter in float32 whatever the weights' dtype (a sigmoid router
    # and its correction), else the stored dtype
    abstract = {"/".join(map(str, p)): jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype,
                                                            sharding=sharding(v))
                for p, v in nnx.state(target, nnx.Param).flat_state()}
    keep32 = _always_float32(cfg)
    quantized = meta.get("quantized_weights", {})
    replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    for name, m in quantized.items():   # QuantizedWeights are restored as stored (replicated on a mesh)
        if name not in abstract:
            raise CheckpointError(f"{folder / 'config.json'}: quantized weight {name!r} is not a parameter")
        del abstract[name]
        abstract.update({f"{name}/{leaf}": jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated)
                         for leaf, s in _quantized_leaves(m).items()})
    params_dir = folder / "params"
    if not params_dir.exists():
        raise CheckpointError(f"{params_dir}: missing (native checkpoint parameters)")
    try:
        restored = ocp.StandardCheckpointer().restore(params_dir, abstract)
    except Exception as e:  # orbax raises many types; the user needs the folder and the cause
        raise CheckpointError(_restore_error(params_dir, e)) from None
    jdtype = DTYPES[dtype] if dtype else stored
    arrays = {k: v if k in keep32 else v.astype(jdtype) for k, v in restored.items()
              if k.rsplit("/", 1)[0] not in quantized}
    for name, m in quantized.items():   # keys not read here (none written so far) are ignored
        arrays[name] = QuantizedWeight(restored[f"{name}/q"], restored[f"{name}/scales"],
                                       restored.get(f"{name}/zeros"), bits=m["bits"], group_size=m["group_size"],
                                       shape=tuple(m["shape"]), contract=m["contract"], act_bits=m.get("act_bits"),
                                       act_scale=restored.get(f"{name}/act_scale"),
                                       act_zero=restored.get(f"{name}/act_zero"), batch=m.get("batch", 0),
                                       layout=m.get("layout", "kn"), perm=restored.get(f"{name}/perm"))
    return _set_params(abstract_decoder(cfg, jdtype), arrays)


def _restore_error(params_dir: Path, e: Exception) -> str:
    """One line for an orbax/TensorStore failure, whose message can be a 60-line spec dump: the
    first sentence, and the tensor it names (the relative kvstore 'path' inside the dump)."""
    text = str(e)
    first = text.split(" See full TensorStore details")[0].splitlines()[0] if text else type(e).__name__
    tensors = [p.rstrip("/") for p in re.findall(r"'path': '([^']+)'", text) if not p.startswith("/")]
    where = f"tensor {tensors[-1]!r}" if tensors else "parameters"
    damaged = " (a file under it is damaged or truncated)" if tensors else ""
    return f"{params_dir}: cannot restore {where}{damaged}: {first[:300]}"


def resolve_dtype(dtype: str) -> str:
    """"auto" -> float32 on CPU (XLA:CPU runs bfloat16 matmuls about 2x slower than float32: the
    bundled model decodes at ~105 vs ~210 tok/s on one stream), bfloat16 on accelerators."""
    return resolve_dtype_name(dtype, jax.default_backend())


def load_model(path: str | Path, dtype: str = "float32", mesh=None, rules=None,
               cfg: ModelConfig | None = None, gguf_blocks: bool = True, tensors=None) -> tuple[Decoder, ModelConfig]:
    """An HF or native folder -> (Decoder, ModelConfig). Errors name the path at fault.
    mesh: place every parameter on it by sharding.rules_for (or `rules`) while loading.
    dtype: the compute/storage dtype of the float weights, or "auto" (resolve_dtype). cfg: an HF
    folder's ModelConfig when not config.json's own (an embedding model without an LM head).
    gguf_blocks, tensors: load_hf's (a native checkpoint takes no tensors)."""
    dtype = resolve_dtype(dtype)
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such model folder")
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path}: no config.json (expected an HF model folder or a jaxinfer checkpoint)")
    if is_native(path) and tensors is not None:
        raise CheckpointError(f"{path}: a jaxinfer checkpoint's weights are read from its own files, not from "
                              "named tensors")
    model = (load_native(path, dtype, mesh=mesh, rules=rules) if is_native(path)
             else load_hf(path, dtype, cfg=cfg, mesh=mesh, rules=rules, gguf_blocks=gguf_blocks, tensors=tensors))
    return model, model.cfg
