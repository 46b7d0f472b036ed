"""Tiny on-disk autotuner for kernel launch parameters (block sizes, warps, stages), with a
process-wide measuring budget.

    cfg = autotune("quant_matmul_int4", shape_class(m, k, n), candidates, run)

On first use for a (device kind, jax version, kernel name, shape class) key, every candidate is run
once as a warm-up (compilation), then timed ``iters`` times (blocking on the result); the candidate
with the smallest median time wins and is written to a JSON cache file. Later calls (in this or any
other process) return the cached winner without measuring, as long as it is still one of the
candidates. A launch config shipped for the key in a kernel's table of tuned sizes (the TUNED table of
quant_matmul_tuned.py) counts as a cached winner when this machine has measured none. On CPU nothing
is measured, and neither is it anywhere with ``$JAXINFER_AUTOTUNE=0``: there ``untuned_config`` is
returned, the shipped config for the key if there is one, else ``candidates[0]`` (the defaults).

Budget. Measuring compiles every candidate, and a GPU compile takes up to seconds, so the time one
process spends measuring (compiles included, all keys together) is bounded by
``$JAXINFER_AUTOTUNE_BUDGET_S`` (default ``DEFAULT_BUDGET_S``; ``inf``: unbounded; ``0``: measure
nothing, use cached winners only). The budget is checked before each candidate. Once it is spent:
* a key cut partway uses the best candidate measured so far in this process; what it measured is
  saved as a partial entry (no winner: other processes do not use it as one) so that a later
  process measures only the candidates still missing and then caches the winner of them all;
* a key not measured at all uses ``candidates[0]``; nothing is written for it;
* the key's config is remembered for the rest of the process (the same key always gets the same
  config in one process), and later processes, each with a budget of its own, go on where this
  one stopped until every key is cached.

Cache file: ``cache_path`` or ``$JAXINFER_AUTOTUNE_CACHE`` or ``~/.cache/jaxinfer/autotune.json``.
Updates re-read the file under a lock, then write a temporary file in the same folder and
``os.replace`` it, so concurrent writers never leave a torn file.

This module imports jax only.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pallas_kernels import quant_matmul_tuned

__all__ = ["autotune", "untuned_config", "shape_class", "cache_key", "default_cache_path", "device_kind",
           "load_cache", "clear_memory_cache", "DEFAULT_BUDGET_S", "budget_seconds", "budget_summary",
           "log_budget_summary"]

log = logging.getLogger(__name__)

# Seconds of measuring (compiles included) one process may spend, all keys together. The 8B
# shape's int4 path has a key per projection (4) and per M class its token buckets reach (the
# weight-only matmuls class M as 1, 2, 4, 8, 16, then powers of two up to 512: up to 40 keys) of up
# to 16 candidates each (tiled, split-K and XLA's own: jaxinfer.quant.pallas_block_candidates): some
# 600 compiles, minutes of measuring if done in one go. 10 s plus the one candidate that may
# run past it (a compile, a second or two) leaves ~18 s of a 30 s cold start to loading and XLA's
# own compile of the step programs (a bf16 first request takes a few seconds in all on a GPU).
DEFAULT_BUDGET_S = 10.0
BUDGET_ENV = "JAXINFER_AUTOTUNE_BUDGET_S"

_LOCK = threading.RLock()
_MEMO: dict[tuple[str, str], dict] = {}
_FORMAT_VERSION = 1


@dataclasses.dataclass
class _Spending:
    """What this process has measured (clear_memory_cache starts afresh, as a new process would)."""
    spent_s: float = 0.0                                     # measuring time, compiles included
    tuned: set[str] = dataclasses.field(default_factory=set)     # keys measured to the end (cached)
    partial: set[str] = dataclasses.field(default_factory=set)   # keys cut partway: best so far
    untuned: set[str] = dataclasses.field(default_factory=set)   # keys left at candidates[0]
    ran_out: bool = False                                    # the budget has stopped a measurement
    summarized: bool = False                                 # log_budget_summary has warned


_SPENDING = _Spending()


def default_cache_path() -> str:
    env = os.environ.get("JAXINFER_AUTOTUNE_CACHE")
    if env:
        return os.path.expanduser(env)
    return os.path.join(os.path.expanduser("~"), ".cache", "jaxinfer", "autotune.json")


def device_kind() -> str:
    """'<backend>:<device kind>' of the default device, e.g. 'gpu:NVIDIA H100 80GB HBM3', 'cpu:cpu'."""
    return f"{jax.default_backend()}:{jax.devices()[0].device_kind}"


def budget_seconds() -> float:
    """This process's measuring budget: $JAXINFER_AUTOTUNE_BUDGET_S (seconds; 'inf' for none) or
    DEFAULT_BUDGET_S; an unreadable value is logged once and the default used."""
    return _parse_budget(os.environ.get(BUDGET_ENV, ""))


@functools.lru_cache(maxsize=8)
def _parse_budget(raw: str) -> float:
    if not raw.strip():
        return DEFAULT_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value):
        log.warning("autotune: %s=%r is not a number of seconds; using %g s", BUDGET_ENV, raw, DEFAULT_BUDGET_S)
        return DEFAULT_BUDGET_S
    return max(value, 0.0)


def budget_summary() -> dict:
    """This process's measuring so far: budget_s, spent_s, and how many keys were tuned (cached),
    cut partway (best so far) and left at their defaults."""
    with _LOCK:
        s = _SPENDING
        return {"budget_s": budget_seconds(), "spent_s": s.spent_s, "tuned": len(s.tuned),
                "partial": len(s.partial), "left_default": len(s.untuned)}


def log_budget_summary() -> dict:
    """Once per process, after the budget has cut tuning short (the engine's warm-up, where every
    key is first used, is the natural time), one warning naming the keys left untuned. -> summary."""
    summary = budget_summary()
    with _LOCK:
        if not _SPENDING.ran_out or _SPENDING.summarized:
            return summary
        _SPENDING.summarized = True
    log.warning("autotune: the measuring budget of %g s (%s) ran out: %d kernel shape(s) left at their "
                "default launch configs and %d measured partway in this process (%d tuned); they are not "
                "cached as final, so later processes go on tuning where this one stopped",
                summary["budget_s"], BUDGET_ENV, summary["left_default"], summary["partial"], summary["tuned"])
    return summary


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
    """The cache file's entries ({key: {"config": ..., "median_s": ..., ...}}; a key measured
    partway: {"partial": true, "measured": ..., ...} without "config"); {} if absent/corrupt."""
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


def _store(path: str, key: str, update: Callable[[Any], dict | None]) -> None:
    """entries[key] = update(the entry on disk now, or None); update returning None writes nothing."""
    with _LOCK:
        entries = load_cache(path)          # merge with whatever other writers stored meanwhile
        entry = update(entries.get(key))
        if entry is None:
            return
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
    """Forget in-process winners and this process's spent budget, as in a fresh process (the next
    call re-reads the file)."""
    global _SPENDING
    with _LOCK:
        _MEMO.clear()
        _SPENDING = _Spending()


def _measure(cfg: dict, run: Callable[[dict], Any], warmup: int, iters: int) -> float:
    for _ in range(max(warmup, 0)):
        jax.block_until_ready(run(cfg))
    times = []
    for _ in range(max(iters, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(run(cfg))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _earlier_progress(entry: Any, candidates: list[dict]) -> tuple[dict[int, float], set[int]]:
    """A partial entry's measurements of these candidates: ({index: median_s}, failed indices)."""
    measured: dict[int, float] = {}
    failed: set[int] = set()
    if not isinstance(entry, dict) or not entry.get("partial"):
        return measured, failed
    try:
        for rec in entry.get("measured", []):
            if rec["config"] in candidates:
                measured[candidates.index(rec["config"])] = float(rec["median_s"])
        for cfg in entry.get("failed_configs", []):
            if cfg in candidates:
                failed.add(candidates.index(cfg))
    except (KeyError, TypeError, ValueError):    # a malformed entry: start over
        return {}, set()
    return measured, failed


# the tables of tuned launch sizes shipped beside the kernels: device kind -> kernel -> shape class -> config
_SHIPPED_TABLES = (quant_matmul_tuned,)


def _shipped_config(dev: str, kernel_name: str, key: str) -> dict | None:
    """A launch config for this key shipped in a kernel's table of tuned sizes, or None."""
    shape = key.rsplit("|", 1)[-1]
    for table in _SHIPPED_TABLES:
        cfg = table.tuned_config(dev, kernel_name, shape)
        if cfg is not None:
            return cfg
    return None


def untuned_config(kernel_name: str, shape_class_key: Any, candidates: Sequence[dict], *,
                   device_key: str | None = None) -> dict:
    """What runs when nothing is measured: the config shipped for this device kind, kernel and
    shape class (the kernels' tables of tuned sizes) where it is one of `candidates`, else
    candidates[0]. A shipped config that is no longer a candidate (the candidate lists changed
    since it was measured) is not used."""
    dev = device_kind() if device_key is None else str(device_key)
    shipped = _shipped_config(dev, kernel_name, cache_key(kernel_name, shape_class_key, device_key=dev))
    return dict(shipped if shipped is not None and shipped in candidates else candidates[0])


def _entry_fields(kernel_name: str, key: str, dev: str) -> dict:
    return {"device_kind": dev, "jax_version": jax.__version__, "kernel": kernel_name,
            "shape_class": key.rsplit("|", 1)[-1], "time": time.time()}


def autotune(kernel_name: str, shape_class_key: Any, candidates: Sequence[dict],
             run: Callable[[dict], Any], *, cache_path: str | None = None, force: bool = False,
             device_key: str | None = None, warmup: int = 1, iters: int = 5) -> dict:
    """Returns the fastest of `candidates` (JSON-serialisable dicts) for this key, cached on disk.

    run(cfg) launches the kernel with cfg and returns its output (blocked on for timing).
    On CPU, or with $JAXINFER_AUTOTUNE=0, returns untuned_config (a shipped config for the key,
    else candidates[0]) without measuring, unless force=True. device_key overrides the device part
    of the cache key (a key starting with 'cpu' counts as CPU); candidates that raise are skipped; if
    all raise, RuntimeError. Measuring stops when this process's budget is spent (module docstring):
    the best so far, or candidates[0].
    """
    candidates = [dict(c) for c in candidates]
    if not candidates:
        raise ValueError("autotune needs at least one candidate")
    dev = device_kind() if device_key is None else str(device_key)
    if not force and (dev.lower().startswith("cpu") or os.environ.get("JAXINFER_AUTOTUNE", "1") == "0"):
        return untuned_config(kernel_name, shape_class_key, candidates, device_key=dev)
    if len(candidates) == 1:
        return dict(candidates[0])

    path = os.path.abspath(os.path.expanduser(cache_path or default_cache_path()))
    key = cache_key(kernel_name, shape_class_key, device_key=dev)
    with _LOCK:
        hit = _MEMO.get((path, key))    # a cached winner, or what this process settled on
        if hit is not None and hit in candidates:
            return dict(hit)
        entry = load_cache(path).get(key)
        if isinstance(entry, dict) and entry.get("config") in candidates:
            _MEMO[(path, key)] = entry["config"]
            return dict(entry["config"])
        shipped = _shipped_config(dev, kernel_name, key)
        if shipped is not None and shipped in candidates:
            _MEMO[(path, key)] = shipped
            return dict(shipped)

    # candidates measured by earlier processes (a partial entry) are not measured again
    measured, failed = _earlier_progress(entry, candidates)
    earlier = len(measured) + len(failed)
    errors: list[str] = []
    budget = budget_seconds()
    cut = False
    for i, cfg in enumerate(candidates):
        if i in measured or i in failed:
            continue
        if _SPENDING.spent_s >= budget:
            cut = True
            break
        t0 = time.perf_counter()
        try:
            measured[i] = _measure(cfg, run, warmup, iters)
        except Exception as e:  # noqa: BLE001 -- a candidate that does not compile/fit is skipped
            failed.add(i)
            errors.append(f"{cfg}: {type(e).__name__}: {e}")
            log.debug("autotune %s: candidate %s failed: %s", kernel_name, cfg, e)
        finally:
            with _LOCK:
                _SPENDING.spent_s += time.perf_counter() - t0
    if cut:
        return _settle_partway(path, key, kernel_name, dev, candidates, measured, failed, earlier)
    if not measured:
        raise RuntimeError(f"autotune {kernel_name} [{shape_class_key}]: every candidate failed:\n"
                           + "\n".join(errors or ["(in an earlier process)"]))
    best_i = min(measured, key=lambda i: (measured[i], i))
    winner = candidates[best_i]
    final = dict(_entry_fields(kernel_name, key, dev), config=winner, median_s=measured[best_i],
                 measured=[{"config": candidates[i], "median_s": measured[i]}
                           for i in sorted(measured, key=lambda i: (measured[i], i))],
                 failed=len(failed))
    try:
        _store(path, key, lambda _old: final)
    except OSError as e:
        log.warning("autotune: could not write cache %s (%s)", path, e)
    with _LOCK:
        _MEMO[(path, key)] = winner
        _SPENDING.tuned.add(key)
    log.info("autotune %s [%s]: %s (%.3g ms)", kernel_name, key, winner, measured[best_i] * 1e3)
    return dict(winner)


def _settle_partway(path: str, key: str, kernel_name: str, dev: str, candidates: list[dict],
                    measured: dict[int, float], failed: set[int], earlier: int) -> dict:
    """The budget stopped this key: its best so far (or candidates[0]) for the rest of this process;
    what was measured here is saved as a partial entry for later processes."""
    if measured:
        best_i = min(measured, key=lambda i: (measured[i], i))
        cfg = candidates[best_i]
    else:
        cfg = candidates[0]
    if len(measured) + len(failed) > earlier:
        def update(old):
            if isinstance(old, dict) and old.get("config") in candidates:
                return None                    # another process finished this key meanwhile
            more, more_failed = _earlier_progress(old, candidates)   # or measured some of it meanwhile
            times = {**more, **measured}
            broken = (more_failed | failed) - set(times)
            return dict(_entry_fields(kernel_name, key, dev), partial=True, candidates=len(candidates),
                        measured=[{"config": candidates[i], "median_s": t} for i, t in sorted(times.items())],
                        failed_configs=[candidates[i] for i in sorted(broken)])
        try:
            _store(path, key, update)
        except OSError as e:
            log.warning("autotune: could not write cache %s (%s)", path, e)
    with _LOCK:
        _MEMO[(path, key)] = cfg
        (_SPENDING.partial if measured else _SPENDING.untuned).add(key)
        first = not _SPENDING.ran_out
        _SPENDING.ran_out = True
    if first:
        log.info("autotune: the measuring budget of %g s (%s) is spent (%.3g s measured, %d keys tuned); "
                 "%s keeps %s (%d of %d candidates measured) and keys not tuned yet keep their defaults "
                 "in this process", budget_seconds(), BUDGET_ENV, _SPENDING.spent_s, len(_SPENDING.tuned),
                 key, cfg, len(measured) + len(failed), len(candidates))
    return dict(cfg)
