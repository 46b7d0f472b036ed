"""PEFT LoRA adapters on disk -> per-layer (A, B) matrices in the serving model's fused layout.

A PEFT LoRA folder holds adapter_config.json and adapter_model.safetensors, with one pair per
adapted Linear: `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r];
PEFT adds `scaling * B(A(x))` to the module's output, scaling = lora_alpha / r (lora_alpha / sqrt(r)
with use_rslora), r and lora_alpha per module from rank_pattern / alpha_pattern (PEFT's
utils.other.get_pattern_key: the first pattern that matches the end of the module's name).

The serving model fuses q, k, v into `qkv` and gate, up into `gate_up` (models/decoder.py), so an
adapter becomes four groups per layer (qkv, o, gate_up or an ungated MLP's up, down), each one
A [*in, P R] (its P parts' A side by side: qkv 3, gate_up 2, o, up and down 1; R = max_lora_rank,
part j's rank columns j R .. j R + r, zero-padded past r, so every adapter has the same shapes and
loading one compiles nothing) and one B [R, n_p] per part, added to q, k, v and gate, up after the
fused output is split (KV heads repeated as the fused model repeats them). The scaling is folded
into B. Each family's module names are its own (_FAMILY_PROJECTIONS: Phi's dense / fc1 / fc2,
GPT-NeoX's, BLOOM's and Falcon's query_key_value, GPT-2's and GPTBigCode's c_attn, Phi-3's qkv_proj
and gate_up_proj, GLM-4's gate_up_proj; Llama's q_proj ... down_proj for the rest); a module that
fuses q, k and v (or gate and
up) gives its one A to every part and its B rows split among them.
Everything PEFT can save that this does not run (biases, DoRA, modules_to_save, embedding or LM-head
adapters, experts) is refused by name, as is a folder that does not fit the model.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.hf_maps import head_order
from jaxinfer.errors import CheckpointError
from jaxinfer.safetensors_file import SafetensorsFile

# per family: the adapted module ("attn." or "mlp." + its HF name) -> (our group, part index within
# the fused group); part "kv_groups": q, k, v fused in one module, [kv heads, h / kv + 2, head_dim]
# rows (each KV head's query heads, key, value: GPT-NeoX's, BLOOM's and Falcon's query_key_value,
# GPTBigCode's c_attn; per head [q, k, v] with as many KV heads as heads, [q | k | v] with one),
# "rows": every part of the group in one module, their rows
# one after another ([q | k | v]: GPT-2's c_attn, Phi-3's qkv_proj; [gate | up]: Phi-3's and GLM-4's
# gate_up_proj). The ungated MLPs' up projection is the group "up" (one part).
_LLAMA = {"attn.q_proj": ("qkv", 0), "attn.k_proj": ("qkv", 1), "attn.v_proj": ("qkv", 2), "attn.o_proj": ("o", 0),
          "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1), "mlp.down_proj": ("down", 0)}
_QKV = {"attn.q_proj": ("qkv", 0), "attn.k_proj": ("qkv", 1), "attn.v_proj": ("qkv", 2)}
_FUSED_QKV = {"attn.query_key_value": ("qkv", "kv_groups"), "attn.dense": ("o", 0), "mlp.dense_h_to_4h": ("up", 0),
              "mlp.dense_4h_to_h": ("down", 0)}
_UNGATED_UP = {**_QKV, "attn.o_proj": ("o", 0), "mlp.up_proj": ("up", 0), "mlp.down_proj": ("down", 0)}
_GLM = {**_QKV, "attn.o_proj": ("o", 0), "mlp.gate_up_proj": ("gate_up", "rows"), "mlp.down_proj": ("down", 0)}
_FAMILY_PROJECTIONS = {
    "Phi3ForCausalLM": {"attn.qkv_proj": ("qkv", "rows"), "attn.o_proj": ("o", 0), "mlp.gate_up_proj": ("gate_up", "rows"),
                        "mlp.down_proj": ("down", 0)},
    "GlmForCausalLM": _GLM, "Glm4ForCausalLM": _GLM,
    "PhiForCausalLM": {**_QKV, "attn.dense": ("o", 0), "mlp.fc1": ("up", 0), "mlp.fc2": ("down", 0)},
    "Starcoder2ForCausalLM": {**_QKV, "attn.o_proj": ("o", 0), "mlp.c_fc": ("up", 0), "mlp.c_proj": ("down", 0)},
    "ArceeForCausalLM": _UNGATED_UP, "Jais2ForCausalLM": _UNGATED_UP, "NemotronForCausalLM": _UNGATED_UP,
    "ApertusForCausalLM": _UNGATED_UP,
    "GPTJForCausalLM": {**_QKV, "attn.out_proj": ("o", 0), "mlp.fc_in": ("up", 0), "mlp.fc_out": ("down", 0)},
    "GPTNeoForCausalLM": {**_QKV, "attn.out_proj": ("o", 0), "mlp.c_fc": ("up", 0), "mlp.c_proj": ("down", 0)},
    "OPTForCausalLM": {**_QKV, "attn.out_proj": ("o", 0), "mlp.fc1": ("up", 0), "mlp.fc2": ("down", 0)},
    "GPTNeoXForCausalLM": _FUSED_QKV, "BloomForCausalLM": _FUSED_QKV, "FalconForCausalLM": _FUSED_QKV,
    "GPT2LMHeadModel": {"attn.c_attn": ("qkv", "rows"), "attn.c_proj": ("o", 0), "mlp.c_fc": ("up", 0),
                        "mlp.c_proj": ("down", 0)},
    "GPTBigCodeForCausalLM": {"attn.c_attn": ("qkv", "kv_groups"), "attn.c_proj": ("o", 0), "mlp.c_fc": ("up", 0),
                              "mlp.c_proj": ("down", 0)},
    # EXAONE 3.x: Llama's names (transformers' model) and those of its modeling code
    # (transformer.h.i.attn.attention.q_proj / out_proj, mlp.c_fc_0 / c_fc_1 / c_proj)
    "ExaoneForCausalLM": {**_LLAMA, "attn.out_proj": ("o", 0), "mlp.c_fc_0": ("gate_up", 0),
                          "mlp.c_fc_1": ("gate_up", 1), "mlp.c_proj": ("down", 0)},
}
GROUP_PARTS = {"qkv": 3, "o": 1, "gate_up": 2, "up": 1, "down": 1}
LORA_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
                 "SmolLM3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
                 "Exaone4ForCausalLM", "SeedOssForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM",
                 "Ernie4_5ForCausalLM", "StableLmForCausalLM", "GraniteMoeForCausalLM", "OlmoeForCausalLM",
                 "Ministral3ForCausalLM", "HunYuanDenseV1ForCausalLM", "HeliumForCausalLM",
                 "MinistralForCausalLM", "GraniteSWAForCausalLM", "InternLM3ForCausalLM", "OlmoForCausalLM",
                 "MiniCPMForCausalLM", "PhimoeForCausalLM", "AfmoeForCausalLM", "Llama4ForCausalLM",
                 *_FAMILY_PROJECTIONS)
# PeftModel.save_pretrained writes base_model.model.<module>; an adapter saved from a transformers
# model (its PEFT integration: model.add_adapter, then save_pretrained) the module names alone
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# (OPT's fc1 / fc2 sit directly under the layer: no part, read as the MLP's; Llama 4's MLP is its feed_forward)
_MODULE = re.compile(r"^(?:(?:model\.language_model|language_model\.model|model|gpt_neox|model\.decoder)\.layers"
                     r"|transformer\.h)\.(?P<layer>\d+)\."
                     r"(?:(?P<part>self_attn|attention|self_attention|attn|mlp|feed_forward)(?:\.attention)?\.)?(?P<proj>\w+)$")


def projections(architecture: str) -> dict[str, tuple[str, int | str]]:
    """The family's adapted modules (_FAMILY_PROJECTIONS; Llama's names for the others)."""
    return _FAMILY_PROJECTIONS.get(architecture, _LLAMA)


# An adapter of a vision-language checkpoint (served as its language model, hf_configs._MULTIMODAL):
# its language model's modules under LANGUAGE_MODEL_PREFIXES' names; those of its vision tower and
# projector (an "all-linear" adapter's) never touch a text-only request, so they are left out
_VISION = re.compile(r"^(?:model\.)?(?:vision_tower|vision_model|visual|multi_modal_projector)\.")


class LoraError(ValueError):
    """An adapter this model cannot serve; the message names the folder and what is wrong."""


@dataclass
class LoraAdapter:
    """One adapter, ready for a device slot: layers[i][group] = (A [*in, P R], (B_p [R, n_p], ...)),
    float32 numpy, scaling folded into B; groups the adapter does not touch are absent."""
    name: str
    path: str
    rank: int                                   # the largest rank of any of its modules
    layers: list[dict[str, tuple[np.ndarray, tuple[np.ndarray, ...]]]]


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's get_pattern_key: the first pattern matching the module name's end, else the default."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def read_config(folder: Path, max_rank: int, vision: frozenset[str] = frozenset(),
                names: frozenset[str] = frozenset(p.split(".", 1)[1] for p in _LLAMA)) -> dict:
    """adapter_config.json, with every setting this does not run refused by name. vision: the
    target names the adapter's tensors adapt in a vision tower only (_vision_targets: left out);
    names: the model's adaptable module names (projections)."""
    path = folder / "adapter_config.json"
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter folder {str(folder)!r} does not exist")
    if not path.exists():
        raise LoraError(f"{folder}: no adapter_config.json (not a PEFT adapter folder)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise LoraError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
    except OSError as e:          # a folder of that name, unreadable
        raise LoraError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{path}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{path}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{path}: bias={cfg['bias']!r} is not supported (only bias='none')")
    if cfg.get("lora_bias"):
        raise LoraError(f"{path}: lora_bias=true is not supported")
    if cfg.get("use_dora"):
        raise LoraError(f"{path}: use_dora=true (DoRA) is not supported")
    if cfg.get("modules_to_save"):
        raise LoraError(f"{path}: modules_to_save {cfg['modules_to_save']} is not supported (only LoRA matrices)")
    for name in ("target_parameters", "trainable_token_indices", "alora_invocation_tokens", "layer_replication"):
        if cfg.get(name):
            raise LoraError(f"{path}: {name} is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        for target in targets:   # a name, or a module path: PEFT matches the name's last part
            t = target.rsplit(".", 1)[-1]
            if t in ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out"):
                raise LoraError(f"{path}: target module {t!r}: embedding and LM-head adapters are not supported")
            if t not in names and t not in vision:
                raise LoraError(f"{path}: target module {t!r} is not in the model (LoRA targets: "
                                f"{', '.join(sorted(names))})")
    ranks = [int(cfg.get("r", 8)), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())]
    if max(ranks) > max_rank:
        raise LoraError(f"{path}: rank {max(ranks)} exceeds max_lora_rank={max_rank}")
    return cfg


def load_adapter(name: str, folder: str | Path, model_cfg: ModelConfig, kv_replicas: int, max_rank: int
                 ) -> LoraAdapter:
    """The adapter at `folder` for a model of (unfused) model_cfg served with each KV head repeated
    kv_replicas times (models.decoder.FusedLayout). Every problem is a LoraError naming the file and
    tensor: a corrupt safetensors file, or a config field of the wrong type, too."""
    try:
        return _load_adapter(name, Path(folder), model_cfg, kv_replicas, max_rank)
    except LoraError:
        raise
    except CheckpointError as e:
        raise LoraError(str(e)) from None
    except (ValueError, TypeError, AttributeError, KeyError, OverflowError, OSError, RecursionError) as e:
        # (OverflowError: "r": Infinity or 1e999 in the config)
        raise LoraError(f"{folder}: adapter_config.json or its tensors cannot be read "
                        f"({type(e).__name__}: {e})") from None


def _vision_targets(st: SafetensorsFile | None) -> frozenset[str]:
    """The module names (their last part: PEFT's target names) the adapter adapts in a vision tower
    or projector only."""
    if st is None:
        return frozenset()
    modules = [m["module"] for m in map(_KEY.match, st.tensors) if m is not None]
    language = {m.rsplit(".", 1)[-1] for m in modules if not _VISION.match(m)}
    return frozenset(m.rsplit(".", 1)[-1] for m in modules if _VISION.match(m)) - language


def _load_adapter(name: str, folder: Path, model_cfg: ModelConfig, kv_replicas: int, max_rank: int) -> LoraAdapter:
    weights = folder / "adapter_model.safetensors"
    st = SafetensorsFile(weights) if weights.is_file() else None
    table = projections(model_cfg.architecture)
    cfg = read_config(folder, max_rank, _vision_targets(st), frozenset(p.split(".", 1)[1] for p in table))
    if model_cfg.architecture not in LORA_FAMILIES:
        raise LoraError(f"{folder}: LoRA adapters are not supported for {model_cfg.architecture} "
                        f"(supported: {', '.join(LORA_FAMILIES)})")
    if st is None:
        if (folder / "adapter_model.bin").exists():
            raise LoraError(f"{folder}: adapter_model.bin (a pickled PyTorch file) is not loaded; save the adapter "
                            "with safe_serialization=True (adapter_model.safetensors)")
        raise LoraError(f"{folder}: no adapter_model.safetensors")
    pairs: dict[str, dict[str, str]] = {}
    for key in st.tensors:
        m = _KEY.match(key)
        if m is not None and _VISION.match(m["module"]):
            continue
        if m is None:
            what = ("an embedding adapter" if "lora_embedding" in key else "a DoRA magnitude" if "magnitude" in key
                    else "a LoRA bias" if ".lora_B.bias" in key else "not a LoRA matrix")
            raise LoraError(f"{weights}: tensor {key!r} is {what}: not supported")
        pairs.setdefault(m["module"], {})[m["ab"]] = key
    if not pairs:
        raise LoraError(f"{weights}: no LoRA tensors")
    # per layer, group: the parts' A^T [in, R] and scaled B^T [R, out] (None: not adapted)
    parts: list[dict[str, list]] = [{} for _ in range(model_cfg.n_layers)]
    alpha, r_cfg, rslora = float(cfg.get("lora_alpha", 8)), int(cfg.get("r", 8)), bool(cfg.get("use_rslora"))
    top_rank, qk_order = 0, head_order(model_cfg)
    ins, outs = _group_dims(model_cfg)
    for module, ab in sorted(pairs.items()):
        mm = _MODULE.match(module)
        key = None if mm is None else ("mlp." if mm["part"] in ("mlp", "feed_forward", None) else "attn.") + mm["proj"]
        if key not in table or int(mm["layer"]) >= model_cfg.n_layers:
            raise LoraError(f"{weights}: adapted module {module!r} is not in the model (LoRA targets: layers "
                            f"0..{model_cfg.n_layers - 1}, modules {', '.join(k.split('.', 1)[1] for k in table)})")
        layer, (group, j) = int(mm["layer"]), table[key]
        if group in ("gate_up", "up", "down") and model_cfg.is_moe_layer(layer):
            raise LoraError(f"{weights}: adapted module {module!r}: layer {layer} is a mixture of experts "
                            "(expert adapters are not supported)")
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{weights}: module {module!r} has lora_{next(iter(ab))} without its pair")
        a, b = st.get(ab["A"]).astype(np.float32), st.get(ab["B"]).astype(np.float32)
        r = int(_pattern_value(cfg.get("rank_pattern") or {}, module, r_cfg))
        n_in, n_out = ins[group], (sum(outs[group]) if isinstance(j, str) else outs[group][j])
        if a.shape != (r, n_in) or b.shape != (n_out, r):
            raise LoraError(f"{weights}: module {module!r}: lora_A {a.shape} / lora_B {b.shape} disagree with the "
                            f"model and adapter_config.json (expected [{r}, {n_in}] / [{n_out}, {r}])")
        if r > max_rank:
            raise LoraError(f"{weights}: module {module!r} has rank {r}, above max_lora_rank={max_rank}")
        lora_alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, module, alpha))
        scale = np.float32(lora_alpha / math.sqrt(r) if rslora else lora_alpha / r)
        slots = parts[layer].setdefault(group, [None] * GROUP_PARTS[group])
        for i, part in _split_parts(model_cfg, group, b, j):
            if group == "qkv" and i < 2:   # q / k features in the order the model's weights were loaded in
                part = part.reshape(-1, model_cfg.head_dim, r)[:, qk_order].reshape(-1, r)
            slots[i] = (a.T, part.T * scale, r)
        top_rank = max(top_rank, r)
    layers = [{group: _fuse_group(model_cfg, group, got, max_rank, kv_replicas) for group, got in parts[i].items()}
              for i in range(model_cfg.n_layers)]
    return LoraAdapter(name, str(folder), top_rank, layers)


def _group_dims(cfg: ModelConfig) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Per group: its input width, and its parts' output widths."""
    d, h, kv, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    return ({"qkv": d, "o": h * hd, "gate_up": d, "up": d, "down": f},
            {"qkv": [h * hd, kv * hd, kv * hd], "o": [d], "gate_up": [f, f], "up": [f], "down": [d]})


def _split_parts(cfg: ModelConfig, group: str, b: np.ndarray, j: int | str) -> list[tuple[int, np.ndarray]]:
    """A module's lora_B [out, r] -> (part index, its rows) for each part it adapts: itself (j an
    index), or every part of a fused module (j "kv_groups": q, k, v in [kv, h / kv + 2, head_dim] rows; "rows":
    the group's parts one after another, [q | k | v] or [gate | up])."""
    if isinstance(j, int):
        return [(j, b)]
    h, hd, r = cfg.n_heads, cfg.head_dim, b.shape[1]
    if j == "kv_groups":   # per KV head: its h / kv query heads, its key, its value
        kv = cfg.n_kv_heads
        g = h // kv
        per = b.reshape(kv, g + 2, hd, r)
        return [(0, per[:, :g].reshape(h * hd, r)), (1, per[:, g].reshape(kv * hd, r)),
                (2, per[:, g + 1].reshape(kv * hd, r))]
    bounds = np.cumsum([0, *_group_dims(cfg)[1][group]])
    return [(i, b[bounds[i]:bounds[i + 1]]) for i in range(len(bounds) - 1)]


def _fuse_group(cfg: ModelConfig, group: str, got: list, r_max: int, kv_replicas: int
                ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """One group's parts -> (A [*in, P R], (B_p [R, n_p] for each part)) as the serving model adds
    them (module docstring): k and v columns repeated per KV replica; absent parts zero."""
    h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    ins_by_group, outs_by_group = _group_dims(cfg)
    ins, outs = ins_by_group[group], outs_by_group[group]
    p = len(outs)
    a = np.zeros((ins, p * r_max), np.float32)
    bs = []
    for j, n_out in enumerate(outs):
        b = np.zeros((r_max, n_out), np.float32)
        if got[j] is not None:
            at, bt, r = got[j]
            a[:, j * r_max: j * r_max + r] = at
            b[:r] = bt
        if group == "qkv" and j > 0:   # (R, kv heads, hd) -> each head kv_replicas times, as fuse_decoder
            b = np.repeat(b.reshape(r_max, kv, hd), kv_replicas, axis=1).reshape(r_max, -1)
        bs.append(b)
    if group == "o":
        a = a.reshape(h, hd, p * r_max)
    return a, tuple(bs)
