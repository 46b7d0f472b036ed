"""Choose QAT's hyperparameters on the held-out slice of its own training text (never on an
evaluation text): each configuration runs jaxinfer.quantize.qat.qat_train on the text, and the
score is the held-out slice's KL(float || fake-quantized) per token at the best epoch, the very
number QAT's early stopping minimises. Nothing here reads heldout.txt or any other evaluation text.

    python scripts/qat_sweep.py [--text checkpoints/jaxinfer-tiny-llama/calibration.txt]
        [--format w4-pc] --config lr=3e-5 --config lr=1e-4 --config lr=1e-4,nll_weight=0.1 ...
        [--out bench/results/2026-11-26-cpu-qat-sweep.json]

A --config is comma-separated qat_train keyword arguments (lr, steps, batch, nll_weight,
temperature, trainable, patience); unset ones take qat.py's defaults at the time of the run (each
row records them as "resolved"). Results are appended to
--out (one row per configuration: every epoch's held-out KL, the best, the wall time), so a
sweep can be run in stages.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
FORMATS = {"w4-pc": (4, -1, False), "w4-g128": (4, 128, False), "w3-g128": (3, 128, False)}
TYPES = {"lr": float, "steps": int, "batch": int, "nll_weight": float, "temperature": float, "trainable": str,
         "patience": int, "heldout": float, "seed": int}


def parse_config(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        if key not in TYPES:
            raise SystemExit(f"unknown --config key {key!r}; known: {', '.join(TYPES)}")
        out[key] = TYPES[key](value)
    return out


def run_config(path: Path, ids: np.ndarray, fmt: str, config: dict) -> dict:
    from jaxinfer.quantize.qat import qat_train
    from jaxinfer.weights import load_model
    bits, group, sym = FORMATS[fmt]
    model, _ = load_model(path, "float32")
    events = []
    t0 = time.perf_counter()
    qat_train(model, bits=bits, group_size=group, symmetric=sym, tokens=ids, progress=False, log=events.append,
              **config)
    epochs = [{k: e[k] for k in ("epoch", "step", "heldout_kl")} for e in events if e["event"] == "qat_epoch"]
    done = next(e for e in events if e["event"] == "qat_done")
    data = next(e for e in events if e["event"] == "qat_data")
    from jaxinfer.quantize import qat
    resolved = {k: config.get(k, getattr(qat, f"DEFAULT_{k.upper()}", None)) for k in TYPES}
    resolved["seed"] = config.get("seed", 0)
    return {"config": config, "resolved": resolved, "format": fmt, "epochs": epochs, "best_epoch": done["best_epoch"],
            "best_step": done["best_step"], "best_heldout_kl": done["heldout_kl"],
            "rtn_heldout_kl": epochs[0]["heldout_kl"],
            "kl_removed": 1 - done["heldout_kl"] / epochs[0]["heldout_kl"],
            "train_tokens": data["train_tokens"], "heldout_tokens": data["heldout_tokens"],
            "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/jaxinfer-tiny-llama")
    ap.add_argument("--text", default=None, help="training text (default: MODEL/calibration.txt)")
    ap.add_argument("--format", default="w4-pc", choices=list(FORMATS))
    ap.add_argument("--config", action="append", default=[], help="e.g. lr=1e-4,nll_weight=0.1 (repeatable)")
    ap.add_argument("--out", default="bench/results/2026-11-26-cpu-qat-sweep.json")
    args = ap.parse_args()
    from jaxinfer.tokenizer import load_tokenizer
    path = Path(args.model)
    text = Path(args.text) if args.text else path / "calibration.txt"
    ids = np.asarray(load_tokenizer(path).encode(text.read_text(encoding="utf-8")), np.int32)
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {
        "benchmark": "QAT hyperparameters on the held-out slice of the training text", "model": str(path),
        "text": str(text), "score": "held-out slice KL(float || fake-quantized) per token, nats, at the best epoch",
        "cpu": platform.processor() or platform.machine(), "command": "python scripts/qat_sweep.py", "rows": []}
    for config in map(parse_config, args.config or [""]):
        row = run_config(path, ids, args.format, config)
        result["rows"].append(row)
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in row.items() if k != "epochs"}), flush=True)


if __name__ == "__main__":
    main()
