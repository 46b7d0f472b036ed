"""A part's records: one flushed JSON line {"key": [...], "value": ...} per number, written by the
part's process as soon as it has the number (Recorder) and merged by the parent (read_records), so a
part killed at its timeout keeps what it measured. Imports neither jax nor jaxinfer: the parent never
starts a device backend, and a test's stand-in part writes records without importing jax.
"""
from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np


class Recorder:
    """Appends {"key": [...], "value": ...} lines to a JSON-lines file, flushed as written, and
    prints a short progress line into the part's log."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.t0 = time.perf_counter()

    def put(self, key: tuple[str, ...], value: Any) -> None:
        line = json.dumps({"key": list(key), "value": value}, default=_jsonable)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        text = json.dumps(value, default=_jsonable)
        print(f"{time.perf_counter() - self.t0:7.1f}s [{'/'.join(key)}] {text[:300]}", flush=True)

    def guarded(self, key: tuple[str, ...], fn: Callable[[], Any], record: bool = True) -> Any:
        """Record fn()'s value at key (unless record=False), or its error there, and go on; returns
        the value, or None when fn failed."""
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 -- one failed measurement must not lose the others
            tb = traceback.format_exc(limit=6)
            self.put(key, {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": tb[-3000:]})
            return None
        if record:
            self.put(key, value)
        return value


def _jsonable(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def read_records(path: Path) -> dict[str, Any]:
    """Merge a part's {"key": [...], "value": ...} lines into one nested dict (a torn last line of a
    killed part is skipped)."""
    merged: dict[str, Any] = {}
    if not path.exists():
        return merged
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        *parents, last = rec["key"]
        node = merged
        for k in parents:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        old, new = node.get(last), rec["value"]
        node[last] = {**old, **new} if isinstance(old, dict) and isinstance(new, dict) else new
    return merged
