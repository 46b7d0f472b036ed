"""Many LoRA adapters in one jitted step: device slots, the per-token slot index, the low-rank update.

Device state (Punica's / vLLM's layout): per layer and group (qkv, o, gate_up, down: the serving
model's fused projections), one stack A [*in, P, max_loras, R] (laid out so that x times it is one
matmul with no transpose) and one stack per part B_p [max_loras, R, n_p] (jaxinfer/lora/adapter.py: P parts, R = max_lora_rank, zero-padded), sharded
like the base weight (A by its input axes, each B by the base weight's output axis: tensor
parallelism splits them where it splits the base weight, and XLA adds the reduction the row-parallel
o and down already need). Shapes never change, so loading an adapter into a slot (write: one small
program, compiled at warm-up) recompiles nothing.

Each token of a step carries its row's slot (LoraInputs.token_slots [T]; -1: no adapter, the update
is exactly zero) and layers.lora_delta adds x A[s] B[s] to the projection's output: every slot's A
at once, a one-hot of the token's slot keeping its own rank columns, then the stacked B (the dense
form of Punica's SGMV; why not BGMV's per-token gather on CPU: layers.lora_delta).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jaxinfer.lora.adapter import GROUP_PARTS, LoraAdapter

GROUP_CONTRACT = {"qkv": 1, "o": 2, "gate_up": 1, "up": 1, "down": 1}


@jax.tree_util.register_dataclass
@dataclass
class LoraInputs:
    """The step's LoRA input: token_slots [T] int32 (-1: none), and the device stacks: per layer,
    group -> (A [*in, P, L, R], (B_p [L, R, n_p], ...))."""
    token_slots: jax.Array
    stacks: list


def group_shapes(model) -> list[dict[str, tuple]]:
    """Per layer of a fused Decoder: group -> (A's input shape, its logical axes, the parts' output
    widths, their logical axis); slot and rank axes left out. A mixture-of-experts layer has the
    attention groups only."""
    from jaxinfer.layers import MLP
    cfg = model.cfg   # fused: n_kv_heads counts the KV replicas, as the heads project_qkv returns
    out = []
    for block in model.layers:
        named = [("qkv", block.attn.qkv, [cfg.n_heads * cfg.head_dim] + [cfg.n_kv_heads * cfg.head_dim] * 2),
                 ("o", block.attn.o, [cfg.d_model])]
        if isinstance(block.mlp, MLP) and block.mlp.gated:
            named += [("gate_up", block.mlp.gate_up, [cfg.ffn_dim] * 2), ("down", block.mlp.down, [cfg.d_model])]
        elif isinstance(block.mlp, MLP):   # an ungated MLP (Phi, StarCoder2, GPT-NeoX, BLOOM, GPT-2)
            named += [("up", block.mlp.up, [cfg.ffn_dim]), ("down", block.mlp.down, [cfg.d_model])]
        groups = {}
        for group, var, widths in named:
            c = GROUP_CONTRACT[group]
            shape = tuple(var.get_value().shape)
            axes = tuple(var.get_metadata().get("logical_axes") or (None,) * len(shape))
            groups[group] = (shape[:c], axes[:c], widths, axes[-1])
        out.append(groups)
    return out


def lora_supported(model) -> str | None:
    """None if adapters can run on this model, else why not."""
    if getattr(model, "fused", None) is None:
        return "LoRA needs the fused serving model (not available multi-host or with pipeline_parallel > 1)"
    if model.cfg.mla:
        return "LoRA adapters are not available with latent attention (DeepSeek-V3's q / kv projections)"
    if model.cfg.has_state:
        return (f"LoRA adapters are not available for {model.cfg.architecture}, whose conv / Gated DeltaNet / "
                "Mamba-2 layers take none")
    return None


class LoraSlotsDevice:
    """The device stacks of one engine (max_loras slots, rank max_lora_rank) and the program that
    writes one adapter into one slot."""

    def __init__(self, model, max_loras: int, max_rank: int, mesh=None, rules=None):
        self.max_loras, self.max_rank = max_loras, max_rank
        dtype = model.embed.get_value().dtype
        self.dtype = dtype

        def place(shape, axes):
            x = np.zeros(shape, dtype)
            if mesh is None:
                return jax.device_put(x, jax.devices()[0])
            from jaxinfer.sharding import param_sharding
            return jax.device_put(x, param_sharding(axes, rules, mesh, shape))

        self.stacks = [{group: (place((*ins, GROUP_PARTS[group], max_loras, max_rank), (*in_axes, None, None, None)),
                                tuple(place((max_loras, max_rank, n), (None, None, out_axis)) for n in widths))
                        for group, (ins, in_axes, widths, out_axis) in groups.items()}
                       for groups in group_shapes(model)]
        # the written stacks keep each stack's sharding (jit's default for a functional update)
        self._write = jax.jit(_write_slot)

    def _slot_values(self, adapter: LoraAdapter | None, single: bool = False) -> list:
        """The adapter's arrays shaped as one slot of the stacks, A [*in, P, R] and B_p [R, n_p] (single:
        as stacks of one slot, A [*in, P, 1, R] and B_p [1, R, n_p]); zeros where it has none."""
        def a_slot(shape, a=None):   # stack shape (*in, P, L, R) -> the slot's
            ins, parts, r = shape[:-3], shape[-3], shape[-1]
            a = np.zeros((*ins, parts, r), self.dtype) if a is None else a.reshape(*ins, parts, r).astype(self.dtype)
            return a[..., None, :] if single else a

        def b_slot(shape, b=None):
            b = np.zeros(shape[1:], self.dtype) if b is None else b.astype(self.dtype)
            return b[None] if single else b

        values = [{g: (a_slot(a.shape), tuple(b_slot(b.shape) for b in bs)) for g, (a, bs) in layer.items()}
                  for layer in self.stacks]
        if adapter is not None:
            for layer, stacks, groups in zip(values, self.stacks, adapter.layers):
                for g, (a, bs) in groups.items():
                    layer[g] = (a_slot(stacks[g][0].shape, a),
                                tuple(b_slot(st.shape, b) for st, b in zip(stacks[g][1], bs)))
        return values

    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Place `adapter` (None: zeros) in `slot`: new arrays, so a step still in flight keeps
        reading the old ones."""
        self.stacks = self._write(self.stacks, np.int32(slot), self._slot_values(adapter))

    def single(self, adapter: LoraAdapter) -> list:
        """Stacks holding only `adapter`, in slot 0 (gen.logits: a full forward outside the engine)."""
        return self._slot_values(adapter, single=True)


def _write_slot(stacks, slot, values):
    """Each group's A at [..., slot, :] (its slot axis is second to last), each B at [slot]."""
    return [{g: (a.at[..., slot, :].set(va), tuple(b.at[slot].set(vb) for b, vb in zip(bs, vbs)))
             for g, ((a, bs), (va, vbs)) in ((g, (layer[g], vals[g])) for g in layer)}
            for layer, vals in zip(stacks, values)]
