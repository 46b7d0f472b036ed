"""Perplexity and bits per byte of a text (`jaxinfer eval-ppl`).

The text is encoded once with the model's tokenizer (BOS prepended when the tokenizer adds one;
BOS is never scored). Long texts are scored with a sliding window: windows of `window` tokens
advance by `stride` (default window // 2) and each scores only the tokens no earlier window
scored, so every token after the first is scored exactly once, with at least window - stride
tokens of context (except near the start).
    perplexity    = exp(total NLL / scored tokens)
    bits per byte = total NLL / ln 2 / UTF-8 bytes of the text
Bits per byte compares models with different tokenizers; perplexity does not.
With kv_dtype (e.g. "int8") each window runs the engine's paged path instead of the plain
forward: its K/V are written into pages of that dtype and attention reads them back, so the
score includes the KV quantization error exactly as serving sees it.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.kv_cache import AttentionMetadata, init_kv_pages, kv_storage_dtype, with_states
from jaxinfer.models.decoder import Decoder
from jaxinfer.tokenizer import Tokenizer


def score_windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, first scored position, end) per window over n tokens: positions 1..n-1 once each,
    except a window's first position where no earlier window reaches it (stride == window: it has
    no context in its window), as transformers' strided perplexity recipe scores them."""
    spans, scored_to, begin = [], 1, 0
    while True:
        end = min(begin + window, n)
        first = max(scored_to, begin + 1)
        if end > first:
            spans.append((begin, first, end))
        scored_to = max(scored_to, end)
        if end >= n:
            return spans
        begin += stride


def _window_logits_fn(model: Decoder, window: int, kv_dtype: str | None):
    """(params, tokens [W]) -> logits [W, V]: the plain causal forward, or with kv_dtype the
    engine's paged path (K/V written into pages of that dtype, then read back by attention)."""
    graphdef, _ = nnx.split(model)
    pos = jnp.arange(window, dtype=jnp.int32)
    if kv_dtype is None:
        return lambda params, t: nnx.merge(graphdef, params)(t, pos)[0]
    cfg, bs = model.cfg, 16
    n_blocks = -(-window // bs)
    meta = AttentionMetadata(jnp.zeros(window, jnp.int32), pos + bs,          # block 0 is the null block
                             jnp.arange(1, n_blocks + 1, dtype=jnp.int32)[None], jnp.array([window], jnp.int32),
                             jnp.array([0, window], jnp.int32),
                             state_slots=jnp.zeros(1, jnp.int32) if cfg.has_state else None)
    dtype = kv_storage_dtype(kv_dtype)

    def run(params, t):
        pages = init_kv_pages(cfg.n_attn_layers, cfg.n_kv_heads, cfg.head_dim, n_blocks + 1, bs, dtype,
                              cfg.kv_value_dim)
        if cfg.has_state:   # conv and Gated DeltaNet layers: one state slot, the window's
            pages = with_states(pages, cfg, 1, model.embed.get_value().dtype)
        return nnx.merge(graphdef, params)(t, pos, pages, meta)[0]
    return run


def eval_ppl(model: Decoder, tokenizer: Tokenizer, text: str, window: int = 256, stride: int | None = None,
             batch: int = 8, kv_dtype: str | None = None) -> dict[str, Any]:
    stride = stride or window // 2
    if not 0 < stride <= window <= model.cfg.exact_positions:
        raise ValueError(f"need 0 < stride ({stride}) <= window ({window}) <= the model's "
                         f"context ({model.cfg.exact_positions} positions)")
    ids = np.asarray(tokenizer.encode(text), np.int32)
    if len(ids) < 2:
        raise ValueError("the text has fewer than two tokens: nothing to score")
    spans = score_windows(len(ids), window, stride)
    n_rows = -(-len(spans) // batch) * batch
    windows = np.zeros((n_rows, window), np.int32)
    targets = np.zeros((n_rows, window - 1), bool)     # row j predicts token j + 1 of the window
    for i, (b, s, e) in enumerate(spans):
        windows[i, : e - b] = ids[b:e]
        targets[i, s - b - 1: e - b - 1] = True
    _, params = nnx.split(model)
    forward = _window_logits_fn(model, window, kv_dtype)

    @jax.jit
    def window_nll(params, w, mask):          # w [B, W], mask [B, W-1] -> summed NLL [B]
        logits = jax.vmap(lambda t: forward(params, t))(w)                  # (B, W, V)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, w[:, 1:, None], axis=-1)[..., 0]   # (B, W-1)
        return jnp.sum(jnp.where(mask, nll, 0.0), axis=1)

    total = 0.0
    for i in range(0, n_rows, batch):
        total += float(np.sum(np.asarray(window_nll(params, windows[i: i + batch], targets[i: i + batch]),
                                         np.float64)))
    n_tokens, n_bytes = int(targets.sum()), len(text.encode("utf-8"))
    return {"nll": total, "tokens": n_tokens, "bytes": n_bytes, "loss": total / n_tokens,
            "ppl": math.exp(total / n_tokens), "bits_per_byte": total / math.log(2) / n_bytes,
            "window": window, "stride": stride, "kv_dtype": kv_dtype}
