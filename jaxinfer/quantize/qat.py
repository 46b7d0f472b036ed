"""Quantization-aware training (QAT) for weight-only quantization: fine-tune a float Decoder with its
linears fake-quantized in the forward pass, then export it with RTN.

    model, _ = load_model("checkpoints/jaxinfer-tiny-llama", "float32")
    tokens = np.fromfile("/work/cache/corpus/train.bin", dtype=np.uint16)     # the training split
    qat_finetune(model, bits=4, group_size=-1, symmetric=False, tokens=tokens)   # defaults: see below
    save_native(model, out, "float32", tokenizer, extra={"quantization": {...}})

Fake quantization. Exactly the linears that jaxinfer.quantize quantizes (`linears(block)`: q, k, v,
o, gate, up, down of every block) are replaced in the forward pass by
    fq(w) = dequantize(quantize(w, bits, group_size=group_for(K, settings), symmetric, contract=c))
with c the linear's contracted dims (_CONTRACT): literally the RTN quantizer of jaxinfer.quant on the
current weight (scale / zero from each group's min / max), so the training forward sees the very
weights that export writes (tests/test_qat.py checks fq(w) == dequantize(exported weight) bit for
bit). Embeddings (hence the tied LM head), norms and biases stay float, as in the rest of
jaxinfer.quantize.

Straight-through estimator (STE). round() has zero gradient almost everywhere, so the backward pass
treats fq as the identity: d loss / d w := d loss / d w_used evaluated at w_used = fq(w), i.e. the
gradient of the float forward at the fake-quantized weights. Written as w + stop_gradient(fq(w) - w)
this is the same function mathematically but not in float32 (w + (fq - w) may differ from fq in the
last bit), so `ste_fake_quant` is a jax.custom_vjp whose forward returns fq(w) itself and whose
backward passes the cotangent through unchanged.

Training: next-token NLL over `batch` random windows of window + 1 tokens of `tokens` (numpy
default_rng(seed)), as scripts/train_tiny.py trains the bundled model; optax AdamW (b1 0.9, b2 0.95,
weight decay 0), linear warm-up over 10% of the steps then cosine decay to 0, global-norm clipping
1.0, one jitted step with the trained parameters and optimizer state donated. By default only the
linears train (trainable="linears"; "all" also trains embeddings and norms). Export: the trained
float values are written back into `model`, then quantize_rtn(model, ...) turns every linear into a
QuantizedWeight (in place; the same codes fq used), so the result saves / loads / serves like any
RTN checkpoint.

Defaults: steps 200, batch 8, window 256, lr 1e-4, trainable "linears". Measured on
checkpoints/jaxinfer-tiny-llama (w4 per channel asymmetric; tokens: /work/cache/corpus/train.bin,
the model's own training split; held-out perplexity as bench/quantize_ppl.py, eval_ppl window 256
stride 128 on heldout.txt; float32 36.954, RTN 37.353 = +1.08%; 2-core CPU shared with other jobs,
so the seconds are loose, about 2 s a step):
    trainable  steps x batch  lr     ppl (exported w4)   train s
    all        200 x 8        1e-4   36.778              618
    linears    200 x 8        1e-4   36.694              392   <- default
    linears    100 x 8        1e-4   37.092              255   (misses <= 30% of RTN's rise: 37.07)
    linears    200 x 8        3e-4   37.168              479   (too high an lr)
    controls, the same training WITHOUT fake quantization (float ppl; then RTN of that model):
    all        200 x 8        1e-4   float 36.628, RTN 37.009 (+1.04%)                      586
    linears    200 x 8        1e-4   float 36.504, RTN 36.882 (+1.04%)                      339
The bundled model is not converged (1600 steps), so more training on its own split lowers the float
perplexity too (36.954 -> 36.504): most of QAT's result below the original float32 comes from that
fine-tuning, not from quantization awareness. The attributable gain is against the matched control:
QAT's exported w4 rises +0.52% (linears; 36.694 vs 36.504) / +0.41% (all; 36.778 vs 36.628) over
the equally fine-tuned float model, where RTN of it rises +1.04%: QAT removes 50-61% of RTN's rise,
and beats fine-tune-then-RTN by 0.19 / 0.23 ppl. Linears-only gave the lowest exported perplexity
and is no slower; 100 steps were not enough at lr 1e-4 and lr 3e-4 was worse.
"""
from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxinfer.models.decoder import Decoder, window_nll
from jaxinfer.quant import dequantize, quantize
from jaxinfer.quantize import _CONTRACT, QuantizeSettings, group_for, linears, quantize_rtn

DEFAULT_STEPS = 200
DEFAULT_LR = 1e-4
DEFAULT_BATCH = 8
DEFAULT_TRAINABLE = "linears"


def _settings(bits: int, group_size: int, symmetric: bool) -> QuantizeSettings:
    return QuantizeSettings(method="rtn", bits=bits, group_size=group_size, symmetric=symmetric)


def fake_quant(w: jax.Array, settings: QuantizeSettings, contract: int) -> jax.Array:
    """RTN quantize-dequantize of one linear's float weight (logical shape, f32): the values export
    (quantize_rtn) stores for it."""
    k = math.prod(w.shape[:contract])
    g = group_for(k, settings)
    return dequantize(quantize(w, settings.bits, group_size=g, symmetric=settings.symmetric, contract=contract))


def ste_fake_quant(w: jax.Array, settings: QuantizeSettings, contract: int) -> jax.Array:
    """fq(w) forward, identity backward (the straight-through estimator)."""
    @jax.custom_vjp
    def f(w):
        return fake_quant(w, settings, contract)

    f.defvjp(lambda w: (fake_quant(w, settings, contract), None), lambda _, g: (g,))
    return f(w)


def linear_vars(model: Decoder) -> list[tuple[Any, str]]:
    """(owner, name) of every linear quantize_rtn quantizes, block by block (raises on a fused model)."""
    return [pair for block in model.layers for group in linears(block).values() for pair in group]


def apply_fake_quant(model: Decoder, settings: QuantizeSettings, ste: bool = True) -> Decoder:
    """In place: every linear's value becomes fq(w) (ste: through the STE, for training)."""
    fn = ste_fake_quant if ste else fake_quant
    for owner, name in linear_vars(model):
        var = getattr(owner, name)
        var.set_value(fn(var.get_value(), settings, _CONTRACT[name]))
    return model


def split_trainable(model: Decoder, trainable: str):
    """-> (graphdef, trainable state, frozen state). trainable: "all" float parameters or "linears"."""
    if trainable == "all":
        return nnx.split(model, nnx.Param, ...)
    if trainable != "linears":
        raise ValueError(f"trainable must be 'all' or 'linears', got {trainable!r}")
    ids = {id(getattr(owner, name)) for owner, name in linear_vars(model)}
    paths = {tuple(p) for p, v in nnx.iter_graph(model) if id(v) in ids}
    return nnx.split(model, lambda path, _: tuple(path) in paths, ...)


def make_qat_loss(graphdef, settings: QuantizeSettings | None) -> Callable:
    """(trainable, frozen, windows) -> mean NLL of the model with fake-quantized linears (STE);
    settings None: the plain float forward (the control run)."""
    def loss(trainable, frozen, windows):
        model = nnx.merge(graphdef, trainable, frozen)
        if settings is not None:
            apply_fake_quant(model, settings, ste=True)
        return jnp.mean(window_nll(model, windows))
    return loss


@functools.lru_cache(maxsize=4)
def _train_step(graphdef, settings: QuantizeSettings | None, lr: float, steps: int, warmup: int,
                min_lr_ratio: float):
    """(jitted step, optimizer, schedule), cached so that a repeated run of one configuration (tests,
    sweeps) reuses the compiled step. The step: (params, opt_state, frozen, windows) ->
    (params, opt_state, loss, grad norm), params and opt_state donated."""
    schedule = optax.warmup_cosine_decay_schedule(lr / warmup, lr, warmup, max(steps, warmup + 1), lr * min_lr_ratio)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0))
    loss_fn = make_qat_loss(graphdef, settings)

    def train_step(params, opt_state, frozen, windows):
        loss, grads = jax.value_and_grad(loss_fn)(params, frozen, windows)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)

    return jax.jit(train_step, donate_argnums=(0, 1)), tx, schedule


def qat_train(model: Decoder, *, bits: int, group_size: int, symmetric: bool, tokens: np.ndarray,
              steps: int = DEFAULT_STEPS, batch: int = DEFAULT_BATCH, window: int = 256, lr: float = DEFAULT_LR,
              seed: int = 0, progress: bool = True, log: Callable | None = None, trainable: str = DEFAULT_TRAINABLE,
              warmup: int | None = None, min_lr_ratio: float = 0.0, fake: bool = True) -> Decoder:
    """The training half of qat_finetune: the model's float parameters are updated in place (no
    export). fake=False trains without fake quantization (the control run)."""
    settings = _settings(bits, group_size, symmetric)
    for owner, name in linear_vars(model):               # refuses a fused model before any work
        w = getattr(owner, name).get_value()
        if getattr(w, "dtype", None) != jnp.float32:
            raise ValueError(f"QAT trains a float32 model (load it with dtype float32); a linear is "
                             f"{getattr(w, 'dtype', type(w).__name__)}")
    tokens = np.asarray(tokens).reshape(-1)
    max_start = tokens.size - (window + 1)
    if max_start < 0:
        raise ValueError(f"the token stream ({tokens.size} tokens) is shorter than one window ({window + 1})")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")

    graphdef, train_state, frozen = split_trainable(model, trainable)
    warmup = max(1, steps // 10) if warmup is None else max(1, warmup)
    step_fn, tx, schedule = _train_step(graphdef, settings if fake else None, lr, steps, warmup, min_lr_ratio)
    opt_state = tx.init(train_state)
    # commit every single-device input (optax's step counts, parameters made by jnp.asarray) to the
    # parameters' device: the second call's inputs are the first call's committed outputs, and
    # uncommitted first inputs would make it compile the step twice
    dev = next(iter(jax.tree.leaves(train_state)[0].devices()))
    commit = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(x, dev) if len(x.devices()) == 1 else x, tree)
    train_state, opt_state, frozen = commit((train_state, opt_state, frozen))
    rng = np.random.default_rng(seed)
    from tqdm import tqdm
    bar = tqdm(range(steps), desc=f"QAT w{bits}" if fake else "fine-tune (float)", unit="step",
               disable=not progress)
    every = max(1, steps // 20)
    t0 = time.perf_counter()
    for step in bar:
        starts = rng.integers(0, max_start + 1, size=batch)
        windows = np.stack([tokens[s:s + window + 1] for s in starts]).astype(np.int32)
        train_state, opt_state, loss, gnorm = step_fn(train_state, opt_state, frozen, jax.device_put(windows, dev))
        loss = float(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"QAT loss is {loss} at step {step + 1}")
        bar.set_postfix(loss=f"{loss:.4f}")
        if log is not None and ((step + 1) % every == 0 or step == 0 or step + 1 == steps):
            log({"event": "qat", "step": step + 1, "loss": loss, "grad_norm": float(gnorm),
                 "lr": float(schedule(step)), "elapsed_s": round(time.perf_counter() - t0, 1)})
    bar.close()
    nnx.update(model, train_state)
    return model


def qat_finetune(model: Decoder, *, bits: int, group_size: int, symmetric: bool, tokens: np.ndarray,
                 steps: int = DEFAULT_STEPS, batch: int = DEFAULT_BATCH, window: int = 256,
                 lr: float = DEFAULT_LR, seed: int = 0, progress: bool = True, log: Callable | None = None,
                 **options) -> Decoder:
    """Fine-tune an unfused float Decoder with fake-quantized linears (STE), then export it with RTN
    (in place) and return it: a Decoder whose linears are QuantizedWeights. tokens: a 1-D token
    stream (e.g. train.bin as uint16); each step draws `batch` windows of window + 1 tokens with numpy
    default_rng(seed). log: called with a dict per logged step (about 20 per run). options:
    qat_train's trainable, warmup, min_lr_ratio."""
    qat_train(model, bits=bits, group_size=group_size, symmetric=symmetric, tokens=tokens, steps=steps,
              batch=batch, window=window, lr=lr, seed=seed, progress=progress, log=log, **options)
    return export(model, _settings(bits, group_size, symmetric))


def export(model: Decoder, settings: QuantizeSettings) -> Decoder:
    """RTN of the trained float linears (in place): the codes fake_quant trained against."""
    return quantize_rtn(model, settings)


__all__ = ["qat_finetune", "qat_train", "export", "fake_quant", "ste_fake_quant", "apply_fake_quant",
           "linear_vars", "window_nll", "make_qat_loss", "split_trainable"]
