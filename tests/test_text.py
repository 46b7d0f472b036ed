"""Text-level behaviour of the engine with a real tokenizer: stop strings, streaming, string prompts.

The model is a random tiny Llama whose vocabulary is a SentencePiece BPE trained here, so its
output is arbitrary text made of real pieces (with multi-character tokens and byte fallback).
"""
from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import Generator, SamplingParams
from jaxinfer.tokenizer import load_tokenizer
from tests.hf_models import TEXT_WORDS, save_text_model

WORDS = TEXT_WORDS


@pytest.fixture(scope="module")
def text_gen(tmp_path_factory) -> Generator:
    folder = save_text_model(tmp_path_factory.mktemp("sp-llama"))
    # no warm-up: nothing here counts compilations, so compile only the token buckets the tests use
    return Generator.from_pretrained(folder, dtype="float32", max_model_len=128, max_num_batched_tokens=32,
                                     max_num_seqs=8, block_size=8, warmup=False)


def test_string_prompt_is_encoded_by_the_tokenizer(text_gen):
    tok = load_tokenizer(text_gen.engine.tokenizer.files[0].parent)
    a = text_gen.generate("the lazy dog", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    b = text_gen.generate([tok.encode("the lazy dog")], SamplingParams(max_tokens=8, temperature=0,
                                                                       ignore_eos=True))[0]
    assert a.prompt_token_ids == tok.encode("the lazy dog") and a.token_ids == b.token_ids
    assert a.text == tok.decode(a.token_ids)


def test_stop_strings_cut_the_text_across_token_boundaries(text_gen):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    free = text_gen.generate("seven wizards", params)[0]
    text = free.text
    assert len(text) > 20
    # a stop string that starts inside one token and ends inside another
    starts = np.cumsum([len(text_gen.tokenizer.decode(free.token_ids[:i])) for i in range(1, len(free.token_ids))])
    k = next(s for s in range(len(text) // 3, len(text) - 4) if s + 1 not in starts and s not in starts)
    stop = text[k: k + 4]
    out = text_gen.generate("seven wizards", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                            stop=[stop, "\x00never"]))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)       # vLLM's stop_reason: the string
    assert out.text == text[: text.index(stop)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    # streamed: the same text, the stop string never shown, no partial prefix left dangling
    deltas = list(text_gen.stream("seven wizards", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                                  stop=[stop])))
    assert "".join(d.text for d in deltas) == out.text
    assert deltas[-1].finish_reason == "stop" and all(d.finish_reason is None for d in deltas[:-1])


def test_eos_under_ignore_eos_is_text_when_special_tokens_are_kept(text_gen):
    """skip_special_tokens=False: an EOS that does not end the output (ignore_eos) is text, as the
    tokenizer decodes it and vLLM returns it (it was dropped); a stop token id that ends it is not."""
    tok = text_gen.tokenizer
    eos = tok.eos_ids[0]
    out = text_gen.generate("the lazy dog", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                           skip_special_tokens=False, logit_bias={eos: 100.0}))[0]
    assert out.token_ids == [eos] * 3 and out.text == tok.decode([eos] * 3, skip_special_tokens=False) != ""
    stopped = text_gen.generate("the lazy dog", SamplingParams(max_tokens=3, temperature=0, skip_special_tokens=False,
                                                               logit_bias={eos: 100.0}))[0]
    assert stopped.token_ids == [eos] and stopped.text == "" and stopped.finish_reason == "stop"
    assert stopped.stop_reason is None             # vLLM's: an EOS is no stop_reason
    # a stop_token_ids entry: vLLM's stop_reason is its id (the output ends at its first occurrence)
    free = text_gen.generate("the lazy dog", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    t = free.token_ids[3]
    by_id = text_gen.generate("the lazy dog", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                             stop_token_ids=[t]))[0]
    assert by_id.token_ids == free.token_ids[:free.token_ids.index(t) + 1]
    assert (by_id.finish_reason, by_id.stop_reason, free.stop_reason) == ("stop", t, None)


def test_stream_equals_generate(text_gen):
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)
    full = text_gen.generate("hackers write", params)[0]
    deltas = list(text_gen.stream("hackers write", params))
    assert "".join(d.text for d in deltas) == full.text
    assert sum((d.token_ids for d in deltas), []) == full.token_ids
    assert deltas[-1].finish_reason == "length"


@pytest.mark.parametrize("stride", [16, 32])
def test_eval_ppl_matches_transformers_nll(text_gen, stride):
    """Sliding-window NLL against HF transformers scoring the same windows (window 32, stride 16, and
    32: disjoint windows, whose first tokens have no context and are not scored; that run once
    scored one token of the second window and none after)."""
    import math

    import torch
    from transformers import LlamaForCausalLM

    from jaxinfer.evaluate import eval_ppl
    from jaxinfer.weights import load_model

    folder = text_gen.engine.tokenizer.files[0].parent
    hf = LlamaForCausalLM.from_pretrained(folder).eval()
    model, _ = load_model(folder, "float32")
    rng = np.random.RandomState(1)
    text = " ".join(rng.choice(WORDS, 60)) + "\n" + " ".join(rng.choice(WORDS, 30))
    ids = text_gen.tokenizer.encode(text)
    assert len(ids) > 70
    result = eval_ppl(model, text_gen.tokenizer, text, window=32, stride=stride)
    # reference: score token i (i >= 1) once, in the first window [b, b+32) with b % stride == 0 that
    # contains it beyond the part scored by the previous window, never a window's first token
    total, scored = 0.0, set()
    b = 0
    while True:
        e = min(b + 32, len(ids))
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids[b:e]])).logits[0].double(), -1).numpy()
        for i in range(max(b + 1, 1), e):
            if i not in scored:
                total -= logp[i - b - 1, ids[i]]
                scored.add(i)
        if e >= len(ids):
            break
        b += stride
    want = set(range(1, len(ids))) - (set(range(32, len(ids), 32)) if stride == 32 else set())
    assert scored == want and result["tokens"] == len(want)
    assert result["nll"] == pytest.approx(total, rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(total / math.log(2) / len(text.encode()), rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(total / len(want)), rel=1e-5)


def test_eval_ppl_paged_path_equals_plain_and_int8_fp8_are_close(text_gen):
    from jaxinfer.evaluate import eval_ppl
    from jaxinfer.weights import load_model

    folder = text_gen.engine.tokenizer.files[0].parent
    model, _ = load_model(folder, "float32")
    text = " ".join(np.random.RandomState(2).choice(WORDS, 80))
    plain = eval_ppl(model, text_gen.tokenizer, text, window=32, stride=16)
    paged = eval_ppl(model, text_gen.tokenizer, text, window=32, stride=16, kv_dtype="float32")
    int8 = eval_ppl(model, text_gen.tokenizer, text, window=32, stride=16, kv_dtype="int8")
    assert paged["nll"] == pytest.approx(plain["nll"], rel=1e-5)       # same maths through the pages
    assert int8["nll"] != plain["nll"] and int8["nll"] == pytest.approx(plain["nll"], rel=2e-2)
    # e4m3 pages keep 3 mantissa bits (<= 2^-4 relative error per element, int8 per-token ~2^-8 of
    # the row's max): further from plain than int8 on the same text, and still close
    fp8 = eval_ppl(model, text_gen.tokenizer, text, window=32, stride=16, kv_dtype="fp8")
    assert fp8["nll"] != plain["nll"] and fp8["nll"] == pytest.approx(plain["nll"], rel=2e-2)
