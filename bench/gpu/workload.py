"""The shapes and counts of `python -m bench.gpu`'s two runs: REAL (the Llama-3-8B-shaped model on a
GPU) and SMOKE (every part on CPU with tiny shapes). bench/gpu/run.py picks one and hands it to each part
(bench/gpu/parts.py); both import it from here, so neither imports the other for it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    """Every shape and count a run uses: the real run and --smoke differ only here."""
    model: dict[str, Any]            # HF config.json fields of the random Llama
    prompt_len: int                  # tokens per prompt, random ids
    decode_tokens: int               # N of batch-1 decode tok/s = N / (t(N+1 tokens) - t(1 token))
    batch1_reps: int                 # pairs (t(1), t(N+1)) whose medians are used
    concurrency: tuple[int, ...]     # requests submitted at once
    new_tokens: int                  # generated per concurrent request
    warm_tokens: int                 # the short run that compiles a batch's shapes before timing
    hf_batch: int                    # HF's batched run (one of `concurrency`)
    max_num_seqs: int
    block_size: int
    max_num_batched_tokens: int
    attention_tokens: tuple[int, ...]
    matmul_rows: tuple[int, ...]     # M of the weight-only matmuls
    copy_bytes: int                  # buffer size of the copy ceiling (each call moves twice this)
    square: int                      # n of the n^3 bf16 matmul ceiling
    square_calls: int
    chain_bytes: int                 # weight bytes one timed matmul chain reads (distinct weights)
    attention_flops: float           # FLOPs one timed attention chain computes (at least one call)
    max_chain: int                   # kernels per timed call, at most
    reps: int                        # timed calls per kernel measurement (median)
    xla_attention_max_bytes: int     # the XLA attention's float32 scores beyond this are not tried

    @property
    def max_model_len(self) -> int:
        """The longest sequence rounded up to a power of two (few block-table buckets)."""
        longest = self.prompt_len + max(self.decode_tokens + 1, self.new_tokens)
        return 1 << (longest - 1).bit_length()

    @property
    def num_blocks(self) -> int:
        """KV blocks for every concurrent request at full length plus the multi-step decode's
        lookahead (8 tokens), +10%, + the null block: the pool never preempts and is never sized
        from free memory (the automatic sizing is being rewritten)."""
        per_seq = math.ceil((self.prompt_len + self.new_tokens + 8) / self.block_size)
        return math.ceil(max(self.concurrency) * per_seq * 1.1) + 1


LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
             "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
             "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu"}
# head_dim 32, K = 128 or 256 in every projection (int4's groups of 128 fit, as in the 8B shape)
TINY_LLAMA = dict(LLAMA3_8B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2)

GiB = 1 << 30
REAL = Workload(model=LLAMA3_8B, prompt_len=128, decode_tokens=128, batch1_reps=3, concurrency=(16, 64, 256),
                new_tokens=128, warm_tokens=8, hf_batch=64, max_num_seqs=256, block_size=16,
                max_num_batched_tokens=512, attention_tokens=(2048, 8192, 32768), matmul_rows=(1, 16, 128),
                copy_bytes=2 * GiB, square=8192, square_calls=8, chain_bytes=2 * GiB, attention_flops=3e11,
                max_chain=32, reps=10, xla_attention_max_bytes=4 * GiB)
SMOKE = dataclasses.replace(
    REAL, model=TINY_LLAMA, prompt_len=8, decode_tokens=8, concurrency=(2, 4, 8), new_tokens=8, warm_tokens=2,
    # a 16-token budget: every level prefills in 16-token chunks and decodes in the 8-token bucket, so
    # only batch 1 compiles (two shapes), as in the real run's 512-token budget most shapes repeat
    hf_batch=4, max_num_seqs=8, max_num_batched_tokens=16, attention_tokens=(32, 64), copy_bytes=1 << 22,
    square=128, square_calls=2, chain_bytes=1, attention_flops=1.0, max_chain=2, reps=3)
