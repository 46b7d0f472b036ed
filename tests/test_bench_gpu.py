"""`python -m bench.gpu --smoke`: every part of the GPU benchmark on CPU with tiny shapes, through the
same subprocesses, merging, ratios, PNG and table as the real run. Every derived number in its JSON is
recomputed here from the raw times and byte counts it records (and the byte counts from the model's
shape), with this file's own arithmetic."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.fake_devices import HANG_GUARD_S

REPO = Path(__file__).resolve().parent.parent
PARTS = ["ceilings", "bf16", "hf", "kernels", "int8", "fp8", "int4"]
VARIANTS = ["bf16", "int8", "int4", "fp8"]


def _torch_importable() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu") / "smoke-gpu.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke", "--out", str(out),
                           "--log-dir", str(out.parent / "logs")],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), out


def net(total: float, overhead: float, calls: int) -> float:
    return max(total - overhead, total / 2) / calls


def close(a, b, rel=1e-9) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=rel)


def same_ratio(got, a, b) -> bool:
    """The report's ratio of two rates: a / b when both are positive, else none. A CPU smoke's batch-1
    rate comes from two medians of a few timed runs (N tokens less 1 token), which a busy machine can
    order either way: the rate is then <= 0 and the ratio absent (a loaded run had HF's at -133 tok/s)."""
    return got is None if not (a > 0 and b > 0) else close(got, a / b)


def matrix_bytes(k: int, n: int, dtype: str) -> int:
    return {"bf16": 2 * k * n, "int8": k * n + 4 * n, "fp8": k * n + 4 * n,
            "int4": k * n // 2 + 4 * (k // 128) * n}[dtype]


def layer_matrices(m: dict) -> list[tuple[int, int]]:
    d, h, kv, f = m["hidden_size"], m["num_attention_heads"], m["num_key_value_heads"], m["intermediate_size"]
    hd = d // h
    return [(d, (h + 2 * kv) * hd), (h * hd, d), (d, 2 * f), (f, d)]


def test_every_part_ran_and_only_cudnn_and_memory_stats_are_unavailable(smoke):
    report, _ = smoke
    assert list(report["parts"]) == PARTS
    for name, part in report["parts"].items():
        assert part["status"] == "ok" and part["errors"] == [], (name, part["errors"])
    unavailable = [u for part in report["parts"].values() for u in part["unavailable"]]
    if not _torch_importable():
        unavailable = [u for u in unavailable if not u.startswith("torch")]
    cases = report["parts"]["kernels"]["results"]["attention"]
    memory = [f"memory/{when}: this backend reports no memory stats"    # XLA:CPU has no allocator stats
              for _ in ("bf16", "int8", "fp8", "int4") for when in ("after_build", "end")]
    assert sorted(unavailable) == sorted([f"attention/{t}/cudnn: {cases[t]['cudnn']['unavailable']}" for t in cases]
                                         + memory)
    assert report["device"]["platform"] == "cpu" and report["smoke"] is True
    assert report["settings"]["compilation_cache"].startswith("off")
    assert all(report["versions"][p] for p in ("python", "jax", "jaxlib", "flax", "numpy"))
    for part in report["parts"].values():
        assert 0 < part["wall_s"] <= part["timeout_s"] + 60


def test_engine_bytes_mbu_and_ratios_recomputed(smoke):
    report, _ = smoke
    m, w = report["workload"]["model"], report["workload"]
    parts, derived = report["parts"], report["derived"]
    ceil = parts["ceilings"]["results"]
    copy = max(2 * w["copy_bytes"] / net(r["total_s"], r["overhead_s"], 1) for r in ceil["copy"]["methods"].values()
               if "total_s" in r)
    assert close(ceil["copy"]["GBps"] * 1e9, copy)
    d, v, L, hkv = m["hidden_size"], m["vocab_size"], m["num_hidden_layers"], m["num_key_value_heads"]
    hd = d // m["num_attention_heads"]
    for variant in VARIANTS:
        r = parts[variant]["results"]
        build, b1 = r["build"], r["batch1"]
        # parameter bytes from the shape: embedding, LM head, norms in bf16; the layer matrices as quantized
        dtype = variant
        expect = 2 * (2 * v * d + (2 * L + 1) * d) + L * sum(matrix_bytes(k, n, dtype) for k, n in layer_matrices(m))
        assert build["param_bytes"] == expect
        assert build["kv_bytes_per_token"] == 2 * 2 * L * hkv * hd
        read = expect - 2 * v * d + 2 * d          # the embedding table is gathered, one row per token
        assert build["weight_bytes_read_per_token"] == read
        n, p = w["decode_tokens"], w["prompt_len"]
        tok_s = n / (np.median(b1["tN_s"]) - np.median(b1["t1_s"]))
        assert close(b1["decode_tok_s"], tok_s) and close(b1["tpot_s"], 1 / tok_s)
        assert close(b1["cold_compile_s"], b1["first_request_s"] - np.median(b1["tN_s"]))
        context = p + (n + 1) / 2                   # decode steps attend p + 1 .. p + n keys
        per_token = read + context * build["kv_bytes_per_token"]
        util = derived["engine"][variant]
        assert same_ratio(util["mbu_vs_copy"], per_token * tok_s, copy)
        assert util["mbu_vs_datasheet"] is None     # a CPU has no datasheet
        for c in w["concurrency"]:
            cr = r["concurrency"][str(c)]
            assert cr["total_new_tokens"] == c * w["new_tokens"]
            assert close(cr["output_tok_s"], cr["total_new_tokens"] / cr["wall_s"])
            assert cr["compiles_in_timed_run"] == 0       # the warm-up compiled every step shape
        if variant in ("int8", "int4"):                   # the launch configs, on CPU each shape's default
            from jaxinfer import quant
            bits, g = (8, None) if variant == "int8" else (4, 128)
            for name, (k, n) in zip(("qkv", "o", "gate_up", "down"), layer_matrices(m)):
                for mm, cfg in r["launch_configs"][name].items():
                    assert cfg == quant.pallas_block_candidates(int(mm), k, n, bits, g)[0]
    rate = lambda part, k: (parts[part]["results"]["batch1"]["decode_tok_s"] if k == "batch1"  # noqa: E731
                            else parts[part]["results"]["concurrency"][k]["output_tok_s"])
    for variant in ("int8", "int4", "fp8"):
        for k in ["batch1"] + [str(c) for c in w["concurrency"]]:
            assert same_ratio(derived["ratios"]["vs_bf16"][variant][k], rate(variant, k), rate("bf16", k))
    if _torch_importable():
        hf = parts["hf"]["results"]
        assert hf["build"]["param_bytes"] == 2 * (2 * v * d + (2 * L + 1) * d) + L * sum(
            2 * k * n for k, n in layer_matrices(m))
        for variant in VARIANTS:
            for k in ("batch1", str(w["hf_batch"])):
                assert same_ratio(derived["ratios"]["vs_hf"][variant][k], rate(variant, k), rate("hf", k))


def test_kernel_and_ceiling_ratios_recomputed(smoke):
    report, _ = smoke
    m = report["workload"]["model"]
    ceil = report["parts"]["ceilings"]["results"]["matmul"]
    assert close(ceil["TFLOPs"] * 1e12, 2 * ceil["n"] ** 3 / net(ceil["total_s"], ceil["overhead_s"], ceil["calls"]))
    kr, ratios = report["parts"]["kernels"]["results"], report["derived"]["ratios"]
    h, hkv = m["num_attention_heads"], m["num_key_value_heads"]
    hd = m["hidden_size"] // h
    assert list(kr["attention"]) == [str(t) for t in report["workload"]["attention_tokens"]]
    for t, case in kr["attention"].items():
        t_flash, t_xla = (net(case[i]["total_s"], case[i]["overhead_s"], case[i]["calls"]) for i in ("flash", "xla"))
        assert close(case["flash"]["TFLOPs"] * 1e12, 4 * int(t) ** 2 * h * hd / 2 / t_flash)
        assert close(ratios["attention"][t]["flash_vs_xla"], t_xla / t_flash)
        assert ratios["attention"][t]["flash_vs_cudnn"] is None
        assert case["agreement"]["flash_vs_xla"] < 2e-2          # bf16 inputs and outputs
        assert case["shape"]["heads"] == h and case["shape"]["kv_heads"] == hkv
    projections = dict(zip(["qkv", "o", "gate_up", "down"], layer_matrices(m)))
    assert list(kr["matmul"]) == list(projections)
    for proj, (k, n) in projections.items():
        case = kr["matmul"][proj]
        assert (case["shape"]["K"], case["shape"]["N"]) == (k, n)
        assert list(case["M"]) == [str(r) for r in report["workload"]["matmul_rows"]]
        for rows, impls in case["M"].items():
            t = {i: net(impls[i]["total_s"], impls[i]["overhead_s"], impls[i]["calls"]) for i in
                 ("bf16", "xla_int8", "pallas_int8", "xla_int4", "pallas_int4")}
            for impl, seconds in t.items():
                nbytes = matrix_bytes(k, n, impl.split("_")[-1])
                assert impls[impl]["weight_bytes"] == nbytes
                assert close(impls[impl]["GBps"] * 1e9, nbytes / seconds)
                if impl != "bf16":
                    assert close(ratios["matmul"][proj][rows][f"{impl}_vs_bf16"], t["bf16"] / seconds)
            for bits in ("int8", "int4"):
                assert close(ratios["matmul"][proj][rows][f"pallas_{bits}_vs_xla_{bits}"],
                             t[f"xla_{bits}"] / t[f"pallas_{bits}"])
                assert impls[f"agreement_{bits}"]["pallas_vs_xla"] < 1e-2


def test_png_and_table(smoke, capsys):
    report, out = smoke
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    from bench.gpu.run import main
    assert main(["--table", str(out)]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    for variant in VARIANTS:
        [row] = [r for r in rows if r.startswith(f"| {variant} |")]
        tok_s = report["parts"][variant]["results"]["batch1"]["decode_tok_s"]
        assert f"| {tok_s:,.1f} |" in row
    assert any(r.startswith("| HF transformers") for r in rows)
    for t in report["workload"]["attention_tokens"]:
        assert any(r.startswith(f"| {t} |") for r in rows)
    assert sum(r.startswith("| qkv (") for r in rows) == len(report["workload"]["matmul_rows"])


def test_jaxinfer_bench_gpu_parses(capsys):
    from bench.gpu.run import command
    from jaxinfer.cli import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "gpu", "--help"])
    assert e.value.code == 0
    assert "--deadline-s" in capsys.readouterr().out
    args = build_parser().parse_args(["bench", "gpu", "--parts", "bf16,hf", "--smoke", "--deadline-s", "60"])
    assert args.func is command and args.parts == "bf16,hf" and args.smoke and args.deadline_s == 60


def test_part_timeouts_fit_the_deadline():
    from bench.gpu.run import PARENT_RESERVE_S, PART_CAPS_S, part_timeout, part_timeouts
    caps = part_timeouts(PARTS, 540)
    assert caps == {p: float(PART_CAPS_S[p]) for p in PARTS}
    assert sum(caps.values()) + PARENT_RESERVE_S <= 540
    # every part gets at least its cap when the ones before it used all of theirs
    left = 540 - PARENT_RESERVE_S
    for i, p in enumerate(PARTS):
        assert part_timeout(p, PARTS[i + 1:], caps, left) >= caps[p] - 1e-9
        left -= caps[p]
    short = part_timeouts(PARTS, 120)
    assert math.isclose(sum(short.values()), 120 - PARENT_RESERVE_S)


def test_a_part_killed_at_its_timeout_keeps_its_records(tmp_path):
    # A stand-in part that records one key with the parts' own Recorder and then never finishes: the
    # real parts import jax first (over 5 s on a loaded 2-core machine, so a short timeout could kill
    # one before its first record); bench/gpu/records.py imports no jax, so this one records within a
    # second of starting, well inside 10 s. The real parts' records are checked by the smoke run above.
    import os
    from bench.gpu.records import read_records
    from bench.gpu.run import run_worker
    (tmp_path / "standin_part.py").write_text(
        "import sys, time\n"
        "from bench.gpu.records import Recorder\n"
        "arg = lambda name: sys.argv[sys.argv.index(name) + 1]\n"
        "Recorder(arg('--records')).put(('device',), {'platform': 'cpu', 'part': arg('--worker')})\n"
        "time.sleep(600)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    (tmp_path / "kernels.jsonl").write_text('{"key": ["stale"], "value": 1}\n')   # a previous run's: not read
    entry = run_worker("kernels", 10.0, smoke=True, autotune=False, run_dir=tmp_path, module="standin_part", env=env)
    assert entry["status"] == "timeout" and "timeout" in entry["errors"][0] and entry["returncode"] is None
    assert 10.0 <= entry["wall_s"] < 70.0
    assert entry["results"] == {"device": {"platform": "cpu", "part": "kernels"}}
    records = tmp_path / "r.jsonl"
    records.write_text('{"key": ["a", "b"], "value": {"x": 1}}\n{"key": ["a", "b"], "value": {"y": 2}}\n'
                       '{"key": ["a", "c"], "value": 3}\n{"key": ["a", "d"], "val')     # torn by the kill
    assert read_records(records) == {"a": {"b": {"x": 1, "y": 2}, "c": 3}}
