"""Multi-LoRA serving: PEFT adapters loaded into the serving model's fused layout (adapter.py) and run
from device slots inside the jitted step (execute.py); the host's LRU of slots is
jaxinfer/host/lora_slots.py (no jax there)."""
