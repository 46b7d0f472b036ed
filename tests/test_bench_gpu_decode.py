"""`python -m bench.gpu.decode --smoke`: issue #40's decode benchmark on CPU with a tiny random model,
through the same subprocesses, traces and merging as the GPU run; its trace parser (bench/gpu/trace.py)
against hand-written traces whose answers are worked out by hand below; and every derived number of
the smoke JSON (MBU, the knee, `jaxinfer plan`'s prediction) recomputed here from the raw ones."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from bench.gpu import trace as gpu_trace
from tests.fake_devices import HANG_GUARD_S

REPO = Path(__file__).resolve().parent.parent
PARTS = ["ceilings", "profile", "profile_nocb", "profile_int8", "batch1", "ttft", "knee"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu_decode") / "smoke-decode.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu.decode", "--smoke", "--out", str(out),
                           "--log-dir", str(out.parent / "logs")],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def close(a, b, rel=1e-9) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


# --------------------------------------------------------------------------- hand-written traces
# A GPU trace: the host's python thread holds the two annotated calls, the device's stream the kernels,
# and a derived "XLA Ops" line repeats their time (it must not count). Kernels (start, duration):
#   decode_call_0 [100, 200]: gemm 110+30, fusion.2 145+10, attention 155+20, sampler 180+5
#       busy 65; gaps (145-140) + (155-155) + (180-175) = 10; lead 110-100 = 10; tail 200-185 = 15
#   decode_call_1 [300, 360]: gemm 305+30, LM head 340+10
#       busy 40; gaps 340-335 = 5; lead 5; tail 360-350 = 10
# and a warm-up kernel at 50 that lies in no window.
STREAM = [("gemm_fusion_1", "gemm.1", 110, 30), ("fusion.2", "fusion.2", 145, 10),
          ("ragged_attention_kernel", "custom-call.3", 155, 20), ("sample_fusion", "fusion.4", 180, 5),
          ("gemm_fusion_1", "gemm.1", 305, 30), ("fusion.5", "dot.5", 340, 10), ("warmup_fusion", "fusion.9", 50, 5)]


def gpu_trace_events() -> dict:
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 10, "name": "thread_name", "args": {"name": "python"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 1, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "pid": 2, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    host = [{"ph": "X", "pid": 1, "tid": 10, "name": "decode_call_0", "ts": 100, "dur": 100},
            {"ph": "X", "pid": 1, "tid": 10, "name": "decode_call_1", "ts": 300, "dur": 60},
            {"ph": "X", "pid": 1, "tid": 10, "name": "decode_call_10x", "ts": 100, "dur": 300}]   # not a window
    stream = [{"ph": "X", "pid": 2, "tid": 1, "name": n, "ts": ts, "dur": d, "args": {"hlo_op": op, "hlo_module": "m"}}
              for n, op, ts, d in STREAM]
    derived = [{"ph": "X", "pid": 2, "tid": 2, "name": "gemm.1", "ts": 110, "dur": 75, "args": {"hlo_op": "gemm.1"}}]
    return {"traceEvents": meta + host + stream + derived}


def hlo_text(parents_one_based: bool) -> str:
    """A compiled module's text with XLA's stack-frame tables. Frames (parent): 1 _step (none),
    2 Block.__call__ (1), 3 dense (2), 4 ragged_paged_attention (2), 5 sample (1), 6 Decoder.logits (1);
    XLA prints parent ids one higher than the frame ids (0 = none), the other form prints them as they are."""
    location_and_parent = {1: (1, 0), 2: (6, 1), 3: (2, 2), 4: (3, 2), 5: (4, 1), 6: (5, 1)}
    frames = "\n".join(f"{f} {{file_location_id={loc} parent_frame_id={p + parents_one_based}}}"
                       for f, (loc, p) in location_and_parent.items())
    return f"""HloModule jit__step, is_scheduled=true

FileNames
1 "/x/jaxinfer/step.py"
2 "/x/jaxinfer/layers.py"
3 "/x/pallas_kernels/ragged_paged_attention.py"
4 "/x/jaxinfer/sampling.py"
5 "/x/jaxinfer/models/decoder.py"

FunctionNames
1 "_step"
2 "dense"
3 "ragged_paged_attention"
4 "sample"
5 "Decoder.logits"
6 "Block.__call__"

FileLocations
1 {{file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}}
2 {{file_name_id=2 function_name_id=2 line=20 end_line=20 column=1 end_column=2}}
3 {{file_name_id=3 function_name_id=3 line=30 end_line=30 column=1 end_column=2}}
4 {{file_name_id=4 function_name_id=4 line=40 end_line=40 column=1 end_column=2}}
5 {{file_name_id=5 function_name_id=5 line=50 end_line=50 column=1 end_column=2}}
6 {{file_name_id=5 function_name_id=6 line=60 end_line=60 column=1 end_column=2}}

StackFrames
{frames}

%fused_computation.2 (p: bf16[4]) -> bf16[4] {{
  %p = bf16[4]{{0}} parameter(0)
  ROOT %add.9 = bf16[4]{{0}} add(%p, %p), metadata={{op_name="jit(_step)/add" stack_frame_id=2}}
}}

ENTRY %main.1 (a: bf16[1,8]) -> f32[1,512] {{
  %gemm.1 = bf16[1,64]{{1,0}} custom-call(%a, %b), custom_call_target="__cublas$gemm", metadata={{op_name="jit(_step)/dot_general" stack_frame_id=3}}
  %fusion.2 = bf16[4]{{0}} fusion(%c), kind=kLoop, calls=%fused_computation.2
  %custom-call.3 = bf16[1,8]{{1,0}} custom-call(%q), custom_call_target="__gpu$xla.gpu.triton", metadata={{op_name="jit(_step)/pallas_call" stack_frame_id=4}}
  %fusion.4 = s32[1]{{0}} fusion(%l), kind=kLoop, calls=%fused_computation.4, metadata={{op_name="jit(_step)/argmax" stack_frame_id=5}}
  %command_buffer.7 = (bf16[4]{{0}}) call(%c), to_apply=%command_buffer
  ROOT %dot.5 = f32[1,512]{{1,0}} dot(%h, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="jit(_step)/dot_general" stack_frame_id=6}}
}}
"""


def check_gpu_summary(s: dict) -> None:
    assert s["num_windows"] == 2 and s["tokens_per_window"] == 4
    assert s["kernel_events"] == "device: stream lines Stream #7(Compute)"      # not the derived XLA Ops line
    w0, w1 = s["windows"]
    assert (w0["wall_us"], w0["busy_us"], w0["kernel_us"], w0["gaps_us"], w0["lead_us"], w0["tail_us"], w0["kernels"]) \
        == (100, 65, 65, 10, 10, 15, 4)
    assert (w1["wall_us"], w1["busy_us"], w1["kernel_us"], w1["gaps_us"], w1["lead_us"], w1["tail_us"], w1["kernels"]) \
        == (60, 40, 40, 5, 5, 10, 2)
    assert (s["wall_us"], s["busy_us"], s["kernel_us"], s["gaps_us"]) == (80, 52.5, 52.5, 7.5)
    assert s["kernels_per_window"] == 3 and s["kernels_per_token"] == 6 / (2 * 4)
    assert s["busy_fraction"] == 105 / 160
    per_kernel = {k["name"]: (k["us"], k["count"]) for k in s["kernels"]}
    assert per_kernel == {"gemm_fusion_1": (60, 2), "ragged_attention_kernel": (20, 1), "fusion.2": (10, 1),
                          "fusion.5": (10, 1), "sample_fusion": (5, 1)}
    assert [k["name"] for k in s["kernels"]][:2] == ["gemm_fusion_1", "ragged_attention_kernel"]
    assert sum(us for us, _ in per_kernel.values()) == 2 * s["busy_us"]     # no overlap: the kernels fill the busy time
    assert {g["name"]: g["us"] for g in s["kernel_groups"]} == {"gemm_fusion": 60, "ragged_attention_kernel": 20,
                                                                "fusion": 20, "sample_fusion": 5}


def test_gpu_trace_summary_matches_the_hand_calculation():
    s = gpu_trace.summarize(gpu_trace_events(), "decode_call", 4, hlo_text(True))
    check_gpu_summary(s)
    # categories from the HLO's stacks: dense -> matmul, the fused add of Block -> other (the fusion has no
    # metadata of its own: its computation's root has), the Pallas kernel -> attention, sample -> sampler,
    # Decoder.logits -> lm_head; shares of the 105 us
    us = {"matmul": 60, "other": 10, "attention": 20, "sampler": 5, "lm_head": 10}
    assert {c: v["us_per_window"] * 2 for c, v in s["categories"].items()} == us
    assert all(close(v["share"], us[c] / 105) for c, v in s["categories"].items())
    assert s["hlo_mapped_share"] == 1.0
    assert {k["name"]: k["category"] for k in s["kernels"]} == {
        "gemm_fusion_1": "matmul", "fusion.2": "other", "ragged_attention_kernel": "attention",
        "sample_fusion": "sampler", "fusion.5": "lm_head"}


def test_stack_frames_read_in_either_numbering_and_names_without_hlo():
    for one_based in (True, False):
        ops = gpu_trace.parse_hlo(hlo_text(one_based))
        assert ops["gemm.1"].functions == ("dense", "Block.__call__", "_step")
        assert ops["dot.5"].functions == ("Decoder.logits", "_step")
        assert ops["fusion.2"].op_name == "jit(_step)/add" and ops["fusion.2"].target == "fused_computation.2"
        assert (ops["custom-call.3"].opcode, ops["dot.5"].opcode) == ("custom-call", "dot")
    # no HLO: the kernels' names decide (GEMM and attention kernels say what they are)
    s = gpu_trace.summarize(gpu_trace_events(), "decode_call", 4)
    check_gpu_summary(s)
    assert s["hlo_mapped_share"] == 0.0
    assert {c: v["us_per_window"] * 2 for c, v in s["categories"].items()} == {
        "matmul": 60, "attention": 20, "other": 25, "sampler": 0, "lm_head": 0}
    assert gpu_trace.category("sm90_xmma_gemm_bf16bf16_bf16f32", None) == "matmul"
    assert gpu_trace.category("nvjet_tst_128x64", None) == "matmul"


def test_command_buffer_kernels_found_by_their_names():
    """XLA:GPU in a command buffer: every kernel records the command buffer's call as its hlo_op; a
    fusion's kernel is named after its instruction ("." as "_"), a cuBLAS kernel is not."""
    renamed = {"fusion.2": "fusion_2", "sample_fusion": "fusion_4", "fusion.5": "dot_5"}
    trace = gpu_trace_events()
    for e in trace["traceEvents"]:
        if e.get("pid") == 2 and e.get("tid") == 1:
            e["name"] = renamed.get(e["name"], e["name"])
            e["args"]["hlo_op"] = "command_buffer.7"
    s = gpu_trace.summarize(trace, "decode_call", 4, hlo_text(True))
    assert {c: v["us_per_window"] * 2 for c, v in s["categories"].items()} == {
        "matmul": 60, "other": 10, "attention": 20, "sampler": 5, "lm_head": 10}
    assert close(s["hlo_mapped_share"], (10 + 5 + 10) / 105)
    assert {k["name"]: k["hlo_op"] for k in s["kernels"]} == {
        "gemm_fusion_1": "command_buffer.7", "ragged_attention_kernel": "command_buffer.7", "fusion_2": "fusion.2",
        "fusion_4": "fusion.4", "dot_5": "dot.5"}


def test_xplane_events_read_the_same_as_the_json_trace():
    """jax.profiler.ProfileData's planes -> lines -> events (ns), as xspace_to_trace reads them."""
    def ev(name: str, ts: float, dur: float, **stats) -> SimpleNamespace:
        return SimpleNamespace(name=name, start_ns=ts * 1e3, duration_ns=dur * 1e3, stats=list(stats.items()))
    host = SimpleNamespace(name="/host:CPU", lines=[SimpleNamespace(name="python", events=[
        ev("decode_call_0", 100, 100), ev("decode_call_1", 300, 60)])])
    device = SimpleNamespace(name="/device:GPU:0", lines=[
        SimpleNamespace(name="Stream #7(Compute)", events=[ev(n, ts, d, hlo_op=op) for n, op, ts, d in STREAM]),
        SimpleNamespace(name="XLA Ops", events=[ev("gemm.1", 110, 75, hlo_op="gemm.1")])])
    trace = gpu_trace.xspace_to_trace(SimpleNamespace(planes=[host, device]))
    check_gpu_summary(gpu_trace.summarize(trace, "decode_call", 4, hlo_text(True)))


def test_cpu_trace_counts_the_innermost_thunks():
    """XLA:CPU: thunks on host threads, a while loop's event around the thunks it ran. decode_loop
    [5, 65]: fusion.a 12+10, fusion.b 25+20 inside while.1 10+50: busy 30, gaps 25-22 = 3, lead 7, tail 20."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "python"}},
            {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "tf_XLAEigen/1"}}]
    op = lambda name, ts, dur: {"ph": "X", "pid": 1, "tid": 2, "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                "args": {"hlo_op": name.removeprefix("end: ")}}
    events = meta + [{"ph": "X", "pid": 1, "tid": 1, "name": "decode_loop", "ts": 5, "dur": 60},
                     op("while.1", 10, 50), op("fusion.a", 12, 10), op("end: fusion.a", 22, 0), op("fusion.b", 25, 20),
                     {"ph": "X", "pid": 1, "tid": 2, "name": "ThunkExecutor::Execute", "ts": 9, "dur": 52}]
    s = gpu_trace.summarize({"traceEvents": events}, "decode_loop", 2)
    [w] = s["windows"]
    assert (w["wall_us"], w["busy_us"], w["kernel_us"], w["gaps_us"], w["lead_us"], w["tail_us"], w["kernels"]) \
        == (60, 30, 30, 3, 7, 20, 2)
    assert s["kernels_per_token"] == 1 and {k["name"] for k in s["kernels"]} == {"fusion.a", "fusion.b"}
    assert s["kernel_events"].startswith("host thunks")


# --------------------------------------------------------------------------- the smoke run
def test_every_part_ran(smoke):
    assert list(smoke["parts"]) == PARTS and smoke["smoke"] is True
    for name, part in smoke["parts"].items():
        assert part["status"] == "ok" and part["errors"] == [] and part["unavailable"] == [], (name, part["errors"])
        assert 0 < part["wall_s"] <= part["timeout_s"] + 60
    assert smoke["device"]["platform"] == "cpu"
    b1 = smoke["parts"]["batch1"]["results"]["settings"]
    assert list(b1) == [f"{a}-k{k}-{'async' if s else 'sync'}" for a, k, s in smoke["workload"]["batch1_settings"]]
    assert [b1[key]["engine"]["attention"] for key in b1] == [a for a, _, _ in smoke["workload"]["batch1_settings"]]


def test_profile_summaries_are_consistent(smoke):
    prof, w = smoke["parts"]["profile"]["results"], smoke["workload"]
    replay, loop, nocb = prof["replay"], prof["loop"], smoke["parts"]["profile_nocb"]["results"]["replay"]
    int8 = smoke["parts"]["profile_int8"]["results"]["replay"]
    assert "loop" not in smoke["parts"]["profile_nocb"]["results"]
    assert "loop" not in smoke["parts"]["profile_int8"]["results"]
    for r in (replay, nocb, int8):
        assert r["decode_iterations_per_call"] == r["tokens_per_window"] == w["profile_steps"]
        assert r["num_windows"] == w["profile_calls"]
    assert loop["num_windows"] == 1 and loop["tokens"] > 0
    for s in (replay, loop, nocb, int8):
        for win in s["windows"]:
            assert close(win["wall_us"], win["lead_us"] + win["busy_us"] + win["gaps_us"] + win["tail_us"], 1e-6)
            assert 0 < win["busy_us"] <= min(win["wall_us"], win["kernel_us"] + 1e-6) and win["gaps_us"] >= 0
        assert close(sum(v["us_per_window"] for v in s["categories"].values()), s["kernel_us"], 1e-6)
        assert sum(k["us_per_window"] for k in s["kernels"]) <= s["kernel_us"] + 1e-6
        assert len(s["kernels"]) == min(30, s["num_kernel_names"])
        assert close(s["kernels_per_token"], s["kernels_per_window"] / s["tokens_per_window"])
        assert close(s["hlo_mapped_share"], 1.0, 1e-9)    # every thunk named an instruction of the step's HLO
    # the CPU's HLO stacks place time in every category of the decode call
    for r in (replay, int8):
        assert all(r["categories"][c]["us_per_window"] > 0 for c in ("attention", "matmul", "lm_head", "sampler"))


def test_int8_profile_against_bf16_recomputed(smoke):
    """derived.profile_int8_vs_bf16: each category's (and the window's wall, busy and gap) time per
    decode token in the bf16 and int8 replay traces, and int8's excess, from the raw summaries."""
    a = smoke["parts"]["profile"]["results"]["replay"]
    b = smoke["parts"]["profile_int8"]["results"]["replay"]
    d = smoke["derived"]["profile_int8_vs_bf16"]
    # the int8 part's model is the bf16 one with its linears' weights as int8 codes (+ per-channel scales)
    bf16, int8 = (smoke["parts"][p]["results"]["build"] for p in ("profile", "profile_int8"))
    assert (bf16["weights"], int8["weights"]) == ("bf16", "int8") and int8["embed_bytes"] == bf16["embed_bytes"]
    assert int8["param_bytes"] < bf16["param_bytes"]
    assert set(d) == {"wall_us", "busy_us", "gaps_us", "attention", "matmul", "lm_head", "sampler", "other"}
    for key, row in d.items():
        x, y = ((s[key] if key.endswith("_us") else s["categories"][key]["us_per_window"]) / s["tokens_per_window"]
                for s in (a, b))
        assert close(row["bf16_us_per_token"], x) and close(row["int8_us_per_token"], y)
        assert close(row["int8_minus_bf16_us"], y - x, 1e-6)


def test_mbu_knee_and_plan_recomputed(smoke):
    w, parts, d = smoke["workload"], smoke["parts"], smoke["derived"]
    b, m = w["base"], w["base"]["model"]
    copy = parts["ceilings"]["results"]["copy"]["GBps"] * 1e9
    mm = parts["ceilings"]["results"]["matmul"]
    flops = 2 * mm["n"] ** 3 / (max(mm["total_s"] - mm["overhead_s"], mm["total_s"] / 2) / mm["calls"])
    assert close(d["copy_Bps"], copy) and close(d["matmul_flops"], flops)
    v, dm, L, hkv = m["vocab_size"], m["hidden_size"], m["num_hidden_layers"], m["num_key_value_heads"]
    hd, f = dm // m["num_attention_heads"], m["intermediate_size"]
    layer = 2 * (dm * (m["num_attention_heads"] + 2 * hkv) * hd + dm * dm + dm * 2 * f + f * dm)
    read = 2 * (v * dm + (2 * L + 1) * dm) + L * layer + 2 * dm    # LM head, norms, layers, one embedding row
    kv = 2 * 2 * L * hkv * hd
    build = parts["batch1"]["results"]["build"]
    assert (build["weight_bytes_read_per_token"], build["kv_bytes_per_token"]) == (read, kv)
    n, p = b["decode_tokens"], b["prompt_len"]
    for key, r in parts["batch1"]["results"]["settings"].items():
        tok_s = n / (np.median(r["tN_s"]) - np.median(r["t1_s"]))
        per_token = read + (p + (n + 1) / 2) * kv
        assert close(d["batch1"][key]["decode_tok_s"], tok_s) and close(d["batch1"][key]["mbu_vs_copy"],
                                                                         per_token * tok_s / copy)
        assert d["batch1"][key]["mbu_vs_datasheet"] is None               # a CPU has no datasheet
    # plan at batch 1: bandwidth / (weights read + context * KV), context = p + (n + 1) / 2 rounded
    context = round(p + (n + 1) / 2)
    assert close(d["plan_batch1"]["decode_tokens_per_s_bs1"], copy / (read + context * kv))
    levels = parts["knee"]["results"]["concurrency"]
    rates = {int(c): r["total_new_tokens"] / r["wall_s"] for c, r in levels.items()}
    assert sorted(rates) == list(b["concurrency"])
    assert all(levels[str(c)]["total_new_tokens"] == c * b["new_tokens"] for c in rates)
    assert all(close(levels[str(c)]["decode_tok_s"], c / levels[str(c)]["median_tpot_s"]) for c in rates)
    best = max(rates.values())
    knee = min(c for c, r in rates.items() if r >= w["knee_fraction"] * best)
    k = d["knee"]
    assert k["output"]["knee"] == knee and close(k["output"]["best_rate"], best)
    assert k["output"]["censored"] == (rates[max(rates)] == best)
    # plan's compute-bound batch for bf16 weights: B* x 2 bytes/param / 2 = F / BW
    assert close(k["plan_measured_ceilings"]["compute_bound_batch"], flops / copy)
    assert close(k["measured_knee_over_predicted"], knee / (flops / copy))
    for attention in w["ttft_attention"]:
        t = parts["ttft"]["results"][attention]
        assert close(t["ttft_median_s"], float(np.median(t["ttft_s"])))
        assert all(0 < ttft <= wall for ttft, wall in zip(t["ttft_s"], t["wall_s"]))
        assert t["prefill_steps"] == math.ceil(w["ttft_prompt_len"] / b["max_num_batched_tokens"])


def test_parts_selector():
    from bench.gpu.decode import parse_parts
    assert parse_parts("knee, ceilings") == ["ceilings", "knee"] and parse_parts(None) == PARTS
    with pytest.raises(ValueError, match="unknown part"):
        parse_parts("ceilings,decode")
