"""Vision-language checkpoints served as their language model (Gemma 3 4B-27B, Mistral Small 3.x):
config.json's text_config, the weights under language_model, against transformers' own
ForConditionalGeneration on text (no image)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from jaxinfer import Generator, SamplingParams
from jaxinfer.config import ConfigError
from jaxinfer.models.hf_configs import model_config_from_hf
from tests.hf_models import CONFIGS

PROMPT = [5, 7, 9, 11, 13, 50, 60, 70, 3, 4, 90, 17, 22, 8]
# an 8-token budget: one token bucket (one step compilation); an explicit pool, as test_hf_parity's
ENGINE = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=8, max_num_seqs=2, num_blocks=9, warmup=False)


def _wrapper(family: str):
    """A tiny random Gemma3ForConditionalGeneration (the gemma3 text config of tests/hf_models.py,
    its image tokens beyond the prompt's ids) or Mistral3ForConditionalGeneration (mistral-window's,
    untied as Mistral Small's), each with a one-layer vision tower."""
    import transformers as tf
    torch.manual_seed(0)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    if family == "gemma3":
        # Gemma3ForConditionalGeneration does not soft-cap its logits (the published models set no cap)
        text = tf.Gemma3TextConfig(**{**CONFIGS["gemma3"][1], "final_logit_softcapping": None})
        cfg = tf.Gemma3Config(text_config=text.to_dict(), vision_config=tf.SiglipVisionConfig(**vision).to_dict(),
                              mm_tokens_per_image=4, boi_token_index=128, eoi_token_index=129, image_token_index=130)
        return tf.Gemma3ForConditionalGeneration(cfg).eval()
    text = tf.MistralConfig(**CONFIGS["mistral-window"][1], tie_word_embeddings=False)
    cfg = tf.Mistral3Config(text_config=text.to_dict(), vision_config=tf.PixtralVisionConfig(**vision, head_dim=8).to_dict(),
                            image_token_index=110, spatial_merge_size=1, tie_word_embeddings=False)
    return tf.Mistral3ForConditionalGeneration(cfg).eval()


def _renamed(folder: Path, out: Path) -> Path:
    """The folder with its tensors under transformers 4.52-4.5x's layout (model.language_model.*,
    model.vision_tower.*, the head at lm_head), as checkpoints saved by those versions have them."""
    from safetensors.numpy import load_file, save_file
    out.mkdir()
    new = {}
    for k, v in load_file(folder / "model.safetensors").items():
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model."):]
        elif k.startswith("language_model.lm_head."):
            k = k[len("language_model."):]
        else:
            k = "model." + k
        new[k] = v
    save_file(new, out / "model.safetensors", metadata={"format": "pt"})
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.mark.parametrize("family", ["gemma3", "mistral3"])
def test_language_model_of_a_vision_language_checkpoint_matches_transformers(family, tmp_path):
    hf = _wrapper(family)
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()   # one file: _renamed rewrites it
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
    for folder in (tmp_path / "hf", _renamed(tmp_path / "hf", tmp_path / "renamed")):
        gen = Generator.from_pretrained(folder, **ENGINE)
        assert gen.model_cfg.architecture == {"gemma3": "Gemma3ForCausalLM", "mistral3": "MistralForCausalLM"}[family]
        logits = gen.logits(PROMPT)
        assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-4, folder.name
    if family == "gemma3":   # the paged path too: greedy tokens as transformers' generate
        with torch.no_grad():
            want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(PROMPT):].tolist()
        out = gen.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
        assert out.token_ids == want


def test_published_gemma3_text_config_reads_as_transformers_does():
    """gemma-3-4b-it's config.json names only the text sizes that differ from Gemma3TextConfig's
    defaults, and its end-of-turn id at the top level: transformers' Gemma3Config of it and ours agree."""
    import transformers as tf
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
           "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
           "mm_tokens_per_image": 256,
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    t = tf.Gemma3Config(**{k: v for k, v in raw.items() if k != "architectures"}).text_config
    ours = model_config_from_hf(raw)
    assert (ours.vocab_size, ours.d_model, ours.n_layers, ours.n_heads, ours.n_kv_heads, ours.head_dim, ours.ffn_dim) == \
        (t.vocab_size, t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
         t.intermediate_size)
    assert ours.sliding_window == t.sliding_window and ours.norm_eps == t.rms_norm_eps
    assert ours.max_position_embeddings == t.max_position_embeddings
    assert ours.attn_scale == t.query_pre_attn_scalar ** -0.5
    params = t.rope_parameters
    assert ours.rope_theta == params["full_attention"]["rope_theta"]
    assert ours.rope_local_theta == params["sliding_attention"]["rope_theta"]
    assert ours.rope_scaling.kind == "linear" and ours.rope_scaling.factor == params["full_attention"]["factor"]
    assert ours.sliding_layers == tuple(k == "sliding_attention" for k in t.layer_types)
    assert ours.tie_embeddings == t.tie_word_embeddings and ours.bos_token_id == t.bos_token_id
    assert list(ours.eos_token_ids) == [1, 106]   # the wrapper's, over Gemma3TextConfig's 1


@pytest.mark.parametrize("change,message", [
    ({"text_config": None}, "'text_config'"),
    ({"text_config": {"model_type": "qwen2", "hidden_size": 64}}, "model_type 'qwen2'"),
])
def test_refused_vision_language_configs_name_the_field(change, message):
    raw = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", **change}
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(raw)


def test_an_image_part_is_refused_by_name():
    """Served text-only: a message with an image part is a 400 naming the part's type, never its
    text alone."""
    from serve.protocol import ChatCompletionRequest, OpenAIError
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}])
    with pytest.raises(OpenAIError) as e:
        req.messages[0].text()
    assert e.value.status == 400 and e.value.param == "messages" and "'image_url'" in e.value.message


def test_an_adapter_of_a_vision_language_checkpoint_matches_peft(tmp_path):
    """PEFT's all-linear LoRA over Gemma3ForConditionalGeneration adapts its language model and its
    vision tower: the text-only server takes the language model's matrices (under
    model.language_model, as PEFT names them) and leaves the tower's out, and its logits on text are
    PEFT's."""
    from safetensors import safe_open

    from tests.hf_models import seeded_peft
    from tests.precision import assert_rel_close, attention_rtol, dot_chain_rtol
    hf = _wrapper("gemma3")
    hf.save_pretrained(tmp_path / "hf")
    model = seeded_peft(hf, dict(r=4, lora_alpha=8, target_modules="all-linear"), 11, 0.2)
    model.save_pretrained(tmp_path / "a")
    with safe_open(tmp_path / "a" / "adapter_model.safetensors", "np") as f:
        keys = list(f.keys())
    assert any("vision_tower" in k for k in keys) and any("language_model.layers" in k for k in keys)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
    gen = Generator.from_pretrained(tmp_path / "hf", lora_modules={"a": str(tmp_path / "a")}, max_loras=1,
                                    max_lora_rank=4, **ENGINE)
    c = CONFIGS["gemma3"][1]
    d, f, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    rtol = dot_chain_rtol(*([d, d, 4 * hd, f, 4, 4] * c["num_hidden_layers"]), d) + \
        attention_rtol("float32", len(PROMPT), hd)
    assert_rel_close(gen.logits(PROMPT, lora="a"), ref, rtol, "gemma3 wrapper")
