"""`jaxinfer plan`: every figure against a hand calculation written out here, or a published number.

Pure Python (no jax, no models): the planner is arithmetic on ModelConfig and a device table.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import pytest

from jaxinfer.plan import (
    DEVICE_NAMES,
    PRESETS,
    add_plan_parser,
    get_device,
    get_preset,
    plan,
)

GiB = 2**30


def run_plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="jaxinfer")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def plan_json(argv: list[str], capsys) -> dict:
    assert run_plan([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# Published parameter counts (model cards / HF safetensors metadata), each re-derived by hand:
# per layer q, k, v, o + gate, up, down + 2 RMSNorm vectors; then final norm + embedding + lm_head.
def test_llama_2_7b_params():
    attn = 4096 * 4096 + 2 * 4096 * (32 * 128) + 4096 * 4096        # MHA: 32 KV heads x 128
    mlp = 3 * 4096 * 11008
    hand = 32 * (attn + mlp + 2 * 4096) + 4096 + 2 * 32000 * 4096
    assert hand == 6_738_415_616
    assert PRESETS["llama-2-7b"].num_params() == 6_738_415_616


def test_llama_3_1_8b_params():
    attn = 4096 * 4096 + 2 * 4096 * (8 * 128) + 4096 * 4096         # GQA: 8 KV heads x 128
    mlp = 3 * 4096 * 14336
    hand = 32 * (attn + mlp + 2 * 4096) + 4096 + 2 * 128256 * 4096
    assert hand == 8_030_261_248
    assert PRESETS["llama-3.1-8b"].num_params() == 8_030_261_248


def test_mistral_7b_params():
    attn = 4096 * 4096 + 2 * 4096 * (8 * 128) + 4096 * 4096
    mlp = 3 * 4096 * 14336
    hand = 32 * (attn + mlp + 2 * 4096) + 4096 + 2 * 32000 * 4096
    assert hand == 7_241_732_096
    assert PRESETS["mistral-7b"].num_params() == 7_241_732_096
    assert PRESETS["mistral-7b"].sliding_window == 4096


def test_qwen2_7b_params():
    q, kv = 28 * 128, 4 * 128                                      # 3584, 512
    attn = 3584 * q + 2 * 3584 * kv + q * 3584 + (q + 2 * kv)      # q/k/v carry biases, o does not
    mlp = 3 * 3584 * 18944
    hand = 28 * (attn + mlp + 2 * 3584) + 3584 + 2 * 152064 * 3584
    assert hand == 7_615_616_512
    assert PRESETS["qwen2-7b"].num_params() == 7_615_616_512


def test_large_presets_params():
    # Llama-2-13B, Llama-2-70B and Llama-3.1-70B as published (13.0B, 69.0B, 70.6B).
    l13 = 40 * (4 * 5120 * 5120 + 3 * 5120 * 13824 + 2 * 5120) + 5120 + 2 * 32000 * 5120
    gqa70 = 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192) + 8192
    assert (l13, gqa70 + 2 * 32000 * 8192, gqa70 + 2 * 128256 * 8192) == (
        13_015_864_320, 68_976_648_192, 70_553_706_496)
    assert PRESETS["llama-2-13b"].num_params() == 13_015_864_320
    assert PRESETS["llama-2-70b"].num_params() == 68_976_648_192
    assert PRESETS["llama-3.1-70b"].num_params() == 70_553_706_496


def test_latent_attention_kv_bytes_are_the_cached_vector_once():
    """DeepSeek-V3's latent attention caches, per token and layer, one vector of latent + RoPE
    features (its keys and, its first kv_lora_rank features, its values: nothing else is stored).
    DeepSeek-V3's own widths (512 + 64, 61 layers) in bfloat16 by hand: 2 * 61 * 576 = 70272 bytes a
    token; int8: 61 * (576 + 4), one float32 scale per token and layer."""
    from jaxinfer.models.hf_configs import model_config_from_hf
    from jaxinfer.plan import kv_bytes_per_token
    cfg = model_config_from_hf({"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
                                "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128,
                                "num_key_value_heads": 128, "n_routed_experts": 256})
    assert cfg.kv_value_dim == 0 and cfg.head_dim == 576
    assert kv_bytes_per_token(cfg, "bfloat16") == 2 * 61 * 576 == 70272
    assert kv_bytes_per_token(cfg, "int8") == 61 * (576 + 4)


def test_latent_attention_int8_weights_by_hand():
    """quantize="int8" on DeepSeek-V3 (the preset, its published shape) quantizes o, the dense and
    shared MLPs and the experts, and leaves the latent projections in bfloat16: the planner's int8
    matmul bytes by hand (61 layers' o [128 x 128, 7168]; 3 dense MLPs of 18432; 58 MoE layers of
    one shared and 256 routed experts of 2048), everything else at 2 bytes a parameter."""
    from jaxinfer.plan import PRESETS, weight_bytes
    cfg = PRESETS["deepseek-v3"]
    o, dense, expert = 128 * 128 * 7168, 3 * 7168 * 18432, 3 * 7168 * 2048
    matmul = 61 * o + 3 * dense + 58 * (1 + 256) * expert
    wb = weight_bytes(cfg, "int8")
    assert wb["matmul"] == matmul
    assert wb["other"] == 2 * (cfg.num_params() - matmul)


def test_params_approximation():
    p = plan(PRESETS["llama-2-7b"], get_device("h100"))
    assert p.params_approx == 12 * 32 * 4096**2 + 2 * 32000 * 4096 == 6_704_594_944


def test_kv_bytes_per_token():
    cfg = PRESETS["llama-3.1-8b"]
    assert plan(cfg, get_device("h100"), context=4096).kv_bytes_per_token == 2 * 2 * 32 * 8 * 128 == 131072
    # int8 KV: 1 byte per element + an f32 scale per token per KV head, for K and for V.
    p8 = plan(cfg, get_device("h100"), kv_dtype="int8", context=4096)
    assert p8.kv_bytes_per_token == 2 * 1 * 32 * 8 * 128 + 2 * 4 * 32 * 8 == 67584
    assert p8.kv_bytes_per_sequence == 67584 * 4096
    assert plan(cfg, get_device("h100"), kv_dtype="float32", context=4096).kv_bytes_per_token == 262144


def test_weight_bytes_per_dtype():
    cfg = PRESETS["llama-2-7b"]
    matmul = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)            # quantizable params
    other = 6_738_415_616 - matmul                                # embeddings, lm_head, norms: bf16
    h100 = get_device("h100")
    assert plan(cfg, h100, dtype="bfloat16").weight_bytes == 2 * 6_738_415_616
    assert plan(cfg, h100, dtype="float32").weight_bytes == 4 * 6_738_415_616
    # int8: one f32 scale per output column: q, k, v, o -> 4096 each; gate, up -> 11008; down -> 4096.
    int8_scales = 32 * (4 * 4096 + 2 * 11008 + 4096) * 4
    assert plan(cfg, h100, dtype="int8").weight_bytes == matmul + int8_scales + 2 * other
    # int4: half a byte per param + a 4-byte (float32) scale per 128 params (every K here is a multiple of 128).
    int4 = plan(cfg, h100, dtype="int4")
    assert int4.weight_bytes == matmul // 2 + matmul // 128 * 4 + 2 * other == 3_965_198_336
    assert int4.kv_dtype == "bfloat16"


def test_b_star_and_compute_bound_batch():
    p = plan(PRESETS["llama-2-7b"], get_device("h100"))
    assert p.b_star == pytest.approx(989e12 / 3.35e12, rel=1e-12)
    assert round(p.b_star) == 295
    # bf16: 2 bytes/param, 2 FLOPs/param/token -> B = B* * 2 / 2 = B*.
    assert p.compute_bound_batch == pytest.approx(p.b_star)
    q = plan(PRESETS["llama-2-7b"], get_device("h100"), dtype="int4")
    assert q.compute_bound_batch == pytest.approx(989e12 / 3.35e12 * (3_965_198_336 / 6_738_415_616) / 2)
    a100 = plan(PRESETS["llama-2-7b"], get_device("a100-80gb"))
    assert a100.b_star == pytest.approx(312e12 / 2.039e12)
    f32 = plan(PRESETS["llama-2-7b"], get_device("h100"), dtype="float32")
    assert f32.peak_flops_kind == "tf32" and f32.b_star == pytest.approx(494.5e12 / 3.35e12)


# What a batch-1 decode token reads of llama-2-7b's bf16 weights (jaxinfer.perf's cost model): every
# weight but the untied 32000 x 4096 token-embedding table, of which it gathers one row.
LLAMA_2_7B_W1 = 2 * (6_738_415_616 - 32000 * 4096 + 4096)


def test_decode_tokens_per_s_bs1():
    p = plan(PRESETS["llama-2-7b"], get_device("h100"))
    assert p.context == 4096                                      # the model's max_position_embeddings
    kv = 2 * 2 * 32 * 32 * 128 * 4096                             # one full-context sequence
    assert p.decode_tokens_per_s_bs1 == pytest.approx(3.35e12 / (LLAMA_2_7B_W1 + kv), rel=1e-9)
    assert p.decode_tokens_per_s_bs1 == pytest.approx(3.35e12 / (13.22e9 + kv), rel=0.01)
    tp2 = plan(PRESETS["llama-2-7b"], get_device("h100"), tp=2)
    assert tp2.decode_tokens_per_s_bs1 == pytest.approx(2 * 3.35e12 / (LLAMA_2_7B_W1 + kv), rel=1e-9)
    pp2 = plan(PRESETS["llama-2-7b"], get_device("h100"), pp=2)   # stages run in turn at batch 1
    assert pp2.decode_tokens_per_s_bs1 == pytest.approx(p.decode_tokens_per_s_bs1, rel=1e-9)


def test_max_sequences_by_hand():
    p = plan(PRESETS["llama-2-7b"], get_device("h100"), memory_fraction=0.9)
    budget = int(80 * GiB * 0.9) - 2 * 6_738_415_616
    assert p.per_device_kv_budget_bytes == budget
    assert p.max_sequences == budget // (2 * 2 * 32 * 32 * 128 * 4096) == 29
    assert p.max_kv_tokens == budget // (2 * 2 * 32 * 32 * 128)


def test_max_sequences_monotone_in_memory():
    cfg = PRESETS["llama-3.1-8b"]
    counts = [plan(cfg, get_device("h100", memory_gib=g), context=8192).max_sequences for g in range(8, 200, 4)]
    assert counts[0] == 0 and counts[-1] > 100
    assert all(a <= b for a, b in zip(counts, counts[1:]))
    assert plan(cfg, get_device("h100"), context=8192, memory_fraction=0.5).max_sequences < \
        plan(cfg, get_device("h100"), context=8192, memory_fraction=0.9).max_sequences


def test_tensor_parallel_layout():
    cfg = PRESETS["llama-3.1-8b"]
    one = plan(cfg, get_device("h100"), context=8192)
    two = plan(cfg, get_device("h100"), context=8192, tp=2)
    assert two.per_device_weight_bytes * 2 == one.per_device_weight_bytes == 2 * 8_030_261_248
    assert two.per_device_kv_bytes_per_token == 2 * 2 * 32 * (8 // 2) * 128 and two.kv_sharding == "sharded"
    # Even split: the per-device count equals the aggregate formula of the module docstring.
    assert two.max_sequences == (2 * int(80 * GiB * 0.9) - 2 * 8_030_261_248) // (131072 * 8192)
    # tp=16 > 8 KV heads: each device keeps one whole KV head (replicated twice).
    sixteen = plan(cfg, get_device("h100"), context=8192, tp=16)
    assert sixteen.kv_sharding == "replicated"
    assert sixteen.per_device_kv_bytes_per_token == 2 * 2 * 32 * 1 * 128
    pp4 = plan(cfg, get_device("h100"), context=8192, pp=4)
    assert pp4.per_device_weight_bytes == 2 * 8_030_261_248 // 4
    assert pp4.per_device_kv_bytes_per_token == 2 * 2 * (32 // 4) * 8 * 128


def test_weights_that_do_not_fit():
    p = plan(PRESETS["llama-3.1-70b"], get_device("h100"), context=4096)
    assert p.max_sequences == 0 and p.per_device_kv_budget_bytes < 0
    assert any("do not fit" in w for w in p.warnings)
    assert plan(PRESETS["llama-3.1-70b"], get_device("h100"), context=4096, tp=4).max_sequences > 0


def test_config_json_path(tmp_path, capsys):
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
          "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    head_dim = 256 // 8
    attn = 256 * 256 + 2 * 256 * (2 * head_dim) + 256 * 256
    hand = 4 * (attn + 3 * 256 * 688 + 2 * 256) + 256 + 2 * 1000 * 256
    out = plan_json(["--config", str(tmp_path / "config.json"), "--device", "a100-40gb"], capsys)
    assert out["params"] == hand == 3_283_200
    assert out["weight_bytes"] == 2 * hand
    assert out["context"] == 512
    assert out["kv_bytes_per_token"] == 2 * 2 * 4 * 2 * head_dim
    assert plan_json(["--config", str(tmp_path)], capsys)["params"] == hand   # the folder works too


def test_json_keys_and_text(capsys):
    out = plan_json(["--preset", "mistral-7b", "--device", "h200", "--dtype", "int8", "--kv-dtype", "int8",
                     "--context", "8192", "--tp", "2"], capsys)
    for key in ("params", "weight_bytes", "kv_bytes_per_token", "max_sequences", "b_star", "decode_tokens_per_s_bs1",
                "kv_bytes_per_sequence", "per_device_weight_bytes", "per_device_kv_budget_bytes",
                "compute_bound_batch", "device", "assumptions", "warnings"):
        assert key in out, key
    assert (out["device"], out["dtype"], out["kv_dtype"]) == ("h200", "int8", "int8")
    assert (out["context"], out["tp"]) == (8192, 2)
    assert out["b_star"] == pytest.approx(989e12 / 4.8e12)
    assert run_plan(["--preset", "llama-2-7b"]) == 0
    text = capsys.readouterr().out
    assert "6,738,415,616" in text and "29 sequences" in text and "218." in text   # 3.35e12 / (W_1 + KV)


def test_cpu_device():
    dev = get_device("cpu", memory_gib=64)
    assert dev.memory_bytes == 64 * GiB and dev.bandwidth == 50e9
    p = plan(PRESETS["llama-2-7b"], dev, context=1024)
    assert any("assumption" in a for a in p.assumptions)
    assert p.decode_tokens_per_s_bs1 == pytest.approx(50e9 / (LLAMA_2_7B_W1 + 524288 * 1024))


def test_bad_names_list_the_choices(capsys):
    for argv in (["--preset", "llama-9b"], ["--preset", "llama-2-7b", "--device", "tpu-v5"]):
        with pytest.raises(SystemExit) as e:
            run_plan(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "invalid choice" in err
        for name in (PRESETS if "llama-9b" in argv else DEVICE_NAMES):
            assert name in err
    with pytest.raises(ValueError, match="mistral-7b"):
        get_preset("llama-9b")
    with pytest.raises(ValueError, match="a100-80gb"):
        get_device("tpu-v5")
    with pytest.raises(ValueError, match="int4"):
        plan(PRESETS["llama-2-7b"], get_device("h100"), dtype="fp8")
    with pytest.raises(ValueError, match="tp must be"):
        plan(PRESETS["llama-2-7b"], get_device("h100"), tp=0)


def test_plan_never_imports_jax():
    code = "import sys, jaxinfer.plan; assert not any(m == 'jax' or m.startswith('jax.') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert math.isfinite(plan(PRESETS["qwen2-7b"], get_device("h100")).b_star)
