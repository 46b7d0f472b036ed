"""Which LoRA adapter sits in which device slot: an LRU over max_loras slots. Never imports jax.

More adapters may be registered than there are slots (vLLM's LRUCacheWorkerLoRAManager): a request
with an adapter takes a slot when it is admitted (acquire), holding it while it runs; the slot is
released when it finishes, aborts or is preempted. An adapter not in a slot goes to a free slot,
else to the least recently used slot nobody holds (evicting what was there); when every slot is
held, acquire returns None and the request waits (it is never refused). Each placement is queued in
`pending` for the engine, which writes the adapter's weights into the slot before the step that
first uses it runs. Adapters are keyed by a load id (one per successful load), so an adapter
unloaded and loaded again under the same name never reuses the old weights.
"""
from __future__ import annotations

from collections import OrderedDict


class LoraSlots:
    def __init__(self, max_loras: int):
        assert max_loras >= 1, max_loras
        self.max_loras = max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()   # lora id -> slot, least recently used first
        self.holders: dict[int, int] = {}                    # lora id -> requests holding its slot
        self.free: list[int] = list(range(max_loras))
        self.pending: list[tuple[int, int]] = []             # (slot, lora id) to write before the next step
        self.num_loads = 0                                   # placements so far (evictions included)

    def acquire(self, lora_id: int) -> int | None:
        """The slot of lora_id, placing it (LRU) if needed and holding it; None if every slot is held."""
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
        else:
            if self.free:
                slot = self.free.pop(0)
            else:
                victim = next((i for i in self.slot_of if not self.holders.get(i)), None)
                if victim is None:
                    return None
                slot = self.slot_of.pop(victim)
                self.holders.pop(victim, None)
            self.slot_of[lora_id] = slot
            self.pending.append((slot, lora_id))
            self.num_loads += 1
        self.holders[lora_id] = self.holders.get(lora_id, 0) + 1
        return self.slot_of[lora_id]

    def release(self, lora_id: int) -> None:
        assert self.holders.get(lora_id, 0) > 0, lora_id
        self.holders[lora_id] -= 1

    def drop(self, lora_id: int) -> None:
        """Forget an unloaded adapter's slot (nobody holds it): the slot is free again."""
        assert not self.holders.get(lora_id), lora_id
        self.holders.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.pending = [(s, i) for s, i in self.pending if s != slot]
            self.free.append(slot)

    def take_pending(self) -> list[tuple[int, int]]:
        """The placements since the last call, (slot, lora id), the latest per slot."""
        latest = dict(self.pending)
        self.pending = []
        return sorted(latest.items())

    def held(self, lora_id: int) -> bool:
        return bool(self.holders.get(lora_id))
