"""GGUF checkpoints (llama.cpp's single-file format): `--model path/to/model.gguf`.

A .gguf file holds the model's settings and its tokenizer as metadata (llama.cpp's key names) and
its tensors under llama.cpp's names, in float formats or llama.cpp's block quantizations (Q4_0,
Q8_0, the K-quants, ...). prepare_folder() turns the metadata into the files jaxinfer's loaders read
(config.json, tokenizer.json, tokenizer_config.json, generation_config.json) in a small folder of
the cache, keyed by the file's path, size and modification time and this module's source; that folder's config.json names the
file, and GGUFTensors serves the loader every tensor by its Hugging Face name (gguf.TensorNameMap,
llama.cpp's own table), dequantized to float32 by the gguf package (llama.cpp's Python reference of
its formats), Llama's Q and K rows turned back from llama.cpp's rotary layout. Blocks that are
jaxinfer formats (Q8_0, Q4_0, Q5_0, Q6_K, Q3_K, IQ4_NL, IQ4_XS, gpt-oss's MXFP4 experts exactly;
Q4_K, Q5_K, Q2_K with float zero points) stay packed (jaxinfer/prequant/gguf_blocks.py); the other weights are held in the
serving dtype (--dtype).

The tokenizer is rebuilt as llama.cpp reads it (llama-vocab.cpp), in the tokenizers library: a
"llama" vocabulary is SentencePiece BPE with byte fallback (merges from the scores when the file has
none, as transformers' GGUF loader derives them), a "gpt2" one byte-level BPE over the regexes its
`tokenizer.ggml.pre` names (an unknown name is refused); control tokens are special, user-defined
ones plain, both kept as the raw text the converter wrote; BOS is added as
`tokenizer.ggml.add_bos_token` says (without it: SentencePiece and Llama 3's vocabularies, yes).

Architectures: llama (also Mistral's files, and Mixtral's: llama with experts), qwen2, qwen3,
qwen3moe (experts stacked per layer: ffn_{gate,up,down}_exps or gate and up fused in
ffn_gate_up_exps, read expert by expert), gemma (Gemma 1 and CodeGemma: every layer global), arcee (Arcee AFM: Llama's permuted Q/K, the ungated
squared-ReLU MLP), exaone (EXAONE 3.x: Llama's block, Q/K as stored: NeoX RoPE), internlm2
(InternLM2 / 2.5: the converter splits wqkv into Llama's permuted Q/K and V; InternLM3's files are llama), gemma2,
gemma3 (text; the settings llama.cpp takes from the model size rather than the file: _GEMMA), phi3
(Phi-3, Phi-3.5, Phi-4, Phi-4-mini: fused q/k/v and gate/up, LongRoPE's factors as tensors, partial
rotary) and gpt-oss (experts with biases in ffn_*_exps, gate and up apart or fused, served in
transformers' interleaved layout; sinks; the clamp llama.cpp fixes at 7.0), smollm3, granite, olmo2,
olmoe (OLMoE: whole-width q / k norms, Q / K as stored, experts as wide as feed_forward_length, not
renormalized), ernie4_5 (ERNIE 4.5 dense: Q / K as stored, each head rotating in pairs, as
transformers holds them; a file with biases refused), ernie4_5-moe (its mixtures:
interleave_moe_layer_step, leading_dense_block_count, softmax scores corrected by exp_probs_b, gated
shared experts), minimax-m2 (MiniMax-M2 / M2.1: whole-width q / k norms, partial rotary, sigmoid
routing corrected by exp_probs_b), exaone4 (EXAONE 4.0: the norms after each branch, per-head q / k
norms; llama.cpp's sliding layers, three in four of the 32B's 64 only, rotating, the global ones
not; every layer rotating elsewhere), granitemoe (Granite 3.x MoE, and GraniteMoeShared where
expert_shared_feed_forward_length: Granite's multipliers, permuted Q / K, the experts' and shared
MLP's gate and up rejoined),
seed_oss, qwen2moe (a gated shared expert), glm4moe (GLM-4.5: partial rotary, dense leading layers,
sigmoid routing with exp_probs_b, shared experts; the appended next-token-prediction blocks skipped),
glm4 (GLM-4-0414: gate and up fused in ffn_up, the norms after each branch, half of each head rotating
in pairs, stored as transformers stores them), starcoder2 (LayerNorms, ungated MLP, biases; no window,
as llama.cpp runs it), command-r (Command R / R+ / Aya: one LayerNorm for attention and MLP side by
side, logit_scale) and cohere2 (Command R7B / A: three sliding layers with RoPE to one global without)
and deepseek2 (DeepSeek-V3: latent attention, kv_b_proj from attn_k_b / attn_v_b or attn_kv_b,
sigmoid routing; DeepSeek-V2 / V2-Lite / Coder-V2: softmax routing without groups), phi2 (Phi-1 / 1.5 / 2:
one LayerNorm for attention and MLP side by side, the head's bias; q / k / v apart or, in files
converted from the remote-code Phi, fused in attn_qkv), gptneox (Pythia, GPT-NeoX-20B:
attn_qkv's [q | k | v] rows put back in transformers' per-head order, use_parallel_residual; the
tanh GELU llama.cpp runs every such file with, Pythia's erf one not being in the file) and stablelm
(StableLM: per-head q / k norms stacked in attn_q_norm / attn_k_norm; parallel blocks where the file
has no ffn_norm, as llama.cpp runs them); these three rotate the share of each head
rope.dimension_count gives; and lfm2 (LFM2: head_count_kv per layer, 0 on the short-convolution
layers, whose taps the converter squeezes to [d, L]; the MLP's width already adjusted); qwen35,
qwen35moe and qwen3next (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: the Gated DeltaNet's sizes in ssm.*, its
tensors' conversions undone (GGUFTensors.rows), Qwen3-Next's in_proj_qkvz regrouped from attn_qkv and
attn_gate; the next-token-prediction blocks qwen35 files append not run). Rope: none,
linear, yarn, and Llama 3's (its rope_freqs.weight divisors, recovered as transformers' llama3 parameters and checked against
every stored divisor). Anything else is refused naming the key or tensor. Split files
(NAME-00001-of-0000N.gguf) are read across their parts.

Never imports jax (jaxinfer.hub resolves a model before the engine starts).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxinfer.errors import CheckpointError
from jaxinfer.cache_dir import cache_dir

MARKER = "gguf_file"   # config.json's key naming the file
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen3moe": "Qwen3MoeForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
         "gemma3": "Gemma3ForCausalLM",
         "phi3": "Phi3ForCausalLM", "gpt-oss": "GptOssForCausalLM", "smollm3": "SmolLM3ForCausalLM",
         "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM", "seed_oss": "SeedOssForCausalLM",
         "qwen2moe": "Qwen2MoeForCausalLM", "glm4moe": "Glm4MoeForCausalLM", "deepseek2": "DeepseekV3ForCausalLM",
         "glm4": "Glm4ForCausalLM", "starcoder2": "Starcoder2ForCausalLM", "command-r": "CohereForCausalLM",
         "cohere2": "Cohere2ForCausalLM", "phi2": "PhiForCausalLM", "gptneox": "GPTNeoXForCausalLM",
         "stablelm": "StableLmForCausalLM", "starcoder": "GPTBigCodeForCausalLM", "arcee": "ArceeForCausalLM",
         "exaone": "LlamaForCausalLM", "internlm2": "LlamaForCausalLM", "lfm2": "Lfm2ForCausalLM",
         "qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM", "qwen3next": "Qwen3NextForCausalLM",
         "granitehybrid": "GraniteMoeHybridForCausalLM", "nemotron_h": "NemotronHForCausalLM",
         "nemotron_h_moe": "NemotronHForCausalLM", "olmoe": "OlmoeForCausalLM",
         "granitemoe": "GraniteMoeForCausalLM", "exaone4": "Exaone4ForCausalLM",
         "ernie4_5": "Ernie4_5ForCausalLM", "ernie4_5-moe": "Ernie4_5_MoeForCausalLM",
         "minimax-m2": "MiniMaxM2ForCausalLM"}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gemma": "gemma",
                "gemma2": "gemma2",
                "gemma3": "gemma3_text", "phi3": "phi3", "gpt-oss": "gpt_oss", "smollm3": "smollm3",
                "granite": "granite", "olmo2": "olmo2", "seed_oss": "seed_oss", "qwen2moe": "qwen2_moe",
                "glm4moe": "glm4_moe", "deepseek2": "deepseek_v3", "glm4": "glm4", "starcoder2": "starcoder2",
                "command-r": "cohere", "cohere2": "cohere2", "phi2": "phi", "gptneox": "gpt_neox",
                "stablelm": "stablelm", "starcoder": "gpt_bigcode", "arcee": "arcee", "exaone": "llama", "internlm2": "llama",
                "lfm2": "lfm2", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next",
                "granitehybrid": "granitemoehybrid", "nemotron_h": "nemotron_h", "nemotron_h_moe": "nemotron_h",
                "olmoe": "olmoe", "granitemoe": "granitemoe", "exaone4": "exaone4", "ernie4_5": "ernie4_5",
                "ernie4_5-moe": "ernie4_5_moe", "minimax-m2": "minimax_m2"}
# the architectures whose heads may rotate only their first rope.dimension_count features
_PARTIAL_ROTARY = ("phi3", "glm4moe", "glm4", "phi2", "gptneox", "stablelm", "qwen35", "qwen35moe", "qwen3next",
                   "minimax-m2")
# Gated DeltaNet models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the converter stores every norm weight as
# 1 + w but the Gated DeltaNet's own (linear_attn.norm), A_log as -exp(A_log) (ssm_a), and for qwen35
# / qwen35moe the value heads "tiled" where there are more than key heads (_LinearAttentionVReorderBase)
_DELTANET = ("qwen35", "qwen35moe", "qwen3next")
# Nemotron-H (nemotron_h) and Nemotron 3 with its mixtures of experts (nemotron_h_moe)
_NEMOTRON_H = ("nemotron_h", "nemotron_h_moe")
# Qwen3-Next's in_proj_qkvz (transformers' name; the converter splits it into attn_qkv and attn_gate)
_QKVZ = re.compile(r"model\.layers\.(\d+)\.linear_attn\.in_proj_qkvz\.weight")
# Granite 3.x MoE's and 4.0-H's fused MLP tensors (transformers' names on disk), which the converter splits
# (GraniteMoeModel.modify_tensors): GGUFTensors.granite_parts
_GRANITE_MLP = re.compile(r"model\.layers\.(\d+)\.(block_sparse_moe|shared_mlp)\.(input_linear|output_linear)\.weight")
# llama.cpp's mixtures with dense leading layers, sigmoid routing with a learned correction
# (exp_probs_b), groups, a routed scale and shared experts (its build_moe_ffn with those settings)
_SIGMOID_MOE = ("glm4moe", "deepseek2")
# the architectures whose Q / K rows llama.cpp's converter stores in its rotary order (LlamaModel.permute)
_PERMUTED_QK = ("llama", "smollm3", "granite", "arcee", "internlm2", "granitehybrid", "nemotron_h", "nemotron_h_moe",
                "granitemoe")
# SmolLM3's NoPE layers: every 4th, a constant of llama.cpp's (hparams.n_no_rope_layer_step), in no key
_SMOLLM3_NO_ROPE_STEP = 4
# llama.cpp's Gemma: every `swa`-th layer global, the others sliding (hparams.set_swa_pattern), the
# sliding layers' RoPE base 10 000, the 27B models' queries scaled by 1/sqrt(d_model / heads) (their
# block counts), the others' by 1/sqrt(head_dim): none of it is in the file
_GEMMA = {"gemma2": {"swa": 2, "big_layers": 46}, "gemma3": {"swa": 6, "big_layers": 62}}
# one expert's matrix (transformers' per-expert names, as hf_maps reads them) -> llama.cpp's stacked tensor
_EXPERT = re.compile(r"(?:model|backbone)\.layers\.(\d+)\.(?:mlp|block_sparse_moe|mixer)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# gpt-oss's experts as transformers holds them: all of a layer's in one tensor, gate and up interleaved
# (gate_up_proj [E, D, 2F], its bias [E, 2F]; down_proj [E, F, D], its bias [E, D])
_OSS_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
_CONTROL, _USER_DEFINED = 3, 4
SPLIT_NAME = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")
# StableLM 2 12B's q / k norm of one head (transformers' name); the converter stacks a layer's heads in one
# tensor [heads, head_dim] (StableLMModel._stack_qk_norm)
_QK_NORM_HEAD = re.compile(r"(model\.layers\.\d+\.self_attn\.[qk]_layernorm)\.norms\.(\d+)\.weight")
# Phi-2's q / k / v projections (transformers' names), fused in attn_qkv by older files (GGUFTensors._phi2_qkv)
_PHI2_QKV = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)")
# DeepSeek's kv_b_proj (transformers' name), which today's converter splits in two (GGUFTensors.latent_parts)
_KV_B = re.compile(r"model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight")

# tokenizer.ggml.pre -> the regexes llama.cpp's llama-vocab.cpp splits text with before BPE, applied in
# turn (each splits the pieces the one before left, the text between matches kept as pieces: the
# tokenizers library's Split "isolated", in sequence); a name not here is refused
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
# whole words of the vocabulary taken before merging (llama.cpp's ignore_merges), BOS added unless the
# file says otherwise: Llama 3's names and Mistral's tekken
WHOLE_WORDS_PRE = LLAMA3_PRE + ("tekken",)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(LLAMA3_PRE + ("dbrx", "smaug-bpe"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), (_QWEN2,)),
    "tekken": (_TEKKEN,), **dict.fromkeys(("gpt-4o", "llama4"), (_GPT4O,)),
    # Qwen3.5's (llama.cpp's QWEN35): Qwen2's with combining marks (\p{M}) kept in words, out of punctuation
    "qwen35": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), (_GPT2,)),   # (exaone4: llama.cpp's GPT2 type)
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
                    (r"\p{N}", _GPT2)),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    # GLM-4.5's (llama.cpp's CHATGLM4: Llama 3's expression, merges applied, no BOS) and DeepSeek-V3's
    **dict.fromkeys(("glm4", "chatglm-bpe"), (_LLAMA3,)),
    "deepseek-v3": (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
}
# vocabularies llama.cpp gives no BOS whatever the file says (special_bos_id = LLAMA_TOKEN_NULL)
NO_BOS_PRE = ("glm4", "chatglm-bpe")
# the end-of-generation tokens llama.cpp finds by their text (llama-vocab.cpp), besides the ids the
# file names (EOS, EOT, EOM)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
             "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def expert_stack(name: str) -> str | None:
    """llama.cpp's stacked tensor (blk.L.ffn_{gate,up,down}_exps.weight) holding transformers' per-expert
    matrix `name`; None for any other name."""
    m = _EXPERT.fullmatch(name)
    return None if m is None else f"blk.{m.group(1)}.ffn_{_EXPERT_PART[m.group(3)]}_exps.weight"


def is_gguf(path: str | os.PathLike) -> bool:
    return Path(path).is_file() and str(path).endswith(".gguf")


# ----------------------------------------------------------------------------------- reading

class GGUFFile:
    """The metadata and tensors of a .gguf file and, when it is the first of a split, of every part."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.readers = [(self.path, self._open(self.path))]
        self.meta = dict(self.readers[0][1].fields)
        parts = int(self.get("split.count", 1))
        if parts > 1:
            if int(self.get("split.no", 0)) != 0:
                raise CheckpointError(f"{self.path}: part {int(self.get('split.no')) + 1} of a split GGUF ({parts} "
                                      "parts); give the first, NAME-00001-of-NNNNN.gguf")
            m = SPLIT_NAME.fullmatch(self.path.name)
            if m is None:
                raise CheckpointError(f"{self.path}: the first of {parts} parts of a split GGUF, named otherwise than "
                                      "NAME-00001-of-NNNNN.gguf (llama.cpp's names), so its other parts cannot be found")
            for i in range(2, parts + 1):
                p = self.path.with_name(f"{m.group(1)}-{i:05d}-of-{parts:05d}.gguf")
                if not p.is_file():
                    raise CheckpointError(f"{p}: missing (part {i} of the split GGUF {self.path.name})")
                self.readers.append((p, self._open(p)))
        self.tensors: dict[str, tuple[Any, Path]] = {}
        for where, reader in self.readers:
            for t in reader.tensors:
                self.tensors[t.name] = (t, where)

    @staticmethod
    def _open(path: Path):
        from gguf import GGUFReader
        try:
            return GGUFReader(path)
        except (ValueError, KeyError, IndexError, OSError) as e:
            raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None

    def get(self, key: str, default: Any = None) -> Any:
        field = self.meta.get(key)
        return default if field is None else field.contents()

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    @property
    def arch(self) -> str:
        return self.get("general.architecture", "")

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` as float32, in the row-major shape of its Hugging Face original."""
        from gguf import GGMLQuantizationType, quants
        t, where = self.tensors[name]
        try:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                x = np.asarray(t.data, dtype=np.float32)
            else:
                x = quants.dequantize(t.data, t.tensor_type)
            return x.reshape(tuple(int(n) for n in reversed(t.shape)))
        except NotImplementedError:
            raise CheckpointError(f"{where}: tensor {name!r} is stored as {t.tensor_type.name}, a type the gguf "
                                  "package cannot dequantize") from None
        except ValueError as e:
            raise CheckpointError(f"{where}: tensor {name!r} ({t.tensor_type.name}, shape {list(t.shape)}) is "
                                  f"damaged: {e}") from None


# ------------------------------------------------------------------------------------ config

def hf_config(f: GGUFFile) -> dict[str, Any]:
    """config.json (transformers' names) of the model the file holds."""
    arch = f.arch
    if arch not in ARCHS:
        raise CheckpointError(f"{f.path}: GGUF architecture {arch!r} (general.architecture) is not supported; "
                              f"supported: {sorted(ARCHS)}")
    need = {k: f.arch_get(k) for k in ("block_count", "embedding_length", "feed_forward_length",
                                       "attention.head_count")}
    if arch == "qwen35moe" and need["feed_forward_length"] is None:   # (no dense MLP: none written)
        need["feed_forward_length"] = f.arch_get("expert_feed_forward_length")
    if arch in _NEMOTRON_H and isinstance(need["feed_forward_length"], list):   # per layer: 0 but on MLP layers
        need["feed_forward_length"] = max(need["feed_forward_length"], default=None) or None
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise CheckpointError(f"{f.path}: metadata {arch}.{missing[0]} is missing")
    heads = int(need["attention.head_count"])
    head_dim = int(f.arch_get("attention.key_length") or need["embedding_length"] // heads)
    rotary = f.arch_get("rope.dimension_count")
    partial = {}
    # deepseek2's key_length is its latent + RoPE width (_deepseek2 reads the heads' own widths)
    if rotary is not None and int(rotary) != head_dim and arch != "deepseek2":
        if arch not in _PARTIAL_ROTARY:   # Phi-4-mini rotates 3/4 of each head, GLM-4.5 half
            raise CheckpointError(f"{f.path}: {arch}.rope.dimension_count = {rotary} rotates part of each "
                                  f"{head_dim}-wide head; {arch} models in jaxinfer rotate all of it")
        if int(rotary) % 2 or not 0 < int(rotary) < head_dim:
            raise CheckpointError(f"{f.path}: {arch}.rope.dimension_count = {rotary}: expected an even number of "
                                  f"the {head_dim} features of a head")
        partial = {"partial_rotary_factor": int(rotary) / head_dim}
    # the next-token-prediction blocks llama.cpp's converter appends (GLM-4.5's) are not run
    layers = int(need["block_count"]) - int(f.arch_get("nextn_predict_layers") or 0)
    if layers < 1:
        raise CheckpointError(f"{f.path}: {arch}.block_count = {need['block_count']} with "
                              f"{arch}.nextn_predict_layers = {f.arch_get('nextn_predict_layers')} leaves no layer")
    if "token_embd.weight" not in f.tensors:
        raise CheckpointError(f"{f.path}: no tensor 'token_embd.weight'")
    vocab = int(f.tensors["token_embd.weight"][0].shape[1])
    cfg: dict[str, Any] = {
        "architectures": [ARCHS[arch]], "model_type": _MODEL_TYPES[arch],
        "vocab_size": vocab, "hidden_size": int(need["embedding_length"]),
        "intermediate_size": int(need["feed_forward_length"]), "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": _kv_heads(f, heads),
        "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": int(f.arch_get("context_length") or 2048),
        "rms_norm_eps": float(f.arch_get("attention.layer_norm_rms_epsilon") or 1e-6),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors and arch not in ("qwen2", "qwen2moe"),
        "rope_parameters": {"rope_theta": float(f.arch_get("rope.freq_base") or 10000.0),
                            **_rope_scaling(f, head_dim), **partial},
        MARKER: str(Path(os.path.abspath(f.path))),
    }
    cfg.update(_experts(f, cfg))
    cfg.update(_arch_fields(f, cfg, partial))
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id")):
        v = f.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[hf] = int(v)
    return cfg


def _kv_heads(f: GGUFFile, heads: int) -> int:
    """attention.head_count_kv: one number, or one per layer (lfm2's: 0 on its conv layers), the
    attention layers' then; absent: as many as the heads."""
    kv = f.arch_get("attention.head_count_kv")
    if isinstance(kv, list):
        kv = max(kv, default=0)
    return int(kv or heads)


def _lfm2(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's lfm2 (LFM2Model): head_count_kv per layer, 0 on the short-convolution layers; the
    MLP's width as Lfm2MLP computes it (feed_forward_length, already adjusted); the conv layers' taps
    (shortconv.l_cache); the final norm in token_embd_norm."""
    kv, taps = f.arch_get("attention.head_count_kv"), f.arch_get("shortconv.l_cache")
    if not isinstance(kv, list) or len(kv) != cfg["num_hidden_layers"]:
        raise CheckpointError(f"{f.path}: lfm2.attention.head_count_kv must give each of the "
                              f"{cfg['num_hidden_layers']} layers its KV heads (0 on a conv layer), got {kv!r}")
    if taps is None:
        raise CheckpointError(f"{f.path}: metadata lfm2.shortconv.l_cache is missing")
    conv = [i for i, k in enumerate(kv) if k == 0]
    return {"layer_types": ["conv" if k == 0 else "full_attention" for k in kv], "conv_L_cache": int(taps),
            "block_auto_adjust_ff_dim": False, "norm_eps": cfg["rms_norm_eps"],
            "conv_bias": bool(conv) and f"blk.{conv[0]}.shortconv.in_proj.bias" in f.tensors}


# the recurrent layers' sizes (llama.cpp's LLM_KV_SSM_*): qwen35 / qwen35moe / qwen3next, granitehybrid
_SSM_KEYS = ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size")


def _required(f: GGUFFile, keys: tuple[str, ...]) -> dict[str, Any]:
    """The architecture's metadata `keys` (under its prefix), the first missing one named."""
    got = {k: f.arch_get(k) for k in keys}
    missing = [k for k, v in got.items() if v is None]
    if missing:
        raise CheckpointError(f"{f.path}: metadata {f.arch}.{missing[0]} is missing")
    return got


def _deltanet(f: GGUFFile) -> dict[str, Any]:
    """llama.cpp's qwen35 / qwen35moe / qwen3next (Qwen3NextModel.set_gguf_parameters): the Gated
    DeltaNet's sizes in ssm.* (conv_kernel; state_size: a key head's width; group_count: key heads;
    time_step_rank: value heads; inner_size: value heads x their width) and full_attention_interval."""
    got = _required(f, (*_SSM_KEYS, "full_attention_interval"))
    v_heads, inner = int(got["ssm.time_step_rank"]), int(got["ssm.inner_size"])
    if v_heads <= 0 or inner % v_heads:
        raise CheckpointError(f"{f.path}: {f.arch}.ssm.inner_size = {inner} is not a multiple of "
                              f"{f.arch}.ssm.time_step_rank = {v_heads} (value heads)")
    return {"linear_conv_kernel_dim": int(got["ssm.conv_kernel"]), "linear_key_head_dim": int(got["ssm.state_size"]),
            "linear_num_key_heads": int(got["ssm.group_count"]), "linear_num_value_heads": v_heads,
            "linear_value_head_dim": inner // v_heads, "full_attention_interval": int(got["full_attention_interval"])}


def _arch_fields(f: GGUFFile, cfg: dict[str, Any], partial: dict[str, float]) -> dict[str, Any]:
    """The fields of config.json that only some architectures' files give (or refuse), by architecture."""
    arch = f.arch
    if arch in _GEMMA:
        return _gemma(f, cfg)
    elif arch == "gemma":   # llama.cpp's gemma: GELU-tanh, the embedding as the head, queries by 1/sqrt(head_dim)
        return {"hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True}
    elif arch == "phi3":
        return _phi3(f, cfg)
    elif arch == "gpt-oss":
        return _gpt_oss(f, cfg)
    elif arch == "smollm3":
        return {"no_rope_layer_interval": _SMOLLM3_NO_ROPE_STEP}
    elif arch == "granite":
        return _granite(f, cfg)
    elif arch == "exaone4":
        return _exaone4(f, cfg)
    elif arch in ("ernie4_5", "ernie4_5-moe"):   # Ernie4_5Model: q / k / v as transformers holds them, in pairs
        if "blk.0.attn_q.bias" in f.tensors:   # (llama.cpp adds q / k / v biases only; use_bias puts them everywhere)
            raise CheckpointError(f"{f.path}: tensor 'blk.0.attn_q.bias': {arch} with biases is not supported "
                                  "(llama.cpp adds those of q / k / v only, transformers' use_bias one on every "
                                  "projection; no published ERNIE 4.5 has them)")
        return {"use_bias": False}
    elif arch == "granitemoe":   # GraniteMoeShared where the file gives the shared MLP's width
        shared = f.arch_get("expert_shared_feed_forward_length")
        return {**_granite(f, cfg), **({} if not shared else {
            "architectures": ["GraniteMoeSharedForCausalLM"], "model_type": "granitemoeshared",
            "shared_intermediate_size": int(shared)})}
    elif arch == "olmo2" and f.arch_get("attention.sliding_window") is not None:
        raise CheckpointError(f"{f.path}: olmo2.attention.sliding_window: OLMo 3's sliding layers from a GGUF file are "
                              "not supported (load the HF folder)")
    elif arch == "seed_oss":   # SeedOssModel: q / k / v biases and, apart, o's
        return {"attention_out_bias": "blk.0.attn_output.bias" in f.tensors}
    elif arch == "qwen2moe":   # Qwen2MoeConfig's name for q / k / v biases
        return {"qkv_bias": "blk.0.attn_q.bias" in f.tensors}
    elif arch == "glm4moe":   # q / k norms where the file has them, the rotated share of each head stated
        return {"use_qk_norm": "blk.0.attn_q_norm.weight" in f.tensors,
                "partial_rotary_factor": partial.get("partial_rotary_factor", 1.0)}
    elif arch == "glm4":   # the rotated share of each head stated (Glm4Config's default is half)
        if f.arch_get("rope.dimension_sections") is not None:   # Glm4Model's M-RoPE files: Q / K reordered
            raise CheckpointError(f"{f.path}: glm4.rope.dimension_sections (the text model of a GLM-4.xV / GLM-OCR "
                                  "file, with M-RoPE and its Q / K rows reordered) is not supported")
        return {"partial_rotary_factor": partial.get("partial_rotary_factor", 1.0)}
    elif arch == "starcoder2":
        return _starcoder2(f)
    elif arch in ("command-r", "cohere2"):
        return _cohere(f)
    elif arch == "deepseek2":
        return _deepseek2(f, cfg)
    elif arch in ("phi2", "gptneox", "stablelm"):
        return _layernorm_family(f, partial.get("partial_rotary_factor", 1.0))
    elif arch == "starcoder":
        return _starcoder(f, cfg)
    elif arch == "arcee":   # llama.cpp's arcee: Llama's attention, the ungated squared-ReLU MLP
        return {"hidden_act": "relu2"}
    elif arch == "lfm2":
        return _lfm2(f, cfg)
    elif arch in _DELTANET:
        return _deltanet(f)
    elif arch == "granitehybrid":
        return _granitehybrid(f, cfg)
    elif arch in _NEMOTRON_H:
        return _nemotron_h(f, cfg)
    return {}


def _starcoder(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """StarCoder 1 / SantaCoder (llama.cpp's starcoder, transformers' GPTBigCode): learned positions,
    LayerNorms, c_attn's rows [q | k | v] as stored, one KV head (the converter writes head_count_kv
    1 for every file), the tanh GELU llama.cpp runs, the embedding as the head without output."""
    eps = f.arch_get("attention.layer_norm_epsilon")
    if eps is None:
        raise CheckpointError(f"{f.path}: metadata starcoder.attention.layer_norm_epsilon is missing")
    if cfg["num_key_value_heads"] != 1:
        raise CheckpointError(f"{f.path}: starcoder.attention.head_count_kv = {cfg['num_key_value_heads']}: "
                              "llama.cpp's starcoder runs one KV head")
    if "position_embd.weight" not in f.tensors:
        raise CheckpointError(f"{f.path}: no tensor 'position_embd.weight' (starcoder's learned positions)")
    return {"n_embd": cfg["hidden_size"], "n_head": cfg["num_attention_heads"], "n_layer": cfg["num_hidden_layers"],
            "n_inner": cfg["intermediate_size"], "n_positions": int(f.tensors["position_embd.weight"][0].shape[1]),
            "multi_query": True, "activation_function": "gelu_pytorch_tanh", "layer_norm_epsilon": float(eps)}


def _layernorm_family(f: GGUFFile, rotary: float) -> dict[str, Any]:
    """phi2, gptneox and stablelm, whose converters write their own metadata: the LayerNorm's epsilon,
    the rotated share of each head stated (their config classes default to a part), the biases and
    norms by the tensors present, gptneox's block layout by use_parallel_residual and stablelm's by
    whether the file has ffn_norm (llama.cpp's graph decides so)."""
    eps = f.arch_get("attention.layer_norm_epsilon")
    if eps is None:
        raise CheckpointError(f"{f.path}: metadata {f.arch}.attention.layer_norm_epsilon is missing")
    out: dict[str, Any] = {"layer_norm_eps": float(eps), "partial_rotary_factor": rotary}
    if f.arch == "gptneox":
        out.update(rotary_pct=rotary, hidden_act="gelu_new", attention_bias="blk.0.attn_qkv.bias" in f.tensors,
                   use_parallel_residual=bool(f.arch_get("use_parallel_residual", True)))
    elif f.arch == "stablelm":
        out.update(use_qkv_bias="blk.0.attn_q.bias" in f.tensors, qk_layernorm="blk.0.attn_q_norm.weight" in f.tensors,
                   use_parallel_residual="blk.0.ffn_norm.weight" not in f.tensors)
    else:
        out["hidden_act"] = "gelu_new"
    return out


def _starcoder2(f: GGUFFile) -> dict[str, Any]:
    """StarCoder2 as llama.cpp's starcoder2 runs it: LayerNorms with biases (attention.layer_norm_epsilon),
    the ungated GELU-tanh MLP, biases on every projection where the file has them, and no window on
    any layer (the published models' 4096-token window is not in the file, and llama.cpp attends to
    the whole context)."""
    eps = f.arch_get("attention.layer_norm_epsilon")
    if eps is None:
        raise CheckpointError(f"{f.path}: metadata starcoder2.attention.layer_norm_epsilon is missing")
    return {"hidden_act": "gelu_pytorch_tanh", "norm_epsilon": float(eps), "sliding_window": None,
            "use_bias": "blk.0.attn_q.bias" in f.tensors}


def _gemma(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3's fields as llama.cpp runs them (_GEMMA): GELU-tanh, tied embeddings, sliding and
    global layers, the query scale, Gemma 2's soft caps; Gemma 3's global layers take the file's RoPE
    base and linear scaling, its sliding ones base 10 000 (or the file's rope.freq_base_swa)."""
    g, n = _GEMMA[f.arch], cfg["num_hidden_layers"]
    window = f.arch_get("attention.sliding_window")
    if window is None:
        raise CheckpointError(f"{f.path}: metadata {f.arch}.attention.sliding_window is missing")
    big = n == g["big_layers"]
    out = {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True,
           "sliding_window": int(window),
           "layer_types": ["sliding_attention" if (i + 1) % g["swa"] else "full_attention" for i in range(n)],
           "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"],
           "final_logit_softcapping": f.arch_get("final_logit_softcapping")}
    if f.arch == "gemma2":
        out["attn_logit_softcapping"] = f.arch_get("attn_logit_softcapping")
        return out
    local = float(f.arch_get("rope.freq_base_swa") or 10000.0)
    out["rope_parameters"] = {"full_attention": cfg["rope_parameters"],
                              "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return out


def _cohere(f: GGUFFile) -> dict[str, Any]:
    """Command R / Aya (llama.cpp's command-r) and Command R7B / A (cohere2): the LayerNorm's epsilon,
    logit_scale, the embedding as the LM head (neither graph reads an output tensor); cohere2's
    window on three layers of every attention.sliding_window_pattern (default 4), the others global
    and without RoPE; Command R+'s per-head q / k norms where the file has attn_q_norm."""
    eps, scale = f.arch_get("attention.layer_norm_epsilon"), f.arch_get("logit_scale")
    for key, value in (("attention.layer_norm_epsilon", eps), ("logit_scale", scale)):
        if value is None:
            raise CheckpointError(f"{f.path}: metadata {f.arch}.{key} is missing")
    out = {"layer_norm_eps": float(eps), "logit_scale": float(scale), "tie_word_embeddings": True,
           "use_qk_norm": "blk.0.attn_q_norm.weight" in f.tensors}
    if f.arch != "cohere2":
        return out
    window, period = f.arch_get("attention.sliding_window"), f.arch_get("attention.sliding_window_pattern", 4)
    if window is None:
        raise CheckpointError(f"{f.path}: metadata cohere2.attention.sliding_window is missing")
    if isinstance(period, list) or int(period) < 1:
        raise CheckpointError(f"{f.path}: cohere2.attention.sliding_window_pattern = {period!r} is not supported "
                              "(a period: every p-th layer global)")
    swa_base = f.arch_get("rope.freq_base_swa")
    if swa_base is not None and float(swa_base) != float(f.arch_get("rope.freq_base") or 10000.0):
        raise CheckpointError(f"{f.path}: cohere2.rope.freq_base_swa = {swa_base} (a RoPE base of the sliding "
                              "layers apart from the others) is not supported")
    return {**out, "sliding_window": int(window), "sliding_window_pattern": int(period)}


def _exaone4(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's exaone4 (Exaone4Model: EXAONE 4.0; Q / K as stored, NeoX RoPE), as its loader reads
    it: only a 64-layer file (the 32B) has sliding layers, those of every attention.sliding_window_pattern
    (a number; default 4; the converter's array of bools is not read) but the last, with
    attention.sliding_window (default 4096); llm_build_exaone4 rotates the sliding layers only, as
    transformers does. Any other file runs every layer global and rotating (the 1.2B), whatever window
    it names. Next-token-prediction blocks and a separate base for the sliding layers' RoPE are refused."""
    n = cfg["num_hidden_layers"]
    if f.arch_get("nextn_predict_layers"):
        raise CheckpointError(f"{f.path}: exaone4.nextn_predict_layers = {f.arch_get('nextn_predict_layers')} "
                              "(next-token-prediction blocks) is not supported")
    if n != 64:
        return {"sliding_window": None, "layer_types": ["full_attention"] * n}
    base = f.arch_get("rope.freq_base_swa")
    if base is not None and float(base) != cfg["rope_parameters"]["rope_theta"]:
        raise CheckpointError(f"{f.path}: exaone4.rope.freq_base_swa = {base} (the sliding layers' own RoPE base) "
                              "is not supported")
    period = f.arch_get("attention.sliding_window_pattern")
    if not (isinstance(period, int) and not isinstance(period, bool) and period >= 0):
        period = 4   # (llama_hparams::set_swa_pattern: layer il slides where il % period < period - 1; 0: all)
    return {"sliding_window": int(f.arch_get("attention.sliding_window") or 4096),
            "layer_types": ["sliding_attention" if period == 0 or i % period < period - 1 else "full_attention"
                            for i in range(n)]}


def _granite(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers as llama.cpp reads them (GraniteModel writes each only when the config's is
    not 0): a missing embedding, residual or logit scale is no scaling, a missing attention scale
    1/sqrt(head_dim) (llama.cpp's build_granite)."""
    if f.arch in ("granite", "granitemoe") and f.arch_get("rope.scaling.finetuned") is False:   # (then no RoPE)
        raise CheckpointError(f"{f.path}: {f.arch}.rope.scaling.finetuned = false (attention without RoPE) is "
                              "not supported")
    get = lambda key: f.arch_get(key) or None  # noqa: E731   (0, as absent, means the default)
    scale = get("attention.scale")
    return {"embedding_multiplier": float(get("embedding_scale") or 1.0),
            "residual_multiplier": float(get("residual_scale") or 1.0),
            "logits_scaling": float(get("logit_scale") or 1.0),
            "attention_multiplier": float(scale) if scale is not None else cfg["head_dim"] ** -0.5}


def _granitehybrid(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's granitehybrid (GraniteHybridModel: Granite 4.0-H): head_count_kv per layer, 0 on the
    Mamba-2 layers; the mixer's sizes in ssm.* (conv_kernel; state_size; group_count; time_step_rank:
    heads; inner_size: heads x their width), the convolution's bias where the file has one; Granite's
    multipliers; RoPE only where rope.scaling.finetuned is true (the converter's switch, false for
    every hybrid: llama.cpp then rotates nothing); experts where expert_count, else the shared MLP alone,
    its width expert_shared_feed_forward_length either way (the experts': feed_forward_length)."""
    n, kv = cfg["num_hidden_layers"], f.arch_get("attention.head_count_kv")
    if not isinstance(kv, list) or len(kv) != n:
        raise CheckpointError(f"{f.path}: granitehybrid.attention.head_count_kv must give each of the {n} layers' "
                              f"KV heads (0 on a Mamba-2 layer), got {kv!r}")
    got = _required(f, (*_SSM_KEYS, "expert_shared_feed_forward_length"))
    heads, inner, hidden = int(got["ssm.time_step_rank"]), int(got["ssm.inner_size"]), cfg["hidden_size"]
    if heads <= 0 or inner % heads or inner % hidden:
        raise CheckpointError(f"{f.path}: granitehybrid.ssm.inner_size = {inner} must be a multiple of "
                              f"ssm.time_step_rank = {heads} (heads) and of embedding_length = {hidden}")
    mamba = [i for i, k in enumerate(kv) if k == 0]
    out = {"layer_types": ["mamba" if k == 0 else "attention" for k in kv],
           "mamba_d_conv": int(got["ssm.conv_kernel"]), "mamba_d_state": int(got["ssm.state_size"]),
           "mamba_n_groups": int(got["ssm.group_count"]), "mamba_n_heads": heads, "mamba_d_head": inner // heads,
           "mamba_expand": inner // hidden, "mamba_conv_bias": bool(mamba) and f"blk.{mamba[0]}.ssm_conv1d.bias" in f.tensors,
           "shared_intermediate_size": int(got["expert_shared_feed_forward_length"]),
           "position_embedding_type": "rope" if f.arch_get("rope.scaling.finetuned") is True else None,
           **_granite(f, cfg)}
    count, used = f.arch_get("expert_count"), f.arch_get("expert_used_count")
    if count and not used:
        raise CheckpointError(f"{f.path}: metadata granitehybrid.expert_used_count is missing")
    return {**out, "num_local_experts": int(count or 0), **({"num_experts_per_tok": int(used)} if count else {})}


def _nemotron_h(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's nemotron_h (NemotronHModel: Nemotron-H, Nemotron Nano 2): every layer one part, told
    apart by head_count_kv (> 0: attention) and feed_forward_length (> 0: the MLP), both per layer,
    the rest Mamba-2 layers of GraniteHybridModel's ssm.* sizes (inner_size: heads x their width, not a
    multiple of embedding_length); the squared-ReLU MLP; no RoPE. nemotron_h_moe (Nemotron 3 Nano, the
    same class with experts): a layer with a feed_forward_length is a mixture (_nemotron_h_experts), and
    the next-token-prediction block the converter appends (nextn_predict_layers, counted in block_count
    and in both lists) is not run."""
    n = cfg["num_hidden_layers"]
    kv, ff = f.arch_get("attention.head_count_kv"), f.arch_get("feed_forward_length")
    total = n + int(f.arch_get("nextn_predict_layers") or 0)
    for key, value in (("attention.head_count_kv", kv), ("feed_forward_length", ff)):
        if not isinstance(value, list) or len(value) != total:
            raise CheckpointError(f"{f.path}: {f.arch}.{key} must give each of the {total} layers its value (0 "
                                  f"where the layer has none), got {value!r}")
    kv, ff = kv[:n], ff[:n]
    got = _required(f, _SSM_KEYS)
    heads, inner = int(got["ssm.time_step_rank"]), int(got["ssm.inner_size"])
    if heads <= 0 or inner % heads:
        raise CheckpointError(f"{f.path}: {f.arch}.ssm.inner_size = {inner} must be a multiple of "
                              f"ssm.time_step_rank = {heads} (heads)")
    moe = f.arch == "nemotron_h_moe"
    types = ["attention" if k else ("moe" if moe else "mlp") if m else "mamba" for k, m in zip(kv, ff)]
    mamba = [i for i, t in enumerate(types) if t == "mamba"]
    return {**(_nemotron_h_experts(f) if moe else {}),
            "layers_block_type": types, "mamba_num_heads": heads, "mamba_head_dim": inner // heads,
            "n_groups": int(got["ssm.group_count"]), "ssm_state_size": int(got["ssm.state_size"]),
            "conv_kernel": int(got["ssm.conv_kernel"]), "mlp_hidden_act": "relu2",
            "use_conv_bias": bool(mamba) and f"blk.{mamba[0]}.ssm_conv1d.bias" in f.tensors,
            "layer_norm_epsilon": cfg["rms_norm_eps"]}


def _nemotron_h_experts(f: GGUFFile) -> dict[str, Any]:
    """Nemotron 3 Nano's mixture as NemotronHModel writes it: _sigmoid_experts' routing over
    expert_count ungated experts of expert_feed_forward_length, and one shared MLP of
    expert_shared_feed_forward_length (the converter writes no expert_group_used_count: more than one
    group without it is refused). Nemotron 3 Super's latent projections (moe_latent_size) are refused."""
    latent = f.arch_get("moe_latent_size")
    if latent:
        raise CheckpointError(f"{f.path}: {f.arch}.moe_latent_size = {latent} is not supported (Nemotron 3 Super's "
                              "latent projections around the experts)")
    got = _required(f, ("expert_count", "expert_used_count", "expert_feed_forward_length",
                        "expert_shared_feed_forward_length"))
    groups = int(f.arch_get("expert_group_count") or 1)
    if groups > 1 and f.arch_get("expert_group_used_count") is None:
        raise CheckpointError(f"{f.path}: {f.arch}.expert_group_count = {groups} without "
                              f"{f.arch}.expert_group_used_count: how many groups a token may choose from is unknown")
    return {**_sigmoid_experts(f, int(got["expert_count"]), int(got["expert_used_count"]),
                               int(got["expert_feed_forward_length"]), 0),
            "moe_shared_expert_intermediate_size": int(got["expert_shared_feed_forward_length"])}


def _phi3(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 / Phi-4 (llama.cpp's phi3, q/k/v and gate/up fused as transformers holds them: attn_qkv,
    ffn_up): LongRoPE when the file has rope_factors_long / rope_factors_short (llama.cpp's converter
    writes no rope type for it, only those tensors, rope.scaling.original_context_length and
    rope.scaling.attn_factor); a window on every layer when attention.sliding_window > 0 (the converter
    writes 0 for none). llama.cpp ignores that window (its "Phi SWA is currently disabled"); here it
    is kept, as transformers and the model's own config.json run it."""
    window = f.arch_get("attention.sliding_window")
    out: dict[str, Any] = {"sliding_window": int(window) if window else None}
    if "rope_factors_long.weight" not in f.tensors:
        return out
    original = f.arch_get("rope.scaling.original_context_length")
    if original is None or "rope_factors_short.weight" not in f.tensors:
        raise CheckpointError(f"{f.path}: rope_factors_long.weight without rope_factors_short.weight and "
                              "phi3.rope.scaling.original_context_length")
    rotary = int(cfg["head_dim"] * cfg["rope_parameters"].get("partial_rotary_factor", 1.0))
    factors = {}
    for kind in ("long", "short"):
        factors[kind] = f.tensor(f"rope_factors_{kind}.weight").reshape(-1).astype(float).tolist()
        if len(factors[kind]) != rotary // 2:
            raise CheckpointError(f"{f.path}: tensor 'rope_factors_{kind}.weight' has {len(factors[kind])} values; "
                                  f"expected {rotary // 2}, one per rotated frequency of {rotary}")
    rope = {**cfg["rope_parameters"], "rope_type": "longrope", "original_max_position_embeddings": int(original),
            "long_factor": factors["long"], "short_factor": factors["short"]}
    attention = f.arch_get("rope.scaling.attn_factor")
    if attention is not None:
        rope["attention_factor"] = float(attention)
    return {**out, "rope_parameters": rope, "original_max_position_embeddings": int(original)}


def _gpt_oss(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss (llama.cpp's llm_build_openai_moe): sliding and global layers alternating, the first
    sliding (its SWA pattern 2, transformers' default layer_types; another period when the file gives
    attention.sliding_window_pattern); biased attention with sinks;
    YaRN over the whole band (truncate false: the model as published, OpenAI's reference and
    transformers; llama.cpp rounds the band's ends to whole dimensions). The clamped SwiGLU's alpha
    and limit are not in the file (llama.cpp fixes them at 1.702 and 7.0, GptOssConfig's defaults)."""
    window = f.arch_get("attention.sliding_window")
    if window is None:
        raise CheckpointError(f"{f.path}: metadata gpt-oss.attention.sliding_window is missing")
    n = cfg["num_hidden_layers"]
    # llama.cpp also reads a period (every p-th layer global) and a sliding layers' RoPE base
    period = f.arch_get("attention.sliding_window_pattern", 2)
    if isinstance(period, list) or int(period) < 1:
        raise CheckpointError(f"{f.path}: gpt-oss.attention.sliding_window_pattern = {period!r} is not supported "
                              "(a period: every p-th layer global)")
    swa_base = f.arch_get("rope.freq_base_swa")
    if swa_base is not None and float(swa_base) != cfg["rope_parameters"]["rope_theta"]:
        raise CheckpointError(f"{f.path}: gpt-oss.rope.freq_base_swa = {swa_base} (a RoPE base of the sliding layers "
                              "apart from the others) is not supported")
    rope = dict(cfg["rope_parameters"])
    if rope.get("rope_type") == "yarn":
        rope["truncate"] = False
    return {"sliding_window": int(window), "attention_bias": True, "rope_parameters": rope,
            "layer_types": ["sliding_attention" if i % int(period) < int(period) - 1 else "full_attention"
                            for i in range(n)]}


def _experts(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' fields: Mixtral (llama.cpp's `llama` with experts), Qwen3-MoE (routing
    normalized over the chosen experts, as llama.cpp's qwen3moe does), Qwen2-MoE (not normalized, a
    gated shared expert: llama.cpp's qwen2moe), gpt-oss, GLM-4.5 and DeepSeek-V3 (_sigmoid_experts);
    every layer routed but the leading dense ones GLM-4.5's and DeepSeek's files name."""
    if f.arch in ("granitehybrid", *_NEMOTRON_H):   # (their own readers: GraniteMoeShared's fields; _nemotron_h)
        return {}
    count, used = f.arch_get("expert_count"), f.arch_get("expert_used_count")
    if not count:
        if f.arch in ("qwen3moe", "gpt-oss", "qwen2moe", "qwen35moe", "qwen3next", "olmoe", "granitemoe",
                      "ernie4_5-moe", "minimax-m2", *_SIGMOID_MOE):
            raise CheckpointError(f"{f.path}: metadata {f.arch}.expert_count is missing")
        return {}
    if not used:
        raise CheckpointError(f"{f.path}: metadata {f.arch}.expert_used_count is missing")
    if f.arch == "ernie4_5-moe":   # (its dense layers interleaved: its own check)
        return _ernie_experts(f, cfg, int(count), int(used))
    lead = int(f.arch_get("leading_dense_block_count") or 0) if f.arch in _SIGMOID_MOE else 0
    dense = [i for i in range(lead, cfg["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors]
    if dense:   # llama.cpp's llama, qwen3moe and qwen2moe route every layer, the others all after the lead
        raise CheckpointError(f"{f.path}: tensor 'blk.{dense[0]}.ffn_gate_inp.weight' is missing (a {f.arch} "
                              f"mixture of experts routes every layer{f' after the first {lead}' if lead else ''})")
    if f.arch == "llama":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": int(count),
                "num_experts_per_tok": int(used), "sliding_window": None}
    ffn = f.arch_get("expert_feed_forward_length")
    if f.arch in ("minimax-m2", "granitemoe", "olmoe"):
        # families whose experts are intermediate_size wide: GraniteMoeModel and OlmoeModel write no
        # experts' width (llama.cpp sizes them by feed_forward_length), MiniMaxM2Model writes that one
        out = {"num_experts" if f.arch == "olmoe" else "num_local_experts": int(count),   # (each config's name)
               "num_experts_per_tok": int(used), "intermediate_size": int(cfg["intermediate_size"] if ffn is None else ffn)}
        if f.arch == "minimax-m2":
            return {**out, **_minimax_m2_routing(f)}
        # OLMoE: the chosen softmax probabilities weighed as they are (norm_topk_prob false, not in the file)
        return {**out, "norm_topk_prob": False} if f.arch == "olmoe" else out
    if ffn is None:
        raise CheckpointError(f"{f.path}: metadata {f.arch}.expert_feed_forward_length is missing")
    if f.arch == "gpt-oss":   # GptOssConfig: the experts' width is intermediate_size
        return {"num_local_experts": int(count), "num_experts_per_tok": int(used), "intermediate_size": int(ffn)}
    if f.arch in _SIGMOID_MOE:
        return _sigmoid_experts(f, int(count), int(used), int(ffn), lead)
    out = {"num_experts": int(count), "num_experts_per_tok": int(used), "moe_intermediate_size": int(ffn),
           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    if f.arch in ("qwen35moe", "qwen3next"):   # Qwen2-MoE's shared expert, the routing renormalized
        shared = f.arch_get("expert_shared_feed_forward_length")
        if shared is None:
            raise CheckpointError(f"{f.path}: metadata {f.arch}.expert_shared_feed_forward_length is missing")
        out.update(shared_expert_intermediate_size=int(shared))
    if f.arch == "qwen2moe":   # llama.cpp: the shared expert as wide as feed_forward_length when not given
        shared = f.arch_get("expert_shared_feed_forward_length") or cfg["intermediate_size"]
        out.update(norm_topk_prob=False, shared_expert_intermediate_size=int(shared), use_sliding_window=False)
    return out


def _minimax_m2_routing(f: GGUFFile) -> dict[str, Any]:
    """MiniMax-M2's routing as llama.cpp's minimax-m2 runs it (MiniMaxM2Model): sigmoid scores
    (expert_gating_func 2, which TextModel writes from scoring_func) with the choice corrected by
    exp_probs_b, the chosen renormalized; another gating function, or a routed scale other than 1, is
    refused."""
    gating, scale = f.arch_get("expert_gating_func"), f.arch_get("expert_weights_scale")
    if gating != 2:
        raise CheckpointError(f"{f.path}: minimax-m2.expert_gating_func = {gating!r} is not supported (2: sigmoid, "
                              "MiniMax-M2's scoring_func)")
    if scale not in (None, 0, 1):
        raise CheckpointError(f"{f.path}: minimax-m2.expert_weights_scale = {scale!r} is not supported (1)")
    return {"scoring_func": "sigmoid"}


def _ernie_experts(f: GGUFFile, cfg: dict[str, Any], count: int, used: int) -> dict[str, Any]:
    """ERNIE 4.5 MoE's mixture as llama.cpp's ernie4_5-moe runs it (Ernie4_5MoeModel): layer i is a
    mixture where i >= leading_dense_block_count and (i + 1) % interleave_moe_layer_step == 0 (no end
    index: the converter writes none), softmax scores, the choice corrected by exp_probs_b, the chosen
    renormalized (transformers' moe_statics routing), expert_shared_count gated shared experts whose
    total width is expert_shared_feed_forward_length. The converter writes that width as
    intermediate_size // num_key_value_heads, which is the shared experts' width in the published
    models; where it is not expert_shared_count times the experts' width, llama.cpp could not load the
    file either, and it is refused."""
    got = _required(f, ("expert_feed_forward_length", "interleave_moe_layer_step"))
    ffn, step = int(got["expert_feed_forward_length"]), int(got["interleave_moe_layer_step"])
    lead = int(f.arch_get("leading_dense_block_count") or 0)
    n = cfg["num_hidden_layers"]
    layers = [i >= lead and (i + 1) % step == 0 for i in range(n)] if step > 0 else []
    if not any(layers):
        raise CheckpointError(f"{f.path}: ernie4_5-moe.interleave_moe_layer_step = {step} and "
                              f"leading_dense_block_count = {lead} leave no mixture-of-experts layer of {n}")
    wrong = [i for i, moe in enumerate(layers) if moe != (f"blk.{i}.ffn_gate_inp.weight" in f.tensors)]
    if wrong:
        raise CheckpointError(f"{f.path}: layer {wrong[0]} {'lacks' if layers[wrong[0]] else 'has'} tensor "
                              f"'blk.{wrong[0]}.ffn_gate_inp.weight', against its interleave_moe_layer_step = "
                              f"{step} and leading_dense_block_count = {lead}")
    shared = int(f.arch_get("expert_shared_count") or 0)
    width = int(f.arch_get("expert_shared_feed_forward_length") or 0)
    if shared and width != shared * ffn:
        raise CheckpointError(f"{f.path}: ernie4_5-moe.expert_shared_feed_forward_length = {width} is not "
                              f"expert_shared_count = {shared} times expert_feed_forward_length = {ffn}")
    return {"moe_num_experts": count, "moe_k": used, "moe_intermediate_size": ffn, "moe_layer_interval": step,
            "moe_layer_start_index": lead, "moe_layer_end_index": -1, "moe_num_shared_experts": shared}


def _sigmoid_experts(f: GGUFFile, count: int, used: int, ffn: int, lead: int) -> dict[str, Any]:
    """GLM-4.5's, DeepSeek-V3's and Nemotron 3's mixture as llama.cpp reads it: sigmoid scores (expert_gating_func 2),
    the choice biased by exp_probs_b, expert_group_count groups of which expert_group_used_count are
    kept (1 and 1: none), the weights renormalized where expert_weights_norm and times
    expert_weights_scale (1 when absent), expert_shared_count shared experts of the experts' width,
    dense FFNs on the first leading_dense_block_count layers. A deepseek2 file with softmax scores (1,
    or no key: llama.cpp's default, DeepSeek-V2's files) is DeepSeek-V2's mixture: _softmax_experts."""
    gating = f.arch_get("expert_gating_func")
    if gating is None:   # llama.cpp's defaults: deepseek2 softmax, the others sigmoid
        gating = 1 if f.arch == "deepseek2" else 2
    shared = int(f.arch_get("expert_shared_count") or 0)
    if shared < 1:
        raise CheckpointError(f"{f.path}: {f.arch}.expert_shared_count = {shared}: expected 1 or more shared experts")
    common = {"n_routed_experts": count, "num_experts_per_tok": used, "moe_intermediate_size": ffn,
              "n_shared_experts": shared, "first_k_dense_replace": lead,
              "routed_scaling_factor": float(f.arch_get("expert_weights_scale") or 1.0)}
    if gating == 1 and f.arch == "deepseek2":
        return {**common, **_softmax_experts(f)}
    if gating != 2:
        raise CheckpointError(f"{f.path}: {f.arch}.expert_gating_func = {gating} is not supported (2: sigmoid scores; "
                              f"1: softmax, {'on deepseek2 only' if f.arch != 'deepseek2' else 'DeepSeek-V2'})")
    return {**common, "norm_topk_prob": bool(f.arch_get("expert_weights_norm", False)),
            "n_group": int(f.arch_get("expert_group_count") or 1),
            "topk_group": int(f.arch_get("expert_group_used_count") or 1)}


def _softmax_experts(f: GGUFFile) -> dict[str, Any]:
    """DeepSeek-V2 / V2-Lite / Coder-V2's routing as llama.cpp runs it: softmax over every expert, the
    k best, times expert_weights_scale, not renormalized. Refused: renormalized weights
    (expert_weights_norm), a choice correction, and groups (llama.cpp scores a group by its two best
    experts, DeepSeek-V3's rule; DeepSeek-V2's by its best: the file's model and llama.cpp's disagree)."""
    groups, kept = int(f.arch_get("expert_group_count") or 1), int(f.arch_get("expert_group_used_count") or 1)
    if groups > 1 and kept < groups:
        raise CheckpointError(f"{f.path}: deepseek2.expert_group_count = {groups} with softmax routing: llama.cpp "
                              "limits the choice by DeepSeek-V3's group rule, not DeepSeek-V2's; not supported")
    if f.arch_get("expert_weights_norm", False) or any(t.endswith(".exp_probs_b.bias") for t in f.tensors):
        why = "" if f.arch_get("expert_gating_func") is not None else " (deepseek2.expert_gating_func is absent: softmax)"
        raise CheckpointError(f"{f.path}: softmax routing{why} with expert_weights_norm or exp_probs_b is not "
                              "DeepSeek-V2's; not supported")
    return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "topk_method": "greedy",
            "norm_topk_prob": False, "n_group": 1, "topk_group": 1}


def _deepseek2(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's latent attention as llama.cpp's converter writes it (deepseek2): kv_lora_rank,
    q_lora_rank (absent: a plain attn_q, as DeepSeek-V2-Lite's), key_length_mla / value_length_mla (the
    heads' own query-key and value widths; key_length / value_length are the latent form's; an older
    file, one attn_kv_b and no *_mla keys, gives the heads' widths as key_length / value_length, as
    llama.cpp reads it), rope.dimension_count RoPE features, interleaved in pairs as the HF checkpoint
    holds them (llama.cpp rotates adjacent pairs: the converter moves nothing). YaRN's magnitude is
    llama.cpp's: RoPE unscaled (attention_factor 1) and the softmax scale times mscale^2 with mscale =
    1 + rope.scaling.yarn_log_multiplier * ln(factor) (the converter writes 0.1 * mscale_all_dim
    there; a YaRN file without it is refused)."""
    mla = f.arch_get("attention.key_length_mla") is not None or f.arch_get("attention.value_length_mla") is not None
    if not mla and "blk.0.attn_kv_b.weight" not in f.tensors:
        raise CheckpointError(f"{f.path}: metadata deepseek2.attention.key_length_mla is missing (a file without it "
                              "holds kv_b_proj as one attn_kv_b, and this one has none)")
    widths = ("attention.key_length_mla", "attention.value_length_mla") if mla else ("attention.key_length",
                                                                                     "attention.value_length")
    need = {k: f.arch_get(k) for k in ("attention.kv_lora_rank", *widths, "rope.dimension_count")}
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise CheckpointError(f"{f.path}: metadata deepseek2.{missing[0]} is missing")
    rope, qk = int(need["rope.dimension_count"]), int(need[widths[0]])
    if not 0 < rope < qk:
        raise CheckpointError(f"{f.path}: deepseek2.rope.dimension_count = {rope} with {widths[0]} = {qk}: "
                              "expected fewer RoPE features than a head's")
    q_rank = int(f.arch_get("attention.q_lora_rank") or 0)
    if (q_rank > 0) != ("blk.0.attn_q_a.weight" in f.tensors):
        raise CheckpointError(f"{f.path}: deepseek2.attention.q_lora_rank = {q_rank} does not match the tensors "
                              f"({'no ' * ('blk.0.attn_q_a.weight' not in f.tensors)}blk.0.attn_q_a.weight)")
    out = {"kv_lora_rank": int(need["attention.kv_lora_rank"]), "q_lora_rank": q_rank or None,
           "qk_nope_head_dim": qk - rope, "qk_rope_head_dim": rope, "v_head_dim": int(need[widths[1]]),
           "num_key_value_heads": cfg["num_attention_heads"], "rope_interleave": True,
           "attention_bias": "blk.0.attn_kv_a_mqa.bias" in f.tensors}
    rope_params = dict(cfg["rope_parameters"])
    if rope_params.get("rope_type") == "yarn":
        log_mul = f.arch_get("rope.scaling.yarn_log_multiplier")
        if log_mul is None:   # llama.cpp then scales RoPE and the softmax alike, transformers otherwise
            raise CheckpointError(f"{f.path}: deepseek2 YaRN without rope.scaling.yarn_log_multiplier (the converter "
                                  "writes 0.1 * mscale_all_dim there) is not supported")
        rope_params["attention_factor"] = 1.0
        if float(log_mul):
            rope_params["mscale_all_dim"] = float(log_mul) / 0.1
        out["rope_parameters"] = rope_params
    return out


def _rope_scaling(f: GGUFFile, head_dim: int) -> dict[str, Any]:
    kind = f.arch_get("rope.scaling.type")
    factor = f.arch_get("rope.scaling.factor")
    if "rope_freqs.weight" in f.tensors:
        if kind not in (None, "none"):
            raise CheckpointError(f"{f.path}: both {f.arch}.rope.scaling.type = {kind!r} and rope_freqs.weight")
        return _llama3_rope(f, head_dim)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return {"rope_type": "default"}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = f.arch_get("rope.scaling.original_context_length")
        if original is None or factor is None:
            raise CheckpointError(f"{f.path}: yarn rope scaling without {f.arch}.rope.scaling.factor and "
                                  "original_context_length")
        out = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
        for key, hf in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if f.arch_get(key) is not None:
                out[hf] = float(f.arch_get(key))
        # llama.cpp's other YaRN knobs, at their neutral values only (its attn factor multiplies the
        # magnitude transformers computes, where transformers' attention_factor replaces it)
        for key, neutral in (("rope.scaling.yarn_attn_factor", 1.0), ("rope.scaling.yarn_ext_factor", 1.0),
                             ("rope.scaling.yarn_log_multiplier", 0.0)):
            if f.arch == "deepseek2" and key.endswith("log_multiplier"):   # _deepseek2's softmax scale
                continue
            if f.arch_get(key) not in (None, neutral):
                raise CheckpointError(f"{f.path}: {f.arch}.{key} = {f.arch_get(key)} is not supported (YaRN as "
                                      "transformers computes it)")
        return out
    raise CheckpointError(f"{f.path}: {f.arch}.rope.scaling.type = {kind!r} is not supported (none, linear, yarn)")


def llama3_divisors(head_dim: int, theta: float, factor: float, low: float, high: float,
                    original: int) -> np.ndarray:
    """Llama 3's per-frequency divisors (HF's _compute_llama3_parameters: inv_freq / divisor)."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def _llama3_rope(f: GGUFFile, head_dim: int) -> dict[str, Any]:
    """rope_freqs.weight (llama.cpp's divisors of each frequency) as transformers' llama3 parameters.
    Only the ratios original/low and original/high change the divisors, so low_freq_factor is taken
    as 1 and the other two are solved from the smoothly scaled frequencies; every divisor is then
    recomputed and must match the file's."""
    div = f.tensor("rope_freqs.weight").astype(np.float64).reshape(-1)
    theta = float(f.arch_get("rope.freq_base") or 10000.0)
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    fail = CheckpointError(f"{f.path}: rope_freqs.weight is not Llama 3's frequency scaling (the only one "
                           "jaxinfer reads from that tensor)")
    if div.shape != inv.shape:
        raise fail
    factor = float(div.max())
    mid = (div > 1 + 1e-6) & (div < factor - 1e-6 * factor)
    if factor <= 1 or mid.sum() < 2:
        raise CheckpointError(f"{f.path}: rope_freqs.weight has {int(mid.sum())} smoothly scaled frequencies; "
                              "Llama 3's scaling is read from two or more")
    # 1/div = (1 - s)/factor + s with s = (original/wavelen - low)/(high - low) = a / wavelen + b
    s = (1 / div[mid] - 1 / factor) / (1 - 1 / factor)
    a, b = np.polyfit(inv[mid] / (2 * math.pi), s, 1)
    if not (a > 0 and b < 0):
        raise fail
    high = 1 - 1 / b            # low = 1: b = -1/(high - 1), a = original/(high - 1)
    original = a * (high - 1)
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": float(high),
              "original_max_position_embeddings": float(original)}
    if not np.allclose(llama3_divisors(head_dim, theta, factor, 1.0, high, original), div, rtol=1e-4):
        raise fail
    rounded = round(original)   # transformers' field is an integer: keep it so where that is exact
    if abs(rounded - original) < 1e-3 * original and np.allclose(
            llama3_divisors(head_dim, theta, factor, 1.0, high * rounded / original, rounded), div, rtol=1e-4):
        params.update(original_max_position_embeddings=rounded, high_freq_factor=float(high * rounded / original))
    return params


def generation_config(f: GGUFFile) -> dict[str, Any]:
    """Stop tokens (EOS, the end-of-turn / end-of-message ids, and the tokens llama.cpp stops at by their
    text: EOG_TEXTS) and the sampling defaults a file may carry (general.sampling.*: llama.cpp's names)."""
    tokens = list(f.get("tokenizer.ggml.tokens") or [])
    stops = [int(v) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
             if (v := f.get(f"tokenizer.ggml.{k}")) is not None]
    stops += [i for i, t in enumerate(tokens) if t in EOG_TEXTS]
    # llama.cpp's rule for gpt-oss's harmony: with <|return|> and <|call|> ending generation, <|end|>
    # ends only a message (the analysis channel's, before the final one)
    texts = {tokens[i] for i in stops if 0 <= i < len(tokens)}
    if {"<|return|>", "<|call|>", "<|end|>"} <= texts:
        stops = [i for i in stops if not 0 <= i < len(tokens) or tokens[i] != "<|end|>"]
    out: dict[str, Any] = {}
    if stops:
        out["eos_token_id"] = list(dict.fromkeys(stops))
    bos = f.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        out["bos_token_id"] = int(bos)
    for key, hf in (("temp", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"),
                    ("penalty_repeat", "repetition_penalty")):
        v = f.get(f"general.sampling.{key}")
        if v is not None:
            out[hf] = v
    if len(out) > ("bos_token_id" in out) + ("eos_token_id" in out):
        out["do_sample"] = True
    return out


# --------------------------------------------------------------------------------- tokenizer

def _score_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """A SentencePiece BPE vocabulary's merges, from its scores: each token that two vocabulary
    pieces join to, ranked by the token's score (highest first), then by the left piece's and the
    right piece's length (longest first), then by the pieces' ids."""
    ids = {t: i for i, t in enumerate(tokens)}
    cands = []
    for tok, score in dict(zip(tokens, scores)).items():
        pairs = sorted(((tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in ids and tok[k:] in ids),
                       key=lambda p: (ids[p[0]], ids[p[1]]))
        cands.extend((score, len(left), len(right), left, right) for left, right in pairs)
    # a stable sort on the key alone keeps equal keys in the order they were found
    cands.sort(key=lambda c: (c[0], c[1], c[2]), reverse=True)
    return [(c[3], c[4]) for c in cands]


def build_tokenizer(f: GGUFFile):
    """(tokenizers.Tokenizer, add_bos) of the file's tokenizer.ggml.* metadata."""
    from tokenizers import AddedToken, Tokenizer, processors
    kind = f.get("tokenizer.ggml.model")
    tokens = f.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise CheckpointError(f"{f.path}: no tokenizer.ggml.model / tokenizer.ggml.tokens metadata (give --tokenizer "
                              "a folder with the model's tokenizer)")
    tokens = list(tokens)
    types = list(f.get("tokenizer.ggml.token_type") or [])
    if kind == "llama":
        tok = _sentencepiece(f, tokens)
    elif kind == "gpt2":
        tok = _byte_level(f, tokens, types)
    else:
        raise CheckpointError(f"{f.path}: tokenizer.ggml.model = {kind!r} is not supported (llama, gpt2); give "
                              "--tokenizer a folder with the model's tokenizer")
    # control tokens are special, user-defined ones (<think>) plain; both matched whole, as llama.cpp does.
    # A Phi-3's (llama.cpp tells them by general.name) also take the whitespace after them, as its
    # tokenizer.json's added tokens do, but for <s>, <unk> and <|endoftext|> (llama.cpp's RSTRIP rule; the
    # tokenizers library strips any Unicode whitespace there, llama.cpp only ASCII's: a no-break space
    # right after such a token is the one difference)
    name = str(f.get("general.name", "")).lower()
    phi3 = "phi-3" in name or "phi3" in name
    strip = lambda t: phi3 and t not in ("<unk>", "<s>", "<|endoftext|>")  # noqa: E731
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True, rstrip=strip(t))
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False, rstrip=strip(t))
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    if len(set(tokens)) != len(tokens):
        seen: set[str] = set()
        twice = next(t for t in tokens if t in seen or seen.add(t))
        raise CheckpointError(f"{f.path}: tokenizer.ggml.tokens lists {twice!r} twice ({len(tokens) - len(set(tokens))} "
                              "repeated tokens)")
    flag = f.get("tokenizer.ggml.add_bos_token")
    bos = f.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(flag) if flag is not None else (kind == "llama" or f.get("tokenizer.ggml.pre") in WHOLE_WORDS_PRE)
    add_bos = add_bos and f.get("tokenizer.ggml.pre") not in NO_BOS_PRE
    if add_bos and bos is not None:
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(single=f"{b}:0 $A:0", pair=f"{b}:0 $A:0 {b}:1 $B:1",
                                                           special_tokens=[(b, int(bos))])
    return tok, add_bos


def _sentencepiece(f: GGUFFile, tokens: list[str]):
    """A "llama" vocabulary: SentencePiece BPE with byte fallback; spaces as U+2581, one prepended as
    tokenizer.ggml.add_space_prefix says (default: yes) to the text and, as llama.cpp does, to each run
    of text after a control or added token (the normalizer runs on the pieces between added tokens one
    by one), also when the run starts with a space (llama.cpp's " " + text: "<s> hi" is "<s>", "▁▁hi",
    as sentencepiece itself makes " hi" with its whitespace kept); the first stripped again when decoding."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    merges, scores = f.get("tokenizer.ggml.merges"), f.get("tokenizer.ggml.scores")
    if merges is None and scores is None:
        raise CheckpointError(f"{f.path}: a SentencePiece vocabulary without tokenizer.ggml.scores or merges")
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges is not None else _score_merges(tokens, list(scores))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=True,
                               byte_fallback=True))
    prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581")] * prefix + [normalizers.Replace(" ", "\u2581")])
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _byte_level(f: GGUFFile, tokens: list[str], types: list[int]):
    """A "gpt2" vocabulary: byte-level BPE over the regexes tokenizer.ggml.pre names. Its tokens are taken
    as the file spells them, as llama.cpp takes them: ordinary ones in GPT-2's byte alphabet, control and
    user-defined ones as raw text (llama.cpp's converter writes added tokens so), matched whole."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    merges = f.get("tokenizer.ggml.merges")
    if merges is None:
        raise CheckpointError(f"{f.path}: a byte-level BPE vocabulary without tokenizer.ggml.merges")
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{f.path}: tokenizer.ggml.pre = {pre!r} is a pre-tokenizer jaxinfer does not know "
                              f"(known: {sorted(PRE_TOKENIZERS)}); give --tokenizer the model's own tokenizer")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges],
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               ignore_merges=pre in WHOLE_WORDS_PRE))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizer_config(f: GGUFFile, add_bos: bool) -> dict[str, Any]:
    tokens = f.get("tokenizer.ggml.tokens") or []
    out: dict[str, Any] = {"add_bos_token": add_bos, "add_eos_token": bool(f.get("tokenizer.ggml.add_eos_token", False))}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        i = f.get(f"tokenizer.ggml.{key}")
        if i is not None and 0 <= int(i) < len(tokens):
            out[name] = tokens[int(i)]
    template = f.get("tokenizer.chat_template")
    named = {k[len("tokenizer.chat_template."):]: f.get(k) for k in f.meta if k.startswith("tokenizer.chat_template.")}
    if named:
        out["chat_template"] = ([{"name": "default", "template": template}] if template else []) + [
            {"name": n, "template": t} for n, t in named.items()]
    elif template is not None:
        out["chat_template"] = template
    return out


# ------------------------------------------------------------------------------ the folder

def cache_root() -> Path:
    return cache_dir("gguf")


def prepare_folder(path: str | os.PathLike) -> Path:
    """The folder of config.json, tokenizer.json, tokenizer_config.json and generation_config.json
    describing GGUF file `path` (built once per file version; its tensors stay in the file)."""
    path = Path(os.path.abspath(path))   # a symlink stays (the Hub cache's point at blobs/<hash>: names matter)
    st = path.stat()
    # this module's own source in the key: a folder made by another version of it is never reused
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    key = hashlib.sha256(f"{code}\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:20]
    folder = cache_root() / f"{path.stem[:60]}-{key}"
    if (folder / "config.json").is_file():
        return folder
    f = GGUFFile(path)
    cfg = hf_config(f)
    tok, add_bos = build_tokenizer(f)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(f, add_bos), indent=1))
    (tmp / "generation_config.json").write_text(json.dumps(generation_config(f), indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))   # last: its presence marks a whole folder
    try:
        os.replace(tmp, folder)
    except OSError:   # another process prepared it first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a prepared folder describes (None for any other folder)."""
    try:
        value = json.loads((Path(folder) / "config.json").read_text()).get(MARKER)
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return Path(value) if isinstance(value, str) else None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary row order of each head (pairs interleaved) back to transformers' (halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFTensors:
    """A GGUF file's tensors by their Hugging Face names (weights.SafetensorsFolder's interface)."""

    def __init__(self, path: Path, hf_cfg: dict[str, Any]):
        import gguf
        self.file = GGUFFile(path)
        self.cfg = hf_cfg
        self._stacked: tuple[str | None, Any] = (None, None)
        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.file.arch)   # "gpt-oss": GPT_OSS
        self.names = gguf.get_tensor_name_map(arch, hf_cfg["num_hidden_layers"])

    def stored(self, name: str) -> str | None:
        parts = self.oss_parts(name) or self.latent_parts(name) or self.qkvz_parts(name) or self.granite_parts(name)
        if parts is not None:
            return parts[0] if all(p in self.file.tensors for p in parts) else None
        stack = self.expert_rows(name)
        if stack is not None:
            return stack[0]
        g = expert_stack(name) or self._mapped(name)
        if g is not None and g not in self.file.tensors and f"{g}.weight" in self.file.tensors:
            g = f"{g}.weight"   # a name with no suffix in transformers (gpt-oss's sinks): llama.cpp adds .weight
        if g is not None and g not in self.file.tensors and self._phi2_qkv(name) is not None:
            g = self._phi2_qkv(name)[0]
        return g if g in self.file.tensors else None

    def _phi2_qkv(self, name: str) -> tuple[str, slice] | None:
        """(attn_qkv, q's, k's or v's rows in it) for Phi-2's q / k / v projection `name`: files converted
        from the remote-code Phi (mixer.Wqkv) hold them fused as [q | k | v] rows, which llama.cpp's phi2
        reads too; None for other names or architectures."""
        m = _PHI2_QKV.fullmatch(name) if self.file.arch == "phi2" else None
        if m is None:
            return None
        width = self.cfg["num_attention_heads"] * (self.cfg["hidden_size"] // self.cfg["num_attention_heads"])
        j = "qkv".index(m.group(2))
        return f"blk.{m.group(1)}.attn_qkv.{m.group(3)}", slice(j * width, (j + 1) * width)

    def _mapped(self, name: str) -> str | None:
        """llama.cpp's name of transformers' tensor `name` (gguf.TensorNameMap; the router's correction
        bias renamed first, as the converter does: .e_score_correction.bias -> exp_probs_b.bias; one
        head's q / k norm: the layer's stacked tensor)."""
        if name.endswith(".e_score_correction_bias"):
            name = name[:-len("_bias")] + ".bias"
        if name.endswith((".linear_attn.dt_bias", ".mamba.dt_bias", ".mixer.dt_bias")):   # the converter's rename:
            name = name[:-len("dt_bias")] + "dt_proj.bias"                                 # dt_proj.bias -> ssm_dt.bias
        head = _QK_NORM_HEAD.fullmatch(name)
        if head is not None:
            name = f"{head.group(1)}.weight"
        return self.names.get_name(name, try_suffixes=(".weight", ".bias"))

    def expert_rows(self, name: str) -> tuple[str, slice] | None:
        """(llama.cpp stacked tensor, its rows along axis 1) holding transformers' per-expert matrix
        `name`: ffn_{gate,up,down}_exps, or gate's or up's half of one ffn_gate_up_exps (gate's rows
        first: convert_hf_to_gguf.py's --fuse-gate-up-exps); None for other names, or neither stored."""
        stack = expert_stack(name)
        if stack is None or stack in self.file.tensors:
            return None if stack is None else (stack, slice(None))
        fused = re.sub(r"ffn_(gate|up)_exps", "ffn_gate_up_exps", stack)
        if fused == stack or fused not in self.file.tensors:
            return None
        return fused, self._half(fused, "gate" if ".ffn_gate_exps." in stack else "up")

    def _half(self, fused: str, part: str) -> slice:
        """Gate's or up's rows of a fused ffn_gate_up_exps tensor [E, 2F(, D)], gate's first (2F rows,
        F the experts' width in the metadata, else the file is refused)."""
        rows = int(self.file.tensors[fused][0].shape[::-1][1])
        f = int(self.cfg.get("moe_intermediate_size") or self.cfg["intermediate_size"])
        if rows != 2 * f:
            raise CheckpointError(f"{self.file.path}: tensor {fused!r} has {rows} rows of gate and up; expected "
                                  f"2 x {f} (the experts' feed_forward_length)")
        return slice(0, f) if part == "gate" else slice(f, 2 * f)

    def oss_parts(self, name: str) -> list[str] | None:
        """The llama.cpp tensors gpt-oss's experts tensor `name` is made of (_OSS_EXPERTS): down as
        ffn_down_exps, gate_up as ffn_gate_exps and ffn_up_exps or, fused, ffn_gate_up_exps (gate's
        rows first); None for any other name."""
        m = _OSS_EXPERTS.fullmatch(name) if self.file.arch == "gpt-oss" else None
        if m is None:
            return None
        layer, suffix = m.group(1), ".bias" if m.group(3) else ".weight"
        if m.group(2) == "down_proj":
            return [f"blk.{layer}.ffn_down_exps{suffix}"]
        fused = f"blk.{layer}.ffn_gate_up_exps{suffix}"
        return [fused] if fused in self.file.tensors else [f"blk.{layer}.ffn_{p}_exps{suffix}" for p in ("gate", "up")]

    def oss_rows(self, name: str, part: str) -> tuple[str, slice]:
        """(llama.cpp tensor, its rows along axis 1) holding gpt-oss's experts tensor `name`'s `part`
        (gate, up or down), each expert's rows [out, in] as llama.cpp stores them."""
        parts = self.oss_parts(name)
        if len(parts) == 2:
            return parts[part == "up"], slice(None)
        return parts[0], slice(None) if part == "down" else self._half(parts[0], part)

    def _oss(self, name: str) -> np.ndarray:
        """gpt-oss's experts tensor `name` in transformers' layout (_OSS_EXPERTS)."""
        if name.endswith(("down_proj", "down_proj_bias")):
            x = self.file.tensor(self.oss_parts(name)[0])                 # [E, D, F] or bias [E, D]
            return x if x.ndim == 2 else x.transpose(0, 2, 1)
        read = {t: self.file.tensor(t) for t in self.oss_parts(name)}
        gate, up = (read[t][:, rows] for t, rows in (self.oss_rows(name, p) for p in ("gate", "up")))
        if gate.shape != up.shape:
            raise CheckpointError(f"{self.file.path}: gate's and up's tensors {self.oss_parts(name)} of {name!r} have "
                                  f"the shapes {list(gate.shape)} and {list(up.shape)}; expected the same")
        if gate.ndim == 3:                                                # [E, F, D] -> [E, D, F]
            gate, up = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), np.float32)
        out[..., 0::2], out[..., 1::2] = gate, up                         # interleaved, as transformers holds them
        return out

    def latent_parts(self, name: str) -> list[str] | None:
        """The llama.cpp tensors DeepSeek's kv_b_proj is split into (attn_k_b, each head's key
        up-projection transposed, and attn_v_b: what the converter writes for llama.cpp's absorbed
        attention), when the file has no attn_kv_b (older files); None for any other name."""
        m = _KV_B.fullmatch(name)
        if m is None or self.file.arch != "deepseek2" or f"blk.{m.group(1)}.attn_kv_b.weight" in self.file.tensors:
            return None
        return [f"blk.{m.group(1)}.attn_{p}_b.weight" for p in ("k", "v")]

    def _kv_b(self, name: str) -> np.ndarray:
        """kv_b_proj [H (nope + v), r] from attn_k_b [H, r, nope] and attn_v_b [H, v, r] (their row-major
        shapes), each head's key rows then its value rows, as DeepSeek's checkpoint holds them."""
        k_name, v_name = self.latent_parts(name)
        k, v = self.file.tensor(k_name), self.file.tensor(v_name)
        h, r = self.cfg["num_attention_heads"], self.cfg["kv_lora_rank"]
        nope, vd = self.cfg["qk_nope_head_dim"], self.cfg["v_head_dim"]
        for t, x, shape in ((k_name, k, (h, r, nope)), (v_name, v, (h, vd, r))):
            if x.shape != shape:
                raise CheckpointError(f"{self.file.path}: tensor {t!r} has the shape {list(x.shape)}; expected "
                                      f"{list(shape)} (heads, then the latent attention's widths in the metadata)")
        return np.concatenate([k.transpose(0, 2, 1), v], axis=1).reshape(h * (nope + vd), r)

    def qkvz_parts(self, name: str) -> list[str] | None:
        """The tensors Qwen3-Next's in_proj_qkvz is split into by the converter (attn_qkv: every key
        head's q, then k, then v; attn_gate: z), for a qwen3next file; None for any other name."""
        m = _QKVZ.fullmatch(name) if self.file.arch == "qwen3next" else None
        if m is None or f"blk.{m.group(1)}.attn_qkv.weight" not in self.file.tensors:
            return None   # (older files: ssm_in, transformers' in_proj_qkvz as it is, which llama.cpp still reads)
        return [f"blk.{m.group(1)}.attn_qkv.weight", f"blk.{m.group(1)}.attn_gate.weight"]

    def _qkvz(self, name: str) -> np.ndarray:
        """in_proj_qkvz as transformers holds it, grouped per key head ([q, k, v, z] of each), from
        attn_qkv and attn_gate (the inverse of Qwen3NextModel.modify_tensors' split)."""
        qkv_name, z_name = self.qkvz_parts(name)
        qkv, z = self.file.tensor(qkv_name), self.file.tensor(z_name)
        hk, dk = self.cfg["linear_num_key_heads"], self.cfg["linear_key_head_dim"]
        vd = self.cfg["linear_num_value_heads"] * self.cfg["linear_value_head_dim"]
        if qkv.shape[0] != 2 * hk * dk + vd or z.shape[0] != vd:
            raise CheckpointError(f"{self.file.path}: tensors {qkv_name!r} / {z_name!r} have {qkv.shape[0]} / "
                                  f"{z.shape[0]} rows; expected {2 * hk * dk + vd} / {vd} (the ssm.* sizes)")
        per = lambda x: x.reshape(hk, -1, x.shape[-1])  # noqa: E731   (key head, its rows, d)
        parts = (qkv[:hk * dk], qkv[hk * dk:2 * hk * dk], qkv[2 * hk * dk:], z)
        return np.concatenate([per(x) for x in parts], axis=1).reshape(-1, qkv.shape[-1])

    def granite_parts(self, name: str) -> list[str] | None:
        """The tensors a granitehybrid or granitemoe file holds Granite's fused MLP tensors in (GraniteMoeModel.
        modify_tensors): the experts' input_linear [E, 2F, D] as ffn_gate_exps and ffn_up_exps, the
        shared MLP's input_linear [2S, D] as ffn_gate_shexp and ffn_up_shexp and its output_linear as
        ffn_down_shexp (a model without experts: ffn_gate, ffn_up, ffn_down); None for any other name
        (the experts' output_linear is ffn_down_exps by the name map)."""
        m = _GRANITE_MLP.fullmatch(name) if self.file.arch in ("granitehybrid", "granitemoe") else None
        if m is None or (m.group(2) == "block_sparse_moe" and m.group(3) == "output_linear"):
            return None
        layer, gate_up = m.group(1), ("gate", "up") if m.group(3) == "input_linear" else ("down",)
        suffix = "_exps" if m.group(2) == "block_sparse_moe" else "_shexp" if self.cfg.get("num_local_experts") else ""
        return [f"blk.{layer}.ffn_{p}{suffix}.weight" for p in gate_up]

    def _granite_mlp(self, name: str) -> np.ndarray:
        """A fused Granite MLP tensor from its parts (granite_parts): gate's rows, then up's."""
        parts = self.granite_parts(name)
        read = [self.file.tensor(t) for t in parts]
        if any(x.shape != read[0].shape for x in read):
            raise CheckpointError(f"{self.file.path}: tensors {parts} of {name!r} have the shapes "
                                  f"{[list(x.shape) for x in read]}; expected the same")
        return np.concatenate(read, axis=-2)

    def columns_reordered(self, name: str) -> bool:
        """Whether the tensor's columns (within its rows' blocks) need reordering: a tiled qwen35 /
        qwen35moe out_proj (_untile), which cannot stay packed."""
        return (self.file.arch in ("qwen35", "qwen35moe") and name.endswith(".linear_attn.out_proj.weight")
                and self.cfg["linear_num_key_heads"] != self.cfg["linear_num_value_heads"])

    def _untile(self, name: str, x: np.ndarray) -> np.ndarray:
        """A qwen35 / qwen35moe Gated DeltaNet tensor's value heads back from the converter's tiled
        order (value head j of key head g at j Hk + g) to transformers' grouped one (g r + j, r = Hv /
        Hk): the v rows of in_proj_qkv and of the taps, in_proj_z's rows, in_proj_a's / in_proj_b's,
        A_log's and dt_bias's, out_proj's columns; as stored where Hv = Hk."""
        hk, hv = self.cfg["linear_num_key_heads"], self.cfg["linear_num_value_heads"]
        if self.file.arch not in ("qwen35", "qwen35moe") or hk == hv or ".linear_attn." not in name:
            return x

        def grouped(a: np.ndarray, axis: int, width: int) -> np.ndarray:
            shape = a.shape
            a = a.reshape(*shape[:axis], hv // hk, hk, width, *shape[axis + 1:])
            return np.swapaxes(a, axis, axis + 1).reshape(shape)
        dv, qk = self.cfg["linear_value_head_dim"], 2 * hk * self.cfg["linear_key_head_dim"]
        if ".in_proj_qkv." in name or ".conv1d." in name:
            return np.concatenate([x[:qk], grouped(x[qk:], 0, dv)])
        if ".in_proj_z." in name:
            return grouped(x, 0, dv)
        if any(p in name for p in (".in_proj_a.", ".in_proj_b.", ".A_log", ".dt_bias")):
            return grouped(x, 0, 1)
        if ".out_proj." in name:
            return grouped(x, 1, dv)
        return x

    def has(self, name: str) -> bool:
        return self.stored(name) is not None

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(np.float32)

    def source(self, name: str) -> str:
        return str(self.file.path)

    def get(self, name: str) -> np.ndarray:
        g = self.stored(name)
        if g is None:
            wanted = (self.oss_parts(name) or self.latent_parts(name) or self.granite_parts(name)
                      or [expert_stack(name) or self._mapped(name)])
            missing = [t for t in wanted if t not in self.file.tensors]
            raise CheckpointError(f"{self.file.path}: tensor {name!r} (GGUF {', '.join(map(repr, missing))}) "
                                  "not found")
        if self.oss_parts(name) is not None:   # gate's and up's parameters read it in turn: composed once
            if self._stacked[0] != name:
                self._stacked = (name, self._oss(name))
            return self._stacked[1]
        if self.latent_parts(name) is not None:
            return self._kv_b(name)
        if self.qkvz_parts(name) is not None:
            return self._qkvz(name)
        if self.granite_parts(name) is not None:   # the experts' gate and up parameters read it in turn
            if self._stacked[0] != name:
                self._stacked = (name, self._granite_mlp(name))
            return self._stacked[1]
        m = _EXPERT.fullmatch(name)
        if m is None:
            return self.rows(name, self.file.tensor(g))
        if self._stacked[0] != g:   # every expert of a layer is read in turn: dequantize the stack once
            self._stacked = (g, self.file.tensor(g))
        return self._stacked[1][int(m.group(2))][self.expert_rows(name)[1]]

    def rows(self, name: str, x: np.ndarray) -> np.ndarray:
        """x, indexed by tensor `name`'s rows as stored, in transformers' row order (Llama's Q and K:
        llama.cpp's rotary order turned back); Gemma's norm weights as transformers' w of (1 + w)
        (llama.cpp's converter stores 1 + w); Qwen2-MoE's shared-expert gate [D] as its one row [1, D];
        StableLM's stacked q / k norms as one head's; GPT-NeoX's fused q / k / v rows per head; the Gated
        DeltaNet models' norms (1 + w), A_log (-exp) and tiled value heads (_untile) undone."""
        if self.file.arch in (*_GEMMA, "gemma") and name.endswith("norm.weight"):
            return x - 1.0
        if self.file.arch in _DELTANET:   # (Qwen3NextModel.modify_tensors' changes undone)
            if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                x = x - 1.0
            elif name.endswith(".A_log"):
                x = np.log(-x)
            x = self._untile(name, x)
        mixer = {"granitehybrid": ".mamba.", **dict.fromkeys(_NEMOTRON_H, ".mixer.")}.get(self.file.arch)
        if mixer is not None and mixer in name:   # a Mamba-2 mixer's (Mamba2Model.modify_tensors undone)
            if name.endswith(".A_log"):   # stored as -exp(A_log), [H, 1]
                return np.log(-x).reshape(-1)
            if name.endswith((".D", ".norm.weight")):   # [H, 1]; the gated norm's [groups, I / groups]
                return x.reshape(-1)
        if name.endswith("shared_expert_gate.weight") and x.ndim == 1:   # llama.cpp's {n_embd}: one row
            return x[None, :]
        head = _QK_NORM_HEAD.fullmatch(name)
        if head is not None:   # one head's row of the stacked norms
            return x[int(head.group(2))]
        fused = self._phi2_qkv(name)
        if fused is not None and self.stored(name) == fused[0]:   # q's, k's or v's rows of attn_qkv
            return x[fused[1]]
        if self.file.arch == "gptneox" and ".attention.query_key_value." in name:
            # the converter's [q | k | v] rows -> transformers' [heads, 3, head_dim] (GPTNeoXModel.modify_tensors)
            h = self.cfg["num_attention_heads"]
            return x.reshape(3, h, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
        if self.file.arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                             "k_proj.bias")):
            heads = self.cfg["num_attention_heads"] if ".q_proj." in name else self.cfg["num_key_value_heads"]
            x = _unpermute(x, heads)
        return x
