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
    model; tie_word_embeddings ties nothing (NemotronHForCausalLM has no tied weights); Nemotron 3's
    mixture-of-experts layers, a pattern without Mamba-2 or without attention layers, an unknown layer type, biased projections and another activation in the
    mixer are each refused by name."""
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
    for change, match in (({"hybrid_override_pattern": "MEM*E"}, "mixture-of-experts layers"),
                          ({"hybrid_override_pattern": "M-M-"}, "needs Mamba-2 and attention layers"),
                          ({"hybrid_override_pattern": "*-*-"}, "needs Mamba-2 and attention layers"),
                          ({"hybrid_override_pattern": "MX*"}, "must name each layer"),
                          ({"use_bias": True}, "use_bias=true"),
                          ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act='gelu'"),
                          ({"mamba_n_groups": 3}, "mamba_num_heads a multiple of n_groups")):
        with pytest.raises(ConfigError, match=match):
            model_config_from_hf({"hybrid_override_pattern": "M-*-MM--", **base, **change})
