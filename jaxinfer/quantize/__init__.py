"""`jaxinfer quantize`: quantization of a Decoder: weight-only post-training (RTN, GPTQ, AWQ, FP8
e4m3: its checkpoints hold weights only; on GPU the engine also scales activations to e4m3, quant.py),
quantization-aware training (QAT: the fake-quantized model distilled from the float model's
own logits, then RTN export; qat.py) and SmoothQuant W8A8 (int8 weights and int8 activations,
dynamic per token or static).

    settings = QuantizeSettings(method="gptq", bits=4, group_size=-1, symmetric=False)
    quantize_model(model, settings, calib_windows)      # in place; unfused float Decoder
    save_native(model, out, "float32", tokenizer, extra={"quantization": settings.to_json()})

The result is a Decoder whose matmul weights are jaxinfer.quant.QuantizedWeights (packed codes,
scales, zero points), so save/load, fusion and the engine treat it like any other quantized
model; the method only decides which codes are written. AWQ also rewrites float parameters
(norm weights, v and up columns) into which its scales fold. Embeddings, norms, biases and the
LM head stay in float, as quantize_decoder keeps them. Groups: group_size along K (the
contracted dims), or -1 for one group per output channel; a matrix whose K is not a multiple of
group_size uses the largest of 64 and 32 below it that divides K, else one group per channel.
int8 and fp8 are per channel and symmetric only.

    default_bits_group(method) -> the (bits, group_size) a method takes when the user gives none.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxinfer.models.decoder import Block, Decoder
from jaxinfer.quant import from_codes, quantize, quantize_fp8
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


def default_bits_group(method: str) -> tuple[int, int]:
    """fp8 and smoothquant are 8-bit per channel; the weight-only integer methods default to w4 g128."""
    return (8, -1) if method in ("fp8", "smoothquant") else (4, 128)


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


_CONTRACT = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


def _matrix(owner, name) -> tuple[np.ndarray, tuple[int, ...], int]:
    """A linear's float weight as [K, N] float32, its logical shape and contracted dims."""
    w = np.asarray(getattr(owner, name).get_value(), np.float32)
    c = _CONTRACT[name]
    return w.reshape(math.prod(w.shape[:c]), -1), w.shape, c


def _rtn(owner, name, settings: QuantizeSettings, w2: np.ndarray | None = None) -> None:
    w, shape, c = _matrix(owner, name)
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
                    w, shape, c = _matrix(owner, name)
                    getattr(owner, name).set_value(quantize_fp8(jnp.asarray(w.reshape(shape)), contract=c))
                else:
                    _rtn(owner, name, settings)
    return model


def report_qat(event: dict, bits: int = 4) -> None:
    """One line on stderr per QAT event that a user needs (qat.py's log): how much text it trains
    on, each epoch's held-out KL, which epoch it exports."""
    from tqdm import tqdm                       # tqdm.write keeps an open progress bar intact
    if event["event"] == "qat_data":
        msg = (f"QAT: training on {event['train_tokens']:,} tokens of the text ({event['heldout_tokens']:,} more "
               f"held out for early stopping); at most {event['steps']} steps x {event['batch']} x {event['window']} "
               f"tokens = {event['epochs']:.1f} epochs of {event['steps_per_epoch']} steps")
    elif event["event"] == "qat_epoch":
        msg = (f"QAT epoch {event['epoch']} (step {event['step']}): held-out KL(float || w{bits}) "
               f"{event['heldout_kl']:.5f} nats/token" + (" (RTN)" if event["epoch"] == 0 else ""))
    elif event["event"] == "qat_done":
        msg = (f"QAT: exporting epoch {event['best_epoch']} (step {event['best_step']}), held-out KL "
               f"{event['heldout_kl']:.5f}")
    else:
        return
    tqdm.write(msg, file=sys.stderr)


def calibrated_unsupported(cfg) -> str | None:
    """Why GPTQ / AWQ / SmoothQuant cannot calibrate this model, or None. They rebuild each block's
    inputs tap by tap (calibrate._taps: norm, attention, residual, norm, MLP) and AWQ / SmoothQuant
    fold their scales into the norm before a matmul (scale / s): Gemma's norms after attention and
    MLP are not in those taps, and its (1 + w) norm would need (1 + w) / s - 1."""
    if cfg.post_norms:
        return "its blocks norm the attention and MLP outputs (Gemma), which calibration does not replay"
    if cfg.norm == "gemma_rmsnorm":
        return "its norms scale by (1 + w) (Gemma), which AWQ / SmoothQuant's folding does not handle"
    return None


def quantize_model(model: Decoder, settings: QuantizeSettings, windows: np.ndarray | None = None,
                   progress: bool = True, train_tokens: np.ndarray | None = None) -> Decoder:
    """Quantize an unfused float Decoder in place. windows [B, W] calibration token ids (gptq, awq,
    smoothquant); train_tokens: QAT's 1-D training token stream (never the evaluation text)."""
    # what the method needs first, then whether it can take this model
    if settings.method == "qat" and train_tokens is None:
        raise ValueError("--method qat fine-tunes the model: it needs training text (--train-text FILE "
                         "or --train-bin FILE, disjoint from the text you evaluate on)")
    if settings.method not in ("rtn", "fp8", "qat") and windows is None:
        raise ValueError(f"--method {settings.method} needs calibration text (--calib-text)")
    if model.cfg.num_experts:
        raise ValueError(f"jaxinfer quantize cannot quantize {model.cfg.architecture}: its MLPs are mixtures of "
                         f"experts ({model.cfg.num_experts} stacked experts per layer) and every method here works "
                         "on one [K, N] matrix per linear; quantize at load instead: --quantize int8 | int4 | fp8 "
                         "(Generator.from_pretrained(quantize=...))")
    if settings.method in ("rtn", "fp8"):
        return quantize_rtn(model, settings)
    if settings.method == "qat":
        from jaxinfer.quantize.qat import qat_finetune
        return qat_finetune(model, bits=settings.bits, group_size=settings.group_size, symmetric=settings.symmetric,
                            tokens=train_tokens, steps=settings.qat_steps, batch=settings.qat_batch,
                            window=settings.calib_window, lr=settings.qat_lr, seed=settings.seed, progress=progress,
                            trainable=settings.qat_trainable, nll_weight=settings.qat_nll_weight,
                            temperature=settings.qat_temperature, heldout=settings.qat_heldout,
                            log=functools.partial(report_qat, bits=settings.bits))
    unsupported = calibrated_unsupported(model.cfg)
    if unsupported:
        raise ValueError(f"--method {settings.method} cannot quantize this model: {unsupported}; use --method rtn, "
                         f"fp8 or qat")
    from tqdm import tqdm

    from jaxinfer.quantize.calibrate import BlockRunner, embed_windows
    from jaxinfer.quantize.methods import awq_block, gptq_block
    from jaxinfer.quantize.smoothquant import smoothquant_block

    x = embed_windows(model, windows)                                              # (B, W, D)
    runner = BlockRunner(windows.shape[1])
    passes = 5                                                                     # 4 taps + the output
    bar = tqdm(total=passes * len(model.layers) * len(windows), unit="window", disable=not progress,
               desc=f"calibrating {settings.method} w{settings.bits}")
    for i, block in enumerate(model.layers):
        bar.set_postfix(layer=i)
        step = {"gptq": gptq_block, "awq": awq_block, "smoothquant": smoothquant_block}[settings.method]
        step(block, x, runner, settings, bar)
        x = runner.run(block, "out", x, settings.chunk, bar)
    bar.close()
    return model


__all__ = ["METHODS", "QuantizeSettings", "default_bits_group", "quantize_model", "quantize_rtn", "group_for", "linears",
           "from_codes"]
