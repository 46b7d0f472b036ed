"""The bundled models: they load by default, have the documented shapes, reproduce their model
card's held-out figure, and write English (words of the training corpus)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from jaxinfer import Generator, SamplingParams
from jaxinfer.evaluate import eval_ppl
from jaxinfer.generator import CHECKPOINTS, DEFAULT_MODEL, default_model_path
from jaxinfer.tokenizer import load_tokenizer
from jaxinfer.weights import is_native, load_model, read_native_config

TARGET = CHECKPOINTS / DEFAULT_MODEL
DRAFT = CHECKPOINTS / f"{DEFAULT_MODEL}-draft"


@pytest.fixture(scope="module")
def gen() -> Generator:
    # an 8-token budget: warm-up compiles one step shape (the short prompts here never fill more), and
    # generating must still compile nothing after it
    return Generator.from_pretrained(dtype="float32", max_model_len=256, max_num_batched_tokens=8,
                                     max_num_seqs=4)


def test_default_path_is_the_bundled_target():
    assert default_model_path() == TARGET
    for folder in (TARGET, DRAFT):
        assert is_native(folder) and (folder / "tokenizer.model").exists() and (folder / "MODEL_CARD.md").exists()
    total = sum(f.stat().st_size for f in CHECKPOINTS.rglob("*") if f.is_file())
    assert total <= 40 * 2**20, f"checkpoints/ holds {total / 2**20:.1f} MiB"


def test_shapes_and_parameter_counts():
    target, _ = read_native_config(TARGET)
    draft, _ = read_native_config(DRAFT)
    assert target.architecture == draft.architecture == "LlamaForCausalLM"
    assert target.vocab_size == draft.vocab_size == load_tokenizer(TARGET).vocab_size
    assert target.n_kv_heads < target.n_heads                        # GQA
    assert target.num_params() >= 8 * draft.num_params()
    model, _ = load_model(TARGET, "float32")
    from flax import nnx
    n = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.state(model, nnx.Param).flat_state())
    assert n == target.num_params()
    card = (TARGET / "MODEL_CARD.md").read_text()
    assert f"{target.num_params():,}" in card


@pytest.mark.parametrize("folder", [TARGET, DRAFT], ids=["target", "draft"])
def test_eval_ppl_reproduces_the_model_card(folder):
    card = json.loads((folder / "eval.json").read_text())
    model, _ = load_model(folder, "float32")
    text = (folder / "heldout.txt").read_text(encoding="utf-8")
    ev = card["eval"]
    got = eval_ppl(model, load_tokenizer(folder), text, window=ev["window"], stride=ev["stride"])
    assert got["tokens"] == ev["tokens"]
    assert got["bits_per_byte"] == pytest.approx(ev["bits_per_byte"], rel=2e-3)


def test_target_beats_draft_beats_unigram():
    t = json.loads((TARGET / "eval.json").read_text())
    d = json.loads((DRAFT / "eval.json").read_text())
    assert t["eval"]["bits_per_byte"] < d["eval"]["bits_per_byte"] < t["unigram"]["bits_per_byte"]


def _english_fraction(text: str, vocabulary: set[str]) -> float:
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 30, text
    return sum(w.lower() in vocabulary for w in words) / len(words)


@pytest.mark.parametrize("prompt", ["And God said", "hacker"])
def test_generations_read_as_english(gen, prompt):
    vocabulary = set((CHECKPOINTS / "training_words.txt").read_text().split())
    greedy = gen.generate(prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    sampled = gen.generate(prompt, SamplingParams(max_tokens=100, temperature=0.8, seed=0, ignore_eos=True))[0]
    assert _english_fraction(greedy.text, vocabulary) >= 0.9, greedy.text
    assert _english_fraction(sampled.text, vocabulary) >= 0.9, sampled.text
    assert gen.stats()["compilations_after_warmup"] == 0


def test_draft_card_agreement_with_the_target_reproduces():
    """The distilled draft's card: how often its most likely token is the target's (greedy
    speculative acceptance per token) and the mean of sum_v min(p, q) (speculative sampling's
    acceptance probability), recomputed here with numpy from both models' logits over the windows
    the card scored: heldout.txt re-tokenized as scripts/prepare_corpus.py builds heldout.bin
    ([BOS doc EOS] per document), windows of 257 tokens at stride 256 (scripts/train_tiny.py)."""
    training = json.loads((DRAFT / "training.json").read_text())
    final = training["evals"][-1]
    card = (DRAFT / "MODEL_CARD.md").read_text()
    assert (f"| {final['teacher_top1_agreement']:.4f} | {final['teacher_overlap']:.4f} | "
            f"{final['teacher_kl']:.4f} |") in card
    first = training["evals"][0]                      # stage 1's weights, before distillation
    assert first["step"] == 0 and final["teacher_top1_agreement"] > first["teacher_top1_agreement"]
    import jax
    import jax.numpy as jnp
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(TARGET / "tokenizer.model"))
    docs = (TARGET / "heldout.txt").read_text().split("\n\n")
    ids = np.asarray([t for d in docs for t in (1, *sp.encode(d.strip("\n")), 2)], np.int32)
    w = 256
    windows = np.stack([ids[s:s + w] for s in range(0, (len(ids) - 1) // w * w, w)])  # inputs; the target is next
    target, _ = load_model(TARGET, "float32")
    draft, _ = load_model(DRAFT, "float32")
    pos = jnp.arange(w, dtype=jnp.int32)
    logits = jax.jit(lambda m, x: jax.vmap(lambda t: m(t, pos)[0])(x))
    top1 = overlap = 0.0
    for s in range(0, len(windows), 16):
        x = jnp.asarray(windows[s:s + 16])
        lp = np.asarray(logits(target, x), np.float64)
        lq = np.asarray(logits(draft, x), np.float64)
        top1 += np.sum(lp.argmax(-1) == lq.argmax(-1))
        p = np.exp(lp - lp.max(-1, keepdims=True))
        q = np.exp(lq - lq.max(-1, keepdims=True))
        overlap += np.sum(np.minimum(p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)))
    n = windows.size
    assert n == training["heldout_eval_tokens"]
    # the same weights and windows in float32: only near-ties between two logits can flip a match
    # (each flip moves the share by 1 / 36,352 = 2.8e-5); sum min(p, q) moves with float32 rounding
    # of the logits, ~1e-6 relative
    assert top1 / n == pytest.approx(final["teacher_top1_agreement"], abs=2e-4)
    assert overlap / n == pytest.approx(final["teacher_overlap"], abs=1e-4)
