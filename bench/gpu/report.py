"""`python -m bench.gpu`'s derived numbers, README table and PNG, from the raw measurements the parts
record (bench/gpu/parts.py). Every ratio and utilisation is computed here, once, from raw times and
byte counts kept in the JSON, so a reader (or tests/test_bench_gpu.py) can recompute each one.

Definitions (times in seconds, bytes, FLOPs):
    net_seconds(total, overhead, n) = max(total - overhead, total / 2) / n
        one kernel's time in a timed call that ran a chain of n kernels: the launch + sync cost of an
        empty jitted call (overhead) is subtracted, never more than half the call.
    a_vs_b = rate(a) / rate(b) = time(b) / time(a): > 1 means a is faster.
    bytes per decode token (batch 1) = weight bytes read + mean context * KV bytes per token, where
        weight bytes read = every parameter byte - the embedding table + one embedding row (a decode
        step gathers one row; the untied LM head is read in full), mean context = prompt_len + (N + 1) / 2
        (the N timed decode steps attend prompt_len + 1 .. prompt_len + N keys).
    MBU = bytes per decode token / TPOT / bandwidth, against the copy bandwidth measured in the same run
        and against the device's datasheet peak (jaxinfer.perf.device_for_kind).

Never imports jax (the parent process of `bench.gpu` must not start a device backend).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from jaxinfer import perf

VARIANTS = ("bf16", "int8", "int4", "fp8")          # weight dtypes of the engine parts, bf16 the baseline
ATTENTION_IMPLS = ("flash", "cudnn", "xla")
MATMUL_IMPLS = ("bf16", "xla_int8", "pallas_int8", "xla_int4", "pallas_int4")
RATIO_DEFINITION = "a_vs_b = rate(a) / rate(b) = time(b) / time(a); > 1 means a is faster"


def net_seconds(total_s: float, overhead_s: float, calls: int) -> float:
    """One call's seconds in a timed chain of `calls` (see the module docstring)."""
    return max(total_s - overhead_s, total_s / 2) / calls


def ratio(a: Any, b: Any) -> float | None:
    """a / b for two positive numbers, else None (a part that failed has no ratio)."""
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (a, b))
    return a / b if ok else None


def mean_context_tokens(prompt_len: int, decode_tokens: int) -> float:
    return prompt_len + (decode_tokens + 1) / 2


def _get(d: Any, *keys: str) -> Any:
    """d[k0][k1]... or None where a level is missing or holds an error."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    if isinstance(d, dict) and ("error" in d or "unavailable" in d):
        return None
    return d


def results(report: dict, part: str) -> dict:
    return (report.get("parts", {}).get(part) or {}).get("results") or {}


def device_kind(report: dict) -> str | None:
    return (report.get("device") or {}).get("kind")


# --------------------------------------------------------------------------- derived numbers
def engine_utilisation(report: dict) -> dict[str, dict]:
    """Per variant: bytes per decode token, bytes/s at batch 1, MBU vs the measured copy and the datasheet."""
    copy_gbps = _get(results(report, "ceilings"), "copy", "GBps")
    sheet = perf.device_for_kind(device_kind(report) or "")
    out = {}
    for v in VARIANTS:
        build, b1 = _get(results(report, v), "build"), _get(results(report, v), "batch1")
        if not build or not b1:
            continue
        per_token = build["weight_bytes_read_per_token"] + b1["mean_context_tokens"] * build["kv_bytes_per_token"]
        bps = per_token / b1["tpot_s"]
        out[v] = {"bytes_per_token": per_token, "bytes_per_s": bps,
                  "mbu_vs_copy": ratio(bps, copy_gbps * 1e9 if copy_gbps else None),
                  "mbu_vs_datasheet": ratio(bps, sheet.bandwidth if sheet else None)}
    return out


def engine_ratios(report: dict) -> dict[str, dict]:
    """vs_bf16: each quantized variant over bf16 (batch-1 decode tok/s, output tok/s per concurrency);
    vs_hf: each variant over HF transformers (batch 1, and the HF batch size)."""
    def rate(part: str, key: str) -> float | None:
        r = results(report, part)
        return _get(r, "batch1", "decode_tok_s") if key == "batch1" else _get(r, "concurrency", key, "output_tok_s")

    levels = ["batch1"] + [str(c) for c in (report.get("workload") or {}).get("concurrency", ())]
    hf_levels = ["batch1"] + list((results(report, "hf").get("concurrency") or {}).keys())
    vs_bf16 = {v: {k: ratio(rate(v, k), rate("bf16", k)) for k in levels} for v in VARIANTS if v != "bf16"}
    vs_hf = {v: {k: ratio(rate(v, k), rate("hf", k)) for k in hf_levels} for v in VARIANTS}
    return {"vs_bf16": vs_bf16, "vs_hf": vs_hf}


def kernel_ratios(report: dict) -> dict[str, dict]:
    """attention: flash over cuDNN and over XLA per T; matmul: each weight-only path over the bf16 dot,
    and the Pallas kernels over XLA's dequantize-and-dot, per projection and M."""
    kr = results(report, "kernels")
    attention = {}
    for t, case in (kr.get("attention") or {}).items():
        flash = _get(case, "flash", "per_call_s")
        attention[t] = {f"flash_vs_{b}": ratio(_get(case, b, "per_call_s"), flash) for b in ("cudnn", "xla")}
    matmul: dict[str, dict] = {}
    for proj, case in (kr.get("matmul") or {}).items():
        for m, impls in (case.get("M") or {}).items():
            t = {i: _get(impls, i, "per_call_s") for i in MATMUL_IMPLS}
            r = {f"{i}_vs_bf16": ratio(t["bf16"], t[i]) for i in MATMUL_IMPLS if i != "bf16"}
            r |= {f"pallas_{b}_vs_xla_{b}": ratio(t[f"xla_{b}"], t[f"pallas_{b}"]) for b in ("int8", "int4")}
            matmul.setdefault(proj, {})[m] = r
    return {"attention": attention, "matmul": matmul}


def derive(report: dict) -> dict:
    """Everything computed from the raw measurements (recomputed after each part)."""
    sheet = perf.device_for_kind(device_kind(report) or "")
    ceil = results(report, "ceilings")
    copy_gbps, tflops = _get(ceil, "copy", "GBps"), _get(ceil, "matmul", "TFLOPs")
    return {
        "ratio_definition": RATIO_DEFINITION,
        "datasheet": None if sheet is None else {"name": sheet.label, "bandwidth_Bps": sheet.bandwidth,
                                                 "bf16_flops": sheet.flops_bf16, "source": sheet.source},
        "copy_vs_datasheet": ratio(copy_gbps * 1e9 if copy_gbps else None, sheet.bandwidth if sheet else None),
        "matmul_vs_datasheet": ratio(tflops * 1e12 if tflops else None, sheet.flops_bf16 if sheet else None),
        "engine": engine_utilisation(report),
        "ratios": {**engine_ratios(report), **kernel_ratios(report)},
    }


# --------------------------------------------------------------------------- the README table
def _fmt(v: Any, digits: int = 1, scale: float = 1.0, suffix: str = "") -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v):
        return "-"
    return f"{v * scale:,.{digits}f}{suffix}"


def engine_table(report: dict) -> list[str]:
    levels = [str(c) for c in (report.get("workload") or {}).get("concurrency", ())]
    hf_batch = str((report.get("workload") or {}).get("hf_batch"))
    util, ratios = report["derived"]["engine"], report["derived"]["ratios"]
    head = (["weights", "batch-1 tok/s", "TPOT ms", "MBU (copy)", "MBU (datasheet)"]
            + [f"{c} req: out tok/s" for c in levels] + ["cold compile s", "batch-1 vs bf16", f"{levels[-1]} req vs bf16",
                                                         "batch-1 vs HF", f"{hf_batch} vs HF"])
    rows = [head, ["---"] * len(head)]
    for part in (*VARIANTS, "hf"):
        r = results(report, part)
        b1 = _get(r, "batch1") or {}
        u = util.get(part, {})
        vb, vh = ratios["vs_bf16"].get(part, {}), ratios["vs_hf"].get(part, {})
        rows.append(["HF transformers (bf16)" if part == "hf" else part, _fmt(b1.get("decode_tok_s")),
                     _fmt(b1.get("tpot_s"), 2, 1e3), _fmt(u.get("mbu_vs_copy"), 0, 100, "%"),
                     _fmt(u.get("mbu_vs_datasheet"), 0, 100, "%")]
                    + [_fmt(_get(r, "concurrency", c, "output_tok_s"), 0) for c in levels]
                    + [_fmt(b1.get("cold_compile_s")), _fmt(vb.get("batch1"), 2, suffix="x"),
                       _fmt(vb.get(levels[-1]), 2, suffix="x"), _fmt(vh.get("batch1"), 2, suffix="x"),
                       _fmt(vh.get(hf_batch), 2, suffix="x")])
    return ["| " + " | ".join(row) + " |" for row in rows]


def attention_table(report: dict) -> list[str]:
    rows = ["| prefill tokens | flash TFLOP/s | cuDNN TFLOP/s | XLA TFLOP/s | flash vs cuDNN | flash vs XLA "
            "| rel. err vs cuDNN |", "|---|---|---|---|---|---|---|"]
    cases = results(report, "kernels").get("attention") or {}
    for t, case in cases.items():
        r = report["derived"]["ratios"]["attention"].get(t, {})
        rows.append(f"| {t} | " + " | ".join([_fmt(_get(case, i, "TFLOPs")) for i in ATTENTION_IMPLS]
                                             + [_fmt(r.get("flash_vs_cudnn"), 2, suffix="x"),
                                                _fmt(r.get("flash_vs_xla"), 2, suffix="x"),
                                                _fmt(_get(case, "agreement", "flash_vs_cudnn"), 4)]) + " |")
    return rows


def matmul_table(report: dict) -> list[str]:
    rows = ["| projection (K->N) | M | bf16 us | XLA int8 us | Pallas int8 us | int8 vs bf16 | int8 vs XLA "
            "| XLA int4 us | Pallas int4 us | int4 vs bf16 | int4 vs XLA |", "|---" * 11 + "|"]
    for proj, case in (results(report, "kernels").get("matmul") or {}).items():
        shape = case.get("shape") or {}
        for m, impls in (case.get("M") or {}).items():
            r = report["derived"]["ratios"]["matmul"].get(proj, {}).get(m, {})
            us = {i: _fmt(_get(impls, i, "per_call_s"), 1, 1e6) for i in MATMUL_IMPLS}
            cells = [us["bf16"]]
            for b in ("int8", "int4"):
                cells += [us[f"xla_{b}"], us[f"pallas_{b}"], _fmt(r.get(f"pallas_{b}_vs_bf16"), 2, suffix="x"),
                          _fmt(r.get(f"pallas_{b}_vs_xla_{b}"), 2, suffix="x")]
            rows.append(f"| {proj} ({shape.get('K')}->{shape.get('N')}) | {m} | " + " | ".join(cells) + " |")
    return rows


def markdown(report: dict) -> str:
    """The README's GPU section from a results JSON."""
    ceil, d = results(report, "ceilings"), report["derived"]
    dev = report.get("device") or {}
    head = (f"GPU benchmark: {dev.get('kind', '?')} ({report.get('date')}, `{report.get('command')}`); "
            f"measured copy {_fmt(_get(ceil, 'copy', 'GBps'), 0)} GB/s "
            f"({_fmt(d.get('copy_vs_datasheet'), 0, 100, '%')} of the datasheet), bf16 matmul "
            f"{_fmt(_get(ceil, 'matmul', 'TFLOPs'), 0)} TFLOP/s. {RATIO_DEFINITION}.")
    w = report.get("workload") or {}
    engine_note = (f"Llama-3-8B-shaped random model through `Generator`: greedy, prompts of {w.get('prompt_len')} "
                   f"random tokens; batch 1 decodes {w.get('decode_tokens')} tokens; concurrent requests each "
                   f"generate {w.get('new_tokens')} tokens, all submitted at once (wall time includes prefill).")
    return "\n".join([head, "", engine_note, "", *engine_table(report), "",
                      "Prefill attention (causal, one sequence):", "", *attention_table(report), "",
                      "Weight-only matmuls (us per matmul):", "", *matmul_table(report)]) + "\n"


# --------------------------------------------------------------------------- the PNG
def plot(report: dict, png: Path) -> Path:
    """Throughput per weight dtype and concurrency, batch-1 MBU, attention TFLOP/s, matmul speedups."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    _plot_throughput(axes[0][0], report)
    _plot_mbu(axes[0][1], report)
    _plot_attention(axes[1][0], report)
    _plot_matmul(axes[1][1], report)
    fig.suptitle(f"bench.gpu: {device_kind(report) or '?'}, {report.get('date')}"
                 + (" (smoke: tiny shapes on CPU)" if report.get("smoke") else ""), fontsize=11)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def _bars(ax, groups: list[str], series: dict[str, list[float | None]], ylabel: str, title: str,
          log: bool = False) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, [v or 0 for v in values], width, label=name)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log and any(v for vs in series.values() for v in vs):
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def _plot_throughput(ax, report: dict) -> None:
    levels = [str(c) for c in (report.get("workload") or {}).get("concurrency", ())]
    series = {}
    for part in (*VARIANTS, "hf"):
        r = results(report, part)
        series["HF" if part == "hf" else part] = (
            [_get(r, "batch1", "decode_tok_s")] + [_get(r, "concurrency", c, "output_tok_s") for c in levels])
    _bars(ax, ["batch 1"] + [f"{c} req" for c in levels], series, "output tok/s", "8B-shaped model", log=True)


def _plot_mbu(ax, report: dict) -> None:
    util = report["derived"]["engine"]
    names = [v for v in VARIANTS if v in util]
    _bars(ax, names, {"vs measured copy": [util[v]["mbu_vs_copy"] for v in names],
                      "vs datasheet": [util[v]["mbu_vs_datasheet"] for v in names]},
          "MBU", "batch-1 decode bandwidth utilisation")


def _plot_attention(ax, report: dict) -> None:
    cases = results(report, "kernels").get("attention") or {}
    _bars(ax, [f"T={t}" for t in cases], {i: [_get(c, i, "TFLOPs") for c in cases.values()] for i in ATTENTION_IMPLS},
          "TFLOP/s", "prefill attention (causal)")


def _plot_matmul(ax, report: dict) -> None:
    ratios = report["derived"]["ratios"]["matmul"]
    groups = [(p, m) for p, by_m in ratios.items() for m in by_m]
    series = {i: [ratios[p][m].get(f"{i}_vs_bf16") for p, m in groups] for i in MATMUL_IMPLS if i != "bf16"}
    _bars(ax, [f"{p}\nM={m}" for p, m in groups], series, "speedup vs bf16 dot", "weight-only matmuls")
    ax.axhline(1.0, color="k", lw=0.8)
