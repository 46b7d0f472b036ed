"""Tensor parallelism (jaxinfer/sharding.py).

Single-device checks run here. The multi-device checks run once, in a subprocess with 8 virtual
CPU devices (tests/sharding_worker.py; this process has already initialised jax with one device):
TP in {2, 4, 8} on a Llama with 8 heads / 2 KV heads / vocab 136, and TP 8 on a tied one with
biases and an odd vocab (131), against the same model on one device:
  (a) full-forward logits within 1e-5 relative, (b) per-device weight bytes = total / tp for every
  sharded matrix and the full size for replicated ones, (c) identical greedy generations through
  Generator with sharded weights and KV pages, plus load_sharded reading only each shard, and
  int4 weights sharded at TP 2 against the same quantized model on one device.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import Decoder, quantize_decoder
from jaxinfer.quant import QuantizedWeight
from jaxinfer.sharding import (DEFAULT_RULES, ShardingRules, bytes_per_device, kv_sharding, make_mesh,
                               model_mesh, param_sharding, rules_for, shard_decoder, shard_kv_pages)
from tests.sharding_worker import CONFIGS, TPS

from tests.fake_devices import run_worker

RTOL = 1e-5


def _abstract_mesh(tp: int) -> AbstractMesh:
    return AbstractMesh((1, 1, tp), ("data", "pipeline", "tensor"))


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=136, d_model=32, n_layers=1, n_heads=8, n_kv_heads=2, head_dim=4, ffn_dim=64)
    return ModelConfig(**{**base, **kw})


# ------------------------------------------------------------------------------ single device

def test_rules_are_frozen_megatron_defaults():
    r = DEFAULT_RULES
    assert {a: r[a] for a in ("heads", "kv_heads", "mlp", "vocab")} == dict.fromkeys(
        ("heads", "kv_heads", "mlp", "vocab"), "tensor")
    assert r["embed"] is r["head_dim"] is r["position"] is None and r["layers"] == "pipeline"
    with pytest.raises((AttributeError, TypeError)):
        r._rules = {}
    with pytest.raises(TypeError):
        r["vocab"] = None             # a Mapping, not a MutableMapping
    assert hash(r) == hash(ShardingRules(dict(r))) and r == ShardingRules(dict(r))
    assert r.without("vocab")["vocab"] is None and r["vocab"] == "tensor"
    with pytest.raises(ValueError, match="mesh axis"):
        ShardingRules(heads="model")


@pytest.mark.parametrize("tp, cfg_kw, replicated", [
    (1, {}, set()),
    (2, {}, set()),
    (4, {}, {"kv_heads"}),                                  # 2 KV heads < 4 devices
    (8, {"vocab_size": 131}, {"kv_heads", "vocab"}),
    (16, {}, {"heads", "kv_heads", "vocab"}),                # ffn 64 still divides
    (16, {"ffn_dim": 72}, {"heads", "kv_heads", "mlp", "vocab"}),
    (3, {"n_heads": 6, "n_kv_heads": 3, "ffn_dim": 96, "vocab_size": 99}, set()),
])
def test_rules_for_drops_axes_that_do_not_divide(tp, cfg_kw, replicated):
    rules = rules_for(_cfg(**cfg_kw), _abstract_mesh(tp))
    for axis in ("heads", "kv_heads", "mlp", "vocab"):
        assert rules[axis] == (None if axis in replicated else "tensor"), axis


def test_param_sharding_specs():
    mesh = _abstract_mesh(4)
    rules = rules_for(_cfg(), mesh)
    spec = lambda axes, shape=None: param_sharding(axes, rules, mesh, shape).spec  # noqa: E731
    assert spec(("embed", "heads", "head_dim")) == P(None, "tensor")           # q: column-parallel
    assert spec(("heads", "head_dim", "embed")) == P("tensor")                 # o: row-parallel
    assert spec(("embed", "kv_heads", "head_dim")) == P()                      # k/v: replicated (GQA)
    assert spec(("embed", "mlp")) == P(None, "tensor") and spec(("mlp", "embed")) == P("tensor")
    assert spec(("vocab", "embed")) == P("tensor") and spec(("embed", "vocab")) == P(None, "tensor")
    assert spec(("embed",)) == P() and spec(("position", "embed")) == P() and spec(None) == P()
    assert spec(("heads", "mlp")) == P("tensor")                               # a mesh axis used once
    assert spec(("embed", "mlp"), (32, 66)) == P()                             # 4 does not divide 66
    assert kv_sharding(mesh, 2).spec == P() and kv_sharding(mesh, 8).spec == P("tensor")


def test_make_mesh_errors_and_axes():
    mesh = make_mesh()
    assert mesh.axis_names == ("data", "pipeline", "tensor") and mesh.devices.shape == (1, 1, 1)
    with pytest.raises(ValueError, match="needs 2 devices but only 1"):
        make_mesh(tensor_parallel=2)
    with pytest.raises(ValueError, match="needs 1 devices, but 2 were given"):
        make_mesh(devices=jax.devices() * 2)
    with pytest.raises(ValueError, match="integers >= 1"):
        make_mesh(tensor_parallel=0)


def test_shard_decoder_one_device_quantized_and_kv():
    cfg = _cfg()
    model = quantize_decoder(Decoder(cfg, rngs=None), "int8")     # zero init: no per-shape RNG compiles
    mesh = make_mesh()
    assert shard_decoder(model, mesh) is model
    q = model.layers[0].attn.q.get_value()
    assert isinstance(q, QuantizedWeight) and q.q.sharding == NamedSharding(mesh, P(None, "tensor"))  # column-parallel
    assert model.embed.get_value().sharding == NamedSharding(mesh, P("tensor"))   # vocab on a size-1 axis
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert bytes_per_device(model) == {jax.devices()[0]: sum(x.nbytes for x in leaves)}
    assert model_mesh(model) is None                                               # one device: no mesh
    pages = shard_kv_pages([jnp.zeros((2, 3, 4, 4))], mesh, cfg.n_kv_heads)
    assert pages[0].sharding == kv_sharding(mesh, 2)


# ------------------------------------------------------------------------------ 8 virtual devices

@pytest.fixture(scope="module")
def tp_result(tmp_path_factory):
    from tests.sharding_worker import save_llama   # torch: written here, so the worker never imports it

    tmp = tmp_path_factory.mktemp("tp")
    for name in CONFIGS:
        save_llama(name, tmp / name)
    return run_worker("tests.sharding_worker", tmp)


def _runs(result):
    for name, entry in result["configs"].items():
        assert sorted(map(int, entry["tp"])) == sorted(TPS[name])
        for tp, run in entry["tp"].items():
            yield name, int(tp), entry, run


def test_tp_logits_match_single_device(tp_result):
    for name, tp, _, run in _runs(tp_result):
        assert run["logits_rel_err"] <= RTOL, (name, tp, run["logits_rel_err"])


def test_tp_greedy_generation_identical(tp_result):
    for name, tp, entry, run in _runs(tp_result):
        assert any(len(set(t)) > 1 for t in entry["ref_tokens"])     # not a degenerate repeat
        assert run["tokens"] == entry["ref_tokens"], (name, tp)
        assert run["param_devices"] == list(range(tp))     # the runner's nnx.split kept the shardings
        assert run["model_mesh_found"] and entry["ref_model_mesh"]
        # the donated pages come back with the sharding they went in with: no recompilation
        assert run["kv_spec_after"] == run["kv_spec_before"] == run["kv_expected_spec"], (name, tp)
        assert run["generate_compiles"] == entry["ref_generate_compiles"], (name, tp)
        # prefix caching on (the default) under TP: the second prompt starts from the first's two
        # cached blocks of the shared prefix, and draws what the one-device engine draws
        assert run["shared_tokens"] == entry["ref_shared"], (name, tp)
        assert run["shared_cache_hits"] >= 16, (name, tp)


def test_tp_weight_bytes_per_device(tp_result):
    for name, tp, _, run in _runs(tp_result):
        vocab = CONFIGS[name]["vocab_size"]
        expect_sharded = {"q": True, "o": True, "up": True, "gate": True, "down": True, "q_bias": True,
                          "up_bias": True, "gate_bias": True, "k": 2 % tp == 0, "v": 2 % tp == 0,
                          "k_bias": 2 % tp == 0, "v_bias": 2 % tp == 0, "embed": vocab % tp == 0,
                          "lm_head": vocab % tp == 0}
        sharded_total = sharded_dev = 0
        for path, w in run["weights"].items():
            short = path.split("/")[-1]
            assert len(w["per_device"]) == tp
            if expect_sharded[short]:
                assert not w["replicated"] and "tensor" in w["spec"], (name, tp, path, w)
                for b in w["per_device"]:
                    assert abs(b - w["nbytes"] / tp) <= 0.01 * w["nbytes"] / tp, (name, tp, path, w)
                sharded_total += w["nbytes"]
                sharded_dev += w["per_device"][0]
            else:
                assert w["replicated"] and w["per_device"] == [w["nbytes"]] * tp, (name, tp, path, w)
        assert abs(sharded_dev - sharded_total / tp) <= 0.01 * sharded_total / tp
        per_dev, total = run["per_device_param_bytes"], run["total_param_bytes"]
        assert len(set(per_dev)) == 1 and total / tp <= per_dev[0] < total


def test_tp_kv_pages_sharded_when_heads_divide(tp_result):
    for name, tp, entry, run in _runs(tp_result):
        kv = run["kv_per_device_bytes"]
        full = 2 * 2 * 2 * 64 * 8 * 8 * 4      # layers x (k, v) x kv heads x blocks x block x head_dim x f32
        assert kv == [full // tp if 2 % tp == 0 else full] * tp, (name, tp, kv)


def test_tp_quantized_weights_sharded_not_replicated(tp_result):
    """int4 weights at TP 2: column-parallel q/k/v/gate/up split their codes' and scales' columns,
    row-parallel o/down their codes' and grouped scales' rows (K / 2 = 32 rows: whole bytes and
    whole groups of 32); each device holds half of every leaf, and the engine draws the tokens of
    the same quantized model on one device."""
    q = tp_result["quantized_tp2"]
    want = {"q": "P(None, 'tensor')", "k": "P(None, 'tensor')", "v": "P(None, 'tensor')",
            "gate": "P(None, 'tensor')", "up": "P(None, 'tensor')", "o": "P('tensor',)", "down": "P('tensor',)"}
    assert {p.split("/")[-1] for p in q["weights"]} == set(want)
    for path, leaves in q["weights"].items():
        for leaf, w in leaves.items():
            assert w["spec"] == want[path.split("/")[-1]], (path, leaf, w)
            assert w["per_device"] == [w["nbytes"] // 2] * 2, (path, leaf, w)
    assert q["logits_rel_err"] <= RTOL
    assert q["tokens"] == q["ref_tokens"] and any(len(set(t)) > 1 for t in q["ref_tokens"])


def test_load_sharded_reads_only_each_shard(tp_result):
    ls = tp_result["load_sharded"]
    assert ls["equal"] and ls["array_source_equal"] and ls["dtype"] == "float16"
    assert ls["shard_shapes"] == [[16, 3]] * 4
    assert sorted(r[1] for r in ls["reads"]) == [[0, 3], [3, 6], [6, 9], [9, 12]]
    assert "needs 16 devices but only 8" in tp_result["mesh_error"]
