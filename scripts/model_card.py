"""Write MODEL_CARD.md (and eval.json) for a checkpoint trained by scripts/train_tiny.py.

The card covers: the data (sources, Debian package names + versions from corpus.json, licence,
held-out split rule), the architecture with its exact parameter count, training (steps, time,
tokens, final train loss, held-out loss on heldout.bin), an evaluation of held-out perplexity and
bits per byte over heldout.txt (`eval_ppl`), a unigram baseline over the same tokenizer, and
greedy samples.

Bits per byte = total NLL (nats) over the scored held-out tokens / ln 2 / UTF-8 bytes of the text.
`eval_ppl` is the definition jaxinfer's eval-ppl is meant to share: the text is encoded once with
the checkpoint's tokenizer (BOS prepended when the tokenizer adds one; BOS itself is never
scored), cut into windows of `window` tokens advancing by `stride` (default window // 2), and each
window scores only the tokens not scored by an earlier window (the first window scores all of
its tokens but the first), so every token after the first is scored exactly once with at least
window - stride tokens of context (except near the start).

Usage: python scripts/model_card.py checkpoints/jaxinfer-tiny-llama [--corpus /work/cache/corpus]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxinfer.evaluate import eval_ppl  # noqa: E402,F401  (the definition eval-ppl uses)
from jaxinfer.models.decoder import Decoder, count_params  # noqa: E402
from jaxinfer.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from jaxinfer.weights import load_native  # noqa: E402

PROMPTS = ("And God said", "hacker", "The programmer")


def unigram_baseline(train_ids: np.ndarray, tokenizer: Tokenizer, text: str, vocab_size: int) -> dict[str, Any]:
    """Add-one-smoothed unigram model from train.bin token counts, scored on the tokens eval_ppl scores."""
    counts = np.bincount(train_ids.astype(np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    ids = np.asarray(tokenizer.encode(text), np.int64)[1:]
    total, n_bytes = float(-logp[ids].sum()), len(text.encode("utf-8"))
    return {"nll": total, "tokens": int(ids.size), "bytes": n_bytes, "loss": total / ids.size,
            "ppl": math.exp(total / ids.size), "bits_per_byte": total / math.log(2) / n_bytes}


def greedy(model: Decoder, tokenizer: Tokenizer, prompt: str, max_new: int = 100) -> dict[str, Any]:
    """Greedy decoding by repeated full forwards over a fixed-size buffer (causal, so padding is inert)."""
    ids = tokenizer.encode(prompt)
    size = min(-(-(len(ids) + max_new) // 64) * 64, model.cfg.max_position_embeddings)
    graphdef, params = nnx.split(model)

    @jax.jit
    def next_token(params: Any, buf: jax.Array, n: jax.Array) -> jax.Array:
        logits, _ = nnx.merge(graphdef, params)(buf, jnp.arange(size, dtype=jnp.int32))
        return jnp.argmax(logits[n - 1])

    buf, n, stop = np.zeros(size, np.int32), len(ids), None
    buf[:n] = ids
    for _ in range(max_new):
        if n >= size:
            break
        tok = int(next_token(params, jnp.asarray(buf), n))
        buf[n], n = tok, n + 1
        if tok in tokenizer.eos_ids:
            stop = "eos"
            break
    new = buf[len(ids):n].tolist()
    return {"prompt": prompt, "new_tokens": len(new), "stopped": stop or "length",
            "completion": tokenizer.decode(new), "text": tokenizer.decode(list(buf[:n]))}


def _stage_lines(training: dict[str, Any], log_lr: float | None = None) -> list[str]:
    """One training run (training.json of scripts/train_tiny.py) as the card's bullet points;
    log_lr: the lr at its last logged step (from its train_log.jsonl, where the card has it)."""
    hp = training["hyperparameters"]
    return [
        f"- {training['steps']} steps (planned {training['planned_steps']}) of {hp['batch']} random windows x "
        f"{hp['seq_len']} tokens = {training['tokens_seen']:,} tokens ({training['epochs']:.2f} epochs), "
        f"{training['train_loop_s'] / 60:.1f} min on {hp['backend'].upper()} (2 cores, shared), "
        f"{training['mean_tokens_per_s']:.0f} tokens/s, float32."
        + (f" Stopped by the --seconds {hp['seconds']:g} wall-time cap"
           + (f" at lr {log_lr:.3g}" if log_lr is not None else "")
           + f" (the schedule was planned over {training['planned_steps']} steps)."
           if training["steps"] < training["planned_steps"] else ""),
        f"- AdamW (betas {hp['betas'][0]}/{hp['betas'][1]}, weight decay {hp['weight_decay']} on matrices only), "
        f"peak lr {hp['lr']:g}, {hp['warmup']} warm-up steps then cosine decay to {hp['min_lr_ratio']:g}x, "
        f"global-norm clipping {hp['clip']}, seed {hp['seed']}.",
        f"- Command: `{training['command']}`",
        f"- Final train loss {training['final_train_loss']:.4f} (last step"
        + (", KL to the teacher" if hp.get("teacher") else "") + "), held-out loss "
        f"{training['heldout_loss']:.4f} (heldout.bin, non-overlapping {hp['seq_len']}-token windows, "
        f"ppl {training['heldout_ppl']:.2f})."]


def fmt_md(text: str) -> str:
    return "\n".join("    " + line for line in text.split("\n"))


def _data_and_architecture(name: str, stats: dict, training: dict, cfg, n_params: int, size: int) -> list[str]:
    """The card's title, Data and Architecture sections."""
    hp = training["hyperparameters"]
    pk = stats.get("packages", {})
    sp, sh = stats["splits"]["train"], stats["splits"]["heldout"]
    role = ("Draft model for speculative decoding (shares the tokenizer of jaxinfer-tiny-llama)."
            if hp["preset"] == "draft" else "Target model (its speculative-decoding draft is jaxinfer-tiny-llama-draft).")
    how = ("trained from scratch" if "init_training" not in training
           else f"trained from scratch and then distilled from {Path(hp['teacher']).name}")
    L = [f"# {name}", "", f"A tiny Llama-architecture causal LM {how} with `scripts/train_tiny.py` "
         f"(jaxinfer). {role} It is a test fixture for the inference engine, not a useful language model.", "",
         "## Data", "",
         f"- Sources: King James Bible ({stats['documents_by_source'].get('kjv', 0)} chapter documents) and the "
         f"Jargon File 4.4.7 ({stats['documents_by_source'].get('jargon', 0)} entry documents), built by "
         "`scripts/prepare_corpus.py` from Debian packages (fetched with `apt-get download`, never installed):"]
    L += [f"  - `{n}` {v['version']} (`{v['deb']}`, sha256 `{v['sha256'][:16]}…`)" for n, v in pk.items()]
    L += ["- Licence: public domain (KJV: copyright expired per the Debian copyright file; Jargon File 4.4.7: "
          "public domain).",
          f"- Held-out split: every {stats['holdout_every']}th document (1-based, in source order) is held out "
          f"and never trained on; the tokenizer is trained on the training split only.",
          f"- Train: {sp['documents']} documents, {sp['bytes']:,} bytes, {sp['tokens']:,} tokens; held out: "
          f"{sh['documents']} documents, {sh['bytes']:,} bytes, {sh['tokens']:,} tokens (with BOS/EOS).",
          f"- Tokenizer: SentencePiece BPE, vocabulary {cfg.vocab_size}, byte fallback, bos=1 eos=2 pad=3 "
          f"(train.bin sha256 `{stats['train_bin_sha256'][:16]}…`).", "",
          "## Architecture", "",
          f"`{cfg.architecture}`: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} query heads / "
          f"{cfg.n_kv_heads} KV heads (GQA) of head_dim {cfg.head_dim}, SwiGLU FFN {cfg.ffn_dim}, RMSNorm "
          f"(eps {cfg.norm_eps}), RoPE (theta {cfg.rope_theta:g}), max positions {cfg.max_position_embeddings}, "
          f"tied embeddings. **{n_params:,} parameters** (embedding {cfg.vocab_size * cfg.d_model:,}). "
          f"Stored as {training['saved_dtype']} (folder size {size / 1e6:.2f} MB).", "",
          "## Training", ""]
    return L


def _training_lines(training: dict, trains: dict, evals: list) -> list[str]:
    """The Training section: one or two stages, the loss table (with the draft's agreement with its
    teacher when it was distilled)."""
    hp = training["hyperparameters"]
    L: list[str] = []
    stage1 = training.get("init_training")
    teacher = Path(hp["teacher"]).name if hp.get("teacher") else None
    if stage1 is not None:
        e1 = stage1["evals"]
        L += [f"Two stages: trained from scratch on the corpus, then distilled from "
              f"{teacher} (its next-token distributions, forward KL).", "",
              "### Stage 1: from scratch", ""]
        L += _stage_lines(stage1) + ["", "| step | held-out loss |", "|---:|---:|"]
        L += [f"| {e['step']} | {e['heldout_loss']:.4f} |" for e in e1]
        L += ["", f"### Stage 2: distillation from {teacher}", "",
              "Starting from stage 1's weights, the loss is KL(teacher || draft) per position (the teacher "
              "frozen) over random windows of train.bin"
              + (f" and, for {hp['generated_fraction']:.0%} of each batch, windows of the teacher's own "
                 f"continuations of {hp['teacher_generated']} random train.bin prompts of {hp['prompt_len']} tokens "
                 "(half greedy, half sampled at temperature 1: what a draft is asked to predict when serving)"
                 if hp.get("teacher_generated") else "") + ". On heldout.bin: *agreement* is the share of positions where the "
              "draft's and the teacher's most likely tokens match (greedy speculative acceptance per token), "
              "*overlap* the mean of sum_v min(p_teacher, p_draft) (the acceptance probability of speculative "
              "sampling at temperature 1).", ""]
    L += _stage_lines(training, trains[max(trains)]["lr"]) + ["", "| step | train loss (10-step mean at the last log <= step) | held-out loss |"
                                   + (" agreement | overlap | KL(teacher \\|\\| draft) |" if stage1 else ""),
                                   "|---:|---:|---:|" + ("---:|---:|---:|" if stage1 else "")]
    for e in evals:
        prior = [s for s in trains if s <= e["step"]]
        t = f"{trains[max(prior)]['loss_avg']:.4f} (step {max(prior)})" if prior else "–"
        L.append(f"| {e['step']} | {t} | {e['heldout_loss']:.4f} |"
                 + (f" {e['teacher_top1_agreement']:.4f} | {e['teacher_overlap']:.4f} | {e['teacher_kl']:.4f} |"
                    if stage1 else ""))
    return L


def _evaluation_lines(name: str, ev: dict, uni: dict, samples: list) -> list[str]:
    """The Evaluation and Samples sections."""
    L: list[str] = []
    L += ["", "## Evaluation (heldout.txt)", "",
          f"Sliding window of {ev['window']} tokens, stride {ev['stride']}, each token scored once "
          f"(`jaxinfer eval-ppl`, jaxinfer/evaluate.py); {ev['tokens']:,} tokens, {ev['bytes']:,} UTF-8 bytes.", "",
          "| model | loss (nats/token) | perplexity | bits per byte |", "|---|---:|---:|---:|",
          f"| {name} | {ev['loss']:.4f} | {ev['ppl']:.2f} | {ev['bits_per_byte']:.4f} |",
          f"| unigram baseline (train.bin counts, add-one) | {uni['loss']:.4f} | {uni['ppl']:.2f} | "
          f"{uni['bits_per_byte']:.4f} |", "",
          "## Samples (greedy, up to 100 new tokens, float32)", ""]
    for s in samples:
        L += [f"Prompt `{s['prompt']}` ({s['new_tokens']} tokens, stopped: {s['stopped']}):", "", fmt_md(s["text"]), ""]
    return L


def write_card(folder: Path, corpus: Path | None = None) -> dict[str, Any]:
    folder = Path(folder)
    training = json.loads((folder / "training.json").read_text())
    hp = training["hyperparameters"]
    corpus = Path(corpus or hp["corpus"])
    stats = json.loads((corpus / "corpus.json").read_text())
    model = load_native(folder, "float32")
    tokenizer = load_tokenizer(folder)
    cfg = model.cfg
    n_params = count_params(model)
    assert n_params == cfg.num_params() == training["params"]
    text = (corpus / "heldout.txt").read_text(encoding="utf-8")
    t0 = time.time()
    ev = eval_ppl(model, tokenizer, text, window=hp["seq_len"])
    ev["eval_s"] = round(time.time() - t0, 1)
    uni = unigram_baseline(np.fromfile(corpus / "train.bin", np.uint16), tokenizer, text, cfg.vocab_size)
    samples = [greedy(model, tokenizer, p) for p in PROMPTS]
    log = [json.loads(l) for l in (folder / "train_log.jsonl").read_text().splitlines()]
    trains = {r["step"]: r for r in log if r.get("event") == "train"}
    evals = [r for r in log if r.get("event") == "eval"]
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    name = folder.resolve().name
    L = _data_and_architecture(name, stats, training, cfg, n_params, size)
    L += _training_lines(training, trains, evals)
    L += _evaluation_lines(name, ev, uni, samples)
    (folder / "MODEL_CARD.md").write_text("\n".join(L), encoding="utf-8")
    result = {"model": name, "params": n_params, "eval": ev, "unigram": uni, "samples": samples,
              "folder_bytes": size}
    (folder / "eval.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--corpus", type=Path, default=None, help="default: the corpus recorded in training.json")
    r = write_card(**vars(ap.parse_args()))
    print(json.dumps({k: r[k] for k in ("model", "params", "eval", "unigram", "folder_bytes")}, indent=1))
