"""One block of GPTQ or AWQ on calibration activations (the driver is quantize/__init__.py).

Both walk the block's taps in order (calibrate.TAPS), recomputing each tap from the block as
quantized so far, so later linears see the error of earlier ones."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxinfer.quant import QuantizedWeight, from_codes
from jaxinfer.quantize import QuantizeSettings, _matrix, _rtn, group_for, linears
from jaxinfer.quantize.awq import search_clip, search_scale
from jaxinfer.quantize.calibrate import BlockRunner
from jaxinfer.quantize.gptq import gptq_quantize


def gptq_block(block, x, runner: BlockRunner, settings: QuantizeSettings, bar=None) -> None:
    for tap, group in linears(block).items():
        hessian = np.asarray(runner.run(block, f"hessian:{tap}", x, settings.chunk, bar), np.float64)
        for owner, name in group:
            w, shape, contract = _matrix(owner, name)
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


def _fold(block, tap: str, s: np.ndarray) -> bool:
    """Divide the operator producing `tap` by s (AWQ); False where the architecture does not allow it."""
    a, m = block.attn, block.mlp
    if tap in ("attn_in", "mlp_in"):
        if block.residual_post_norm:          # the norm's output is also the residual
            return False
        norm = block.attn_norm if tap == "attn_in" else block.mlp_norm
        for var in (norm.scale, norm.bias):
            if var is not None:
                var.set_value(var.get_value() / jnp.asarray(s, var.get_value().dtype))
        return True
    if tap == "o_in":                         # s is [H * hd], equal across the heads of a KV head
        cfg = a.cfg
        s_kv = s.reshape(cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim)[:, 0, :].reshape(-1)
        _divide_columns(a.v, a.v_bias, s_kv)
        return True
    if tap == "down_in":
        if m.gate is None:                    # act(up) is not linear in up
            return False
        _divide_columns(m.up, m.up_bias, s)
        return True
    raise AssertionError(tap)


def awq_block(block, x, runner: BlockRunner, settings: QuantizeSettings, bar=None) -> dict[str, float | None]:
    """-> the alpha chosen per tap (for the log; None: no scaling, as RTN)."""
    alphas = {}
    b = dict(bits=settings.bits, symmetric=settings.symmetric)
    t = x.shape[0] * x.shape[1]                                                        # calibration tokens
    for tap, group in linears(block).items():
        xtx, abs_sum = runner.run(block, f"moments:{tap}", x, settings.chunk, bar)
        h, s_x = np.asarray(xtx, np.float32) / t, np.asarray(abs_sum, np.float32) / t
        mats = [_matrix(owner, name) for owner, name in group]
        w = np.concatenate([m[0] for m in mats], axis=1)                                # (K, sum N)
        g = group_for(w.shape[0], settings) or w.shape[0]
        cfg = block.attn.cfg
        kv_groups = (cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim) if tap == "o_in" else None
        clip = settings.bits < 8              # int8 per channel: the clip search is for low bits
        s, alpha, _ = search_scale(h, s_x, w, group_size=g, n_grid=settings.awq_grid, kv_groups=kv_groups,
                                   clip=clip, **b)
        if alpha is not None and _fold(block, tap, s):
            h = h / (s[:, None] * s[None, :])
        else:
            s, alpha = np.ones_like(s), None
        alphas[tap] = alpha
        for (owner, name), (wm, _, _) in zip(group, mats):
            ws = wm * s[:, None]
            if clip:
                ws = search_clip(h, ws, group_size=g, n_grid=settings.awq_grid, **b)
            _rtn(owner, name, settings, ws)
    return alphas
