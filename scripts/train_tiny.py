"""Train a tiny Llama-architecture model from scratch on the prepared corpus (reproducibly).

Pipeline:
  1. corpus: `prepare_corpus` into --corpus-out (default /work/cache/corpus), or an existing
     folder via --corpus DIR (train.bin / heldout.bin / tokenizer.model / corpus.json).
  2. model: a `Decoder` (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings) from a preset; std 0.02
     normal init with the residual output projections (attn.o, mlp.down) scaled by
     1/sqrt(2 * n_layers) (GPT-2). Training runs in float32.
  3. optimisation: optax AdamW (b1 0.9, b2 0.95, weight decay on >= 2-D parameters only),
     linear warm-up then cosine decay to min_lr_ratio * lr over --steps, global-norm clipping 1.0.
     One jitted train step (params and optimizer state donated) over a batch of --batch random
     windows of seq_len + 1 tokens of train.bin, drawn by numpy's default_rng(seed).
  4. held-out loss every --eval-every steps and at the end: mean next-token NLL over
     non-overlapping windows of heldout.bin (window seq_len + 1, stride seq_len, so every
     token but the first is scored once; the partial tail window is dropped).
  5. output (--out): save_native(...) params + config.json + tokenizer, train_log.jsonl (one JSON
     object per logged step / eval) and training.json (summary).

Usage:
  python scripts/train_tiny.py --preset target --out checkpoints/jaxinfer-tiny-llama --steps 2000 \
      [--seconds 3500] [--batch 16 --seq-len 256 --lr 1e-3] [--seed 0] [--corpus /work/cache/corpus]
`--seconds` stops the loop by wall time (the schedule stays defined over --steps); `--stop-after N`
stops after N steps with the same schedule (used to check that a run reproduces). The first
--log-first steps are always logged individually so such a check can compare them step by step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.models.decoder import Decoder, count_params, window_nll  # noqa: E402
from jaxinfer.tokenizer import load_tokenizer  # noqa: E402
from jaxinfer.weights import save_native  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent
# Architectures (vocab_size comes from the tokenizer). n_kv_heads < n_heads exercises GQA.
PRESETS: dict[str, dict[str, Any]] = {
    "target": dict(d_model=256, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=704),  # 6.95M
    "draft": dict(d_model=96, n_layers=3, n_heads=3, n_kv_heads=1, head_dim=32, ffn_dim=256),    # 0.69M
}
PRESET_LR = {"target": 1e-3, "draft": 2e-3}
ARCH_FLAGS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim")


def build_config(preset: str, vocab_size: int, overrides: dict[str, int | None]) -> ModelConfig:
    arch = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    return ModelConfig(vocab_size=vocab_size, **arch, activation="silu", gated_mlp=True, norm="rmsnorm",
                       norm_eps=1e-5, position="rope", rope_theta=10000.0, max_position_embeddings=1024,
                       tie_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
                       architecture="LlamaForCausalLM")


def init_model(cfg: ModelConfig, seed: int) -> Decoder:
    model = Decoder(cfg, jnp.float32, rngs=nnx.Rngs(seed))
    scale = 1.0 / math.sqrt(2 * cfg.n_layers)
    for block in model.layers:  # GPT-2: residual output projections scaled by 1/sqrt(2L)
        block.attn.o.set_value(block.attn.o.get_value() * scale)
        block.mlp.down.set_value(block.mlp.down.get_value() * scale)
    return model


def make_schedule(lr: float, steps: int, warmup: int, min_lr_ratio: float) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(lr / warmup, lr, warmup, max(steps, warmup + 1), lr * min_lr_ratio)


def make_fns(graphdef: Any, tx: optax.GradientTransformation):
    def batch_nll(params: Any, windows: jax.Array) -> jax.Array:
        """windows [B, L+1] int32 -> per-token NLL [B, L] (next-token prediction)."""
        return window_nll(nnx.merge(graphdef, params), windows)

    def loss_fn(params: Any, windows: jax.Array) -> jax.Array:
        return jnp.mean(batch_nll(params, windows))

    @jax.jit
    def eval_nll(params: Any, windows: jax.Array) -> jax.Array:
        return jnp.sum(batch_nll(params, windows), axis=1)  # [B] summed NLL per window

    def train_step(params: Any, opt_state: Any, windows: jax.Array):
        loss, grads = jax.value_and_grad(loss_fn)(params, windows)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)

    return jax.jit(train_step, donate_argnums=(0, 1)), eval_nll


def heldout_loss(eval_nll, params: Any, heldout: np.ndarray, seq_len: int, batch: int) -> tuple[float, int]:
    """Mean NLL over non-overlapping windows (stride seq_len) of the held-out stream; (loss, tokens)."""
    n = (heldout.size - 1) // seq_len
    starts = np.arange(n) * seq_len
    windows = np.stack([heldout[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    total = 0.0
    for i in range(0, n, batch):
        chunk = windows[i:i + batch]
        m = len(chunk)  # pad to a fixed shape (one compile); padding rows are not counted
        chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch - m, axis=0)])
        total += float(np.sum(np.asarray(eval_nll(params, jnp.asarray(chunk)))[:m], dtype=np.float64))
    return total / (n * seq_len), n * seq_len


class Logger:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = path.open("w", encoding="utf-8")

    def __call__(self, record: dict[str, Any]) -> None:
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()),
              flush=True)


def train(a: argparse.Namespace) -> dict[str, Any]:
    t_start = time.time()
    if a.corpus is None:
        sys.path.insert(0, str(SCRIPTS))
        from prepare_corpus import prepare_corpus
        prepare_corpus(a.corpus_out, seed=a.seed)
        a.corpus = a.corpus_out
    corpus = Path(a.corpus)
    tokenizer = load_tokenizer(corpus)
    train_ids = np.fromfile(corpus / "train.bin", dtype=np.uint16)
    held_ids = np.fromfile(corpus / "heldout.bin", dtype=np.uint16)
    cfg = build_config(a.preset, tokenizer.vocab_size, {k: getattr(a, k) for k in ARCH_FLAGS})
    lr = a.lr if a.lr is not None else PRESET_LR[a.preset]
    warmup = a.warmup if a.warmup is not None else max(1, min(200, a.steps // 20))

    model = init_model(cfg, a.seed)
    n_params = count_params(model)
    assert n_params == cfg.num_params(), (n_params, cfg.num_params())
    graphdef, params = nnx.split(model, nnx.Param)
    schedule = make_schedule(lr, a.steps, warmup, a.min_lr_ratio)
    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    tx = optax.chain(optax.clip_by_global_norm(a.clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=a.weight_decay,
                                 mask=decay_mask))
    opt_state = tx.init(params)
    train_step, eval_nll = make_fns(graphdef, tx)
    rng = np.random.default_rng(a.seed)
    max_start = train_ids.size - (a.seq_len + 1)

    out = Path(a.out)
    log = Logger(out / "train_log.jsonl")
    hp = {"preset": a.preset, "steps": a.steps, "batch": a.batch, "seq_len": a.seq_len, "lr": lr,
          "min_lr_ratio": a.min_lr_ratio, "warmup": warmup, "weight_decay": a.weight_decay, "clip": a.clip,
          "betas": [0.9, 0.95], "seed": a.seed, "seconds": a.seconds, "stop_after": a.stop_after,
          "corpus": str(corpus.resolve()), "train_tokens": int(train_ids.size),
          "heldout_tokens": int(held_ids.size), "jax": jax.__version__, "backend": jax.default_backend()}
    log({"event": "start", "params": n_params, **hp})

    evals: list[dict[str, Any]] = []

    def evaluate(step: int) -> None:
        t0 = time.time()
        loss, n = heldout_loss(eval_nll, params, held_ids, a.seq_len, a.batch)
        evals.append({"event": "eval", "step": step, "heldout_loss": loss, "heldout_ppl": math.exp(loss),
                      "eval_tokens": n, "eval_s": round(time.time() - t0, 2)})
        log(evals[-1])

    last = a.steps if a.stop_after is None else min(a.steps, a.stop_after)
    losses: list[float] = []
    t_loop = time.time()
    t_int, tok_int, train_s, step, compile_s = time.time(), 0, 0.0, 0, 0.0
    while step < last:
        starts = rng.integers(0, max_start + 1, size=a.batch)
        windows = np.stack([train_ids[s:s + a.seq_len + 1] for s in starts]).astype(np.int32)
        t0 = time.time()
        params, opt_state, loss, gnorm = train_step(params, opt_state, jnp.asarray(windows))
        loss = float(loss)  # also waits for the step
        step += 1
        if step == 1:
            compile_s = time.time() - t0
            t_int = time.time()  # compile time is not throughput
        else:
            tok_int += a.batch * a.seq_len
            train_s += time.time() - t0
        losses.append(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
        out_of_time = a.seconds is not None and time.time() - t_loop >= a.seconds
        if step <= a.log_first or step % a.log_every == 0 or step == last or out_of_time:
            now = time.time()
            k = min(a.log_every, len(losses))
            log({"event": "train", "step": step, "loss": loss, "loss_avg": float(np.mean(losses[-k:])),
                 "grad_norm": float(gnorm), "lr": float(schedule(step - 1)),
                 "tokens_per_s": round(tok_int / max(now - t_int, 1e-9), 1) if tok_int else None,
                 "tokens_seen": step * a.batch * a.seq_len, "elapsed_s": round(now - t_loop, 1)})
            t_int, tok_int = time.time(), 0
        if step % a.eval_every == 0 and step != last and not out_of_time:
            evaluate(step)
            t_int, tok_int = time.time(), 0  # eval time is not training throughput
        if out_of_time:
            log({"event": "stop", "reason": f"--seconds {a.seconds} reached", "step": step})
            break
    loop_s = time.time() - t_loop
    evaluate(step)

    model = nnx.merge(graphdef, params)
    save_native(model, out, a.dtype, tokenizer=tokenizer,
                extra={"training": {"preset": a.preset, "steps": step, "seed": a.seed}})
    k = min(a.log_every, len(losses))
    summary = {
        "model": cfg.to_dict(), "params": n_params, "saved_dtype": a.dtype, "hyperparameters": hp,
        "steps": step, "planned_steps": a.steps, "tokens_seen": step * a.batch * a.seq_len,
        "epochs": step * a.batch * a.seq_len / train_ids.size,
        "train_loop_s": round(loop_s, 1), "compile_s": round(compile_s, 1), "total_s": round(time.time() - t_start, 1),
        "mean_tokens_per_s": round((step - 1) * a.batch * a.seq_len / max(train_s, 1e-9), 1),
        "final_train_loss": losses[-1], f"final_train_loss_avg{k}": float(np.mean(losses[-k:])),
        "heldout_loss": evals[-1]["heldout_loss"], "heldout_ppl": evals[-1]["heldout_ppl"],
        "heldout_eval_tokens": evals[-1]["eval_tokens"], "evals": [
            {k2: e[k2] for k2 in ("step", "heldout_loss")} for e in evals],
        "command": " ".join(sys.argv), "host": os.uname().nodename, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    log({"event": "done", "steps": step, "heldout_loss": summary["heldout_loss"], "total_s": summary["total_s"]})
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, required=True, help="planned steps (the lr schedule's length)")
    ap.add_argument("--seconds", type=float, default=None, help="stop the loop after this wall time")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after N steps (schedule unchanged)")
    ap.add_argument("--corpus", type=Path, default=None, help="prepared corpus folder (else prepare one)")
    ap.add_argument("--corpus-out", type=Path, default=Path("/work/cache/corpus"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=None, help="peak lr (default per preset)")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=None, help="default: steps/20, at most 200")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="saved dtype")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--log-first", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=250)
    for k in ARCH_FLAGS:
        ap.add_argument("--" + k.replace("_", "-"), dest=k, type=int, default=None, help="override the preset")
    return ap.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
