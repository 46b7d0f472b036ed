"""What the benchmarks share: the device a run is on and its results file name, the model a run
reads, and the JSON + PNG report. (The engine flags they share with `jaxinfer serve` are
jaxinfer.config.flags', derived from EngineConfig.)

Imports nothing else from bench/ and never jaxinfer.cli: cli.py -> bench.benchmark -> bench.common
runs one way, and every bench script can use these without importing a benchmark it does not run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jaxinfer import perf

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------- device, model, results
def device_info() -> dict[str, Any]:
    import jax
    d = jax.devices()[0]
    return {"kind": str(d.device_kind), "platform": d.platform, "count": jax.device_count(),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def device_slug(info: dict[str, Any]) -> str:
    """The device's name in results file names (jaxinfer.perf's device table)."""
    return perf.device_slug(info["kind"], info["platform"])


def results_path(out: str | None, slug: str, mode: str) -> Path:
    return Path(out) if out else RESULTS_DIR / f"{time.strftime('%Y-%m-%d')}-{slug}-{mode}.json"


def model_config(path: Path):
    """ModelConfig of an HF or native folder without loading its weights."""
    from jaxinfer.models.hf_configs import model_config_from_hf
    from jaxinfer.weights import is_native, read_native_config
    return read_native_config(path)[0] if is_native(path) else model_config_from_hf(path)


def model_path(arg: str | None) -> Path:
    from jaxinfer.generator import default_model_path
    return Path(arg) if arg else default_model_path()


def parse_list(text: str, kind=int) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected a comma-separated list, got {text!r}") from None


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as a report's "config" (without the subcommand's handler)."""
    return {k: v for k, v in vars(args).items() if not callable(v)}


def release(gen) -> None:
    """Free a Generator's KV pages now (on a GPU the next Generator sizes its cache from free memory)."""
    gen.client.debug.free_kv_pages()
    gc.collect()


def write_report(report: dict[str, Any], out: Path, label_key: str, title: str, plot: bool = True) -> Path | None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=_json_default))
    return plot_points(report["points"], label_key, out.with_suffix(".png"), title) if plot else None


def _json_default(o: Any):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def plot_points(points: Sequence[dict[str, Any]], label_key: str, png: Path, title: str) -> Path:
    """Output-token throughput vs median TPOT (left) and vs median E2E latency (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, xlabel in ((axes[0], "tpot_ms", "median TPOT (ms)"), (axes[1], "e2el_ms", "median E2E latency (ms)")):
        pts = [p for p in points if p[key]["p50"] is not None and p["output_throughput"] is not None]
        xs = [p[key]["p50"] for p in pts]
        ys = [p["output_throughput"] for p in pts]
        ax.plot(xs, ys, "o-")
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(f"{label_key}={p[label_key]}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def write_json_atomic(obj: Any, out: Path) -> None:
    """Write obj as indented JSON to out through a temporary file and os.replace, so a run killed
    mid-write leaves the previous complete file (the GPU scripts rewrite theirs after each part)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, out)
