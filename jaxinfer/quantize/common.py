"""What the quantization methods share: QuantizeSettings (the user's choices, validated once), the
linears a block quantizes and their contracted dims, and round-to-nearest (RTN), which every
method ends in or falls back to. The package (__init__.py) drives the methods; its submodules
(methods.py, smoothquant.py, qat.py) import from here, never from the package, so that no import
goes back up.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxinfer.models.decoder import CONTRACTED_DIMS, Block, Decoder  # linear -> contracted leading dims
from jaxinfer.quant import quantize, quantize_fp8
from jaxinfer.quantize.awq import CLIP_GRID

METHODS = ("rtn", "gptq", "awq", "smoothquant", "fp8", "qat")
ACT_SCALES = ("dynamic", "static")


@dataclasses.dataclass(frozen=True)
class QuantizeSettings:
    method: str = "rtn"
    bits: int = 4
    group_size: int = 128          # -1: per output channel
    symmetric: bool = True
    act_order: bool = False        # GPTQ only (static groups: module gptq.py)
    clip_search: bool = False      # GPTQ: each grid's range by the |err|^2.4 search (gptq.search_grid)
    calib_tokens: int = 65536      # the first N tokens of the calibration text (all of a shorter one)
    calib_window: int = 256
    percdamp: float = 0.01         # GPTQ damping, a fraction of mean(diag H)
    blocksize: int = 128           # GPTQ lazy-update block
    awq_grid: int = 20             # AWQ alpha grid points in [0, 1)
    awq_clip_grid: int = CLIP_GRID  # AWQ clip ratios 1 - i / awq_clip_grid, i < awq_clip_grid / 2 (awq.py)
    max_rows: int = 4096           # SmoothQuant static act-calib mse: calibration rows sampled per tap
    seed: int = 0
    chunk: int = 8                 # windows per calibration call
    alpha: float = 0.5             # SmoothQuant migration strength
    act_scales: str = "dynamic"    # SmoothQuant: dynamic (per token at run time) | static (calibrated)
    act_calib: str = "percentile"  # static: minmax | percentile | mse (smoothquant.py)
    act_percentile: float = 99.99
    act_symmetric: bool = True     # static: False = an asymmetric grid with a zero point (smoothquant.py)
    qat_steps: int = 400           # QAT (qat.py; these equal its DEFAULT_*): at most this many steps of
    qat_lr: float = 3e-5           # qat_batch windows of calib_window + 1 tokens, early-stopped on the
    qat_batch: int = 8             # held-out KL of the qat_heldout slice of the training text
    qat_trainable: str = "all"     # all float parameters, or "linears" only
    qat_nll_weight: float = 0.0    # loss: (1 - w) KL(float || fake-quantized) + w next-token NLL
    qat_temperature: float = 2.0   # of the KL term
    qat_heldout: float = 0.1       # share of the training text held out for early stopping

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown --method {self.method!r}; available: {', '.join(METHODS)}")
        if self.bits not in (8, 4, 3):
            raise ValueError(f"--bits must be 8, 4 or 3, got {self.bits}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"--group-size must be positive or -1 (per channel), got {self.group_size}")
        if self.calib_tokens < 1 or self.calib_window < 1:
            raise ValueError(f"--calib-tokens and --calib-window must be >= 1, got {self.calib_tokens} and "
                             f"{self.calib_window}")
        if self.bits == 8 and (self.group_size != -1 or not self.symmetric):
            raise ValueError("--bits 8 is per output channel and symmetric: use --group-size -1 --sym")
        if self.method == "smoothquant" and (self.bits != 8 or self.group_size != -1 or not self.symmetric):
            raise ValueError("--method smoothquant is W8A8: use --bits 8 --group-size -1 --sym")
        if self.method == "fp8" and (self.bits != 8 or self.group_size != -1 or not self.symmetric):
            raise ValueError("--method fp8 is e4m3 per output channel: use --bits 8 --group-size -1 --sym")
        if self.act_order and self.method != "gptq":
            raise ValueError("--act-order applies to --method gptq only")
        if self.clip_search and self.method != "gptq":
            raise ValueError("--clip-search applies to --method gptq only (AWQ always searches its clipping)")
        if self.act_scales not in ACT_SCALES:
            raise ValueError(f"--act-scales must be one of {', '.join(ACT_SCALES)}, got {self.act_scales!r}")
        if self.act_scales == "static" and self.method != "smoothquant":
            raise ValueError("--act-scales static applies to --method smoothquant (W8A8) only")
        if not self.act_symmetric and self.act_scales != "static":
            raise ValueError("--act-asym applies to --method smoothquant --act-scales static only (dynamic "
                             "per-token scales are symmetric)")
        if self.act_calib not in ("minmax", "percentile", "mse"):
            raise ValueError(f"--act-calib must be minmax, percentile or mse, got {self.act_calib!r}")
        if self.qat_steps < 1 or self.qat_batch < 1 or not self.qat_lr > 0:
            raise ValueError(f"QAT needs --qat-steps >= 1, --qat-batch >= 1 and --qat-lr > 0, got "
                             f"{self.qat_steps}, {self.qat_batch}, {self.qat_lr}")
        if self.qat_trainable not in ("all", "linears"):
            raise ValueError(f"--qat-trainable must be all or linears, got {self.qat_trainable!r}")
        if not (0 <= self.qat_nll_weight <= 1 and self.qat_temperature > 0 and 0 < self.qat_heldout < 1):
            raise ValueError(f"QAT needs 0 <= --qat-nll-weight <= 1, --qat-temperature > 0 and 0 < --qat-heldout "
                             f"< 1, got {self.qat_nll_weight}, {self.qat_temperature}, {self.qat_heldout}")
        if self.awq_grid < 1 or self.awq_clip_grid < 2:
            raise ValueError(f"AWQ needs awq_grid >= 1 and awq_clip_grid >= 2, got {self.awq_grid}, {self.awq_clip_grid}")
        if not 50.0 < self.act_percentile <= 100.0:
            raise ValueError(f"--act-percentile must be in (50, 100], got {self.act_percentile}")

    def to_json(self) -> dict[str, Any]:
        keys = ["method", "bits", "group_size", "symmetric"] + {
            "rtn": [], "fp8": [], "gptq": ["act_order", "clip_search", "percdamp", "blocksize", "calib_tokens", "calib_window"],
            "awq": ["awq_grid", "awq_clip_grid", "calib_tokens", "calib_window"],
            "smoothquant": ["alpha", "calib_tokens", "calib_window"],
            "qat": ["qat_steps", "qat_lr", "qat_batch", "qat_trainable", "qat_nll_weight", "qat_temperature",
                    "qat_heldout", "calib_window", "seed"]}[self.method]
        if self.method == "smoothquant":
            act = ({"act_scales": "dynamic per token"} if self.act_scales == "dynamic" else
                   {"act_scales": "static per tensor", "act_symmetric": self.act_symmetric,
                    "act_calib": self.act_calib, "max_rows": self.max_rows,
                    **({"act_percentile": self.act_percentile} if self.act_calib == "percentile" else {})})
            return {**{k: getattr(self, k) for k in keys}, "act_bits": 8, **act}
        if self.method == "fp8":
            return {**{k: getattr(self, k) for k in keys}, "format": "fp8_e4m3"}
        if self.method == "qat":
            return {**{k: getattr(self, k) for k in keys}, "export": "rtn"}
        return {k: getattr(self, k) for k in keys}


def group_for(k: int, settings: QuantizeSettings) -> int | None:
    """The group size used for a matrix with K contracted rows (None: int8 per channel)."""
    if settings.bits == 8:
        return None
    if settings.bits == 3 and k % 8:
        raise ValueError(f"3-bit packing needs K divisible by 8; a weight has K={k}")
    if settings.group_size == -1:
        return k
    g = next((g for g in (settings.group_size, 64, 32) if g <= settings.group_size and k % g == 0), None)
    return g or k


def linears(block: Block) -> dict[str, list[tuple[Any, str]]]:
    """tap -> the (module, attribute) of each linear that reads it (calibrate.TAPS)."""
    a, m = block.attn, block.mlp
    if a.qkv is not None or m.gate_up is not None:
        raise ValueError("quantize an unfused model (load_model gives one; fuse afterwards)")
    return {"attn_in": [(a, "q"), (a, "k"), (a, "v")], "o_in": [(a, "o")],
            "mlp_in": ([(m, "gate")] if m.gate is not None else []) + [(m, "up")], "down_in": [(m, "down")]}


def float_matrix(owner, name) -> tuple[np.ndarray, tuple[int, ...], int]:
    """A linear's float weight as [K, N] float32, its logical shape and contracted dims."""
    w = np.asarray(getattr(owner, name).get_value(), np.float32)
    c = CONTRACTED_DIMS[name]
    return w.reshape(math.prod(w.shape[:c]), -1), w.shape, c


def rtn_linear(owner, name, settings: QuantizeSettings, w2: np.ndarray | None = None) -> None:
    """Round-to-nearest one linear in place: its own weight, or w2 [K, N] in its place (AWQ's scaled
    and clipped matrix), on the settings' grid."""
    w, shape, c = float_matrix(owner, name)
    w = w if w2 is None else w2
    g = group_for(w.shape[0], settings)
    qw = quantize(jnp.asarray(w.reshape(shape)), settings.bits, group_size=g, symmetric=settings.symmetric,
                  contract=c)
    getattr(owner, name).set_value(qw)


def quantize_rtn(model: Decoder, settings: QuantizeSettings) -> Decoder:
    """Round-to-nearest every linear of every block (no calibration); method fp8: e4m3 per channel."""
    for block in model.layers:
        for group in linears(block).values():
            for owner, name in group:
                if settings.method == "fp8":
                    w, shape, c = float_matrix(owner, name)
                    getattr(owner, name).set_value(quantize_fp8(jnp.asarray(w.reshape(shape)), contract=c))
                else:
                    rtn_linear(owner, name, settings)
    return model
