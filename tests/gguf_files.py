"""GGUF files of tiny random HF models, written as llama.cpp's convert_hf_to_gguf.py writes them.

Written with the `gguf` package (llama.cpp's own Python writer and quantizers): the architecture's
metadata, llama.cpp's tensor names (gguf.TensorNameMap), Llama's Q and K rows permuted into
llama.cpp's rotary layout (LlamaModel.permute in convert_hf_to_gguf.py; Qwen's are not), the
tokenizer as metadata (a SentencePiece vocabulary with scores and token types, or a byte-level
BPE's tokens and merges with its pre-tokenizer's name), and each tensor in the type the test asks
(F32, F16, BF16, or llama.cpp's block quantizations: the gguf package's quantizers).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# the architectures whose converters store Q / K rows permuted into llama.cpp's rotary layout
_PERMUTED = ("llama", "smollm3", "granite", "arcee", "internlm2", "granitehybrid", "nemotron_h", "nemotron_h_moe",
             "granitemoe")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout: each head's rows in (half, pair) order -> (pair, half) order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def sentencepiece_vocab(model_file: Path) -> dict:
    """tokenizer.ggml.* of a SentencePiece model, as convert_hf_to_gguf.py's _create_vocab_sentencepiece
    reads one: every piece, its score, its type."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else BYTE if sp.is_byte(i)
                     else UNUSED if sp.is_unused(i) else NORMAL)
    return {"model": "llama", "pre": "default", "tokens": tokens, "scores": scores, "types": types,
            "bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id(), "pad": sp.pad_id()}


def byte_level_vocab(lines, vocab_size: int, pre: str, raw: dict[str, int] | None = None) -> dict:
    """A byte-level BPE trained here (the tokenizers library) on `lines`, as a "gpt2" GGUF vocabulary:
    specials <|endoftext|> (BOS/EOS), <|im_start|>, <|im_end|> (control) and <think> (user-defined);
    raw: more added tokens {text: type}, written as raw text as llama.cpp's converter writes them."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", *(raw or {})]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    model = json.loads(tok.to_str())["model"]
    tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [(raw or {}).get(t) or (USER_DEFINED if t == "<think>" else CONTROL if t in specials else NORMAL)
             for t in tokens]
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "merges": merges, "types": types,
            "bos": 0, "eos": 0, "unk": None, "pad": None}


# byte offsets of each K-quant block's float16 scales (d, dmin), from ggml-common.h's block layouts
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
             "IQ4_XS": (0,)}


def random_blocks(shape: tuple[int, ...], qtype, rng) -> np.ndarray:
    """Random llama.cpp blocks of a K-quant or IQ4 type for a float tensor of `shape` (rows of a multiple
    of 256): random bits, each block's float16 scales set to small finite values."""
    import gguf
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    b = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    # the IQ4 types' codes are int8 table values up to 127 (IQ4_XS's also times a 6-bit scale - 32)
    low = {"IQ4_NL": 0.0002, "IQ4_XS": 0.00002}.get(qtype.name, 0.0005)
    for off in _K_SCALES[qtype.name]:
        scale = rng.uniform(low, 4 * low, b.shape[:2]).astype(np.float16)
        b[:, :, off:off + 2] = scale.view(np.uint8).reshape(*b.shape[:2], 2)
    if qtype.name in ("Q4_K", "Q5_K"):   # every 6-bit sub-scale >= 1 (its low bit set in bytes 4-7, 12-15)
        b[:, :, 4:8] |= 1
        b[:, :, 12:16] |= 1
    return b.reshape(*shape[:-1], -1)


def _add(w, name: str, x: np.ndarray, qtype: str, rng) -> None:
    import gguf
    if qtype == "F32":
        w.add_tensor(name, x.astype(np.float32))
    elif qtype == "F16":
        w.add_tensor(name, x.astype(np.float16))
    elif qtype.startswith("random:"):   # a K-quant (no quantizer in the gguf package): random blocks
        gt = gguf.GGMLQuantizationType[qtype[len("random:"):]]
        w.add_tensor(name, random_blocks(x.shape, gt, rng), raw_dtype=gt)
    else:
        gt = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, gguf.quants.quantize(x, gt), raw_dtype=gt)


def mxfp4_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OCP MXFP4 as gpt-oss ships it (blocks uint8 [..., K/32, 16], value 2j in byte j's low nibble;
    scales uint8 [..., K/32]) -> ggml's block_mxfp4 bytes [..., K/32 * 17] (the exponent byte, then
    values 0-15 in the low nibbles and 16-31 in the high ones), as convert_hf_to_gguf.py's
    GptOssModel.repack_mxfp4 writes them."""
    codes = np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    out = np.concatenate([scales[..., None], qs], axis=-1)
    return np.ascontiguousarray(out.reshape(*out.shape[:-2], -1))


def _layernorm_family_hparams(w, cfg, arch: str, head_dim: int) -> None:
    """Phi2Model's, GPTNeoXModel's and StableLMModel's set_gguf_parameters, which write only these keys
    (no RoPE base: llama.cpp's 10 000): the context, widths (Phi-2's MLP as 4 x its width), heads,
    the rotated features of a head, the LayerNorm's epsilon, GPT-NeoX's and StableLM's
    use_parallel_residual, Phi-2's add_bos_token false."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(4 * cfg.hidden_size if arch == "phi2" else cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    if arch != "gptneox":   # (Phi2Model writes n_head)
        w.add_head_count_kv(cfg.num_attention_heads if arch == "phi2" else cfg.num_key_value_heads)
    w.add_rope_dimension_count(int(cfg.rope_parameters["partial_rotary_factor"] * head_dim))
    if arch != "phi2":
        w.add_parallel_residual(cfg.use_parallel_residual)
    w.add_layer_norm_eps(cfg.layer_norm_eps)


def _hparams(w, cfg, arch: str, head_dim: int, nextn: int = 0, mla: bool = True) -> None:
    """The architecture's metadata, as convert_hf_to_gguf.py's model classes write it (nextn: blocks
    appended past the model's, counted in block_count as Glm4MoeModel counts them; mla: DeepSeek's
    latent form, today's converter, else an older one's file)."""
    import gguf
    if arch in ("phi2", "gptneox", "stablelm"):
        return _layernorm_family_hparams(w, cfg, arch, head_dim)
    if arch == "lfm2":
        return _lfm2_hparams(w, cfg, head_dim)
    if arch == "granitehybrid":
        return _granitehybrid_hparams(w, cfg)
    if arch in ("nemotron_h", "nemotron_h_moe"):
        return _nemotron_h_hparams(w, cfg, nextn)
    if arch == "starcoder":   # StarCoderModel.set_gguf_parameters: these keys only, the MLP as 4 x the width
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(cfg.n_embd)
        w.add_feed_forward_length(4 * cfg.n_embd)
        w.add_block_count(cfg.n_layer)
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(1)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
        return
    gemma = arch.startswith("gemma")
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)   # Gemma 3: the global layers'
    w.add_block_count(cfg.num_hidden_layers + nextn)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if cfg.to_dict().get("intermediate_size") is not None:   # TextModel: only when the config has it (not Qwen3.5-MoE)
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1 if arch == "deepseek2" and mla else cfg.num_key_value_heads)   # DeepSeek: latent form as MQA
    if arch != "gemma":   # GemmaModel.set_gguf_parameters writes no RoPE base (llama.cpp's 10 000)
        w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    if rope.get("rope_type") == "yarn":   # TextModel.set_gguf_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast), ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(float(rope[key]))
    if gemma and arch != "gemma":   # Gemma2Model / Gemma3Model.set_gguf_parameters: the window and caps
        w.add_sliding_window(cfg.sliding_window)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gpt-oss":   # GptOssModel.set_gguf_parameters
        w.add_sliding_window(cfg.sliding_window)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
    if arch in ("granite", "granitemoe"):
        _granite_scales(w, cfg)
    if arch == "exaone4" and cfg.sliding_window is not None:   # Exaone4Model: the window, layer_types as bools
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch == "granitemoe" and getattr(cfg, "shared_intermediate_size", 0):   # GraniteMoeModel.set_gguf_parameters
        w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    if arch == "phi3":   # Phi3MiniModel.set_gguf_parameters: 0 for no window, the original context
        w.add_sliding_window(cfg.sliding_window or 0)
        original = rope.get("original_max_position_embeddings", getattr(cfg, "original_max_position_embeddings", None))
        w.add_rope_scaling_orig_ctx_len(original or cfg.max_position_embeddings)
    if arch == "starcoder2":   # TextModel.set_gguf_parameters: norm_epsilon as the LayerNorm's
        w.add_layer_norm_eps(cfg.norm_epsilon)
    elif arch in ("command-r", "cohere2"):   # CommandR2Model / Cohere2Model: layer_norm_eps, logit_scale
        w.add_layer_norm_eps(cfg.layer_norm_eps)
        w.add_logit_scale(cfg.logit_scale)
        if arch == "cohere2":
            w.add_sliding_window(cfg.sliding_window)
    else:   # (OlmoeModel writes 1e-5 whatever the config says)
        w.add_layer_norm_rms_eps(1e-5 if arch == "olmoe" else cfg.rms_norm_eps)
    if arch == "deepseek2":   # DeepseekV2Model.set_gguf_parameters: the latent form as MQA (its own widths apart)
        _deepseek2_hparams(w, cfg, rope, mla)
        w.add_vocab_size(cfg.vocab_size)
        return
    deltanet = arch in ("qwen3next", "qwen35", "qwen35moe")
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25 if deltanet else 1.0)))
    if deltanet:   # Qwen3NextModel.set_gguf_parameters (Qwen3.5's: and its M-RoPE sections, _Qwen35MRopeMixin)
        w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        w.add_ssm_state_size(cfg.linear_key_head_dim)
        w.add_ssm_group_count(cfg.linear_num_key_heads)
        w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
        w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        # the converter writes config.json's full_attention_interval (else 4); transformers saves layer_types
        # instead, which llama.cpp cannot read: the interval they follow
        every = cfg.layer_types.index("full_attention") + 1
        assert cfg.layer_types == ["linear_attention" if (i + 1) % every else "full_attention"
                                   for i in range(cfg.num_hidden_layers)]
        w.add_full_attention_interval(every)
        if arch != "qwen3next":
            w.add_rope_dimension_sections([11, 11, 10, 0])
    if gemma or arch == "gpt-oss" or head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)


def _granite_scales(w, cfg) -> None:
    """GraniteModel.set_gguf_parameters: each multiplier only when not 0."""
    for value, add in ((cfg.attention_multiplier, w.add_attention_scale), (cfg.embedding_multiplier, w.add_embedding_scale),
                       (cfg.residual_multiplier, w.add_residual_scale), (cfg.logits_scaling, w.add_logit_scale)):
        if value:
            add(value)


def _ssm_sizes(w, taps: int, state: int, groups: int, heads: int, inner: int) -> None:
    """Mamba2Model's ssm.* keys (time_step_rank: the heads; inner_size: heads x their width)."""
    w.add_ssm_conv_kernel(taps)
    w.add_ssm_state_size(state)
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(heads)


def _granitehybrid_hparams(w, cfg) -> None:
    """GraniteHybridModel.set_gguf_parameters: GraniteMoeModel's (TextModel's keys, Granite's scales, the
    shared MLP's width), the Mamba-2 sizes in ssm.* (time_step_rank: the heads), head_count_kv per layer
    (0 on a Mamba-2 layer), rope.scaling.finetuned false and a context of 2^20 for a hybrid (no RoPE)."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _granite_scales(w, cfg)
    w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    _ssm_sizes(w, cfg.mamba_d_conv, cfg.mamba_d_state, cfg.mamba_n_groups, cfg.mamba_n_heads,
               cfg.mamba_expand * cfg.hidden_size)
    w.add_head_count_kv([cfg.num_key_value_heads if t in ("attention", "full_attention") else 0
                         for t in cfg.layer_types])
    w.add_rope_scaling_finetuned(False)
    w.add_context_length(2 ** 20)
    w.add_vocab_size(cfg.vocab_size)


def _granitehybrid_tensor(w, cfg, hf_name: str, x: np.ndarray, qtype: str, rng):
    """GraniteHybridModel.modify_tensors, Mamba2Model's part: the taps squeezed to [C, L], dt_bias as
    ssm_dt.bias, A_log as -exp(A_log) [H, 1], D as [H, 1], the gated norm as [groups, I / groups];
    GraniteMoeModel's: the shared MLP's input_linear split into gate and up (_shexp beside experts,
    else the dense ffn_gate / ffn_up, its output_linear ffn_down); the router under transformers'
    on-disk name. -> (the name to map, x), or (None, None) when written here."""
    layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
    if ".shared_mlp." in hf_name:
        suffix = "_shexp" if cfg.num_local_experts else ""
        if "input_linear" in hf_name:
            half = x.shape[0] // 2
            for part, value in (("gate", x[:half]), ("up", x[half:])):
                _add(w, f"blk.{layer}.ffn_{part}{suffix}.weight", np.ascontiguousarray(value), qtype, rng)
        else:
            _add(w, f"blk.{layer}.ffn_down{suffix}.weight", x, qtype, rng)
        return None, None
    if hf_name.endswith(".block_sparse_moe.router.weight"):
        return hf_name.replace(".router.weight", ".router.layer.weight"), x
    if ".mamba." not in hf_name:
        return hf_name, x
    return _mamba2_tensor(cfg.mamba_n_groups, hf_name, x)


def _mamba2_tensor(groups: int, hf_name: str, x: np.ndarray) -> tuple[str, np.ndarray]:
    """Mamba2Model.modify_tensors on one of a Mamba-2 mixer's tensors: the taps squeezed to [C, L],
    dt_bias as dt_proj.bias (ssm_dt.bias), A_log as -exp(A_log) [H, 1], D as [H, 1], the gated norm
    as [groups, I / groups]."""
    if hf_name.endswith("conv1d.weight"):
        x = x[:, 0, :]
    elif hf_name.endswith(".dt_bias"):
        hf_name = hf_name[:-len("dt_bias")] + "dt_proj.bias"
    elif hf_name.endswith(".A_log"):
        x = -np.exp(x).reshape(-1, 1)
    elif hf_name.endswith(".D"):
        x = x.reshape(-1, 1)
    elif hf_name.endswith(".norm.weight"):
        x = x.reshape(groups, -1)
    return hf_name, np.ascontiguousarray(x)


def _nemotron_h_hparams(w, cfg, nextn: int = 0) -> None:
    """NemotronHModel.set_gguf_parameters (over GraniteHybridModel's): head_count_kv per layer (0 but on
    attention layers), feed_forward_length per layer (0 but on MLP layers; with experts, nemotron_h_moe:
    the experts' width on the mixtures' layers, 0 elsewhere), key / value length the attention's
    head_dim, the Mamba-2 sizes in ssm.* (inner_size: heads x head dim), no RoPE; with experts their
    expert_* keys (no expert_group_used_count), and nextn next-token-prediction blocks appended (an
    attention and a mixture each, in both lists and block_count)."""
    types = list(cfg.layers_block_type)
    moe = "moe" in types
    types += ["mtp"] * nextn
    w.add_block_count(len(types))
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length([cfg.moe_intermediate_size if moe and t in ("moe", "mtp") else
                               cfg.intermediate_size if not moe and t == "mlp" else 0 for t in types])
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if t in ("full_attention", "mtp") else 0 for t in types])
    if moe:
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.moe_shared_expert_intermediate_size)
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_group_count(cfg.n_group)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    _ssm_sizes(w, cfg.conv_kernel, cfg.ssm_state_size, cfg.n_groups, cfg.mamba_num_heads,
               cfg.mamba_num_heads * cfg.mamba_head_dim)
    w.add_rope_scaling_finetuned(False)
    w.add_context_length(2 ** 20)
    w.add_vocab_size(cfg.vocab_size)


def _lfm2_hparams(w, cfg, head_dim: int) -> None:
    """LFM2Model.set_gguf_parameters: num_key_value_heads per layer (0 on the conv layers), TextModel's
    keys, the vocabulary size, the conv layers' taps, norm_eps as the RMS epsilon and the MLP's width
    as Lfm2MLP computes it (_add_feed_forward_length)."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if t != "conv" else 0 for t in cfg.layer_types])
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    ff = cfg.intermediate_size
    if cfg.block_auto_adjust_ff_dim:
        ff = int(2 * ff / 3)
        if cfg.block_ffn_dim_multiplier is not None:
            ff = int(cfg.block_ffn_dim_multiplier * ff)
        ff = cfg.block_multiple_of * ((ff + cfg.block_multiple_of - 1) // cfg.block_multiple_of)
    w.add_feed_forward_length(ff)


def _deepseek2_hparams(w, cfg, rope: dict, mla: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters: one KV head of latent + RoPE features (key_length) and the
    latent (value_length), the heads' own widths as key_length_mla / value_length_mla, the ranks, and
    YaRN's softmax magnitude as yarn_log_multiplier = 0.1 * mscale_all_dim; an older converter's file
    (mla False): the heads' widths as key_length / value_length, no *_mla keys."""
    r, nope, rot = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(r)
    if mla:
        w.add_key_length(r + rot)
        w.add_value_length(r)
        w.add_key_length_mla(nope + rot)
        w.add_value_length_mla(cfg.v_head_dim)
    else:
        w.add_key_length(nope + rot)
        w.add_value_length(cfg.v_head_dim)
    w.add_rope_dimension_count(rot)
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _moe_hparams(w, cfg, arch: str, nextn: int) -> None:
    """The mixtures' metadata: Qwen3MoeModel / Qwen2MoeModel (the experts' and the shared expert's
    widths), Glm4MoeModel and DeepseekV2Model (TextModel's group counts and sigmoid gating, leading
    dense layers, shared experts, the routed scale, the renormalization where set)."""
    import gguf
    if nextn:
        w.add_nextn_predict_layers(nextn)
    if arch == "ernie4_5-moe":   # Ernie4_5MoeModel.set_gguf_parameters (the shared width as it computes it)
        w.add_expert_count(cfg.moe_num_experts)
        w.add_expert_used_count(cfg.moe_k)
        w.add_interleave_moe_layer_step(cfg.moe_layer_interval)
        w.add_leading_dense_block_count(cfg.moe_layer_start_index)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.moe_num_shared_experts)
        if cfg.moe_num_shared_experts > 0:
            w.add_expert_shared_feed_forward_length(cfg.intermediate_size // cfg.num_key_value_heads)
        return
    experts = getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if not experts:
        return
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen3moe", "qwen2moe", "glm4moe", "deepseek2", "qwen3next", "qwen35moe"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "minimax-m2":   # MiniMaxM2Model: the experts' width; TextModel: scoring_func sigmoid
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if arch in ("qwen2moe", "qwen3next", "qwen35moe"):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch in ("glm4moe", "deepseek2"):
        w.add_expert_group_count(cfg.n_group or 1)
        w.add_expert_group_used_count(cfg.topk_group or 1)
        # TextModel's scoring_func: DeepSeek-V2's softmax (transformers' V2 config has no such field)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX if cfg.model_type == "deepseek_v2"
                                 else gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        if arch == "glm4moe" or cfg.norm_topk_prob:   # DeepseekV2Model writes it only when true
            w.add_expert_weights_norm(cfg.norm_topk_prob)


def _tiled(x: np.ndarray, axis: int, hk: int, r: int, width: int) -> np.ndarray:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped per key head [Hk, r, width]
    along `axis` -> tiled [r, Hk, width]."""
    shape = x.shape
    x = x.reshape(*shape[:axis], hk, r, width, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(x, axis, axis + 1).reshape(shape))


def _deltanet_tensor(w, cfg, arch: str, hf_name: str, x: np.ndarray, qtype: str, rng, split_qkvz: bool = True):
    """Qwen3NextModel.modify_tensors (and, for qwen35 / qwen35moe, _LinearAttentionVReorderBase's):
    every norm weight but the Gated DeltaNet's as 1 + w, A_log as -exp(A_log), dt_bias renamed
    dt_proj.bias, the taps squeezed; Qwen3-Next's in_proj_qkvz split into attn_qkv (every key head's
    q, then k, then v) and attn_gate (z), written here (-> None); Qwen3.5's value heads tiled where there
    are more than key heads. -> (the name to map, the tensor)."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        x = x + 1.0
    elif hf_name.endswith(".A_log"):
        x = -np.exp(x)
    elif hf_name.endswith(".dt_bias"):
        hf_name = hf_name[:-len("dt_bias")] + "dt_proj.bias"
    elif ".conv1d." in hf_name:
        x = x[:, 0, :]
    if hf_name.endswith("in_proj_qkvz.weight") and split_qkvz:
        g = x.reshape(hk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = (g[:, a:b].reshape(-1, g.shape[-1]) for a, b in (
            (0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + r * dv), (2 * dk + r * dv, 2 * dk + 2 * r * dv)))
        layer = hf_name.split(".")[2]
        _add(w, f"blk.{layer}.attn_qkv.weight", np.ascontiguousarray(np.concatenate([q, k, v])), qtype, rng)
        _add(w, f"blk.{layer}.attn_gate.weight", np.ascontiguousarray(z), qtype, rng)
        return None, x
    if arch != "qwen3next" and r > 1 and ".linear_attn." in hf_name:
        if ".in_proj_qkv." in hf_name or ".conv1d." in hf_name:
            x = np.concatenate([x[:2 * hk * dk], _tiled(x[2 * hk * dk:], 0, hk, r, dv)])
        elif ".in_proj_z." in hf_name:
            x = _tiled(x, 0, hk, r, dv)
        elif any(p in hf_name for p in (".in_proj_a.", ".in_proj_b.", ".A_log", ".dt_proj.")):
            x = _tiled(x, 0, hk, r, 1)
        elif ".out_proj." in hf_name:
            x = _tiled(x, 1, hk, r, dv)
    return hf_name, x


def _nextn_block(w, cfg, layer: int, rng) -> None:
    """A next-token-prediction block as Glm4MoeModel appends it (blk.N past the model's layers: its
    projection, norms and an attention of its own): llama.cpp loads and never runs it in the main model."""
    d = cfg.hidden_size
    for name, shape in (("nextn.eh_proj.weight", (d, 2 * d)), ("nextn.enorm.weight", (d,)), ("nextn.hnorm.weight", (d,)),
                        ("nextn.shared_head_norm.weight", (d,)), ("attn_norm.weight", (d,)),
                        ("attn_q.weight", (d, d))):
        w.add_tensor(f"blk.{layer}.{name}", rng.standard_normal(shape).astype(np.float32))


def _phi3_rope_factors(w, cfg, head_dim: int, attn_factor: float | None) -> None:
    """Phi3MiniModel.generate_extra_tensors: LongRoPE's factors as tensors, the attention factor recomputed
    (attn_factor: another value, as a file converted otherwise may carry)."""
    import math
    rope = cfg.rope_parameters
    if not rope.get("long_factor"):
        return
    original = rope.get("original_max_position_embeddings", getattr(cfg, "original_max_position_embeddings", None))
    scale = cfg.max_position_embeddings / original
    if attn_factor is None:
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    w.add_rope_scaling_attn_factors(attn_factor)
    w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))


def _gpt_oss_experts(w, hf_name: str, x: np.ndarray, qtype: str, rng, mxfp4: dict | None, fuse: bool) -> None:
    """gpt-oss's experts (transformers: gate_up_proj [E, D, 2F] with gate's and up's columns
    interleaved, down_proj [E, F, D], their biases) as GptOssModel writes them: ffn_gate_exps /
    ffn_up_exps [E, F, D] (fuse: one ffn_gate_up_exps [E, 2F, D], gate's rows first, as its
    fuse_gate_up_exps option writes), ffn_down_exps [E, D, F] and .bias tensors; MXFP4 from the
    checkpoint's own blocks (mxfp4: {HF name: (blocks, scales)}) when given."""
    import gguf
    layer, base = hf_name.split(".")[2], hf_name.rsplit(".", 1)[-1]
    bias = base.endswith("_bias")
    rows = {"gate": slice(0, None, 2), "up": slice(1, None, 2)} if base.startswith("gate_up") else {"down": slice(None)}
    if mxfp4 is not None and not bias:   # the checkpoint's rows: gate's even, up's odd
        blocks, scales = mxfp4[hf_name]
        parts = {p: mxfp4_ggml(blocks[:, j], scales[:, j]) for p, j in rows.items()}
    else:
        parts = {p: x[..., j] if bias else x[..., j].transpose(0, 2, 1) for p, j in rows.items()}
    if fuse and len(parts) == 2:
        parts = {"gate_up": np.concatenate([parts["gate"], parts["up"]], axis=1 if not bias else -1)}
    for part, value in parts.items():
        name = f"blk.{layer}.ffn_{part}_exps.{'bias' if bias else 'weight'}"
        if mxfp4 is not None and not bias:
            w.add_tensor(name, value, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            _add(w, name, np.ascontiguousarray(value), "F32" if bias else qtype, rng)


def _split_kv_b(w, cfg, hf_name: str, x: np.ndarray, qtype: str, rng) -> None:
    """DeepseekV2Model.modify_tensors: kv_b_proj [H (nope + v), r] as attn_k_b [H, r, nope] (each head's
    key rows transposed) and attn_v_b [H, v, r]."""
    h, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    kv = x.reshape(h, nope + v, x.shape[-1])
    layer = hf_name.split(".")[2]
    _add(w, f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1)), qtype, rng)
    _add(w, f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv[:, nope:]), qtype, rng)


def write_gguf(model, path: Path, vocab: dict, qtypes: dict[str, str] | None = None, *,
               add_bos: bool | None = True, chat_template: str | None = CHAT_TEMPLATE,
               rope_freqs: np.ndarray | None = None, space_prefix: bool | None = None,
               mxfp4: dict | None = None, name: str | None = None, fuse_gate_up: bool = False,
               attn_factor: float | None = None, extra: dict | None = None, nextn: int = 0,
               split_kv_b: bool = True, fuse_qkv: bool = False, arch: str | None = None,
               split_qkvz: bool = True) -> Path:
    """`model` (a transformers Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE / Gemma 2 / Gemma 3
    / Phi-3 / gpt-oss causal LM) as a GGUF at `path` (experts stacked per layer, Gemma's norms as 1 + w,
    as llama.cpp's converter writes them).
    qtypes: {substring of an HF tensor name: GGML type name} (the first that matches; F32 otherwise);
    rope_freqs: Llama 3's rope_freqs.weight (llama.cpp's frequency divisors), when given;
    mxfp4: gpt-oss's experts' MXFP4 blocks and scales by HF name (tests/prequant_models.mxfp4_pack);
    name: general.name; fuse_gate_up: a mixture's gate and up experts in one tensor; attn_factor: Phi-3's
    LongRoPE attention factor other than the converter's; extra: more metadata {key: uint32, float32, bool
    or a list};
    nextn: next-token-prediction blocks appended (GLM-4.5's); split_kv_b: DeepSeek's kv_b_proj as
    attn_k_b / attn_v_b with the latent form's metadata (today's converter), else an older converter's
    file (one attn_kv_b, the heads' widths as key_length / value_length); fuse_qkv: q / k / v in one
    attn_qkv as [q | k | v] rows (a Phi-2 file converted from its remote-code checkpoint's mixer.Wqkv);
    arch: llama.cpp's architecture other than the model type's (a Llama written as internlm2: what
    InternLM2Model writes, wqkv split into permuted Q / K and V); split_qkvz: Qwen3-Next's in_proj_qkvz
    as attn_qkv and attn_gate (today's converter), else as it is in ssm_in (an older one's file)."""
    import gguf

    cfg = model.config
    arch = arch or {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "llama",
            "qwen3_moe": "qwen3moe", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
            "gpt_oss": "gpt-oss", "smollm3": "smollm3", "granite": "granite",
            "olmo2": "olmo2", "seed_oss": "seed_oss", "qwen2_moe": "qwen2moe", "glm4_moe": "glm4moe",
            "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "glm4_moe_lite": "deepseek2", "glm4": "glm4",
            "starcoder2": "starcoder2", "cohere": "command-r", "cohere2": "cohere2", "phi": "phi2",
            "gpt_neox": "gptneox", "stablelm": "stablelm", "gpt_bigcode": "starcoder", "arcee": "arcee",
            "exaone": "exaone", "lfm2": "lfm2", "qwen3_next": "qwen3next", "qwen3_5_text": "qwen35",
            "qwen3_5_moe_text": "qwen35moe", "granitemoehybrid": "granitehybrid",
            "nemotron_h": "nemotron_h_moe" if "moe" in getattr(cfg, "layers_block_type", ()) else "nemotron_h",
            "olmoe": "olmoe", "granitemoe": "granitemoe", "granitemoeshared": "granitemoe",
            "exaone4": "exaone4", "ernie4_5": "ernie4_5", "ernie4_5_moe": "ernie4_5-moe",
            "minimax_m2": "minimax-m2"}[cfg.model_type]
    gemma = arch.startswith("gemma")
    w = gguf.GGUFWriter(str(path), arch)
    if name is not None:
        w.add_name(name)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    _hparams(w, cfg, arch, head_dim, nextn, mla=split_kv_b)
    if arch not in ("nemotron_h", "nemotron_h_moe"):   # (their experts' keys: _nemotron_h_hparams)
        _moe_hparams(w, cfg, arch, nextn)
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    w.add_token_types(vocab["types"])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                     ("pad", w.add_pad_token_id), ("eot", w.add_eot_token_id)):
        if vocab.get(key) is not None and vocab[key] >= 0:
            add(vocab[key])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(0)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue   # a tied head is the embedding (convert_hf_to_gguf writes no output.weight)
        x = t.float().numpy()
        if gemma and hf_name.endswith("norm.weight"):   # llama.cpp's Gemma norms are 1 + w
            x = x + 1.0
        if arch in _PERMUTED and hf_name.endswith("q_proj.weight"):   # LlamaModel's kin
            x = _permute(x, cfg.num_attention_heads)
        elif arch in _PERMUTED and hf_name.endswith("k_proj.weight"):
            x = _permute(x, cfg.num_key_value_heads)
        qtype = next((q for k, q in (qtypes or {}).items() if k in hf_name), "F32")
        if arch == "gpt-oss" and ".mlp.experts." in hf_name:
            _gpt_oss_experts(w, hf_name, x, qtype, rng, mxfp4, fuse_gate_up)
            continue
        if hf_name.endswith("mixer.experts.up_proj"):   # Nemotron 3's ungated experts [E, F, D]: ffn_up_exps
            _add(w, f"blk.{hf_name.split('.')[2]}.ffn_up_exps.weight", np.ascontiguousarray(x), qtype, rng)
            continue
        if hf_name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # transformers' stacked experts: gate_up [E, 2F, D] (gate rows first), down [E, D, F] ->
            # llama.cpp's ffn_gate_exps / ffn_up_exps [E, F, D] (fuse_gate_up: ffn_gate_up_exps [E, 2F, D],
            # base.py's torch.cat([gate, up], dim=1)) and ffn_down_exps [E, D, F]
            layer = hf_name.split(".")[2]
            parts = ({"down": x} if "gate_up" not in hf_name else {"gate_up": x} if fuse_gate_up
                     else {"gate": x[:, :x.shape[1] // 2], "up": x[:, x.shape[1] // 2:]})
            for part, value in parts.items():
                _add(w, f"blk.{layer}.ffn_{part}_exps.weight", np.ascontiguousarray(value), qtype, rng)
            continue
        if hf_name.endswith("kv_b_proj.weight") and split_kv_b:   # DeepseekV2Model: k_b transposed, v_b
            _split_kv_b(w, cfg, hf_name, x, qtype, rng)
            continue
        if hf_name.endswith("shared_expert_gate.weight"):   # [1, D] -> [D]: llama.cpp's ffn_gate_inp_shexp is 1-D
            x = x.reshape(-1)
        if fuse_qkv and ".self_attn." in hf_name and hf_name.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
            if ".q_proj." not in hf_name:
                continue
            state = model.state_dict()
            x = np.concatenate([state[hf_name.replace("q_proj", p)].float().numpy() for p in ("q_proj", "k_proj", "v_proj")])
            _add(w, f"blk.{hf_name.split('.')[2]}.attn_qkv.{hf_name.split('.')[-1]}", x, qtype, rng)
            continue
        if arch == "gptneox" and ".query_key_value." in hf_name:   # per head [h, 3, hd] -> [q | k | v] rows
            h = cfg.num_attention_heads
            x = np.ascontiguousarray(x.reshape(h, 3, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape))
        if "_layernorm.norms." in hf_name:   # StableLM's per-head q / k norms: stacked per layer
            if not hf_name.endswith(".norms.0.weight"):
                continue
            prefix = hf_name[:-len("norms.0.weight")]
            x = np.stack([v.float().numpy() for k, v in model.state_dict().items() if k.startswith(prefix + "norms.")])
            hf_name = prefix + "weight"
        if hf_name.endswith(".conv.conv.weight"):   # LFM2Model.modify_tensors: the taps [d, 1, L] -> [d, L]
            x = x[:, 0, :]
        if arch in ("qwen3next", "qwen35", "qwen35moe"):
            hf_name, x = _deltanet_tensor(w, cfg, arch, hf_name, x, qtype, rng, split_qkvz)
            if hf_name is None:
                continue
        if arch in ("granitehybrid", "granitemoe"):
            hf_name, x = _granitehybrid_tensor(w, cfg, hf_name, x, qtype, rng)
            if hf_name is None:
                continue
        if arch in ("nemotron_h", "nemotron_h_moe"):   # the names on disk (backbone.); a Mamba-2 layer's as Mamba2Model writes them
            hf_name = "backbone." + hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
            if ".mixer." in hf_name and cfg.layers_block_type[int(hf_name.split(".")[2])] == "linear_attention":
                hf_name, x = _mamba2_tensor(cfg.n_groups, hf_name, x)
        if arch == "minimax-m2" and hf_name.endswith((".mlp.gate.weight", ".mlp.e_score_correction_bias")):
            hf_name = hf_name.replace(".mlp.", ".block_sparse_moe.")   # (their names on disk)
        if arch == "ernie4_5-moe":   # transformers' in-memory name of the correction: its name on disk
            hf_name = hf_name.replace(".mlp.gate.moe_statics.", ".mlp.moe_statics.")
        if hf_name.endswith(".e_score_correction_bias"):   # TextModel's rename before the name map
            hf_name = hf_name[:-len("_bias")] + ".bias"
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf_name
        if hf_name.endswith(".sinks"):   # GptOssModel.filter_tensors: sinks get a .weight
            gname += ".weight"
        _add(w, gname, x, qtype, rng)
    if arch == "phi3":
        _phi3_rope_factors(w, cfg, head_dim, attn_factor)
    for key, value in (extra or {}).items():
        (w.add_array if isinstance(value, list) else w.add_bool if isinstance(value, bool)
         else w.add_uint32 if isinstance(value, int) else w.add_float32)(key, value)
    for i in range(nextn):
        _nextn_block(w, cfg, cfg.num_hidden_layers + i, rng)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
