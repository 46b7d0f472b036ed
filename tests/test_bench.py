"""bench/: the metrics against hand-computed values, the workloads, and a tiny offline run."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from bench.datasets import build_requests, load_jsonl, parse_range, sample_lengths, token_pool
from bench.metrics import RequestRecord, distribution, summarize, utilization
from jaxinfer.perf import ModelCost, StepRecord


# --------------------------------------------------------------------------- request metrics
def _records() -> list[RequestRecord]:
    return [
        # arrival, first token, finish, token times
        RequestRecord(0.0, 1.0, 2.5, [1.0, 1.5, 2.5], prompt_tokens=10, output_tokens=3),
        RequestRecord(1.0, 1.5, 2.0, [1.5, 2.0], prompt_tokens=20, output_tokens=2),
        RequestRecord(2.0, 4.0, 4.0, [4.0], prompt_tokens=30, output_tokens=1),
        RequestRecord(0.5, None, None, [], prompt_tokens=99, output_tokens=0, success=False, error="HTTP 500"),
    ]


def test_per_request_metrics():
    a, b, c, _ = _records()
    assert (a.ttft, a.e2el, a.tpot, a.itl) == (1.0, 2.5, 0.75, [0.5, 1.0])
    assert (b.ttft, b.e2el, b.tpot, b.itl) == (0.5, 1.0, 0.5, [0.5])
    assert (c.ttft, c.e2el, c.tpot, c.itl) == (2.0, 2.0, None, [])   # one token: no TPOT


def test_summary_matches_hand_computed_values():
    m = summarize(_records(), duration_s=4.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 6)
    assert m["request_throughput"] == pytest.approx(3 / 4)
    assert m["output_throughput"] == pytest.approx(6 / 4)
    assert m["total_token_throughput"] == pytest.approx(66 / 4)
    ttft = m["ttft_ms"]          # [1000, 500, 2000]
    assert ttft["n"] == 3 and ttft["mean"] == pytest.approx(3500 / 3)
    assert (ttft["p50"], ttft["p90"], ttft["p99"]) == pytest.approx((1000, 1800, 1980))   # linear interpolation
    tpot = m["tpot_ms"]          # [750, 500]
    assert tpot["n"] == 2 and (tpot["mean"], tpot["p50"], tpot["p90"]) == pytest.approx((625, 625, 725))
    itl = m["itl_ms"]            # pooled [500, 1000, 500]
    assert itl["n"] == 3 and (itl["mean"], itl["p50"], itl["p90"]) == pytest.approx((2000 / 3, 500, 900))
    e2el = m["e2el_ms"]          # [2500, 1000, 2000]
    assert (e2el["mean"], e2el["p50"], e2el["p99"]) == pytest.approx((5500 / 3, 2000, 2490))
    assert distribution([])["mean"] is None and distribution([])["p99"] is None


def test_record_from_engine_request():
    from jaxinfer.config import SamplingParams
    from jaxinfer.host.request import Request

    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=3), seed=0, arrival_time=10.0)
    for t, now in zip([5, 6, 7], [10.5, 10.7, 11.0]):
        r.append_token(t, 0.0, None, now)
    r.finish("length", 11.0)
    rec = RequestRecord.from_request(r)
    assert (rec.prompt_tokens, rec.output_tokens) == (3, 3)
    assert rec.ttft == pytest.approx(0.5) and rec.tpot == pytest.approx(0.25) and rec.e2el == pytest.approx(1.0)
    assert rec.tpot == pytest.approx(r.tpot)


# --------------------------------------------------------------------------- MBU / MFU
COST = ModelCost(n_layers=2, n_heads=4, head_dim=8, d_model=32, vocab_size=100, body_params=1000,
                 weight_bytes_read=4000, kv_bytes_per_token=256)
PREFILL = StepRecord(0.010, [(0, 4)])              # one sequence, 4 prompt tokens
DECODE = StepRecord(0.002, [(4, 1), (10, 1)])      # two sequences, one token each


def test_step_bytes_and_flops():
    # bytes = W + sum(context) * kv_bytes_per_token
    assert COST.step_bytes(PREFILL) == 4000 + 4 * 256
    assert COST.step_bytes(DECODE) == 4000 + (5 + 11) * 256
    # flops = 2 P_body T + 2 V d S + 4 H d_head L sum(keys per query)
    assert COST.step_flops(PREFILL) == 2 * 1000 * 4 + 2 * 100 * 32 * 1 + 4 * 4 * 8 * 2 * (1 + 2 + 3 + 4)
    assert COST.step_flops(DECODE) == 2 * 1000 * 2 + 2 * 100 * 32 * 2 + 4 * 4 * 8 * 2 * (5 + 11)
    windowed = dataclasses.replace(COST, windows=(2, None))
    assert windowed.step_flops(PREFILL) == 8000 + 6400 + 4 * 4 * 8 * ((1 + 2 + 2 + 2) + (1 + 2 + 3 + 4))
    assert windowed.step_bytes(PREFILL) == 4000 + 128 * 2 + 128 * 4


def test_multi_step_decode_counts_every_iteration_in_bytes_and_flops():
    """A step the device ran for several iterations (multi-step decode): bytes and FLOPs both count
    each iteration, every live sequence one token further along (FLOPs counted one iteration, so MFU
    came out low by the iteration count). By hand: iterations [3, 2] over contexts 4 and 10."""
    step = StepRecord(0.003, [(4, 1), (10, 1)], iterations=[3, 2])
    flops = lambda live, keys: 2 * 1000 * live + 2 * 100 * 32 * live + 4 * 4 * 8 * 2 * keys  # noqa: E731
    assert COST.step_flops(step) == flops(2, 5 + 11) + flops(2, 6 + 12) + flops(1, 7)
    assert COST.step_bytes(step) == 3 * 4000 + (5 + 11 + 6 + 12 + 7) * 256


def test_moe_steps_read_the_experts_their_tokens_can_reach():
    """T tokens with top-k routing reach at most min(E, T k) experts of a layer (all E were
    counted from 2 tokens on: twice the expert bytes at T = 2 with E = 8, k = 2)."""
    moe = dataclasses.replace(COST, num_experts=8, experts_per_token=2)
    assert [moe.experts_read(t) for t in (0, 1, 2, 3, 4, 100)] == [0, 2, 4, 6, 8, 8]


def test_mbu_mfu_on_a_made_up_step_log():
    u = utilization([PREFILL, DECODE], COST, peak_bandwidth=1e7, peak_flops=1e8)
    total_bytes, total_flops = 5024 + 8096, 16960 + 20896
    assert u["mbu"] == pytest.approx(total_bytes / 0.012 / 1e7)
    assert u["mfu"] == pytest.approx(total_flops / 0.012 / 1e8)
    assert u["num_steps"] == 2 and u["num_steps_decode"] == 1
    assert u["mbu_decode"] == pytest.approx(8096 / 0.002 / 1e7)
    assert u["mfu_decode"] == pytest.approx(20896 / 0.002 / 1e8)
    assert utilization([DECODE], COST, None, None)["mbu"] is None


def test_model_cost_from_config():
    from jaxinfer.config import ModelConfig

    cfg = ModelConfig(vocab_size=400, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96)
    cost = ModelCost.from_config(cfg, weight_itemsize=2, kv_itemsize=2)
    table = 400 * 64
    assert cost.body_params == cfg.num_params() - 2 * table        # untied: embedding + LM head
    assert cost.weight_bytes_read == 2 * (cfg.num_params() - table)   # the input table is gathered, not read
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 2 * 16


# --------------------------------------------------------------------------- workloads
def test_fixed_and_uniform_lengths():
    rng = np.random.RandomState(0)
    p, o = sample_lengths("fixed", 5, rng, 256, input_len=100, output_len=50)
    assert p.tolist() == [100] * 5 and o.tolist() == [50] * 5
    with pytest.raises(ValueError, match="exceeds the context"):
        sample_lengths("fixed", 5, rng, 128, input_len=100, output_len=50)
    p, o = sample_lengths("uniform", 500, rng, 1024, input_range=(16, 64), output_range=(8, 32))
    assert p.min() >= 16 and p.max() <= 64 and o.min() >= 8 and o.max() <= 32
    assert len(set(p.tolist())) > 20
    p, o = sample_lengths("uniform", 500, rng, 100, input_range=(16, 90), output_range=(8, 64))
    assert (p + o).max() <= 100 and o.min() >= 1
    with pytest.raises(ValueError, match="unknown dataset"):
        sample_lengths("nope", 5, rng, 128)
    assert parse_range("3,9") == (3, 9)
    with pytest.raises(ValueError):
        parse_range("9,3")


def test_sharegpt_synthetic_shape():
    p, o = sample_lengths("sharegpt-synthetic", 4000, np.random.RandomState(1), 100_000)
    assert 100 <= np.median(p) <= 200 and 150 <= np.median(o) <= 250
    assert p.mean() > 1.3 * np.median(p)              # long right tail
    assert p.min() >= 4 and o.min() >= 4
    p, o = sample_lengths("sharegpt-synthetic", 2000, np.random.RandomState(1), 256)
    assert (p + o).max() <= 256 and p.min() >= 4 and o.min() >= 4
    assert (p > 150).sum() > 20 and (o > 150).sum() > 20 and (o == 4).mean() < 0.05   # redrawn, not clipped
    p, o = sample_lengths("sharegpt-synthetic", 50, np.random.RandomState(1), 9)      # too short: clipped
    assert (p + o).max() <= 9 and p.min() >= 4 and o.min() >= 4


class _FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [3 + (ord(c) % 50) for c in text]


def test_build_requests_and_jsonl(tmp_path):
    reqs, info = build_requests("uniform", 7, tokenizer=None, vocab_size=97, max_model_len=64, seed=3,
                                input_range=(4, 20), output_range=(2, 9))
    assert len(reqs) == 7 and info["source"] == "random ids" and info["num_requests"] == 7
    assert all(4 <= len(r.prompt_ids) <= 20 and 2 <= r.max_tokens <= 9 for r in reqs)
    assert all(3 <= t < 97 for r in reqs for t in r.prompt_ids)
    (tmp_path / "heldout.txt").write_text("hello world " * 20)
    pool, source = token_pool(_FakeTokenizer(), 97, tmp_path, np.random.RandomState(0), min_len=500)
    assert source.endswith("heldout.txt") and len(pool) > 500
    reqs, info = build_requests("fixed", 3, tokenizer=_FakeTokenizer(), vocab_size=97, max_model_len=64,
                                model_path=tmp_path, input_len=10, output_len=5)
    assert [len(r.prompt_ids) for r in reqs] == [10] * 3 and info["source"].endswith("heldout.txt")
    f = tmp_path / "w.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [{"prompt": "abc", "max_tokens": 4},
                                                   {"prompt": [5, 6, 7, 8], "max_tokens": 100},
                                                   {"prompt": list(range(3, 80)), "max_tokens": 4}]))
    reqs, skipped = load_jsonl(f, None, _FakeTokenizer(), 64)
    assert skipped == 1 and [r.max_tokens for r in reqs] == [4, 60]      # clipped to the context
    assert reqs[1].prompt_ids == [5, 6, 7, 8]


def test_poisson_arrivals():
    from bench.benchmark import arrival_offsets

    assert arrival_offsets(5, math.inf, np.random.RandomState(0)).tolist() == [0.0] * 5
    t = arrival_offsets(4000, 10.0, np.random.RandomState(0))
    gaps = np.diff(t)
    assert t[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.1) and gaps.std() == pytest.approx(0.1, rel=0.1)


def test_sse_client_against_a_fake_server():
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from bench.benchmark import BenchRequest, completion_payload, stream_completion

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict):
        assert body["stream"] and body["ignore_eos"] and body["prompt"] == [4, 5, 6]

        async def events():
            for i in range(3):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': str(i)}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 3, 'completion_tokens': 3}})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await stream_completion(client, "http://t", completion_payload("m", BenchRequest([4, 5, 6], 3)))

    rec = asyncio.run(go())
    assert rec.success and rec.output_tokens == 3 and rec.prompt_tokens == 3 and len(rec.token_times) == 3
    assert rec.first_token == rec.token_times[0] and rec.finish == rec.token_times[-1] >= rec.arrival


def test_cli_parser_hooks():
    from bench.benchmark import add_bench_parser

    parser = argparse.ArgumentParser(prog="jaxinfer")
    add_bench_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["bench", "offline", "--batch-sizes", "1,2", "--dataset", "fixed"])
    assert (a.bench_mode, a.batch_sizes, a.dataset) == ("offline", "1,2", "fixed") and callable(a.func)
    a = parser.parse_args(["bench", "serving", "--request-rates", "1,inf", "--launch-server"])
    assert a.launch_server and a.request_rates == "1,inf"
    assert parser.parse_args(["bench", "peer-hf", "--max-tokens", "8"]).max_tokens == 8


# --------------------------------------------------------------------------- a tiny offline run
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tests.hf_models import TEXT_WORDS, save_text_model
    folder = save_text_model(tmp_path_factory.mktemp("bench") / "model")
    (folder / "heldout.txt").write_text(" ".join(TEXT_WORDS * 4))    # prompts are cut from it
    return folder


def test_tiny_offline_run_writes_json_and_png(tiny_model, tmp_path):
    pytest.importorskip("matplotlib")
    from bench.benchmark import main

    out = tmp_path / "offline.json"
    rc = main(["offline", "--model", str(tiny_model), "--dataset", "uniform", "--num-prompts", "6",
               "--batch-sizes", "1,4", "--input-range", "4,12", "--output-range", "2,6", "--max-model-len", "32",
               "--max-num-batched-tokens", "8", "--peak-bandwidth", "1e10", "--peak-flops", "1e11",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads(out.read_text())
    for key in ("benchmark", "date", "device", "jax", "model", "model_config", "config", "dataset", "peaks", "points"):
        assert key in report, key
    import jax
    assert report["benchmark"] == "offline" and report["device"]["platform"] == jax.default_backend()
    assert report["peaks"]["bandwidth_Bps"] == 1e10 and report["peaks"]["flops"] == 1e11
    assert [p["max_num_seqs"] for p in report["points"]] == [1, 4]
    for p in report["points"]:
        assert p["completed"] == 6 and p["failed"] == 0
        assert p["total_output_tokens"] == round(6 * report["dataset"]["output_tokens"]["mean"])
        assert p["output_throughput"] > 0 and p["request_throughput"] > 0
        for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(p[m]) == {"n", "mean", "std", "p50", "p90", "p99"} and p[m]["p50"] > 0
        assert 0 < p["mbu"] < 1 and 0 < p["mfu"] < 1 and p["num_steps"] > 0
        assert p["compilations_after_warmup"] == 0
    assert report["dataset"]["num_requests"] == 6 and report["dataset"]["source"].endswith("heldout.txt")
    png = out.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_speculative_copy_check_by_hand():
    """bench.speculative.copy_check on made-up sequences, counted by hand."""
    from bench.speculative import copy_check
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    # the passage continues 5 6 7 8 9; the answer follows it for 3 tokens, then leaves it
    out = [5, 6, 7, 2, 3, 4, 5]
    got = copy_check([prompt], [out], [[5, 6, 7, 8, 9]], n=3)
    assert got["tokens_following_the_passage"] == [3]
    # the 3-gram ending at each output token (the 2 tokens before it, the prompt's at first):
    # (7,8,5) (8,5,6) not in the prompt, (5,6,7) in it, (6,7,2) (7,2,3) not, (2,3,4) (3,4,5) in it -> 3 of 7
    assert got["share_of_output_3grams_in_prompt"] == [3 / 7]
    # an answer that copies the whole continuation
    assert copy_check([prompt], [[5, 6]], [[5, 6, 7]], n=2)["tokens_following_the_passage"] == [2]


def test_multiturn_report_by_hand_and_kept_after_each_rep(tmp_path, monkeypatch):
    """bench.multiturn's report from made-up passes (no engine): each side's medians and the off/on
    ratios by hand, rewritten after every rep, so a run cut at rep 3 (a lent GPU's time limit; SIGINT
    is a KeyboardInterrupt) keeps the two reps it finished."""
    import types

    from bench import multiturn

    # (off, on) per rep: TTFT p50 and p90 (s), prefill tokens, the on side's first step (s)
    passes = [((0.10, 0.30, 900), (0.05, 0.10, 300, 0.04)), ((0.30, 0.50, 900), (0.10, 0.12, 250, 0.02)),
              ((0.20, 0.40, 900), (0.04, 0.09, 350, 0.03))]
    calls = []

    def fake_run(gen, args, seed):
        rep = seed - 100
        if rep == 2:
            raise KeyboardInterrupt
        calls.append((gen.on, rep))
        p50, p90, prefill, *first = passes[rep][gen.on]
        return {"ttft_p50_s": p50, "ttft_p90_s": p90, "prefill_tokens_computed": prefill, "prefix_cache_hits": 0,
                "kv_host_hits": 0, "kv_host_restore_time_s": 0.0, "outputs": [[1, 2]] * 4,
                "ttft_parts": {"launch_host_s": 0.0, "restore_host_s": 0.0, "first_step_tokens": 8,
                               "first_step_device_s": first[0] if first else 0.09, "offload_host_s": 0.0}}

    def fake_gen(on):
        return types.SimpleNamespace(on=on, reset_prefix_cache=lambda: None,
                                     client=types.SimpleNamespace(resolved=types.SimpleNamespace(dtype="float32")))
    monkeypatch.setattr(multiturn, "run", fake_run)
    monkeypatch.setattr(multiturn, "build_generators",
                        lambda args, path, common: {on: fake_gen(on) for on in (False, True)})
    out = tmp_path / "mt.json"
    with pytest.raises(KeyboardInterrupt):
        multiturn.main(["--shape", "tiny", "--reps", "3", "--conversations", "2", "--turns", "2", "--out", str(out)])
    assert calls == [(False, 0), (True, 0), (True, 1), (False, 1)]    # who runs first alternates
    r = json.loads(out.read_text())
    assert r["reps_done"] == 2 and r["outputs_identical"] == ["4 of 4", "4 of 4"]
    # medians of two reps: off TTFT (0.10 + 0.30) / 2, on (0.05 + 0.10) / 2; p90 0.40 / 0.11; prefill 900 / 275
    assert r["tier_off"]["ttft_p50_s"] == pytest.approx(0.20) and r["tier_on"]["ttft_p50_s"] == pytest.approx(0.075)
    assert r["ttft_p50_off_over_on"] == pytest.approx(0.20 / 0.075)
    assert r["ttft_p90_off_over_on"] == pytest.approx(0.40 / 0.11)
    assert r["paired_ttft_p50_off_over_on"] == pytest.approx([0.10 / 0.05, 0.30 / 0.10])
    assert r["prefill_tokens_off_over_on"] == pytest.approx(900 / 275)
    assert r["ttft_p50_ceiling_off_over_on"] == pytest.approx(0.20 / 0.03)
    assert r["config"]["reps"] == 3 and r["pool_tokens"] == (r["num_blocks"] - 1) * 16
