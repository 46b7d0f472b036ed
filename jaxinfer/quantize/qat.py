"""Quantization-aware training (QAT) for weight-only quantization: restore the float model's own
outputs with its linears fake-quantized, then export with RTN. It must never retrain the model on
the text: the target is the float model (the teacher), not the text's next tokens.

    model, _ = load_model("checkpoints/jaxinfer-tiny-llama", "float32")
    tokens = tokenizer.encode(open("checkpoints/jaxinfer-tiny-llama/calibration.txt").read())
    qat_finetune(model, bits=4, group_size=-1, symmetric=False, tokens=tokens)   # defaults: see below

Fake quantization. Exactly the linears jaxinfer.quantize quantizes (`linears(block)`: q, k, v, o,
gate, up, down of every block) are replaced in the forward pass by
    fq(w) = dequantize(quantize(w, bits, group_size=group_for(K, settings), symmetric, contract=c))
with c the linear's contracted dims (common.CONTRACTED_DIMS): the RTN quantizer of jaxinfer.quant on
the current weight, so the training forward sees the very weights export writes (tests/test_qat.py
checks it bit for bit). Embeddings (hence the tied LM head), norms and biases stay float. The
straight-through estimator treats fq as the identity in the backward pass; `ste_fake_quant` is a
custom_vjp so the forward is fq(w) itself (w + stop_gradient(fq(w) - w) can differ from fq(w) in
the last bit).

Loss (LLM-QAT, Liu et al. 2023; BitDistiller; the forward KL of scripts/train_tiny.py's draft):
    (1 - nll_weight) * T^2 * KL(softmax(z_float / T) || softmax(z_fq / T)) + nll_weight * NLL(z_fq)
per position, mean over positions (T^2 keeps the gradient's scale as T changes, Hinton et al.);
z_float are the logits of the frozen float model (the starting weights, no fake quantization) on
the same windows, computed in the same jitted step. At nll_weight 0 the only target is the float
model: the text only supplies inputs, and the quantized model learns to compute what the float
model computes on them, not to predict that text. The control (the same training without fake
quantization) then has a zero gradient but for rounding (tests/test_qat.py bounds it), which
AdamW's normalisation turns into small random steps. nll_weight 1 is next-token fine-tuning, this
module's former loss, which moves the model toward its training text.

Data. The token stream is cut into blocks of 8 windows; about `heldout` of them, spread evenly,
are held out (split_heldout). Training windows (window + 1 tokens, random starts from numpy
default_rng(seed)) never touch a held-out token. An epoch is ceil(training tokens / (batch * window))
steps; before training and after every epoch the held-out KL(float || fq) at T = 1 is measured, and
the parameters of the best epoch are the ones exported (early stopping: epoch 0 is plain RTN, so a
run that does not help exports RTN; after `patience` epochs without improvement the run stops). A
run that passes over its training tokens more than REPEAT_WARNING times warns: the slice that picks
the epoch comes from the same text, so it cannot tell how the model does on other text.

Optimiser: optax AdamW (b1 0.9, b2 0.95, weight decay 0), linear warm-up over 10% of the steps then
cosine decay to 0, global-norm clipping 1.0, one jitted step with the trained parameters and
optimizer state donated. trainable="all" trains every float parameter (the linears, norms and the
tied embedding), "linears" only the quantized linears. Export: quantize_rtn of the best epoch's float
linears (in place), so the result saves / loads / serves like any RTN checkpoint.

Defaults: lr 3e-5, at most 400 steps of 8 windows of 256 tokens, trainable "all", nll_weight 0,
T 2, a 10% held-out slice, patience 5. Chosen by scripts/qat_sweep.py on the held-out slice of
checkpoints/jaxinfer-tiny-llama/calibration.txt only (4,112 of its 43,981 tokens; w4 per channel
asymmetric), never on an evaluation text. The score is
the slice's KL(float || fq) per token at the best epoch; RTN's is 0.01124 nats.
    lr at 200 steps (linears, T 1): 1e-5 0.00567, 3e-5 0.00475, 1e-4 0.00503; 3e-4 and 1e-3 diverge
        (their best epoch is 0: RTN)
    at lr 3e-5:   linears 200 steps 0.00475, 400 steps 0.00414; all 200 0.00461, 400 0.00396
                  nll_weight 0.1 (linears, 200) 0.00839: next-token loss pulls away from the float model
                  T 2 (linears, 200) 0.00418; T 4 (all, 400, stopped at epoch 11) 0.00480
                  all, 400 steps, T 2: 0.00357 (68% of RTN's KL removed)  <- the defaults
Every row ran with patience 3. Curves on the slice went up to 2 epochs without improvement before a
new best, and the T 4 run stopped at patience 3 mid-schedule with its best at epoch 8, so the default
patience is 5: it only cuts runs that diverge. The 400-step default passes over calibration.txt's
39,869 training tokens 20.5 times, so it warns there; on the slice, more passes kept lowering the
KL. Wall time of the default on the 2-core CPU: about 0.75 s a step alone, 1 to 1.5 s with other
jobs running (5 to 10 minutes).

Measured (bench/quantize_ppl.py, in the README's quantization table; w4 per channel asymmetric, trained on
calibration.txt; perplexity rise over float32 on heldout.txt / on the fortunes of Debian's
fortunes-min, a domain nobody trained, calibrated or tuned on): RTN +1.08% / +1.70%, GPTQ +0.46% /
+1.41%, AWQ +0.69% / +2.75%, QAT +0.21% / -0.05% (81% / 103% of RTN's rise removed); the control
(the same training without fake quantization) exports RTN's model (its slice KL only rose, so
epoch 0 was kept). The former loss (next-token, 200 steps at lr 1e-4, no held-out slice: this file
at commit 7300e68, run once outside the bench) on the same text: +11.2% / +3.4%.
"""
from __future__ import annotations

import functools
import math
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxinfer.models.decoder import Decoder, window_logits, window_nll
from jaxinfer.quant import dequantize, quantize
from jaxinfer.quantize.common import CONTRACTED_DIMS, QuantizeSettings, group_for, linears, quantize_rtn

DEFAULT_STEPS = 400
DEFAULT_LR = 3e-5
DEFAULT_BATCH = 8
DEFAULT_TRAINABLE = "all"
DEFAULT_NLL_WEIGHT = 0.0
DEFAULT_TEMPERATURE = 2.0
DEFAULT_HELDOUT = 0.1
DEFAULT_PATIENCE = 5
REPEAT_WARNING = 4.0            # epochs over the training tokens past which a run warns
BLOCK_WINDOWS = 8               # split_heldout's block: 8 windows, so a held-out block scores 8 full windows


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
        var.set_value(fn(var.get_value(), settings, CONTRACTED_DIMS[name]))
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


def distill_kl(teacher_logits: jax.Array, student_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """[..., V] logits -> [...] KL(softmax(teacher / T) || softmax(student / T)) in nats, f32."""
    logp = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    logq = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def _logits(graphdef, settings: QuantizeSettings | None, params, frozen, windows) -> jax.Array:
    """windows [B, L+1] -> [B, L, V] logits of the model (graphdef, params, frozen), its linears
    fake-quantized (through the STE) unless settings is None."""
    model = nnx.merge(graphdef, params, frozen)
    if settings is not None:
        apply_fake_quant(model, settings, ste=True)
    return window_logits(model, windows)


def make_qat_loss(graphdef, settings: QuantizeSettings | None, nll_weight: float = DEFAULT_NLL_WEIGHT,
                  temperature: float = DEFAULT_TEMPERATURE) -> Callable:
    """(trainable, frozen, teacher, windows [B, L+1]) -> the mean loss of the module docstring.
    teacher: the float values of `trainable` (the starting weights; no gradient flows into them);
    settings None: the student runs without fake quantization (the control run)."""
    def loss(trainable, frozen, teacher, windows):
        z = _logits(graphdef, settings, trainable, frozen, windows)                      # (B, L, V)
        total = 0.0
        if nll_weight < 1:
            z_t = jax.lax.stop_gradient(_logits(graphdef, None, teacher, frozen, windows))
            total = (1 - nll_weight) * temperature ** 2 * jnp.mean(distill_kl(z_t, z, temperature))
        if nll_weight > 0:
            logq = jax.nn.log_softmax(z.astype(jnp.float32), axis=-1)
            nll = -jnp.take_along_axis(logq, windows[:, 1:, None], axis=-1)[..., 0]
            total = total + nll_weight * jnp.mean(nll)
        return total
    return loss


def split_heldout(n_tokens: int, window: int, fraction: float = DEFAULT_HELDOUT) -> tuple[np.ndarray, np.ndarray]:
    """-> (training window starts, held-out window starts), windows of window + 1 tokens.

    The stream is cut into blocks of BLOCK_WINDOWS * (window + 1) tokens; max(1, round(fraction *
    blocks)) of them, evenly spread (a text's documents change along it), are held out and scored as
    non-overlapping windows. A training start is any whose window touches no held-out token."""
    size = BLOCK_WINDOWS * (window + 1)
    n_blocks = n_tokens // size
    if n_blocks < 2:
        raise ValueError(f"QAT holds out a slice of its text for early stopping: it needs at least "
                         f"{2 * size} tokens ({2 * BLOCK_WINDOWS} windows of {window + 1}), the text gives {n_tokens}")
    k = max(1, round(fraction * n_blocks))
    held_blocks = ((np.arange(k) + 0.5) * n_blocks / k).astype(int)
    held = np.zeros(n_tokens, bool)
    for b in held_blocks:
        held[b * size:(b + 1) * size] = True
    touched = np.concatenate([[0], np.cumsum(held)])                            # held tokens before i
    starts = np.arange(n_tokens - window)                                       # windows [s, s + window]
    train = starts[touched[starts + window + 1] == touched[starts]]
    heldout = (held_blocks[:, None] * size + np.arange(BLOCK_WINDOWS)[None] * (window + 1)).reshape(-1)
    return train, heldout


@functools.lru_cache(maxsize=4)
def _train_step(graphdef, settings: QuantizeSettings | None, lr: float, steps: int, warmup: int,
                min_lr_ratio: float, nll_weight: float, temperature: float):
    """(jitted step, optimizer, schedule), cached so that a repeated run of one configuration (tests,
    sweeps) reuses the compiled step. The step: (params, opt_state, frozen, teacher, windows) ->
    (params, opt_state, loss, grad norm), params and opt_state donated."""
    schedule = optax.warmup_cosine_decay_schedule(lr / warmup, lr, warmup, max(steps, warmup + 1), lr * min_lr_ratio)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0))
    loss_fn = make_qat_loss(graphdef, settings, nll_weight, temperature)

    def train_step(params, opt_state, frozen, teacher, windows):
        loss, grads = jax.value_and_grad(loss_fn)(params, frozen, teacher, windows)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)

    return jax.jit(train_step, donate_argnums=(0, 1)), tx, schedule


@functools.lru_cache(maxsize=4)
def _window_kl(graphdef, settings: QuantizeSettings):
    """Jitted (params, frozen, teacher, windows [B, L+1]) -> [B] summed KL(float || fq) at T = 1."""
    def fn(params, frozen, teacher, windows):
        z = _logits(graphdef, settings, params, frozen, windows)
        return jnp.sum(distill_kl(_logits(graphdef, None, teacher, frozen, windows), z), axis=-1)
    return jax.jit(fn)


def heldout_kl(graphdef, settings, params, frozen, teacher, windows: np.ndarray, batch: int, dev) -> float:
    """Mean KL(float || fq) per position over held-out windows [n, L+1], `batch` at a time (the
    last chunk padded to the same shape, one compile; padding rows are not counted)."""
    fn, total = _window_kl(graphdef, settings), 0.0
    for i in range(0, len(windows), batch):
        chunk = windows[i:i + batch]
        m = len(chunk)
        padded = np.concatenate([chunk, np.repeat(chunk[:1], batch - m, axis=0)])
        total += float(np.sum(np.asarray(fn(params, frozen, teacher, jax.device_put(padded, dev)), np.float64)[:m]))
    return total / (len(windows) * (windows.shape[1] - 1))


def _check_inputs(model: Decoder, steps, batch, patience, nll_weight, temperature, heldout) -> None:
    for owner, name in linear_vars(model):               # refuses a fused model before any work
        w = getattr(owner, name).get_value()
        if getattr(w, "dtype", None) != jnp.float32:
            raise ValueError(f"QAT trains a float32 model (load it with dtype float32); a linear is "
                             f"{getattr(w, 'dtype', type(w).__name__)}")
    if steps < 1 or batch < 1 or patience < 1:
        raise ValueError(f"QAT needs steps, batch and patience >= 1, got {steps}, {batch}, {patience}")
    if not (0.0 <= nll_weight <= 1.0 and temperature > 0 and 0.0 < heldout < 1.0):
        raise ValueError(f"QAT needs 0 <= nll_weight <= 1, temperature > 0 and 0 < heldout < 1, got "
                         f"{nll_weight}, {temperature}, {heldout}")


def plan_data(tokens: np.ndarray, window: int, batch: int, steps: int, heldout: float) -> dict[str, Any]:
    """The data a run uses: training / held-out window starts, distinct tokens of each, the steps of
    an epoch and how many times the run passes over its training tokens."""
    train_starts, held_starts = split_heldout(tokens.size, window, heldout)
    cover = np.zeros(tokens.size + 1, np.int64)
    np.add.at(cover, train_starts, 1)
    np.add.at(cover, train_starts + window + 1, -1)
    train_tokens = int(np.count_nonzero(np.cumsum(cover)[:-1]))
    steps_per_epoch = math.ceil(train_tokens / (batch * window))
    return {"train_starts": train_starts, "heldout_starts": held_starts, "train_tokens": train_tokens,
            "heldout_tokens": int(len(held_starts) * (window + 1)), "steps_per_epoch": steps_per_epoch,
            "epochs": steps * batch * window / train_tokens}


def _host_copy(state):
    """A numpy copy of a state pytree: the device buffers are donated to the next step."""
    return jax.tree.map(lambda x: np.array(x, copy=True), state)


def qat_train(model: Decoder, *, bits: int, group_size: int, symmetric: bool, tokens: np.ndarray,
              steps: int = DEFAULT_STEPS, batch: int = DEFAULT_BATCH, window: int = 256, lr: float = DEFAULT_LR,
              seed: int = 0, progress: bool = True, log: Callable | None = None, trainable: str = DEFAULT_TRAINABLE,
              warmup: int | None = None, min_lr_ratio: float = 0.0, fake: bool = True,
              nll_weight: float = DEFAULT_NLL_WEIGHT, temperature: float = DEFAULT_TEMPERATURE,
              heldout: float = DEFAULT_HELDOUT, patience: int = DEFAULT_PATIENCE) -> Decoder:
    """The training half of qat_finetune: the model's float parameters become those of the epoch
    with the least held-out KL (in place; no export). fake=False trains without fake quantization
    (the control run; it is scored and early-stopped exactly as QAT, on its RTN export). log: called
    with a dict per event (qat_data, qat_step about 20 per run, qat_epoch, qat_done)."""
    _check_inputs(model, steps, batch, patience, nll_weight, temperature, heldout)
    settings = _settings(bits, group_size, symmetric)
    tokens = np.asarray(tokens).reshape(-1)
    plan = plan_data(tokens, window, batch, steps, heldout)
    log = log or (lambda event: None)
    log({"event": "qat_data", "text_tokens": int(tokens.size), "steps": steps, "batch": batch, "window": window,
         **{k: v for k, v in plan.items() if not k.endswith("starts")}})
    if plan["epochs"] > REPEAT_WARNING:
        warnings.warn(f"QAT: {steps} steps x {batch} x {window} tokens pass over the {plan['train_tokens']:,} "
                      f"training tokens {plan['epochs']:.1f} times. A text this small shows the quantized model "
                      f"only what the float model does on it, and the held-out slice that picks the epoch comes "
                      f"from the same text, so it cannot see other domains: give more text if you have it.",
                      stacklevel=2)

    graphdef, params, frozen = split_trainable(model, trainable)
    teacher = jax.tree.map(jnp.copy, params)                 # the float starting weights, never updated
    warmup = max(1, steps // 10) if warmup is None else max(1, warmup)
    step_fn, tx, schedule = _train_step(graphdef, settings if fake else None, lr, steps, warmup, min_lr_ratio,
                                        float(nll_weight), float(temperature))
    opt_state = tx.init(params)
    # commit every single-device input (optax's step counts, parameters made by jnp.asarray) to the
    # parameters' device: the second call's inputs are the first call's committed outputs, and
    # uncommitted first inputs would make it compile the step twice
    dev = next(iter(jax.tree.leaves(params)[0].devices()))
    commit = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(x, dev) if len(x.devices()) == 1 else x, tree)
    params, opt_state, frozen, teacher = commit((params, opt_state, frozen, teacher))
    held = np.stack([tokens[s:s + window + 1] for s in plan["heldout_starts"]]).astype(np.int32)
    score = lambda p: heldout_kl(graphdef, settings, p, frozen, teacher, held, batch, dev)  # noqa: E731
    train_starts = plan["train_starts"]

    def step(params, opt_state, rng):
        starts = train_starts[rng.integers(0, len(train_starts), size=batch)]
        windows = np.stack([tokens[s:s + window + 1] for s in starts]).astype(np.int32)
        return step_fn(params, opt_state, frozen, teacher, jax.device_put(windows, dev))

    best = _run(step, schedule, score, params, opt_state, plan["steps_per_epoch"], steps, seed, patience, log,
                tqdm_bar(steps, f"QAT w{bits}" if fake else "fine-tune (float)", progress))
    nnx.update(model, jax.tree.map(jnp.asarray, best["params"]))
    log({"event": "qat_done", "best_epoch": best["epoch"], "best_step": best["step"], "heldout_kl": best["kl"]})
    return model


def tqdm_bar(steps: int, desc: str, progress: bool):
    from tqdm import tqdm
    return tqdm(range(steps), desc=desc, unit="step", disable=not progress)


def _run(step, schedule, score, params, opt_state, spe: int, steps: int, seed: int, patience: int, log,
         bar) -> dict[str, Any]:
    """The training loop with early stopping -> {"kl", "epoch", "step", "params" (host copy)} of the
    best scored point; epoch 0 is the starting model (RTN of the float weights). step(params,
    opt_state, rng) draws a batch and runs one optimizer step; spe: steps per epoch."""
    best = {"kl": score(params), "epoch": 0, "step": 0, "params": _host_copy(params)}
    log({"event": "qat_epoch", "epoch": 0, "step": 0, "heldout_kl": best["kl"], "elapsed_s": 0.0})
    rng = np.random.default_rng(seed)
    every, t0 = max(1, steps // 20), time.perf_counter()
    for i in bar:
        params, opt_state, loss, gnorm = step(params, opt_state, rng)
        loss = float(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"QAT loss is {loss} at step {i + 1}")
        bar.set_postfix(loss=f"{loss:.4f}")
        if (i + 1) % every == 0 or i == 0 or i + 1 == steps:
            log({"event": "qat_step", "step": i + 1, "loss": loss, "grad_norm": float(gnorm),
                 "lr": float(schedule(i)), "elapsed_s": round(time.perf_counter() - t0, 1)})
        if (i + 1) % spe and i + 1 != steps:
            continue
        epoch = math.ceil((i + 1) / spe)
        kl = score(params)
        log({"event": "qat_epoch", "epoch": epoch, "step": i + 1, "heldout_kl": kl,
             "elapsed_s": round(time.perf_counter() - t0, 1)})
        if kl < best["kl"]:
            best = {"kl": kl, "epoch": epoch, "step": i + 1, "params": _host_copy(params)}
        elif epoch - best["epoch"] >= patience:
            break
    bar.close()
    return best


def qat_finetune(model: Decoder, *, bits: int, group_size: int, symmetric: bool, tokens: np.ndarray,
                 **options) -> Decoder:
    """Distil the float Decoder into its fake-quantized self (STE), then export it with RTN (in
    place) and return it: a Decoder whose linears are QuantizedWeights. tokens: a 1-D token stream
    of text the model was trained on or will serve (never the evaluation text). options: qat_train's
    (steps, batch, window, lr, seed, progress, log, trainable, nll_weight, temperature, heldout, ...)."""
    qat_train(model, bits=bits, group_size=group_size, symmetric=symmetric, tokens=tokens, **options)
    return export(model, _settings(bits, group_size, symmetric))


def export(model: Decoder, settings: QuantizeSettings) -> Decoder:
    """RTN of the trained float linears (in place): the codes fake_quant trained against."""
    return quantize_rtn(model, settings)


__all__ = ["qat_finetune", "qat_train", "export", "fake_quant", "ste_fake_quant", "apply_fake_quant",
           "linear_vars", "window_nll", "make_qat_loss", "split_trainable", "distill_kl", "split_heldout",
           "plan_data", "heldout_kl"]
