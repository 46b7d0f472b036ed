"""Nemotron-H (transformers' NemotronHForCausalLM, tests/hf_models.py "nemotron-h"): layers of one
part each (a Mamba-2 mixer, attention without positions, or a squared-ReLU MLP), run as jaxinfer's
blocks of a mixer and the MLP after it (a block without an MLP, one without a mixer). The
references are transformers' full forwards, its parameter count and its config class."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.config import ConfigError
from jaxinfer.models.hf_configs import model_config_from_hf
from tests.hf_models import build_hf_model
from tests.state_engine import hf_greedy, served


def test_logits_and_greedy_tokens_are_transformers(tmp_path):
    """The checkpoint as save_pretrained writes it (the uploads' backbone. names): a 20-token prompt's
    logits, prefilled in 16-token chunks (the Mamba-2 states carried across them), and 8 greedy
    tokens of two prompts, decoded beside each other's prefill, are transformers' full forwards'.
    The eight layers are five blocks, the third without an MLP, the fifth without a mixer."""
    hf = build_hf_model("nemotron-h")
    gen, prompts, ref = served(hf, tmp_path, (20, 29), 7)
    cfg = gen.model_cfg
    assert (cfg.n_layers, cfg.layer_kinds, cfg.mlp_layers) == (5, ("mamba", "attention", "mamba", "mamba", "mlp"),
                                                               (True, True, False, True, True))
    assert cfg.n_attn_layers == 1
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    assert np.abs(gen.logits(prompts[0]) - ref).max() <= 1e-4 * np.abs(ref).max()
    outs = gen.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]


def test_legacy_spellings_and_refused_configs(tmp_path):
    """NVIDIA's remote-code config.json spellings (hybrid_override_pattern, mamba_n_groups,
    mamba_d_conv, which transformers' NemotronHConfig renames too, and attention_head_dim, which
    NVIDIA's remote code reads; the tiny model's sizes, each changed from its default) give the same
    model; tie_word_embeddings ties nothing (NemotronHForCausalLM has no tied weights); Nemotron 3
    Super's latent projections around the experts, a mixture whose sizes do not fit, a pattern without
    Mamba-2 or without attention layers, an unknown layer type, biased projections and another
    activation in the mixer are each refused by name."""
    from transformers import NemotronHConfig
    hf = build_hf_model("nemotron-h")
    hf.config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    renamed = {"head_dim": "attention_head_dim", "n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv"}
    base = {renamed.get(k, k): v for k, v in config.items() if k != "layers_block_type"}
    theirs = NemotronHConfig(**{k: v for k, v in base.items() if k != "time_step_limit"},
                             hybrid_override_pattern="M-*-MM--")
    legacy = model_config_from_hf({**base, "hybrid_override_pattern": "M-*-MM--"})
    assert legacy == model_config_from_hf(config)
    assert (legacy.linear_k_heads, legacy.conv_kernel) == (theirs.n_groups, theirs.conv_kernel) == (2, 3)
    assert legacy.head_dim == 16 and legacy.layer_kinds == ("mamba", "attention", "mamba", "mamba", "mlp")
    # an MLP block only where state layers keep the engine on its per-layer path, not in a parallel block
    for change in ({"layer_kinds": ("attention",) * 4 + ("mlp",)}, {"parallel_block": True}):
        with pytest.raises(ConfigError, match="layer_kinds"):
            dataclasses.replace(legacy, **change)
    tied = build_hf_model("nemotron-h", overrides={"tie_word_embeddings": True})
    assert tied.lm_head.weight.data_ptr() != tied.get_input_embeddings().weight.data_ptr()
    assert not model_config_from_hf({**config, "tie_word_embeddings": True}).tie_embeddings
    for change, match in (({"hybrid_override_pattern": "ME*E", "moe_latent_size": 32}, "'moe_latent_size' = 32"),
                          ({"hybrid_override_pattern": "ME*E", "n_group": 3}, "n_routed_experts = 8 is not a multiple of n_group = 3"),
                          ({"hybrid_override_pattern": "ME*E", "num_experts_per_tok": 9}, "num_experts_per_tok = 9 exceeds"),
                          ({"hybrid_override_pattern": "ME*E", "topk_group": 2}, "topk_group = 2 exceeds n_group = 1"),
                          ({"hybrid_override_pattern": "ME*E", "moe_intermediate_size": 0}, "'moe_intermediate_size' must be a positive"),
                          ({"hybrid_override_pattern": "ME*E", "mlp_bias": True}, "'mlp_bias' = true"),
                          ({"hybrid_override_pattern": "M-M-"}, "needs Mamba-2 and attention layers"),
                          ({"hybrid_override_pattern": "*-*-"}, "needs Mamba-2 and attention layers"),
                          ({"hybrid_override_pattern": "MX*"}, "must name each layer"),
                          ({"use_bias": True}, "use_bias=true"),
                          ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act='gelu'"),
                          ({"mamba_n_groups": 3}, "mamba_num_heads a multiple of n_groups")):
        with pytest.raises(ConfigError, match=match):
            model_config_from_hf({"hybrid_override_pattern": "M-*-MM--", **base, **change})


def test_moe_layers_are_transformers_experts(tmp_path):
    """Nemotron 3 Nano's mixtures (tests/hf_models.py "nemotron-h-moe"; the engine's logits and greedy
    tokens against transformers' are test_hf_parity's): the seven layers are four blocks, three with
    ungated squared-ReLU experts; the parameter count is transformers'; one MoE layer on 24 tokens is
    transformers' NemotronHMoE (the group-limited sigmoid routing with its correction, the experts, the
    shared MLP) with either grouped matmul, and, with int8 weights, the same torch layer holding the
    dequantized weights; a checkpoint holding each layer's experts fused, as transformers 5 keeps them
    (experts.up_proj [E, F, d], experts.down_proj [E, d, F]), loads the same weights."""
    import jax
    import torch
    from flax import nnx
    from safetensors.torch import save_file

    from jaxinfer.models.decoder import quantize_decoder
    from jaxinfer.moe import set_moe_impl
    from jaxinfer.quant import dequantize
    from jaxinfer.weights import load_model
    from tests.precision import assert_rel_close, dot_chain_rtol
    hf = build_hf_model("nemotron-h-moe")
    hf.save_pretrained(tmp_path / "uploads")
    model, cfg = load_model(tmp_path / "uploads", "float32")
    assert (cfg.n_layers, cfg.layer_kinds, cfg.moe_layers) == (4, ("mamba", "attention", "mlp", "mamba"),
                                                              (True, False, True, True))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.gated_mlp) == (8, 2, False)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    # NemotronHConfig's alias of n_routed_experts
    from transformers import NemotronHConfig
    saved = {k: v for k, v in json.loads((tmp_path / "uploads" / "config.json").read_text()).items()
             if k not in ("n_routed_experts", "time_step_limit")}
    assert model_config_from_hf({**saved, "num_local_experts": 4}).num_experts == NemotronHConfig(
        **saved, num_local_experts=4).n_routed_experts == 4
    moe, theirs = model.layers[0].mlp, hf.model.layers[1].mixer
    assert moe.gate is None and moe.up.get_value().shape == (8, 64, 32)
    x = np.random.RandomState(0).randn(24, 64).astype(np.float32)
    with torch.no_grad():
        ref = theirs(torch.tensor(x)[None])[0].numpy()
    # d_model into the router, the experts and the shared MLP (squared: twice its relative error), then
    # their hidden sizes out, and the combine of two weighted rows and the shared MLP's output
    rtol = dot_chain_rtol(2 * 64, 48, 3)
    run = nnx.jit(lambda m, x: m(x))
    for impl in ("tiles", "ragged_dot"):
        set_moe_impl(model, impl)
        assert_rel_close(run(moe, x), ref, rtol, impl)

    fused = {k.replace("model.", "backbone.", 1): v.contiguous() for k, v in hf.state_dict().items()}
    assert fused["backbone.layers.1.mixer.experts.up_proj"].shape == (8, 32, 64)
    (tmp_path / "fused").mkdir()
    save_file(fused, tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "uploads" / "config.json").read_text())
    again, _ = load_model(tmp_path / "fused", "float32")
    for (path, a), (_, b) in zip(nnx.state(model, nnx.Param).flat_state(), nnx.state(again, nnx.Param).flat_state()):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))

    quantize_decoder(model, "int8")
    set_moe_impl(model, "tiles")
    as_torch = lambda w: torch.tensor(np.asarray(jax.device_get(dequantize(w.get_value())), np.float32))  # noqa: E731
    with torch.no_grad():
        theirs.experts.up_proj.copy_(as_torch(moe.up).transpose(1, 2))
        theirs.experts.down_proj.copy_(as_torch(moe.down).transpose(1, 2))
        theirs.shared_experts.up_proj.weight.copy_(as_torch(moe.shared.up).T)
        theirs.shared_experts.down_proj.weight.copy_(as_torch(moe.shared.down).T)
        ref_int8 = theirs(torch.tensor(x)[None])[0].numpy()
    assert_rel_close(run(moe, x), ref_int8, rtol, "int8")


def test_int8_weights_are_transformers_with_their_weights_rounded(tmp_path):
    """Nemotron 3 Nano's mixtures with int8 weights at load (quantize="int8": per output channel,
    scale max|w| / 127) compute what transformers' model computes with each of those weights rounded
    so in numpy: q / k / v / o, the Mamba-2 in_proj (but its dt rows, which stay float) and out_proj,
    the dense MLP, every ungated expert's up and down and the shared MLP; the routers, norms,
    embeddings and head stay float."""
    import copy

    import torch

    from jaxinfer import Generator
    hf = build_hf_model("nemotron-h-moe")
    hf.save_pretrained(tmp_path)
    ref = copy.deepcopy(hf)

    def rounded(w: np.ndarray) -> np.ndarray:   # torch's [.., out, in]: one scale per output row
        amax = np.abs(w).max(axis=-1, keepdims=True)
        scale = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
        return (np.round(w / scale) * scale).astype(np.float32)
    dt_rows = hf.config.mamba_num_heads
    with torch.no_grad():
        for name, p in ref.named_parameters():
            w = p.detach().numpy()
            if name.endswith(("_proj.weight", "experts.up_proj", "experts.down_proj")) and "in_proj" not in name:
                p.copy_(torch.tensor(rounded(w)))
            elif name.endswith("mixer.in_proj.weight"):
                p.copy_(torch.tensor(np.concatenate([rounded(w[:-dt_rows]), w[-dt_rows:]])))
    prompt = np.random.RandomState(0).randint(3, 100, 24).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0].numpy()
    gen = Generator.from_pretrained(tmp_path, dtype="float32", quantize="int8", max_model_len=64, max_num_seqs=2,
                                    block_size=8, num_blocks=17, max_num_batched_tokens=16, warmup=False)
    assert np.abs(gen.logits(prompt) - want).max() <= 1e-4 * np.abs(want).max()
