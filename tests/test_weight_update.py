"""New weights for a running engine and its sleep mode (jaxinfer/weight_update.py): Generator.update_weights
from a folder or from named tensors, sleep(level) / wake_up(tags), each checked against HF
transformers' greedy tokens of the weights served, and against the device memory jax holds."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer import Generator, SamplingParams
from jaxinfer.engine import EngineBusyError, EngineSleepingError
from jaxinfer.errors import CheckpointError
from tests.hf_models import build_hf_model
from tests.test_engine import BUCKETED, BUCKETED_MODEL

# the engine settings of test_engine's HF-greedy tests: their step programs load from the run's cache
SETTINGS = dict(BUCKETED, token_buckets=[32])
PROMPTS = [[5, 9, 17, 3, 88, 41, 7, 120, 64, 2, 33, 19], [40, 2, 8]]   # the first fills a block: cached
N = 6
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


def hf_greedy(model) -> list[list[int]]:
    import torch
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two draws of one config (seeds 0 and 1) saved as folders, their HF models and greedy tokens,
    and a third of another shape."""
    tmp = tmp_path_factory.mktemp("weights")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        m = build_hf_model(BUCKETED_MODEL, seed=seed)
        m.save_pretrained(tmp / name)
        out[name] = (tmp / name, m, hf_greedy(m))
    build_hf_model(BUCKETED_MODEL, seed=2, overrides={"intermediate_size": 64}).save_pretrained(tmp / "narrow")
    out["narrow"] = (tmp / "narrow", None, None)
    return out


def tokens(gen: Generator) -> list[list[int]]:
    return [o.token_ids for o in gen.generate(PROMPTS, GREEDY)]


def test_update_weights_from_a_folder_and_from_named_tensors(models):
    """A then B (a folder) then A again (its torch state dict): HF's greedy tokens of the weights
    served each time, with nothing compiled and the prefix cache emptied (PROMPTS[0] fills a
    block, cached under A's K/V: were it reused, B's tokens would come from A's context)."""
    a_dir, a, a_ref = models["a"]
    b_dir, _, b_ref = models["b"]
    assert a_ref != b_ref
    gen = Generator.from_pretrained(a_dir, **SETTINGS)
    assert tokens(gen) == a_ref and gen.stats()["prefix_cache_blocks"] > 0
    # a request that ends on a stop token leaves the step dispatched after its last one in flight
    # (async scheduling): the update collects it rather than waiting for a request that never comes
    stop = SamplingParams(max_tokens=N, temperature=0, stop_token_ids=[a_ref[1][0]])   # its first token
    assert gen.generate([PROMPTS[1]], stop)[0].finish_reason == "stop"
    gen.update_weights(b_dir)
    assert gen.stats()["prefix_cache_blocks"] == 0
    assert tokens(gen) == b_ref
    np.testing.assert_allclose(gen.logits(PROMPTS[1]), _hf_logits(models["b"][1], PROMPTS[1]), rtol=0, atol=1e-4)
    gen.update_weights(dict(a.state_dict()))
    assert tokens(gen) == a_ref
    assert gen.stats()["compilations_after_warmup"] == 0


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_bad_weights_are_refused_and_nothing_changes(models):
    """Another shape (a config that differs), a tensor missing from a state dict, a tensor of the
    wrong shape, and an update while a request runs: each refused naming what is wrong, the served
    weights unchanged (A's greedy tokens after each)."""
    a_dir, a, a_ref = models["a"]
    gen = Generator.from_pretrained(a_dir, **SETTINGS)
    with pytest.raises(CheckpointError, match="ffn_dim: 64"):   # ModelConfig.ffn_dim: intermediate_size
        gen.update_weights(models["narrow"][0])
    state = dict(a.state_dict())
    missing = state.pop("model.layers.1.mlp.down_proj.weight")
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        gen.update_weights(state)
    state["model.layers.1.mlp.down_proj.weight"] = missing[:, :-1]
    with pytest.raises(CheckpointError, match="down_proj"):
        gen.update_weights(state)
    rid = gen.client.submit([PROMPTS[0]], GREEDY)[0]
    with pytest.raises(EngineBusyError, match="unfinished"):
        gen.update_weights(models["b"][0])
    gen.abort(rid)
    gen.client.run_until_done()
    assert tokens(gen) == a_ref


def test_a_copy_that_fails_midway_leaves_the_weights_discarded(models, monkeypatch):
    """The device refusing a leaf partway through (as when it runs out of memory): the error comes
    out, the engine sleeps with its weights discarded (never half of A and half of B), requests are
    refused, and wake_up() reads A's folder again."""
    import jaxinfer.weight_update as wu
    a_dir, _, a_ref = models["a"]
    gen = Generator.from_pretrained(a_dir, **SETTINGS)
    put, calls = wu._put, []

    def failing(y, x):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (injected)")
        return put(y, x)
    monkeypatch.setattr(wu, "_put", failing)
    with pytest.raises(RuntimeError, match="injected"):
        gen.update_weights(models["b"][0])
    monkeypatch.setattr(wu, "_put", put)
    assert gen.is_sleeping()
    with pytest.raises(EngineSleepingError):
        gen.generate(PROMPTS, GREEDY)
    gen.wake_up()
    assert tokens(gen) == a_ref and gen.stats()["compilations_after_warmup"] == 0


def test_sleep_frees_the_device_and_wake_up_restores(models):
    """sleep(1) frees the weights and the KV pages (jax's live arrays drop by at least their bytes),
    refuses requests, and wake_up() serves A again; sleep(2) then update_weights(B) then
    wake_up(["kv_cache"]) serves B (the RL loop's order); sleep(2) then wake_up() reads the
    checkpoint the engine started from (A). Nothing compiles a step."""
    a_dir, _, a_ref = models["a"]
    b_dir, _, b_ref = models["b"]
    gen = Generator.from_pretrained(a_dir, **SETTINGS)
    assert tokens(gen) == a_ref
    runner = gen.engine.runner
    held = sum(x.nbytes for x in jax.tree.leaves((runner.params, runner.kv_pages)))
    live = lambda: sum(x.nbytes for x in jax.live_arrays())  # noqa: E731
    before = live()
    gen.sleep(1)
    assert gen.is_sleeping() and before - live() >= held
    with pytest.raises(EngineSleepingError):
        gen.generate(PROMPTS, GREEDY)
    with pytest.raises(EngineSleepingError):
        gen.logits(PROMPTS[1])
    gen.wake_up()
    assert not gen.is_sleeping() and tokens(gen) == a_ref
    gen.sleep(2)
    gen.update_weights(b_dir)
    assert gen.is_sleeping()                 # the pages are still freed
    gen.wake_up(["kv_cache"])
    assert tokens(gen) == b_ref
    gen.sleep(2)
    gen.wake_up(["weights"])
    assert gen.is_sleeping()
    gen.wake_up()
    assert tokens(gen) == a_ref
    with pytest.raises(ValueError, match="bogus"):
        gen.wake_up(["bogus"])
    with pytest.raises(ValueError, match="level"):
        gen.sleep(3)
    assert gen.stats()["compilations_after_warmup"] == 0


def test_int8_weights_and_a_draft_model_kept(models):
    """quantize="int8" (the new weights quantized as the served ones were) under speculative decoding
    with A as the draft model: after update_weights(B) the draft is still A and the target B, and
    greedy speculation is exact, so the tokens are those of a fresh int8 engine over B; after
    sleep(1) / wake_up() the same again (the draft's weights kept in host memory too)."""
    a_dir, _, _ = models["a"]
    b_dir, _, _ = models["b"]
    kw = dict(SETTINGS, quantize="int8")
    fresh = Generator.from_pretrained(b_dir, **kw)
    ref = tokens(fresh)
    gen = Generator.from_pretrained(a_dir, **kw, speculative_method="draft", speculative_model=a_dir,
                                    speculative_max_batch=4, num_speculative_tokens=2)
    draft = lambda: [np.asarray(x) for x in jax.tree.leaves(gen.engine.runner.params.draft)]  # noqa: E731
    before = draft()
    gen.update_weights(b_dir)
    assert tokens(gen) == ref
    assert gen.stats()["spec_decode_num_drafts"] > 0
    gen.sleep(1)
    gen.wake_up()
    assert tokens(gen) == ref
    assert all(np.array_equal(x, y) for x, y in zip(draft(), before))   # the draft is A's, as it was


def test_http_routes_with_enable_sleep_mode(models):
    """vLLM's /sleep, /wake_up, /is_sleeping and SGLang's /update_weights_from_disk: completions answer
    503 while asleep, B's greedy tokens after the update (HF's), a bad folder a 400 with success false,
    a bad level or tag a 400 naming it; without the flag the routes do not exist."""
    from fastapi.testclient import TestClient

    from serve.app import build_app
    a_dir, _, _ = models["a"]
    b_dir, _, b_ref = models["b"]
    gen = Generator.from_pretrained(a_dir, **SETTINGS)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with TestClient(build_app(gen, "tiny")) as http:
        assert http.post("/sleep").status_code == 404
    with TestClient(build_app(gen, "tiny", enable_sleep_mode=True)) as http:
        complete = lambda: http.post("/v1/completions", json=body)  # noqa: E731
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/sleep", params={"level": 3}).json()["error"]["param"] == "level"
        assert http.post("/sleep", params={"level": 1}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        r = complete()
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping"
        assert http.post("/wake_up", params={"tags": ["weights", "nope"]}).json()["error"]["param"] == "tags"
        assert http.post("/wake_up", params={"tags": ["weights"]}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}      # the KV pages are still freed
        assert http.post("/wake_up").status_code == 200
        r = http.post("/update_weights_from_disk", json={"model_path": str(models["narrow"][0])})
        assert r.status_code == 400 and r.json()["success"] is False and "ffn_dim" in r.json()["message"]
        r = http.post("/update_weights_from_disk", json={"model_path": str(b_dir), "abort_all_requests": True})
        assert r.status_code == 400 and "abort_all_requests" in r.json()["message"]
        r = http.post("/update_weights_from_disk", json={"model_path": str(b_dir), "weight_version": "step-7"})
        assert r.status_code == 200 and r.json()["success"] is True
        assert complete().json()["choices"][0]["token_ids"] == b_ref[0]


def test_tensor_and_pipeline_parallel(models):
    """TP 2 and PP 2 on fake devices (tests/weight_update_worker.py): HF's greedy tokens of A, then of
    B after update_weights, after sleep(1) / wake_up(), and of A after sleep(2) / wake_up(); the
    shardings kept and no step compiled after the first run."""
    from tests.fake_devices import run_worker
    result = run_worker("tests.weight_update_worker", models["a"][0].parent)
    a_ref, b_ref = models["a"][2], models["b"][2]
    for label in ("tp2", "pp2"):
        run = result[label]
        assert run["a"] == run["a_again"] == a_ref and run["b"] == run["b_again"] == b_ref, label
        assert run["same_shardings"] and run["devices"] == 2, label
        assert run["programs"][0] == run["programs"][1] > 0, label
