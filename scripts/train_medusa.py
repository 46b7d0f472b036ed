"""Train Medusa heads (jaxinfer/spec_decode/medusa.py) on the bundled model's corpus, the target frozen.

Pipeline (reproducible from --seed):
  1. corpus: the prepared corpus folder (scripts/prepare_corpus.py; train.bin / heldout.bin). The
     last --val-fraction of train.bin is held back for choosing the tree; heads train on random
     windows of the rest; the card's accuracies are measured on heldout.bin (never trained on, by
     the target or the heads). --self-distill (the bundled heads' setting; Medusa-2's recipe):
     every training and validation window is instead its first --prompt-len tokens and the target's
     own continuation (train_tiny.teacher_windows: half greedy, half sampled at temperature 1), and
     the card adds the heads' accuracy on the target's continuations of held-out prompts.
  2. features: the frozen target's final-norm hidden states of --train-windows windows of --seq-len
     tokens, computed once (float32, kept in memory).
  3. heads: K residual SiLU blocks over the target's LM head, W = 0 at the start (each head starts
     as the next-token head); head i learns to predict the token i + 2 positions ahead of its hidden
     state. Loss: sum_i 0.8^i * cross-entropy_i (the Medusa paper's weighting). optax AdamW,
     linear warm-up then cosine decay, global-norm clipping 1.0, --steps steps of --batch windows.
  4. tree: each head's rank accuracy (how often its r-th most likely token is the right one) on the
     validation windows, then medusa.choose_tree: --tree-nodes nodes of largest expected
     acceptance.
  5. card: top-1 / top-5 accuracy of every head on heldout.bin and the tree's expected acceptance
     length, written to medusa.json and MODEL_CARD.md.

Usage:
  python scripts/train_medusa.py --target checkpoints/jaxinfer-tiny-llama \
      --out checkpoints/jaxinfer-tiny-llama-medusa [--corpus /work/cache/corpus] [--steps 1500]
(the bundled heads: the defaults with --self-distill, about 22 minutes on the 2-core CPU)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxinfer.spec_decode.medusa import (MedusaHeads, choose_tree, expected_acceptance_length, save_heads,  # noqa: E402
                             target_fingerprint)
from jaxinfer.weights import load_model  # noqa: E402

LOSS_DECAY = 0.8


def hidden_fn(model):
    """windows [B, W] -> the target's final-norm hidden states [B, W, D] (no cache)."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def fn(params, windows):
        m = nnx.merge(graphdef, params)
        pos = jnp.arange(windows.shape[1], dtype=jnp.int32)
        return jax.vmap(lambda t: m.hidden_states(t, pos)[0])(windows)
    return lambda windows: fn(params, windows)


def corpus_windows(ids: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    return np.stack([ids[s:s + seq_len] for s in starts]).astype(np.int32)


def features(hidden, windows: np.ndarray, chunk: int = 8, desc: str = ""):
    out = np.zeros((len(windows), windows.shape[1], 0), np.float32)
    parts = []
    for i in tqdm(range(0, len(windows), chunk), desc=desc, unit="batch"):
        parts.append(np.asarray(hidden(jnp.asarray(windows[i:i + chunk]))))
    out = np.concatenate(parts) if parts else out
    return windows, out


def head_logits(heads_graphdef, lm_w):
    def fn(hparams, h):
        """h [B, W, D] -> [K, B, W, V] float32."""
        heads = nnx.merge(heads_graphdef, hparams)
        b, w, d = h.shape
        x = heads(h.reshape(b * w, d))
        return jnp.dot(x, lm_w, preferred_element_type=jnp.float32).reshape(x.shape[0], b, w, -1)
    return fn


def losses(logits, windows, k):
    """Per-head mean cross-entropy: head i at position t predicts windows[t + i + 2]."""
    out = []
    for i in range(k):
        lg = logits[i, :, : windows.shape[1] - i - 2]
        tgt = windows[:, i + 2:]
        out.append(jnp.mean(optax.softmax_cross_entropy_with_integer_labels(lg, tgt)))
    return jnp.stack(out)


def rank_counts(logits_fn, hparams, feats, windows, k, top, chunk=8, skip=0):
    """[K, top] how often head i's r-th token is the right one, and the positions scored per head;
    skip: hidden states before this position are not scored (a generated window's prompt)."""
    counts = np.zeros((k, top), np.int64)
    totals = np.zeros(k, np.int64)
    fn = jax.jit(lambda hp, h: jax.lax.top_k(logits_fn(hp, h), top)[1])
    for s in range(0, len(windows), chunk):
        ranks = np.asarray(fn(hparams, jnp.asarray(feats[s:s + chunk])))            # [K, B, W, top]
        w = windows[s:s + chunk]
        for i in range(k):
            hit = ranks[i, :, skip: w.shape[1] - i - 2] == w[:, skip + i + 2:, None]
            counts[i] += hit.reshape(-1, top).sum(0)
            totals[i] += hit.shape[0] * hit.shape[1]
    return counts, totals


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("checkpoints/jaxinfer-tiny-llama"))
    ap.add_argument("--out", type=Path, default=Path("checkpoints/jaxinfer-tiny-llama-medusa"))
    ap.add_argument("--corpus", type=Path, default=Path("/work/cache/corpus"))
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--train-windows", type=int, default=1536)
    ap.add_argument("--val-windows", type=int, default=96)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--tree-nodes", type=int, default=7,
                    help="the tree's nodes: with its root, 8 tokens a row, the engine's smallest step bucket "
                         "(the bundled heads on this CPU, batch 1, free generation: 2.03x of no speculation "
                         "against 1.72x for 12 nodes, which verify in the 16-token bucket, 1.67x for 4 nodes and "
                         "2.02x for a chain of 4; bench/results/2026-11-26-cpu-speculative-medusa-trees.json)")
    ap.add_argument("--top-r", type=int, default=8, help="ranks measured per head for the tree")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--self-distill", action="store_true",
                    help="train and choose the tree on the target's own continuations of the windows' first "
                         "--prompt-len tokens (half greedy, half sampled at temperature 1), not on the corpus")
    ap.add_argument("--prompt-len", type=int, default=64)
    a = ap.parse_args(argv)
    t_start = time.time()
    if not (a.corpus / "train.bin").exists():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from prepare_corpus import prepare_corpus
        prepare_corpus(a.corpus, seed=0)
    model, cfg = load_model(a.target, "float32")
    train_ids = np.fromfile(a.corpus / "train.bin", dtype=np.uint16)
    held_ids = np.fromfile(a.corpus / "heldout.bin", dtype=np.uint16)
    split = int(len(train_ids) * (1 - a.val_fraction))
    rng = np.random.default_rng(a.seed)
    w = a.seq_len
    hidden = hidden_fn(model)
    tr_starts = rng.integers(0, split - w, a.train_windows)
    va_starts = rng.integers(split, len(train_ids) - w, a.val_windows)
    n_held = (len(held_ids) - 1) // w
    if a.self_distill:   # the target's own continuations of the same prompts
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from train_tiny import teacher_windows
        gen = lambda ids, starts, seed: teacher_windows(a.target, ids, starts, a.prompt_len, w, seed)  # noqa: E731
        tr_windows = gen(train_ids, tr_starts, a.seed)
        va_windows = gen(train_ids, va_starts, a.seed + len(tr_starts))
        hg_windows = gen(held_ids, np.arange(n_held) * w, a.seed + len(tr_starts) + len(va_starts))
    else:
        tr_windows, va_windows = corpus_windows(train_ids, tr_starts, w), corpus_windows(train_ids, va_starts, w)
    tr_windows, tr_feats = features(hidden, tr_windows, desc="target features (train)")
    va_windows, va_feats = features(hidden, va_windows, desc="target features (validation)")
    he_windows, he_feats = features(hidden, corpus_windows(held_ids, np.arange(n_held) * w, w),
                                    desc="target features (heldout)")

    heads = MedusaHeads(a.heads, cfg.d_model)
    graphdef, hparams = nnx.split(heads)
    lm_w = (model.embed.get_value().T if model.lm_head is None else model.lm_head.get_value()).astype(jnp.float32)
    logits_fn = head_logits(graphdef, lm_w)
    weights = jnp.asarray([LOSS_DECAY ** i for i in range(a.heads)], jnp.float32)
    sched = optax.warmup_cosine_decay_schedule(a.lr / a.warmup, a.lr, a.warmup, max(a.steps, a.warmup + 1), a.lr * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.0))
    opt_state = tx.init(hparams)

    @jax.jit
    def train_step(hparams, opt_state, h, windows):
        def loss_fn(hp):
            per_head = losses(logits_fn(hp, h), windows, a.heads)
            return jnp.sum(weights * per_head), per_head
        (loss, per_head), grads = jax.value_and_grad(loss_fn, has_aux=True)(hparams)
        updates, opt_state = tx.update(grads, opt_state, hparams)
        return optax.apply_updates(hparams, updates), opt_state, loss, per_head

    a.out.mkdir(parents=True, exist_ok=True)
    log = open(a.out / "train_log.jsonl", "w")
    for step in tqdm(range(1, a.steps + 1), desc="medusa heads", unit="step"):
        idx = rng.integers(0, len(tr_windows), a.batch)
        hparams, opt_state, loss, per_head = train_step(hparams, opt_state, jnp.asarray(tr_feats[idx]),
                                                        jnp.asarray(tr_windows[idx]))
        if step % 25 == 0 or step == 1:
            log.write(json.dumps({"step": step, "loss": float(loss),
                                  "head_loss": [round(float(x), 4) for x in per_head]}) + "\n")
    log.close()

    va_counts, va_totals = rank_counts(logits_fn, hparams, va_feats, va_windows, a.heads, a.top_r)
    rank_acc = va_counts / va_totals[:, None]
    tree = choose_tree(rank_acc, a.tree_nodes)
    he_counts, he_totals = rank_counts(logits_fn, hparams, he_feats, he_windows, a.heads, 5)
    top1 = (he_counts[:, 0] / he_totals).tolist()
    top5 = (he_counts.sum(1) / he_totals).tolist()
    heldout_generated = None
    if a.self_distill:   # on what the heads meet when serving: the target's continuations of held-out prompts
        hg_windows, hg_feats = features(hidden, hg_windows, desc="target features (heldout, generated)")
        c, t = rank_counts(logits_fn, hparams, hg_feats, hg_windows, a.heads, 5, skip=a.prompt_len - 1)
        heldout_generated = {"top1": (c[:, 0] / t).tolist(), "top5": (c.sum(1) / t).tolist(), "positions": t.tolist(),
                             "windows": len(hg_windows), "prompt_len": a.prompt_len}
    # the target's own next-token accuracy on the same windows, for scale
    nxt = jax.jit(lambda h: jax.lax.top_k(jnp.dot(h, lm_w), 5)[1])
    t_hits = np.zeros(5, np.int64)
    t_total = 0
    for s in range(0, len(he_windows), 8):
        r = np.asarray(nxt(jnp.asarray(he_feats[s:s + 8])))[:, :-1]
        t_hits += (r == he_windows[s:s + 8, 1:, None]).reshape(-1, 5).sum(0)
        t_total += r.shape[0] * r.shape[1]
    heads = nnx.merge(graphdef, hparams)
    info = {
        "format": "jaxinfer-medusa", "version": 1, "num_heads": a.heads,
        "target": {"architecture": cfg.architecture, "d_model": cfg.d_model, "vocab_size": cfg.vocab_size,
                   "embed_sha256": target_fingerprint(model), "path": str(a.target)},
        "tree": [list(p) for p in tree.paths],
        "tree_expected_acceptance_length": expected_acceptance_length(tree, rank_acc),
        "chain_expected_acceptance_length": expected_acceptance_length(
            choose_tree(rank_acc[:, :1], a.heads), rank_acc),
        "validation_rank_accuracy": [[round(float(x), 5) for x in row] for row in rank_acc],
        "heldout": {"top1": top1, "top5": top5, "positions": he_totals.tolist(),
                    "target_next_token_top1": float(t_hits[0] / t_total),
                    "target_next_token_top5": float(t_hits.sum() / t_total)},
        "heldout_generated": heldout_generated,
        "training": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "train_seconds": round(time.time() - t_start, 1), "jax": jax.__version__,
    }
    save_heads(heads, tree, info, a.out)
    write_card(a.out, info)
    print(json.dumps({k: info[k] for k in ("tree", "tree_expected_acceptance_length", "heldout")}, indent=1))
    return info


def _accuracy_rows(acc: dict) -> str:
    """The card's table rows of each head's top-1 / top-5 accuracy (acc: "top1", "top5" per head)."""
    return "\n".join(f"| {i} | t + {i + 2} | {100 * a:.1f}% | {100 * b:.1f}% |"
                     for i, (a, b) in enumerate(zip(acc["top1"], acc["top5"])))


def write_card(out: Path, info: dict) -> None:
    h = info["heldout"]
    t = info["training"]
    rows = _accuracy_rows(h)
    tree = ", ".join("(" + ",".join(map(str, p)) + ")" for p in info["tree"])
    g = info.get("heldout_generated")
    if t.get("self_distill"):   # Medusa-2's self-distillation: the target's own outputs
        data = (f"windows of {t['seq_len']} tokens, each a random prompt of {t['prompt_len']} tokens and the "
                "target's own continuation (self-distillation, as Medusa-2: half greedy, half sampled at "
                "temperature 1, so the heads learn what the target says rather than what the corpus says),")
        val = "such windows (prompts)"
    else:
        data, val = f"random windows of {t['seq_len']} tokens", "windows"
    generated = "" if g is None else f"""
On what the heads meet when serving: the target's own continuations of {g['windows']} held-out prompts
of {g['prompt_len']} tokens (the same windows' starts, half greedy, half sampled at temperature 1), scored
after the prompt ({g['positions'][0]:,} positions for head 0):

| head | predicts | top-1 | top-5 |
|---|---|---|---|
""" + _accuracy_rows(g) + "\n"
    (out / "MODEL_CARD.md").write_text(f"""# jaxinfer-tiny-llama-medusa

Medusa heads (Cai et al. 2024, Medusa-1: the target frozen) for `checkpoints/jaxinfer-tiny-llama`,
trained by `scripts/train_medusa.py` with optax in {info['train_seconds']:.0f} s on the 2-core CPU. Used by
`speculative_method="medusa"` (jaxinfer/spec_decode/medusa.py); they refuse to load for any other target
(d_model, vocabulary and the sha256 of the target's embedding are checked).

- {info['num_heads']} heads, each one residual SiLU block (W [{info['target']['d_model']}, {info['target']['d_model']}], b) over the target's
  tied LM head: {info['num_heads'] * (info['target']['d_model'] ** 2 + info['target']['d_model']):,} parameters in all.
- Training: {t['train_windows']} {data} from the first {100 * (1 - t['val_fraction']):.0f}% of the corpus'
  train.bin (the target's own training split), {t['steps']} AdamW steps of {t['batch']} windows, lr {t['lr']}
  (warm-up {t['warmup']}, cosine to 10%), loss sum_i 0.8^i CE_i, seed {t['seed']}. Log: `train_log.jsonl`.
- Tree: chosen from each head's rank accuracy on {t['val_windows']} {val} of the held-back last
  {100 * t['val_fraction']:.0f}% of train.bin (`medusa.json`, validation_rank_accuracy), greedily by expected
  acceptance (medusa.choose_tree): {len(info['tree'])} nodes, paths of ranks {tree}.
  Expected acceptance length under independent heads: {info['tree_expected_acceptance_length']:.2f} tokens per
  step (a single chain of the heads' top-1 tokens: {info['chain_expected_acceptance_length']:.2f}).

## Accuracy on held-out text

`heldout.bin` of the corpus ({h['positions'][0]:,} positions for head 0), never trained on by the target or the
heads. Head i predicts the token i + 2 positions after its hidden state; the target's own next-token
accuracy on the same windows is top-1 {100 * h['target_next_token_top1']:.1f}%, top-5 {100 * h['target_next_token_top5']:.1f}%.

| head | predicts | top-1 | top-5 |
|---|---|---|---|
{rows}
{generated}""")


if __name__ == "__main__":
    main()
