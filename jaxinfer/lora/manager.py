"""The engine's adapters: names -> loaded adapters (host memory), their LRU slots and device stacks.

    lora = LoraManager(model, max_loras=4, max_rank=16)     # the serving (fused) model
    lora.load("a", "/path/to/peft-folder")                  # LoraError: nothing registered
    lora.lora_id("a")                                       # what a request carries (KeyError if unknown)
    lora.apply_pending()                                    # before each step: slots placed since
    lora.unload("a")

An adapter's weights stay in host memory while it is registered (or while a request that was
admitted with it is unfinished); the device holds max_loras of them (host/lora_slots.py decides
which, lora/execute.py holds them). Each load gets a new id, so requests, slots and prefix-cache
salts never confuse an adapter with an earlier one of the same name.
"""
from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from jaxinfer.host.lora_slots import LoraSlots
from jaxinfer.lora.adapter import LoraAdapter, LoraError, load_adapter
from jaxinfer.lora.execute import LoraSlotsDevice, lora_supported


class LoraManager:
    def __init__(self, model, max_loras: int, max_rank: int, mesh=None, rules=None):
        why = lora_supported(model)
        if why is not None:
            raise LoraError(why)
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras}, {max_rank}")
        self.kv_replicas = model.fused.kv_replicas
        # the unfused model's config (the fused one counts each KV head kv_replicas times)
        self.model_cfg = dataclasses.replace(model.cfg, n_kv_heads=model.cfg.n_kv_heads // self.kv_replicas)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.slots = LoraSlots(max_loras)
        self.device = LoraSlotsDevice(model, max_loras, max_rank, mesh, rules)
        self.ids: dict[str, int] = {}                  # registered name -> load id
        self.adapters: dict[int, LoraAdapter] = {}     # load id -> weights (registered or still in use)
        self._next_id = itertools.count(1)

    @property
    def names(self) -> list[str]:
        return list(self.ids)

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """The adapter at path, checked against the model (LoraError naming what is wrong); not registered."""
        return load_adapter(name, path, self.model_cfg, self.kv_replicas, self.max_rank)

    def register(self, adapter: LoraAdapter) -> int:
        if adapter.name in self.ids:
            raise LoraError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        lora_id = next(self._next_id)
        self.ids[adapter.name] = lora_id
        self.adapters[lora_id] = adapter
        return lora_id

    def load(self, name: str, path: str | Path) -> int:
        if name in self.ids:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded")
        return self.register(self.read(name, path))

    def lora_id(self, name: str) -> int:
        return self.ids[name]

    def unload(self, name: str, in_use: set[int]) -> None:
        """Forget `name` (KeyError if unknown). Its weights stay while unfinished requests use them
        (in_use: their load ids); collect() frees them afterwards."""
        del self.ids[name]
        self.collect(in_use)

    def collect(self, in_use: set[int]) -> None:
        """Free the weights and slots of unloaded adapters no unfinished request uses."""
        live = set(self.ids.values()) | in_use
        for lora_id in [i for i in self.adapters if i not in live]:
            del self.adapters[lora_id]
            self.slots.drop(lora_id)

    @property
    def has_retired(self) -> bool:
        return len(self.adapters) > len(self.ids)

    def apply_pending(self) -> None:
        """Write the adapters placed in slots since the last step into the device stacks."""
        for slot, lora_id in self.slots.take_pending():
            self.device.write(slot, self.adapters[lora_id])

    def warmup(self) -> None:
        """Compile the slot-writing program (a zero write to slot 0, which holds nothing yet)."""
        self.device.write(0, None)
