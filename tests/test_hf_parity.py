"""The decoder computes what HF transformers computes: logits and greedy continuations."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import Generator, SamplingParams
from jaxinfer.weights import load_model, save_native
from tests.hf_models import CONFIGS, build_hf_model

PROMPT_LEN = 24


def _prompt(vocab: int, seed: int = 0) -> list[int]:
    return np.random.RandomState(seed).randint(3, vocab, PROMPT_LEN).tolist()


def _rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _small_gen(path, dtype="float32", **kw) -> Generator:
    # an 8-token budget: one token bucket, so one step compilation per engine; the 24-token prompt is
    # prefilled in 3 chunks, each reading the pages the earlier ones wrote (sliding windows cross them)
    kw = {"max_model_len": 64, "max_num_batched_tokens": 8, "max_num_seqs": 4, "warmup": False, **kw}
    # an explicit pool (max_num_seqs sequences of max_model_len, + the null block: what CPU sizes by
    # itself): on a GPU a pool sized from memory would leave none for the second engine of a test
    kw.setdefault("num_blocks", kw["max_num_seqs"] * -(-kw["max_model_len"] // kw.get("block_size", 16)) + 1)
    return Generator.from_pretrained(path, dtype=dtype, **kw)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_greedy_match_hf(name, hf_model_dir):
    hf = build_hf_model(name)
    gen = _small_gen(hf_model_dir(name))
    ids = _prompt(gen.model_cfg.vocab_size)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
        ref_gen = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, PROMPT_LEN:].tolist()
    assert _rel_err(gen.logits(ids), ref) < 1e-4
    out = gen.generate([ids], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref_gen
    assert out.finish_reason == "length"


@pytest.mark.parametrize("name", ["llama-gqa-llama3", "gpt2", "bloom", "qwen2-window", "gemma2"])
def test_bfloat16_logits_close_to_float32(name, hf_model_dir):
    path = hf_model_dir(name)
    f32 = _small_gen(path, "float32")
    bf16 = _small_gen(path, "bfloat16")
    ids = _prompt(f32.model_cfg.vocab_size, seed=1)
    a, b = f32.logits(ids), bf16.logits(ids)
    assert b.dtype == np.float32
    # bf16 keeps 8 mantissa bits (rel. precision 2^-8 = 0.4%); a few layers of it stay within ~3%.
    assert _rel_err(b, a) < 3e-2
    assert np.mean(np.argmax(a, -1) == np.argmax(b, -1)) > 0.8


@pytest.mark.parametrize("name", ["llama-mqa-tied-linear", "gpt2-untied-relu", "bloom-6heads-postnorm", "gemma3",
                                  "phi3-longrope", "ministral3"])
def test_native_round_trip_identical_logits(name, hf_model_dir, tmp_path):
    path = hf_model_dir(name)
    model, cfg = load_model(path, "float32")
    save_native(model, tmp_path / "native", "float32")
    a = _small_gen(path)
    b = _small_gen(tmp_path / "native")
    assert b.model_cfg == cfg
    ids = _prompt(cfg.vocab_size, seed=2)
    np.testing.assert_array_equal(a.logits(ids), b.logits(ids))


def test_sharded_safetensors_folder(hf_model_dir, tmp_path):
    hf = build_hf_model("llama-gqa-llama3")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    ids = _prompt(131, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert _rel_err(_small_gen(tmp_path).logits(ids), ref) < 1e-4


def test_bfloat16_checkpoint_loads(tmp_path):
    hf = build_hf_model("qwen2-tied").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    gen = _small_gen(tmp_path, "float32")
    ids = _prompt(151, seed=4)
    with torch.no_grad():
        ref = hf.float()(torch.tensor([ids])).logits[0].numpy()
    assert _rel_err(gen.logits(ids), ref) < 1e-4   # bf16 weights upcast exactly to f32
