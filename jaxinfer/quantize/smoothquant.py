"""SmoothQuant W8A8 (Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models"): migrate activation outliers into the weights, then int8
weights per output channel and int8 activations per token (dynamic) with an int8 x int8 -> int32
matmul (quant.py, act_bits=8).

For the linears reading one tap X [T, K] (calibrate.py), with max_k = max_t |X_tk| over the
calibration tokens and w_k = max_n |W_kn| over their concatenated output columns:
    s_k = max_k ** alpha / w_k ** (1 - alpha)       (alpha = 0.5, the paper's default)
X / s is produced by folding 1/s into the previous operator exactly as AWQ does (methods._fold:
norm weights, v -> o with one factor per KV-head channel, up -> down), and W's rows are
multiplied by s. Where the architecture allows no fold the group is quantized unsmoothed.
Only dynamic per-token activation scales are built (`--act-scales static` is issue 17's next step).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxinfer.quant import quantize


def smoothing_factors(act_absmax: np.ndarray, w: np.ndarray, alpha: float,
                      kv_groups: tuple[int, int, int] | None = None) -> np.ndarray:
    """act_absmax [K], w [K, N] -> s [K] (kv_groups as in awq.search_scale: s shared per KV channel)."""
    a = np.asarray(act_absmax, np.float64)
    wmax = np.abs(np.asarray(w, np.float64)).max(axis=1)
    if kv_groups is not None:     # the maxima over the query heads that share a KV head
        hkv, rep, hd = kv_groups
        a, wmax = (np.repeat(v.reshape(hkv, rep, hd).max(axis=1, keepdims=True), rep, axis=1).reshape(-1)
                   for v in (a, wmax))
    s = np.power(np.maximum(a, 1e-5), alpha) / np.power(np.maximum(wmax, 1e-5), 1 - alpha)
    return np.clip(s, 1e-5, None).astype(np.float32)


def smoothquant_block(block, x, runner, settings, bar=None) -> None:
    from jaxinfer.quantize import _matrix, linears
    from jaxinfer.quantize.methods import _fold

    for tap, group in linears(block).items():
        a = runner.run(block, tap, x, settings.chunk, bar)                           # (B, W, K)
        act_absmax = np.asarray(jnp.max(jnp.abs(a.reshape(-1, a.shape[-1])), axis=0))
        mats = [_matrix(owner, name) for owner, name in group]
        w = np.concatenate([m[0] for m in mats], axis=1)
        cfg = block.attn.cfg
        kv_groups = (cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim) if tap == "o_in" else None
        s = smoothing_factors(act_absmax, w, settings.alpha, kv_groups)
        if not _fold(block, tap, s):
            s = np.ones_like(s)
        for (owner, name), (wm, shape, contract) in zip(group, mats):
            qw = quantize(jnp.asarray((wm * s[:, None]).reshape(shape)), 8, contract=contract)
            getattr(owner, name).set_value(dataclasses.replace(qw, act_bits=8))
