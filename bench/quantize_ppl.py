"""Held-out perplexity and CPU decode speed of the bundled model under each weight quantization
method (RTN, GPTQ, AWQ) and format (w8 per channel, w4 g128, w4 per channel, w3 g128), beside
float32 and int8 KV, in one run.

    python -m bench.quantize_ppl [--calib-tokens 8192] [--out bench/results/DATE-cpu-quantize-ppl.json]

Calibration text: the model's calibration.txt (documents of its training split); evaluation text:
its heldout.txt (the held-out split): disjoint by construction (checkpoints/.../MODEL_CARD.md).
Perplexity is jaxinfer.evaluate.eval_ppl (window 256, stride 128), as `jaxinfer eval-ppl`.
Decode speed: Generator.from_pretrained on the saved checkpoint, one stream, greedy, 128 new
tokens after a warm-up request; the packing (hence speed) depends only on the format, so it is
measured once per format (on the RTN checkpoint). The JSON is rewritten after every row.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

FORMATS = {"w8-pc": (8, -1, True), "w4-g128": (4, 128, False), "w4-pc": (4, -1, False), "w3-g128": (3, 128, False)}
METHODS = ("rtn", "gptq", "awq")     # --methods rtn,gptq,awq,smoothquant adds W8A8 (at w8-pc)


def decode_tok_s(folder: Path, kv_dtype: str | None = None, n_tokens: int = 128) -> float:
    from jaxinfer import Generator, SamplingParams
    gen = Generator.from_pretrained(str(folder), dtype="float32", kv_dtype=kv_dtype, max_num_seqs=1,
                                    max_num_batched_tokens=64)
    prompt = gen.tokenizer.encode("And Joseph said unto his brethren,")
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    gen.generate([prompt], params)                       # warm-up: every shape compiled
    t0 = time.perf_counter()
    out = gen.generate([prompt], params)[0]
    dt = time.perf_counter() - t0
    gen.close()
    return len(out.token_ids) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/jaxinfer-tiny-llama")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--out", default="bench/results/2026-11-22-cpu-quantize-ppl.json")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()

    from jaxinfer.evaluate import eval_ppl
    from jaxinfer.quantize import QuantizeSettings, quantize_model
    from jaxinfer.quantize.calibrate import calibration_windows
    from jaxinfer.tokenizer import load_tokenizer
    from jaxinfer.weights import load_model, save_native

    path = Path(args.model)
    tok = load_tokenizer(path)
    heldout = (path / "heldout.txt").read_text(encoding="utf-8")
    calib = path / "calibration.txt"
    windows = calibration_windows(tok.encode(calib.read_text(encoding="utf-8")), args.calib_tokens, 256)
    result = {"benchmark": "weight quantization methods: held-out perplexity and CPU decode speed",
              "date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
              "cpu": platform.processor() or platform.machine(), "model": str(path),
              "eval_text": str(path / "heldout.txt"), "calib_text": str(calib),
              "calib_tokens": int(windows.size), "calib_windows": int(windows.shape[0]),
              "command": "python -m bench.quantize_ppl", "note": "w4/w3 asymmetric (zero points), w8 symmetric "
              "per channel; GPTQ with act-order (static groups); decode: batch 1, greedy, 128 tokens",
              "rows": []}
    out = Path(args.out)

    def add(row):
        result["rows"].append(row)
        base = result["rows"][0]["ppl"]
        for r in result["rows"]:
            r["ppl_rise_percent"] = 100 * (r["ppl"] / base - 1)
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: row[k] for k in row if k not in ("tokens", "bytes")}), flush=True)

    model, _ = load_model(path, "float32")
    for kv in (None, "int8"):
        r = eval_ppl(model, tok, heldout, kv_dtype=kv)
        add({"method": "float32", "format": "float32" if kv is None else "float32 + int8 KV", "kv_dtype": kv,
             "ppl": r["ppl"], "bits_per_byte": r["bits_per_byte"], "tokens": r["tokens"],
             "decode_tok_s": decode_tok_s(path, kv)})
    tmp = Path(tempfile.mkdtemp(prefix="quantize-ppl-"))
    for fmt in args.formats.split(","):
        bits, g, sym = FORMATS[fmt]
        for method in args.methods.split(","):
            if method == "smoothquant" and fmt != "w8-pc":
                continue                                  # W8A8 only
            settings = QuantizeSettings(method, bits=bits, group_size=g, symmetric=sym,
                                        act_order=method == "gptq", calib_tokens=args.calib_tokens)
            model, _ = load_model(path, "float32")
            t0 = time.perf_counter()
            quantize_model(model, settings, None if method == "rtn" else windows, progress=False)
            quantize_s = time.perf_counter() - t0
            folder = tmp / f"{method}-{fmt}"
            save_native(model, folder, "float32", tokenizer=tok, extra={"quantization": settings.to_json()})
            r = eval_ppl(model, tok, heldout)
            add({"method": method, "format": fmt, "bits": bits, "group_size": g, "symmetric": sym,
                 "ppl": r["ppl"], "bits_per_byte": r["bits_per_byte"], "tokens": r["tokens"],
                 "quantize_s": quantize_s,
                 "decode_tok_s": decode_tok_s(folder) if method in ("rtn", "smoothquant") else None})
    # the targets: share of RTN's perplexity rise that GPTQ / AWQ remove
    rows = {(r["method"], r["format"]): r for r in result["rows"]}
    base = rows[("float32", "float32")]["ppl"]
    targets = {}
    for fmt in ("w4-pc", "w3-g128"):
        if ("rtn", fmt) not in rows:
            continue
        rise = rows[("rtn", fmt)]["ppl"] - base
        cut = {m: 1 - (rows[(m, fmt)]["ppl"] - base) / rise for m in ("gptq", "awq") if (m, fmt) in rows}
        targets[fmt] = {"rtn_rise": rise, "cut_of_rtn_rise": cut,
                        "each_at_least_30pct": all(c >= 0.30 for c in cut.values()),
                        "best_at_least_50pct": max(cut.values(), default=0) >= 0.50}
    result["targets"] = targets
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(targets, indent=1))


if __name__ == "__main__":
    main()
