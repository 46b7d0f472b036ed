"""Tiny random-weight models of the supported HF architectures, built with transformers.

Two shapes per family cover (mixtures of experts: top-1..3 of 3..6 experts, dense layers mixed in,
YaRN, attention sinks, clamped SwiGLU; with the rest): odd vocab sizes, tied and untied embeddings, n_kv_heads in
{1, 2, n_heads}, Llama-3, linear and LongRoPE scaling, partial rotary, sliding windows shorter
than the sequence (alternating with global layers in Gemma), soft caps small enough that tanh bends
(Gemma's initializer_range 0.2 makes scores and logits O(1)), head_dim != d_model / n_heads.
"""
from __future__ import annotations

from pathlib import Path

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
_COMMON = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=256)

CONFIGS: dict[str, tuple[str, dict]] = {
    "llama-gqa-llama3": ("llama", dict(_COMMON, vocab_size=131, intermediate_size=96, num_hidden_layers=2,
                                       num_key_value_heads=2, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False)),
    "llama-mqa-tied-linear": ("llama", dict(_COMMON, vocab_size=97, intermediate_size=80, num_hidden_layers=3,
                                            num_key_value_heads=1, tie_word_embeddings=True,
                                            rope_scaling={"rope_type": "linear", "factor": 2.0},
                                            attention_bias=True, mlp_bias=True)),
    "mistral-window": ("mistral", dict(_COMMON, vocab_size=113, intermediate_size=96, num_hidden_layers=2,
                                       num_key_value_heads=2, sliding_window=7)),
    # Ministral 8B (2410): the window on the layers layer_types names
    "ministral": ("ministral", dict(_COMMON, vocab_size=119, intermediate_size=96, num_hidden_layers=3,
                                    num_key_value_heads=2, head_dim=16, sliding_window=6,
                                    layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
    # CWM: Llama's block, every 4th layer from the first global, the others windowed; its default
    # Llama 3 RoPE (scaled from 8192 positions: the factors of the lowest frequencies)
    "cwm": ("cwm", dict(_COMMON, vocab_size=127, intermediate_size=96, num_hidden_layers=5, num_key_value_heads=2,
                        head_dim=16, sliding_window=5)),
    "mistral-mha": ("mistral", dict(_COMMON, vocab_size=128, intermediate_size=64, num_hidden_layers=2,
                                    num_key_value_heads=4, sliding_window=None, head_dim=32)),
    "qwen2-tied": ("qwen2", dict(_COMMON, vocab_size=151, intermediate_size=96, num_hidden_layers=2,
                                 num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-window": ("qwen2", dict(_COMMON, vocab_size=99, intermediate_size=64, num_hidden_layers=3,
                                   num_key_value_heads=1, tie_word_embeddings=False, use_sliding_window=True,
                                   sliding_window=6, max_window_layers=1)),
    "qwen3-gqa": ("qwen3", dict(_COMMON, vocab_size=127, intermediate_size=96, num_hidden_layers=2,
                                num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    "qwen3-mqa-window": ("qwen3", dict(_COMMON, vocab_size=109, intermediate_size=64, num_hidden_layers=3,
                                       num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True,
                                       use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                       initializer_range=0.1)),
    # SmolLM3: a NoPE layer every 2nd (no_rope_layer_interval), GQA, tied; then an explicit
    # no_rope_layers list with the window on the NoPE layers (SmolLM3Config's layer_types rule)
    "smollm3-nope": ("smollm3", dict(_COMMON, vocab_size=117, intermediate_size=96, num_hidden_layers=3,
                                     num_key_value_heads=2, no_rope_layer_interval=2, tie_word_embeddings=True)),
    "smollm3-window": ("smollm3", dict(_COMMON, vocab_size=103, intermediate_size=64, num_hidden_layers=4,
                                       num_key_value_heads=1, no_rope_layers=[0, 1, 1, 0], use_sliding_window=True,
                                       sliding_window=6, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    # Granite 3.x: its four multipliers at the published 8B model's values (embeddings x 12, q.k x 1/128
    # where 1/sqrt(head_dim) would be 1/4, each branch x 0.22, logits / 16)
    "granite": ("granite", dict(_COMMON, vocab_size=121, intermediate_size=96, num_hidden_layers=3,
                                num_key_value_heads=2, embedding_multiplier=12.0, attention_multiplier=0.0078125,
                                residual_multiplier=0.22, logits_scaling=16.0, tie_word_embeddings=True)),
    # Granite 3.x MoE: Granite's multipliers on top-2 of 4 experts (Mixtral's routing), every layer;
    # GraniteMoeShared: a shared gated MLP beside top-1 of 3
    "granitemoe": ("granitemoe", dict(_COMMON, vocab_size=117, intermediate_size=32, num_hidden_layers=2,
                                      num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                      embedding_multiplier=12.0, attention_multiplier=0.0078125,
                                      residual_multiplier=0.22, logits_scaling=16.0, tie_word_embeddings=True)),
    "granitemoeshared": ("granitemoeshared", dict(_COMMON, vocab_size=111, intermediate_size=24, num_hidden_layers=2,
                                                  num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=1,
                                                  shared_intermediate_size=40, embedding_multiplier=6.0,
                                                  attention_multiplier=0.015625, residual_multiplier=0.5,
                                                  logits_scaling=4.0, tie_word_embeddings=False)),
    # Ministral 3: Mistral with YaRN and its queries scaled up by log position past every 8 tokens
    # (the published period is 16384)
    "ministral3": ("ministral3", dict(_COMMON, vocab_size=131, intermediate_size=96, num_hidden_layers=2,
                                      num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                                                       "llama_4_scaling_beta": 0.4})),
    # HunYuan dense: per-head q / k norms after RoPE, the checkpoints' "dynamic" RoPE with a fixed alpha
    "hunyuan": ("hunyuan_v1_dense", dict(_COMMON, vocab_size=131, intermediate_size=96, num_hidden_layers=2,
                                         num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                                         rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0})),
    # HunYuan MoE: HunYuan's attention, top-2 of 4 experts renormalized beside a shared MLP
    "hunyuan-moe": ("hunyuan_v1_moe", dict(_COMMON, vocab_size=127, intermediate_size=32, num_hidden_layers=2,
                                           num_key_value_heads=1, head_dim=16, num_experts=4, moe_topk=2,
                                           rope_theta=10000.0,
                                           rope_scaling={"type": "dynamic", "alpha": 50.0, "factor": 1.0})),
    # OLMoE: q / k norms over the whole projection before RoPE, top-3 of 5 experts, not renormalized
    "olmoe": ("olmoe", dict(_COMMON, vocab_size=119, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
                            num_experts=5, num_experts_per_tok=3, norm_topk_prob=False)),
    # OLMo 2: norms after each branch only, q / k norms over the whole projection (GQA here; the
    # published models are MHA but for the 32B)
    "olmo2": ("olmo2", dict(_COMMON, vocab_size=119, intermediate_size=96, num_hidden_layers=3,
                            num_key_value_heads=2, tie_word_embeddings=False)),
    # OLMo 3: + sliding layers (three of four by default) at their own RoPE base, YaRN on the full ones
    "olmo3": ("olmo3", dict(_COMMON, vocab_size=107, intermediate_size=64, num_hidden_layers=4,
                            num_key_value_heads=4, sliding_window=6, tie_word_embeddings=False,
                            rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                                                "original_max_position_embeddings": 64},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # EXAONE 4.0: OLMo 2's block order with per-head q / k norms; sliding layers (LLLG) rotate, the
    # global one does not; then no window: every layer rotates
    "exaone4": ("exaone4", dict(_COMMON, vocab_size=111, intermediate_size=96, num_hidden_layers=4,
                                num_key_value_heads=2, sliding_window=6, sliding_window_pattern="LLLG",
                                tie_word_embeddings=True, layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    "exaone4-nowindow": ("exaone4", dict(_COMMON, vocab_size=101, intermediate_size=64, num_hidden_layers=2,
                                         num_key_value_heads=4, sliding_window=None,
                                         layer_types=["full_attention", "full_attention"])),
    # Seed-OSS: biases on q / k / v and (attention_out_bias) on o, head_dim != d / heads
    "seed_oss": ("seed_oss", dict(_COMMON, vocab_size=113, intermediate_size=96, num_hidden_layers=2,
                                  num_key_value_heads=2, head_dim=32, attention_bias=True, attention_out_bias=True,
                                  tie_word_embeddings=False)),
    # GLM-4-0414 / GLM-Z1: a norm after each branch too, half of each head rotating in pairs, q/k/v
    # biases; GLM-4 (chat-hf): the plain block, MQA, three quarters rotating, no biases
    "glm4": ("glm4", dict(_COMMON, vocab_size=123, intermediate_size=96, num_hidden_layers=3,
                          num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    "glm-mqa": ("glm", dict(_COMMON, vocab_size=101, intermediate_size=64, num_hidden_layers=2,
                            num_key_value_heads=1, head_dim=16, attention_bias=False, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                             "partial_rotary_factor": 0.75})),
    # Command R+ (Cohere): one bias-free LayerNorm feeding attention and MLP side by side, RoPE in
    # pairs, per-head q / k norms, q/k/v/o biases, logits x 1/16, tied; Command R7B / A (Cohere2): three sliding layers
    # that rotate to one global that does not, a window shorter than the prompt, logits x 1/4
    "cohere": ("cohere", dict(_COMMON, vocab_size=119, intermediate_size=96, num_hidden_layers=3,
                              num_key_value_heads=2, attention_bias=True, logit_scale=0.0625, use_qk_norm=True)),
    "cohere2": ("cohere2", dict(_COMMON, vocab_size=107, intermediate_size=64, num_hidden_layers=4,
                                num_key_value_heads=1, sliding_window=6, logit_scale=0.25,
                                layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                tie_word_embeddings=False)),
    # ERNIE 4.5 (0.3B's shape): RoPE in pairs over whole heads, biases everywhere (use_bias), tied
    "ernie4_5": ("ernie4_5", dict(_COMMON, vocab_size=111, intermediate_size=96, num_hidden_layers=2,
                                  num_key_value_heads=2, head_dim=32, use_bias=True)),
    # ERNIE 4.5 MoE (21B-A3B's routing): a dense first layer, then top-2 of 4 by softmax + a choice
    # correction (randomised below), renormalized, one shared expert
    "ernie4_5_moe": ("ernie4_5_moe", dict(_COMMON, vocab_size=113, intermediate_size=96, num_hidden_layers=3,
                                          num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                                          moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
                                          moe_layer_start_index=1, initializer_range=0.3)),
    # StarCoder2: LayerNorms with biases, an ungated gelu MLP, biases everywhere, a window on every
    # layer shorter than the prompt, tied; then no biases, MQA, untied, no window
    "starcoder2-window": ("starcoder2", dict(_COMMON, vocab_size=117, intermediate_size=96, num_hidden_layers=3,
                                             num_key_value_heads=2, sliding_window=7)),
    "starcoder2-mqa": ("starcoder2", dict(_COMMON, vocab_size=93, intermediate_size=80, num_hidden_layers=2,
                                          num_key_value_heads=1, use_bias=False, tie_word_embeddings=False,
                                          sliding_window=None)),
    # Arcee (AFM-4.5B): Llama with an ungated squared-ReLU MLP; YaRN from position 16 as AFM's
    "arcee": ("arcee", dict(_COMMON, vocab_size=113, intermediate_size=112, num_hidden_layers=2,
                            num_key_value_heads=2, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 16})),
    # Helium: Llama's block, q / k rotated in pairs, biased q / k / v (unbiased o)
    "helium": ("helium", dict(_COMMON, vocab_size=127, intermediate_size=96, num_hidden_layers=2,
                              num_key_value_heads=2, head_dim=16, attention_bias=True, mlp_bias=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    # EXAONE 3.5 (transformers runs it as Llama, its tensors renamed): tied, Llama 3 RoPE, GQA
    "exaone": ("exaone", dict(_COMMON, vocab_size=109, intermediate_size=96, num_hidden_layers=3,
                              num_key_value_heads=2, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE)),
    # InternLM3 (Llama in transformers): biases everywhere, "dynamic" RoPE (plain within the context)
    "internlm3": ("internlm3", dict(_COMMON, vocab_size=103, intermediate_size=96, num_hidden_layers=2,
                                    num_key_value_heads=2, head_dim=16, qkv_bias=True, bias=True,
                                    rope_parameters={"rope_type": "dynamic", "factor": 6.0, "rope_theta": 50000.0})),
    # Arcee Trinity (AFMoE): gated attention, RoPE and a window on the sliding layers only, OLMo 2 norms
    # around attention and MLP, a dense first layer, then sigmoid-routed experts with a correction, a
    # route scale and a shared expert; embeddings times sqrt(hidden) (mup_enabled)
    "afmoe": ("afmoe", dict(_COMMON, vocab_size=127, intermediate_size=96, num_hidden_layers=4, num_key_value_heads=2,
                            head_dim=16, num_dense_layers=1, global_attn_every_n_layers=2, sliding_window=6,
                            num_experts=6, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=32,
                            route_scale=2.5, mup_enabled=True, tie_word_embeddings=False)),
    # MiniCPM (remote code): written from transformers' Granite with muP's scales as its multipliers
    # (_PUBLISHED: scale_emb, scale_depth / sqrt(layers), hidden / dim_model_base), tied
    "minicpm": ("granite", dict(_COMMON, vocab_size=103, intermediate_size=96, num_hidden_layers=4,
                                num_key_value_heads=2, embedding_multiplier=12.0, residual_multiplier=1.4 / 2.0,
                                logits_scaling=64 / 16, attention_multiplier=16 ** -0.5, tie_word_embeddings=True)),
    # OPT (125m ... 66b): pre-LayerNorm blocks, ReLU, learned positions offset by 2, tied; biases
    "opt": ("opt", dict(vocab_size=109, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=112,
                        max_position_embeddings=256)),
    # GPT-Neo: global and local (windowed, shorter than the prompt) layers, unscaled scores, learned positions
    "gpt-neo": ("gpt_neo", dict(vocab_size=111, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=256,
                                window_size=6, attention_types=[[["global", "local"], 1]])),
    # OLMo 1: parameter-free LayerNorms, q / k / v clamped (at a bound the projections cross), biases
    "olmo": ("olmo", dict(_COMMON, vocab_size=109, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2,
                          clip_qkv=0.12, attention_bias=True, tie_word_embeddings=True)),
    # GPT-J: a parallel block on one LayerNorm, a quarter of each head rotated in pairs, the LM head's bias
    "gptj": ("gptj", dict(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=256, rotary_dim=4,
                          n_inner=112)),
    # Apertus: Llama 3 RoPE, q / k norms, an ungated xIELU MLP (its two scalars randomised below)
    "apertus": ("apertus", dict(_COMMON, vocab_size=107, intermediate_size=112, num_hidden_layers=2,
                                num_key_value_heads=2, head_dim=16,
                                rope_parameters={**LLAMA3_ROPE, "rope_theta": 12000000.0})),
    # Phi-3.5-MoE: LayerNorms, biases, the LM head's bias, LongRoPE with its short_mscale (the short
    # factors: served within the original context), sparsemixer's top-2 with a wide margin (several
    # logits within it)
    "phimoe": ("phimoe", dict(_COMMON, vocab_size=113, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2,
                              num_local_experts=4, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
                              router_jitter_noise=0.3, sliding_window=None,
                              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                               "short_factor": [1.0 + 0.15 * i for i in range(8)],
                                               "long_factor": [2.0 + 0.3 * i for i in range(8)], "short_mscale": 1.2,
                                               "long_mscale": 1.35, "original_max_position_embeddings": 256})),
    # LFM2: short-convolution layers (3 taps) around attention layers with per-head q / k norms; the
    # MLP's width from block_ff_dim (2/3 of it, rounded up to block_multiple_of), tied; weights of std 0.2
    # (initializer_range) so that the mixers move the residual (else a tied model repeats its last token)
    "lfm2": ("lfm2", dict(_COMMON, vocab_size=113, initializer_range=0.2, block_ff_dim=144, block_multiple_of=32,
                          num_hidden_layers=4,
                          num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "full_attention"])),
    # LFM2 with biased conv layers of 4 taps (a biased upload's shape), three conv layers in a row, untied
    "lfm2-bias": ("lfm2", dict(_COMMON, vocab_size=101, initializer_range=0.2, intermediate_size=96,
                               block_auto_adjust_ff_dim=False,
                               num_hidden_layers=4, num_key_value_heads=4, conv_L_cache=4, conv_bias=True,
                               full_attn_idxs=[3], tie_word_embeddings=False)),
    # LFM2-MoE: a dense first layer, then top-2 of 6 experts chosen by sigmoid + expert_bias, renormalized
    # and scaled; conv and attention layers as LFM2's
    "lfm2-moe": ("lfm2_moe", dict(_COMMON, vocab_size=107, initializer_range=0.2, intermediate_size=96,
                                  moe_intermediate_size=32, num_hidden_layers=4, num_key_value_heads=2, num_experts=6,
                                  num_experts_per_tok=2, num_dense_layers=1, routed_scaling_factor=1.5,
                                  layer_types=["conv", "full_attention", "conv", "full_attention"])),
    # Qwen3-Next: Gated DeltaNet layers (2 query / key heads of 8, 4 value heads of 8: each key head
    # shared by two, a 4-tap convolution) around gated attention layers with half of each head rotated;
    # top-2 of 4 experts renormalized plus the gated shared expert, a dense MLP on layer 2
    # (mlp_only_layers); A_log drawn so that the state decays by ~0.85 a token (build_hf_model), not ~0
    "qwen3-next": ("qwen3_next", dict(_COMMON, vocab_size=109, intermediate_size=96, num_hidden_layers=4,
                                      num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                      mlp_only_layers=[2], linear_num_key_heads=2, linear_num_value_heads=4,
                                      linear_key_head_dim=8, linear_value_head_dim=8, initializer_range=0.2,
                                      layer_types=["linear_attention", "full_attention", "linear_attention",
                                                   "full_attention"],
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5})),
    # Qwen3.5: the same mixers (three Gated DeltaNet layers in a row: full_attention_interval 4, one
    # key head per value head, 3 taps) with SwiGLU MLPs, its in_proj_qkv / z / b / a unfused, its
    # text config's interleaved M-RoPE section (one position per text token: plain RoPE), tied
    "qwen3.5": ("qwen3_5_text", dict(_COMMON, vocab_size=103, intermediate_size=96, num_hidden_layers=4,
                                     num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                                     linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                     linear_conv_kernel_dim=3, initializer_range=0.2, tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                                      "mrope_section": [1, 1, 0]})),
    # Qwen3.5-MoE: experts on every layer (top-2 of 4, always renormalized) and the gated shared expert
    "qwen3.5-moe": ("qwen3_5_moe_text", dict(_COMMON, vocab_size=107, num_hidden_layers=4, num_key_value_heads=2,
                                             head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=40,
                                             num_experts=4, num_experts_per_tok=2, linear_num_key_heads=2,
                                             linear_num_value_heads=4, linear_key_head_dim=8,
                                             linear_value_head_dim=8, initializer_range=0.2,
                                             layer_types=["linear_attention", "full_attention", "linear_attention",
                                                          "full_attention"])),
    # Granite 4.0-H-Tiny's shape: Mamba-2 layers (8 heads of 16 in 2 groups of state size 8, 4 taps and
    # the convolution's bias; transformers chunks its scan by 16) around an attention layer without
    # positions (the uploads' "nope"), Granite's multipliers, top-2 of 4 experts beside the shared MLP;
    # A_log drawn as the Gated DeltaNet's (a decay of ~0.85 a token: build_hf_model); untied (tied, its
    # embeddings times 12 dominate the residual: greedy repeats the last token)
    "granitemoehybrid": ("granitemoehybrid", dict(
        _COMMON, vocab_size=113, intermediate_size=32, num_hidden_layers=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=40, embedding_multiplier=12.0,
        attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=16.0, initializer_range=0.2,
        layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8,
        mamba_d_head=16, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=16, tie_word_embeddings=False)),
    # Granite 4.0-H-Micro's: dense (the shared MLP alone), RoPE on the attention layers, one group, 3
    # taps without a bias
    "granitemoehybrid-dense": ("granitemoehybrid", dict(
        _COMMON, vocab_size=107, num_hidden_layers=4, num_key_value_heads=1, num_local_experts=0,
        shared_intermediate_size=96, embedding_multiplier=6.0, attention_multiplier=0.015625,
        residual_multiplier=0.5, logits_scaling=4.0, initializer_range=0.2, position_embedding_type="rope",
        layer_types=["attention", "mamba", "mamba", "attention"], mamba_n_heads=4, mamba_n_groups=1,
        mamba_d_state=12, mamba_d_head=16, mamba_expand=1, mamba_d_conv=3, mamba_conv_bias=False,
        mamba_chunk_size=16, tie_word_embeddings=False)),
    # Bamba-9B's shape: Mamba-2 layers (8 heads of 16 in 2 groups of state size 8, 4 taps with a bias)
    # around attention layers that rotate half of each 16-wide head, Llama's MLP on every layer; no
    # multipliers; untied
    "bamba": ("bamba", dict(
        _COMMON, vocab_size=109, intermediate_size=80, num_hidden_layers=4, num_key_value_heads=2,
        attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_head=16,
        mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=16, initializer_range=0.2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    # Nemotron-H's layer patterns in small (M-, *-, M alone, M-, then a second - as 47B's runs: five
    # blocks, one without an MLP, one without a mixer):
    # Mamba-2 layers of 8 heads of 10 (heads * head dim not a multiple of hidden_size, as Nano 9B v2's)
    # in 2 groups of state size 8, 3 taps; attention of 16-wide heads without positions; squared-ReLU MLPs
    "nemotron-h": ("nemotron_h", dict(
        _COMMON, vocab_size=103, intermediate_size=80, num_key_value_heads=2, head_dim=16,
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention",
                           "linear_attention", "mlp", "mlp"], mamba_num_heads=8, mamba_head_dim=10, n_groups=2,
        ssm_state_size=8, conv_kernel=3, chunk_size=16, initializer_range=0.2, tie_word_embeddings=False)),
    # Nemotron 3 Nano's mixtures in small: M E * - E M E, four blocks (a Mamba-2 and its MoE, attention
    # and a dense MLP, an MoE without a mixer, a Mamba-2 and its MoE); 8 ungated squared-ReLU experts of
    # 32, 2 a token, in 2 groups of which 1 is chosen, sigmoid scores renormalized and scaled by 2.5,
    # and an ungated shared MLP of 48
    "nemotron-h-moe": ("nemotron_h", dict(
        _COMMON, vocab_size=101, intermediate_size=80, num_key_value_heads=2, head_dim=16,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "moe", "linear_attention", "moe"],
        mamba_num_heads=8, mamba_head_dim=10, n_groups=2, ssm_state_size=8, conv_kernel=3, chunk_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, norm_topk_prob=True,
        initializer_range=0.2, tie_word_embeddings=False)),
    # Llama 4 Scout: Llama 3 RoPE in pairs on every other layer (no_rope_layer_interval 2) with the
    # weightless q / k norm after it, the others unrotated with their queries scaled by position
    # (floor_scale small enough for the prompts to cross it); MoE on every layer: top-1 of 4 experts,
    # the input scaled by its sigmoid, plus the shared expert
    "llama4-scout": ("llama4_text", dict(_COMMON, vocab_size=127, intermediate_size=32, intermediate_size_mlp=96,
                                         num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                         num_experts_per_tok=1, no_rope_layer_interval=2, attention_chunk_size=256,
                                         floor_scale=4, attn_scale=0.5, use_qk_norm=True,
                                         rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0})),
    # Llama 4 Maverick's pattern: MoE on every other layer (interleave_moe_layer_step 2), dense MLPs of
    # intermediate_size_mlp between, no q / k norm; top-2 of 6 here (each scaled input its own row)
    "llama4-maverick": ("llama4_text", dict(_COMMON, vocab_size=109, intermediate_size=32, intermediate_size_mlp=80,
                                            num_hidden_layers=4, num_key_value_heads=1, num_local_experts=6,
                                            num_experts_per_tok=2, interleave_moe_layer_step=2, use_qk_norm=False,
                                            attention_chunk_size=256, floor_scale=6, attn_scale=0.3)),
    # GPTBigCode: StarCoder 1's one KV head (multi_query), and per-head q / k / v without it, unscaled scores
    "gpt-bigcode-mqa": ("gpt_bigcode", dict(vocab_size=131, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                            n_inner=112, multi_query=True)),
    "gpt-bigcode-mha": ("gpt_bigcode", dict(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                            multi_query=False, scale_attn_weights=False, tie_word_embeddings=False,
                                            activation_function="gelu")),
    # Falcon: 7B's block (one KV head, attention and MLP side by side on one norm); 40B / 180B's
    # (KV groups, ln_attn and ln_mlp, biases here); the original block sequential, multi-head
    "falcon-7b": ("falcon", dict(vocab_size=131, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 max_position_embeddings=256)),
    "falcon-40b": ("falcon", dict(vocab_size=103, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                  num_kv_heads=2, new_decoder_architecture=True, bias=True, ffn_hidden_size=112,
                                  max_position_embeddings=256, tie_word_embeddings=False)),
    # Falcon2-11B's: KV groups, side by side on one norm (num_ln_in_parallel_attn 1)
    "falcon-11b": ("falcon", dict(vocab_size=107, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                  num_kv_heads=2, new_decoder_architecture=True, num_ln_in_parallel_attn=1,
                                  max_position_embeddings=256)),
    "falcon-sequential": ("falcon", dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         multi_query=False, parallel_attn=False, max_position_embeddings=256,
                                         rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 10000.0})),
    # Granite SWA: Granite's multipliers, a sink logit per head (drawn: see build_hf_model), windows on
    # all but every 4th layer from the first (the first without RoPE), the sliding layers at a base of their own
    "granite-swa": ("granite_swa", dict(_COMMON, vocab_size=109, intermediate_size=96, num_hidden_layers=5,
                                        num_key_value_heads=2, sliding_window=5, embedding_multiplier=6.0,
                                        attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=4.0,
                                        tie_word_embeddings=False,
                                        layer_rope_theta=[0, 50.0, 50.0, 50.0, 20000.0],
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Jais 2: Llama's block with LayerNorms, biases everywhere, an ungated squared-ReLU MLP
    "jais2": ("jais2", dict(_COMMON, vocab_size=103, intermediate_size=112, num_hidden_layers=2,
                            num_key_value_heads=2)),
    # Nemotron (Minitron): LayerNorm1P, half of each head rotated (NemotronConfig's default), an ungated
    # squared-ReLU MLP, biases
    "nemotron": ("nemotron", dict(_COMMON, vocab_size=127, intermediate_size=112, num_hidden_layers=2,
                                  num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    # Gemma (1): Llama's block with Gemma's norms, GeGLU and scaled embedding; MQA as gemma-2b,
    # head_dim != d_model / heads as gemma-7b
    "gemma": ("gemma", dict(_COMMON, vocab_size=109, intermediate_size=96, num_hidden_layers=2,
                            num_key_value_heads=1, head_dim=32, initializer_range=0.2)),
    # sliding, global, sliding, global; query_pre_attn_scalar != head_dim; caps that bend
    "gemma2": ("gemma2", dict(_COMMON, vocab_size=137, intermediate_size=96, num_hidden_layers=4,
                              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                              attn_logit_softcapping=2.0, final_logit_softcapping=1.0, initializer_range=0.2)),
    "gemma2-mqa": ("gemma2", dict(_COMMON, vocab_size=97, intermediate_size=64, num_hidden_layers=2,
                                  num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=5,
                                  tie_word_embeddings=False, attn_logit_softcapping=1.5,
                                  final_logit_softcapping=None, initializer_range=0.2)),
    # VaultGemma: Gemma 2 without the norms after attention and MLP
    "vaultgemma": ("vaultgemma", dict(_COMMON, vocab_size=113, intermediate_size=96, num_hidden_layers=4,
                                      num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                                      attn_logit_softcapping=2.0, final_logit_softcapping=1.0, initializer_range=0.2)),
    # five local layers (base 10 000) to one global (base 1e6, linear scaling 8), q/k norms
    "gemma3": ("gemma3_text", dict(_COMMON, vocab_size=131, intermediate_size=96, num_hidden_layers=6,
                                   num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=20, sliding_window=5,
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1_000_000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10_000.0}},
                                   final_logit_softcapping=1.0, initializer_range=0.2)),
    "gemma3-mqa": ("gemma3_text", dict(_COMMON, vocab_size=103, intermediate_size=64, num_hidden_layers=2,
                                       num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                                       sliding_window=7, layer_types=["sliding_attention", "full_attention"],
                                       tie_word_embeddings=False, initializer_range=0.2)),
    # Phi-4-mini's shape: LongRoPE with 3/4 of each head rotating; served beyond the original 16
    # positions, so the long factors rotate every position (as HF does for the 24-token prompt on)
    "phi3-longrope": ("phi3", dict(_COMMON, vocab_size=119, intermediate_size=96, num_hidden_layers=2,
                                   num_key_value_heads=2, tie_word_embeddings=True, original_max_position_embeddings=16,
                                   initializer_range=0.2,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.75,
                                                    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]})),
    # served at the original length: the short factors (and an attention factor given explicitly)
    "phi3-mqa-window": ("phi3", dict(_COMMON, vocab_size=89, intermediate_size=80, num_hidden_layers=2,
                                     num_key_value_heads=1, sliding_window=7, max_position_embeddings=128,
                                     original_max_position_embeddings=128, initializer_range=0.1,
                                     rope_parameters={"rope_type": "longrope", "rope_theta": 500.0,
                                                      "attention_factor": 1.1,
                                                      "short_factor": [1.0, 1.2, 1.5, 2.0, 2.0, 3.0, 4.0, 5.0],
                                                      "long_factor": [2.0] * 8})),
    # mixtures of experts. Qwen3-MoE: renormalized top-2 of 4 with a dense layer between MoE layers;
    # unnormalized top-3 of 6, every layer windowed, YaRN (truncated band)
    "qwen3moe-gqa": ("qwen3_moe", dict(_COMMON, vocab_size=127, intermediate_size=96, moe_intermediate_size=32,
                                       num_hidden_layers=3, num_key_value_heads=2, head_dim=32, num_experts=4,
                                       num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                       tie_word_embeddings=False, initializer_range=0.3)),
    "qwen3moe-mqa-window-yarn": ("qwen3_moe", dict(_COMMON, vocab_size=109, intermediate_size=64,
                                                   moe_intermediate_size=48, num_hidden_layers=2, num_key_value_heads=1,
                                                   num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                                                   use_sliding_window=True, sliding_window=6, tie_word_embeddings=True,
                                                   initializer_range=0.2, max_position_embeddings=128,
                                                   rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                    "original_max_position_embeddings": 32,
                                                                    "rope_theta": 10000.0})),
    # Qwen2-MoE: a shared expert behind a sigmoid gate beside the routed ones, q/k/v biases, a dense layer
    "qwen2moe-shared": ("qwen2_moe", dict(_COMMON, vocab_size=119, intermediate_size=64, moe_intermediate_size=24,
                                          shared_expert_intermediate_size=40, num_hidden_layers=3,
                                          num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                          norm_topk_prob=False, mlp_only_layers=[1], initializer_range=0.3)),
    # GLM-4.5: sigmoid routing with a correction (randomized below) over 4 groups of which 2 are kept, scaled
    # weights, two shared experts, partial rotary (half of each head), q/k norms, q/k/v biases, a first
    # dense layer
    "glm4moe-groups": ("glm4_moe", dict(_COMMON, vocab_size=123, intermediate_size=48, moe_intermediate_size=16,
                                        num_hidden_layers=3, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
                                        num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
                                        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                                        use_qk_norm=True, attention_bias=True, initializer_range=0.3)),
    # DeepSeek-V3: latent attention (a q bottleneck, interleaved RoPE features) and GLM-4.5's mixture;
    # then without the q bottleneck, with attention biases and YaRN (mscale_all_dim: the softmax scale);
    # latent + rope = 32 features a token: a power of two, so the GPU's Pallas kernels take them too
    "deepseekv3-mla": ("deepseek_v3", dict(_COMMON, num_key_value_heads=4, vocab_size=117, intermediate_size=48, moe_intermediate_size=16,
                                           num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                           topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                                           first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=24,
                                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                           initializer_range=0.2)),
    "deepseekv3-yarn-bias": ("deepseek_v3", dict(_COMMON, num_key_value_heads=4, vocab_size=109, intermediate_size=40, moe_intermediate_size=16,
                                                 num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
                                                 n_group=1, topk_group=1, n_shared_experts=2, first_k_dense_replace=0,
                                                 kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                                                 qk_rope_head_dim=16, v_head_dim=12, attention_bias=True,
                                                 norm_topk_prob=False, initializer_range=0.2,
                                                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                                  "original_max_position_embeddings": 64,
                                                                  "mscale": 1.0, "mscale_all_dim": 0.8,
                                                                  "beta_fast": 32.0, "beta_slow": 1.0})),
    # MiniMax-M2: whole-projection q / k norms, half of each head rotated (the legacy rotary_dim),
    # sigmoid-chosen experts with a learned correction, renormalized
    "minimax-m2": ("minimax_m2", dict(_COMMON, vocab_size=117, intermediate_size=24, num_hidden_layers=2,
                                      num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=6,
                                      num_experts_per_tok=2, initializer_range=0.2,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # dots.llm1: Qwen3's attention (biased, its last layer windowed) and DeepSeek-V3's mixture after a
    # dense first layer
    "dots1": ("dots1", dict(_COMMON, vocab_size=111, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=3, num_key_value_heads=2, head_dim=16, n_routed_experts=6,
                            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                            routed_scaling_factor=2.0, norm_topk_prob=True, first_k_dense_replace=1,
                            attention_bias=True, sliding_window=6, max_window_layers=2, initializer_range=0.2)),
    # Solar Open: Llama's attention (q / k / v biases) and GLM-4.5's mixture on every layer
    "solar-open": ("solar_open", dict(_COMMON, vocab_size=109, moe_intermediate_size=16, num_hidden_layers=2,
                                      num_key_value_heads=2, head_dim=16, n_routed_experts=6, num_experts_per_tok=2,
                                      n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.5,
                                      attention_bias=True, initializer_range=0.2,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # K-EXAONE: EXAONE 4.0's attention (sliding layers with RoPE, the global one without) in a pre-norm
    # block, DeepSeek-V3's mixture after a dense first layer
    "exaone-moe": ("exaone_moe", dict(_COMMON, vocab_size=113, intermediate_size=48, moe_intermediate_size=16,
                                      num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_experts=6,
                                      num_experts_per_tok=2, num_shared_experts=1, routed_scaling_factor=2.5,
                                      first_k_dense_replace=1, sliding_window=6, sliding_window_pattern=3,
                                      initializer_range=0.2)),
    # GLM-4.7-Flash: DeepSeek-V3's latent attention and mixture, a dense layer between mixtures
    # (mlp_layer_types)
    "glm4moelite": ("glm4_moe_lite", dict(_COMMON, num_key_value_heads=4, vocab_size=107, intermediate_size=48,
                                          moe_intermediate_size=16, num_hidden_layers=3, n_routed_experts=6,
                                          num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.8,
                                          mlp_layer_types=["sparse", "dense", "sparse"], kv_lora_rank=24,
                                          q_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                                          initializer_range=0.2)),
    # DeepSeek-V2: the same latent attention (no q bottleneck, as V2-Lite's) with softmax routing limited
    # to 2 of 4 groups (each scored by its best expert), V2's large routed scale, two shared experts, YaRN
    "deepseekv2-groups": ("deepseek_v2", dict(_COMMON, num_key_value_heads=4, vocab_size=113, intermediate_size=48,
                                              moe_intermediate_size=16, num_hidden_layers=3, n_routed_experts=8,
                                              num_experts_per_tok=3, n_group=4, topk_group=2,
                                              topk_method="group_limited_greedy", n_shared_experts=2,
                                              routed_scaling_factor=16.0, first_k_dense_replace=1, kv_lora_rank=24,
                                              q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                              initializer_range=0.2,
                                              rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                               "original_max_position_embeddings": 64,
                                                               "mscale": 0.707, "mscale_all_dim": 0.707,
                                                               "beta_fast": 32.0, "beta_slow": 1.0})),
    "mixtral-gqa": ("mixtral", dict(_COMMON, vocab_size=113, intermediate_size=48, num_hidden_layers=2,
                                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                    initializer_range=0.2)),
    "mixtral-mqa-window": ("mixtral", dict(_COMMON, vocab_size=101, intermediate_size=40, num_hidden_layers=2,
                                           num_key_value_heads=1, head_dim=32, num_local_experts=5,
                                           num_experts_per_tok=3, sliding_window=7, initializer_range=0.2)),
    # gpt-oss: sliding / global layers, sinks, biases everywhere, YaRN (band not truncated), a clamp
    # limit low enough that the tiny model's gate and up values cross it. initializer_range 0.2 (MoE):
    # at 0.02 these models repeat one token (greedy checks would mean little), at 0.2 they vary
    "gpt-oss": ("gpt_oss", dict(_COMMON, vocab_size=131, intermediate_size=48, num_hidden_layers=4,
                                num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=6, swiglu_limit=1.0, initializer_range=0.2,
                                rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 32, "rope_theta": 150000.0})),
    "gpt-oss-mqa": ("gpt_oss", dict(_COMMON, vocab_size=97, intermediate_size=32, num_hidden_layers=2,
                                    num_key_value_heads=1, head_dim=32, num_local_experts=3, num_experts_per_tok=2,
                                    sliding_window=5, layer_types=["full_attention", "sliding_attention"],
                                    swiglu_limit=1.5, swiglu_alpha=2.5, initializer_range=0.2,
                                    rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    "gpt2": ("gpt2", dict(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    "gpt2-untied-relu": ("gpt2", dict(vocab_size=89, n_embd=48, n_layer=3, n_head=2, n_positions=128,
                                      n_inner=100, activation_function="relu", tie_word_embeddings=False)),
    "bloom": ("bloom", dict(vocab_size=103, hidden_size=64, n_layer=2, n_head=4)),
    "bloom-6heads-postnorm": ("bloom", dict(vocab_size=91, hidden_size=48, n_layer=2, n_head=6,
                                            apply_residual_connection_post_layernorm=True)),
    # GPT-NeoX (Pythia): fused per-head q/k/v, a quarter of each head rotated, attention and MLP side
    # by side on their own LayerNorms; sequential, tanh GELU, RoPE base 5000, no attention biases
    # and tied in the second
    "gpt-neox": ("gpt_neox", dict(_COMMON, vocab_size=109, intermediate_size=96, num_hidden_layers=2,
                                  rotary_pct=0.25)),
    "gpt-neox-sequential": ("gpt_neox", dict(_COMMON, vocab_size=95, intermediate_size=80, num_hidden_layers=3,
                                             rotary_pct=0.5, rotary_emb_base=5000, use_parallel_residual=False,
                                             hidden_act="gelu_fast", attention_bias=False, tie_word_embeddings=True)),
    # Phi-2: one LayerNorm feeding attention and MLP side by side, 0.4 of each head rotated, biases
    # everywhere including the LM head; GQA with per-head q / k LayerNorms and tied in the second
    "phi": ("phi", dict(_COMMON, vocab_size=103, intermediate_size=96, num_hidden_layers=2,
                        partial_rotary_factor=0.4)),
    "phi-qk-layernorm": ("phi", dict(_COMMON, vocab_size=89, intermediate_size=64, num_hidden_layers=3,
                                     num_key_value_heads=2, qk_layernorm=True, tie_word_embeddings=True)),
    # StableLM 2 1.6B: Llama's block on LayerNorms, a quarter of each head rotated, q/k/v biases;
    # StableLM 2 12B: GQA, a LayerNorm per head of q and k, attention and MLP side by side
    "stablelm": ("stablelm", dict(_COMMON, vocab_size=101, intermediate_size=96, num_hidden_layers=2,
                                  num_key_value_heads=4, use_qkv_bias=True)),
    "stablelm-parallel-qk-norm": ("stablelm", dict(_COMMON, vocab_size=105, intermediate_size=64, num_hidden_layers=3,
                                                   num_key_value_heads=2, qk_layernorm=True,
                                                   use_parallel_residual=True, partial_rotary_factor=0.5)),
}


# Tied embeddings at initializer_range 0.2 dominate the residual stream and greedy decoding repeats
# one token; drawn smaller (this std) the continuations stay varied, so greedy checks mean something.
EMBED_STD = {"gemma": 0.05, "gemma2": 0.05, "gemma3": 0.05, "vaultgemma": 0.05}


def build_hf_model(name: str, seed: int = 0, overrides: dict | None = None):
    """overrides: HF config fields replacing CONFIGS[name]'s (e.g. more layers)."""
    import torch
    import transformers as tf

    family, kwargs = CONFIGS[name]
    kwargs = {**kwargs, **(overrides or {})}
    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
           "bloom": ("BloomConfig", "BloomForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM"),
           "falcon": ("FalconConfig", "FalconForCausalLM"),
           "arcee": ("ArceeConfig", "ArceeForCausalLM"), "helium": ("HeliumConfig", "HeliumForCausalLM"),
           "gemma": ("GemmaConfig", "GemmaForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
           "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM"),
           "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
           "phi3": ("Phi3Config", "Phi3ForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "mixtral": ("MixtralConfig", "MixtralForCausalLM"), "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
           "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"), "granite": ("GraniteConfig", "GraniteForCausalLM"),
           "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"), "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
           "exaone4": ("Exaone4Config", "Exaone4ForCausalLM"),
           "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM"),
           "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
           "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
           "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
           "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
           "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM"),
           "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
           "ministral": ("MinistralConfig", "MinistralForCausalLM"), "cwm": ("CwmConfig", "CwmForCausalLM"),
           "granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM"),
           "jais2": ("Jais2Config", "Jais2ForCausalLM"), "nemotron": ("NemotronConfig", "NemotronForCausalLM"),
           "dots1": ("Dots1Config", "Dots1ForCausalLM"),
           "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM"),
           "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM"),
           "glm": ("GlmConfig", "GlmForCausalLM"), "glm4": ("Glm4Config", "Glm4ForCausalLM"),
           "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
           "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM"),
           "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM"),
           "cohere": ("CohereConfig", "CohereForCausalLM"), "cohere2": ("Cohere2Config", "Cohere2ForCausalLM"),
           "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"), "phi": ("PhiConfig", "PhiForCausalLM"),
           "stablelm": ("StableLmConfig", "StableLmForCausalLM"),
           "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
           "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM"),
           "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
           "ministral3": ("Ministral3Config", "Ministral3ForCausalLM"),
           "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM"),
           "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM"),
           "afmoe": ("AfmoeConfig", "AfmoeForCausalLM"), "apertus": ("ApertusConfig", "ApertusForCausalLM"),
           "gptj": ("GPTJConfig", "GPTJForCausalLM"), "olmo": ("OlmoConfig", "OlmoForCausalLM"), "opt": ("OPTConfig", "OPTForCausalLM"),
           "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM"), "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM"),
           "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"), "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM"),
           "phimoe": ("PhimoeConfig", "PhimoeForCausalLM"),
           "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
           "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
           "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
           "bamba": ("BambaConfig", "BambaForCausalLM"),
           "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
           "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
           "exaone": ("ExaoneConfig", "LlamaForCausalLM"), "internlm3": ("InternLM3Config", "LlamaForCausalLM")}[family]
    cls = (getattr(tf, names[0]), getattr(tf, names[1]))   # only this family's classes: one
    # missing from an older transformers (the GPU image's) fails only its own tests
    torch.manual_seed(seed)
    # eager attention: the published computation on every transformers version (5.17's default for
    # Gemma 2 was sdpa, which drops its attention soft-capping: seen on the GPU image, 2026-11-26)
    config = cls[0](**kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    model = cls[1](config).eval()
    if family == "gpt_oss":
        # the clamped SwiGLU's alpha and limit come from the config (OpenAI's reference reads
        # swiglu_limit from it); transformers 5.17 (the GPU image's) hard-codes 1.702 and 7.0 and ignores both
        for layer in model.model.layers:
            layer.mlp.experts.alpha = getattr(config, "swiglu_alpha", 1.702)
            layer.mlp.experts.limit = config.swiglu_limit
    # transformers' init leaves many biases and norm weights at 0 / 1: randomise every
    # parameter so that each one matters for the comparison.
    with torch.no_grad():
        if name in EMBED_STD:
            model.get_input_embeddings().weight.normal_(0.0, EMBED_STD[name])
        for n, p in model.named_parameters():
            if n.endswith("moe_statics.e_score_correction_bias"):   # ERNIE's choice correction (zeros at init)
                p.normal_(0.0, 0.3)
            elif n.endswith((".bias", "_bias")) or "norm" in n or "ln_" in n:
                p.add_(0.1 * torch.randn_like(p))
            elif n.endswith(".A_log"):   # Gated DeltaNet: a decay exp(-A softplus(.)) of ~0.85 a token, not ~0
                p.normal_(-2.0, 0.5)
            elif n.endswith("mamba.D"):   # Mamba-2's skip (ones at init)
                p.add_(0.3 * torch.randn_like(p))
            elif n.endswith(".sinks"):   # gpt-oss: sink logits as large as the scores, so that they matter
                p.normal_(0.0, 1.0)
            elif n.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):   # xIELU's scalars: other slopes per layer
                p.add_(0.5 * torch.randn_like(p))
            elif n.endswith(("self_attn.gate_proj.weight", "router.gate.weight", "feed_forward.router.weight",
                             "feed_forward.gate.weight")):
                # AFMoE's attention gate and router (zeros at init), Llama 4's and LFM2-MoE's routers: gates that differ
                # per feature, and scores that differ per expert
                p.normal_(0.0, 0.3)

        for n, b in model.named_buffers():   # GLM-4.5's and LFM2-MoE's choice correction (buffers, zeros at init)
            if n.endswith(("e_score_correction_bias", "feed_forward.expert_bias")):
                b.normal_(0.0, 0.3)
    return model


# Families transformers runs with another's class (LlamaForCausalLM): the config.json of their uploads
# (architectures, and the fields under their own names), where save_pretrained writes the class's
_PUBLISHED = {"exaone": ("ExaoneForCausalLM", {"num_hidden_layers": "num_layers", "rms_norm_eps": "layer_norm_epsilon",
                                               "hidden_act": "activation_function"}),
              "internlm3": ("InternLM3ForCausalLM", {"attention_bias": "qkv_bias", "mlp_bias": "bias"})}


def published_config(name: str, saved: dict) -> dict:
    """config.json as CONFIGS[name]'s family's uploads spell it (_PUBLISHED), from save_pretrained's."""
    if name == "minicpm":   # MiniCPM's scales from the Granite multipliers it was written from
        fields = {k: v for k, v in saved.items() if not k.endswith(("_multiplier", "logits_scaling"))}
        return {**fields, "architectures": ["MiniCPMForCausalLM"], "model_type": "minicpm",
                "scale_emb": saved["embedding_multiplier"], "scale_depth": saved["residual_multiplier"] * 2.0,
                "dim_model_base": saved["hidden_size"] / saved["logits_scaling"]}
    arch, names = _PUBLISHED[CONFIGS[name][0]]
    return {**{names.get(k, k): v for k, v in saved.items()}, "architectures": [arch]}


def save_hf_model(name: str, folder: Path, overrides: dict | None = None) -> str:
    import json

    build_hf_model(name, overrides=overrides).save_pretrained(folder)
    if CONFIGS[name][0] in _PUBLISHED or name == "minicpm":
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(published_config(name, json.loads(path.read_text()))))
    return str(folder)


TEXT_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly "
              "zebras and hackers write code in the night; café naïve über").split()


def save_text_model(folder: Path, vocab: int = 400, seed: int = 0, max_positions: int = 256) -> Path:
    """A random tiny Llama with a SentencePiece BPE (byte fallback) trained here on TEXT_WORDS; its
    context is max_positions (the weights do not depend on it)."""
    import io

    import numpy as np
    import sentencepiece as spm
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(seed)
    lines = [" ".join(rng.choice(TEXT_WORDS, rng.randint(4, 14))) for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.99,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=3)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                                 max_position_embeddings=max_positions)).save_pretrained(folder)
    return folder


def random_medusa_heads(target_dir, out: Path, tree=None, num_heads: int = 3, seed: int = 0) -> Path:
    """Medusa heads with random weights for any target (poor proposals: exactness must not care);
    the tree: 3 children of the root, 3 grandchildren, 1 great-grandchild."""
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.spec_decode.medusa import MedusaHeads, Tree, save_heads, target_fingerprint
    from jaxinfer.weights import load_model
    tree = tree or Tree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    model, cfg = load_model(target_dir)
    heads = MedusaHeads(num_heads, cfg.d_model)
    rng = np.random.default_rng(seed)
    heads.w.set_value(jnp.asarray(rng.normal(size=(num_heads, cfg.d_model, cfg.d_model)) / np.sqrt(cfg.d_model),
                                  jnp.float32))
    heads.b.set_value(jnp.asarray(rng.normal(size=(num_heads, cfg.d_model)), jnp.float32))
    save_heads(heads, tree, {"format": "jaxinfer-medusa", "num_heads": num_heads,
                             "target": {"d_model": cfg.d_model, "vocab_size": cfg.vocab_size,
                                        "embed_sha256": target_fingerprint(model), "path": str(target_dir)}}, out)
    return out


def seeded_peft(model, config: dict, seed: int, std: float):
    """PEFT's LoRA over a transformers model with its A and B drawn N(0, std) from `seed` (PEFT
    starts B at zero, which would make every adapter the identity), in eval mode."""
    import torch
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(model, LoraConfig(**config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, std)
    return model.eval()
