"""Calibration: run calibration text through the model block by block and collect, per linear layer,
what the calibrated methods need: the Hessian X^T X (GPTQ; AWQ with the mean |x| per channel) and
a sample of input rows (SmoothQuant's static activation ranges).

Each block's four linear groups see four inputs ("taps"):
    attn_in  = attn_norm(x)                      -> q, k, v
    o_in     = the heads' outputs [T, H * hd]    -> o
    mlp_in   = mlp_norm(x + attention)           -> gate, up
    down_in  = act(gate) * up                    -> down
Quantization is sequential (as in GPTQ): block i is calibrated on the outputs of the already
quantized blocks 0..i-1, and within a block each tap is recomputed after the groups before it are
quantized. Memory is bounded by one block's input for the calibration tokens ([B, W, D] float32),
one [K, K] float32 Hessian, and at most `max_rows` sampled input rows, whatever the model's depth.
The calibration text must be disjoint from the evaluation text: the bundled model calibrates on
checkpoints/training_words.txt (its training corpus) and is scored on its heldout.txt.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.layers import dense, param_value
from jaxinfer.models.decoder import Block, Decoder

TAPS = ("attn_in", "o_in", "mlp_in", "down_in")


def calibration_windows(token_ids: list[int] | np.ndarray, n_tokens: int, window: int) -> np.ndarray:
    """The first n_tokens of token_ids cut into windows of `window` tokens -> int32 [B, window]
    (the last partial window is dropped). Raises if fewer than one window."""
    ids = np.asarray(token_ids, np.int32)[:n_tokens]
    b = len(ids) // window
    if b == 0:
        raise ValueError(f"calibration needs at least {window} tokens; the text gives {len(ids)}")
    return ids[: b * window].reshape(b, window)


def _taps(block: Block, x: jax.Array, positions: jax.Array) -> dict[str, jax.Array]:
    """One window x [W, D] -> every tap of the block [W, K_tap] and its output [W, D]."""
    h = block.attn_norm(x)
    heads, _ = block.attn.attend(h, positions, None, None, "xla")                   # (W, H, hd)
    attn_out = dense(heads, block.attn.o.get_value(), param_value(block.attn.o_bias), contract=2)  # (W, D)
    x2 = (h if block.residual_post_norm else x) + block.scale_branch(attn_out)     # (Granite: times residual_scale)
    m = block.mlp_norm(x2)
    down_in = block.mlp.hidden(m)
    out = (m if block.residual_post_norm else x2) + block.scale_branch(block.mlp(m))
    return {"attn_in": h, "o_in": heads.reshape(heads.shape[0], -1), "mlp_in": m, "down_in": down_in, "out": out}


class BlockRunner:
    """Jitted per-window computations on a block (recompiled only when the block's pytree changes)."""

    def __init__(self, window: int):
        self.positions = jnp.arange(window, dtype=jnp.int32)
        self._fns: dict = {}

    def _fn(self, graphdef, kind: str) -> Callable:
        key = (graphdef, kind)
        if key not in self._fns:
            pos = self.positions

            def taps(state, xb):                               # xb (b, W, D)
                block = nnx.merge(graphdef, state)
                return jax.vmap(lambda x: _taps(block, x, pos))(xb)

            if kind == "out":
                fn = lambda state, xb: taps(state, xb)["out"]  # noqa: E731
            elif kind.startswith("moments:"):
                tap = kind.split(":", 1)[1]

                def fn(state, xb):
                    a = taps(state, xb)[tap].astype(jnp.float32)
                    a = a.reshape(-1, a.shape[-1])                                 # (b W, K)
                    return (jnp.dot(a.T, a, precision=jax.lax.Precision.HIGHEST),  # (K, K)
                            jnp.sum(jnp.abs(a), axis=0))                           # (K,)
            else:
                fn = lambda state, xb: taps(state, xb)[kind]  # noqa: E731
            self._fns[key] = jax.jit(fn)
        return self._fns[key]

    def run(self, block: Block, kind: str, x: jax.Array, chunk: int, progress=None):
        """kind "out" / a tap name: outputs concatenated over windows; "moments:TAP": the float32
        X^T X (GPTQ's Hessian) and sum_t |X_t| (AWQ) over all windows, accumulated chunk by chunk."""
        graphdef, state = nnx.split(block)
        fn = self._fn(graphdef, kind)
        acc, outs = None, []
        for i in range(0, x.shape[0], chunk):
            y = fn(state, x[i: i + chunk])
            if kind.startswith("moments:"):
                acc = y if acc is None else jax.tree.map(jnp.add, acc, y)
            else:
                outs.append(y)
            if progress is not None:
                progress.update(min(chunk, x.shape[0] - i))
        return acc if kind.startswith("moments:") else jnp.concatenate(outs, axis=0)


def embed_windows(model: Decoder, windows: np.ndarray) -> jax.Array:
    """token windows [B, W] -> the first block's input [B, W, D] float32."""
    pos = jnp.arange(windows.shape[1], dtype=jnp.int32)
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, t: jax.vmap(lambda w: nnx.merge(graphdef, st).embed_tokens(w, pos))(t))
    return fn(state, jnp.asarray(windows)).astype(jnp.float32)


def sample_rows(a: jax.Array, max_rows: int, seed: int = 0) -> np.ndarray:
    """Up to max_rows rows of a [B, W, K] (flattened to [B W, K]), chosen with a fixed seed."""
    a = np.asarray(a, np.float32).reshape(-1, a.shape[-1])
    if len(a) <= max_rows:
        return a
    idx = np.sort(np.random.default_rng(seed).choice(len(a), max_rows, replace=False))
    return a[idx]
