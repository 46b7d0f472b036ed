"""KV pool sizing on accelerators (no GPU needed: the device's memory report is faked).

The rule (DESIGN.md "On a GPU", vLLM's gpu_memory_utilization): the engine may hold
memory_fraction of the device's memory in all, capped by what JAX's allocator may hand out; the
pool is that less what is already allocated (the loaded weights: counted once, since they are in
bytes_in_use) and the step's activations. JAX sizes a GPU allocator at XLA_CLIENT_MEM_FRACTION of
the device (default 0.75, jax's docs), so device memory = bytes_limit / that fraction. A pool that
cannot hold one sequence of max_model_len is an error naming the numbers and the settings to change.
"""
from __future__ import annotations

import pytest

from jaxinfer import Generator
from jaxinfer.config import ConfigError, EngineConfig, ModelConfig, check_pool_fits, resolve_config
from jaxinfer.perf import PoolSize, size_kv_pool

GiB, MiB = 2**30, 2**20
# llama-gqa-llama3 in float32: 2 layers x 2 KV heads x head_dim 16 x (K, V) x 4 bytes = 512 B a token
BLOCK_BYTES = 8 * 2 * 2 * 16 * 2 * 4
ENGINE = dict(dtype="float32", block_size=8, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16,
              warmup=False)


@pytest.fixture
def no_xla_env(monkeypatch):
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(name, raising=False)


def test_gpu_pool_is_the_fraction_of_device_memory_less_what_is_in_use():
    total = 80 * GiB
    weights, reserve, block = 16 * GiB, 1 * GiB, 2 * MiB
    # JAX's default allocator: 75% of the device, which then caps a 0.9 engine
    p = size_kv_pool(block_bytes=block, memory_fraction=0.9, stats={"bytes_limit": total * 3 // 4, "bytes_in_use": weights},
                     platform="gpu", env={}, reserve=reserve, host_ram=0, wanted_blocks=0)
    assert p.device_bytes == total and p.allocator_bound
    assert p.num_blocks == (60 * GiB - 16 * GiB - 1 * GiB) // block == 44 * 512 - 512
    # XLA_CLIENT_MEM_FRACTION=0.95 (what `jaxinfer serve --gpu-memory-utilization 0.95` sets): 0.9 of 80 GiB
    p = size_kv_pool(block_bytes=block, memory_fraction=0.9, stats={"bytes_limit": int(total * 0.95), "bytes_in_use": weights},
                     platform="gpu", env={"XLA_CLIENT_MEM_FRACTION": "0.95"}, reserve=reserve, host_ram=0, wanted_blocks=0)
    assert p.device_bytes == pytest.approx(total, abs=2) and not p.allocator_bound
    assert p.num_blocks == int(0.9 * p.device_bytes - weights - reserve) // block == 55 * 512
    # the deprecated name counts the same; the platform allocator and TPUs report the device itself
    legacy = size_kv_pool(block_bytes=block, memory_fraction=0.9, stats={"bytes_limit": int(total * 0.95), "bytes_in_use": weights},
                          platform="gpu", env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}, reserve=reserve, host_ram=0,
                          wanted_blocks=0)
    assert legacy == p
    for platform, env in (("gpu", {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}), ("tpu", {})):
        q = size_kv_pool(block_bytes=block, memory_fraction=0.5, stats={"bytes_limit": total, "bytes_in_use": weights},
                         platform=platform, env=env, reserve=reserve, host_ram=0, wanted_blocks=0)
        assert q.device_bytes == total and q.num_blocks == (40 - 16 - 1) * 512


def test_host_pool_is_what_the_sequences_need_capped_at_a_quarter_of_ram():
    p = size_kv_pool(block_bytes=4096, memory_fraction=0.9, stats=None, platform="cpu", env={}, reserve=0,
                     host_ram=64 * GiB, wanted_blocks=1025)
    assert (p.num_blocks, p.on_device) == (1025, False)
    p = size_kv_pool(block_bytes=4096, memory_fraction=0.9, stats=None, platform="cpu", env={}, reserve=0,
                     host_ram=4 * MiB, wanted_blocks=1025)
    assert p.num_blocks == 4 * MiB // 4 // 4096 == 256


class FakeDevice:
    """A device whose allocator reports `limit` and what the test says is in use."""
    platform = "gpu"

    def __init__(self, limit: int, in_use: int):
        self.limit, self.in_use = limit, in_use

    def memory_stats(self) -> dict:
        return {"bytes_limit": self.limit, "bytes_in_use": self.in_use}


def test_engine_counts_the_weights_once_and_a_second_engine_gets_what_is_left(hf_model_dir, monkeypatch, no_xla_env):
    import jaxinfer.memory as memory

    total = 768 * MiB
    dev = FakeDevice(limit=total * 3 // 4, in_use=40 * MiB)    # the loaded weights are in the 40 MiB
    monkeypatch.setattr(memory, "pool_device", lambda: dev)
    path = hf_model_dir("llama-gqa-llama3")
    first = Generator.from_pretrained(path, memory_fraction=0.55, **ENGINE)
    r = first.engine.resolved
    assert r.pool.in_use == 40 * MiB and r.pool.device_bytes == total and not r.pool.allocator_bound
    # 0.55 x 768 MiB less the 40 MiB in use (weights included: not subtracted again) and the activations
    assert r.num_blocks == (int(0.55 * total) - 40 * MiB - r.pool.reserve) // BLOCK_BYTES
    assert r.num_blocks > 1000 and r.max_model_len == 64
    assert r.pool.reserve >= 256 * MiB        # at least the workspace slack
    assert first.engine.runner.kv_pages[0].k.shape[1] == r.num_blocks   # what the pool allocated

    dev.in_use += r.num_blocks * BLOCK_BYTES   # the first engine's pool now holds that memory
    second = Generator.from_pretrained(path, memory_fraction=0.75, **ENGINE)
    r2 = second.engine.resolved
    assert r2.num_blocks == (int(0.75 * total) - dev.in_use - r2.pool.reserve) // BLOCK_BYTES

    dev.in_use += r2.num_blocks * BLOCK_BYTES   # all of the allocator's 576 MiB is taken now
    with pytest.raises(ConfigError) as err:
        Generator.from_pretrained(path, memory_fraction=0.75, **ENGINE)
    msg = str(err.value)
    for needle in ("max_model_len = 64 tokens", "memory_fraction 0.75 of 0.75 GiB", "1 usable blocks of 8 tokens = 8 tokens",
                   "lower max_model_len to at most 8", "raise memory_fraction (--gpu-memory-utilization)",
                   "set num_blocks to at least 9"):
        assert needle in msg, (needle, msg)


def test_a_pool_smaller_than_one_sequence_is_refused_naming_the_settings():
    mc = ModelConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                     max_position_embeddings=512)
    with pytest.raises(ConfigError, match=r"max_model_len \(the model's max_position_embeddings\) = 512 tokens: "
                                          r"num_blocks=9 holds 128 tokens .*at least 33, or max_model_len to at most 128"):
        resolve_config(EngineConfig(num_blocks=9, block_size=16), mc, backend="cpu")
    # sized from memory: 8 GiB device, 6 GiB in use, 1 GiB reserved -> the fraction that would fit
    pool = PoolSize(3, 1 * GiB, True, device_bytes=8 * GiB, memory_fraction=0.9, allocator_limit=8 * GiB,
                    in_use=6 * GiB, reserve=1 * GiB)
    with pytest.raises(ConfigError) as err:
        check_pool_fits(EngineConfig(block_size=16, max_model_len=100), 100, pool.num_blocks, pool)
    msg = str(err.value)
    assert "2 usable blocks of 16 tokens = 32 tokens" in msg and "at most 32" in msg
    # 6 + 1 GiB + 8 blocks of 1 GiB (100 tokens need 7 blocks + the null block) = 15 GiB > 8 GiB
    assert "use a device with more memory" in msg and "set num_blocks to at least 8" in msg
    check_pool_fits(EngineConfig(block_size=16, max_model_len=32), 32, pool.num_blocks, pool)   # fits: no error


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, "0.9"])
def test_memory_fraction_must_be_a_fraction(fraction):
    with pytest.raises(ValueError, match="memory_fraction must be in"):
        EngineConfig(memory_fraction=fraction)


def test_cli_flag_and_jax_allocator_cap(monkeypatch, no_xla_env):
    import os

    from jaxinfer.cli import build_parser, cap_xla_allocator

    for flag in ("--gpu-memory-utilization", "--memory-fraction"):
        args = build_parser().parse_args(["serve", flag, "0.8"])
        assert args.memory_fraction == 0.8
    assert build_parser().parse_args(["batch", "in.jsonl", "out.jsonl"]).memory_fraction == 0.9
    cap_xla_allocator(0.8)
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.8"
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")    # the user's setting wins
    cap_xla_allocator(0.8)
    assert "XLA_CLIENT_MEM_FRACTION" not in os.environ
