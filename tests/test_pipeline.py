"""Pipeline parallelism (jaxinfer/pipeline.py).

Host-side checks (micro-batch split, the bubble formula, the layer-count error) run here. The
multi-device checks run once, in a subprocess with 8 virtual CPU devices (tests/pipeline_worker.py):
PP 2 and 4, TP 2 x PP 2 and TP 4 x PP 2 on a 4-layer Llama with GQA (2 KV heads < TP 4) and PP 2 / 4,
TP 2 x PP 2 on a 4-layer Qwen2 with 1 KV head and per-layer sliding windows, each built by
Generator.from_pretrained and compared with the same model on one device: (a) full-forward logits
within 1e-5 relative, (b) identical greedy generations (mixed prompt lengths, a chunked prefill,
more prompts than sequences; also with int8 KV pages at TP 2 x PP 2) and zero compilations after
warm-up, (c) each device holds only its stage's layers: per-device bytes of every stacked layer
weight = total / pp (/ tp where "tensor" shards it), read from the arrays' shardings; KV pages
likewise split over the stages.
"""
from __future__ import annotations


import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.host.request import Request
from jaxinfer.host.scheduler import ScheduledSeq
from jaxinfer.config import SamplingParams
from jaxinfer.pipeline import bubble_fraction, layers_per_stage, split_microbatches
from tests.pipeline_worker import LAYOUTS, MODELS, PROMPTS

from tests.fake_devices import run_worker

RTOL = 1e-5


# ------------------------------------------------------------------------------ host side

def _seqs(sizes: list[int]) -> list[ScheduledSeq]:
    return [ScheduledSeq(Request(f"r{i}", [1] * n, SamplingParams(), 0), 0, n, True) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("sizes, m, loads", [
    ([1, 1, 1, 1, 1, 1, 1, 1], 4, [2, 2, 2, 2]),
    ([16, 1, 1, 1], 2, [16, 3]),
    ([5, 9, 3, 7], 2, [12, 12]),
    ([4], 3, [4, 0, 0]),           # fewer sequences than micro-batches: the empty ones come last
    ([], 2, [0, 0]),
])
def test_split_microbatches_balances_tokens(sizes, m, loads):
    seqs = _seqs(sizes)
    groups = split_microbatches(seqs, m)
    assert len(groups) == m
    assert sorted(sum(q.num_tokens for q in g) for g in groups) == sorted(loads)
    assert [bool(g) for g in groups] == sorted((bool(g) for g in groups), reverse=True)
    assert sorted(id(q) for g in groups for q in g) == sorted(id(q) for q in seqs)   # each exactly once
    for g in groups:                                                                # scheduler order kept
        assert [seqs.index(q) for q in g] == sorted(seqs.index(q) for q in g)


def test_bubble_fraction_formula():
    assert bubble_fraction(1, 4) == 3 / 4 and bubble_fraction(4, 4) == 3 / 7 and bubble_fraction(8, 4) == 3 / 11
    assert bubble_fraction(5, 1) == 0


def test_layers_must_divide_into_stages():
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=6, n_heads=2, n_kv_heads=2, head_dim=8, ffn_dim=32)
    assert layers_per_stage(cfg, 2) == 3 and layers_per_stage(cfg, 6) == 1
    with pytest.raises(ValueError, match="pipeline_parallel=4 must divide the model's 6 layers"):
        layers_per_stage(cfg, 4)


# ------------------------------------------------------------------------------ 8 virtual devices

@pytest.fixture(scope="module")
def pp_result(tmp_path_factory):
    from tests.hf_models import save_hf_model   # torch: imported here, so the worker never does

    tmp = tmp_path_factory.mktemp("pp")
    for name, overrides in MODELS.items():
        save_hf_model(name, tmp / name, overrides)
    save_hf_model("qwen2-window", tmp / "three-layers")            # 3 layers: not divisible by pp 2
    return run_worker("tests.pipeline_worker", tmp)


def _runs(result):
    for name, entry in result["configs"].items():
        assert sorted(entry["layouts"]) == sorted(f"tp{tp}pp{pp}" for tp, pp, _ in LAYOUTS[name])
        for run in entry["layouts"].values():
            yield name, entry, run


def test_pp_logits_match_single_device(pp_result):
    for name, _, run in _runs(pp_result):
        assert run["logits_rel_err"] <= RTOL, (name, run["tp"], run["pp"], run["logits_rel_err"])


def test_pp_greedy_generation_identical_and_no_recompiles(pp_result):
    for name, entry, run in _runs(pp_result):
        tokens = entry["ref_tokens"]
        assert [len(t) for t in tokens] == [8] * len(PROMPTS)
        assert sum(len(set(t)) for t in tokens) > 2 * len(tokens)     # not degenerate repeats
        assert run["tokens"] == tokens, (name, run["tp"], run["pp"])
        assert run["generate_compiles"] == 0 and run["compilations_after_warmup"] == 0, (name, run["tp"], run["pp"])
        assert entry["ref_compiles"] == 0
        assert run["kv_blocks_free_after"] == run["kv_blocks_total"]     # every block back after the requests
        # a stage pads each group of micro-batches to its own bucket: no padding-aware cut
        assert run["compute_bound_tokens"] == 0
        # prefix caching on (the default) across stages: the samples behind a shared prefix start from
        # its cached blocks (two of them each) and draw what the one-device engine draws
        assert run["shared_tokens"] == entry["ref_shared"], (name, run["tp"], run["pp"])
        assert run["biased_tokens"] == entry["ref_biased"] and entry["ref_biased"] != entry["ref_tokens"], name
        assert not any(7 in t for t in entry["ref_biased"])
        assert run["shared_cache_hits"] >= 2 * 16, (name, run["tp"], run["pp"])
        assert run["microbatches"] == next(m or pp for tp, pp, m in LAYOUTS[name]
                                           if (tp, pp) == (run["tp"], run["pp"]))


def test_pp_each_device_holds_its_stage_layers(pp_result):
    for name, _, run in _runs(pp_result):
        tp, pp = run["tp"], run["pp"]
        n_layers = MODELS[name]["num_hidden_layers"]
        lp = n_layers // pp
        total = per_dev = 0
        for path, w in run["weights"].items():
            assert w["spec"][0] == "pipeline" and w["logical_axes"][0] == "layers", (name, path, w)
            split = pp * (tp if "tensor" in w["spec"] else 1)
            assert w["per_device"] == [w["nbytes"] // split] * (pp * tp), (name, tp, pp, path, w)
            # device d (mesh order: pipeline-major, tensor inner) holds layers of stage d // tp only
            assert w["layers"] == [list(range(d // tp * lp, (d // tp + 1) * lp)) for d in range(pp * tp)], (path, w)
            total += w["nbytes"]
            per_dev += w["per_device"][0]
        if tp == 1:
            assert per_dev == total // pp, (name, pp)
        else:
            assert total // (pp * tp) <= per_dev < total // pp, (name, tp, pp)     # q/o/mlp sharded, GQA k/v not
        # every device: its 1/pp of the layers plus the (replicated over pipeline) embeddings and head
        assert len(set(run["per_device_param_bytes"])) == 1


def test_pp_kv_pages_split_over_stages(pp_result):
    for name, _, run in _runs(pp_result):
        tp, pp = run["tp"], run["pp"]
        from tests.pipeline_worker import engine_config
        ecfg = engine_config()
        kv_heads = 2 if name.startswith("llama") else 1
        head_dim = 16
        full = MODELS[name]["num_hidden_layers"] * 2 * kv_heads * ecfg.num_blocks * ecfg.block_size * head_dim * 4
        heads_split = tp > 1 and kv_heads % tp == 0       # GQA/MQA with fewer KV heads than tp: replicated
        assert run["kv_per_device_bytes"] == [full // (pp * (tp if heads_split else 1))] * (pp * tp), (name, tp, pp)
        assert run["kv_spec"] == (["pipeline", "tensor"] if heads_split else ["pipeline"]), (name, tp, pp)


def test_pp_int8_kv_pages_identical_to_one_device(pp_result):
    int8 = pp_result["configs"]["llama-gqa-llama3"]["int8_kv"]
    assert int8["tokens"] == int8["ref_tokens"] and int8["compilations_after_warmup"] == 0
    assert int8["scale_spec"] == ["pipeline", "tensor"]          # TP 2 x PP 2, 2 KV heads: both split


def test_pp_quantized_weights_match_one_device_and_split_over_stages(pp_result):
    """int4 quantized at load (TP 2 x PP 2) and a W8A8 checkpoint with static asymmetric activation
    scales (PP 2): the same tokens and logits as that quantized model on one device, and every leaf stacked
    over the layers with each device holding its stage's layers only (and its tensor shard)."""
    runs = pp_result["configs"]["llama-gqa-llama3"]["quantized"]
    n_layers = MODELS["llama-gqa-llama3"]["num_hidden_layers"]
    for label, run in runs.items():
        tp, pp = run["tp"], run["pp"]
        assert run["tokens"] == run["ref_tokens"] and run["compilations_after_warmup"] == 0, label
        assert run["logits_rel_err"] <= RTOL, (label, run["logits_rel_err"])
        fields = {k.rsplit("/", 1)[1] for k in run["leaves"]}
        assert fields == ({"q", "scales"} if label == "int4" else {"q", "scales", "act_scale", "act_zero"}), \
            (label, fields)
        names = {k.rsplit("/", 1)[0] for k in run["leaves"]}
        assert names == {f"{m}/{n}" for m, ns in (("attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for n in ns}
        for path, leaf in run["leaves"].items():
            assert leaf["shape"][0] == n_layers and leaf["spec"][0] == "pipeline", (label, path, leaf)
            split = pp * (tp if "tensor" in leaf["spec"] else 1)
            assert leaf["per_device"] == [leaf["nbytes"] // split] * (pp * tp), (label, path, leaf)
        if tp > 1:   # int4: the column-parallel codes split over "tensor" inside each stage
            for proj in ("attn/q", "mlp/gate", "mlp/up"):
                assert run["leaves"][f"{proj}/q"]["spec"] == ["pipeline", None, "tensor"], (label, proj)


def test_pp_loading_paths_and_errors(pp_result):
    for name, entry in pp_result["configs"].items():
        assert entry["same_stacking"] == {"decoder": True, "native": True}, name
    assert "pipeline_parallel=2 must divide the model's 3 layers" in pp_result["indivisible_error"]
    refusals = pp_result["direct_refusals"]
    assert "prompt_logprobs is not available" in refusals["prompt_logprobs"]
    assert "kv_offload_gb (the host tier) is not available" in refusals["kv_offload"]
    assert "needs a mesh with pipeline_parallel >= 2, got 1" in refusals["one_stage"]
    assert refusals["after"] == pp_result["configs"]["llama-gqa-llama3"]["ref_tokens"][:1]   # still serving
