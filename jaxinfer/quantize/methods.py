"""One block of GPTQ or AWQ on calibration activations (the driver is quantize/__init__.py).

Both walk the block's taps in order (calibrate.TAPS), recomputing each tap from the block as
quantized so far, so later linears see the error of earlier ones."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxinfer.quant import QuantizedWeight, from_codes
from jaxinfer.quantize.awq import search_clip, search_scale
from jaxinfer.quantize.calibrate import BlockRunner
from jaxinfer.quantize.common import QuantizeSettings, float_matrix, group_for, linears, rtn_linear
from jaxinfer.quantize.gptq import gptq_quantize


def gptq_block(block, x, runner: BlockRunner, settings: QuantizeSettings, bar=None) -> None:
    for tap, group in linears(block).items():
        xtx, _ = runner.run(block, f"moments:{tap}", x, settings.chunk, bar)
        hessian = np.asarray(xtx, np.float64)
        for owner, name in group:
            w, shape, contract = float_matrix(owner, name)
            g = group_for(w.shape[0], settings)
            codes, scales, zeros = gptq_quantize(
                w, hessian, bits=settings.bits, group_size=-1 if g is None else g, symmetric=settings.symmetric,
                act_order=settings.act_order, blocksize=settings.blocksize, percdamp=settings.percdamp,
                clip_search=settings.clip_search)
            getattr(owner, name).set_value(from_codes(codes, scales, zeros, bits=settings.bits, group_size=g,
                                                      shape=shape, contract=contract))


def _divide_columns(var, bias_var, s_cols: np.ndarray) -> None:
    """Divide a linear's output columns (and bias) by s_cols [N]: float or quantized (every format
    has per-column scales, so dividing them is exact)."""
    w = var.get_value()
    if isinstance(w, QuantizedWeight):
        var.set_value(dataclasses.replace(
            w, scales=w.scales / jnp.asarray(s_cols).reshape((1,) * (w.scales.ndim - 1) + (-1,))))
    else:
        var.set_value(w / jnp.asarray(s_cols, w.dtype).reshape(w.shape[-w.ndim + 1:] if w.ndim > 1 else w.shape))
    if bias_var is not None:
        b = bias_var.get_value()
        bias_var.set_value(b / jnp.asarray(s_cols, b.dtype).reshape(b.shape))


def _foldable(block, tap: str) -> bool:
    """Whether the operator producing `tap` can absorb AWQ's 1 / s: not a norm whose output is also
    the residual (residual_post_norm) or that has no weight (OLMo 1's), nor a non-gated MLP's up
    (act(up) is not linear in up)."""
    if tap in ("attn_in", "mlp_in"):
        norm = block.attn_norm if tap == "attn_in" else block.mlp_norm
        return not block.residual_post_norm and norm.scale is not None
    if tap == "down_in":
        return block.mlp.gate is not None
    assert tap == "o_in", tap
    return True


def _fold(block, tap: str, s: np.ndarray) -> bool:
    """Divide the operator producing `tap` by s (AWQ); False where the architecture does not allow it."""
    if not _foldable(block, tap):
        return False
    a, m = block.attn, block.mlp
    if tap in ("attn_in", "mlp_in"):
        norm = block.attn_norm if tap == "attn_in" else block.mlp_norm
        for var in (norm.scale, norm.bias):
            if var is not None:
                var.set_value(var.get_value() / jnp.asarray(s, var.get_value().dtype))
    elif tap == "o_in":                       # s is [H * hd], equal across the heads of a KV head
        cfg = a.cfg
        s_kv = s.reshape(cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim)[:, 0, :].reshape(-1)
        _divide_columns(a.v, a.v_bias, s_kv)
    else:                                     # down_in
        _divide_columns(m.up, m.up_bias, s)
    return True


def awq_block(block, x, runner: BlockRunner, settings: QuantizeSettings, bar=None) -> dict[str, float | None]:
    """-> the alpha chosen per tap (for the log; None: no scaling, as RTN)."""
    alphas = {}
    b = dict(bits=settings.bits, symmetric=settings.symmetric)
    t = x.shape[0] * x.shape[1]                                                        # calibration tokens
    clip = settings.bits < 8                  # int8 per channel: the clip search is for low bits
    for tap, group in linears(block).items():
        xtx, abs_sum = runner.run(block, f"moments:{tap}", x, settings.chunk, bar)
        h, s_x = np.asarray(xtx, np.float32) / t, np.asarray(abs_sum, np.float32) / t
        mats = [float_matrix(owner, name) for owner, name in group]
        w = np.concatenate([m[0] for m in mats], axis=1)                                # (K, sum N)
        g = group_for(w.shape[0], settings) or w.shape[0]
        alpha = None
        if _foldable(block, tap):
            cfg = block.attn.cfg
            kv_groups = (cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim) if tap == "o_in" else None
            s, alpha, _, ws = search_scale(h, s_x, w, group_size=g, n_grid=settings.awq_grid, clip_grid=settings.awq_clip_grid,
                                           kv_groups=kv_groups,
                                           clip=clip, **b)
            if alpha is not None:
                _fold(block, tap, s)
        else:                                 # s = 1: the clip search alone
            ws = search_clip(h, w, group_size=g, n_grid=settings.awq_clip_grid, **b) if clip else w
        alphas[tap] = alpha
        # columns are clipped independently: the group's searched matrix splits into its linears
        for (owner, name), part in zip(group, np.split(ws, np.cumsum([m[0].shape[1] for m in mats])[:-1], axis=1)):
            rtn_linear(owner, name, settings, part)
    return alphas
