"""SmoothQuant W8A8 (Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models"): migrate activation outliers into the weights, then int8
weights per output channel and int8 activations per token (dynamic) with an int8 x int8 -> int32
matmul (jaxinfer/quant/dispatch.py, act_bits=8).

For the linears reading one tap X [T, K] (calibrate.py), with max_k = max_t |X_tk| over the
calibration tokens and w_k = max_n |W_kn| over their concatenated output columns:
    s_k = max_k ** alpha / w_k ** (1 - alpha)       (alpha = 0.5, the paper's default)
X / s is produced by folding 1/s into the previous operator exactly as AWQ does (methods._fold:
norm weights, v -> o with one factor per KV-head channel, up -> down), and W's rows are
multiplied by s. Where the architecture allows no fold the group is quantized unsmoothed.

Activation scales (`--act-scales`):
  dynamic  each token's row x_t gets sx = max|x_t| / 127 at run time (no calibration of x);
  static   one scale per linear input, calibrated here from the smoothed calibration activations
           X / s (`--act-calib`, symmetric, values beyond 127 * scale clip at run time):
             minmax      scale = max |X| / 127
             percentile  scale = P_p(|X|) / 127 (p = --act-percentile, default 99.99): the
                         outliers beyond the p-th percentile clip instead of stretching the grid
             mse         scale = c / 127 for the clip c in {max|X| * i / n, i = 1..n} (n = 100)
                         minimising the mean squared error of the linears' output,
                         mean(((dequant(quant(X)) - X) @ W)^2), over sampled rows (the rounding
                         error of the many small values traded against the clipping error of
                         the few large ones, each weighted by the weights that read it); without
                         W, the error of X itself
  asymmetric (`--act-asym`, static only): the same three calibrations choose a range [lo, hi]
           (always containing 0) instead of a bound on |x|: minmax [min X, max X], percentile
           [P_(100-p)(X), P_p(X)], mse the shrink r * [lo, hi] of the min/max range with the least
           output error; scale = (hi - lo) / 255 and zero point z = round(-128 - lo / scale), so
           that lo -> -128 and hi -> 127. A one-sided input (after SiLU, say) then uses all 256
           codes instead of the half that a symmetric grid gives it.
A static scale costs no reduction over x per token (a fused kernel can quantize x on the fly),
and is what integer-only pipelines need; its price is the clipping of unseen outliers.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxinfer.quant import quantize
from jaxinfer.quantize.calibrate import sample_rows
from jaxinfer.quantize.common import float_matrix, linears
from jaxinfer.quantize.methods import _fold


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


ACT_CALIBS = ("minmax", "percentile", "mse")


def _int8_mse(x: np.ndarray, scale: float, w: np.ndarray | None) -> float:
    err = np.clip(np.round(x / scale), -128, 127) * scale - x   # the run time's codes (quantize_rows_int8)
    return float(np.mean((err if w is None else err @ w) ** 2))


def static_act_scale(x: np.ndarray, calib: str, percentile: float = 99.99, n_grid: int = 100,
                     max_rows: int = 1024, seed: int = 0, w: np.ndarray | None = None) -> float:
    """Calibration activations x [..., K] -> one symmetric int8 scale (module docstring). minmax and
    percentile read every value; mse searches on up to max_rows rows (sampled with `seed`) for the
    least output error through w [K, N] (None: the error of x)."""
    a = np.abs(np.asarray(x, np.float32)).reshape(-1)
    amax = float(a.max()) if a.size else 0.0
    if amax == 0.0:
        return 1.0
    if calib == "minmax":
        return amax / 127.0
    if calib == "percentile":
        clip = float(np.percentile(a, percentile))
        return (clip if clip > 0 else amax) / 127.0
    if calib == "mse":
        xs = sample_rows(np.asarray(x, np.float32), max_rows, seed)
        w = None if w is None else np.asarray(w, np.float32)
        scales = [amax * i / n_grid / 127.0 for i in range(1, n_grid + 1)]
        errs = [_int8_mse(xs, s, w) for s in scales]
        return scales[int(np.argmin(errs))]
    raise ValueError(f"--act-calib must be one of {', '.join(ACT_CALIBS)}, got {calib!r}")


def range_params(lo: float, hi: float) -> tuple[float, int]:
    """An asymmetric int8 grid for [lo, hi] (widened to contain 0) -> (scale, zero point in [-128, 127])."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if hi - lo == 0.0:
        return 1.0, 0
    scale = (hi - lo) / 255.0
    return scale, int(np.clip(np.round(-128.0 - lo / scale), -128, 127))


def _int8_mse_asym(x: np.ndarray, scale: float, zero: int, w: np.ndarray | None) -> float:
    err = (np.clip(np.round(x / scale) + zero, -128, 127) - zero) * scale - x
    return float(np.mean((err if w is None else err @ w) ** 2))


def static_act_range(x: np.ndarray, calib: str, percentile: float = 99.99, n_grid: int = 100,
                     max_rows: int = 1024, seed: int = 0, w: np.ndarray | None = None) -> tuple[float, int]:
    """Calibration activations x [..., K] -> (scale, zero point) of one asymmetric int8 grid
    (module docstring); arguments as for static_act_scale."""
    a = np.asarray(x, np.float32).reshape(-1)
    if a.size == 0:
        return 1.0, 0
    if calib == "minmax":
        return range_params(a.min(), a.max())
    if calib == "percentile":
        return range_params(np.percentile(a, 100.0 - percentile), np.percentile(a, percentile))
    if calib == "mse":
        xs = sample_rows(np.asarray(x, np.float32), max_rows, seed)
        w = None if w is None else np.asarray(w, np.float32)
        lo, hi = float(a.min()), float(a.max())
        grids = [range_params(lo * i / n_grid, hi * i / n_grid) for i in range(1, n_grid + 1)]
        errs = [_int8_mse_asym(xs, sc, z, w) for sc, z in grids]
        return grids[int(np.argmin(errs))]
    raise ValueError(f"--act-calib must be one of {', '.join(ACT_CALIBS)}, got {calib!r}")


def smoothquant_block(block, x, runner, settings, bar=None) -> None:
    for tap, group in linears(block).items():
        a = runner.run(block, tap, x, settings.chunk, bar)                           # (B, W, K)
        act_absmax = np.asarray(jnp.max(jnp.abs(a.reshape(-1, a.shape[-1])), axis=0))
        mats = [float_matrix(owner, name) for owner, name in group]
        w = np.concatenate([m[0] for m in mats], axis=1)
        cfg = block.attn.cfg
        kv_groups = (cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim) if tap == "o_in" else None
        s = smoothing_factors(act_absmax, w, settings.alpha, kv_groups)
        if not _fold(block, tap, s):
            s = np.ones_like(s)
        act_scale = act_zero = None
        if settings.act_scales == "static":     # from the smoothed input X / s (what the linears will read)
            xs = np.asarray(a, np.float32).reshape(-1, a.shape[-1]) / s[None, :]
            if settings.act_symmetric:
                sc = static_act_scale(xs, settings.act_calib, settings.act_percentile, seed=settings.seed,
                                      w=w * s[:, None])
            else:
                sc, z = static_act_range(xs, settings.act_calib, settings.act_percentile, seed=settings.seed,
                                         w=w * s[:, None])
                act_zero = jnp.asarray(z, jnp.int32)
            act_scale = jnp.asarray(sc, jnp.float32)
        for (owner, name), (wm, shape, contract) in zip(group, mats):
            qw = quantize(jnp.asarray((wm * s[:, None]).reshape(shape)), 8, contract=contract)
            getattr(owner, name).set_value(dataclasses.replace(qw, act_bits=8, act_scale=act_scale, act_zero=act_zero))
