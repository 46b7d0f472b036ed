"""Held-out perplexity and CPU decode speed of the bundled model under each weight quantization
method (RTN, GPTQ, AWQ, QAT) and format (w8 per channel, w4 g128, w4 per channel, w3 g128), FP8
(e4m3) weights (dequantized, the CPU path; and "native", the GPU path: activations per token to
e4m3 and an fp8 x fp8 dot, which XLA:CPU emulates with the same arithmetic), SmoothQuant W8A8
(dynamic, and static with each calibration), beside float32 and int8 / fp8 KV, in one run.

    python -m bench.quantize_ppl [--calib-tokens N] [--out bench/results/DATE-cpu-quantize-ppl.json]
        [--methods rtn,gptq,awq,qat,qat-control,smoothquant,fp8] [--formats w8-pc,w4-g128,w4-pc,w3-g128]
        [--ood-text /work/cache/ood/fortunes-min.txt]   (scripts/prepare_ood_text.py rebuilds it)
        [--train-text MODEL/calibration.txt | --train-bin FILE]   (QAT's training text)

Calibration reads all of calibration.txt (43,776 tokens in 256-token windows) unless --calib-tokens
says fewer: which text calibrates moves every rounding decision, and on this model that alone
moves the held-out perplexity by up to a third of RTN's w3 g128 rise (GPTQ w3 g128: 37.67 on the
first 32,768 tokens, 37.44 on the last 32,768, 37.61 on all; 37.91 on the first 16,384).

Calibration text: the model's calibration.txt (documents of its training split); evaluation texts:
its heldout.txt (the held-out split, disjoint by construction: checkpoints/.../MODEL_CARD.md) and,
out of its domain, the fortunes of Debian's fortunes-min (scripts/prepare_ood_text.py; nothing was
trained, calibrated or tuned on it). Every row is scored on both (ppl, ood_ppl).
Perplexity is jaxinfer.evaluate.eval_ppl (window 256, stride 128), as `jaxinfer eval-ppl`.

QAT rows (w4 per channel; qat.py's defaults, trained on --train-text, by default calibration.txt
like the calibrated methods, of which qat.py holds out 10% for its early stopping):
    qat          distillation from the float model's logits with fake quantization, then RTN
    qat-control  the same training (loss, steps, early stopping on the held-out KL of its RTN export)
                 without fake quantization, then RTN: QAT's own effect is the difference. With the
                 default loss, KL to the float model, its gradient is rounding noise, which AdamW's
                 normalisation turns into small random steps; they only raise the held-out KL, so
                 early stopping keeps epoch 0 and its export is RTN's
Decode speed: Generator.from_pretrained on the saved checkpoint, one stream, greedy, 128 new
tokens after a warm-up request; the packing (hence speed) depends only on the format, so it is
measured once per format (on the RTN checkpoint). The JSON is rewritten after every row.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

FORMATS = {"w8-pc": (8, -1, True), "w4-g128": (4, 128, False), "w4-pc": (4, -1, False), "w3-g128": (3, 128, False)}
METHODS = ("rtn", "gptq", "awq", "qat", "qat-control", "smoothquant", "fp8")
QAT_VARIANTS = {"qat": {}, "qat-control": {"fake": False}}
# W8A8 rows (at w8-pc): the activation scales and their calibration
W8A8 = {"dynamic": dict(act_scales="dynamic"),
        "static minmax": dict(act_scales="static", act_calib="minmax"),
        "static p99.99": dict(act_scales="static", act_calib="percentile", act_percentile=99.99),
        "static p99.999": dict(act_scales="static", act_calib="percentile", act_percentile=99.999),
        "static mse": dict(act_scales="static", act_calib="mse"),
        "static asym minmax": dict(act_scales="static", act_calib="minmax", act_symmetric=False),
        "static asym p99.99": dict(act_scales="static", act_calib="percentile", act_percentile=99.99,
                                   act_symmetric=False),
        "static asym mse": dict(act_scales="static", act_calib="mse", act_symmetric=False)}
QAT_FORMATS = ("w4-pc",)             # QAT trains one model per format: the issue's target format


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


def rtn_cuts(rows: dict, fmt: str, field: str, methods) -> dict | None:
    """The share of RTN's rise in `field` (ppl or ood_ppl) over float32 that each method removes."""
    base = rows[("float32", "float32")].get(field)
    if ("rtn", fmt) not in rows or base is None:
        return None
    rise = rows[("rtn", fmt)][field] - base
    return {"rtn_rise": rise, "cut_of_rtn_rise": {m: 1 - (rows[(m, fmt)][field] - base) / rise
                                                  for m in methods if (m, fmt) in rows}}


def qat_targets(rows: dict, fmt: str) -> dict:
    """QAT at fmt: >= 70% of RTN's held-out rise and >= 50% of its out-of-domain rise removed; and
    against the control (the same training without fake quantization): the share of the control's
    own RTN rise, over its fine-tuned float model, that QAT removes."""
    held, ood = rtn_cuts(rows, fmt, "ppl", QAT_VARIANTS), rtn_cuts(rows, fmt, "ood_ppl", QAT_VARIANTS)
    out = {"heldout": held, "ood": ood}
    if held and "qat" in held["cut_of_rtn_rise"]:
        out["qat_heldout_at_least_70pct"] = held["cut_of_rtn_rise"]["qat"] >= 0.70
    if ood and "qat" in ood["cut_of_rtn_rise"]:
        out["qat_ood_at_least_50pct"] = ood["cut_of_rtn_rise"]["qat"] >= 0.50
    control = rows.get(("qat-control", fmt))
    if control and ("qat", fmt) in rows:
        for field in ("ppl", "ood_ppl"):
            f = control["float"][field]
            out[f"qat_cut_of_control_rise_{field}"] = 1 - (rows[("qat", fmt)][field] - f) / (control[field] - f)
    return out


def issue_targets(result_rows: list[dict]) -> dict:
    """The issues' targets from a run's rows: the share of RTN's perplexity rise that GPTQ / AWQ /
    QAT remove (held out and out of domain), W8A8's and fp8's rises. A target whose rows the run did
    not make is None."""
    rows = {(r["method"], r["format"]): r for r in result_rows}
    base = rows[("float32", "float32")]["ppl"]
    targets = {}
    for fmt in ("w4-pc", "w3-g128"):
        held = rtn_cuts(rows, fmt, "ppl", ("gptq", "awq"))
        if held is None:
            continue
        cut = held["cut_of_rtn_rise"]
        targets[fmt] = {**held, "ood": rtn_cuts(rows, fmt, "ood_ppl", ("gptq", "awq")),
                        "each_at_least_30pct": all(c >= 0.30 for c in cut.values()) if cut else None,
                        "best_at_least_50pct": max(cut.values()) >= 0.50 if cut else None}
        if any((m, fmt) in rows for m in QAT_VARIANTS):
            targets[fmt]["qat"] = qat_targets(rows, fmt)
    rise = lambda key: 100 * (rows[key]["ppl"] / base - 1) if key in rows else None  # noqa: E731
    within = lambda key, limit: None if rise(key) is None else rise(key) <= limit  # noqa: E731
    targets["w8a8"] = {"dynamic_rise_percent": rise(("smoothquant", "w8a8 dynamic")),
                       "dynamic_within_1pct": within(("smoothquant", "w8a8 dynamic"), 1.0),
                       "static_rise_percent": {k: rise(("smoothquant", f"w8a8 {k}")) for k in W8A8 if k != "dynamic"}}
    targets["fp8"] = {"rise_percent": rise(("fp8", "fp8-e4m3-pc")),
                      "within_0.5pct": within(("fp8", "fp8-e4m3-pc"), 0.5),
                      "native_rise_percent": rise(("fp8", "fp8-e4m3-pc native")),
                      "native_within_0.5pct": within(("fp8", "fp8-e4m3-pc native"), 0.5)}
    return targets


def scores(model, tok, texts: dict[str, str], kv_dtype: str | None = None) -> dict:
    """Perplexity, bits per byte and scored tokens of the model on each text, keys prefixed by the
    text's name ("" for heldout.txt, "ood_" for the out-of-domain text)."""
    from jaxinfer.evaluate import eval_ppl
    out = {}
    for prefix, text in texts.items():
        r = eval_ppl(model, tok, text, kv_dtype=kv_dtype)
        out.update({f"{prefix}ppl": r["ppl"], f"{prefix}bits_per_byte": r["bits_per_byte"],
                    f"{prefix}tokens": r["tokens"]})
    return out


def train_qat(model, settings, variant: str, train_tokens: np.ndarray, tok, texts) -> dict:
    """QAT variant `variant` (QAT_VARIANTS) trained and exported in place -> the row's QAT fields:
    the epochs' held-out-slice KL, the exported epoch, the tokens; the control also scores its
    fine-tuned float model before export."""
    from jaxinfer.quantize.qat import export, qat_train
    events = []
    options = dict(trainable=settings.qat_trainable, nll_weight=settings.qat_nll_weight,
                   temperature=settings.qat_temperature, heldout=settings.qat_heldout) | QAT_VARIANTS[variant]
    qat_train(model, bits=settings.bits, group_size=settings.group_size, symmetric=settings.symmetric,
              tokens=train_tokens, steps=settings.qat_steps, batch=settings.qat_batch, window=settings.calib_window,
              lr=settings.qat_lr, seed=settings.seed, progress=False, log=events.append, **options)
    data = next(e for e in events if e["event"] == "qat_data")
    done = next(e for e in events if e["event"] == "qat_done")
    extra = {"qat_options": options, "train_tokens": data["train_tokens"],
             "heldout_slice_tokens": data["heldout_tokens"],
             "epochs_planned": data["epochs"], "best_epoch": done["best_epoch"], "best_step": done["best_step"],
             "heldout_slice_kl": [e["heldout_kl"] for e in events if e["event"] == "qat_epoch"]}
    if not QAT_VARIANTS[variant].get("fake", True):
        extra["float"] = scores(model, tok, texts)
    export(model, settings)
    return extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/jaxinfer-tiny-llama")
    ap.add_argument("--calib-tokens", type=int, default=None, help="default: all of calibration.txt")
    ap.add_argument("--out", default="bench/results/2026-11-22-cpu-quantize-ppl.json")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--ood-text", default="/work/cache/ood/fortunes-min.txt",
                    help="out-of-domain evaluation text (scripts/prepare_ood_text.py)")
    ap.add_argument("--train-text", default=None, help="QAT's training text (default: MODEL/calibration.txt)")
    ap.add_argument("--train-bin", default=None, help="QAT's training tokens, uint16, instead of --train-text")
    args = ap.parse_args()

    from jaxinfer.quantize.calibrate import calibration_windows
    from jaxinfer.tokenizer import load_tokenizer

    path = Path(args.model)
    tok = load_tokenizer(path)
    ood = Path(args.ood_text)
    if not ood.exists():
        raise SystemExit(f"{ood}: no out-of-domain text; build it with python scripts/prepare_ood_text.py")
    texts = {"": (path / "heldout.txt").read_text(encoding="utf-8"), "ood_": ood.read_text(encoding="utf-8")}
    calib = path / "calibration.txt"
    calib_ids = tok.encode(calib.read_text(encoding="utf-8"))
    args.calib_tokens = args.calib_tokens or len(calib_ids)
    windows = calibration_windows(calib_ids, args.calib_tokens, 256)
    train = Path(args.train_bin or args.train_text or calib)
    train_tokens = (np.fromfile(train, dtype=np.uint16) if args.train_bin else
                    np.asarray(tok.encode(train.read_text(encoding="utf-8")), np.int32))
    result = {"benchmark": "weight quantization methods: held-out and out-of-domain perplexity, CPU decode speed",
              "date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
              "cpu": platform.processor() or platform.machine(), "model": str(path),
              "eval_text": str(path / "heldout.txt"), "ood_text": str(ood),
              "ood_text_source": "Debian fortunes-min 1:1.99.1-7.3: fortunes, literature, riddles "
                                 "(scripts/prepare_ood_text.py)",
              "calib_text": str(calib), "calib_tokens": int(windows.size), "calib_windows": int(windows.shape[0]),
              "qat_train_data": str(train), "qat_train_text_tokens": int(train_tokens.size),
              "command": "python -m bench.quantize_ppl " + " ".join(sys.argv[1:]),
              "note": "w4/w3 asymmetric (zero points), w8 symmetric per channel; GPTQ with act-order (static "
              "groups) and the grid search (--clip-search); AWQ with its scale and clip searches (scored jointly, "
              "on X^T X of every calibration token; alpha in steps of 0.05, clip ratios in steps of 0.01); QAT: "
              "w4 per channel, defaults of jaxinfer/quantize/qat.py (distillation from the float model's logits, "
              "early-stopped on the held-out KL of 10% of its training text), trained on qat_train_data; "
              "qat-control: the same without fake quantization; "
              "decode: batch 1, greedy, 128 tokens", "rows": []}
    run_rows(args, result, path, tok, texts, windows, train_tokens)
    result["targets"] = issue_targets(result["rows"])
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["targets"], indent=1))


def run_rows(args, result: dict, path: Path, tok, texts: dict, windows: np.ndarray, train_tokens: np.ndarray) -> None:
    """Every row of the run into result["rows"], the JSON rewritten after each."""
    from jaxinfer.models.decoder import set_matmul_impl
    from jaxinfer.quantize import QuantizeSettings, quantize_model
    from jaxinfer.weights import load_model, save_native
    out = Path(args.out)

    def add(row):
        result["rows"].append(row)
        base = result["rows"][0]
        for r in result["rows"]:
            for field in ("ppl", "ood_ppl"):
                r[f"{field}_rise_percent"] = 100 * (r[field] / base[field] - 1)
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: row[k] for k in row if "tokens" not in k and k != "heldout_slice_kl"}), flush=True)

    model, _ = load_model(path, "float32")
    for kv in (None, "int8", "fp8"):
        add({"method": "float32", "format": "float32" if kv is None else f"float32 + {kv} KV", "kv_dtype": kv,
             **scores(model, tok, texts, kv), "decode_tok_s": decode_tok_s(path, kv)})
    tmp = Path(tempfile.mkdtemp(prefix="quantize-ppl-"))

    def run(method, fmt, settings, label=None, **extra):
        model, _ = load_model(path, "float32")
        t0 = time.perf_counter()
        if method in QAT_VARIANTS:
            extra.update(train_qat(model, settings, method, train_tokens, tok, texts))
        else:
            quantize_model(model, settings, None if method in ("rtn", "fp8") else windows, progress=False)
        quantize_s = time.perf_counter() - t0
        folder = tmp / f"{method}-{fmt}-{(label or '').replace(' ', '-')}"
        save_native(model, folder, "float32", tokenizer=tok, extra={"quantization": settings.to_json()})
        r = scores(model, tok, texts)
        if method == "fp8":   # the GPU path too: activations per token to e4m3, fp8 x fp8 dot (emulated here)
            set_matmul_impl(model, "pallas")
            add({"method": method, "format": f"{fmt} native", "bits": settings.bits, "group_size": settings.group_size,
                 "symmetric": settings.symmetric, "qdot_impl": "pallas", "settings": settings.to_json(),
                 **scores(model, tok, texts), "quantize_s": None, "decode_tok_s": None})
        add({"method": method, "format": fmt if label is None else f"{fmt} {label}", "bits": settings.bits,
             "group_size": settings.group_size, "symmetric": settings.symmetric, **extra,
             "settings": settings.to_json(), **r, "quantize_s": quantize_s,
             "decode_tok_s": decode_tok_s(folder) if method in ("rtn", "smoothquant", "fp8") else None})

    for fmt in args.formats.split(","):
        bits, g, sym = FORMATS[fmt]
        for method in args.methods.split(","):
            if method in ("smoothquant", "fp8") and fmt != "w8-pc":
                continue                                  # W8A8 and fp8: 8 bits per channel
            if method in QAT_VARIANTS and fmt not in QAT_FORMATS:
                continue
            if method == "smoothquant":
                for label, kw in W8A8.items():
                    run(method, "w8a8", QuantizeSettings(method, bits=8, group_size=-1, symmetric=True,
                                                         calib_tokens=args.calib_tokens, **kw), label, **kw)
                continue
            if method == "fp8":
                run(method, "fp8-e4m3-pc", QuantizeSettings("fp8", bits=8, group_size=-1, symmetric=True))
                continue
            settings = QuantizeSettings("qat" if method in QAT_VARIANTS else method, bits=bits, group_size=g,
                                        symmetric=sym, act_order=method == "gptq", clip_search=method == "gptq",
                                        calib_tokens=args.calib_tokens)
            run(method, fmt, settings)


if __name__ == "__main__":
    main()
