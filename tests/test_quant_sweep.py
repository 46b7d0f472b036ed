"""`python -m bench.gpu.quant_sweep --smoke`: every code path of the GPU sweep on CPU (tiny shapes,
Pallas interpreted), and every derived number recomputed here by hand from the raw times and bytes
the run recorded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
K, N, G = 256, 128, 128       # the smoke run's one projection, int4's group size


def _run_smoke(tmp_path: Path) -> dict:
    out = tmp_path / "sweep.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "bench.gpu.quant_sweep", "--smoke", "--out", str(out),
                           "--log-dir", str(tmp_path / "logs")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_smoke_sweep_records_every_path_and_its_derived_numbers(tmp_path):
    report = _run_smoke(tmp_path)
    assert report["benchmark"] == "gpu_quant_sweep" and report["smoke"] is True
    assert report["command"].startswith("python -m bench.gpu.quant_sweep --smoke")
    assert report["device"]["platform"] == "cpu" and "driver" in report and report["versions"]["jax"]
    assert all(p["status"] == "ok" and not p["errors"] for p in report["parts"].values()), report["parts"]

    # the copy bandwidth: each method moved its buffer twice (read + write) in per_call_s
    methods = report["parts"]["copy"]["results"]["copy"]["methods"]
    copy_bytes = report["settings"]["copy_bytes"]
    copy = max(2 * copy_bytes / m["per_call_s"] / 1e9 for m in methods.values() if "per_call_s" in m)
    derived = report["derived"]
    assert abs(derived["copy_GBps"] - copy) <= 1e-9 * copy

    rows = report["parts"]["qkv"]["results"]["qkv"]["M"]
    assert set(rows) == {"1", "64"}
    # every code path: both fp8 layouts, XLA, the tiled kernel and the split-K kernel with both inner
    # products (M = 1) for int8 and int4, GGUF's Q4_K (float zero points) and the grouped 8-bit forms
    # (Q8_0, fine-grained FP8); at M = 64 the tiled-first list with one split-K config
    names = set(rows["1"])
    for fmt in ("int8", "int4", "q4k", "q8_0", "fp8b"):
        assert {f"{fmt}:xla"} <= names
        assert any(n.startswith(f"{fmt}:tiled:") for n in names)
        assert any(n.startswith(f"{fmt}:splitk:") and n.endswith("-reduce-w4-s3") for n in names)
        assert any(n.startswith(f"{fmt}:splitk:") and n.endswith("-dot-w4-s3") for n in names)
    assert {"bf16", "fp8:kn", "fp8:nk"} <= names
    assert any(":splitk:" in n for n in rows["64"]) and any(":tiled:" in n for n in rows["64"])

    weight_bytes = {"bf16": 2 * K * N, "int8": K * N + 4 * N, "int4": K * N // 2 + 4 * (K // G) * N,
                    "fp8_kn": K * N + 4 * N, "fp8_nk": K * N + 4 * N,
                    "q4k": K * N // 2 + 2 * 4 * (K // 32) * N, "q8_0": K * N + 4 * (K // 32) * N,
                    "fp8b": K * N + 4 * (K // 128) * N}
    for m, row in rows.items():
        bf16 = row["bf16"]
        assert "error" not in bf16
        for case, r in row.items():
            assert "error" not in r, (m, case, r)
            # one call's net seconds: the empty call's overhead off the chain's median, per call
            per_call = max(r["total_s"] - r["overhead_s"], r["total_s"] / 2) / r["calls"]
            assert abs(r["per_call_s"] - per_call) <= 1e-12
            fmt = "bf16" if case == "bf16" else r["format"]
            assert r["weight_bytes"] == weight_bytes[fmt]
            d = derived["cases"]["qkv"][m][case]
            gbps = weight_bytes[fmt] / per_call / 1e9
            assert abs(d["GBps"] - gbps) <= 1e-9 * gbps
            assert abs(d["copy_fraction"] - gbps / copy) <= 1e-9 * gbps / copy
            ratio = bf16["per_call_s"] / per_call
            assert abs(d["vs_bf16"] - ratio) <= 1e-9 * ratio
            if case != "bf16":
                # against XLA's result of the same format (fp8: the [K, N] layout): bf16 outputs
                # rounded on each side (2^-8 each) and XLA's int4 weights rounded to bf16 (2^-8)
                assert r["rel_err_vs_xla"] is not None and r["rel_err_vs_xla"] <= 2.0 ** -6, (case, r)
        for group in ("int8", "int4", "fp8", "q4k", "q8_0", "fp8b"):
            mine = {c: r["per_call_s"] for c, r in row.items() if c.split(":")[0] == group}
            assert derived["winners"]["qkv"][m][group] == min(mine, key=mine.get)
        assert derived["winners"]["qkv"][m]["overall"] == min(row, key=lambda c: row[c]["per_call_s"])


def test_formats_option_reaches_the_workers_and_refuses_unknown_names(monkeypatch):
    """--formats: the parent's list becomes the Sweep's and is handed to the part workers through the
    environment (a worker, run without the option, reads it back); an unknown name is refused."""
    import argparse

    import pytest

    from bench.gpu import quant_sweep as qs
    monkeypatch.delenv(qs.FORMATS_ENV, raising=False)
    parent = qs.sweep_of(argparse.Namespace(smoke=True, formats="bf16,q4k"))
    assert parent.formats == ("bf16", "q4k") and os.environ[qs.FORMATS_ENV] == "bf16,q4k"
    assert qs.sweep_of(argparse.Namespace(smoke=True, formats=None)).formats == ("bf16", "q4k")
    with pytest.raises(SystemExit, match=r"--formats: unknown \['q3'\]"):
        qs.sweep_of(argparse.Namespace(smoke=True, formats="bf16,q3"))
