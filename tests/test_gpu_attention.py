"""bench/gpu/attention.py (#41's prepared GPU run): every part runs on CPU in smoke mode, the host-side
layouts and byte / FLOP counts are checked against hand counts, and every derived ratio is recomputed
from the raw records."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.gpu import attention as ga, run as gpu
from tests.precision import attention_rtol
from tests.fake_devices import HANG_GUARD_S

SH = ga.SMOKE


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("att") / "att.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu.attention", "--smoke", "--out", str(out),
                           "--log-dir", str(out.parent / "logs")],
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_metadata_by_hand():
    """Two sequences: a 3-token chunk ending a 20-token context and a decode row at 5 keys, 16-token
    pages: pages 1-2 for the first, page 3 for the second, 0 (the null block) as padding."""
    pos, sid, qsl, bt, cl, used = ga.metadata(ga.Step(new=(3, 1), ctx=(20, 5)), SH)
    assert pos.tolist() == [17, 18, 19, 4] and sid.tolist() == [0, 0, 0, 1] and qsl.tolist() == [0, 3, 4]
    assert bt.tolist() == [[1, 2], [3, 0]] and cl.tolist() == [20, 5] and used == 4


def test_counts_by_hand():
    step = ga.Step(new=(3, 1), ctx=(20, 5))
    # token i of the chunk sees 17 + i + 1 keys: 18 + 19 + 20; the decode row sees 5
    assert step.visible_pairs() == 18 + 19 + 20 + 5
    # 25 context tokens x (K and V) x 2 kv heads x (32 values x 2 bytes) in bf16; 1 byte + a 4-byte scale in int8
    assert ga.kv_bytes(step, SH, "bf16") == 25 * 2 * 2 * 32 * 2
    assert ga.kv_bytes(step, SH, "int8") == ga.kv_bytes(step, SH, "fp8") == 25 * 2 * 2 * (32 + 4)
    assert ga.attention_flops(10, SH) == 4 * 4 * 32 * 10


def test_every_part_ran_and_agrees_with_its_reference(report):
    for part, entry in report["parts"].items():
        assert entry["status"] == "ok" and not entry["errors"], (part, entry["errors"])
        # each part's log lands in the --log-dir given (a lent GPU machine sends back only that folder)
        assert Path(entry["log"]).parent == Path(report["settings"]["log_dir"]) and Path(entry["log"]).is_file()
    assert Path(report["settings"]["log_dir"]).name == "logs"
    # only what needs a GPU is unavailable on CPU
    unavailable = [u for e in report["parts"].values() for u in e["unavailable"]]
    assert unavailable and all("needs an NVIDIA GPU" in u and ("cudnn" in u or "mosaic_jax" in u) for u in unavailable)
    cases = [c for fmt in ga.PAGE_FORMATS for c in report["parts"]["decode"]["results"]["decode"][fmt].values()]
    cases += list(report["parts"]["mixed"]["results"]["mixed"].values())
    cases.append(report["parts"]["prefill"]["results"]["prefill"]["chunk_over_cache"])
    # the kernel's bf16 output against its reference: the bound the kernel tests use (unit-variance
    # q, k, v, float32 scores and softmax, bf16 rounding of both outputs and of the probabilities)
    for c in cases:
        assert c["max_err_vs_reference"] <= attention_rtol("bfloat16", c["max_keys"], SH.head_dim), c


def test_derived_numbers_recomputed_by_hand(report):
    res = {p: e["results"] for p, e in report["parts"].items()}
    copy = max(m["GBps"] for m in res["copy"]["copy"]["methods"].values())
    d = report["derived"]
    assert d["copy_GBps"] == pytest.approx(copy)
    contexts = res["decode"]["decode"]["contexts"]
    assert len(contexts) == SH.batch and all(SH.context_range[0] <= c <= SH.context_range[1] for c in contexts)
    steps = [f"batch{SH.batch}"] + [f"batch1_ctx{c}" for c in SH.batch1_contexts]
    for fmt in ga.PAGE_FORMATS:
        # every step in every format; the bf16 ones also split 4 and 16 ways
        splits = (1,) + (ga.KV_SPLITS if fmt == "bf16" else ())
        assert sorted(res["decode"]["decode"][fmt]) == sorted(
            n if s == 1 else f"{n}_splits{s}" for n in steps for s in splits)
        for name, c in res["decode"]["decode"][fmt].items():
            step, s = ga.split_name(name)
            assert c["kv_splits"] == s
            ctx = contexts if step == f"batch{SH.batch}" else [int(step.split("ctx")[1])]
            per_token = 2 * SH.kv_heads * (SH.head_dim * 2 if fmt == "bf16" else SH.head_dim + 4)
            assert c["kv_bytes"] == sum(ctx) * per_token
            net = max(c["total_s"] - c["overhead_s"], c["total_s"] / 2) / c["calls"]
            assert c["per_call_s"] == pytest.approx(net)
            assert d["decode_vs_copy"][fmt][name] == pytest.approx(c["kv_bytes"] / net / 1e9 / copy)
    # the fastest kv_splits of each bf16 step and its speedup over 1, from the per-call times
    bf16 = res["decode"]["decode"]["bf16"]
    assert sorted(d["decode_splits"]) == sorted(steps)
    for step in steps:
        times = {1: bf16[step]["per_call_s"]} | {s: bf16[f"{step}_splits{s}"]["per_call_s"] for s in ga.KV_SPLITS}
        best = min(times, key=times.get)
        assert d["decode_splits"][step]["best_kv_splits"] == best
        assert d["decode_splits"][step]["speedup_over_1"] == pytest.approx(times[1] / times[best])
        assert d["decode_splits"][step]["per_call_s"] == {str(s): pytest.approx(t) for s, t in times.items()}
    m = res["mixed"]["mixed"]
    assert m["mixed"]["tokens"] == m["decode_half"]["tokens"] + m["chunk_half"]["tokens"]
    assert d["mixed"]["mixed_over_halves"] == pytest.approx(
        m["mixed"]["per_call_s"] / (m["decode_half"]["per_call_s"] + m["chunk_half"]["per_call_s"]))
    pre = res["prefill"]["prefill"]["chunk_over_cache"]
    n = SH.prefill_len
    assert pre["visible_pairs"] == n * n + n * (n + 1) // 2
    assert pre["TFLOPs"] == pytest.approx(4 * SH.heads * SH.head_dim * pre["visible_pairs"] / pre["per_call_s"] / 1e12)
    assert d["prefill"]["chunk_vs_cudnn_dense"] is None          # no cuDNN on CPU: no ratio, not a made-up one
    flash = res["dense"]["dense"][str(SH.dense_tokens[0])]["flash"]
    t = SH.dense_tokens[0]
    assert flash["flops"] == 4 * SH.heads * SH.head_dim * t * (t + 1) // 2
    assert np.isfinite(flash["TFLOPs"]) and flash["TFLOPs"] > 0


def test_split_names():
    assert ga.split_name("batch1_ctx4096_splits16") == ("batch1_ctx4096", 16)
    assert ga.split_name("batch64") == ("batch64", 1)
    # a step whose kv_splits=1 case failed has no best (no made-up speedup); one split case failing leaves the others
    cases = {"batch3": {"error": "boom"}, "batch3_splits4": {"per_call_s": 1.0},
             "batch1_ctx16": {"per_call_s": 2.0}, "batch1_ctx16_splits4": {"error": "boom"},
             "batch1_ctx16_splits16": {"per_call_s": 0.5}}
    assert ga.best_splits(cases) == {"batch1_ctx16": {"best_kv_splits": 16, "speedup_over_1": 4.0,
                                                      "per_call_s": {"1": 2.0, "16": 0.5}}}


def test_unknown_part_is_refused():
    with pytest.raises(ValueError, match="unknown part"):
        gpu.parse_parts("decode,warp", ga.PARTS)
