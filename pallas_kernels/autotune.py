"""Tiny on-disk autotuner for kernel launch parameters (block sizes, warps, stages).

    cfg = autotune("quant_matmul_int4", shape_class(m, k, n), candidates, run)

On first use for a (device kind, jax version, kernel name, shape class) key, every candidate is run
once as a warm-up (compilation), then timed ``iters`` times (blocking on the result); the candidate
with the smallest median time wins and is written to a JSON cache file. Later calls (in this or any
other process) return the cached winner without measuring, as long as it is still one of the
candidates. On CPU nothing is measured: ``candidates[0]`` (the defaults) is returned.

Cache file: ``cache_path`` or ``$JAXINFER_AUTOTUNE_CACHE`` or ``~/.cache/jaxinfer/autotune.json``.
Updates re-read the file under a lock, then write a temporary file in the same folder and
``os.replace`` it, so concurrent writers never leave a torn file.

This module imports jax only.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["autotune", "shape_class", "cache_key", "default_cache_path", "device_kind",
           "load_cache", "clear_memory_cache"]

log = logging.getLogger(__name__)

_LOCK = threading.RLock()
_MEMO: dict[tuple[str, str], dict] = {}
_FORMAT_VERSION = 1


def default_cache_path() -> str:
    env = os.environ.get("JAXINFER_AUTOTUNE_CACHE")
    if env:
        return os.path.expanduser(env)
    return os.path.join(os.path.expanduser("~"), ".cache", "jaxinfer", "autotune.json")


def device_kind() -> str:
    """'<backend>:<device kind>' of the default device, e.g. 'gpu:NVIDIA H100 80GB HBM3', 'cpu:cpu'."""
    return f"{jax.default_backend()}:{jax.devices()[0].device_kind}"


def _bucket(d: int) -> int:
    d = int(d)
    if d < 0:
        raise ValueError(f"dims must be >= 0, got {d}")
    return 1 if d <= 1 else 1 << (d - 1).bit_length()


def shape_class(*dims: int) -> str:
    """Buckets each dim up to a power of two: shape_class(5, 96, 4096) -> '8x128x4096'."""
    return "x".join(str(_bucket(d)) for d in dims)


def cache_key(kernel_name: str, shape_class_key: Any, *, device_key: str | None = None) -> str:
    """'<device kind>|jax=<version>|<kernel>|<shape class>'."""
    dev = device_kind() if device_key is None else str(device_key)
    if isinstance(shape_class_key, (tuple, list)):
        shape_class_key = "x".join(str(s) for s in shape_class_key)
    return f"{dev}|jax={jax.__version__}|{kernel_name}|{shape_class_key}"


def load_cache(cache_path: str | None = None) -> dict[str, dict]:
    """The cache file's entries ({key: {"config": ..., "median_s": ..., ...}}); {} if absent/corrupt."""
    path = cache_path or default_cache_path()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("autotune: ignoring unreadable cache %s (%s)", path, e)
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def _store(path: str, key: str, entry: dict) -> None:
    with _LOCK:
        entries = load_cache(path)          # merge with whatever other writers stored meanwhile
        entries[key] = entry
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".autotune.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": _FORMAT_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


def clear_memory_cache() -> None:
    """Forget in-process winners (the next call re-reads the file)."""
    with _LOCK:
        _MEMO.clear()


def _measure(cfg: dict, run: Callable[[dict], Any], warmup: int, iters: int) -> float:
    for _ in range(max(warmup, 0)):
        jax.block_until_ready(run(cfg))
    times = []
    for _ in range(max(iters, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(run(cfg))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def autotune(kernel_name: str, shape_class_key: Any, candidates: Sequence[dict],
             run: Callable[[dict], Any], *, cache_path: str | None = None, force: bool = False,
             device_key: str | None = None, warmup: int = 1, iters: int = 5) -> dict:
    """Returns the fastest of `candidates` (JSON-serialisable dicts) for this key, cached on disk.

    run(cfg) launches the kernel with cfg and returns its output (blocked on for timing).
    On CPU returns candidates[0] without measuring, unless force=True. device_key overrides the
    device part of the cache key (a key starting with 'cpu' counts as CPU); candidates that raise
    are skipped; if all raise, RuntimeError.
    """
    candidates = [dict(c) for c in candidates]
    if not candidates:
        raise ValueError("autotune needs at least one candidate")
    dev = device_kind() if device_key is None else str(device_key)
    if not force and dev.lower().startswith("cpu"):
        return dict(candidates[0])
    if len(candidates) == 1:
        return dict(candidates[0])

    path = os.path.abspath(os.path.expanduser(cache_path or default_cache_path()))
    key = cache_key(kernel_name, shape_class_key, device_key=dev)
    with _LOCK:
        hit = _MEMO.get((path, key))
        if hit is None:
            entry = load_cache(path).get(key)
            if isinstance(entry, dict) and entry.get("config") in candidates:
                hit = entry["config"]
                _MEMO[(path, key)] = hit
        if hit is not None and hit in candidates:
            return dict(hit)

    timings: list[tuple[float, int]] = []
    errors: list[str] = []
    for i, cfg in enumerate(candidates):
        try:
            timings.append((_measure(cfg, run, warmup, iters), i))
        except Exception as e:  # noqa: BLE001 -- a candidate that does not compile/fit is skipped
            errors.append(f"{cfg}: {type(e).__name__}: {e}")
            log.debug("autotune %s: candidate %s failed: %s", kernel_name, cfg, e)
    if not timings:
        raise RuntimeError(f"autotune {kernel_name} [{shape_class_key}]: every candidate failed:\n"
                           + "\n".join(errors))
    best_t, best_i = min(timings)
    winner = candidates[best_i]
    entry = {
        "config": winner,
        "median_s": best_t,
        "device_kind": dev,
        "jax_version": jax.__version__,
        "kernel": kernel_name,
        "shape_class": key.rsplit("|", 1)[-1],
        "measured": [{"config": candidates[i], "median_s": t} for t, i in sorted(timings)],
        "failed": len(errors),
        "time": time.time(),
    }
    try:
        _store(path, key, entry)
    except OSError as e:
        log.warning("autotune: could not write cache %s (%s)", path, e)
    with _LOCK:
        _MEMO[(path, key)] = winner
    log.info("autotune %s [%s]: %s (%.3g ms)", kernel_name, key, winner, best_t * 1e3)
    return dict(winner)
