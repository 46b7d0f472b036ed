"""Hugging Face tensor names -> the decoder's parameter paths, per family.

Each family gives, for every parameter path of models/decoder.py, the HF tensor name(s) it
comes from and a numpy transform into our layout:
    q/k/v  [d_model, heads, head_dim]     o [heads, head_dim, d_model]
    mlp    up/gate [d_model, ffn]         down [ffn, d_model]        lm_head [d_model, vocab]
    norms  scale [dim] (Gemma: the stored w of its 1 + w)
torch Linear stores [out, in] (transpose); GPT-2's Conv1D stores [in, out] (no transpose);
BLOOM fuses q, k, v per head as [heads, 3, head_dim, d_model]; Phi-3 stores [q | k | v] rows in
one qkv_proj and [gate | up] rows in one gate_up_proj (split here; fuse_decoder fuses them again
for serving, grouped per tensor-parallel shard).
Mixtures of experts: router [d_model, E]; experts gate/up [E, d_model, F], down [E, F, d_model].
Mixtral (block_sparse_moe.experts.j.w1 / w3 / w2) and Qwen2-MoE, Qwen3-MoE, GLM-4.5, DeepSeek-V3
(mlp.experts.j.gate_proj / up_proj / down_proj) store one torch Linear per expert, stacked here; the
last three's shared experts (mlp.shared_expert[s]) and sigmoid router's correction
(mlp.gate.e_score_correction_bias) map to MoE.shared / router_correction. gpt-oss stores its experts
stacked [E, in, out] with gate and up interleaved column by column in gate_up_proj (gate: even
columns, up: odd), de-interleaved here. DeepSeek-V3's latent attention: _mla_map.

A new family (dense or mixture-of-experts) is a builder in hf_configs.py and an entry here.
"""
from __future__ import annotations

import re
from typing import Callable

import numpy as np

from jaxinfer.config import ModelConfig

Transform = Callable[..., np.ndarray]
# our parameter path -> (HF tensor names, transform(*tensors) -> array in our layout)
WeightMap = dict[str, tuple[tuple[str, ...], Transform]]


def _ident(x: np.ndarray) -> np.ndarray:
    return x


def _t(x: np.ndarray) -> np.ndarray:
    return x.T


def _rows(w: np.ndarray, lo: int, hi: int, total: int) -> np.ndarray:
    """Rows [lo, hi) of a fused tensor that must have `total` rows (else the checkpoint does not fit)."""
    if w.shape[0] != total:
        raise ValueError(f"a fused tensor of {total} rows expected")
    return w[lo:hi]


def _stack_t(*ws: np.ndarray) -> np.ndarray:
    """One torch Linear [out, in] per expert -> [E, in, out]."""
    return np.stack([w.T for w in ws])


def _norm(m: WeightMap, ours: str, hf: str, layernorm: bool | None) -> None:
    """A norm's weight (and bias where `layernorm`; None: OLMo 1's norm, with neither)."""
    if layernorm is None:
        return
    m[f"{ours}/scale"] = ((f"{hf}.weight",), _ident)
    if layernorm:
        m[f"{ours}/bias"] = ((f"{hf}.bias",), _ident)


def _block_norms(cfg: ModelConfig) -> dict[str, str]:
    """Our norm -> HF's, per block. HF's post_attention_layernorm is the pre-MLP norm in Llama and
    GLM-4 but the attention output's norm in Gemma, whose pre-MLP norm is pre_feedforward_layernorm;
    Cohere's one input_layernorm feeds both branches."""
    if cfg.parallel_block:
        return {"attn_norm": "input_layernorm"}
    if not cfg.pre_norms:   # OLMo 2: only the branches' output norms
        return {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
    if cfg.post_norms and cfg.architecture == "Glm4ForCausalLM":
        return {"attn_norm": "input_layernorm", "attn_post_norm": "post_self_attn_layernorm",
                "mlp_norm": "post_attention_layernorm", "mlp_post_norm": "post_mlp_layernorm"}
    if cfg.post_norms:
        mlp = "mlp" if cfg.architecture == "AfmoeForCausalLM" else "feedforward"
        return {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                "mlp_norm": f"pre_{mlp}_layernorm", "mlp_post_norm": f"post_{mlp}_layernorm"}
    if cfg.architecture == "ApertusForCausalLM":
        return {"attn_norm": "attention_layernorm", "mlp_norm": "feedforward_layernorm"}
    if cfg.architecture == "VaultGemmaForCausalLM":   # Gemma 2's names, without its post-norms
        return {"attn_norm": "input_layernorm", "mlp_norm": "pre_feedforward_layernorm"}
    return {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def head_order(cfg: ModelConfig) -> np.ndarray:
    """The order of each q / k head's stored features that gives layers.apply_rope's layout: GLM's,
    Cohere's and ERNIE 4.5's rotated features come in pairs (x0, x1), (x2, x3), ... (de-interleaved: _deinterleave), the
    features past them unrotated; every other family's are already in it."""
    order = np.arange(cfg.head_dim)
    if cfg.architecture in _PAIRED_ROPE:
        order[:cfg.rope_dim] = _deinterleave(cfg.rope_dim)
    return order


# the ungated MLPs' tensors on Llama's block: StarCoder2's c_fc / c_proj, Arcee's and Jais 2's up_proj / down_proj
_UNGATED_MLP = {"ArceeForCausalLM": (("up", "up_proj"), ("down", "down_proj")),
                "NemotronForCausalLM": (("up", "up_proj"), ("down", "down_proj")),
                "NemotronHForCausalLM": (("up", "up_proj"), ("down", "down_proj")),
                "Jais2ForCausalLM": (("up", "up_proj"), ("down", "down_proj")),
                "ApertusForCausalLM": (("up", "up_proj"), ("down", "down_proj"))}


def _llama_map(cfg: ModelConfig, fused: bool = False, fused_mlp: bool = False) -> WeightMap:
    """Llama, Mistral, Qwen2, Qwen3 (+ q_norm / k_norm), Gemma 2 / 3 (+ the norms after attention and
    MLP), Mixtral, Qwen3-MoE and gpt-oss (+ sinks; their experts: _experts_map); with fused=True,
    Phi-3 (q, k, v in one qkv_proj [(H + 2 Hkv) hd, d]; gate and up in one gate_up_proj [2F, d], gate
    first: each part is a slice of the stored tensor); with fused_mlp=True, GLM-4 (gate_up_proj only,
    q and k de-interleaved: head_order); StarCoder2 (LayerNorms, the ungated mlp.c_fc / c_proj);
    Cohere / Cohere2 (one input_layernorm per block, q and k de-interleaved)."""
    h, kv, hd, d, f = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.ffn_dim
    m: WeightMap = {"embed": (("model.embed_tokens.weight",), _ident)}
    layernorm = None if cfg.norm == "layernorm_noparam" else cfg.norm in ("layernorm", "layernorm1p")
    norms, order = _block_norms(cfg), head_order(cfg)
    rows = {"q": (0, h * hd), "k": (h * hd, (h + kv) * hd), "v": ((h + kv) * hd, (h + 2 * kv) * hd)}
    for i in range(cfg.n_layers):
        p, o = f"model.layers.{i}", f"layers/{i}"
        for ours, theirs in norms.items():
            _norm(m, f"{o}/{ours}", f"{p}.{theirs}", layernorm)
        if cfg.mla:
            _mla_map(m, cfg, f"{o}/attn", f"{p}.self_attn")
        for name, heads in (("q", h), ("k", kv), ("v", kv)) if not cfg.mla else ():
            feats = order if name != "v" else np.arange(hd)
            if fused:
                lo, hi = rows[name]
                m[f"{o}/attn/{name}"] = ((f"{p}.self_attn.qkv_proj.weight",),
                                         lambda w, lo=lo, hi=hi, n=heads:
                                         _rows(w, lo, hi, (h + 2 * kv) * hd).T.reshape(d, n, hd))
            else:
                m[f"{o}/attn/{name}"] = ((f"{p}.self_attn.{name}_proj.weight",),
                                         lambda w, n=heads, j=feats: w.T.reshape(d, n, hd)[..., j])
            if cfg.qkv_bias:
                m[f"{o}/attn/{name}_bias"] = ((f"{p}.self_attn.{name}_proj.bias",),
                                              lambda b, n=heads, j=feats: b.reshape(n, hd)[..., j])
        if cfg.qk_norm_heads:   # Cohere: [heads, head_dim], its features in the q / k order (head_order)
            for name, heads in (("q", h), ("k", kv)):
                m[f"{o}/attn/{name}_norm/scale"] = ((f"{p}.self_attn.{name}_norm.weight",),
                                                    lambda w, n=heads: w.reshape(n, hd)[..., order])
        elif cfg.qk_norm:
            _norm(m, f"{o}/attn/q_norm", f"{p}.self_attn.q_norm", False)
            _norm(m, f"{o}/attn/k_norm", f"{p}.self_attn.k_norm", False)
        if not cfg.mla:
            m[f"{o}/attn/o"] = ((f"{p}.self_attn.o_proj.weight",), lambda w: w.T.reshape(h, hd, d))
        if cfg.out_bias:
            m[f"{o}/attn/o_bias"] = ((f"{p}.self_attn.o_proj.bias",), _ident)
        if cfg.attn_sinks:
            m[f"{o}/attn/sinks"] = ((f"{p}.self_attn.sinks",), _ident)
        if cfg.attn_out_gate:
            m[f"{o}/attn/out_gate"] = ((f"{p}.self_attn.gate_proj.weight",), lambda w: w.T.reshape(d, h, hd))
        if cfg.is_moe_layer(i):
            _experts_map(m, cfg, o, p)
            continue
        if fused or fused_mlp:
            m[f"{o}/mlp/gate"] = ((f"{p}.mlp.gate_up_proj.weight",), lambda w: _rows(w, 0, f, 2 * f).T)
            m[f"{o}/mlp/up"] = ((f"{p}.mlp.gate_up_proj.weight",), lambda w: _rows(w, f, 2 * f, 2 * f).T)
            m[f"{o}/mlp/down"] = ((f"{p}.mlp.down_proj.weight",), _t)
            continue
        mlp = ((("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")) if cfg.gated_mlp else
               _UNGATED_MLP.get(cfg.architecture, (("up", "c_fc"), ("down", "c_proj"))))
        for ours, theirs in mlp:
            m[f"{o}/mlp/{ours}"] = ((f"{p}.mlp.{theirs}.weight",), _t)
            if cfg.mlp_bias:
                m[f"{o}/mlp/{ours}_bias"] = ((f"{p}.mlp.{theirs}.bias",), _ident)
        if cfg.activation == "xielu":   # Apertus: alpha_p, alpha_n [1]; its beta and eps buffers []
            m[f"{o}/mlp/xielu"] = (tuple(f"{p}.mlp.act_fn.{n}" for n in ("alpha_p", "alpha_n", "beta", "eps")),
                                   lambda *v: np.concatenate([x.reshape(-1) for x in v]))
    _norm(m, "final_norm", "model.norm", layernorm)
    if not cfg.tie_embeddings:
        m["lm_head"] = (("lm_head.weight",), _t)
    if cfg.lm_head_bias:   # Phi-2, PhiMoE
        m["lm_head_bias"] = (("lm_head.bias",), _ident)
    return m


def _deinterleave(rope: int) -> np.ndarray:
    """DeepSeek's RoPE features come in pairs (x0, x1), (x2, x3), ...; the half-split RoPE of
    layers.apply_rope wants (x0, x2, ...) then (x1, x3, ...): this order of the rope features."""
    return np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])


def _mla_map(m: WeightMap, cfg: ModelConfig, o: str, p: str) -> None:
    """DeepSeek-V3's latent attention (models/mla.py): q_proj or q_a_proj / q_a_layernorm / q_b_proj,
    kv_a_proj_with_mqa / kv_a_layernorm, kv_b_proj split into the keys' and the values' up-projections,
    o_proj; the RoPE features of the queries and of kv_a de-interleaved (cfg.mla_rope_interleave)."""
    h, d, r = cfg.n_heads, cfg.d_model, cfg.mla_kv_rank
    nope, rope, v, qr = cfg.mla_nope_dim, cfg.mla_rope_dim, cfg.mla_v_dim, cfg.mla_q_rank
    qk = nope + rope
    perm = _deinterleave(rope) if cfg.mla_rope_interleave else np.arange(rope)
    q_cols = np.concatenate([np.arange(nope), nope + perm])            # within each head's qk features
    kv_cols = np.concatenate([np.arange(r), r + perm])
    heads_out = lambda w, n_in: w.reshape(h, qk, n_in)[:, q_cols].transpose(2, 0, 1)  # noqa: E731  [out, in] -> [in, H, qk]
    if qr:
        m[f"{o}/q_down"] = ((f"{p}.q_a_proj.weight",), _t)
        _norm(m, f"{o}/q_norm", f"{p}.q_a_layernorm", False)
        m[f"{o}/q_up"] = ((f"{p}.q_b_proj.weight",), lambda w: heads_out(w, qr))
        if cfg.out_bias:
            m[f"{o}/q_down_bias"] = ((f"{p}.q_a_proj.bias",), _ident)
    else:
        m[f"{o}/q_full"] = ((f"{p}.q_proj.weight",), lambda w: heads_out(w, d))
    m[f"{o}/kv_down"] = ((f"{p}.kv_a_proj_with_mqa.weight",), lambda w: w[kv_cols].T)
    if cfg.out_bias:
        m[f"{o}/kv_down_bias"] = ((f"{p}.kv_a_proj_with_mqa.bias",), lambda b: b[kv_cols])
    _norm(m, f"{o}/kv_norm", f"{p}.kv_a_layernorm", False)
    up = lambda w: w.reshape(h, nope + v, r).transpose(2, 0, 1)  # noqa: E731   [H (nope + v), r] -> [r, H, nope + v]
    m[f"{o}/k_up"] = ((f"{p}.kv_b_proj.weight",), lambda w: up(w)[..., :nope])
    m[f"{o}/v_up"] = ((f"{p}.kv_b_proj.weight",), lambda w: up(w)[..., nope:])
    m[f"{o}/o"] = ((f"{p}.o_proj.weight",), lambda w: w.T.reshape(h, v, d))


def _experts_map(m: WeightMap, cfg: ModelConfig, o: str, p: str) -> None:
    """One MoE layer's router and experts (module docstring), by architecture."""
    e = range(cfg.num_experts)
    if cfg.architecture == "GptOssForCausalLM":
        x = f"{p}.mlp.experts"
        m[f"{o}/mlp/router"] = ((f"{p}.mlp.router.weight",), _t)
        m[f"{o}/mlp/router_bias"] = ((f"{p}.mlp.router.bias",), _ident)
        for ours, first in (("gate", 0), ("up", 1)):
            m[f"{o}/mlp/{ours}"] = ((f"{x}.gate_up_proj",), lambda w, j=first: w[..., j::2])
            m[f"{o}/mlp/{ours}_bias"] = ((f"{x}.gate_up_proj_bias",), lambda b, j=first: b[..., j::2])
        m[f"{o}/mlp/down"] = ((f"{x}.down_proj",), _ident)
        m[f"{o}/mlp/down_bias"] = ((f"{x}.down_proj_bias",), _ident)
        return
    if cfg.architecture in ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteMoeHybridForCausalLM"):
        _granite_experts(m, cfg, o, p)
        return
    minimax = cfg.architecture == "MiniMaxM2ForCausalLM"   # Mixtral's names
    lfm2 = cfg.architecture == "Lfm2MoeForCausalLM"        # Mixtral's experts under feed_forward
    w123 = {"gate": "w1", "up": "w3", "down": "w2"}
    block, names = (("block_sparse_moe", w123) if cfg.architecture in ("MixtralForCausalLM", "PhimoeForCausalLM")
                    or minimax else ("feed_forward", w123) if lfm2 else
                    ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}))
    hunyuan = cfg.architecture == "HunYuanMoEV1ForCausalLM"   # its router in gate.wg, its shared MLP shared_mlp
    afmoe = cfg.architecture == "AfmoeForCausalLM"   # its router in router.gate, its correction expert_bias
    router = "gate.wg" if hunyuan else "router.gate" if afmoe else "gate"
    m[f"{o}/mlp/router"] = ((f"{p}.{block}.{router}.weight",), _t)
    parts = ("gate", "up", "down") if cfg.gated_mlp else ("up", "down")   # (Nemotron 3's experts: up, down)
    names = {ours: names[ours] for ours in parts}
    for ours, theirs in names.items():
        m[f"{o}/mlp/{ours}"] = (tuple(f"{p}.{block}.experts.{j}.{theirs}.weight" for j in e), _stack_t)
    if cfg.moe_routing == "sigmoid_topk":   # DeepSeek-V3 / GLM-4.5's choice correction
        beside = cfg.architecture in ("MiniMaxM2ForCausalLM", "ExaoneMoeForCausalLM")   # not in the gate
        correction = "expert_bias" if afmoe or lfm2 else f"{'' if beside else 'gate.'}e_score_correction_bias"
        m[f"{o}/mlp/router_correction"] = ((f"{p}.{block}.{correction}",), _ident)
    elif cfg.moe_routing == "softmax_corrected_topk":   # ERNIE 4.5's, [1, E] in its moe_statics
        m[f"{o}/mlp/router_correction"] = ((f"{p}.{block}.moe_statics.e_score_correction_bias",),
                                           lambda b: b.reshape(-1))
    if cfg.moe_shared_ffn_dim:   # Qwen2-MoE: shared_expert (+ its gate); GLM-4.5 / DeepSeek: shared_experts
        shared = "shared_mlp" if hunyuan else "shared_expert" if cfg.moe_shared_gate else "shared_experts"
        for ours in parts:
            m[f"{o}/mlp/shared/{ours}"] = ((f"{p}.{block}.{shared}.{ours}_proj.weight",), _t)
        if cfg.moe_shared_gate:
            m[f"{o}/mlp/shared_gate"] = ((f"{p}.{block}.shared_expert_gate.weight",), _t)


def _granite_experts(m: WeightMap, cfg: ModelConfig, o: str, p: str) -> None:
    """Granite MoE's experts stacked as torch Linears: input_linear [E, 2F, d] (gate's rows, then up's),
    output_linear [E, d, F], the router in router.layer; GraniteMoeShared's shared_mlp the same way
    unstacked ([2S, d], [d, S])."""
    x, f, s = f"{p}.block_sparse_moe", cfg.expert_ffn_dim, cfg.moe_shared_ffn_dim
    m[f"{o}/mlp/router"] = ((f"{x}.router.layer.weight",), _t)
    m[f"{o}/mlp/gate"] = ((f"{x}.input_linear.weight",), lambda w: w[:, :f].transpose(0, 2, 1))
    m[f"{o}/mlp/up"] = ((f"{x}.input_linear.weight",), lambda w: w[:, f:].transpose(0, 2, 1))
    m[f"{o}/mlp/down"] = ((f"{x}.output_linear.weight",), lambda w: w.transpose(0, 2, 1))
    if s:
        m[f"{o}/mlp/shared/gate"] = ((f"{p}.shared_mlp.input_linear.weight",), lambda w: w[:s].T)
        m[f"{o}/mlp/shared/up"] = ((f"{p}.shared_mlp.input_linear.weight",), lambda w: w[s:].T)
        m[f"{o}/mlp/shared/down"] = ((f"{p}.shared_mlp.output_linear.weight",), _t)


def _gpt2_map(cfg: ModelConfig) -> WeightMap:
    """GPT-2 (Conv1D tensors [in, out]; c_attn's columns [q | k | v]) and GPTBigCode (GPT-2's names over
    nn.Linear tensors [out, in]; c_attn's rows in KV groups: [q | k | v] with one KV head, where
    multi_query, per head [q, k, v] without)."""
    h, hd, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    linear = cfg.architecture == "GPTBigCodeForCausalLM"
    m: WeightMap = {"embed": (("transformer.wte.weight",), _ident),
                    "pos_embed": (("transformer.wpe.weight",), _ident)}
    for i in range(cfg.n_layers):
        p, o = f"transformer.h.{i}", f"layers/{i}"
        _norm(m, f"{o}/attn_norm", f"{p}.ln_1", True)
        _norm(m, f"{o}/mlp_norm", f"{p}.ln_2", True)
        for j, name in enumerate("qkv"):
            w_fn, b_fn = (_kv_grouped(cfg, name) if linear else
                          (lambda w, j=j: w[:, j * d:(j + 1) * d].reshape(d, h, hd),
                           lambda b, j=j: b[j * d:(j + 1) * d].reshape(h, hd)))
            m[f"{o}/attn/{name}"] = ((f"{p}.attn.c_attn.weight",), w_fn)
            m[f"{o}/attn/{name}_bias"] = ((f"{p}.attn.c_attn.bias",), b_fn)
        m[f"{o}/attn/o"] = ((f"{p}.attn.c_proj.weight",), lambda w, t=linear: (w.T if t else w).reshape(h, hd, d))
        m[f"{o}/attn/o_bias"] = ((f"{p}.attn.c_proj.bias",), _ident)
        for ours, theirs in (("up", "c_fc"), ("down", "c_proj")):
            m[f"{o}/mlp/{ours}"] = ((f"{p}.mlp.{theirs}.weight",), _t if linear else _ident)
            m[f"{o}/mlp/{ours}_bias"] = ((f"{p}.mlp.{theirs}.bias",), _ident)
    _norm(m, "final_norm", "transformer.ln_f", True)
    if not cfg.tie_embeddings:
        m["lm_head"] = (("lm_head.weight",), _t)
    return m


def _kv_grouped(cfg: ModelConfig, part: str) -> tuple[Transform, Transform]:
    """(weight, bias) transforms taking q, k or v from a fused tensor whose rows come in KV groups,
    [kv, h / kv + 2, head_dim]: each KV head's query heads, then its key and its value (Falcon's
    query_key_value, GPTBigCode's c_attn). A tensor of another height does not reshape: refused."""
    h, kv, hd, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    g = h // kv
    rows = {"q": slice(0, g), "k": slice(g, g + 1), "v": slice(g + 1, g + 2)}[part]
    return (lambda w: w.reshape(kv, g + 2, hd, d)[:, rows].reshape(-1, hd, d).transpose(2, 0, 1),
            lambda b: b.reshape(kv, g + 2, hd)[:, rows].reshape(-1, hd))


def _falcon_map(cfg: ModelConfig) -> WeightMap:
    """Falcon: query_key_value's rows in KV groups, each its h / kv query heads, then its key and
    value head ([kv, h / kv + 2, head_dim]: [q | k | v] with one KV head, per head [q, k, v]
    without multi_query: one layout for the three of FalconAttention); the block's norms
    input_layernorm (+ post_attention_layernorm, sequential) or ln_attn and ln_mlp."""
    h, hd, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    m: WeightMap = {"embed": (("transformer.word_embeddings.weight",), _ident)}
    norms = ({"attn_norm": "ln_attn", "mlp_norm": "ln_mlp"} if cfg.parallel_mlp_norm else
             {"attn_norm": "input_layernorm"} if cfg.parallel_block else
             {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"})
    for i in range(cfg.n_layers):
        p, o = f"transformer.h.{i}", f"layers/{i}"
        for ours, theirs in norms.items():
            _norm(m, f"{o}/{ours}", f"{p}.{theirs}", True)
        for name in "qkv":
            w_fn, b_fn = _kv_grouped(cfg, name)
            m[f"{o}/attn/{name}"] = ((f"{p}.self_attention.query_key_value.weight",), w_fn)
            if cfg.qkv_bias:
                m[f"{o}/attn/{name}_bias"] = ((f"{p}.self_attention.query_key_value.bias",), b_fn)
        m[f"{o}/attn/o"] = ((f"{p}.self_attention.dense.weight",), lambda w: w.T.reshape(h, hd, d))
        if cfg.out_bias:
            m[f"{o}/attn/o_bias"] = ((f"{p}.self_attention.dense.bias",), _ident)
        for ours, theirs in (("up", "dense_h_to_4h"), ("down", "dense_4h_to_h")):
            m[f"{o}/mlp/{ours}"] = ((f"{p}.mlp.{theirs}.weight",), _t)
            if cfg.mlp_bias:
                m[f"{o}/mlp/{ours}_bias"] = ((f"{p}.mlp.{theirs}.bias",), _ident)
    _norm(m, "final_norm", "transformer.ln_f", True)
    if not cfg.tie_embeddings:
        m["lm_head"] = (("lm_head.weight",), _t)
    return m


# OPT offsets every position by 2 (OPTLearnedPositionalEmbedding): its table's first two rows are unused
OPT_POSITION_OFFSET = 2


def _linear_block(m: WeightMap, cfg: ModelConfig, o: str, p: str, norms: tuple[str, str], attn: str,
                  mlp: tuple[str, str]) -> None:
    """A pre-LayerNorm block over nn.Linear tensors [out, in] (GPT-Neo, OPT): the norms {p}.{norms},
    {p}.{attn}.q_proj / k_proj / v_proj / out_proj, the ungated MLP's {p}.{mlp} (up, down), biases
    where the config has them."""
    h, hd, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    for ours, theirs in zip(("attn_norm", "mlp_norm"), norms):
        _norm(m, f"{o}/{ours}", f"{p}.{theirs}", True)
    for name in "qkv":
        m[f"{o}/attn/{name}"] = ((f"{p}.{attn}.{name}_proj.weight",), lambda w: w.T.reshape(d, h, hd))
        if cfg.qkv_bias:
            m[f"{o}/attn/{name}_bias"] = ((f"{p}.{attn}.{name}_proj.bias",), lambda b: b.reshape(h, hd))
    m[f"{o}/attn/o"] = ((f"{p}.{attn}.out_proj.weight",), lambda w: w.T.reshape(h, hd, d))
    if cfg.out_bias:
        m[f"{o}/attn/o_bias"] = ((f"{p}.{attn}.out_proj.bias",), _ident)
    for ours, theirs in zip(("up", "down"), mlp):
        m[f"{o}/mlp/{ours}"] = ((f"{p}.{theirs}.weight",), _t)
        if cfg.mlp_bias:
            m[f"{o}/mlp/{ours}_bias"] = ((f"{p}.{theirs}.bias",), _ident)


def _opt_map(cfg: ModelConfig) -> WeightMap:
    """OPT: model.decoder.{embed_tokens, embed_positions (rows from OPT_POSITION_OFFSET), layers.i,
    final_layer_norm}; per layer self_attn_layer_norm, self_attn.q / k / v / out_proj, final_layer_norm
    (the MLP's), fc1, fc2. Uploads saved from OPTModel lack the leading `model.` (OPTIONAL_PREFIXES)."""
    m: WeightMap = {"embed": (("model.decoder.embed_tokens.weight",), _ident),
                    "pos_embed": (("model.decoder.embed_positions.weight",), lambda w: w[OPT_POSITION_OFFSET:])}
    for i in range(cfg.n_layers):
        _linear_block(m, cfg, f"layers/{i}", f"model.decoder.layers.{i}", ("self_attn_layer_norm", "final_layer_norm"),
                      "self_attn", ("fc1", "fc2"))
    _norm(m, "final_norm", "model.decoder.final_layer_norm", True)
    if not cfg.tie_embeddings:
        m["lm_head"] = (("lm_head.weight",), _t)
    return m


def _gpt_neo_map(cfg: ModelConfig) -> WeightMap:
    """GPT-Neo: transformer.{wte, wpe, h.i, ln_f}; per layer ln_1, attn.attention.q / k / v_proj (no
    biases), out_proj, ln_2, mlp.c_fc / c_proj."""
    m: WeightMap = {"embed": (("transformer.wte.weight",), _ident), "pos_embed": (("transformer.wpe.weight",), _ident)}
    for i in range(cfg.n_layers):
        _linear_block(m, cfg, f"layers/{i}", f"transformer.h.{i}", ("ln_1", "ln_2"), "attn.attention",
                      ("mlp.c_fc", "mlp.c_proj"))
    _norm(m, "final_norm", "transformer.ln_f", True)
    if not cfg.tie_embeddings:
        m["lm_head"] = (("lm_head.weight",), _t)
    return m


def _per_head_qkv_block(m: WeightMap, cfg: ModelConfig, o: str, p: str, attn: str) -> None:
    """BLOOM's and GPT-NeoX's block: LayerNorms before attention and MLP, q, k, v fused per head in
    {attn}.query_key_value ([h, 3, hd] rows), {attn}.dense, the ungated mlp.dense_h_to_4h /
    dense_4h_to_h, biases where the config has them."""
    h, hd, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    _norm(m, f"{o}/attn_norm", f"{p}.input_layernorm", True)
    _norm(m, f"{o}/mlp_norm", f"{p}.post_attention_layernorm", True)
    for j, name in enumerate("qkv"):
        m[f"{o}/attn/{name}"] = ((f"{p}.{attn}.query_key_value.weight",),
                                 lambda w, j=j: w.reshape(h, 3, hd, d)[:, j].transpose(2, 0, 1))
        if cfg.qkv_bias:
            m[f"{o}/attn/{name}_bias"] = ((f"{p}.{attn}.query_key_value.bias",), lambda b, j=j: b.reshape(h, 3, hd)[:, j])
    m[f"{o}/attn/o"] = ((f"{p}.{attn}.dense.weight",), lambda w: w.T.reshape(h, hd, d))
    if cfg.out_bias:
        m[f"{o}/attn/o_bias"] = ((f"{p}.{attn}.dense.bias",), _ident)
    for ours, theirs in (("up", "dense_h_to_4h"), ("down", "dense_4h_to_h")):
        m[f"{o}/mlp/{ours}"] = ((f"{p}.mlp.{theirs}.weight",), _t)
        if cfg.mlp_bias:
            m[f"{o}/mlp/{ours}_bias"] = ((f"{p}.mlp.{theirs}.bias",), _ident)


def _bloom_map(cfg: ModelConfig) -> WeightMap:
    m: WeightMap = {"embed": (("transformer.word_embeddings.weight",), _ident)}
    _norm(m, "embed_norm", "transformer.word_embeddings_layernorm", True)
    for i in range(cfg.n_layers):
        _per_head_qkv_block(m, cfg, f"layers/{i}", f"transformer.h.{i}", "self_attention")
    _norm(m, "final_norm", "transformer.ln_f", True)
    if not cfg.tie_embeddings:
        m["lm_head"] = (("lm_head.weight",), _t)
    return m


# Phi-1 / 1.5 / 2's names for what _llama_map names otherwise (module name parts, in this order)
_PHI_NAMES = ((".self_attn.o_proj.", ".self_attn.dense."), (".mlp.c_fc.", ".mlp.fc1."), (".mlp.c_proj.", ".mlp.fc2."),
              ("model.norm.", "model.final_layernorm."), ("_norm.", "_layernorm."))


# Llama 4's MLP is its feed_forward: router, experts (fused: hf_weight_map), shared_expert, or a dense MLP
_LLAMA4_NAMES = ((".mlp.gate.weight", ".feed_forward.router.weight"),
                 (".mlp.shared_experts.", ".feed_forward.shared_expert."), (".mlp.", ".feed_forward."))


# LFM2's names for _llama_map's tensors (its attention layers' q / k norms, output projection, MLP, norms)
_LFM2_NAMES = ((".self_attn.q_norm.", ".self_attn.q_layernorm."), (".self_attn.k_norm.", ".self_attn.k_layernorm."),
               (".self_attn.o_proj.", ".self_attn.out_proj."), (".mlp.gate_proj.", ".feed_forward.w1."),
               (".mlp.up_proj.", ".feed_forward.w3."), (".mlp.down_proj.", ".feed_forward.w2."),
               (".input_layernorm.", ".operator_norm."), (".post_attention_layernorm.", ".ffn_norm."),
               ("model.norm.", "model.embedding_norm."))


def _lfm2_map(cfg: ModelConfig) -> WeightMap:
    """LFM2: _llama_map under its names, each conv layer's attention replaced by conv.in_proj [3d, d]
    (its rows B, C, x), conv.conv [d, 1, L] (the taps; llama.cpp's converter squeezes it to [d, L]) and
    conv.out_proj [d, d], biased where conv_bias."""
    m = _renamed(_llama_map(cfg), _LFM2_NAMES)
    for i in range(cfg.n_layers):
        if not cfg.is_conv_layer(i):
            continue
        o, p = f"layers/{i}/attn", f"model.layers.{i}.conv"
        m = {k: v for k, v in m.items() if not k.startswith(f"{o}/")}
        m[f"{o}/in_proj"] = ((f"{p}.in_proj.weight",), _t)
        m[f"{o}/conv"] = ((f"{p}.conv.weight",), lambda w: (w[:, 0, :] if w.ndim == 3 else w).T)   # (GGUF: [d, L])
        m[f"{o}/out_proj"] = ((f"{p}.out_proj.weight",), _t)
        if cfg.conv_bias:
            for name in ("in_proj", "conv", "out_proj"):
                m[f"{o}/{name}_bias"] = ((f"{p}.{name}.bias",), _ident)
    return m


def _granitemoehybrid_map(cfg: ModelConfig) -> WeightMap:
    """Granite 4.0-H: _llama_map with GraniteMoeShared's experts and shared MLP where num_experts, else
    that shared_mlp alone as the MLP (input_linear [2F, d]: gate's rows, then up's; output_linear);
    each Mamba-2 layer's mixer under mamba (_mamba2_layers)."""
    m = _llama_map(cfg)
    f = cfg.ffn_dim
    for i in range(cfg.n_layers):
        o, p = f"layers/{i}", f"model.layers.{i}"
        if not cfg.is_moe_layer(i):
            m[f"{o}/mlp/gate"] = ((f"{p}.shared_mlp.input_linear.weight",), lambda w: _rows(w, 0, f, 2 * f).T)
            m[f"{o}/mlp/up"] = ((f"{p}.shared_mlp.input_linear.weight",), lambda w: _rows(w, f, 2 * f, 2 * f).T)
            m[f"{o}/mlp/down"] = ((f"{p}.shared_mlp.output_linear.weight",), _t)
    return _mamba2_layers(m, cfg)


# Bamba's names for Llama's MLP and norms
_BAMBA_NAMES = ((".mlp.", ".feed_forward."), (".post_attention_layernorm.", ".pre_ff_layernorm."),
                ("model.norm.", "model.final_layernorm."))


def _bamba_map(cfg: ModelConfig) -> WeightMap:
    """Bamba: _llama_map under Bamba's names (feed_forward, pre_ff_layernorm, final_layernorm), its
    Mamba-2 layers Granite 4.0-H's (_mamba2_layers)."""
    return _mamba2_layers(_renamed(_llama_map(cfg), _BAMBA_NAMES), cfg)


def _nemotron_h_map(cfg: ModelConfig) -> WeightMap:
    """Nemotron-H: block j's mixer is the checkpoint's layer m_j (its norm and mixer: attention's q / k /
    v / o_proj, or _mamba2_layers' Mamba-2 tensors) and its MLP, where it has one, layer m_j + 1 (norm,
    mixer.up_proj / down_proj); an MLP block's is layer m_j itself; embeddings, norm_f; all under
    backbone., as the uploads and transformers' save_pretrained write them."""
    first, at = [], 0
    for j in range(cfg.n_layers):
        first.append(at)
        at += cfg.has_mixer(j) + cfg.has_mlp(j)
    out: WeightMap = {}
    for ours, (names, fn) in _llama_map(cfg).items():
        parts = ours.split("/")
        if parts[0] == "layers":
            j = int(parts[1])
            if parts[2] in ("mlp", "mlp_norm") and not cfg.has_mlp(j) or parts[2] in ("attn", "attn_norm") and not (
                    cfg.has_mixer(j)):
                continue
        out[ours] = (tuple(_nemotron_h_name(n, first, cfg) for n in names), fn)
    return _mamba2_layers(out, cfg, lambda j: f"backbone.layers.{first[j]}.mixer")


def _nemotron_h_name(name: str, first: list[int], cfg: ModelConfig) -> str:
    """One of _llama_map's tensor names under Nemotron-H's (first: each block's first layer)."""
    if not name.startswith("model.layers."):
        return {"model.embed_tokens.weight": "backbone.embeddings.weight",
                "model.norm.weight": "backbone.norm_f.weight"}.get(name, name)
    j, rest = name[len("model.layers."):].split(".", 1)
    part, tail = rest.split(".", 1)
    mlp = int(cfg.has_mixer(int(j)))   # the MLP's layer after the block's first
    layer, new = {"input_layernorm": (0, "norm"), "self_attn": (0, "mixer"), "post_attention_layernorm": (mlp, "norm"),
                  "mlp": (mlp, "mixer")}[part]
    return f"backbone.layers.{first[int(j)] + layer}.{new}.{tail}"


def _mamba2_layers(m: WeightMap, cfg: ModelConfig,
                   where: Callable[[int], str] = lambda i: f"model.layers.{i}.mamba") -> WeightMap:
    """Each Mamba-2 layer's mixer in place of its attention: under mamba, in_proj [I + C + H, d] (rows
    z, then x / B / C, then dt) split into in_proj_z, in_proj_qkv and in_proj_a; conv1d.weight [C, 1, L]
    and its bias, dt_bias, A_log, D, the gated norm's weight [I] and out_proj (`where`: layer i's mixer's
    tensor prefix)."""
    inner, c, h = cfg.linear_v_heads * cfg.linear_v_dim, cfg.linear_conv_dim, cfg.linear_v_heads
    for i in range(cfg.n_layers):
        if not cfg.is_mamba_layer(i):
            continue
        o, a = f"layers/{i}", where(i)
        m = {k: v for k, v in m.items() if not k.startswith(f"{o}/attn/")}
        for ours, lo, hi in (("in_proj_z", 0, inner), ("in_proj_qkv", inner, inner + c),
                             ("in_proj_a", inner + c, inner + c + h)):
            m[f"{o}/attn/{ours}"] = ((f"{a}.in_proj.weight",), lambda w, lo=lo, hi=hi: _rows(w, lo, hi, inner + c + h).T)
        m[f"{o}/attn/conv"] = ((f"{a}.conv1d.weight",), lambda w: (w[:, 0, :] if w.ndim == 3 else w).T)
        if cfg.conv_bias:
            m[f"{o}/attn/conv_bias"] = ((f"{a}.conv1d.bias",), _ident)
        for name in ("dt_bias", "A_log", "D"):
            m[f"{o}/attn/{name}"] = ((f"{a}.{name}",), _ident)
        m[f"{o}/attn/norm"] = ((f"{a}.norm.weight",), _ident)
        m[f"{o}/attn/out_proj"] = ((f"{a}.out_proj.weight",), _t)
    return m


def _qwen3_next_map(cfg: ModelConfig) -> WeightMap:
    """Qwen3-Next, Qwen3.5, Qwen3.5-MoE: _llama_map (with Qwen2-MoE's experts), each attention layer's
    q_proj [H 2 hd, d] holding per head its hd query rows then hd gate rows (the gate: out_gate), and
    each Gated DeltaNet layer under linear_attn: Qwen3.5's in_proj_qkv [2 Hk dk + Hv dv, d] (rows q, k,
    v), in_proj_z, in_proj_b, in_proj_a; or Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped per key head
    (q, k, then its Hv / Hk value heads' v and z; b then a), regrouped here into those; the taps
    conv1d.weight [C, 1, L], dt_bias, A_log, the gated norm's weight and out_proj."""
    m = _llama_map(cfg)
    h, hd, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    hk, dk, dv, r = cfg.linear_k_heads, cfg.linear_k_dim, cfg.linear_v_dim, cfg.linear_v_heads // max(cfg.linear_k_heads, 1)
    next_layout = cfg.architecture == "Qwen3NextForCausalLM"

    def qkvz(w: np.ndarray, part: str) -> np.ndarray:
        g = _rows(w, 0, w.shape[0], hk * (2 * dk + 2 * r * dv)).reshape(hk, 2 * dk + 2 * r * dv, -1)
        cut = {"q": (0, dk), "k": (dk, 2 * dk), "v": (2 * dk, 2 * dk + r * dv), "z": (2 * dk + r * dv, None)}
        if part == "qkv":
            return np.concatenate([qkvz(w, n) for n in "qkv"], axis=1)
        lo, hi = cut[part]
        return g[:, lo:hi].reshape(-1, g.shape[-1]).T

    def ba(w: np.ndarray, part: str) -> np.ndarray:
        g = _rows(w, 0, w.shape[0], 2 * hk * r).reshape(hk, 2 * r, -1)
        return (g[:, :r] if part == "b" else g[:, r:]).reshape(-1, g.shape[-1]).T

    for i in range(cfg.n_layers):
        o, p = f"layers/{i}/attn", f"model.layers.{i}"
        if not cfg.is_linear_layer(i):
            q = f"{p}.self_attn.q_proj.weight"
            m[f"{o}/q"] = ((q,), lambda w: w.T.reshape(d, h, 2, hd)[:, :, 0])
            m[f"{o}/out_gate"] = ((q,), lambda w: w.T.reshape(d, h, 2, hd)[:, :, 1])
            continue
        m = {k: v for k, v in m.items() if not k.startswith(f"{o}/")}
        a = f"{p}.linear_attn"
        if next_layout:
            for ours, part in (("in_proj_qkv", "qkv"), ("in_proj_z", "z")):
                m[f"{o}/{ours}"] = ((f"{a}.in_proj_qkvz.weight",), lambda w, part=part: qkvz(w, part))
            for ours, part in (("in_proj_b", "b"), ("in_proj_a", "a")):
                m[f"{o}/{ours}"] = ((f"{a}.in_proj_ba.weight",), lambda w, part=part: ba(w, part))
        else:
            for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
                m[f"{o}/{name}"] = ((f"{a}.{name}.weight",), _t)
        m[f"{o}/conv"] = ((f"{a}.conv1d.weight",), lambda w: (w[:, 0, :] if w.ndim == 3 else w).T)
        m[f"{o}/dt_bias"] = ((f"{a}.dt_bias",), _ident)
        m[f"{o}/A_log"] = ((f"{a}.A_log",), _ident)
        m[f"{o}/norm"] = ((f"{a}.norm.weight",), _ident)
        m[f"{o}/out_proj"] = ((f"{a}.out_proj.weight",), _t)
    return m


def _renamed(m: WeightMap, pairs: tuple[tuple[str, str], ...]) -> WeightMap:
    """A map's entries under another family's tensor names: each (Llama's, theirs) substring replaced,
    in order."""
    def rename(name: str) -> str:
        for ours, theirs in pairs:
            name = name.replace(ours, theirs)
        return name
    return {ours: (tuple(rename(n) for n in names), fn) for ours, (names, fn) in m.items()}


def _phi_map(cfg: ModelConfig) -> WeightMap:
    """Phi-1 / 1.5 / 2: _llama_map's parallel block (one input_layernorm) under Phi's names (dense,
    fc1 / fc2, final_layernorm; q_layernorm / k_layernorm over each head, with biases, where
    qk_layernorm), and the LM head's bias."""
    m = _renamed(_llama_map(cfg), _PHI_NAMES)
    for i in range(cfg.n_layers) if cfg.qk_norm else ():
        for name in "qk":
            m[f"layers/{i}/attn/{name}_norm/bias"] = ((f"model.layers.{i}.self_attn.{name}_layernorm.bias",), _ident)
    return m


def _hunyuan_map(cfg: ModelConfig) -> WeightMap:
    """HunYuan: _llama_map's names, its q / k norms as query_layernorm / key_layernorm."""
    return _renamed(_llama_map(cfg), ((".self_attn.q_norm.", ".self_attn.query_layernorm."),
                                      (".self_attn.k_norm.", ".self_attn.key_layernorm.")))


# GPT-J's names of _llama_map's parallel block (one ln_1; the ungated MLP's c_fc / c_proj)
_GPTJ_NAMES = (("model.embed_tokens.", "transformer.wte."), ("model.layers.", "transformer.h."),
               ("model.norm.", "transformer.ln_f."), (".input_layernorm.", ".ln_1."),
               (".self_attn.o_proj.", ".attn.out_proj."), (".self_attn.", ".attn."), (".mlp.c_fc.", ".mlp.fc_in."),
               (".mlp.c_proj.", ".mlp.fc_out."))
# InternLM2's names of Llama's tensors (its fused wqkv apart: _internlm2_map)
_INTERNLM2_NAMES = (("model.embed_tokens.", "model.tok_embeddings."), (".self_attn.o_proj.", ".attention.wo."),
                    (".input_layernorm.", ".attention_norm."), (".post_attention_layernorm.", ".ffn_norm."),
                    (".mlp.gate_proj.", ".feed_forward.w1."), (".mlp.up_proj.", ".feed_forward.w3."),
                    (".mlp.down_proj.", ".feed_forward.w2."), ("lm_head.", "output."))


def _internlm2_map(cfg: ModelConfig) -> WeightMap:
    """InternLM2 / 2.5: _llama_map's tensors under its names, q, k and v from attention.wqkv, whose rows
    come in KV groups (each KV head's query heads, then its key and value: _kv_grouped)."""
    m = _renamed(_llama_map(cfg), _INTERNLM2_NAMES)
    for i in range(cfg.n_layers):
        p, o = f"model.layers.{i}.attention.wqkv", f"layers/{i}/attn"
        for name in "qkv":
            w_fn, b_fn = _kv_grouped(cfg, name)
            m[f"{o}/{name}"] = ((f"{p}.weight",), w_fn)
            if cfg.qkv_bias:
                m[f"{o}/{name}_bias"] = ((f"{p}.bias",), b_fn)
    return m


# EXAONE 3.0 / 3.5's names of Llama's tensors (transformers' conversion_mapping reads them as these)
_EXAONE_NAMES = (("model.embed_tokens.", "transformer.wte."), ("model.layers.", "transformer.h."),
                 ("model.norm.", "transformer.ln_f."), (".self_attn.o_proj.", ".attn.attention.out_proj."),
                 (".self_attn.", ".attn.attention."), (".input_layernorm.", ".ln_1."),
                 (".post_attention_layernorm.", ".ln_2."), (".mlp.gate_proj.", ".mlp.c_fc_0."),
                 (".mlp.up_proj.", ".mlp.c_fc_1."), (".mlp.down_proj.", ".mlp.c_proj."))


def _stablelm_map(cfg: ModelConfig) -> WeightMap:
    """StableLM: _llama_map's names; StableLM 2 12B's q / k LayerNorms are one bias-free LayerNorm per
    head (q_layernorm.norms.j), stacked into our per-head weights [heads, head_dim]."""
    m = _llama_map(cfg)
    for i in range(cfg.n_layers) if cfg.qk_norm_heads else ():
        for name, heads in (("q", cfg.n_heads), ("k", cfg.n_kv_heads)):
            per_head = tuple(f"model.layers.{i}.self_attn.{name}_layernorm.norms.{j}.weight" for j in range(heads))
            m[f"layers/{i}/attn/{name}_norm/scale"] = (per_head, lambda *w: np.stack(w))
    return m


def _neox_map(cfg: ModelConfig) -> WeightMap:
    """GPT-NeoX (Pythia): BLOOM's block under gpt_neox.layers.i.attention (_per_head_qkv_block; side by
    side when use_parallel_residual), the LM head in embed_out (transformers 5 reads it as lm_head
    and writes embed_out back)."""
    m: WeightMap = {"embed": (("gpt_neox.embed_in.weight",), _ident)}
    for i in range(cfg.n_layers):
        _per_head_qkv_block(m, cfg, f"layers/{i}", f"gpt_neox.layers.{i}", "attention")
    _norm(m, "final_norm", "gpt_neox.final_layer_norm", True)
    if not cfg.tie_embeddings:
        m["lm_head"] = (("embed_out.weight",), _t)
    return m


_MAPS = {"LlamaForCausalLM": _llama_map, "MistralForCausalLM": _llama_map, "Qwen2ForCausalLM": _llama_map,
         "Qwen3ForCausalLM": _llama_map, "GemmaForCausalLM": _llama_map, "Gemma2ForCausalLM": _llama_map,
         "VaultGemmaForCausalLM": _llama_map,
         "Gemma3ForCausalLM": _llama_map, "ArceeForCausalLM": _llama_map, "HeliumForCausalLM": _llama_map,
         "Phi3ForCausalLM": lambda cfg: _llama_map(cfg, fused=True), "MixtralForCausalLM": _llama_map,
         "Qwen3MoeForCausalLM": _llama_map, "Qwen2MoeForCausalLM": _llama_map, "Glm4MoeForCausalLM": _llama_map,
         "DeepseekV3ForCausalLM": _llama_map, "DeepseekV2ForCausalLM": _llama_map, "Glm4MoeLiteForCausalLM": _llama_map,
         "MiniMaxM2ForCausalLM": _llama_map, "MinistralForCausalLM": _llama_map, "Dots1ForCausalLM": _llama_map,
         "CwmForCausalLM": _llama_map, "GraniteSWAForCausalLM": _llama_map,
         "Jais2ForCausalLM": _llama_map, "NemotronForCausalLM": _llama_map,
         "SolarOpenForCausalLM": _llama_map, "ExaoneMoeForCausalLM": _llama_map,
         "GptOssForCausalLM": _llama_map, "SmolLM3ForCausalLM": _llama_map,
         "GraniteForCausalLM": _llama_map, "Olmo2ForCausalLM": _llama_map, "Olmo3ForCausalLM": _llama_map,
         "Exaone4ForCausalLM": _llama_map, "SeedOssForCausalLM": _llama_map,
         "GlmForCausalLM": lambda cfg: _llama_map(cfg, fused_mlp=True),
         "Glm4ForCausalLM": lambda cfg: _llama_map(cfg, fused_mlp=True), "Starcoder2ForCausalLM": _llama_map,
         "CohereForCausalLM": _llama_map, "Cohere2ForCausalLM": _llama_map, "Ernie4_5ForCausalLM": _llama_map,
         "Ernie4_5_MoeForCausalLM": _llama_map,
         "GPT2LMHeadModel": _gpt2_map, "GPTBigCodeForCausalLM": _gpt2_map,
         "FalconForCausalLM": _falcon_map, "BloomForCausalLM": _bloom_map,
         "GPTNeoXForCausalLM": _neox_map, "PhiForCausalLM": _phi_map,
         "StableLmForCausalLM": _stablelm_map, "GraniteMoeForCausalLM": _llama_map,
         "GraniteMoeSharedForCausalLM": _llama_map, "OlmoeForCausalLM": _llama_map,
         "Ministral3ForCausalLM": _llama_map, "HunYuanDenseV1ForCausalLM": _hunyuan_map,
         "HunYuanMoEV1ForCausalLM": _hunyuan_map, "InternLM3ForCausalLM": _llama_map,
         "ExaoneForCausalLM": lambda cfg: _renamed(_llama_map(cfg), _EXAONE_NAMES), "AfmoeForCausalLM": _llama_map,
         "PhimoeForCausalLM": _llama_map, "ApertusForCausalLM": _llama_map,
         "GPTJForCausalLM": lambda cfg: _renamed(_llama_map(cfg), _GPTJ_NAMES), "OlmoForCausalLM": _llama_map,
         "InternLM2ForCausalLM": _internlm2_map, "MiniCPMForCausalLM": _llama_map, "OPTForCausalLM": _opt_map,
         "GPTNeoForCausalLM": _gpt_neo_map,
         "Llama4ForCausalLM": lambda cfg: _renamed(_llama_map(cfg), _LLAMA4_NAMES), "Lfm2ForCausalLM": _lfm2_map,
         "Lfm2MoeForCausalLM": _lfm2_map, "Qwen3NextForCausalLM": _qwen3_next_map, "Qwen3_5ForCausalLM": _qwen3_next_map,
         "Qwen3_5MoeForCausalLM": _qwen3_next_map, "GraniteMoeHybridForCausalLM": _granitemoehybrid_map,
         "BambaForCausalLM": _bamba_map,
         "NemotronHForCausalLM": _nemotron_h_map}
# the families whose rotated q / k features are stored in pairs (head_order)
_PAIRED_ROPE = ("GlmForCausalLM", "Glm4ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "Ernie4_5ForCausalLM",
                "Ernie4_5_MoeForCausalLM", "HeliumForCausalLM", "GPTJForCausalLM", "Llama4ForCausalLM")
# Checkpoints saved from the bare model class (GPT2Model, BloomModel; an embedding model's Transformer,
# e.g. Qwen3Model) lack these prefixes.
OPTIONAL_PREFIXES = ("transformer.", "model.", "gpt_neox.")
# A vision-language checkpoint's language model (hf_configs._MULTIMODAL) under the names its uploads
# use: model.language_model. (Qwen3-VL's, the head at lm_head.), or language_model.model. and
# language_model.lm_head. (Gemma 3's, Mistral Small's); Qwen2.5-VL's are ours. (ours, theirs)
LANGUAGE_MODEL_PREFIXES = (("model.", "model.language_model."), ("model.", "language_model.model."),
                           ("lm_head.", "language_model.lm_head."))


def hf_weight_map(cfg: ModelConfig, stored: Callable[[str], bool] | None = None) -> WeightMap:
    """Our parameter path -> (HF tensor names, transform). stored: whether the checkpoint holds a
    tensor (SafetensorsFolder.has); with it, per-expert entries whose tensors are not stored read the
    layer's experts fused (_fused_experts)."""
    m = _MAPS[cfg.architecture](cfg)
    if stored is None:
        return m
    return {ours: _fused_experts(cfg, names, fn, stored) for ours, (names, fn) in m.items()}


# one expert's gate / up / down as _experts_map names it (experts 0 .. E-1, stacked by _stack_t)
_PER_EXPERT = re.compile(r"(?P<experts>.+\.experts)\.0\.(?P<part>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")


def _fused_experts(cfg: ModelConfig, names: tuple[str, ...], transform: Transform,
                   stored: Callable[[str], bool]) -> tuple[tuple[str, ...], Transform]:
    """A per-expert entry, or, where its tensors are not stored, the layer's experts as one tensor each
    (Qwen3-VL-MoE's uploads, and transformers 5's own layout): experts.gate_up_proj (gate columns,
    then up; ungated experts: experts.up_proj) and experts.down_proj. Two orientations: the uploads' [E, d, 2F] / [E, F, d] (used as
    x @ w) and transformers 5's [E, 2F, d] / [E, d, F] (F.linear's). As transformers' loader
    (Transpose(check_dims=True)), a tensor with its model's shape, [E, 2F, d] / [E, d, F], is taken as
    that one, any other is transposed; Llama 4's own model holds them as the uploads do (bmm's [E, d, 2F]
    / [E, F, d]): never transposed, whatever the sizes (d = 2F would look like the other)."""
    m = _PER_EXPERT.fullmatch(names[0])
    down = m is not None and m["part"] in ("down_proj", "w2")   # (Mixtral's and LFM2-MoE's w1 / w3 / w2)
    fused = None if m is None else f"{m['experts']}.{'down_proj' if down else 'gate_up_proj' if cfg.gated_mlp else 'up_proj'}"
    # only where the fused tensor is there: a quantized upload's per-expert tensors (qweight, weight_packed)
    # stay the quantized readers', a missing expert stays a missing tensor
    if fused is None or stored(names[0]) or not stored(fused):
        return names, transform
    d, f = cfg.d_model, cfg.expert_ffn_dim
    if cfg.architecture == "Llama4ForCausalLM":
        j = 0 if m["part"] == "gate_proj" else 1
        return (fused,), _ident if down else lambda w, j=j: w[..., j * f:(j + 1) * f]
    if down:
        return (fused,), lambda w: w.transpose(0, 2, 1) if w.shape[1:] == (d, f) else w
    if not cfg.gated_mlp:
        return (fused,), lambda w: w.transpose(0, 2, 1) if w.shape[1:] == (f, d) else w
    j = 0 if m["part"] in ("gate_proj", "w1") else 1

    def gate_or_up(w: np.ndarray) -> np.ndarray:
        w = w.transpose(0, 2, 1) if w.shape[1:] == (2 * f, d) else w      # -> [E, d, 2F]
        return w[..., j * f:(j + 1) * f]
    return (fused,), gate_or_up
