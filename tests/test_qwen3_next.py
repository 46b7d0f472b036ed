"""Qwen3-Next's and Qwen3.5's Gated DeltaNet layers through the paged engine: each sequence's state (its
convolution's last inputs and one recurrent matrix per value head) carried across chunked prefill,
mixed steps and multi-step decoding in a state slot of its own; Qwen3.5's vision-language upload
served as its language model; what the engine refuses for such a model. The references are
transformers' Qwen3NextForCausalLM, Qwen3_5ForCausalLM and Qwen3_5ForConditionalGeneration
(tests/hf_models.py "qwen3-next", "qwen3.5")."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import Generator, SamplingParams
from jaxinfer.config import ConfigError
from tests.hf_models import CONFIGS, build_hf_model
from tests.state_engine import ENGINE, TOKENS, check_state_engine, hf_greedy

@pytest.fixture(scope="module")
def qwen3_next(hf_model_dir):
    rng = np.random.RandomState(7)
    prompts = [rng.randint(3, 109, n).tolist() for n in (5, 45, 17, 30, 9)]
    hf = build_hf_model("qwen3-next")
    return hf_model_dir("qwen3-next"), hf, prompts, [hf_greedy(hf, p) for p in prompts]


def test_state_across_chunks_rows_slot_reuse_preemption_and_prompt_logprobs(qwen3_next):
    """tests/state_engine.py's check: greedy continuations through two slots, preemption and n = 2,
    then prompt logprobs across chunk boundaries, against transformers (which computes the prompt by
    its chunked form of the rule, we token by token on a CPU: the same sums in another order)."""
    check_state_engine(*qwen3_next)


def test_closed_form_prefill_inside_the_engine(qwen3_next):
    """The prefill chunks' closed form, which only a GPU takes by itself (GatedDeltaNet.closed_form),
    set on every Gated DeltaNet layer and run through the paged engine: the same check, against
    transformers, as the test above (16-token chunks of one row, beside decode rows; preemption)."""
    from flax import nnx

    from jaxinfer.models.deltanet import GatedDeltaNet
    from jaxinfer.weights import load_model
    model, _ = load_model(qwen3_next[0], "float32")
    layers = [node for _, node in nnx.iter_graph(model) if isinstance(node, GatedDeltaNet)]
    assert len(layers) == 2
    for node in layers:
        node.closed_form = True
    check_state_engine(*qwen3_next, model=model)


def test_qwen3_5_vision_language_upload_serves_its_language_model(tmp_path):
    """A Qwen3_5ForConditionalGeneration (the "qwen3.5" text config, a one-layer vision tower) as
    transformers saves it, its language model under model.language_model.*: text logits and greedy
    tokens (through the paged engine: chunks and decode steps carry the states) are transformers'."""
    import transformers as tf
    torch.manual_seed(0)
    text = dict(CONFIGS["qwen3.5"][1], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)
    cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=99, video_token_id=100,
                           vision_start_token_id=101, vision_end_token_id=102, tie_word_embeddings=True)
    hf = tf.Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith(".A_log"):   # a decay of ~0.85 a token (tests/hf_models.py)
                p.normal_(-2.0, 0.5)
            elif "language_model" in n and ("norm" in n or n.endswith("_bias")):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    prompt = [5, 7, 9, 11, 13, 50, 60, 70, 3, 4, 90, 17, 22, 8, 31, 40, 41, 6, 77, 12]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0].numpy()
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    gen = Generator.from_pretrained(tmp_path, max_num_seqs=2, num_blocks=17, **{**ENGINE, "max_num_batched_tokens": 8,
                                                                              "token_buckets": [8]})
    assert gen.model_cfg.architecture == "Qwen3_5ForCausalLM" and gen.model_cfg.tie_embeddings
    assert np.abs(gen.logits(prompt) - ref).max() <= 1e-4 * np.abs(ref).max()
    out = gen.generate([prompt], SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == want


def test_what_a_delta_state_cannot_carry_is_refused(qwen3_next):
    """Speculative decoding, tensor and pipeline parallelism (before any loading) and the host KV tier
    are refused by name; LoRA is not offered for the family; jaxinfer quantize points to load-time
    quantization."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.config.resolve import resolve_config
    from jaxinfer.lora.adapter import LORA_FAMILIES
    from jaxinfer.models.hf_configs import model_config_from_hf
    from jaxinfer.quantize import QuantizeSettings, quantize_model
    from jaxinfer.weights import load_model
    folder = qwen3_next[0]
    cfg = model_config_from_hf(folder)
    for name, kw in (("speculative_method", dict(speculative_method="ngram", num_speculative_tokens=2)),
                     ("tensor_parallel", dict(tensor_parallel=2)), ("pipeline_parallel", dict(pipeline_parallel=2))):
        with pytest.raises(ConfigError, match=rf"{name} is not available for Qwen3NextForCausalLM, whose Gated "
                                              "DeltaNet layers keep a state per sequence"):
            Generator.from_pretrained(folder, **kw)
    with pytest.raises(ConfigError, match="kv_offload_gb is not available"):
        resolve_config(EngineConfig(num_blocks=16, kv_offload_bytes=1 << 20), cfg, backend="cpu")
    assert not {"Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"} & set(LORA_FAMILIES)
    model, _ = load_model(folder, "float32")
    with pytest.raises(ValueError, match="state layers .* --quantize int8"):
        quantize_model(model, QuantizeSettings(method="rtn", bits=4))


def test_state_bytes_and_refused_configs():
    """One sequence's state bytes by hand for Qwen3.5-9B's published shape (24 Gated DeltaNet layers
    of 16 key heads of 128, 32 value heads of 128, 4 taps; bfloat16 inputs, float32 matrices), counted
    by `jaxinfer plan` beside the sequence's KV; and a
    config.json whose value heads are not a multiple of its key heads, or whose attention has biases,
    refused by name."""
    from jaxinfer.models.hf_configs import model_config_from_hf
    from jaxinfer.plan import get_device, plan
    base = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
            "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4}
    cfg = model_config_from_hf(base)
    assert cfg.n_attn_layers == 8 and cfg.rotary_dim == 64 and cfg.linear_conv_dim == 2 * 16 * 128 + 32 * 128
    state = 24 * (3 * 8192 * 2 + 4 * 32 * 128 * 128)
    assert cfg.state_bytes_per_slot(2) == state
    p = plan(cfg, get_device("h100"), context=4096)   # jaxinfer plan: each sequence's state beside its KV
    kv_seq = 2 * 2 * 8 * 4 * 256 * 4096   # K and V, bfloat16, 8 attention layers, 4 KV heads of 256
    assert p.per_device_kv_bytes_per_sequence == kv_seq and p.per_device_state_bytes_per_sequence == state
    assert p.max_sequences == p.per_device_kv_budget_bytes // (kv_seq + state)
    with pytest.raises(ConfigError, match="linear_num_value_heads a multiple of linear_num_key_heads"):
        model_config_from_hf({**base, "linear_num_value_heads": 24})
    with pytest.raises(ConfigError, match="attention_bias=true is not supported"):
        model_config_from_hf({**base, "attention_bias": True})


# packed steps (each token's row, position; False: padding): prefill rows from position 0 and
# continuing, decode rows, a one-token prompt, padding; and six two-token rows (more segments than a
# chunk computes in closed form: token by token); four (exactly as many as it does, padding after them)
_STEPS = {"mixed": ([0, 0, 0, 0, 1, 2, 2, 2, 3, 4, 0, 0], [0, 1, 2, 3, 9, 7, 8, 9, 4, 0, 0, 0],
                    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]),
          "four": ([0, 0, 1, 1, 2, 2, 3, 3, 0, 0], [0, 1, 5, 6, 3, 4, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]),
          "many": ([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 6, 6, 1, 1], [5, 6, 0, 1, 3, 4, 2, 3, 8, 9, 0, 1, 0, 0],
                   [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0])}


@pytest.mark.parametrize("delta", [True, False], ids=["delta", "mamba2"])
@pytest.mark.parametrize("step", sorted(_STEPS))
def test_gated_delta_rule_matches_its_token_by_token_reference(step, delta):
    """gated_delta_rule (decode rows at once, the other rows' tokens by chunks of 64, 4 and 2: closed
    form, or token by token where a chunk holds more than CHUNK_SEGMENTS rows, or as a CPU runs
    them: every chunk token by token) against
    gated_delta_rule_reference (every token of the step in order) on packed steps (_STEPS): rows
    from position 0 whose slots hold stale numbers (ignored), decode rows, prefill chunks continuing
    from their states, padding tokens and rows with no token. The same sums in other orders (the
    closed form's over at most a chunk's tokens and dk = 8 features, its triangular solve's entries
    at most 1 in magnitude): outputs and states agree to 64 float32 roundings of their magnitude.
    Without delta (Mamba-2's rule, models/mamba2.py: beta its step, positive and unbounded) the
    same, with no solve."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.models.deltanet import gated_delta_rule, gated_delta_rule_reference
    hv, dk, dv = 3, 8, 5
    row, positions, valid = (np.array(a, dtype) for a, dtype in zip(_STEPS[step], (np.int32, np.int32, bool)))
    t, s = len(row), 8
    keys = jax.random.split(jax.random.PRNGKey(3), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(keys[0], (t, hv, dk))) * dk ** -0.5
    k = unit(jax.random.normal(keys[1], (t, hv, dk)))
    v = jax.random.normal(keys[2], (t, hv, dv))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (t, hv)))
    beta = (jax.nn.sigmoid if delta else jax.nn.softplus)(jax.random.normal(keys[4], (t, hv)))
    h0 = jax.random.normal(keys[5], (s, hv, dk, dv))
    args = (q, k, v, g, beta, jnp.asarray(row), jnp.asarray(positions), jnp.asarray(valid), h0)
    o_ref, h_ref = jax.jit(gated_delta_rule_reference, static_argnames="delta")(*args, delta=delta)
    eps = 64 * np.finfo(np.float32).eps
    for chunk, closed_form in ((64, True), (4, True), (2, True), (4, False)):
        o, h = jax.jit(gated_delta_rule, static_argnames=("chunk", "closed_form", "delta"))(
            *args, chunk=chunk, closed_form=closed_form, delta=delta)
        assert np.abs(np.asarray(o - o_ref))[valid].max() <= eps * np.abs(np.asarray(o_ref)).max(), chunk
        assert np.abs(np.asarray(h - h_ref)).max() <= eps * np.abs(np.asarray(h_ref)).max(), chunk
        assert np.array_equal(np.asarray(h[5]), np.asarray(h0[5]))   # a row without a token keeps its state
