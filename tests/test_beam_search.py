"""Beam search (jaxinfer/host/beam_search.py, EngineClient.beam_search, Generator.beam_search).

References, outside the code under test:
  - HF transformers' own beam search (GenerationMixin.generate, num_beams) on the same checkpoint,
    with no EOS: the same hypotheses in the same order, and their cumulative logprobs;
  - with an EOS: vLLM's loop as its source states it (vllm/entrypoints/openai/serving_engine.py
    beam_search), transcribed below over transformers' logits: completed hypotheses, their scores
    (vLLM's get_beam_search_score, prompt length included), include_stop_str_in_output.
Every reference pick is checked to win by more than the two paths' float32 differences (1e-4), so
the reference alone decides the order.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from jaxinfer import BeamSearchParams, Generator

MODEL = "llama-gqa-llama3"     # vocab 131
KW = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, num_blocks=40,
          block_size=8)


@pytest.fixture(scope="module")
def hf(hf_model_dir):
    import transformers as tf
    path = hf_model_dir(MODEL)
    return path, tf.AutoModelForCausalLM.from_pretrained(path).eval()


def _logprobs(model, seqs: list[list[int]]) -> np.ndarray:
    """transformers' next-token log-softmax after each sequence (float64 from float32 logits)."""
    import torch
    with torch.no_grad():
        out = [model(torch.as_tensor([s])).logits[0, -1].double() for s in seqs]
    return np.stack([torch.log_softmax(o, -1).numpy() for o in out])


def _vllm_beam_search(model, prompt: list[int], width: int, max_tokens: int, eos: int, ignore_eos: bool,
                      length_penalty: float, include_stop: bool) -> list[tuple[list[int], float, str, float]]:
    """vLLM's beam_search loop over transformers' logprobs: (output ids, cumulative logprob, finish,
    the logprob of an EOS that ended it and is not among its ids, else 0)."""
    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        lps = _logprobs(model, [b for b, _ in beams])
        ids, cums, owner = [], [], []
        for i, (b, cum) in enumerate(beams):
            top = np.argsort(-lps[i], kind="stable")[:2 * width]
            ids += top.tolist()
            cums += (cum + lps[i, top]).tolist()
            owner += [i] * len(top)
        ids, cums = np.array(ids), np.array(cums)
        if not ignore_eos:
            for k in np.where(ids == eos)[0]:
                b = beams[owner[k]][0]
                completed.append((b + [eos] if include_stop else b, float(cums[k]), "stop",
                                  0.0 if include_stop else float(lps[owner[k], eos])))
            cums[ids == eos] = -np.inf
        order = np.argsort(-cums, kind="stable")
        assert cums[order[width - 1]] - cums[order[width]] > 1e-4, "a near tie: pick another prompt"
        beams = [(beams[owner[k]][0] + [int(ids[k])], float(cums[k])) for k in order[:width]]
    hyps = completed + [(b, c, "length", 0.0) for b, c in beams]

    def score(h):
        n = len(h[0]) - (h[0][-1] == eos)
        return h[1] / n ** length_penalty
    hyps.sort(key=score, reverse=True)
    return [(t[len(prompt):], c, f, e) for t, c, f, e in hyps[:width]]


def test_matches_transformers_beam_search_without_eos(hf):
    """ignore_eos: the beam_width best hypotheses of HF transformers' beam search (num_beams, no EOS),
    token for token and best first, and their cumulative logprobs (the sum of the chosen tokens')."""
    import torch
    path, model = hf
    g = Generator.from_pretrained(path, **KW)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, 131, 9).tolist(), rng.randint(3, 131, 5).tolist()]
    width, steps = 4, 6
    outs = g.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True, logprobs=2))
    model.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs):
        # the reference's picks win by more than float32's differences (the transcription asserts it)
        _vllm_beam_search(model, prompt, width, steps, eos=-1, ignore_eos=True, length_penalty=1.0, include_stop=False)
        ref = model.generate(torch.as_tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                             max_new_tokens=steps, length_penalty=0.0, early_stopping=False, pad_token_id=0,
                             return_dict_in_generate=True, output_scores=True)
        hf_ids = ref.sequences[:, len(prompt):].tolist()
        assert [s.token_ids for s in out.samples] == hf_ids
        # length_penalty 0: HF's sequence score is the cumulative logprob itself
        np.testing.assert_allclose([sum(s.logprobs) for s in out.samples], ref.sequences_scores.double().numpy(),
                                   atol=1e-4)
        assert all(s.finish_reason == "length" and len(s.top_logprobs) == steps and len(s.top_logprobs[0]) == 2
                   for s in out.samples)
    assert g.engine.stats()["compilations_after_warmup"] == 0


@pytest.mark.parametrize("include_stop,length_penalty", [(False, 1.0), (True, 0.5)])
def test_eos_completes_hypotheses_as_vllm(hf, tmp_path, include_stop, length_penalty):
    """With an EOS among the candidates: vLLM's rule (a candidate ending in EOS completes a hypothesis
    and leaves the pool; the final ranking divides by the whole length ** length_penalty) transcribed
    over transformers' logprobs gives the same hypotheses, order, finish reasons and text."""
    path, model = hf
    rng = np.random.RandomState(1)
    prompt = rng.randint(3, 131, 7).tolist()
    width, steps = 3, 5
    # the EOS: a token beams reach early (the third-best second token of the best first one), so that
    # some hypotheses complete: the checkpoint's config names it
    first = int(np.argmax(_logprobs(model, [prompt])[0]))
    eos = int(np.argsort(-_logprobs(model, [prompt + [first]])[0])[2])
    folder = tmp_path / "model"
    shutil.copytree(path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    g = Generator.from_pretrained(folder, **KW)
    assert g.engine.eos_ids == (eos,)
    ref = _vllm_beam_search(model, prompt, width, steps, eos, False, length_penalty, include_stop)
    assert any(f == "stop" for _, _, f, _ in ref) and any(f == "length" for _, _, f, _ in ref)
    [out] = g.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=steps,
                                                     length_penalty=length_penalty,
                                                     include_stop_str_in_output=include_stop))
    assert [(s.token_ids, s.finish_reason) for s in out.samples] == [(t, f) for t, _, f, _ in ref]
    # each token's logprob (an EOS left out of the ids is left out of them too)
    np.testing.assert_allclose([sum(s.logprobs) for s in out.samples], [c - e for _, c, _, e in ref], atol=1e-4)
    assert all(len(s.logprobs) == len(s.token_ids) for s in out.samples)
    tok = g.tokenizer
    if tok is not None:   # the text never holds the EOS
        assert all(s.text == tok.decode([t for t in s.token_ids if t != eos]) for s in out.samples)


def test_bounds_are_refused_by_name(hf):
    path, _ = hf
    g = Generator.from_pretrained(path, **KW, warmup=False)
    with pytest.raises(ValueError, match="beam width"):
        BeamSearchParams(beam_width=11)
    with pytest.raises(ValueError, match="maximum context length"):
        g.beam_search([[5] * 60], BeamSearchParams(beam_width=2, max_tokens=8))
