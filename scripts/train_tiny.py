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

Distillation (the bundled draft's second stage): --init DIR starts from a trained checkpoint's
weights (its architecture must be the preset's) and --teacher DIR trains on the teacher's
next-token distributions instead of the corpus's next tokens: the loss is the forward KL
divergence KL(teacher || student) per position, the teacher frozen (DistillSpec, Zhou et al.
2023: a draft that matches its target's distribution is accepted more often). The held-out
evaluations then also report how well the student agrees with the teacher: the share of
positions whose argmax tokens match (greedy speculative acceptance per token) and the mean of
sum_v min(p_teacher, p_student) (the acceptance probability of speculative sampling at
temperature 1, Leviathan et al. 2023).

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
from jaxinfer.models.decoder import Decoder, count_params, window_logits, window_nll  # noqa: E402
from jaxinfer.tokenizer import load_tokenizer  # noqa: E402
from jaxinfer.weights import load_native, save_native  # noqa: E402

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


def _logits(graphdef: Any, params: Any, windows: jax.Array) -> jax.Array:
    """decoder.window_logits of the model (graphdef, params), float32."""
    return window_logits(nnx.merge(graphdef, params), windows).astype(jnp.float32)


def make_fns(graphdef: Any, tx: optax.GradientTransformation, teacher_graphdef: Any = None):
    """(train_step, eval_nll, eval_agreement). Every function takes the teacher's params as its last
    argument (None without a teacher). With a teacher the loss is the mean forward KL divergence
    KL(teacher || student) over positions, else the mean next-token NLL of the corpus."""
    def batch_nll(params: Any, windows: jax.Array) -> jax.Array:
        """windows [B, L+1] int32 -> per-token NLL [B, L] (next-token prediction)."""
        return window_nll(nnx.merge(graphdef, params), windows)

    def kl(params: Any, windows: jax.Array, tparams: Any) -> jax.Array:
        logq = jax.nn.log_softmax(_logits(graphdef, params, windows), axis=-1)
        logp = jax.nn.log_softmax(jax.lax.stop_gradient(_logits(teacher_graphdef, tparams, windows)), axis=-1)
        return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)  # [B, L]

    def loss_fn(params: Any, windows: jax.Array, tparams: Any) -> jax.Array:
        return jnp.mean(batch_nll(params, windows) if teacher_graphdef is None else kl(params, windows, tparams))

    @jax.jit
    def eval_nll(params: Any, windows: jax.Array) -> jax.Array:
        return jnp.sum(batch_nll(params, windows), axis=1)  # [B] summed NLL per window

    @jax.jit
    def eval_agreement(params: Any, windows: jax.Array, tparams: Any) -> jax.Array:
        """[B, 3]: per window, the summed argmax matches, sum_v min(p, q) and KL(p || q)."""
        q = jax.nn.softmax(_logits(graphdef, params, windows), axis=-1)
        p = jax.nn.softmax(_logits(teacher_graphdef, tparams, windows), axis=-1)
        top1 = (jnp.argmax(p, -1) == jnp.argmax(q, -1)).astype(jnp.float32)
        overlap = jnp.sum(jnp.minimum(p, q), axis=-1)
        div = jnp.sum(jnp.where(p > 0, p * (jnp.log(p) - jnp.log(jnp.maximum(q, 1e-38))), 0.0), axis=-1)
        return jnp.stack([top1.sum(1), overlap.sum(1), div.sum(1)], axis=1)

    def train_step(params: Any, opt_state: Any, windows: jax.Array, tparams: Any):
        loss, grads = jax.value_and_grad(loss_fn)(params, windows, tparams)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)

    return jax.jit(train_step, donate_argnums=(0, 1)), eval_nll, eval_agreement


def heldout_sums(fn, heldout: np.ndarray, seq_len: int, batch: int) -> tuple[np.ndarray, int]:
    """fn(windows [batch, seq_len + 1]) -> per-window sums [batch, ...], summed over the
    non-overlapping windows (stride seq_len) of the held-out stream; (sums, tokens scored)."""
    n = (heldout.size - 1) // seq_len
    starts = np.arange(n) * seq_len
    windows = np.stack([heldout[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    total = 0.0
    for i in range(0, n, batch):
        chunk = windows[i:i + batch]
        m = len(chunk)  # pad to a fixed shape (one compile); padding rows are not counted
        chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch - m, axis=0)])
        total = total + np.sum(np.asarray(fn(jnp.asarray(chunk)), np.float64)[:m], axis=0)
    return np.asarray(total), n * seq_len


def heldout_loss(eval_nll, params: Any, heldout: np.ndarray, seq_len: int, batch: int) -> tuple[float, int]:
    """Mean NLL over non-overlapping windows (stride seq_len) of the held-out stream; (loss, tokens)."""
    total, n = heldout_sums(lambda w: eval_nll(params, w), heldout, seq_len, batch)
    return float(total) / n, n


def teacher_windows(teacher: Path, ids: np.ndarray, starts: np.ndarray, prompt_len: int, window: int,
                    seed: int) -> np.ndarray:
    """The teacher's own continuations (jaxinfer's Generator, float32) of the prompts
    ids[s:s + prompt_len] for s in starts, each a window of `window` tokens: the first half greedy,
    the rest sampled at temperature 1 (request i seeded seed + i), EOS ignored as the corpus windows
    cross documents. [len(starts), window] int32. A draft learns what it will be asked to predict:
    the target's outputs, not only the corpus (DistillSpec's on-policy finding; Medusa-2's
    self-distillation)."""
    from jaxinfer import Generator, SamplingParams

    g = Generator.from_pretrained(str(teacher), dtype="float32", max_num_seqs=64, max_num_batched_tokens=1024,
                                  max_model_len=window)
    n = len(starts)
    prompts = [ids[s:s + prompt_len].astype(np.int64).tolist() for s in starts]
    new = window - prompt_len
    params = [SamplingParams(max_tokens=new, ignore_eos=True, **(dict(temperature=0.0) if i < n // 2 else
                                                                 dict(temperature=1.0, seed=seed + i)))
              for i in range(n)]
    outs = g.generate(prompts, params)
    windows = np.array([p + list(o.samples[0].token_ids) for p, o in zip(prompts, outs)], np.int32)
    assert windows.shape == (n, window), windows.shape
    g.close()
    return windows


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
    if a.init is not None:
        model = load_native(a.init, "float32")
        if model.cfg != cfg:
            raise ValueError(f"--init {a.init}: its architecture is not the {a.preset!r} preset's")
    teacher_graphdef = teacher_params = None
    if a.teacher is not None:
        teacher = load_native(a.teacher, "float32")
        if teacher.cfg.vocab_size != cfg.vocab_size or load_tokenizer(a.teacher).vocab_size != tokenizer.vocab_size:
            raise ValueError(f"--teacher {a.teacher}: its vocabulary is not the corpus tokenizer's")
        teacher_graphdef, teacher_params = nnx.split(teacher, nnx.Param)
    n_params = count_params(model)
    assert n_params == cfg.num_params(), (n_params, cfg.num_params())
    graphdef, params = nnx.split(model, nnx.Param)
    schedule = make_schedule(lr, a.steps, warmup, a.min_lr_ratio)
    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    tx = optax.chain(optax.clip_by_global_norm(a.clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=a.weight_decay,
                                 mask=decay_mask))
    opt_state = tx.init(params)
    train_step, eval_nll, eval_agreement = make_fns(graphdef, tx, teacher_graphdef)
    rng = np.random.default_rng(a.seed)
    max_start = train_ids.size - (a.seq_len + 1)
    generated, n_gen = None, 0
    if a.teacher_generated:
        if a.teacher is None:
            raise ValueError("--teacher-generated needs --teacher")
        t0 = time.time()
        starts = np.random.default_rng(a.seed + 1).integers(0, train_ids.size - a.prompt_len, a.teacher_generated)
        generated = teacher_windows(a.teacher, train_ids, starts, a.prompt_len, a.seq_len + 1, a.seed)
        n_gen = round(a.batch * a.generated_fraction)
        print(f"{len(generated)} teacher-generated windows in {time.time() - t0:.0f} s; "
              f"{n_gen} of every batch's {a.batch} windows drawn from them", flush=True)

    out = Path(a.out)
    log = Logger(out / "train_log.jsonl")
    hp = {"preset": a.preset, "steps": a.steps, "batch": a.batch, "seq_len": a.seq_len, "lr": lr,
          "min_lr_ratio": a.min_lr_ratio, "warmup": warmup, "weight_decay": a.weight_decay, "clip": a.clip,
          "betas": [0.9, 0.95], "seed": a.seed, "seconds": a.seconds, "stop_after": a.stop_after,
          "corpus": str(corpus.resolve()), "train_tokens": int(train_ids.size),
          "heldout_tokens": int(held_ids.size), "jax": jax.__version__, "backend": jax.default_backend(),
          "init": str(a.init.resolve()) if a.init else None,
          "teacher": str(a.teacher.resolve()) if a.teacher else None,
          "teacher_generated": a.teacher_generated, "generated_fraction": a.generated_fraction if a.teacher_generated
          else 0.0, "prompt_len": a.prompt_len}
    log({"event": "start", "params": n_params, **hp})

    evals: list[dict[str, Any]] = []

    def evaluate(step: int) -> None:
        t0 = time.time()
        loss, n = heldout_loss(eval_nll, params, held_ids, a.seq_len, a.batch)
        record = {"event": "eval", "step": step, "heldout_loss": loss, "heldout_ppl": math.exp(loss), "eval_tokens": n}
        if teacher_params is not None:
            (top1, overlap, div), _ = heldout_sums(lambda w: eval_agreement(params, w, teacher_params),
                                                   held_ids, a.seq_len, a.batch)
            record.update(teacher_top1_agreement=top1 / n, teacher_overlap=overlap / n, teacher_kl=div / n)
        evals.append({**record, "eval_s": round(time.time() - t0, 2)})
        log(evals[-1])

    if a.init is not None:
        evaluate(0)  # the starting point

    last = a.steps if a.stop_after is None else min(a.steps, a.stop_after)
    losses: list[float] = []
    t_loop = time.time()
    t_int, tok_int, train_s, step, compile_s = time.time(), 0, 0.0, 0, 0.0
    while step < last:
        starts = rng.integers(0, max_start + 1, size=a.batch - n_gen)
        windows = np.stack([train_ids[s:s + a.seq_len + 1] for s in starts]).astype(np.int32)
        if n_gen:
            windows = np.concatenate([windows, generated[rng.integers(0, len(generated), size=n_gen)]])
        t0 = time.time()
        params, opt_state, loss, gnorm = train_step(params, opt_state, jnp.asarray(windows), teacher_params)
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
                extra={"training": {"preset": a.preset, "steps": step, "seed": a.seed,
                                    **({"distilled_from": a.teacher.resolve().name} if a.teacher else {})}})
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
            {k2: e[k2] for k2 in ("step", "heldout_loss", "teacher_top1_agreement", "teacher_overlap", "teacher_kl")
             if k2 in e} for e in evals],
        "command": " ".join(sys.argv), "host": os.uname().nodename, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if a.init is not None:  # the card describes every stage
        summary["init_training"] = json.loads((Path(a.init) / "training.json").read_text())
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
    ap.add_argument("--init", type=Path, default=None, help="start from this native checkpoint's weights")
    ap.add_argument("--teacher", type=Path, default=None,
                    help="distil: train on this native checkpoint's next-token distributions (forward KL)")
    ap.add_argument("--teacher-generated", type=int, default=0,
                    help="distil also on this many of the teacher's own continuations of train.bin prompts")
    ap.add_argument("--generated-fraction", type=float, default=0.5,
                    help="the share of each batch's windows drawn from the teacher's continuations")
    ap.add_argument("--prompt-len", type=int, default=64, help="the prompts' length for --teacher-generated")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="saved dtype")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--log-first", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=250)
    for k in ARCH_FLAGS:
        ap.add_argument("--" + k.replace("_", "-"), dest=k, type=int, default=None, help="override the preset")
    return ap.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
