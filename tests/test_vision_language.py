"""Vision-language checkpoints served as their language model (Gemma 3 4B-27B, Mistral Small 3.x,
LLaVA 1.5 / NeXT / OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE):
config.json's text_config, the weights under language_model, against transformers' own
ForConditionalGeneration on text (no image)."""
from __future__ import annotations

import json
import shutil
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
    its image tokens beyond the prompt's ids), Mistral3ForConditionalGeneration (mistral-window's,
    untied as Mistral Small's), LLaVA's three classes (a llama, mistral or qwen2 text model of
    tests/hf_models.py), Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration or
    Qwen3VLForConditionalGeneration (their M-RoPE sections over 8 frequencies; Qwen3-VL's
    interleaved), each with a one-layer vision tower."""
    import transformers as tf
    torch.manual_seed(0)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    if family == "gemma3":
        # its text config soft-caps the logits, which Gemma3ForConditionalGeneration's head never does
        text = tf.Gemma3TextConfig(**CONFIGS["gemma3"][1])
        cfg = tf.Gemma3Config(text_config=text.to_dict(), vision_config=tf.SiglipVisionConfig(**vision).to_dict(),
                              mm_tokens_per_image=4, boi_token_index=128, eoi_token_index=129, image_token_index=130)
        return tf.Gemma3ForConditionalGeneration(cfg).eval()
    if family in ("mistral3", "ministral3"):   # Mistral Small 3.x's text model, or Ministral 3's
        text = (tf.MistralConfig(**CONFIGS["mistral-window"][1], tie_word_embeddings=False) if family == "mistral3"
                else tf.Ministral3Config(**CONFIGS["ministral3"][1]))
        cfg = tf.Mistral3Config(text_config=text.to_dict(), tie_word_embeddings=False, image_token_index=110,
                                vision_config=tf.PixtralVisionConfig(**vision, head_dim=8).to_dict(), spatial_merge_size=1)
        return tf.Mistral3ForConditionalGeneration(cfg).eval()
    if family.startswith("llava"):   # LLaVA 1.5 (Vicuna: llama), LLaVA-NeXT (Mistral), LLaVA-OneVision (Qwen2)
        name = {"llava": "llama-gqa-llama3", "llava_next": "mistral-window", "llava_onevision": "qwen2-window"}[family]
        kind, fields = CONFIGS[name]
        text = dict(fields, model_type=kind, tie_word_embeddings=False)
        clip = dict(vision, projection_dim=16)
        if family == "llava":
            cfg = tf.LlavaConfig(text_config=text, vision_config=dict(clip, model_type="clip_vision_model"),
                                 image_token_index=95)
            return tf.LlavaForConditionalGeneration(cfg).eval()
        if family == "llava_next":
            cfg = tf.LlavaNextConfig(text_config=text, vision_config=dict(clip, model_type="clip_vision_model"),
                                     image_token_index=95, image_grid_pinpoints=[[28, 28]])
            return tf.LlavaNextForConditionalGeneration(cfg).eval()
        cfg = tf.LlavaOnevisionConfig(text_config=text, vision_config=dict(vision, model_type="siglip_vision_model"),
                                      image_token_index=95, video_token_index=96, image_grid_pinpoints=[[28, 28]])
        return tf.LlavaOnevisionForConditionalGeneration(cfg).eval()
    text = dict(vocab_size=139, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2, rope_theta=10000.0)
    qwen_vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=14,
                       spatial_merge_size=1, temporal_patch_size=1)
    tokens = dict(image_token_id=135, video_token_id=136, vision_start_token_id=137, vision_end_token_id=138)
    if family == "qwen2_vl":
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
        cfg = tf.Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=16, hidden_size=64, num_heads=2,
                                                                     mlp_ratio=2, patch_size=14, spatial_merge_size=1,
                                                                     temporal_patch_size=1), **tokens)
        return tf.Qwen2VLForConditionalGeneration(cfg).eval()
    if family == "qwen2_5_vl":
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
        cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=dict(qwen_vision, fullatt_block_indexes=[0],
                                                                         window_size=28), **tokens)
        return tf.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    text = dict(text, head_dim=16, rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                 "mrope_interleaved": True})
    # qwen3_vl_tied: tied at the top level (transformers 5 ties by it: no head stored), untied in
    # text_config, as transformers 5 saves Qwen3-VL-2B / 4B's fine-tunes
    cfg = tf.Qwen3VLConfig(text_config=text, vision_config=dict(qwen_vision, num_position_embeddings=16,
                                                                deepstack_visual_indexes=[0]),
                           tie_word_embeddings=family == "qwen3_vl_tied", **tokens)
    return tf.Qwen3VLForConditionalGeneration(cfg).eval()


def _other_layout(folder: Path, out: Path) -> Path:
    """The folder with its language model's tensors under the other names jaxinfer reads:
    model.language_model.* and lm_head (Qwen3-VL's uploads) for language_model.model.* and
    language_model.lm_head (Gemma 3's and Mistral Small's) or model.* (Qwen2.5-VL's), and
    Gemma 3's names for Qwen3-VL's."""
    from safetensors.numpy import load_file, save_file
    out.mkdir()
    new = {}
    for k, v in load_file(folder / "model.safetensors").items():
        for old, body in (("language_model.model.", "model.language_model."), ("model.language_model.", "language_model.model."),
                          ("language_model.lm_head.", "lm_head."), ("lm_head.", "language_model.lm_head."),
                          ("model.layers.", "model.language_model.layers."), ("model.embed_tokens.", "model.language_model.embed_tokens."),
                          ("model.norm.", "model.language_model.norm.")):
            if k.startswith(old):
                k = body + k[len(old):]
                break
        new[k] = v
    save_file(new, out / "model.safetensors", metadata={"format": "pt"})
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def _flat_config(folder: Path, out: Path) -> Path:
    """Qwen2.5-VL's config.json as published before transformers 5: the text fields at the top level,
    its RoPE the legacy {"type": "mrope", "mrope_section"} (no rope_type)."""
    shutil.copytree(folder, out)
    cfg = json.loads((out / "config.json").read_text())
    text = cfg.pop("text_config")
    text.pop("model_type", None)
    sections = (text.pop("rope_parameters", None) or text.pop("rope_scaling"))["mrope_section"]
    cfg.update(text, rope_scaling={"type": "mrope", "mrope_section": sections}, rope_theta=10000.0)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("family", ["gemma3", "mistral3", "ministral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
                                    "qwen3_vl_tied", "llava", "llava_next", "llava_onevision"])
def test_language_model_of_a_vision_language_checkpoint_matches_transformers(family, tmp_path):
    hf = _wrapper(family)
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()   # one file: _other_layout rewrites it
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
    folders = [tmp_path / "hf", _other_layout(tmp_path / "hf", tmp_path / "other")]
    if family in ("qwen2_vl", "qwen2_5_vl"):
        folders.append(_flat_config(tmp_path / "hf", tmp_path / "flat"))
    for folder in folders:
        gen = Generator.from_pretrained(folder, **ENGINE)
        assert gen.model_cfg.architecture == {"gemma3": "Gemma3ForCausalLM", "mistral3": "MistralForCausalLM",
                                              "ministral3": "Ministral3ForCausalLM",
                                              "qwen2_vl": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM",
                                              "qwen3_vl": "Qwen3ForCausalLM", "qwen3_vl_tied": "Qwen3ForCausalLM",
                                              "llava": "LlamaForCausalLM", "llava_next": "MistralForCausalLM",
                                              "llava_onevision": "Qwen2ForCausalLM"}[family]
        assert gen.model_cfg.tie_embeddings == (family in ("gemma3", "qwen3_vl_tied"))
        logits = gen.logits(PROMPT)
        assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-4, folder.name
    if family == "gemma3":   # the paged path too: greedy tokens as transformers' generate
        with torch.no_grad():
            want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(PROMPT):].tolist()
        out = gen.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
        assert out.token_ids == want


def _moe_wrapper():
    """A tiny random Qwen3VLMoeForConditionalGeneration: 4 experts of 24 (2F != d: the two layouts of
    the fused experts differ in shape, as in every published size), top-2, the second of its
    three layers dense (mlp_only_layers), a one-layer vision tower. transformers' init leaves the
    router at zero: drawn here, so that the choice of experts matters."""
    import transformers as tf
    torch.manual_seed(0)
    text = dict(vocab_size=139, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16, deepstack_visual_indexes=[0])
    cfg = tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=135, video_token_id=136,
                              vision_start_token_id=137, vision_end_token_id=138)
    hf = tf.Qwen3VLMoeForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return hf


def _rewrite_experts(folder: Path, out: Path, layout: str) -> Path:
    """The folder with each layer's fused experts as the uploads store them ("upload": gate_up_proj
    [E, d, 2F], down_proj [E, F, d], what transformers' loader transposes) or one Linear per expert
    ("per_expert": experts.j.gate_proj / up_proj / down_proj [out, in], the FP8 uploads' layout)."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(folder, out)
    new = {}
    for k, v in load_file(folder / "model.safetensors").items():
        if not k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            new[k] = v
        elif layout == "upload":
            new[k] = np.ascontiguousarray(v.transpose(0, 2, 1))
        elif k.endswith("gate_up_proj"):   # [E, 2F, d]: gate rows, then up
            f = v.shape[1] // 2
            for j in range(v.shape[0]):
                new[k.replace("gate_up_proj", f"{j}.gate_proj.weight")] = np.ascontiguousarray(v[j, :f])
                new[k.replace("gate_up_proj", f"{j}.up_proj.weight")] = np.ascontiguousarray(v[j, f:])
        else:
            for j in range(v.shape[0]):
                new[k.replace("down_proj", f"{j}.down_proj.weight")] = np.ascontiguousarray(v[j])
    save_file(new, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_qwen3_vl_moe_language_model_matches_transformers(tmp_path):
    """Qwen3-VL-30B-A3B / 235B-A22B served as their Qwen3-MoE language model: logits on text as
    transformers' Qwen3VLMoeForConditionalGeneration, with the experts as transformers 5 saves them
    ([E, 2F, d] / [E, d, F]), as the uploads store them (transposed) and one tensor per expert; greedy
    tokens as its generate. Its config without norm_topk_prob still renormalizes, as its router does."""
    hf = _moe_wrapper()
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
    assert "norm_topk_prob" not in json.loads((tmp_path / "hf" / "config.json").read_text())["text_config"]
    for folder in (tmp_path / "hf", _rewrite_experts(tmp_path / "hf", tmp_path / "up", "upload"),
                   _rewrite_experts(tmp_path / "hf", tmp_path / "pe", "per_expert")):
        gen = Generator.from_pretrained(folder, **ENGINE)
        cfg = gen.model_cfg
        assert (cfg.architecture, cfg.num_experts, cfg.moe_norm_topk, cfg.moe_layers) == (
            "Qwen3MoeForCausalLM", 4, True, (True, False, True))
        assert np.abs(gen.logits(PROMPT) - ref).max() / np.abs(ref).max() < 1e-4, folder.name
    out = gen.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == want


@pytest.mark.parametrize("kind", ["qwen3_vl_moe_text", "qwen3_vl_text"])
def test_qwen3_vl_sizes_default_as_transformers(kind):
    """A Qwen3-VL(-MoE) text_config naming only its width, heads and depth: its KV heads, MLP and
    (MoE) experts as Qwen3VLMoeTextConfig's / Qwen3VLTextConfig's defaults (60 experts, top-4, 16 KV
    heads; 32 KV heads, ...), not Qwen3's / Qwen3-MoE's."""
    import transformers as tf
    text = {"model_type": kind, "hidden_size": 64, "num_attention_heads": 32, "num_hidden_layers": 2, "vocab_size": 256}
    moe = kind == "qwen3_vl_moe_text"
    t = (tf.Qwen3VLMoeConfig if moe else tf.Qwen3VLConfig)(text_config=text).text_config
    arch = "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"
    ours = model_config_from_hf({"architectures": [arch], "text_config": text})
    assert (ours.ffn_dim, ours.n_kv_heads, ours.head_dim) == (t.intermediate_size, t.num_key_value_heads, t.head_dim)
    assert (ours.rope_theta, ours.max_position_embeddings, ours.norm_eps, ours.sliding_window) == (
        t.rope_parameters["rope_theta"], t.max_position_embeddings, t.rms_norm_eps, None)
    if moe:
        assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_ffn_dim, ours.moe_norm_topk) == (
            t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size, True)


def test_ministral3_text_config_defaults_as_transformers():
    """A Ministral 3 text_config naming only its sizes: Ministral3Config's YaRN (base 1e6, x16 over
    16384), its query scale (beta 0.1 over 16384 positions), heads and context."""
    import transformers as tf
    text = {"model_type": "ministral3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "vocab_size": 256}
    t = tf.Mistral3Config(text_config=text).text_config
    ours = model_config_from_hf({"architectures": ["Mistral3ForConditionalGeneration"], "text_config": text})
    p = t.rope_parameters
    assert (ours.rope_theta, ours.rope_scaling.kind, ours.rope_scaling.factor,
            ours.rope_scaling.original_max_position_embeddings) == (
        p["rope_theta"], p["rope_type"], p["factor"], p["original_max_position_embeddings"])
    assert ours.query_log_scale == (p["llama_4_scaling_beta"], p["original_max_position_embeddings"])
    assert (ours.n_heads, ours.n_kv_heads, ours.head_dim, ours.max_position_embeddings, ours.norm_eps) == (
        t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.max_position_embeddings, t.rms_norm_eps)
    assert (ours.bos_token_id, ours.eos_token_ids) == (t.bos_token_id, (t.eos_token_id,))


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


@pytest.mark.parametrize("family", ["gemma3", "qwen3_vl"])
def test_an_adapter_of_a_vision_language_checkpoint_matches_peft(family, tmp_path):
    """PEFT's all-linear LoRA over Gemma3ForConditionalGeneration / Qwen3VLForConditionalGeneration
    adapts its language model and its vision tower (Qwen's `visual`, with target names of its own:
    qkv, proj, linear_fc1, ...): the text-only server takes the language model's matrices (under
    model.language_model, as PEFT names them) and leaves the tower's out, and its logits on text are
    PEFT's."""
    from safetensors import safe_open

    from tests.hf_models import seeded_peft
    from tests.precision import assert_rel_close, attention_rtol, dot_chain_rtol
    hf = _wrapper(family)
    hf.save_pretrained(tmp_path / "hf")
    model = seeded_peft(hf, dict(r=4, lora_alpha=8, target_modules="all-linear"), 11, 0.2)
    model.save_pretrained(tmp_path / "a")
    with safe_open(tmp_path / "a" / "adapter_model.safetensors", "np") as f:
        keys = list(f.keys())
    assert any(".vision_tower." in k or ".visual." in k for k in keys) and any("language_model.layers" in k for k in keys)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
    gen = Generator.from_pretrained(tmp_path / "hf", lora_modules={"a": str(tmp_path / "a")}, max_loras=1,
                                    max_lora_rank=4, **ENGINE)
    c = hf.config.text_config
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    rtol = dot_chain_rtol(*([d, d, c.num_attention_heads * hd, f, 4, 4] * c.num_hidden_layers), d) + \
        attention_rtol("float32", len(PROMPT), hd)
    assert_rel_close(gen.logits(PROMPT, lora="a"), ref, rtol, family)


@pytest.mark.parametrize("arch,kind", [("Qwen3VLForConditionalGeneration", "qwen3_vl_text"),
                                       ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl_text"),
                                       ("Qwen2VLForConditionalGeneration", "qwen2_vl_text")])
def test_text_config_defaults_as_transformers_fills_them(arch, kind):
    """A text_config naming only its sizes: RoPE base, context, norm epsilon, head size and special
    ids as Qwen3VLTextConfig / Qwen2_5_VLTextConfig fill them."""
    import transformers as tf
    sizes = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
                 num_attention_heads=16, num_key_value_heads=8)
    cls = {"qwen3_vl_text": tf.Qwen3VLConfig, "qwen2_5_vl_text": tf.Qwen2_5_VLConfig,
           "qwen2_vl_text": tf.Qwen2VLConfig}[kind]
    t = cls(text_config=dict(sizes, model_type=kind)).text_config
    ours = model_config_from_hf({"architectures": [arch], "text_config": dict(sizes, model_type=kind)})
    assert ours.rope_theta == t.rope_parameters["rope_theta"] and ours.rope_scaling is None
    assert ours.max_position_embeddings == t.max_position_embeddings and ours.norm_eps == t.rms_norm_eps
    assert ours.head_dim == (getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads)
    bos, eos = getattr(t, "bos_token_id", None), getattr(t, "eos_token_id", None)
    assert ours.bos_token_id == bos and list(ours.eos_token_ids) == ([eos] if eos is not None else [])


@pytest.mark.parametrize("arch,text", [
    # llava-1.5-7b-hf's text_config (Vicuna 7B): every size left to LlamaConfig
    ("LlavaForConditionalGeneration", {"max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                                       "vocab_size": 32064}),
    # llava-v1.6-mistral-7b-hf's: hidden size, layers and heads left to MistralConfig
    ("LlavaNextForConditionalGeneration", {"intermediate_size": 14336, "max_position_embeddings": 32768,
                                           "model_type": "mistral", "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                                           "rope_theta": 1000000.0, "sliding_window": None, "vocab_size": 32064}),
    ("LlavaNextForConditionalGeneration", {"model_type": "mistral"}),
    ("LlavaOnevisionForConditionalGeneration", {"model_type": "qwen2", "hidden_size": 896, "num_attention_heads": 14,
                                                "num_key_value_heads": 2, "intermediate_size": 4864,
                                                "num_hidden_layers": 24, "tie_word_embeddings": True}),
    ("LlavaOnevisionForConditionalGeneration", {}),   # no text_config fields: Qwen2Config's
])
def test_llava_text_config_sizes_as_transformers_fills_them(arch, text):
    """A LLaVA text_config naming only what differs from its language model's config class: every size
    as LlamaConfig / MistralConfig / Qwen2Config fill them inside LlavaConfig / LlavaNextConfig /
    LlavaOnevisionConfig."""
    import transformers as tf
    cls = {"LlavaForConditionalGeneration": tf.LlavaConfig, "LlavaNextForConditionalGeneration": tf.LlavaNextConfig,
           "LlavaOnevisionForConditionalGeneration": tf.LlavaOnevisionConfig}[arch]
    t = cls(text_config=dict(text) or None).text_config
    ours = model_config_from_hf({"architectures": [arch], "text_config": text})
    assert (ours.vocab_size, ours.d_model, ours.n_layers, ours.n_heads, ours.n_kv_heads, ours.ffn_dim) == (
        t.vocab_size, t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
        t.intermediate_size)
    assert (ours.rope_theta, ours.max_position_embeddings, ours.norm_eps, ours.sliding_window) == (
        t.rope_parameters["rope_theta"], t.max_position_embeddings, t.rms_norm_eps,
        getattr(t, "sliding_window", None) if getattr(t, "use_sliding_window", True) is not False else None)
    eos = t.eos_token_id
    assert ours.bos_token_id == t.bos_token_id and list(ours.eos_token_ids) == ([eos] if eos is not None else [])
