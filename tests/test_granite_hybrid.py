"""Granite 4.0-H's Mamba-2 layers through the paged engine: each sequence's state (its convolution's
last inputs and one [state, head] matrix per head) carried across chunked prefill, mixed steps and
multi-step decoding in a state slot of its own; the selective state space's rule against its
token-by-token reference; what the engine refuses for such a model. The references are
transformers' GraniteMoeHybridForCausalLM (tests/hf_models.py "granitemoehybrid", the MoE shape
without positions, and "granitemoehybrid-dense", dense with RoPE) and BambaForCausalLM ("bamba")."""
from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import Generator
from jaxinfer.config import ConfigError
from tests.hf_models import build_hf_model
from tests.state_engine import check_state_engine, hf_greedy, served


def _case(folder, hf):
    """tests/state_engine.py's arguments: five prompts and transformers' greedy continuations."""
    rng = np.random.RandomState(11)
    prompts = [rng.randint(3, 100, n).tolist() for n in (5, 45, 17, 30, 9)]
    return folder, hf, prompts, [hf_greedy(hf, p) for p in prompts]


@pytest.fixture(scope="module")
def granite(hf_model_dir):
    return _case(hf_model_dir("granitemoehybrid"), build_hf_model("granitemoehybrid"))


def test_state_across_chunks_rows_slot_reuse_preemption_and_prompt_logprobs(granite):
    """tests/state_engine.py's check on the MoE shape: greedy continuations through two slots,
    preemption and n = 2, then prompt logprobs across chunk boundaries, against transformers (which
    computes a prompt by its chunked scan, 16 tokens a chunk, we token by token on a CPU: the same
    sums in another order)."""
    check_state_engine(*granite)


def test_closed_form_prefill_and_clamped_step_inside_the_engine(tmp_path):
    """The dense shape (RoPE, one group) with each step clamped to [0.3, 1.5] (time_step_limit; the
    softplus spans both bounds) and the prefill chunks' closed form, which only a GPU takes by
    itself (Mamba2.closed_form), set on every Mamba-2 layer: the same check against transformers'
    full forwards (its cached decoding, selective_state_update as mamba_ssm's step, leaves the
    step unclamped, unlike its scan: the model's training form, which every token here follows)."""
    from flax import nnx

    from jaxinfer.models.mamba2 import Mamba2
    from jaxinfer.weights import load_model
    hf = build_hf_model("granitemoehybrid-dense", overrides={"time_step_limit": (0.3, 1.5)})
    hf.save_pretrained(tmp_path)
    case = _case(tmp_path, hf)
    model, _ = load_model(case[0], "float32")
    assert model.cfg.ssm_dt_limit == (0.3, 1.5) and model.cfg.rope_layers is None
    layers = [node for _, node in nnx.iter_graph(model) if isinstance(node, Mamba2)]
    assert len(layers) == 2
    for node in layers:
        node.closed_form = True
    check_state_engine(*case, model=model)


def test_what_a_mamba_state_cannot_carry_is_refused(granite):
    """Speculative decoding, tensor and pipeline parallelism (before any loading) are refused by name;
    LoRA is not offered for the family, nor its device stacks built (they read each block's q / k / v);
    jaxinfer quantize points to load-time quantization."""
    from jaxinfer.lora.adapter import LORA_FAMILIES
    from jaxinfer.lora.execute import lora_supported
    from jaxinfer.models.decoder import fuse_decoder
    from jaxinfer.quantize import QuantizeSettings, quantize_model
    from jaxinfer.weights import load_model
    folder = granite[0]
    for name, kw in (("speculative_method", dict(speculative_method="ngram", num_speculative_tokens=2)),
                     ("tensor_parallel", dict(tensor_parallel=2)), ("pipeline_parallel", dict(pipeline_parallel=2))):
        with pytest.raises(ConfigError, match=rf"{name} is not available for GraniteMoeHybridForCausalLM, whose "
                                              "Mamba-2 layers keep a state per sequence"):
            Generator.from_pretrained(folder, **kw)
    assert "GraniteMoeHybridForCausalLM" not in LORA_FAMILIES
    model, _ = load_model(folder, "float32")
    assert "not available for GraniteMoeHybridForCausalLM" in lora_supported(fuse_decoder(model))
    with pytest.raises(ValueError, match="state layers .* --quantize int8"):
        quantize_model(model, QuantizeSettings(method="rtn", bits=4))


def test_state_bytes_and_refused_configs():
    """One sequence's state bytes by hand for Granite 4.0-H-Tiny's published shape (40 layers, 4 of
    them attention; 48 Mamba-2 heads of 64, one group of state size 128, 4 taps: 3 inputs of
    48 * 64 + 2 * 128 channels in bfloat16 and 48 float32 [128, 64] matrices a layer), counted by
    `jaxinfer plan` beside the sequence's KV; config.json fields that do not fit, refused by name."""
    from jaxinfer.models.hf_configs import model_config_from_hf
    from jaxinfer.plan import get_device, plan
    types = ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)]
    base = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
            "vocab_size": 100352, "hidden_size": 1536, "intermediate_size": 512, "num_hidden_layers": 40,
            "num_attention_heads": 12, "num_key_value_heads": 4, "num_local_experts": 64, "num_experts_per_tok": 6,
            "shared_intermediate_size": 1024, "layer_types": types, "mamba_n_heads": 48, "mamba_d_head": 64,
            "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_expand": 2, "mamba_d_conv": 4,
            "position_embedding_type": "nope", "embedding_multiplier": 12, "residual_multiplier": 0.22,
            "attention_multiplier": 0.0078125, "logits_scaling": 6, "tie_word_embeddings": True}
    cfg = model_config_from_hf(base)
    assert cfg.n_attn_layers == 4 and cfg.rope_layers == (False,) * 40 and cfg.linear_conv_dim == 3072 + 256
    state = 36 * (3 * 3328 * 2 + 4 * 48 * 128 * 64)
    assert cfg.state_bytes_per_slot(2) == state
    p = plan(cfg, get_device("h100"), context=4096)
    kv_seq = 2 * 2 * 4 * 4 * 128 * 4096   # K and V, bfloat16, 4 attention layers, 4 KV heads of 128
    assert p.per_device_kv_bytes_per_sequence == kv_seq and p.per_device_state_bytes_per_sequence == state
    for bad, match in (({"mamba_d_head": 32}, "mamba_n_heads \\* mamba_d_head = mamba_expand \\* hidden_size"),
                       ({"mamba_n_groups": 5}, "mamba_n_heads a multiple of mamba_n_groups"),
                       ({"mamba_proj_bias": True}, "mamba_proj_bias=true is not supported"),
                       ({"layer_types": types[:-1]}, "layer_types must name 'mamba' / 'attention' for each of the 40"),
                       ({"time_step_limit": [1.0, 0.5]}, "time_step_limit"),
                       ({"layer_types": ["mamba"] * 40}, "needs at least one attention layer"),
                       ({"num_experts_per_tok": 0}, "'num_experts_per_tok' must be a positive integer with 64"),
                       ({"num_local_experts": -1}, "'num_local_experts' must be a positive integer")):
        with pytest.raises(ConfigError, match=match):
            model_config_from_hf({**base, **bad})
    # -Micro's dense form as uploaded: 0 experts, 0 of them a token, the shared MLP alone
    dense = model_config_from_hf({**base, "num_local_experts": 0, "num_experts_per_tok": 0,
                                  "shared_intermediate_size": 8192})
    assert (dense.num_experts, dense.ffn_dim, dense.state_bytes_per_slot(2)) == (0, 8192, state)
    # 0 meaning none is this architecture's: a Granite MoE upload with 0 experts is still refused
    with pytest.raises(ConfigError, match="'num_local_experts' must be a positive integer, got 0"):
        model_config_from_hf({**base, "architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe",
                              "num_local_experts": 0})


def test_all_attention_upload_is_granite(tmp_path):
    """The class's uploads without Mamba-2 layers (Granite 4.0-Micro, -1B, -350M: every layer_types
    entry "attention"): logits and greedy tokens through the paged engine are transformers', and no
    state is kept (prefix caching stays on)."""
    import torch

    from jaxinfer import SamplingParams
    hf = build_hf_model("granitemoehybrid", overrides={"layer_types": ["attention"] * 4})
    hf.save_pretrained(tmp_path)
    prompt = np.random.RandomState(5).randint(3, 100, 20).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    gen = Generator.from_pretrained(tmp_path, dtype="float32", max_model_len=64, max_num_seqs=2, block_size=8,
                                    num_blocks=17, max_num_batched_tokens=16, warmup=False)
    assert not gen.model_cfg.has_state and gen.engine.resolved.enable_prefix_caching
    assert np.abs(gen.logits(prompt) - ref).max() <= 1e-4 * np.abs(ref).max()
    assert gen.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                 ignore_eos=True))[0].token_ids == want


def test_bamba(tmp_path):
    """Bamba (transformers' BambaForCausalLM, tests/hf_models.py "bamba"): Granite 4.0-H's Mamba-2
    layers around attention that rotates half of each head, without multipliers. A 20-token prompt's
    logits (prefilled in 16-token chunks: the state carried across them) and greedy tokens (decode
    steps beside a second prompt's prefill) are transformers' full forwards'. The rotated features as
    transformers' BambaConfig and RoPE read them (a top-level partial_rotary_factor is set to 0.5, one
    in rope_parameters wins: the counts its inv_freq holds), Granite's multipliers in a Bamba config
    read by nothing, a config without attn_layer_indices (all Mamba-2) refused by name."""
    import json

    from transformers import BambaConfig
    from transformers.models.bamba.modeling_bamba import BambaRotaryEmbedding

    from jaxinfer import SamplingParams
    from jaxinfer.models.hf_configs import model_config_from_hf
    hf = build_hf_model("bamba")
    gen, prompts, ref = served(hf, tmp_path, (20, 33), 5)
    assert gen.model_cfg.rotary_dim == 8 and gen.model_cfg.attn_scale is None
    assert np.abs(gen.logits(prompts[0]) - ref).max() <= 1e-4 * np.abs(ref).max()
    outs = gen.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]
    config = json.loads((tmp_path / "config.json").read_text())
    rope = {k: v for k, v in config["rope_parameters"].items() if k != "partial_rotary_factor"}
    for change in ({"partial_rotary_factor": 1.0, "rope_parameters": rope},
                   {"rope_parameters": {**rope, "partial_rotary_factor": 1.0}}, {"rope_parameters": rope}):
        theirs = BambaConfig(**{k: v for k, v in {**config, **change}.items() if k != "time_step_limit"})
        rotated = 2 * BambaRotaryEmbedding(theirs).inv_freq.numel()   # the features transformers rotates
        assert (model_config_from_hf({**config, **change}).rotary_dim or 16) == rotated, change
    granite = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0}
    ours = model_config_from_hf({**config, **granite})
    assert (ours.embed_scale, ours.residual_scale, ours.logits_scaling) == (1.0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="without attn_layer_indices is all Mamba-2"):
        model_config_from_hf({**config, "attn_layer_indices": None})
    with pytest.raises(ConfigError, match="'attn_layer_indices' must list layers 0 .. 3"):
        model_config_from_hf({**config, "attn_layer_indices": [1, 4]})
