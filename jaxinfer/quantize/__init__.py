"""`jaxinfer quantize`: quantization of a Decoder: weight-only post-training (RTN, GPTQ, AWQ, FP8
e4m3: its checkpoints hold weights only; on GPU the engine also scales activations to e4m3, jaxinfer/quant/dispatch.py),
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

QuantizeSettings, the linears a block quantizes and RTN live in common.py, which the methods'
modules import; this package only imports from its submodules, never the other way round.
"""
from __future__ import annotations

import functools
import sys

import numpy as np

from jaxinfer.models.decoder import Decoder
from jaxinfer.quant import from_codes
from jaxinfer.quantize.common import METHODS, QuantizeSettings, group_for, linears, quantize_rtn


def default_bits_group(method: str) -> tuple[int, int]:
    """fp8 and smoothquant are 8-bit per channel; the weight-only integer methods default to w4 g128."""
    return (8, -1) if method in ("fp8", "smoothquant") else (4, 128)


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
        return "its blocks norm the attention and MLP outputs (Gemma, OLMo 2), which calibration does not replay"
    if cfg.parallel_block:
        return "its blocks run attention and MLP side by side on one norm (Cohere), which calibration does not replay"
    if cfg.attn_out_gate:
        return "its attention gates each head's output (AFMoE), which calibration does not replay"
    if cfg.norm in ("gemma_rmsnorm", "layernorm1p"):
        return "its norms scale by (1 + w) (Gemma, Nemotron), which AWQ / SmoothQuant's folding does not handle"
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
    if model.cfg.has_state:
        raise ValueError(f"jaxinfer quantize cannot quantize {model.cfg.architecture}: its state layers (LFM2's short "
                         "convolutions, Gated DeltaNets, Mamba-2 mixers) are not linears its methods take apart; quantize at load instead: "
                         "--quantize int8 | int4 | fp8 (Generator.from_pretrained(quantize=...))")
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
