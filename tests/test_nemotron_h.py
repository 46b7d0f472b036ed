"""Nemotron-H (transformers' NemotronHForCausalLM, tests/hf_models.py "nemotron-h"): layers of one
part each (a Mamba-2 mixer, attention without positions, or a squared-ReLU MLP), run as jaxinfer's
blocks of a mixer and the MLP after it, one block without an MLP. The references are transformers'
full forwards and its parameter count."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxinfer import Generator, SamplingParams
from jaxinfer.config import ConfigError
from jaxinfer.models.hf_configs import model_config_from_hf
from tests.hf_models import build_hf_model
from tests.state_engine import hf_greedy


def test_logits_and_greedy_tokens_are_transformers(tmp_path):
    """The checkpoint as save_pretrained writes it (the uploads' backbone. names): a 20-token prompt's
    logits, prefilled in 16-token chunks (the Mamba-2 states carried across them), and 8 greedy
    tokens of two prompts, decoded beside each other's prefill, are transformers' full forwards'.
    The seven layers are four blocks, the third without an MLP."""
    import torch
    hf = build_hf_model("nemotron-h")
    hf.save_pretrained(tmp_path)
    prompts = [np.random.RandomState(7).randint(3, 100, n).tolist() for n in (20, 29)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]])).logits[0].numpy()
    gen = Generator.from_pretrained(tmp_path, dtype="float32", max_model_len=64, max_num_seqs=2, block_size=8,
                                    num_blocks=17, max_num_batched_tokens=16, warmup=False)
    cfg = gen.model_cfg
    assert (cfg.n_layers, cfg.layer_kinds, cfg.mlp_layers) == (4, ("mamba", "attention", "mamba", "mamba"),
                                                               (True, True, False, True))
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    assert np.abs(gen.logits(prompts[0]) - ref).max() <= 1e-4 * np.abs(ref).max()
    outs = gen.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]


def test_legacy_spellings_and_refused_layer_patterns(tmp_path):
    """NVIDIA's remote-code config.json spellings (hybrid_override_pattern, attention_head_dim,
    mamba_n_groups, mamba_d_conv) read as transformers' NemotronHConfig reads them (the tiny model's
    sizes: each changed from its default); Nemotron 3's mixture-of-experts layers, an MLP layer with
    no mixer before it and an unknown layer type are each refused by name."""
    hf = build_hf_model("nemotron-h")
    hf.config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    renamed = {"head_dim": "attention_head_dim", "n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv"}
    base = {renamed.get(k, k): v for k, v in config.items() if k != "layers_block_type"}
    legacy = model_config_from_hf({**base, "hybrid_override_pattern": "M-*-MM-"})
    assert legacy == model_config_from_hf(config)
    assert (legacy.head_dim, legacy.linear_k_heads, legacy.conv_kernel) == (hf.config.head_dim, hf.config.n_groups,
                                                                            hf.config.conv_kernel) == (16, 2, 3)
    for pattern, match in (("MEM*E", "mixture-of-experts layers"), ("-M*", "layer 0 is an MLP layer"),
                           ("M--*", "layer 2 is an MLP layer"), ("MX*", "must name each layer")):
        with pytest.raises(ConfigError, match=match):
            model_config_from_hf({**base, "hybrid_override_pattern": pattern})
