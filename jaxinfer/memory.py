"""What the KV pool is sized from, gathered from the running process: the allocator's stats of every
process's first device, the host's RAM, the environment, and how the model splits a block over its
mesh (config.PoolInputs). config.resolve_config does the arithmetic (jaxinfer.perf.size_kv_pool);
this module only asks jax and the OS, so the sizing stays testable with hand-written inputs.
"""
from __future__ import annotations

import os

import jax
import numpy as np

from jaxinfer.config import PoolInputs
from jaxinfer.sharding import model_mesh

__all__ = ["pool_device", "pool_inputs", "stats_of_every_process"]


def pool_device():
    """The device whose memory sizes the pool: this process's first (every device of a mesh holds
    the same share of weights and pages)."""
    return jax.local_devices()[0]


def pool_inputs(model, draft_model, embed_dtype) -> PoolInputs:
    """What config.size_pool sizes the KV pool from: the allocator's stats of every process's first
    device (the loaded weights, a draft model's too, are allocated already: memory in use counts
    them), the host's RAM, and how the model splits each block over its mesh. embed_dtype: the
    dtype of the model's activations (None: float32)."""
    mesh = model_mesh(model)
    tp = 1 if mesh is None else mesh.shape["tensor"]
    pp = 1 if mesh is None else mesh.shape["pipeline"]   # pipeline ranks hold their layers' pages only
    device = pool_device()
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    return PoolInputs(stats=stats_of_every_process(device.memory_stats()), platform=device.platform,
                      host_ram=ram, env=dict(os.environ),
                      kv_shards=(tp if model.cfg.n_kv_heads % tp == 0 else 1) * pp,
                      draft=None if draft_model is None else draft_model.cfg,
                      activation_dtype_bytes=embed_dtype.itemsize if embed_dtype is not None else 4)


def stats_of_every_process(stats: dict | None) -> tuple[dict | None, ...]:
    """(this process's allocator stats, then every other process's): multi-host, every process must
    allocate the same pool (one global array), the largest that fits on all of them."""
    if jax.process_count() == 1:
        return (stats,)
    from jax.experimental import multihost_utils
    known = bool(stats) and "bytes_limit" in stats
    values = (int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))) if known else (0, 0)
    # 31-bit halves: jax gathers int32 unless 64-bit mode is on
    row = np.array([known] + [half for v in values for half in (v >> 31, v & 0x7FFFFFFF)], np.int32)
    every = np.asarray(multihost_utils.process_allgather(row))

    def unpacked(r) -> dict | None:
        return {"bytes_limit": int(r[1]) << 31 | int(r[2]), "bytes_in_use": int(r[3]) << 31 | int(r[4])} if r[0] else None
    return (stats, *(unpacked(r) for i, r in enumerate(every) if i != jax.process_index()))
