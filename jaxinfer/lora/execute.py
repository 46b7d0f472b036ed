"""Many LoRA adapters in one jitted step: device slots, the per-token slot index, the low-rank update.

Device state (Punica's / vLLM's layout): per layer and group (qkv, o, gate_up, down: the serving
model's fused projections), one stack A [max_loras, *in, P R] and one B [max_loras, P R, *out]
(jaxinfer/lora/adapter.py: P parts, R = max_lora_rank, zero-padded), sharded like the base weight
(A by its input axes, B by its output axes: tensor parallelism splits them where it splits the base
weight, and XLA adds the reduction the row-parallel o / down already need). Shapes never change,
so loading an adapter into a slot (write_slot: one small program, compiled at warm-up) recompiles
nothing.

Each token of a step carries its row's slot (LoraInputs.token_slots [T]; -1: no adapter, the update
is exactly zero). The update y += (x A[s]) B[s] is computed two ways, both exact:
  - gathered (BGMV: a batched gather-matvec) when the step has at most GATHER_MAX_TOKENS tokens:
    each token's A and B are gathered, so the work is the token's own rank, whatever the slots;
  - per slot (a dense form of SGMV) for larger steps (prefill chunks): x times every slot's A at
    once, the other slots' rank columns zeroed by a one-hot of the token's slot, then times the
    stacked B: max_loras times the rank's FLOPs, but no [T, in, R] gather.
T is static in each compiled step, so the choice is made at trace time.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jaxinfer.layers import GATHER_MAX_TOKENS, lora_delta  # noqa: F401  (the update: layers.py)
from jaxinfer.lora.adapter import GROUP_PARTS, LoraAdapter

NO_SLOT = -1
GROUP_CONTRACT = {"qkv": 1, "o": 2, "gate_up": 1, "down": 1}


@jax.tree_util.register_dataclass
@dataclass
class LoraInputs:
    """The step's LoRA input: token_slots [T] int32 (NO_SLOT: none), and the device stacks: per layer,
    group -> (A [L, *in, P R], B [L, P R, *out])."""
    token_slots: jax.Array
    stacks: list


def group_shapes(model) -> list[dict[str, tuple[tuple, tuple, tuple, tuple]]]:
    """Per layer of a fused Decoder: group -> (A's input shape, B's output shape, and their logical
    axes), slot and rank axes left out. A mixture-of-experts layer has the attention groups only."""
    from jaxinfer.layers import MLP
    out = []
    for block in model.layers:
        named = [("qkv", block.attn.qkv), ("o", block.attn.o)]
        if isinstance(block.mlp, MLP):
            named += [("gate_up", block.mlp.gate_up), ("down", block.mlp.down)]
        groups = {}
        for group, var in named:
            c = GROUP_CONTRACT[group]
            shape = tuple(var.get_value().shape)
            axes = tuple(var.get_metadata().get("logical_axes") or (None,) * len(shape))
            groups[group] = (shape[:c], shape[c:], axes[:c], axes[c:])
        out.append(groups)
    return out


def lora_supported(model) -> str | None:
    """None if adapters can run on this model, else why not."""
    from jaxinfer.layers import MLP
    if model.fused is None:
        return "LoRA needs the fused serving model (not available multi-host or with pipeline_parallel > 1)"
    if any(isinstance(b.mlp, MLP) and not b.mlp.gated for b in model.layers):
        return f"LoRA is not supported for {model.cfg.architecture} (ungated MLP)"
    return None


class LoraSlotsDevice:
    """The device stacks of one engine (max_loras slots, rank max_lora_rank) and the program that
    writes one adapter into one slot."""

    def __init__(self, model, max_loras: int, max_rank: int, mesh=None, rules=None):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.shapes = group_shapes(model)
        shardings = []
        stacks = []
        for groups in self.shapes:
            layer_stacks, layer_sh = {}, {}
            for group, (ins, outs, in_axes, out_axes) in groups.items():
                r = GROUP_PARTS[group] * max_rank
                dtype = model.embed.get_value().dtype
                a = np.zeros((max_loras, *ins, r), dtype)
                b = np.zeros((max_loras, r, *outs), dtype)
                if mesh is not None:
                    from jaxinfer.sharding import param_sharding
                    sh = (param_sharding((None, *in_axes, None), rules, mesh, a.shape),
                          param_sharding((None, None, *out_axes), rules, mesh, b.shape))
                else:
                    sh = (jax.devices()[0],) * 2
                layer_stacks[group] = (jax.device_put(a, sh[0]), jax.device_put(b, sh[1]))
                layer_sh[group] = sh
            stacks.append(layer_stacks)
            shardings.append(layer_sh)
        self.stacks = stacks
        out_shardings = None if mesh is None else shardings
        self._write = jax.jit(_write_slot, out_shardings=out_shardings)

    def zeros_like_slot(self) -> list:
        return [{g: (np.zeros(a.shape[1:], a.dtype), np.zeros(b.shape[1:], b.dtype)) for g, (a, b) in layer.items()}
                for layer in self.stacks]

    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Place `adapter` (None: zeros) in `slot` (a new set of arrays: a step still in flight keeps
        reading the old ones)."""
        values = self.zeros_like_slot()
        if adapter is not None:
            for layer, groups in zip(values, adapter.layers):
                for g, (a, b) in groups.items():
                    layer[g] = (a.astype(layer[g][0].dtype), b.astype(layer[g][1].dtype))
        self.stacks = self._write(self.stacks, np.int32(slot), values)

    def single(self, adapter: LoraAdapter) -> list:
        """Stacks holding only `adapter` in slot 0 (gen.logits: a full forward outside the engine)."""
        stacks = [{g: (np.zeros((1, *a.shape[1:]), a.dtype), np.zeros((1, *b.shape[1:]), b.dtype))
                   for g, (a, b) in layer.items()} for layer in self.stacks]
        for layer, groups in zip(stacks, adapter.layers):
            for g, (a, b) in groups.items():
                layer[g] = (a[None].astype(layer[g][0].dtype), b[None].astype(layer[g][1].dtype))
        return stacks


def _write_slot(stacks, slot, values):
    return jax.tree.map(lambda s, v: s.at[slot].set(v), stacks, values)

