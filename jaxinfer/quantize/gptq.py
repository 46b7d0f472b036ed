"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", Algorithm 1) for one linear layer, in numpy float64.

The weight is ours, [K, N] (y = x @ W); the paper's W is [rows = outputs, columns = inputs], so
the algorithm runs on W.T. Steps:
  1. H = sum X^T X (calibrate.py); dead inputs (H_kk = 0) get H_kk = 1 and zero weights.
  2. act_order: columns in order of decreasing H_kk (the permutation is folded back at the end).
  3. damping: H += percdamp * mean(diag H) * I.
  4. U = the upper Cholesky factor of H^-1 (H^-1 = U^T U).
  5. for each column j (in blocks of `blocksize`, updates to later blocks applied lazily once
     per block): q_j = quant(w_j); err = (w_j - q_j) / U_jj; w_{j+1..} -= err * U_{j, j+1..}.
Groups: the scale (and zero point) of a group of `group_size` input channels is computed from the
error-updated weights when quantization reaches the group's first column. With act_order we use
static groups (AutoGPTQ's static_groups): every group's grid is computed from the original weights
before the loop, in the original channel order, so the exported weight is an ordinary group-wise
weight and loading needs neither a permutation nor a g_idx. Per channel (group_size = K) the grid
is computed from the whole row up front, as in the paper.
Grid search (clip_search, the GPTQ reference code's `mse` quantizer option): each grid's range is
shrunk to p x the weights' (p = 1 - i / 100, i < 80 -- for asymmetric grids the zero point follows)
to minimise sum |w - dequant(w)|^2.4 over the grid's weights, before the error propagation; a
narrower range trades clipping a few large weights for finer steps on the rest. Off, the grid is
the weights' min/max (RTN's), as in the paper.
Never imports jax: the caller packs the codes (quant.from_codes).
"""
from __future__ import annotations

import numpy as np

from jaxinfer.quant import grid_codes, grid_dequant, grid_params


def search_grid(w: np.ndarray, bits: int, symmetric: bool, *, axis: int, n_grid: int = 100,
                max_shrink: float = 0.8, norm: float = 2.4) -> tuple[np.ndarray, np.ndarray | None]:
    """grid_params of w reduced over `axis`, its range shrunk by the p in {1 - i / n_grid : i <
    max_shrink * n_grid} that minimises sum |w - dequant(w)|^norm over the axis (per slice)."""
    best_err, best_s, best_z = None, None, None
    for i in range(int(max_shrink * n_grid)):
        p = 1.0 - i / n_grid
        s, z = grid_params(w * p, bits, symmetric, axis=axis)
        se, ze = np.expand_dims(s, axis), None if z is None else np.expand_dims(z, axis)
        err = np.sum(np.abs(grid_dequant(grid_codes(w, se, ze, bits), se, ze) - w) ** norm, axis=axis)
        if best_err is None:
            best_err, best_s, best_z = err, s, z
            continue
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, s, best_s)
        best_z = None if z is None else np.where(better, z, best_z)
    return best_s.astype(np.float32), None if best_z is None else best_z.astype(np.float32)


def gptq_quantize(w: np.ndarray, hessian: np.ndarray, *, bits: int, group_size: int, symmetric: bool,
                  act_order: bool = False, blocksize: int = 128, percdamp: float = 0.01,
                  clip_search: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """w [K, N], hessian [K, K] (sum of x^T x) -> codes int32 [K, N], scales [K/g, N] ([N] for
    bits=8, which is per channel), zeros [K/g, N] or None; dequantized weight = (codes - zeros) * scales."""
    k, n = w.shape
    g = k if group_size in (None, -1) else int(group_size)
    params = search_grid if clip_search and bits < 8 else grid_params
    assert k % g == 0, (k, g)
    W = np.array(w, np.float64).T.copy()                                   # (N, K): the paper's layout
    H = np.array(hessian, np.float64).copy()
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(k)
    invperm = np.argsort(perm)
    static = act_order or g == k          # grids fixed up front (original order) vs at each group start
    if not static and (g > blocksize or blocksize % g):
        blocksize = g                     # a group's first column sees its whole group inside the block
    if static:
        Wg = W.reshape(n, k // g, g)                                       # (N, K/g, g)
        s_all, z_all = params(Wg, bits, symmetric, axis=2)                 # (N, K/g)
    W, H = W[:, perm], H[perm][:, perm]
    H[np.diag_indices(k)] += percdamp * np.mean(np.diag(H))
    U = np.linalg.cholesky(np.linalg.inv(H)).T                             # upper: H^-1 = U^T U
    codes = np.zeros((n, k), np.float64)                                   # permuted column order
    scales = np.zeros((n, k // g), np.float64)
    zeros = None if symmetric else np.zeros((n, k // g), np.float64)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        W1 = W[:, i1:i2].copy()
        Err1 = np.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            group = perm[col] // g
            if static:
                s, z = s_all[:, group], None if symmetric else z_all[:, group]
            elif col % g == 0:                      # first column of a group (groups lie inside a block)
                s, z = params(W1[:, i:i + g], bits, symmetric, axis=1)
                s = s.astype(np.float64)
                z = None if z is None else z.astype(np.float64)
            scales[:, group] = s
            if zeros is not None:
                zeros[:, group] = z
            q = grid_codes(W1[:, i], s, z, bits)
            codes[:, col] = q
            err = (W1[:, i] - grid_dequant(q, s, z)) / U[col, col]
            W1[:, i:] -= np.outer(err, U[col, col:i2])
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    codes = codes[:, invperm].T.astype(np.int32)                           # (K, N), original order
    scales, zeros = scales.T.astype(np.float32), None if zeros is None else zeros.T.astype(np.float32)
    if bits == 8:
        assert g == k and symmetric, "int8 is per output channel, symmetric"
        scales = scales[0]
    return codes, scales, zeros
