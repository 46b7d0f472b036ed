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
