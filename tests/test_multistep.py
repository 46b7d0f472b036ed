"""Multi-step decoding (several decode iterations per jitted call, step.py) and async scheduling
(step N+1 planned and dispatched before step N's tokens reach the host, engine.py) change nothing
a request sees: the same tokens, logprobs, text and finish reasons as one iteration per step,
each step's tokens on the host before the next is planned.

References: the same engine with max_decode_steps=1 (itself proven equal to naive full-forward
decoding and to HF transformers in test_engine.py / test_hf_parity.py), and hand-built stop
conditions on its output.
"""
from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import Generator, SamplingParams
from jaxinfer.host.block_manager import BlockManager
from jaxinfer.host.request import Request
from jaxinfer.host.scheduler import Scheduler, SchedulerConfig, StepSample
from tests.hf_models import save_text_model

# a 16-token budget: two token buckets (8, 16) per engine, each compiled once; prompts of up to 30
# tokens still prefill in chunks alongside decoding rows (a 32 bucket would only add a compilation).
# num_blocks: 8 sequences of 96 tokens (+ the null block; what CPU sizes by itself), so that on a GPU
# the engines alive at once (the module's reference and a test's own) do not each size a pool from
# the device's memory
SMALL = dict(dtype="float32", max_model_len=96, max_num_batched_tokens=16, token_buckets=[16], max_num_seqs=8,
             block_size=8, num_blocks=8 * 96 // 8 + 1, warmup=False)


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(3, vocab, rng.randint(3, 30)).tolist() for _ in range(n)]


def _run(gen: Generator, prompts, params):
    return [[(c.token_ids, c.finish_reason, c.text) for c in o.samples] for o in gen.generate(prompts, params)]


def _all_free(gen: Generator) -> bool:
    s = gen.stats()
    return s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


@pytest.fixture(scope="module")
def llama_one_iteration(hf_model_dir) -> Generator:
    """The llama reference engine (one iteration per step, synchronous), built and compiled once for
    the three tests that compare against it; its outputs depend on no earlier request."""
    return Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **SMALL, max_decode_steps=1,
                                     async_scheduling=False)


# qwen2-window's sliding window is mistral-window's case (test_hf_parity covers qwen2 itself)
@pytest.mark.parametrize("name", ["llama-gqa-llama3", "gpt2", "bloom-6heads-postnorm"])
def test_multistep_equals_one_iteration_per_step(name, hf_model_dir, request):
    one = request.getfixturevalue("llama_one_iteration") if name == "llama-gqa-llama3" else \
        Generator.from_pretrained(hf_model_dir(name), **SMALL, max_decode_steps=1, async_scheduling=False)
    many = Generator.from_pretrained(hf_model_dir(name), **SMALL, max_decode_steps=5, async_scheduling=True)
    vocab = one.model_cfg.vocab_size
    prompts = _prompts(4, vocab, seed=7)
    greedy = SamplingParams(max_tokens=23, temperature=0, ignore_eos=True)
    free = _run(one, prompts[:1], greedy)[0][0][0]
    params = [
        greedy,
        # seeded sampling with every processor: keys come from (seed, position), penalties from the
        # history the device loop extends
        SamplingParams(max_tokens=19, temperature=0.9, top_p=0.8, top_k=50, seed=11, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.3, logprobs=3, ignore_eos=True),
        # a stop id the greedy run draws at its 10th token: the row stops on device mid-step
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(free[9],), ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=1.0, seed=5, n=3, ignore_eos=True),
    ]
    a, b = _run(one, [prompts[0], prompts[1], prompts[0], prompts[3]], params), \
        _run(many, [prompts[0], prompts[1], prompts[0], prompts[3]], params)
    assert a == b
    assert a[2][0][1] == "stop" and a[2][0][0][-1] == free[9] and len(a[2][0][0]) <= 10
    lp_one = one.generate([prompts[1]], params[1])[0]
    lp_many = many.generate([prompts[1]], params[1])[0]
    np.testing.assert_allclose(lp_many.logprobs, lp_one.logprobs, rtol=0, atol=1e-5)
    assert [[t for t, _ in top] for top in lp_many.top_logprobs] == [[t for t, _ in top] for top in lp_one.top_logprobs]
    assert many.engine.scheduler.cfg.max_decode_steps == 5 and many.engine.async_scheduling
    assert _all_free(one) and _all_free(many)


@pytest.mark.parametrize("k, async_scheduling", [(1, True), (4, False)])
def test_async_scheduling_and_multistep_each_alone(k, async_scheduling, hf_model_dir, llama_one_iteration):
    ref = llama_one_iteration
    g = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **SMALL, max_decode_steps=k,
                                  async_scheduling=async_scheduling)
    prompts = _prompts(6, g.model_cfg.vocab_size, seed=4)
    params = [SamplingParams(max_tokens=int(m), temperature=t, seed=3, ignore_eos=True, n=n, logprobs=lp)
              for m, t, n, lp in zip((1, 7, 20, 13, 2, 25), (0, 0.8, 0, 1.0, 0.5, 0.7), (1, 1, 2, 1, 1, 3),
                                     (None, 2, None, None, 1, None))]
    assert _run(g, prompts, params) == _run(ref, prompts, params)
    # penalties read the host's history: the engine waits for the step in flight first, same tokens
    pen = SamplingParams(max_tokens=15, temperature=0.9, seed=8, repetition_penalty=1.5, presence_penalty=0.5)
    assert _run(g, prompts[:3], pen) == _run(ref, prompts[:3], pen)
    assert _all_free(g)


def test_multistep_under_preemption(hf_model_dir):
    # 12 usable blocks of 8 tokens for 6 requests growing to ~50 tokens: preemption is certain
    kw = {**SMALL, "num_blocks": 13, "max_num_seqs": 6}
    one = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **kw, max_decode_steps=1, async_scheduling=False)
    many = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **kw, max_decode_steps=6, async_scheduling=True)
    prompts = _prompts(6, one.model_cfg.vocab_size, seed=3)
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=2, ignore_eos=True)
    assert _run(one, prompts, params) == _run(many, prompts, params)
    assert many.stats()["num_preemptions"] > 0
    assert _all_free(one) and _all_free(many)


@pytest.fixture(scope="module")
def text_gens(tmp_path_factory):
    folder = save_text_model(tmp_path_factory.mktemp("sp-llama-multistep"))
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8, block_size=8,
              num_blocks=8 * 128 // 8 + 1, warmup=False)
    return (Generator.from_pretrained(folder, **kw, max_decode_steps=1, async_scheduling=False),
            Generator.from_pretrained(folder, **kw, max_decode_steps=6, async_scheduling=True))


def test_stop_strings_with_multistep(text_gens):
    one, many = text_gens
    free = one.generate("seven wizards", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].text
    stop = free[17:21]     # inside the text: the row is cut there, and what it drew after is discarded
    assert stop.strip()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
    a, b = one.generate("seven wizards", params)[0], many.generate("seven wizards", params)[0]
    assert a.text == b.text == free[:free.find(stop)] and a.finish_reason == b.finish_reason == "stop"
    assert a.token_ids == b.token_ids
    streamed = list(many.stream("seven wizards", params))
    assert "".join(d.text for d in streamed) == b.text
    assert [t for d in streamed for t in d.token_ids] == b.token_ids
    assert all(len(d.token_ids) <= 1 for d in streamed)      # one delta per token
    assert _all_free(many)


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(text_gens):
    # issue 14, defect 11: the stop string ends exactly at the max_tokens-th token
    for gen in text_gens:
        free = gen.generate("the lazy dog", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        text = free.text
        m = next(m for m in range(2, len(text)) if text.find(text[-m:]) == len(text) - m and text[-m:].strip())
        out = gen.generate("the lazy dog", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                          stop=(text[-m:],)))[0]
        assert out.finish_reason == "stop" and out.text == text[:-m] and out.token_ids == free.token_ids


def test_zero_compilations_after_warmup_with_multistep(hf_model_dir):
    g = Generator.from_pretrained(hf_model_dir("qwen2-window"), **{**SMALL, "warmup": True, "max_model_len": 64},
                                  max_decode_steps=4, async_scheduling=True)
    prompts = _prompts(5, g.model_cfg.vocab_size, seed=9)
    g.generate(prompts, [SamplingParams(max_tokens=int(m), temperature=t, seed=1, ignore_eos=True, logprobs=lp)
                         for m, t, lp in zip((3, 20, 9, 30, 14), (0, 0.7, 0, 1.0, 0.5), (None, 2, None, None, 5))])
    assert g.stats()["compilations_after_warmup"] == 0 and _all_free(g)


# ------------------------------------------------------------------ the scheduler alone (no model)

def _scheduler(k: int, num_blocks: int = 64, waiting_ok: bool = True):
    bm = BlockManager(num_blocks, 4)
    return Scheduler(SchedulerConfig(policy="continuous", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                     max_decode_steps=k), bm, eos_ids=(2,)), bm


def _req(rid: str, n_prompt: int, max_tokens: int) -> Request:
    return Request(rid, list(range(3, 3 + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0), seed=0)


def _feed(s: Scheduler, out, token: int = 7):
    return s.update(out, {q.request.request_id: [StepSample(token, 0.0)] * q.max_draws
                          for q in out.seqs if q.sample})


def test_scheduler_plans_several_iterations_only_when_every_row_decodes_and_none_waits():
    s, bm = _scheduler(4)
    s.add(_req("a", 5, 10))
    out = s.schedule()                          # prefill: one iteration
    assert out.num_decode_iters == 1 and out.seqs[0].num_tokens == 5
    _feed(s, out)
    out = s.schedule()                          # decode only, nobody waits: 4 iterations
    assert out.num_decode_iters == 4 and out.seqs[0].max_draws == 4
    assert len(bm.table("a")) == 3              # blocks for positions 5..8 (9 tokens of 4) up front
    _feed(s, out)
    assert s.requests["a"].num_computed_tokens == 9 and len(s.requests["a"].output_ids) == 5
    s.add(_req("b", 3, 4))
    out = s.schedule()                          # b waits for prefill: one iteration
    assert out.num_decode_iters == 1 and {q.num_tokens for q in out.seqs} == {1, 3}
    _feed(s, out)
    out = s.schedule()                          # a has 4 draws left, b 3: each row gets its own
    assert out.num_decode_iters == 4 and [q.max_draws for q in out.seqs] == [4, 3]
    _feed(s, out)
    assert not s.has_unfinished() and bm.num_used == 0


def test_scheduler_discards_what_follows_a_stop_and_falls_back_without_blocks():
    s, bm = _scheduler(4)
    req = _req("a", 4, 10)
    s.add(req)
    _feed(s, s.schedule())
    out = s.schedule()
    assert out.num_decode_iters == 4
    # the device drew 3 tokens, the 2nd of them EOS (2): the 3rd is discarded, never counted
    s.update(out, {"a": [StepSample(9, 0.0), StepSample(2, 0.0), StepSample(8, 0.0)]})
    assert req.output_ids == [7, 9, 2] and req.finish_reason == "stop" and req.num_inflight == 0
    assert not s.has_unfinished() and bm.num_used == 0
    # a pool too small for 4 draws up front (3 usable blocks of 4 tokens; 13 tokens would need 4):
    # one iteration, the normal path
    s, bm = _scheduler(4, num_blocks=4)
    s.add(_req("a", 9, 10))
    _feed(s, s.schedule())
    out = s.schedule()
    assert out.num_decode_iters == 1 and out.seqs[0].max_draws == 1


def test_scheduler_plans_the_next_step_while_tokens_are_in_flight():
    s, bm = _scheduler(1)
    req = _req("a", 5, 3)
    s.add(req)
    first = s.schedule()
    s.launched(first)                          # dispatched; its token is not on the host yet
    assert req.num_inflight == 1 and req.num_computed_tokens == 5 and req.num_tokens == 6
    second = s.schedule()                      # the in-flight token is the next step's input
    assert [(q.start, q.num_tokens, q.sample) for q in second.seqs] == [(5, 1, True)]
    s.launched(second)
    assert req.num_inflight == 2 and s.draws_left(req) == 1
    s.update(first, {"a": [StepSample(9, 0.0)]})
    assert req.output_ids == [9] and req.num_inflight == 1
    third = s.schedule()
    s.launched(third)
    assert s.draws_left(req) == 0 and not s.schedule().seqs    # nothing left to draw: not scheduled
    s.update(second, {"a": [StepSample(2, 0.0)]})             # EOS: the third step's token is discarded
    s.update(third, {"a": [StepSample(8, 0.0)]})
    assert req.output_ids == [9, 2] and req.finish_reason == "stop" and bm.num_used == 0
