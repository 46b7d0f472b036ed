"""GGUF checkpoints (`--model file.gguf`) against transformers' own GGUF loader and the HF originals.

Each file is written here as llama.cpp's converter writes one (tests/gguf_files.py): SentencePiece
and byte-level vocabularies, Llama's permuted Q/K rows, float and block-quantized tensors (llama.cpp's
quantizers in the gguf package; random blocks for the K-quants, which it cannot quantize).
References: transformers.AutoModelForCausalLM / AutoTokenizer.from_pretrained(gguf_file=...)
(transformers dequantizes the K-quants with its own torch code), and the HF model the file was
written from (float32 tensors, Llama 3's rope_freqs).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxinfer import Generator, SamplingParams
from jaxinfer.config import ConfigError
from jaxinfer.errors import CheckpointError
from jaxinfer.hub import ModelSpecError, resolve_model_path
from tests import prequant_models as pm
from tests.gguf_files import _PERMUTED, CONTROL, byte_level_vocab, sentencepiece_vocab, write_gguf
from tests.hf_models import TEXT_WORDS, build_hf_model, save_text_model
from tests.precision import assert_rel_close, dot_chain_rtol

# Llama 3's scaling with three of the 8 frequencies of a 16-wide head in its smooth band (wavelengths
# 16..256; Llama 3.1's 128-wide heads have seven there, at 8192 / 4 .. 8192)
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 16.0,
        "original_max_position_embeddings": 256}
TEXTS = ["the quick  brown fox café\n\nnaïve 123456 <think>x<|im_end|>", " hello", "Hello world", "",
         "zebras write code 2024!\tover   a lazy dog's night"]


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    # the prepared folders go to this module's own cache, never the user's
    old = os.environ.get("JAXINFER_CACHE")
    os.environ["JAXINFER_CACHE"] = str(tmp_path_factory.mktemp("jaxinfer-cache"))
    yield
    if old is None:
        os.environ.pop("JAXINFER_CACHE", None)
    else:
        os.environ["JAXINFER_CACHE"] = old


HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
OSS_IDS = [1, 5, 9, 20, 33, 40, 7, 11, 60, 90, 100, 3]
# as tests/test_prequant's gpt-oss: float32 dots of 64 terms through four layers of six matmuls
OSS_RTOL = dot_chain_rtol(*([64] * 6 * 4), 64)


# files of one Llama whose rows are 256 (the K-quants' block): case -> the types of q/k/v, o, gate/up, down
K_MIXES = {"llama-q4km": ("Q4_K", "Q5_K", "Q4_K", "Q6_K"),        # a Q4_K_M-like file
           "llama-q3km": ("Q3_K", "Q4_K", "Q2_K", "Q3_K"),        # Q3_K_M-like, with Q2_K: every K-quant packed
           "llama-iq4": ("IQ4_XS", "IQ4_NL", "IQ4_NL", "IQ4_XS")}  # a 16-value int8 table: grouped int8, exactly


def _lines(n=400, seed=0):
    rng = np.random.RandomState(seed)
    return [" ".join(rng.choice(TEXT_WORDS, rng.randint(4, 14))) for _ in range(n)]


def _kquant_llama(vocab: int):
    """A Llama whose every matrix has rows of 256 (the K-quants' block)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
                                        max_position_embeddings=128, attn_implementation="eager")).eval()


def _make(name: str, root):
    """(path of the .gguf, the HF model it was written from) of case `name`."""
    from transformers import AutoModelForCausalLM
    folder = root / name
    folder.mkdir()
    if name == "llama-spm":   # SentencePiece BPE with byte fallback; every float and block type but K
        text = save_text_model(root / "spm-src")
        hf = AutoModelForCausalLM.from_pretrained(text, attn_implementation="eager").eval()
        vocab = sentencepiece_vocab(text / "tokenizer.model")
        qtypes = {"q_proj": "F16", "k_proj": "BF16", "down": "Q8_0", "up": "Q4_0", "gate": "Q5_1",
                  "embed": "Q4_1", "lm_head": "Q5_0"}
        return write_gguf(hf, folder / "model.gguf", vocab, qtypes), hf
    if name == "qwen2-bpe":   # byte-level BPE, Qwen2's pre-tokenizer; tied, biased q/k/v
        vocab = byte_level_vocab(_lines(), 300, "qwen2")
        vocab["eot"] = 2
        hf = build_hf_model("qwen2-tied", overrides={"vocab_size": 300})
        return write_gguf(hf, folder / "model.gguf", vocab, {"down": "Q8_0", "o_proj": "Q4_0", "embed": "Q8_0"}), hf
    if name == "qwen3-f32":   # q/k norms, head_dim != hidden / heads (16): attention.key_length
        vocab = byte_level_vocab(_lines(), 300, "llama-bpe")
        # 128: transformers' GGUF loader reads no key_length for qwen3, and Qwen3Config's default is 128
        hf = build_hf_model("qwen3-gqa", overrides={"vocab_size": 300, "head_dim": 128})
        return write_gguf(hf, folder / "model.gguf", vocab, add_bos=False), hf
    if name == "llama-kquant":
        vocab = byte_level_vocab(_lines(), 300, "llama-bpe")
        hf = _kquant_llama(300)
        qtypes = {"q_proj": "random:Q2_K", "k_proj": "random:Q3_K", "v_proj": "random:Q4_K",
                  "o_proj": "random:Q5_K", "mlp": "random:Q6_K", "embed": "Q8_0", "lm_head": "random:Q6_K"}
        return write_gguf(hf, folder / "model.gguf", vocab, qtypes), hf
    if name == "llama3-rope":   # Llama 3's rope scaling as llama.cpp stores it: rope_freqs.weight
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        vocab = byte_level_vocab(_lines(), 300, "llama-bpe")
        hf = build_hf_model("llama-gqa-llama3", overrides={"vocab_size": 300, "rope_scaling": ROPE})
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
        plain = 1.0 / hf.config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16)
        return write_gguf(hf, folder / "model.gguf", vocab, rope_freqs=(plain / scaled).numpy()), hf
    if name in K_MIXES:   # random blocks (no quantizer in the gguf package for these types)
        qkv, o, gate_up, down = (f"random:{t}" for t in K_MIXES[name])
        vocab = byte_level_vocab(_lines(), 300, "llama-bpe")
        hf = _kquant_llama(300)
        qtypes = {"q_proj": qkv, "k_proj": qkv, "v_proj": qkv, "o_proj": o, "gate": gate_up, "up_proj": gate_up,
                  "down": down, "embed": "Q8_0"}
        return write_gguf(hf, folder / "model.gguf", vocab, qtypes), hf
    if name == "llama-q8":   # Llama's permuted Q/K packed: q/k/v Q8_0, o Q5_0, gate/up Q4_0, down Q8_0
        vocab = byte_level_vocab(_lines(), 300, "smollm")
        hf = build_hf_model("mistral-mha", overrides={"vocab_size": 300})
        qtypes = {"q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q8_0", "o_proj": "Q5_0", "gate": "Q4_0",
                  "up_proj": "Q4_0", "down": "Q8_0"}
        return write_gguf(hf, folder / "model.gguf", vocab, qtypes), hf
    if name == "qwen3moe":   # experts (Q8_0 stacks, dequantized); q/k/v Q8_0 packed
        vocab = byte_level_vocab(_lines(), 300, "qwen2")
        # 768: transformers' GGUF loader reads no expert_feed_forward_length (Qwen3MoeConfig's default is 768)
        hf = build_hf_model("qwen3moe-gqa", overrides={"vocab_size": 300, "head_dim": 128, "mlp_only_layers": [],
                                                       "moe_intermediate_size": 768})
        qtypes = {"experts": "Q8_0", "q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q8_0"}
        return write_gguf(hf, folder / "model.gguf", vocab, qtypes), hf
    if name == "qwen2moe":   # a gated shared expert (Q4_0) beside the experts (Q8_0 stacks); q/k/v Q8_0
        vocab = byte_level_vocab(_lines(), 300, "qwen2")
        # transformers' GGUF loader reads neither expert width (Qwen2MoeConfig's defaults: 1408, 5632)
        hf = build_hf_model("qwen2moe-shared", overrides={"vocab_size": 300, "mlp_only_layers": [],
                                                          "moe_intermediate_size": 1408,
                                                          "shared_expert_intermediate_size": 5632})
        qtypes = {"experts": "Q8_0", "q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q8_0", "shared_expert.": "Q4_0"}
        return write_gguf(hf, folder / "model.gguf", vocab, qtypes), hf
    if name == "phi3-spm":   # fused q/k/v (Q8_0: packed as one tensor) and gate/up (Q4_0); down Q5_0
        text = save_text_model(root / "phi3-src")
        # no LongRoPE, window or partial rotary: transformers' GGUF loader reads none of them for phi3
        hf = build_hf_model("phi3-mqa-window", overrides={"vocab_size": 400, "intermediate_size": 96, "sliding_window": None,
                                                          "rope_parameters": {
            "rope_type": "default", "rope_theta": 500.0}})
        qtypes = {"qkv_proj": "Q8_0", "gate_up": "Q4_0", "down": "Q5_0"}
        return write_gguf(hf, folder / "model.gguf", sentencepiece_vocab(text / "tokenizer.model"), qtypes), hf
    if name.startswith("gpt-oss"):   # the MXFP4 checkpoint of tests/test_prequant, harmony's special tokens
        # swiglu_limit 7.0: llama.cpp's, fixed (a GGUF carries none)
        src, ref = pm.save_gpt_oss_mxfp4(root / f"{name}-src", overrides={"vocab_size": 300, "swiglu_limit": 7.0})
        vocab = byte_level_vocab(_lines(), 300, "gpt-4o", raw=dict.fromkeys(HARMONY, CONTROL))
        if name == "gpt-oss-mxfp4":   # experts as published, moved into ggml's block order
            from safetensors.numpy import load_file
            st = load_file(str(src / "model.safetensors"))
            mx = {k[:-len("_blocks")]: (st[k], st[k.replace("_blocks", "_scales")]) for k in st if k.endswith("_blocks")}
            return write_gguf(ref, folder / "model.gguf", vocab, mxfp4=mx), ref
        # gate and up in one tensor (llama.cpp's fuse_gate_up_exps), the experts Q8_0
        return write_gguf(ref, folder / "model.gguf", vocab, {"experts": "Q8_0"}, fuse_gate_up=True), ref
    if name == "mixtral-f32":   # llama.cpp's llama with experts
        vocab = byte_level_vocab(_lines(), 300, "llama-bpe")
        hf = build_hf_model("mixtral-gqa", overrides={"vocab_size": 300})
        return write_gguf(hf, folder / "model.gguf", vocab), hf
    raise KeyError(name)


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory):
    made = {}
    root = tmp_path_factory.mktemp("gguf")

    def get(name):
        if name not in made:
            made[name] = _make(name, root)
        return made[name]
    return get


def _gen(path, **kw) -> Generator:
    kw = {"max_model_len": 64, "max_num_batched_tokens": 16, "max_num_seqs": 2, "warmup": False, "num_blocks": 9, **kw}
    return Generator.from_pretrained(str(path), **kw)


def _rel_err(a, ref) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", ["llama-spm", "qwen2-bpe", "qwen3-f32", "llama-kquant", "qwen3moe", "qwen2moe",
                                  "llama-q8", "llama-q4km", "llama-q3km", "llama-iq4", "phi3-spm"])
def test_logits_and_tokenizer_match_transformers_gguf(name, gguf_case):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path, _ = gguf_case(name)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, attn_implementation="eager").eval()
    ref_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    gen = _gen(path)
    for text in TEXTS:
        if name == "llama-spm" and text.startswith(" "):
            # transformers builds Llama's SentencePiece with Metaspace, which adds no U+2581 before text
            # that starts with a space; llama.cpp adds it always (as it does for phi3, where transformers
            # agrees): test_sentencepiece_space_prefix_as_llama_cpp checks it against sentencepiece
            continue
        ids = ref_tok(text).input_ids
        assert gen.tokenizer.encode(text) == ids, text
        assert gen.tokenizer.decode(ids, skip_special_tokens=False) == ref_tok.decode(ids)
        assert gen.tokenizer.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True)
    ids = ref_tok(TEXTS[-1]).input_ids
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].numpy()
    # the same float32 weights on both sides: only the summation order differs (as tests/test_hf_parity)
    assert _rel_err(gen.logits(ids), expected) < 1e-4


@pytest.mark.parametrize("name, packed", [
    # Q8_0 -> grouped int8 (g 32), Q4_0 -> int4 (g 32); q/k/v F32 stay floats
    ("qwen2-bpe", {"mlp/down": (8, 32), "attn/o": (4, 32)}),
    # Q6_K -> grouped int8 (g 16), Q5_K (o) -> grouped int8 with float zero points; q (Q2_K), k (Q3_K)
    # and v (Q4_K) are one fused matmul of three types: all floats
    ("llama-kquant", {"mlp/gate": (8, 16), "mlp/up": (8, 16), "mlp/down": (8, 16), "attn/o": (8, 32, False)}),
    # Q4_K q/k/v and gate/up -> int4 with float zero points, Q6_K down, Q5_K o
    ("llama-q4km", {"attn/q": (4, 32, False), "attn/k": (4, 32, False), "attn/v": (4, 32, False),
                    "attn/o": (8, 32, False), "mlp/gate": (4, 32, False), "mlp/up": (4, 32, False),
                    "mlp/down": (8, 16)}),
    # Q3_K (q/k/v, Llama's permuted Q/K too; down) -> int4 symmetric (g 16, scale d (sc - 32)); Q2_K gate/up
    # -> int4 (g 16) with float zero points; Q4_K o
    ("llama-q3km", {"attn/q": (4, 16), "attn/k": (4, 16), "attn/v": (4, 16), "attn/o": (4, 32, False),
                    "mlp/gate": (4, 16, False), "mlp/up": (4, 16, False), "mlp/down": (4, 16)}),
    # IQ4_XS (q/k/v, down: scale d (sc - 32) per 32) and IQ4_NL (o, gate/up) -> grouped int8 (g 32)
    ("llama-iq4", {"attn/q": (8, 32), "attn/k": (8, 32), "attn/v": (8, 32), "attn/o": (8, 32), "mlp/gate": (8, 32),
                   "mlp/up": (8, 32), "mlp/down": (8, 32)}),
    # down Q8_0 packed; gate Q5_1 and up Q4_0 are one fused matmul of two types: both floats
    ("llama-spm", {"mlp/down": (8, 32)}),
    # Llama's Q/K rows (llama.cpp's rotary order) packed; Q5_0 -> grouped int8 (g 32)
    ("llama-q8", {"attn/q": (8, 32), "attn/k": (8, 32), "attn/v": (8, 32), "attn/o": (8, 32), "mlp/gate": (4, 32),
                  "mlp/up": (4, 32), "mlp/down": (8, 32)}),
    # q/k/v Q8_0; the experts' Q8_0 stacks as stacked grouped int8 (one QuantizedWeight per layer)
    ("qwen3moe", {"attn/q": (8, 32), "attn/k": (8, 32), "attn/v": (8, 32), "mlp/gate": (8, 32),
                  "mlp/up": (8, 32), "mlp/down": (8, 32)}),
    ("qwen2moe", {"attn/q": (8, 32), "attn/k": (8, 32), "attn/v": (8, 32), "mlp/gate": (8, 32),
                  "mlp/up": (8, 32), "mlp/down": (8, 32)}),
])
def test_exact_blocks_stay_packed(name, packed, gguf_case):
    """Q8_0, Q4_0, Q5_0, Q6_K, Q3_K, IQ4_NL and IQ4_XS blocks load as jaxinfer's grouped formats, code for code (the
    dequantized weights equal the gguf package's dequantization of the file exactly); Q4_K, Q5_K and
    Q2_K with float zero points, within float32 rounding of it (16 eps of the tensor's largest |w|:
    (q - z) s against s q - o, a few roundings of terms up to twice it); the rest are floats."""
    import gguf
    from flax import nnx

    from jaxinfer.quant import QuantizedWeight, dequantize
    from jaxinfer.weights import load_model
    path, _ = gguf_case(name)
    folder = resolve_model_path(path)
    model, cfg = load_model(folder, "float32")
    params = {"/".join(map(str, p)): v.get_value() for p, v in nnx.state(model, nnx.Param).flat_state()}
    reader = gguf.GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    names = {"mlp/down": "ffn_down", "mlp/up": "ffn_up", "mlp/gate": "ffn_gate", "attn/o": "attn_output",
             "attn/q": "attn_q", "attn/k": "attn_k", "attn/v": "attn_v"}
    for i in range(cfg.n_layers):
        for ours in ("attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down"):
            w = params[f"layers/{i}/{ours}"]
            assert isinstance(w, QuantizedWeight) == (ours in packed), (i, ours)
            if ours in packed:
                bits, g, *sym = packed[ours]
                assert (w.bits, w.group_size, w.symmetric) == (bits, g, sym[0] if sym else True)
                stacked = cfg.num_experts and ours.startswith("mlp/")
                t = raw[f"blk.{i}.{names[ours]}{'_exps' if stacked else ''}.weight"]
                ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
                ref = ref.transpose(0, 2, 1) if stacked else ref.T                 # [E,] K, N
                if ours in ("attn/q", "attn/k") and cfg.architecture == "LlamaForCausalLM":
                    ref = _unpermute_cols(ref, cfg.n_heads if ours == "attn/q" else cfg.n_kv_heads)
                got = np.asarray(dequantize(w), np.float32).reshape(ref.shape)
                if w.symmetric:
                    assert np.array_equal(got, ref)
                else:   # (q - offset / s) * s against s * q - offset: a few roundings of terms <= max|w| * 2
                    assert np.abs(got - ref).max() <= 8 * np.finfo(np.float32).eps * 2 * np.abs(ref).max()


def _unpermute_cols(w_kn: np.ndarray, heads: int) -> np.ndarray:
    """[K, N] with llama.cpp's rotary order of each head's N columns -> transformers' (as its GGUF
    loader's reverse_permute_weights: (heads, half, 2) -> (heads, 2, half))."""
    k, n = w_kn.shape
    return w_kn.reshape(k, heads, n // heads // 2, 2).swapaxes(2, 3).reshape(k, n)


def test_float32_file_is_the_original_model(gguf_case):
    """Written in float32, the file computes what the model it came from computes (the writer, the
    tensor names and the key_length head size are right, not merely agreed on by two readers)."""
    path, hf = gguf_case("qwen3-f32")
    gen = _gen(path)
    ids = np.random.RandomState(1).randint(3, 300, 24).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    assert gen.model_cfg.head_dim == 128 and gen.model_cfg.qk_norm and not gen.tokenizer.add_bos


def test_mixtral_is_the_original_model(gguf_case):
    """Stacked experts (ffn_*_exps) read expert by expert: Mixtral (llama.cpp's llama with experts, Q/K
    permuted) in float32 computes what the HF model computes (transformers' GGUF loader reads no
    experts for llama; Qwen3-MoE's are checked against it above)."""
    path, hf = gguf_case("mixtral-f32")
    gen = _gen(path)
    assert gen.model_cfg.num_experts == hf.config.num_local_experts
    ids = np.random.RandomState(3).randint(3, 300, 24).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    assert _rel_err(gen.logits(ids), expected) < 1e-4


@pytest.mark.parametrize("name, overrides", [
    # Phi-4-mini's shape: LongRoPE, 3/4 of each head rotating, served past the original length (long factors)
    ("phi3-longrope", {}),
    # a window on every layer, the short factors, an attention factor of 1.1 (llama.cpp's converter would
    # write the default 1.0 from the lengths; the file carries 1.1 here, as the model's config says)
    ("phi3-mqa-window", {}),
])
def test_phi3_is_the_original_model(name, overrides, gguf_case, tmp_path):
    """Phi-3 / Phi-4 as llama.cpp's converter writes them (Phi3MiniModel: q/k/v and gate/up fused;
    LongRoPE as rope_factors_long / rope_factors_short tensors and rope.scaling.attn_factor; partial
    rotary as rope.dimension_count; the window) compute what the HF model computes (transformers'
    GGUF loader reads none of those for phi3). A fused tensor in Q8_0 / Q4_0 stays packed, each
    projection its columns of it, equal to the gguf package's values."""
    import gguf

    from jaxinfer.quant import QuantizedWeight, dequantize
    from jaxinfer.weights import load_model
    text = save_text_model(tmp_path / "spm")
    hf = build_hf_model(name, overrides={"vocab_size": 400, **overrides})
    factor = hf.config.rope_parameters.get("attention_factor")
    path = write_gguf(hf, tmp_path / f"{name}.gguf", sentencepiece_vocab(text / "tokenizer.model"), attn_factor=factor)
    ids = np.random.RandomState(4).randint(3, 400, 24).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    assert _rel_err(_gen(path).logits(ids), expected) < 1e-4
    if name != "phi3-longrope":
        return
    packed_path, _ = gguf_case("phi3-spm")   # q/k/v Q8_0, gate/up Q4_0, down Q5_0
    model, cfg = load_model(resolve_model_path(packed_path), "float32")
    raw = {t.name: t for t in gguf.GGUFReader(packed_path).tensors}
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    for fused, parts in (("attn_qkv", {"attn/q": (0, q), "attn/k": (q, q + kv), "attn/v": (q + kv, q + 2 * kv)}),
                         ("ffn_up", {"mlp/gate": (0, cfg.ffn_dim), "mlp/up": (cfg.ffn_dim, 2 * cfg.ffn_dim)}),
                         ("ffn_down", {"mlp/down": (0, cfg.d_model)})):
        t = raw[f"blk.0.{fused}.weight"]
        whole = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape))).T   # [K, N]
        for ours, (a, b) in parts.items():
            w = getattr(getattr(model.layers[0], ours.split("/")[0]), ours.split("/")[1]).get_value()
            assert isinstance(w, QuantizedWeight), ours
            assert np.array_equal(np.asarray(dequantize(w), np.float32).reshape(whole[:, a:b].shape), whole[:, a:b])


def test_smollm3_is_the_original_model(tmp_path):
    """SmolLM3 as llama.cpp's converter writes it (SmolLM3Model, a LlamaModel: Q / K rows permuted;
    the NoPE step is no key: llama.cpp fixes it at 4, the published models' no_rope_layer_interval):
    with layer 3 of 5 rotating nothing, in float32 and with q / k in Q8_0 (packed rows turned back
    too), computes what the HF model computes (transformers' GGUF loader reads no smollm3)."""
    text = save_text_model(tmp_path / "spm")
    hf = build_hf_model("smollm3-nope", overrides={"vocab_size": 400, "no_rope_layer_interval": 4,
                                                   "num_hidden_layers": 5})
    assert list(hf.config.no_rope_layers) == [1, 1, 1, 0, 1]
    ids = np.random.RandomState(6).randint(3, 400, 24).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    vocab = sentencepiece_vocab(text / "tokenizer.model")
    gen = _gen(write_gguf(hf, tmp_path / "f32.gguf", vocab))
    assert gen.model_cfg.rope_layers == (True, True, True, False, True)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    import copy

    import gguf
    path = write_gguf(hf, tmp_path / "q8.gguf", vocab, {"q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q8_0"})
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    ref = copy.deepcopy(hf)      # the HF model holding the file's q / k / v as the gguf package dequantizes them
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            for ours, proj, heads in (("q", layer.self_attn.q_proj, hf.config.num_attention_heads),
                                      ("k", layer.self_attn.k_proj, hf.config.num_key_value_heads),
                                      ("v", layer.self_attn.v_proj, None)):
                t = raw[f"blk.{i}.attn_{ours}.weight"]
                x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))   # [out, in]
                proj.weight.copy_(torch.tensor(x if heads is None else _unpermute_cols(x.T, heads).T))
        expected_q8 = ref(torch.tensor([ids])).logits[0].numpy()
    assert _rel_err(_gen(path).logits(ids), expected_q8) < 1e-4


def test_granite_is_the_original_model(tmp_path):
    """Granite as llama.cpp's converter writes it (GraniteModel, a LlamaModel: Q / K rows permuted; the
    four multipliers as granite.attention.scale, embedding_scale, residual_scale, logit_scale)
    computes what the HF model computes; without the attention scale key (llama.cpp's converter
    skips a 0) the queries are scaled by 1/sqrt(head_dim), llama.cpp's default, which the HF model
    with attention_multiplier = 1/sqrt(head_dim) computes."""
    text = save_text_model(tmp_path / "spm")
    vocab = sentencepiece_vocab(text / "tokenizer.model")
    ids = np.random.RandomState(7).randint(3, 400, 24).tolist()
    hf = build_hf_model("granite", overrides={"vocab_size": 400})
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    gen = _gen(write_gguf(hf, tmp_path / "granite.gguf", vocab))
    cfg = gen.model_cfg
    # the file's float32 values (0.22 is 0.2199999988... in float32, as transformers multiplies by it too)
    assert (cfg.embed_scale, cfg.attn_scale, cfg.residual_scale, cfg.logits_scaling) == (
        12.0, 0.0078125, float(np.float32(0.22)), 16.0)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    hf0 = build_hf_model("granite", overrides={"vocab_size": 400, "attention_multiplier": 0.0})   # not written
    path = write_gguf(hf0, tmp_path / "granite0.gguf", vocab)
    hf0.config.attention_multiplier = 16 ** -0.5
    for layer in hf0.model.layers:
        layer.self_attn.scaling = 16 ** -0.5
    with torch.no_grad():
        expected = hf0(torch.tensor([ids])).logits[0].numpy()
    assert _rel_err(_gen(path).logits(ids), expected) < 1e-4
    # llama.cpp runs no RoPE where rope.scaling.finetuned is false (granitehybrid's attention): refused
    bad = write_gguf(hf, tmp_path / "norope.gguf", vocab, extra={"granite.rope.scaling.finetuned": False})
    with pytest.raises(CheckpointError, match="granite.rope.scaling.finetuned = false"):
        _gen(bad)


@pytest.mark.parametrize("name", ["olmo2", "seed_oss", "olmoe", "ernie4_5"])
def test_olmo2_seed_oss_olmoe_and_ernie_files_are_the_original_model(name, tmp_path):
    """OLMo 2 (llama.cpp's olmo2: the branch-output norms, whole-width q / k norms; Q / K as stored),
    Seed-OSS (seed_oss: q / k / v and o biases) and OLMoE (olmoe: OLMo 2's q / k norms in a pre-norm
    block, 3 of 5 experts stacked per layer with no width of their own in the file, the chosen
    probabilities not renormalized; MHA, as llama.cpp sizes its k norm by the width) and ERNIE 4.5
    (ernie4_5: Q / K as transformers holds them, each head rotating in pairs) as llama.cpp's converter
    writes them compute what the HF model computes; a file with OLMo 3's sliding layers is refused by
    name, as is an ERNIE file with biases (llama.cpp adds q / k / v's only, transformers' use_bias
    every projection's)."""
    text = save_text_model(tmp_path / "spm")
    vocab = sentencepiece_vocab(text / "tokenizer.model")
    extra = {"olmoe": {"num_key_value_heads": 4}, "ernie4_5": {"use_bias": False}}.get(name, {})
    hf = build_hf_model(name, overrides={"vocab_size": 400, **extra})
    ids = np.random.RandomState(8).randint(3, 400, 24).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    assert _rel_err(_gen(write_gguf(hf, tmp_path / f"{name}.gguf", vocab)).logits(ids), expected) < 1e-4
    if name == "olmo2":
        bad = write_gguf(hf, tmp_path / "olmo3.gguf", vocab, extra={"olmo2.attention.sliding_window": 4096})
        with pytest.raises(CheckpointError, match="OLMo 3's sliding layers"):
            _gen(bad)
    if name == "ernie4_5":
        biased = write_gguf(build_hf_model(name, overrides={"vocab_size": 400}), tmp_path / "bias.gguf", vocab)
        with pytest.raises(CheckpointError, match="'blk.0.attn_q.bias': ernie4_5 with biases"):
            _gen(biased)


@pytest.mark.parametrize("name", ["granitemoe", "granitemoeshared"])
def test_granitemoe_files_are_the_original_model(name, tmp_path):
    """Granite 3.x MoE and GraniteMoeShared as llama.cpp's converter writes them (granitemoe,
    GraniteMoeModel: Granite's multipliers, Q / K permuted, the experts' input_linear split into
    ffn_gate_exps / ffn_up_exps, the shared MLP's into ffn_gate_shexp / ffn_up_shexp with its width as
    expert_shared_feed_forward_length, the experts feed_forward_length wide) compute what the HF model
    computes: the class told apart by that key, logits, greedy tokens through the paged engine; a file
    marked to run without RoPE is refused, as for granite. (An attention multiplier of 1, not the
    tiny configs' 1/128 or 1/64, under which the attention is nearly uniform and Q / K rows left in
    llama.cpp's order would pass unseen.)"""
    hf, vocab, ids, expected, gen = _as_converted(name, {"attention_multiplier": 1.0}, tmp_path)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert gen.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids == want
    bad = write_gguf(hf, tmp_path / "norope.gguf", vocab, extra={"granitemoe.rope.scaling.finetuned": False})
    with pytest.raises(CheckpointError, match="granitemoe.rope.scaling.finetuned = false"):
        _gen(bad)


@pytest.mark.parametrize("case", ["no window", "a window, 4 layers", "a window, 64 layers"])
def test_exaone4_files_are_what_llama_cpp_runs(case, tmp_path):
    """EXAONE 4.0 as llama.cpp's converter writes it (exaone4, Exaone4Model: Q / K as stored, the norms
    after each branch as post_attention_norm / post_ffw_norm, per-head q / k norms, the window and
    layer_types as one bool per layer) computes what llama.cpp computes from it, which is what
    transformers computes: with no window (the 1.2B), every layer global and rotating; a window in a
    64-layer file (the 32B's depth, the only one llama.cpp gives sliding layers), three sliding layers
    in four that rotate and a global one that does not; a window in a file of another depth is not
    run, so the reference is the same weights in transformers without one. Logits, and greedy tokens
    through the paged engine (not for 64 layers, whose decode programs take a minute to compile)."""
    text = save_text_model(tmp_path / "spm")
    vocab = sentencepiece_vocab(text / "tokenizer.model")
    ids = np.random.RandomState(9).randint(3, 400, 24).tolist()
    if case == "no window":
        hf = ref = build_hf_model("exaone4-nowindow", overrides={"vocab_size": 400})
    elif case == "a window, 4 layers":
        hf = build_hf_model("exaone4", overrides={"vocab_size": 400})
        ref = build_hf_model("exaone4", overrides={"vocab_size": 400, "sliding_window": None,
                                                   "layer_types": ["full_attention"] * 4})
        ref.load_state_dict(hf.state_dict())
    else:
        hf = ref = build_hf_model("exaone4", overrides={
            "vocab_size": 400, "num_hidden_layers": 64,
            "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 16})
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].numpy()
        want = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist() if ref.config.num_hidden_layers < 64 else None
    gen = _gen(write_gguf(hf, tmp_path / "exaone4.gguf", vocab))
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    cfg = gen.model_cfg
    if case == "a window, 64 layers":
        assert (cfg.sliding_window, cfg.rope_layers) == (6, (True, True, True, False) * 16)
    else:
        assert (cfg.sliding_window, cfg.rope_layers) == (None, None)
    if case != "a window, 64 layers":   # (64 layers' decode programs: a minute of compiling on a CPU)
        assert gen.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids == want
    if case == "no window":   # next-token-prediction blocks are refused by name
        bad = write_gguf(hf, tmp_path / "mtp.gguf", vocab, extra={"exaone4.nextn_predict_layers": 1})
        with pytest.raises(CheckpointError, match="exaone4.nextn_predict_layers = 1"):
            _gen(bad)


def test_ernie4_5_moe_files_are_the_original_model(tmp_path):
    """ERNIE 4.5 MoE as llama.cpp's converter writes it (ernie4_5-moe, Ernie4_5MoeModel: experts stacked
    per layer, the moe_statics correction as exp_probs_b, interleave_moe_layer_step and
    leading_dense_block_count, the shared experts' width as intermediate_size // num_key_value_heads)
    computes what the HF model computes: a dense first layer, then mixtures with top-2 of 4 by
    softmax plus the correction, renormalized, and a shared expert; logits and greedy tokens through
    the paged engine. A file whose shared width is not the shared experts' (the converter's formula
    on another shape) is refused, naming the key."""
    hf, vocab, ids, expected, gen = _as_converted("ernie4_5_moe", {"intermediate_size": 64}, tmp_path)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    assert gen.model_cfg.moe_layers == (False, True, True)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert gen.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids == want
    other = build_hf_model("ernie4_5_moe", overrides={"vocab_size": 400})   # 96 // 2 = 48, the experts' 32
    with pytest.raises(CheckpointError, match="expert_shared_feed_forward_length = 48 is not"):
        _gen(write_gguf(other, tmp_path / "other.gguf", vocab))


def test_minimax_m2_files_are_the_original_model(tmp_path):
    """MiniMax-M2 as llama.cpp's converter writes it (minimax-m2, MiniMaxM2Model: experts stacked, the
    correction as exp_probs_b, expert_gating_func sigmoid, rope.dimension_count the rotary_dim, Q / K
    as stored) computes what the HF model computes: whole-width q / k norms, half of each head
    rotating, top-2 of 6 by sigmoid scores plus the correction, renormalized; logits and greedy
    tokens through the paged engine. A softmax gating key is refused by name."""
    hf, vocab, ids, expected, gen = _as_converted("minimax-m2", {}, tmp_path)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    assert gen.model_cfg.rotary_dim == 8
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert gen.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids == want
    bad = write_gguf(hf, tmp_path / "softmax.gguf", vocab, extra={"minimax-m2.expert_gating_func": 1})
    with pytest.raises(CheckpointError, match="minimax-m2.expert_gating_func = 1"):
        _gen(bad)


def _as_converted(name: str, overrides: dict, tmp_path: Path):
    """(HF model of tests/hf_models.py's `name` with a 400-token vocabulary, the GGUF vocabulary,
    a 24-token prompt, the HF logits of it, a Generator on the model's GGUF as the converter writes it)."""
    text = save_text_model(tmp_path / "spm")
    vocab = sentencepiece_vocab(text / "tokenizer.model")
    hf = build_hf_model(name, overrides={"vocab_size": 400, **overrides})
    ids = np.random.RandomState(9).randint(3, 400, 24).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    gen = _gen(write_gguf(hf, tmp_path / f"{name}.gguf", vocab))
    assert gen.model_cfg.architecture == type(hf).__name__
    return hf, vocab, ids, expected, gen


def _assert_packed_as_dequantized(hf, vocab, ids, qtypes: dict, path: Path) -> None:
    """The model's GGUF with llama.cpp's blocks (qtypes) kept packed computes what the same model with
    the gguf package's dequantization of those blocks computes."""
    packed = write_gguf(hf, path, vocab, qtypes)
    ref = _dequantized_copy(hf, packed)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].numpy()
    assert _rel_err(_gen(packed).logits(ids), expected) < 1e-4


@pytest.mark.parametrize("name,overrides", [("glm4", {}), ("starcoder2-window", {"sliding_window": None}),
                                            ("cohere", {}), ("cohere2", {"tie_word_embeddings": True}), ("arcee", {}),
                                            ("exaone", {"rope_scaling": None}), ("lfm2", {}), ("lfm2-bias", {})])
def test_glm4_starcoder2_cohere_are_the_original_model(name, overrides, tmp_path):
    """GLM-4-0414 (llama.cpp's glm4: gate and up fused in ffn_up, the branch-output norms, q / k as
    transformers stores them, half of each head rotating in pairs), StarCoder2 (starcoder2:
    LayerNorms, biases, the ungated MLP), Command R (command-r: one bias-free LayerNorm for attention
    and MLP side by side, logit_scale) and Command R7B (cohere2: three sliding layers with RoPE to one
    global without, llama.cpp's default period) and Arcee (arcee: Llama's permuted Q / K, YaRN, the
    ungated squared-ReLU MLP) and EXAONE 3.5 (exaone: Llama's block, Q / K not permuted: NeoX RoPE; the
    embedding as the head) and LFM2 (lfm2: KV heads per layer, 0 on the short-convolution layers, the
    taps squeezed to [d, L], the MLP's width already adjusted; biased and untied too) as llama.cpp's converter writes them compute what the HF model computes. llama.cpp's starcoder2 attends to the whole context (its graph has no window,
    the file none to give), so the reference is the model without its window; cohere2's graph reads
    no output tensor, so the reference is tied."""
    hf, vocab, ids, expected, gen = _as_converted(name, overrides, tmp_path)
    assert gen.model_cfg.sliding_window == (6 if name == "cohere2" else None)
    if name == "lfm2":   # the file's conv layers refuse what their state cannot take, before loading
        with pytest.raises(ConfigError, match="tensor_parallel is not available for Lfm2ForCausalLM"):
            _gen(tmp_path / "lfm2.gguf", tensor_parallel=2)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    # Q8_0 blocks (packed) on q and k (whose rows the paired families' RoPE reorders), the fused gate / up
    # and the ungated up projections
    qtypes = {"q_proj.weight": "Q8_0", "k_proj.weight": "Q8_0", "gate_up_proj.weight": "Q8_0", "c_fc.weight": "Q8_0",
              "mlp.up_proj.weight": "Q8_0", "conv.in_proj.weight": "Q8_0"}
    _assert_packed_as_dequantized(hf, vocab, ids, qtypes, tmp_path / f"{name}-q8.gguf")
    if name == "glm4":   # a GLM-4.xV text model's file (M-RoPE, Q / K rows reordered by the converter): refused
        bad = write_gguf(hf, tmp_path / "glm4v.gguf", vocab, extra={"glm4.rope.dimension_sections": [8, 12, 12, 0]})
        with pytest.raises(CheckpointError, match="glm4.rope.dimension_sections"):
            _gen(bad)


@pytest.mark.parametrize("name", ["qwen3-next", "qwen3.5", "qwen3.5-moe"])
def test_gated_deltanet_files_are_the_original_model(name, tmp_path):
    """Qwen3-Next (qwen3next: in_proj_qkvz split into attn_qkv and attn_gate, in_proj_ba as stored; an
    older converter's file with in_proj_qkvz in ssm_in too),
    Qwen3.5 (qwen35, M-RoPE sections written, two next-token-prediction blocks appended and not run)
    and Qwen3.5-MoE (qwen35moe: its value heads tiled, two per key head) as llama.cpp's converter
    writes them (every norm but the Gated DeltaNet's as 1 + w, A_log as -exp, dt_bias as ssm_dt.bias,
    the taps squeezed) compute what the HF model computes: logits, and greedy tokens through the paged
    engine's states. Then Q8_0 blocks on the attention's q / k / o, the Gated DeltaNet's input
    projections (rows reordered in the packed form) and out_proj (Qwen3-Next's: packed; Qwen3.5-MoE's,
    columns tiled: dequantized at load) give what the HF model gives with those weights as the gguf
    package dequantizes them."""
    # (llama.cpp's qwen3next has no dense MLP layer: the published model has none)
    hf, vocab, ids, expected, gen = _as_converted(name, {"mlp_only_layers": []} if name == "qwen3-next" else {},
                                                  tmp_path)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    out = gen.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == want
    if name == "qwen3.5":
        nextn = write_gguf(hf, tmp_path / "nextn.gguf", vocab, nextn=2)
        assert _rel_err(_gen(nextn).logits(ids), expected) < 1e-4
    if name == "qwen3-next":   # an older converter's file: in_proj_qkvz as it is, in ssm_in
        legacy = write_gguf(hf, tmp_path / "legacy.gguf", vocab, split_qkvz=False)
        assert _rel_err(_gen(legacy).logits(ids), expected) < 1e-4
    qtypes = {"q_proj.weight": "Q8_0", "k_proj.weight": "Q8_0", "v_proj.weight": "Q8_0", "o_proj.weight": "Q8_0",
              "in_proj_qkv": "Q8_0", "in_proj_z": "Q8_0", "linear_attn.out_proj": "Q8_0"}
    packed = write_gguf(hf, tmp_path / f"{name}-q8.gguf", vocab, qtypes)
    ref = _with_dequantized(hf, packed, ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_qkvz",
                                         "in_proj_z", "out_proj"))
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].numpy()
    gen = _gen(packed)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    from flax import nnx

    from jaxinfer.quant import QuantizedWeight
    params = {"/".join(map(str, p)): v.get_value() for p, v in nnx.state(gen.engine.runner.params, nnx.Param).flat_state()}
    first = next(i for i in range(gen.model_cfg.n_layers) if not gen.model_cfg.is_linear_layer(i))
    assert isinstance(params[f"layers/{first}/attn/qkv"], QuantizedWeight)
    assert isinstance(params["layers/0/attn/in_proj_qkv"], QuantizedWeight) == (name != "qwen3-next")
    assert isinstance(params["layers/0/attn/out_proj"], QuantizedWeight) == (name != "qwen3.5-moe")


def test_nemotron_h_files_are_the_original_model(tmp_path):
    """Nemotron-H as llama.cpp's converter writes it (nemotron_h, NemotronHModel: the layers told apart
    by head_count_kv and feed_forward_length, each per layer; Mamba2Model's tensors: A_log as -exp
    [H, 1], D [H, 1], the gated norm [groups, I / groups], dt_bias as ssm_dt.bias, the taps squeezed;
    Q / K permuted; each layer's one norm attn_norm) computes what the HF model computes: logits, and
    greedy tokens through the paged engine's states."""
    hf, vocab, ids, expected, gen = _as_converted("nemotron-h", {}, tmp_path)
    assert gen.model_cfg.mlp_layers == (True, True, False, True, True)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert gen.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids == want


def test_nemotron_h_moe_files_are_the_original_model(tmp_path):
    """Nemotron 3 Nano as llama.cpp's converter writes it (nemotron_h_moe, NemotronHModel with experts:
    feed_forward_length the experts' width on the mixtures' layers; expert_count / used_count /
    feed_forward_length / shared_feed_forward_length / weights_norm / weights_scale / group_count;
    ffn_up_exps and ffn_down_exps stacked, ffn_gate_inp, exp_probs_b, ffn_up_shexp / ffn_down_shexp; a
    next-token-prediction block appended, counted in block_count and both per-layer lists) computes
    what the HF model computes: logits, and greedy tokens through the engine; Q8_0 experts and shared MLP
    load packed (the ungated up with no gate to agree with), as the gguf package dequantizes them. The converter never
    writes how many expert groups a token may use: a file with more than one group is refused, as is
    Nemotron 3 Super's latent size."""
    pattern = ["linear_attention", "moe", "full_attention", "moe", "moe", "linear_attention", "moe"]
    text = save_text_model(tmp_path / "spm")
    vocab = sentencepiece_vocab(text / "tokenizer.model")
    hf = build_hf_model("nemotron-h-moe", overrides={"vocab_size": 400, "layers_block_type": pattern, "n_group": 1,
                                                     "topk_group": 1})
    ids = np.random.RandomState(9).randint(3, 400, 24).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    gen = _gen(write_gguf(hf, tmp_path / "nano.gguf", vocab, nextn=1))
    cfg = gen.model_cfg
    assert (cfg.layer_kinds, cfg.moe_layers, cfg.num_experts) == (("mamba", "attention", "mlp", "mamba"),
                                                                  None, 8)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    assert gen.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids == want
    # Q8_0 experts and shared MLP stay packed, up without a gate beside it: the gguf package's dequantization
    import gguf

    from jaxinfer.gguf_file import prepare_folder
    from jaxinfer.quant import QuantizedWeight, dequantize
    from jaxinfer.weights import load_model
    packed = write_gguf(hf, tmp_path / "q8.gguf", vocab, {"mixer.experts": "Q8_0", "shared_experts.up_proj": "Q8_0"})
    model, _ = load_model(prepare_folder(packed), "float32")
    raw = {t.name: t for t in gguf.GGUFReader(packed).tensors}
    for ours, theirs, transpose in ((model.layers[0].mlp.up, "blk.1.ffn_up_exps.weight", (0, 2, 1)),
                                    (model.layers[0].mlp.down, "blk.1.ffn_down_exps.weight", (0, 2, 1)),
                                    (model.layers[0].mlp.shared.up, "blk.1.ffn_up_shexp.weight", (1, 0))):
        w, t = ours.get_value(), raw[theirs]
        assert isinstance(w, QuantizedWeight), theirs
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape))).transpose(transpose)
        np.testing.assert_array_equal(np.asarray(dequantize(w), np.float32), ref, err_msg=theirs)
    grouped = build_hf_model("nemotron-h-moe", overrides={"vocab_size": 400, "layers_block_type": pattern})
    with pytest.raises(CheckpointError, match="expert_group_count = 2 without nemotron_h_moe.expert_group_used_count"):
        _gen(write_gguf(grouped, tmp_path / "grouped.gguf", vocab))
    with pytest.raises(CheckpointError, match="moe_latent_size = 32"):
        _gen(write_gguf(hf, tmp_path / "super.gguf", vocab, extra={"nemotron_h_moe.moe_latent_size": 32}))


@pytest.mark.parametrize("name", ["granitemoehybrid", "granitemoehybrid-dense"])
def test_granitehybrid_files_are_the_original_model(name, tmp_path):
    """Granite 4.0-H as llama.cpp's converter writes it (granitehybrid, GraniteHybridModel: head_count_kv
    0 on the Mamba-2 layers, their sizes in ssm.*, A_log as -exp [H, 1], D [H, 1], the gated norm
    [groups, I / groups], dt_bias as ssm_dt.bias, the taps squeezed; the shared MLP's input_linear split
    into gate and up, _shexp beside the experts, the dense ffn_* without; Q / K permuted; no RoPE, as the
    converter marks every hybrid) computes what the HF model computes: logits, and greedy tokens
    through the paged engine's states. Then Q8_0 blocks on the Mamba-2 layers' ssm_in (its rows three
    parameters, the x / B / C and gate ones packed) and ssm_out and on the attention's v / o give what
    the HF model gives with those weights as the gguf package dequantizes them."""
    import copy

    import gguf
    from flax import nnx

    from jaxinfer.quant import QuantizedWeight
    hf, vocab, ids, expected, gen = _as_converted(name, {"position_embedding_type": None}, tmp_path)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert gen.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids == want
    parts = {"mamba.in_proj": "ssm_in", "mamba.out_proj": "ssm_out", "v_proj": "attn_v", "o_proj": "attn_output"}
    packed = write_gguf(hf, tmp_path / f"{name}-q8.gguf", vocab, {f"{k}.weight": "Q8_0" for k in parts})
    raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
           for t in gguf.GGUFReader(packed).tensors}
    ref = copy.deepcopy(hf)
    ref.load_state_dict({n: torch.tensor(raw[f"blk.{n.split('.')[2]}.{g}.weight"]) for n in ref.state_dict()
                         for k, g in parts.items() if n.endswith(f".{k}.weight")}, strict=False)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].numpy()
    gen = _gen(packed)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    params = {"/".join(map(str, p)): v.get_value() for p, v in nnx.state(gen.engine.runner.params, nnx.Param).flat_state()}
    first = gen.model_cfg.layer_kinds.index("mamba")
    assert all(isinstance(params[f"layers/{first}/attn/{p}"], QuantizedWeight) for p in ("in_proj_qkv", "in_proj_z",
                                                                                            "out_proj"))
    assert not isinstance(params[f"layers/{first}/attn/in_proj_a"], QuantizedWeight)


def test_qwen35_pre_tokenizer_keeps_combining_marks_in_words():
    """llama.cpp's qwen35 split (LLAMA_VOCAB_PRE_TYPE_QWEN35, Qwen3.5's tokenizer.json): Qwen2's, but a
    combining mark (\\p{M}) stays in its word and out of punctuation runs. By hand, "cafe" + U+0301 +
    " x!" is ["cafe\u0301", " x", "!"]; Qwen2's split cuts the mark off as a piece of its own."""
    from tokenizers import Regex, pre_tokenizers

    from jaxinfer.gguf_file import PRE_TOKENIZERS

    def pieces(pre: str, text: str) -> list[str]:
        split = pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre][0]), behavior="isolated")
        return [p for p, _ in split.pre_tokenize_str(text)]
    assert pieces("qwen35", "cafe\u0301 x!") == ["cafe\u0301", " x", "!"]
    assert pieces("qwen2", "cafe\u0301 x!") == ["cafe", "\u0301", " x", "!"]


def _with_dequantized(hf, path, modules: tuple[str, ...]):
    """A copy of the HF model whose `modules`' weights (transformers' names, each stored by the
    converter as is, or as Qwen3-Next's split / Qwen3.5's tiled forms) are the file's as the gguf
    package dequantizes them, the converter's reordering undone here (tests/gguf_files.py does it)."""
    import copy

    import gguf

    from tests.gguf_files import _tiled
    model = copy.deepcopy(hf)
    cfg = hf.config
    reader = gguf.GGUFReader(path)
    raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
           for t in reader.tensors}
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    r = hv // hk
    untile = lambda x, axis, width: _tiled(x, axis, r, hk, width) if r > 1 and cfg.model_type != "qwen3_next" \
        else x  # noqa: E731   (tiled [r, Hk] back to grouped [Hk, r]: the same swap)
    state = {}
    for hf_name in model.state_dict():
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        if layer is None or not any(f".{m}." in hf_name for m in modules):
            continue
        part = hf_name.split(".")[-2]
        if part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            x = raw[f"blk.{layer}.attn_{dict(q_proj='q', k_proj='k', v_proj='v', o_proj='output')[part]}.weight"]
        elif part == "in_proj_qkvz":   # attn_qkv's q, k, v and attn_gate regrouped per key head
            qkv, z = raw[f"blk.{layer}.attn_qkv.weight"], raw[f"blk.{layer}.attn_gate.weight"]
            parts = (qkv[:hk * dk], qkv[hk * dk:2 * hk * dk], qkv[2 * hk * dk:], z)
            x = np.concatenate([p.reshape(hk, -1, p.shape[-1]) for p in parts], axis=1).reshape(-1, qkv.shape[-1])
        elif part == "in_proj_qkv":
            x = raw[f"blk.{layer}.attn_qkv.weight"]
            x = np.concatenate([x[:2 * hk * dk], untile(x[2 * hk * dk:], 0, dv)])
        elif part == "in_proj_z":
            x = untile(raw[f"blk.{layer}.attn_gate.weight"], 0, dv)
        elif part == "out_proj":
            x = untile(raw[f"blk.{layer}.ssm_out.weight"], 1, dv)
        else:
            continue
        state[hf_name] = torch.tensor(np.ascontiguousarray(x))
    assert state
    model.load_state_dict(state, strict=False)
    return model


def test_internlm2_is_the_original_model(tmp_path):
    """InternLM2 / 2.5 (internlm2: InternLM2Model splits attention.wqkv into Q, K and V and permutes Q
    and K as LlamaModel does, so a file is a Llama's under another name): a Llama written as that
    converter writes it computes what the Llama computes."""
    text = save_text_model(tmp_path / "spm")
    vocab = sentencepiece_vocab(text / "tokenizer.model")
    hf = build_hf_model("llama-gqa-llama3", overrides={"vocab_size": 400, "rope_scaling": None})
    ids = np.random.RandomState(9).randint(3, 400, 24).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    gen = _gen(write_gguf(hf, tmp_path / "internlm2.gguf", vocab, arch="internlm2"))
    assert _rel_err(gen.logits(ids), expected) < 1e-4


@pytest.mark.parametrize("name,overrides", [
    ("phi", {"intermediate_size": 256}), ("gpt-neox", {"hidden_act": "gelu_new"}),
    ("gpt-neox-sequential", {"rotary_emb_base": 10000, "hidden_act": "gelu_new", "tie_word_embeddings": False}),
    ("stablelm", {}), ("stablelm-parallel-qk-norm", {}),
    ("gpt-bigcode-mqa", {"n_inner": None, "activation_function": "gelu_pytorch_tanh"})])
def test_phi2_gptneox_stablelm_are_the_original_model(name, overrides, tmp_path):
    """Phi-2 (llama.cpp's phi2: the LM head's bias), GPT-NeoX / Pythia (gptneox: attn_qkv's rows as
    [q | k | v], written back per head; sequential blocks by use_parallel_residual) and StableLM
    (stablelm: StableLM 2 12B's per-head q / k norms stacked, parallel blocks without ffn_norm) as
    llama.cpp's converters write them compute what the HF model computes. Their converters write no
    RoPE base (llama.cpp's 10 000) and Phi-2's MLP width as 4 x its width, so the references have
    those; GPT-NeoX's activation is the tanh GELU llama.cpp runs every gptneox file with. An older
    Phi-2 file's fused attn_qkv ([q | k | v] rows) reads as its three projections. StarCoder 1
    (starcoder: GPTBigCode's one KV head, c_attn's rows as stored, learned positions; its MLP 4 x the
    width and the tanh GELU, as the converter and llama.cpp assume)."""
    hf, vocab, ids, expected, gen = _as_converted(name, overrides, tmp_path)
    assert _rel_err(gen.logits(ids), expected) < 1e-4
    if name == "phi":
        fused = write_gguf(hf, tmp_path / "phi-fused.gguf", vocab, fuse_qkv=True)
        assert _rel_err(_gen(fused).logits(ids), expected) < 1e-4
    if name in ("gpt-neox", "stablelm-parallel-qk-norm", "phi", "gpt-bigcode-mqa"):
        # llama.cpp's blocks kept packed: Q8_0 / Q4_0 on the fused q / k / v (rows reordered per head as
        # codes and scales), the projections, the MLP and Phi-2's biased head
        qtypes = {"query_key_value.weight": "Q8_0", "q_proj.weight": "Q8_0", "k_proj.weight": "Q8_0", "c_attn": "Q8_0",
                  "dense.weight": "Q8_0", "fc1.weight": "Q4_0", "dense_h_to_4h.weight": "Q4_0", "gate_proj": "Q8_0",
                  "lm_head.weight": "Q8_0"}
        _assert_packed_as_dequantized(hf, vocab, ids, qtypes, tmp_path / f"{name}-q.gguf")


# DeepSeek-V3's YaRN as its config.json gives it (mscale = mscale_all_dim): what a GGUF carries (the
# converter writes 0.1 * mscale_all_dim only; llama.cpp takes mscale to equal it)
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                 "mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}


def _q8_0_round_trip(hf, parts: tuple[str, ...]) -> None:
    """Every parameter of `hf` whose name holds one of `parts` replaced by the gguf package's Q8_0
    quantization of it, dequantized (blocks of 32 along the last axis, as the writer stores it)."""
    import gguf
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if any(part in n for part in parts):
                x = p.detach().float().numpy()
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x, q8), q8).reshape(x.shape)))


@pytest.mark.parametrize("name, overrides, kw", [
    # GLM-4.5: 4 groups of experts (2 kept), half of each head rotating, q/k norms, q/k/v biases, a dense
    # first layer, two shared experts; the next-token-prediction block the converter appends (counted
    # in block_count, named by nextn_predict_layers) is not run
    ("glm4moe-groups", {}, {"nextn": 1}),
    # DeepSeek-V3: a q bottleneck, kv_b_proj as attn_k_b / attn_v_b (today's converter)
    ("deepseekv3-mla", {}, {}),
    # no q bottleneck, an older converter's file (one attn_kv_b, the heads' widths as key_length /
    # value_length, no *_mla keys), YaRN: the softmax scale from yarn_log_multiplier
    ("deepseekv3-yarn-bias", {"attention_bias": False, "rope_parameters": DEEPSEEK_YARN}, {"split_kv_b": False}),
    # DeepSeek-V2-Lite's shape: softmax routing (expert_gating_func 1) without groups, times 16, YaRN
    ("deepseekv2-groups", {"topk_method": "greedy", "n_group": 1, "topk_group": 1}, {}),
    # GLM-4.7-Flash: llama.cpp's converter writes it as deepseek2 (Glm4MoeLiteModel), its dense first layer
    # as leading_dense_block_count from the published config.json's first_k_dense_replace, its MTP block
    # appended
    ("glm4moelite", {"mlp_layer_types": ["dense", "sparse", "sparse"]}, {"nextn": 1}),
    # experts, shared experts, o and the latent down-projections Q8_0 (packed), the rest float32
    ("deepseekv3-mla", {"moe_intermediate_size": 32},
     {"qtypes": {"experts": "Q8_0", "shared_experts": "Q8_0", "o_proj": "Q8_0", "q_a_proj": "Q8_0",
                 "kv_a_proj": "Q8_0"}}),
])
def test_glm4moe_and_deepseek_are_the_original_model(name, overrides, kw, tmp_path):
    """GLM-4.5 (llama.cpp's glm4moe), DeepSeek-V3, GLM-4.7-Flash and DeepSeek-V2 (deepseek2: latent attention written
    as MQA, its own widths in key_length_mla / value_length_mla; sigmoid or softmax routing) as
    llama.cpp's converter writes them compute what the HF model computes; quantized, what it computes
    with the file's Q8_0 weights (the gguf package's round trip put into the HF model)."""
    text = save_text_model(tmp_path / "spm")
    vocab = sentencepiece_vocab(text / "tokenizer.model")
    hf = build_hf_model(name, overrides={"vocab_size": 400, **overrides})
    if name == "glm4moelite":   # (the published config.json names it; Glm4MoeLiteConfig keeps it as given)
        hf.config.first_k_dense_replace = 1
    kw = dict(kw)
    qtypes = kw.pop("qtypes", None)
    path = write_gguf(hf, tmp_path / f"{name}.gguf", vocab, qtypes, **kw)
    if qtypes:
        _q8_0_round_trip(hf, tuple(qtypes))
    ids = np.random.RandomState(8).randint(3, 400, 24).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    gen = _gen(path)
    assert gen.model_cfg.n_layers == hf.config.num_hidden_layers
    assert _rel_err(gen.logits(ids), expected) < 1e-4


def test_glm4moe_and_deepseek_refusals_and_tokenizers(tmp_path):
    """Softmax routing with groups (DeepSeek-V2's full models: llama.cpp limits them by DeepSeek-V3's
    group rule) and another gating function are refused by name; DeepSeek-V3's pre-tokenizer splits text as its tokenizer.json's does (the tokenizers library
    running the published Split expressions over the same vocabulary), and a glm4 vocabulary gets no
    BOS whatever the file says (llama.cpp's rule for it)."""
    from tokenizers import Tokenizer

    from jaxinfer.gguf_file import GGUFFile, build_tokenizer
    hf = build_hf_model("deepseekv3-mla", overrides={"vocab_size": 300})
    bad = write_gguf(hf, tmp_path / "gating.gguf", byte_level_vocab(_lines(), 300, "deepseek-v3"),
                     extra={"deepseek2.expert_gating_func": 3})
    with pytest.raises(CheckpointError, match="expert_gating_func = 3"):
        _gen(bad)
    v2 = build_hf_model("deepseekv2-groups", overrides={"vocab_size": 300})
    bad = write_gguf(v2, tmp_path / "v2.gguf", byte_level_vocab(_lines(), 300, "deepseek-v3"))
    with pytest.raises(CheckpointError, match="expert_group_count = 4 with softmax routing"):
        _gen(bad)
    # DeepSeek-V3's tokenizer.json: three Splits ("Isolated"), then ByteLevel without its own regex
    splits = [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
              "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"]
    lines = _lines() + ["价格是1234567元，東京タワー!abc#def", "x.y(z)=1;\r\n  \tfoo", "naïve café—über"]
    vocab = byte_level_vocab(lines, 300, "deepseek-v3")
    path = write_gguf(build_hf_model("qwen2-tied", overrides={"vocab_size": 300}), tmp_path / "ds.gguf", vocab)
    ours, _ = build_tokenizer(GGUFFile(path))
    ref = json.loads(ours.to_str())
    ref["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        *({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in splits),
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    ref = Tokenizer.from_str(json.dumps(ref))
    for text in lines[-3:] + TEXTS:
        assert ours.encode(text).ids == ref.encode(text).ids, text
    glm = write_gguf(build_hf_model("qwen2-tied", overrides={"vocab_size": 300}), tmp_path / "glm.gguf",
                     byte_level_vocab(_lines(), 300, "glm4"), add_bos=True)
    assert build_tokenizer(GGUFFile(glm))[1] is False


def _oss_expert(t) -> np.ndarray:
    """A llama.cpp experts tensor [E, N, K] as the gguf package dequantizes it, as jaxinfer's [E, K, N]."""
    import gguf
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape))).transpose(0, 2, 1)


def test_gpt_oss_mxfp4_is_the_original_model(gguf_case):
    """gpt-oss as llama.cpp's converter writes it (experts MXFP4 in ggml's block order, split into
    ffn_gate_exps / ffn_up_exps; sinks as attn_sinks.weight; YaRN) computes what the
    checkpoint it came from computes (transformers' own MXFP4 dequantization: its GGUF loader cannot
    read gpt-oss, it takes the metadata's key for the value). The experts stay MXFP4, as many bytes
    as the file's, and dequantize to the gguf package's values exactly; read as floats
    (gguf_blocks=False) they are those values, gate's and up's columns interleaved back. Harmony's
    <|end|> ends a message, not the generation (llama.cpp's rule when <|return|> and <|call|> stop)."""
    import gguf

    from jaxinfer.quant import QuantizedWeight, dequantize
    from jaxinfer.weights import load_model
    path, ref = gguf_case("gpt-oss-mxfp4")
    folder = resolve_model_path(path)
    packed, cfg = load_model(folder, "float32")
    floats, _ = load_model(folder, "float32", gguf_blocks=False)
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for i in range(cfg.n_layers):
        for part in ("gate", "up", "down"):
            w, t = getattr(packed.layers[i].mlp, part).get_value(), raw[f"blk.{i}.ffn_{part}_exps.weight"]
            assert isinstance(w, QuantizedWeight) and w.mxfp4 and w.batch == 1
            assert w.q.nbytes + w.scales.nbytes == t.data.nbytes
            expected = _oss_expert(t)
            assert np.array_equal(np.asarray(dequantize(w), np.float32).reshape(expected.shape), expected)
            assert np.array_equal(np.asarray(getattr(floats.layers[i].mlp, part).get_value()), expected)
    gen = _gen(path)
    assert_rel_close(gen.logits(OSS_IDS), pm.logits(ref, OSS_IDS), OSS_RTOL, "gpt-oss GGUF")
    stops = {gen.tokenizer.decode([i], skip_special_tokens=False) for i in gen.tokenizer.eos_ids}
    # the writer's vocabulary also has <|im_end|>, which llama.cpp stops at by its text
    assert stops == {"<|endoftext|>", "<|im_end|>", "<|return|>", "<|call|>"}


def test_gpt_oss_fused_gate_up_experts(gguf_case):
    """gpt-oss's gate and up experts in one llama.cpp tensor (ffn_gate_up_exps, gate's rows first) in
    Q8_0: each packed as grouped int8 from its half of the rows, equal to the gguf package's values;
    as floats, those values; the biases split alike."""
    import gguf

    from jaxinfer.quant import QuantizedWeight, dequantize
    from jaxinfer.weights import load_model
    path, ref = gguf_case("gpt-oss-q8-fused")
    folder = resolve_model_path(path)
    packed, cfg = load_model(folder, "float32")
    floats, _ = load_model(folder, "float32", gguf_blocks=False)
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    f = cfg.ffn_dim
    for i in range(cfg.n_layers):
        both = _oss_expert(raw[f"blk.{i}.ffn_gate_up_exps.weight"])                      # [E, D, 2F]
        bias = np.asarray(raw[f"blk.{i}.ffn_gate_up_exps.bias"].data).reshape(cfg.num_experts, 2 * f)
        experts = ref.model.layers[i].mlp.experts
        for part, cols in (("gate", slice(0, f)), ("up", slice(f, 2 * f))):
            w = getattr(packed.layers[i].mlp, part).get_value()
            assert isinstance(w, QuantizedWeight) and (w.bits, w.group_size, w.batch) == (8, 32, 1)
            assert np.array_equal(np.asarray(dequantize(w), np.float32).reshape(both[..., cols].shape), both[..., cols])
            assert np.array_equal(np.asarray(getattr(floats.layers[i].mlp, part).get_value()), both[..., cols])
            got = np.asarray(getattr(packed.layers[i].mlp, f"{part}_bias").get_value())
            assert np.array_equal(got, bias[:, cols])
            j = 0 if part == "gate" else 1   # the checkpoint's interleaved columns
            assert np.array_equal(got, experts.gate_up_proj_bias.detach().numpy()[:, j::2])


def test_fused_gate_up_experts(tmp_path):
    """A Qwen3-MoE's gate and up experts in one ffn_gate_up_exps tensor (convert_hf_to_gguf.py's
    --fuse-gate-up-exps, gate's rows first): in Q8_0 each packed from its half of the rows, equal to
    the gguf package's values; as floats, the HF model's experts (F32)."""
    import gguf

    from jaxinfer.quant import QuantizedWeight, dequantize
    from jaxinfer.weights import load_model
    vocab = byte_level_vocab(_lines(), 300, "qwen2")
    hf = build_hf_model("qwen3moe-gqa", overrides={"vocab_size": 300, "mlp_only_layers": [], "moe_intermediate_size": 64})
    q8 = write_gguf(hf, tmp_path / "q8.gguf", vocab, {"experts": "Q8_0"}, fuse_gate_up=True)
    f32 = write_gguf(hf, tmp_path / "f32.gguf", vocab, fuse_gate_up=True)
    packed, cfg = load_model(resolve_model_path(q8), "float32")
    floats, _ = load_model(resolve_model_path(f32), "float32")
    raw = {t.name: t for t in gguf.GGUFReader(q8).tensors}
    f = cfg.moe_ffn_dim or cfg.ffn_dim
    for i in range(cfg.n_layers):
        both = _oss_expert(raw[f"blk.{i}.ffn_gate_up_exps.weight"])                      # [E, D, 2F]
        hf_both = hf.model.layers[i].mlp.experts.gate_up_proj.detach().numpy().transpose(0, 2, 1)
        for part, cols in (("gate", slice(0, f)), ("up", slice(f, 2 * f))):
            w = getattr(packed.layers[i].mlp, part).get_value()
            assert isinstance(w, QuantizedWeight) and (w.bits, w.group_size, w.batch) == (8, 32, 1)
            assert np.array_equal(np.asarray(dequantize(w), np.float32).reshape(both[..., cols].shape), both[..., cols])
            assert np.array_equal(np.asarray(getattr(floats.layers[i].mlp, part).get_value()), hf_both[..., cols])


@pytest.mark.parametrize("name, overrides", [
    # llama.cpp's Gemma (1): every layer global, no RoPE base in the file
    ("gemma", {}),
    # llama.cpp's Gemma 2: every other layer sliding, soft caps from the file, queries by 1/sqrt(head_dim)
    ("gemma2", {"query_pre_attn_scalar": 16}),
    # Gemma 3: five sliding layers to one global (base 1e6, linear x8; sliding base 10 000), q/k norms
    ("gemma3", {"query_pre_attn_scalar": 16, "final_logit_softcapping": None}),
])
def test_gemma_is_the_original_model(name, overrides, tmp_path):
    """Gemma 1 / 2 / 3 as llama.cpp's converter writes them (norms as 1 + w, SentencePiece without the
    space prefix; Q8_0 projections packed) compute what the HF model computes, with the settings
    llama.cpp assumes rather than reads (query scale, layer pattern, sliding RoPE base)."""
    text = save_text_model(tmp_path / "spm")
    hf = build_hf_model(name, overrides={"vocab_size": 400, **overrides})
    qtypes = {"q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q8_0", "o_proj": "Q8_0"}
    path = write_gguf(hf, tmp_path / f"{name}.gguf", sentencepiece_vocab(text / "tokenizer.model"), space_prefix=False)
    packed = write_gguf(hf, tmp_path / f"{name}-q8.gguf", sentencepiece_vocab(text / "tokenizer.model"), qtypes,
                        space_prefix=False)
    ids = np.random.RandomState(4).randint(3, 400, 24).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    assert _rel_err(_gen(path).logits(ids), expected) < 1e-4
    ref = _dequantized_copy(hf, packed)   # the same Q8_0 weights, dequantized by the gguf package
    with torch.no_grad():
        expected_q8 = ref(torch.tensor([ids])).logits[0].numpy()
    assert _rel_err(_gen(packed).logits(ids), expected_q8) < 1e-4


def _dequantized_copy(hf, path):
    """A copy of the HF model holding the file's weights as the gguf package dequantizes them (Gemma's
    norms turned back from llama.cpp's 1 + w); transformers' GGUF loader reads no Gemma layer pattern or
    query scale, so the original model's config is kept."""
    import copy

    import gguf
    model = copy.deepcopy(hf)
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     hf.config.num_hidden_layers)
    raw = {t.name: t for t in reader.tensors}
    state = {}
    for hf_name in model.state_dict():
        stacked, head = hf_name, None
        if "_layernorm.norms." in hf_name:   # StableLM's per-head q / k norms: one row of the stacked tensor
            stacked, rest = hf_name.split(".norms.")
            stacked, head = f"{stacked}.weight", int(rest.split(".")[0])
        t = raw.get(names.get_name(stacked, try_suffixes=(".weight", ".bias")) or "")
        if t is not None:
            x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
            gemma_norm = hf.config.model_type.startswith("gemma") and hf_name.endswith("norm.weight")
            if head is not None:
                x = x[head]
            if arch in _PERMUTED and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                n = hf.config.num_attention_heads if ".q_proj." in hf_name else hf.config.num_key_value_heads
                x = np.ascontiguousarray(x.reshape(n, -1, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape))   # unpermute
            if arch == "gptneox" and ".query_key_value." in hf_name:   # [q | k | v] rows -> per head
                h = hf.config.num_attention_heads
                x = np.ascontiguousarray(x.reshape(3, h, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape))
            if hf_name.endswith(".conv.conv.weight"):   # LFM2's taps, squeezed to [d, L] by the converter
                x = x[:, None, :]
            state[hf_name] = torch.tensor(x - 1.0 if gemma_norm else x)
    assert not set(model.state_dict()) - set(state) - {"lm_head.weight"}
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def test_llama3_rope_freqs_recovered(gguf_case):
    """rope_freqs.weight (llama.cpp's divisors) becomes transformers' llama3 parameters: every position
    rotates as the HF model's (transformers' GGUF loader ignores the tensor); Llama's Q/K rows come
    back from llama.cpp's permuted order."""
    path, hf = gguf_case("llama3-rope")
    gen = _gen(path)
    rs = gen.model_cfg.rope_scaling
    assert rs.kind == "llama3" and rs.factor == pytest.approx(ROPE["factor"])
    # only the ratios original/low and original/high are fixed by the divisors (low is taken as 1)
    assert rs.original_max_position_embeddings / rs.low_freq_factor == pytest.approx(256, rel=1e-4)
    assert rs.original_max_position_embeddings / rs.high_freq_factor == pytest.approx(256 / 16, rel=1e-4)
    ids = np.random.RandomState(2).randint(3, 300, 60).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    assert _rel_err(gen.logits(ids), expected) < 1e-4


def test_generation_chat_template_and_stop_tokens(gguf_case):
    """The served path: greedy tokens as transformers' GGUF model generates them; the file's chat
    template renders; EOS and the end-of-turn token both stop (llama.cpp's end-of-generation set)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path, _ = gguf_case("qwen2-bpe")
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, attn_implementation="eager").eval()
    gen = _gen(path)
    assert gen.tokenizer.eos_ids == (0, 2) and gen.tokenizer.bos_id == 0
    ids = gen.tokenizer.encode("the lazy dog")
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist()
    out = gen.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == expected
    from serve.chat_template import ChatTemplates
    rendered = ChatTemplates.for_model(gen.tokenizer).render([{"role": "user", "content": "hi"}])
    ref_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert rendered == ref_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                   add_generation_prompt=True) == "<|user|>hi\n<|assistant|>"


def test_split_file(gguf_case, tmp_path):
    """A split GGUF (NAME-0000i-of-0000N.gguf, the gguf writer's split) loads from its first part and
    computes what the whole file computes; a later part alone, or a part missing, is named."""
    import gguf
    path, hf = gguf_case("qwen3-f32")
    reader = gguf.GGUFReader(path)
    assert len(reader.tensors) > 8
    split = tmp_path / "split"
    split.mkdir()
    vocab = byte_level_vocab(_lines(), 300, "llama-bpe")
    write_gguf_split(hf, split / "model.gguf", vocab)
    parts = sorted(p.name for p in split.iterdir())
    assert parts[0] == "model-00001-of-00003.gguf" and len(parts) == 3
    ids = [5, 17, 99, 3, 250, 8]
    whole = _gen(path).logits(ids)
    assert np.array_equal(_gen(split / parts[0]).logits(ids), whole)
    with pytest.raises(CheckpointError, match="give the first"):
        resolve_model_path(split / parts[1])
    (split / parts[2]).unlink()
    with pytest.raises(CheckpointError, match="00003-of-00003.gguf: missing"):
        _gen(split / parts[0])


def write_gguf_split(hf, path, vocab):
    """The file in 3 parts (the gguf writer's split_max_tensors)."""
    import gguf
    orig = gguf.GGUFWriter.__init__

    def init(self, *a, **kw):
        orig(self, *a, **{**kw, "split_max_tensors": 10})
    gguf.GGUFWriter.__init__ = init
    try:
        return write_gguf(hf, path, vocab, add_bos=False)
    finally:
        gguf.GGUFWriter.__init__ = orig


def test_prepared_folder_reused_and_refreshed(gguf_case, tmp_path):
    path, _ = gguf_case("qwen2-bpe")
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    first = resolve_model_path(copy)
    assert resolve_model_path(copy) == first
    cfg = json.loads((first / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"] is True
    os.utime(copy, ns=(1, 1))
    assert resolve_model_path(copy) != first


def test_bad_files_named(gguf_case, tmp_path):
    path, hf = gguf_case("qwen2-bpe")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:4000])
    with pytest.raises(CheckpointError, match="truncated.gguf"):
        resolve_model_path(truncated)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelSpecError, match="a .gguf file"):
        resolve_model_path(other)
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="'gpt2' .general.architecture. is not supported"):
        resolve_model_path(tmp_path / "gpt2.gguf")


def test_damaged_expert_and_rope_tensors_named(tmp_path):
    """A fused ffn_gate_up_exps whose rows are not twice the experts' width, a LongRoPE factor tensor
    of the wrong length, a missing gpt-oss expert tensor: each refused naming the file and tensor."""
    from jaxinfer.weights import load_model
    vocab = byte_level_vocab(_lines(), 300, "qwen2")
    hf = build_hf_model("qwen3moe-gqa", overrides={"vocab_size": 300, "mlp_only_layers": []})
    hf.config.moe_intermediate_size = 31     # the metadata's width; the tensors hold 2 x 32 rows
    bad = write_gguf(hf, tmp_path / "moe.gguf", vocab, fuse_gate_up=True)
    with pytest.raises(CheckpointError, match=r"moe.gguf: tensor 'blk.0.ffn_gate_up_exps.weight' has 64 rows"):
        load_model(resolve_model_path(bad), "float32")
    text = save_text_model(tmp_path / "spm")
    phi = build_hf_model("phi3-longrope", overrides={"vocab_size": 400})
    phi.config.rope_parameters["long_factor"] = phi.config.rope_parameters["long_factor"][:5]
    bad = write_gguf(phi, tmp_path / "phi.gguf", sentencepiece_vocab(text / "tokenizer.model"))
    with pytest.raises(CheckpointError, match=r"phi.gguf: tensor 'rope_factors_long.weight' has 5 values; expected 6"):
        resolve_model_path(bad)
    oss = build_hf_model("gpt-oss", overrides={"vocab_size": 300})
    state = {k: v for k, v in oss.state_dict().items() if k != "model.layers.1.mlp.experts.gate_up_proj_bias"}
    oss.load_state_dict(state, strict=False, assign=True)
    del oss.model.layers[1].mlp.experts.gate_up_proj_bias
    bad = write_gguf(oss, tmp_path / "oss.gguf", byte_level_vocab(_lines(), 300, "gpt-4o"))
    with pytest.raises(CheckpointError, match=r"oss.gguf: tensor 'model.layers.1.mlp.experts.gate_up_proj_bias' "
                                              r"\(GGUF 'blk.1.ffn_gate_exps.bias', 'blk.1.ffn_up_exps.bias'\) not found"):
        load_model(resolve_model_path(bad), "float32")


def test_gpt_oss_sliding_period_from_the_file(tmp_path):
    """llama.cpp's gpt-oss reads attention.sliding_window_pattern (every p-th layer global, the others
    sliding: its set_swa_pattern) and rope.freq_base_swa; a period of 3 gives sliding, sliding, global,
    ...; a sliding layers' RoPE base of their own is refused by name."""
    hf = build_hf_model("gpt-oss", overrides={"vocab_size": 300})
    vocab = byte_level_vocab(_lines(), 300, "gpt-4o")
    path = write_gguf(hf, tmp_path / "p3.gguf", vocab, extra={"gpt-oss.attention.sliding_window_pattern": 3})
    cfg = json.loads((resolve_model_path(path) / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    path = write_gguf(hf, tmp_path / "swa.gguf", vocab, extra={"gpt-oss.rope.freq_base_swa": 10000.0})
    with pytest.raises(CheckpointError, match=r"swa.gguf: gpt-oss.rope.freq_base_swa = 10000.0"):
        resolve_model_path(path)


def test_hub_id_with_quantization_label(gguf_case, tmp_path):
    """vLLM's ORG/NAME:QUANT: the one .gguf of that label in a GGUF repository, through huggingface_hub's
    cache (laid out as it lays one out, offline, in a subprocess: huggingface_hub reads its environment
    when imported); Q8_0 is not Q8_0_L, a vision projector is not the model, two matches are named."""
    import subprocess
    import sys
    import textwrap

    from tests.fake_devices import HANG_GUARD_S
    from tests.test_hub import lay_out_hf_cache
    from jaxinfer.hub import gguf_files
    assert gguf_files(["a-Q4_K.gguf", "a-Q4_K_M.gguf", "Q4_K_M/a-Q4_K_M-00001-of-00002.gguf",
                       "mmproj-a-Q4_K_M.gguf", "a-q4_k_m.gguf"], "Q4_K_M") == [
        "Q4_K_M/a-Q4_K_M-00001-of-00002.gguf", "a-Q4_K_M.gguf", "a-q4_k_m.gguf"]
    path, _ = gguf_case("qwen2-bpe")
    repo_files = tmp_path / "files"
    repo_files.mkdir()
    shutil.copy(path, repo_files / "tiny-Q8_0.gguf")
    shutil.copy(path, repo_files / "tiny-Q8_0_L.gguf")
    shutil.copy(path, repo_files / "mmproj-tiny-Q8_0.gguf")
    shutil.copy(path, repo_files / "tiny-a-F16.gguf")
    shutil.copy(path, repo_files / "tiny-b-F16.gguf")
    home = tmp_path / "hf_home"
    lay_out_hf_cache(home, "tiny-org/tiny-GGUF", repo_files, {"main": "c" * 40})
    script = textwrap.dedent("""
        import json
        from jaxinfer.hub import ModelSpecError, is_hub_id, resolve_model_path, served_name
        out = {"folder": str(resolve_model_path("tiny-org/tiny-GGUF:q8_0")),
               "hub_id": is_hub_id("tiny-org/tiny-GGUF:Q8_0"), "served": served_name("tiny-org/tiny-GGUF:Q8_0", None)}
        for spec in ("tiny-org/tiny-GGUF:F16", "tiny-org/tiny-GGUF:Q2_K", "tiny-org/tiny-GGUF:Q8 0"):
            try:
                resolve_model_path(spec)
            except ModelSpecError as e:
                out[spec] = str(e)
        print("RESULT " + json.dumps(out))
    """)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    cfg = json.loads((Path(out["folder"]) / "config.json").read_text())
    snapshot = home / "hub" / "models--tiny-org--tiny-GGUF" / "snapshots" / ("c" * 40)
    assert cfg["gguf_file"] == str(snapshot / "tiny-Q8_0.gguf")
    assert out["hub_id"] is True and out["served"] == "tiny-org/tiny-GGUF:Q8_0"
    assert "2 models match 'F16'" in out["tiny-org/tiny-GGUF:F16"]
    assert "no .gguf file of quantization 'Q2_K'" in out["tiny-org/tiny-GGUF:Q2_K"]
    assert "not a GGUF quantization label" in out["tiny-org/tiny-GGUF:Q8 0"]


def test_tokenizer_from_another_folder(gguf_case, tmp_path):
    """vLLM's --tokenizer: the base model's tokenizer and chat template instead of the file's (here
    transformers' own save of the GGUF's tokenizer, with another template); one with more tokens
    than the model has embeddings is refused; the flag is derived from the setting."""
    from transformers import AutoTokenizer

    from jaxinfer.cli import build_parser
    path, _ = gguf_case("qwen2-bpe")
    ref_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ref_tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    ref_tok.save_pretrained(tmp_path / "base")
    gen = _gen(path, tokenizer=str(tmp_path / "base"))
    assert gen.tokenizer.chat_template == ref_tok.chat_template
    assert gen.tokenizer.encode(TEXTS[0]) == ref_tok(TEXTS[0]).input_ids
    ref_tok.add_tokens([f"<extra{i}>" for i in range(5)])
    ref_tok.save_pretrained(tmp_path / "bigger")
    with pytest.raises(ValueError, match="305 tokens, more than the model's 300 embeddings"):
        _gen(path, tokenizer=str(tmp_path / "bigger"))
    args = build_parser().parse_args(["serve", "--model", str(path), "--tokenizer", str(tmp_path / "base")])
    assert args.tokenizer == str(tmp_path / "base")


def test_packed_experts_under_ragged_dot(gguf_case):
    """Grouped int8 experts (Q8_0 stacks) through jaxinfer.moe's opt-in lax.ragged_dot path compute
    what the tile loop computes (two summation orders of the same float32 products)."""
    import jax.numpy as jnp

    from jaxinfer.moe import set_moe_impl
    from jaxinfer.quant import QuantizedWeight
    from jaxinfer.weights import load_model
    from tests.precision import assert_rel_close
    from tests.test_moe import _logits_rtol
    path, _ = gguf_case("qwen3moe")
    model, cfg = load_model(resolve_model_path(path), "float32")
    assert isinstance(model.layers[0].mlp.down.get_value(), QuantizedWeight)
    ids, pos = jnp.arange(3, 30, dtype=jnp.int32), jnp.arange(27, dtype=jnp.int32)
    tiles = np.asarray(model(ids, pos)[0])
    set_moe_impl(model, "ragged_dot")
    assert_rel_close(model(ids, pos)[0], tiles, _logits_rtol(cfg, len(ids)), "ragged_dot vs the tile loop")


def test_added_tokens_whole_and_stops(gguf_case, tmp_path):
    """llama.cpp's converter writes added tokens as raw text: a control token outside GPT-2's byte
    alphabet (DeepSeek's <｜User｜>) and a user-defined one with a space are each one token, of the id the
    file lists (transformers' GGUF tokenizer splits the first into bytes and gives the second an id
    past the embeddings); <|eot_id|> and <|end_of_text|> stop generation by their text as in llama.cpp;
    an unknown pre-tokenizer is refused."""
    from jaxinfer.tokenizer import load_tokenizer
    raw = {"<｜User｜>": 3, "<tool call>": 4, "<|eot_id|>": 3, "<|end_of_text|>": 3}
    vocab = byte_level_vocab(_lines(), 300, "qwen2", raw=raw)
    hf = build_hf_model("qwen2-tied", overrides={"vocab_size": 300})
    path = write_gguf(hf, tmp_path / "added.gguf", vocab)
    folder = resolve_model_path(path)
    tok = load_tokenizer(folder)
    ids = {t: vocab["tokens"].index(t) for t in raw}
    assert tok.encode("<｜User｜>the dog<tool call>x", add_special_tokens=False)[:1] == [ids["<｜User｜>"]]
    assert ids["<tool call>"] in tok.encode("the dog<tool call>x") and tok.vocab_size == 300
    assert set(tok.eos_ids) == {0, 2, ids["<|eot_id|>"], ids["<|end_of_text|>"]}
    gen = _gen(path)
    out = gen.generate([tok.encode("the dog")], SamplingParams(max_tokens=6, temperature=0.0,
                                                               logit_bias={ids["<|eot_id|>"]: 100.0}))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) <= 1
    vocab["pre"] = "no-such-pre"
    bad = write_gguf(hf, tmp_path / "bad-pre.gguf", vocab)
    with pytest.raises(CheckpointError, match="tokenizer.ggml.pre = 'no-such-pre'"):
        resolve_model_path(bad)


def test_no_space_prefix_round_trip(tmp_path):
    """tokenizer.ggml.add_space_prefix false: no U+2581 prepended, and none stripped when decoding
    (llama.cpp's rule): a text with a leading space comes back as it was."""
    from transformers import AutoModelForCausalLM

    from jaxinfer.tokenizer import load_tokenizer
    text = save_text_model(tmp_path / "spm")
    hf = AutoModelForCausalLM.from_pretrained(text).eval()
    path = write_gguf(hf, tmp_path / "noprefix.gguf", sentencepiece_vocab(text / "tokenizer.model"), space_prefix=False)
    tok = load_tokenizer(resolve_model_path(path))
    for s in (" the lazy dog", "the lazy dog"):
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


def test_quantize_flag_requantizes_every_weight(gguf_case):
    """quantize="int8" on a file with packed blocks (Q8_0 down, Q4_0 o) reads them as floats and
    quantizes every matmul weight alike (per-channel int8), as for any float checkpoint."""
    from flax import nnx

    from jaxinfer.quant import QuantizedWeight
    path, _ = gguf_case("qwen2-bpe")
    gen = _gen(path, quantize="int8")
    weights = [v.get_value() for p, v in nnx.state(gen.engine._model, nnx.Param).flat_state()
               if str(p[-1]) in ("qkv", "o", "gate_up", "down")]
    assert weights and all(isinstance(w, QuantizedWeight) and w.bits == 8 and w.group_size is None for w in weights)


def test_hub_fetches_only_the_chosen_file(monkeypatch, tmp_path, gguf_case):
    """Online, ORG/NAME:QUANT lists the repository first and fetches only the chosen file's parts
    (huggingface_hub's own filter applied to the patterns passed to snapshot_download)."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects
    path, _ = gguf_case("qwen2-bpe")
    listing = ["README.md", "Qwen3-8B-BF16.gguf", "Qwen3-8B-F16.gguf", "mmproj-F16.gguf", "Qwen3-8B-Q4_K_M.gguf",
               "Q8_0/Qwen3-8B-Q8_0-00001-of-00002.gguf", "Q8_0/Qwen3-8B-Q8_0-00002-of-00002.gguf",
               "Qwen3-8B-Q8_0_L.gguf"]
    calls = []

    def snapshot(repo_id, revision=None, allow_patterns=None, ignore_patterns=None, **kw):
        calls.append(allow_patterns)
        root = tmp_path / "snap"
        for name in filter_repo_objects(listing, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, root / name)
        return str(root)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo_id, revision=None: listing)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    resolve_model_path("org/Qwen3-8B-GGUF:F16")
    assert set(filter_repo_objects(listing, allow_patterns=calls[-1])) == {"Qwen3-8B-F16.gguf"}
    resolve_model_path("org/Qwen3-8B-GGUF:Q8_0")   # (each part here is a whole file: only names matter)
    assert set(filter_repo_objects(listing, allow_patterns=calls[-1])) == {
        "Q8_0/Qwen3-8B-Q8_0-00001-of-00002.gguf", "Q8_0/Qwen3-8B-Q8_0-00002-of-00002.gguf"}


def test_hub_unreachable_falls_back_to_the_cache(monkeypatch, tmp_path, gguf_case):
    """The Hub unreachable (no HF_HUB_OFFLINE): the listing comes from the cache's snapshot, as
    snapshot_download falls back to the cache; a repository the Hub answers for is still named."""
    import huggingface_hub
    path, _ = gguf_case("qwen2-bpe")
    (tmp_path / "snap").mkdir()
    shutil.copy(path, tmp_path / "snap" / "tiny-Q8_0.gguf")

    def unreachable(self, repo_id, revision=None):
        raise ConnectionError("[Errno 111] Connection refused")
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", unreachable)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: str(tmp_path / "snap"))
    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    folder = resolve_model_path("org/tiny-GGUF:Q8_0")
    assert json.loads((folder / "config.json").read_text())["gguf_file"] == str(tmp_path / "snap" / "tiny-Q8_0.gguf")


def test_whole_words_and_space_prefix_after_special_tokens(tmp_path):
    """llama.cpp's rules the transformers GGUF tokenizer does not follow: Llama 3's and tekken's
    vocabularies take a piece that is a whole vocabulary word before merging (ignore_merges; Qwen2's
    do not), and a SentencePiece vocabulary prefixes a space to the text after a control token, so
    "</s>the dog" is </s> followed by what sentencepiece makes of "the dog"."""
    import sentencepiece as spm
    from transformers import AutoModelForCausalLM

    from jaxinfer.tokenizer import load_tokenizer
    hf = build_hf_model("qwen2-tied", overrides={"vocab_size": 301})
    for pre, whole in (("llama-bpe", True), ("tekken", True), ("qwen2", False)):
        vocab = byte_level_vocab(_lines(), 300, pre)
        vocab["tokens"].append("Ġqzxv")     # a word no merge reaches
        vocab["types"].append(1)
        tok = load_tokenizer(resolve_model_path(write_gguf(hf, tmp_path / f"{pre}.gguf", vocab, add_bos=None)))
        ids = tok.encode("a qzxv", add_special_tokens=False)
        assert (ids[-1] == 300) == whole and (len(ids) == 2) == whole, (pre, ids)
        assert tok.add_bos == whole      # no add_bos_token in the file: llama.cpp's default for the name
    text = save_text_model(tmp_path / "spm")
    sp = spm.SentencePieceProcessor(model_file=str(text / "tokenizer.model"))
    spm_model = AutoModelForCausalLM.from_pretrained(text).eval()
    tok = load_tokenizer(resolve_model_path(write_gguf(spm_model, tmp_path / "spm.gguf",
                                                       sentencepiece_vocab(text / "tokenizer.model"))))
    assert tok.encode("</s>the dog", add_special_tokens=False) == [sp.eos_id()] + sp.encode("the dog")
    assert tok.encode("the dog", add_special_tokens=False) == sp.encode("the dog")


def test_sentencepiece_space_prefix_as_llama_cpp(tmp_path):
    """llama.cpp's SentencePiece (llm_tokenizer_spm_session: " " + the text at the start and after each
    special or added token, spaces kept as they are) against sentencepiece itself, trained to keep
    whitespace (identity normalization, remove_extra_whitespaces off): leading and repeated spaces
    included. A Phi-3 (llama.cpp tells it by general.name) also drops the whitespace after its added
    tokens but <s>, <unk> and <|endoftext|> (llama.cpp's RSTRIP attributes, as Phi-3's tokenizer.json)."""
    import io

    import sentencepiece as spm

    from jaxinfer.tokenizer import load_tokenizer
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_lines()), model_writer=model, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2,
                                   unk_id=0, pad_id=3, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    vocab = sentencepiece_vocab(tmp_path / "tokenizer.model")
    for added in ("<|user|>", "<|end|>", "<|endoftext|>"):   # Phi-3's, written as its converter does
        vocab["tokens"].append(added)
        vocab["scores"].append(-1000.0)
        vocab["types"].append(CONTROL)
    hf = build_hf_model("llama-gqa-llama3", overrides={"vocab_size": 403})
    tok = load_tokenizer(resolve_model_path(write_gguf(hf, tmp_path / "spm.gguf", vocab)))
    for text in (" hello", "  the  lazy dog ", "the quick brown fox", "\tzebras\n write"):
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    user, end, eot = 400, 401, 402
    assert tok.encode("</s> the dog<|user|>hi", add_special_tokens=False) == (
        [sp.eos_id()] + sp.encode(" the dog") + [user] + sp.encode("hi"))
    phi3 = load_tokenizer(resolve_model_path(write_gguf(hf, tmp_path / "phi3.gguf", vocab, name="Phi-3 Mini")))
    assert phi3.encode("<|user|>  hi \n<|end|>\n<|endoftext|> x</s> y", add_special_tokens=False) == (
        [user] + sp.encode("hi \n") + [end, eot] + sp.encode(" x") + [sp.eos_id()] + sp.encode("y"))


def test_k_quant_flat_group_and_native_round_trip(gguf_case, tmp_path):
    """A Q4_K group whose 6-bit scale is 0 is the constant -dmin * m: held exactly (code 0, zero point 1,
    the offset as its scale); a block whose scale is not finite is refused naming the tensor; float
    zero points survive a native checkpoint's save and restore; the
    Pallas int4 kernel (interpreted here) multiplies by them within float32's bound of the exact
    product of the gguf package's values."""
    from types import SimpleNamespace

    import gguf
    import jax.numpy as jnp

    from jaxinfer.prequant.common import QuantConfigError
    from jaxinfer.prequant.gguf_blocks import _weight
    from jaxinfer.quant import dequantize
    from jaxinfer.weights import load_model, save_native
    from jaxinfer.quant import qdot
    from tests.gguf_files import random_blocks
    q4k = gguf.GGMLQuantizationType.Q4_K
    raw = random_blocks((2, 256), q4k, np.random.default_rng(1))
    raw[0, 4] &= 0xC0            # group 0 of row 0: scale 0 (low 6 bits of byte 4) ...
    raw[0, 8] |= 1               # ... and an offset (low 6 bits of byte 8)
    w = gguf.quants.dequantize(raw, q4k)
    assert np.all(w[0, :32] == w[0, 0]) and w[0, 0] != 0      # the flat group, as the gguf package reads it
    qw = _weight(SimpleNamespace(tensor_type=q4k, name="t"), raw, lambda x: x)
    got = np.asarray(dequantize(qw)).T
    assert np.array_equal(got[0, :32], w[0, :32])
    assert np.abs(got - w).max() <= 8 * np.finfo(np.float32).eps * 2 * np.abs(w).max()
    x = np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32)
    y = np.asarray(qdot(jnp.asarray(x), qw, impl="pallas", blocks={"block_m": 16, "block_n": 2, "block_k": 64},
                        interpret=True), np.float64)
    w64 = w.T.astype(np.float64)                               # [K, N], the gguf package's values
    # (q - z) * s: two float32 roundings a weight and its difference from w (<= 8 ulp of 2 max|w|,
    # checked above), then K float32 products and sums (tests/test_quant.dot_error_bound's analysis)
    gamma = (256 + 3) * 2.0 ** -24 / (1 - (256 + 3) * 2.0 ** -24)
    bound = gamma * (np.abs(x) @ np.abs(w64)) + 8 * np.finfo(np.float32).eps * 2 * np.abs(w).max() * np.abs(x).sum(1)[:, None]
    assert np.all(np.abs(y - x.astype(np.float64) @ w64) <= bound)
    damaged = raw.copy()
    damaged[1, 0:2] = np.frombuffer(b"\x00\x7c", np.uint8)   # row 1's first d: float16 infinity
    with pytest.raises(QuantConfigError, match="GGUF tensor 't' .Q4_K.: a block's scale is not finite"):
        _weight(SimpleNamespace(tensor_type=q4k, name="t"), damaged, lambda x: x)
    path, _ = gguf_case("llama-q4km")
    model, _ = load_model(resolve_model_path(path), "float32")
    save_native(model, tmp_path / "native", "float32")
    again, _ = load_model(tmp_path / "native", "float32")
    before, after = model.layers[0].attn.q.get_value(), again.layers[0].attn.q.get_value()
    assert before.float_zeros and after.float_zeros
    assert np.array_equal(np.asarray(dequantize(before)), np.asarray(dequantize(after)))
