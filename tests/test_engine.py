"""The paged continuous-batching engine against naive decoding and against itself in isolation.

References: greedy decoding by repeated full forwards (`gen.logits`, already proven equal to
HF transformers), numpy log-softmax, and the same request run alone.
"""
from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from jaxinfer import Generator, SamplingParams

# a 16-token budget: two token buckets (8, 16) to compile per engine; prompts of up to 100 tokens are
# still prefilled in chunks beside decoding rows (a 32 bucket would only add a compilation per engine).
# num_blocks: 16 sequences of 128 tokens (+ the null block; what CPU sizes by itself), so that on a GPU
# an engine built while the module's `gen` is alive does not find the device's memory taken by its pool
SMALL = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=16, block_size=8,
             num_blocks=16 * 128 // 8 + 1)
# the engines a test builds beside `gen`: one step program (the budget) instead of two. `gen` and the
# warm-up test keep the default buckets (8, 16), so batch invariance is checked across two programs
ONE_BUCKET = dict(SMALL, token_buckets=[16])


@pytest.fixture(scope="module")
def gen(hf_model_dir) -> Generator:
    return Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **SMALL)


def _prompts(n: int, vocab: int, lo: int = 3, hi: int = 60, seed: int = 0) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(3, vocab, rng.randint(lo, hi)).tolist() for _ in range(n)]


def naive_greedy(gen: Generator, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(gen.logits(ids)[-1])))
    return ids[len(prompt):]


def _all_free(gen: Generator) -> bool:
    s = gen.stats()
    return s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


@pytest.mark.parametrize("name", ["llama-gqa-llama3", "mistral-window", "qwen2-window", "gpt2", "bloom-6heads-postnorm"])
def test_paged_engine_equals_naive_decoding(name, hf_model_dir):
    # an 8-token budget: one step shape per family; prompts of 5-40 tokens are prefilled in chunks
    # beside decoding rows
    g = Generator.from_pretrained(hf_model_dir(name), **{**SMALL, "max_num_batched_tokens": 8}, warmup=False)
    prompts = _prompts(3, g.model_cfg.vocab_size, 5, 40, seed=1)
    outs = g.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == naive_greedy(g, p, 20)
    assert _all_free(g)


def test_greedy_output_independent_of_batch(gen):
    prompts = _prompts(16, gen.model_cfg.vocab_size, 2, 90, seed=2)
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True)
              for m in np.random.RandomState(3).randint(1, 30, 16)]
    batched = gen.generate(prompts, params)
    for i in (0, 5, 11):
        alone = gen.generate([prompts[i]], params[i])[0]
        assert alone.token_ids == batched[i].token_ids
    assert batched[5].token_ids == naive_greedy(gen, prompts[5], params[5].max_tokens)


def test_top_k_minus_one_is_off_and_a_numpy_prompt_is_one_prompt(gen):
    """vLLM's top_k=-1 means off, as 0 does (its clients send it); -2 is refused. A 1-D numpy array of
    token ids is one prompt, as the same list is (its truth value raised)."""
    from jaxinfer.config import SamplingParamsError
    assert SamplingParams(top_k=-1).top_k == 0
    with pytest.raises(SamplingParamsError, match="top_k must be an integer >= 0"):
        SamplingParams(top_k=-2)
    prompt = _prompts(1, gen.model_cfg.vocab_size, 5, 20, seed=9)[0]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (out,) = gen.generate(np.asarray(prompt, np.int32), sp)
    assert out.token_ids == gen.generate([prompt], sp)[0].token_ids == naive_greedy(gen, prompt, 4)


def test_every_sample_is_measured_when_the_prompt_forks_at_once(gen):
    """n=3 of a 3-token prompt (within its first block of 8: the samples fork when it is added) and of
    a 20-token one: the client measures and releases 3 samples either way (the short prompt's
    forks were never listed: the server's request metrics counted one sample)."""
    sp = SamplingParams(max_tokens=3, temperature=0.8, seed=1, n=3, ignore_eos=True)
    for prompt in (_prompts(1, gen.model_cfg.vocab_size, 3, 4, seed=4)[0],
                   _prompts(1, gen.model_cfg.vocab_size, 20, 21, seed=5)[0]):
        [rid] = gen.client.submit([prompt], sp)
        assert [m.sample_index for m in gen.client.metrics(rid)] == [0, 1, 2], len(prompt)
        gen.client.run_until_done()
        done = gen.client.release(rid, abort=False)
        assert [m.sample_index for m in done] == [0, 1, 2] and all(m.finished for m in done), len(prompt)
    assert _all_free(gen)


def test_seeded_sampling_independent_of_batch(gen):
    prompts = _prompts(16, gen.model_cfg.vocab_size, 2, 90, seed=4)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=40, seed=100 + i, ignore_eos=True)
              for i in range(16)]
    batched = gen.generate(prompts, params)
    for i in (0, 7, 15):
        assert gen.generate([prompts[i]], params[i])[0].token_ids == batched[i].token_ids
    assert len({tuple(o.token_ids) for o in batched}) > 1


def test_seeds_that_differ_above_bit_31_draw_their_own_streams(gen):
    """Seeds are integers in [0, 2**63): s, s + 2**32 and s + 2**62 are three seeds and draw three
    streams (the sampler's keys once took the low 32 bits, and all three gave one output); a seed
    below 2**32 keeps its stream."""
    from jaxinfer.runner import key_seed
    prompt = _prompts(1, gen.model_cfg.vocab_size, 12, 13, seed=9)[0]
    outs = [gen.generate([prompt], SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True))[0].token_ids
            for s in (7, 7 + 2**32, 7 + 2**62)]
    assert len({tuple(o) for o in outs}) == 3
    assert key_seed(7) == 7 and len({key_seed(7 + 2**32), key_seed(7 + 2**62), 7}) == 3


def test_tiny_temperatures_run_at_vllms_floor_with_finite_logprobs(gen):
    """0 < temperature < 0.01 runs at 0.01 (vLLM clamps it there: logits / 1e-10 overflow float32),
    so the logprobs are finite and equal those of temperature 0.01; 0 stays greedy."""
    assert SamplingParams(temperature=1e-10).temperature == 0.01 and SamplingParams(temperature=0).temperature == 0
    prompt = _prompts(1, gen.model_cfg.vocab_size, 12, 13, seed=10)[0]
    tiny, floor = (gen.generate([prompt], SamplingParams(max_tokens=8, temperature=t, seed=3, logprobs=2,
                                                         ignore_eos=True))[0] for t in (1e-10, 0.01))
    assert tiny.token_ids == floor.token_ids and np.all(np.isfinite(tiny.logprobs))
    assert tiny.logprobs == floor.logprobs


def test_stop_token_ids_outside_the_vocabulary_are_refused_by_name(gen):
    """A stop id past int32 killed the engine (an OverflowError building the step's arrays: the
    server's every later request got 503); past the vocabulary it could never match. Both are
    refused by name before anything runs; None means none, as in vLLM."""
    from jaxinfer.config.sampling import SamplingParamsError
    from jaxinfer.engine import RequestError
    for bad in ([2**70], [-1]):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(stop_token_ids=bad)
        assert e.value.fields == ("stop_token_ids",)
    with pytest.raises(RequestError) as e:
        gen.engine.add_request([1, 5, 6], SamplingParams(stop_token_ids=[gen.model_cfg.vocab_size]))
    assert e.value.param == "stop_token_ids" and not gen.engine.has_unfinished()
    assert SamplingParams(stop=None, stop_token_ids=None).stop == SamplingParams().stop_token_ids == ()
    assert len(gen.generate([[1, 5, 6]], SamplingParams(max_tokens=3, temperature=0))[0].token_ids) == 3


def test_preemption_gives_identical_outputs(hf_model_dir, gen):
    # 12 blocks of 8 tokens for 12 requests that each need up to 9 blocks: heavy preemption. The
    # context is what the pool holds (96 tokens: a pool must hold one sequence of max_model_len); the
    # longest request is 59 + 16 tokens
    tight = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"),
                                      **{**ONE_BUCKET, "num_blocks": 13, "max_model_len": 12 * 8})
    prompts = _prompts(12, tight.model_cfg.vocab_size, 20, 60, seed=5)
    params = [SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(12)]
    ample = gen.generate(prompts, params)
    squeezed = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in ample]
    assert _all_free(tight)


def test_blocks_free_after_finish_and_abort(gen):
    eng = gen.engine
    prompts = _prompts(6, gen.model_cfg.vocab_size, 50, 100, seed=6)
    rids = [eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
    eng.step()                        # budget 16: the first request is mid-prefill
    assert gen.stats()["kv_blocks_used"] > 0
    eng.abort(rids[0])                # mid-prefill
    eng.abort(rids[5])                # still waiting
    for _ in range(8):
        eng.step()
    eng.abort(rids[1])                # running
    while eng.has_unfinished():
        eng.step()
    assert _all_free(gen)
    # a stream abandoned by its consumer aborts its request
    for i, _ in enumerate(gen.stream(prompts[2], SamplingParams(max_tokens=50, ignore_eos=True))):
        if i == 3:
            break
    assert _all_free(gen)


def test_a_samples_id_is_never_a_live_requests_id(gen):
    """Request "x" with n=2 names its second sample "x#1": a live request of that id, or a waiting
    request's sample not yet forked, makes the other request's id taken (one scheduler entry and
    one block table per id; sharing one wedged the engine)."""
    eng = gen.engine
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.add_request([5, 6, 7], sp, request_id="x#1")
    with pytest.raises(ValueError, match=r"'x' is already in use \(by a sample of another request: 'x#1'\)"):
        eng.add_request([8, 9, 10], SamplingParams(max_tokens=4, ignore_eos=True, n=2), request_id="x")
    eng.add_request([8, 9, 10], SamplingParams(max_tokens=4, ignore_eos=True, n=2), request_id="y")
    with pytest.raises(ValueError, match=r"'y#1' is already in use"):
        eng.add_request([5, 6, 7], sp, request_id="y#1")       # y's second sample, not forked yet
    while eng.has_unfinished():
        eng.step()
    assert _all_free(gen)
    eng.add_request([8, 9, 10], SamplingParams(max_tokens=2, ignore_eos=True, n=2), request_id="x")   # free now
    while eng.has_unfinished():
        eng.step()
    assert _all_free(gen)


def test_no_compilation_after_warmup_over_200_requests(hf_model_dir):
    gen = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **SMALL)    # fresh: nothing served yet
    rng = np.random.RandomState(7)
    vocab = gen.model_cfg.vocab_size
    prompts = [rng.randint(3, vocab, rng.randint(1, 100)).tolist() for _ in range(200)]
    params = [SamplingParams(max_tokens=int(rng.randint(1, 28)), temperature=float(rng.choice([0, 0.7])),
                             top_k=int(rng.choice([0, 5])), repetition_penalty=float(rng.choice([1.0, 1.2])),
                             logprobs=int(rng.choice([0, 3])), seed=i, ignore_eos=True) for i in range(200)]
    outs = gen.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert gen.stats()["compilations_after_warmup"] == 0
    assert _all_free(gen)


def test_logprobs_are_log_softmax_of_the_model(gen):
    prompt = _prompts(1, gen.model_cfg.vocab_size, 10, 11, seed=8)[0]
    out = gen.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=5, ignore_eos=True))[0]
    ids = list(prompt)
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        row = gen.logits(ids)[-1].astype(np.float64)
        ref = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert lp == pytest.approx(ref[tok], abs=1e-4)
        assert [t for t, _ in top] == np.argsort(-ref)[:5].tolist()
        np.testing.assert_allclose([v for _, v in top], np.sort(ref)[::-1][:5], atol=1e-4)
        ids.append(tok)


def _log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    m = np.max(row[np.isfinite(row)])
    return row - m - np.log(np.sum(np.exp(row - m)))


def test_logprobs_mode_raw_and_processed(gen, hf_model_dir):
    """vLLM's --logprobs-mode on sampled rows (temperature 0.7, top-k 4, a repetition penalty):
    raw_logprobs (the default) reports log_softmax of the model's logits (gen.logits of the prefix);
    processed_logprobs the distribution drawn from, by hand: CTRL penalty over prompt and output, /T,
    the top 4 kept and renormalised (the others -inf); processed_logits and raw_logits the logits
    themselves. float32 forwards: ~1e-5 of logits of O(1-10)."""
    prompt = _prompts(1, gen.model_cfg.vocab_size, 10, 11, seed=8)[0]
    params = SamplingParams(max_tokens=5, temperature=0.7, top_k=4, repetition_penalty=1.4, seed=2, logprobs=5,
                            ignore_eos=True)

    def by_hand(ids: list[int], mode: str) -> np.ndarray:
        row = gen.logits(ids)[-1].astype(np.float64)
        if mode.startswith("raw"):
            return _log_softmax(row) if mode == "raw_logprobs" else row
        seen = list(set(ids))
        row[seen] = np.where(row[seen] > 0, row[seen] / 1.4, row[seen] * 1.4)
        row = row / 0.7
        row = np.where(row >= np.sort(row)[-4], row, -np.inf)
        return _log_softmax(row) if mode == "processed_logprobs" else row

    out = gen.generate([prompt], params)[0]
    for mode in ("raw_logprobs", "processed_logprobs", "processed_logits", "raw_logits"):
        if mode != "raw_logprobs":
            g = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **ONE_BUCKET, logprobs_mode=mode,
                                          warmup=False)
            out = g.generate([prompt], params)[0]
            g.close()
        ids = list(prompt)
        for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
            ref = by_hand(ids, mode)
            assert np.isfinite(ref[tok]) and lp == pytest.approx(ref[tok], abs=1e-4), mode
            k = min(5, int(np.isfinite(ref).sum()))
            assert [t for t, _ in top][:k] == np.argsort(-ref)[:k].tolist(), mode
            np.testing.assert_allclose([v for _, v in top][:k], np.sort(ref)[::-1][:k], atol=1e-4, err_msg=mode)
            ids.append(tok)


def test_n_samples_share_prompt_and_first_equals_n1(gen):
    prompt = _prompts(1, gen.model_cfg.vocab_size, 37, 38, seed=9)[0]
    p1 = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    single = gen.generate([prompt], p1)[0]
    multi = gen.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=4, ignore_eos=True))[0]
    assert len(multi.samples) == 4
    assert multi.samples[0].token_ids == single.token_ids   # key depends on (seed, sample index, position)
    assert len({tuple(s.token_ids) for s in multi.samples}) > 1
    greedy = gen.generate([prompt], SamplingParams(max_tokens=8, temperature=0, n=3, ignore_eos=True))[0]
    assert all(s.token_ids == naive_greedy(gen, prompt, 8) for s in greedy.samples)
    assert _all_free(gen)


def test_stop_token_ids_and_max_tokens(gen):
    prompt = _prompts(1, gen.model_cfg.vocab_size, 12, 13, seed=10)[0]
    free = naive_greedy(gen, prompt, 15)
    stop_tok = free[6]
    out = gen.generate([prompt], SamplingParams(max_tokens=15, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == free[: free.index(stop_tok) + 1]
    assert out.finish_reason == "stop"


def test_threads_share_the_engine(gen):
    prompts = _prompts(8, gen.model_cfg.vocab_size, 5, 50, seed=11)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in gen.generate(prompts, params)]
    results: dict[int, list[int]] = {}

    def worker(i):
        results[i] = gen.generate([prompts[i]], params)[0].token_ids
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results[i] for i in range(8)] == expected
    assert _all_free(gen)


def test_prompt_too_long_is_rejected_with_the_excess(gen):
    with pytest.raises(ValueError, match="130 tokens.*context is 128.*3 tokens too long"):
        gen.generate([[5] * 130])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate([[5, 10**6]])
    assert _all_free(gen)


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_static_and_dynamic_policies_give_the_same_tokens(policy, hf_model_dir, gen):
    g = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **{**ONE_BUCKET, "max_num_seqs": 4,
                                                                       "num_blocks": 4 * 128 // 8 + 1},
                                  batching=policy, warmup=False)
    prompts = _prompts(7, g.model_cfg.vocab_size, 5, 40, seed=12)
    params = SamplingParams(max_tokens=9, temperature=0.7, seed=3, ignore_eos=True)
    assert [o.token_ids for o in g.generate(prompts, params)] == [o.token_ids for o in gen.generate(prompts, params)]
    assert _all_free(g)


def test_live_mbu_is_bytes_read_over_step_time(gen, monkeypatch):
    from jaxinfer.plan import Device

    gen.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng = gen.engine
    monkeypatch.setattr(eng, "device_spec", Device("test", "test", 0, 1e9, 0.0, 0.0, 0.0))
    st = gen.stats()
    # the last step ran 2 decode iterations on device (multi-step) with 3 + 1 and 3 + 2 tokens of
    # context: per iteration it read the weights once (but the untied token table, of which its one
    # token gathers a row: jaxinfer.perf's cost model) and (4 + 5) / 2 tokens of KV on average
    mc = gen.model_cfg
    assert (st["embedding_table_bytes"], st["embedding_row_bytes"]) == (4 * mc.vocab_size * mc.d_model, 4 * mc.d_model)
    step_bytes = (st["weight_bytes"] - st["embedding_table_bytes"] + st["embedding_row_bytes"]
                  + (4 + 5) / 2 * eng.runner.kv_bytes_per_token)
    assert eng.stats_.bandwidth[-1] == pytest.approx(step_bytes / eng.stats_.step_times[-1])
    assert st["mbu"] == pytest.approx(st["achieved_bandwidth_bytes_per_s"] / 1e9)
    assert eng.runner.kv_bytes_per_token == 2 * 4 * gen.model_cfg.n_layers * gen.model_cfg.n_kv_heads * gen.model_cfg.head_dim


@pytest.mark.device
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_scaled_kv_cache_close_to_float(hf_model_dir, gen, kv_dtype):
    """int8 / fp8 KV (per token per head scales): the first token unchanged, logprobs close."""
    q = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **ONE_BUCKET, kv_dtype=kv_dtype, warmup=False)
    assert q.engine.runner.kv_pages[0].k.dtype == {"int8": np.int8, "fp8": ml_dtypes.float8_e4m3fn}[kv_dtype]
    prompts = _prompts(4, gen.model_cfg.vocab_size, 10, 40, seed=13)
    p = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    ref, got = gen.generate(prompts, p), q.generate(prompts, p)
    first = [a.token_ids[0] == b.token_ids[0] for a, b in zip(ref, got)]
    assert all(first)                              # the first step reads only what it just wrote
    lp_ref, lp_got = np.array(ref[0].logprobs[:3]), np.array(got[0].logprobs[:3])
    assert np.abs(lp_ref - lp_got).max() < 0.05
    assert _all_free(q)


@pytest.mark.device
def test_quantized_weights_generate(hf_model_dir):
    for method in ("int8", "int4"):
        g = Generator.from_pretrained(hf_model_dir("qwen2-tied"), **ONE_BUCKET, quantize=method, warmup=False)
        out = g.generate([[5, 9, 33, 2, 41]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
        assert out.token_ids == naive_greedy(g, [5, 9, 33, 2, 41], 10)  # paged path == full forward, quantized


# four 20-token prompts under a 128-token budget: the token-bucket tests' engine
BUCKETED_MODEL = "llama-gqa-llama3"
BUCKETED = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=128, max_num_seqs=4, block_size=8,
                num_blocks=4 * 64 // 8 + 1)


def _assert_hf_greedy(name: str, prompts: list[list[int]], outs, n: int) -> None:
    """Every output's n greedy tokens are HF transformers' own generate's for its prompt."""
    import torch

    from tests.hf_models import build_hf_model
    hf = build_hf_model(name)
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
            assert o.token_ids == ref


def test_token_buckets_compile_only_those_sizes_and_keep_hf_greedy_tokens(hf_model_dir):
    """token_buckets=[32] under a 128-token budget: the runner compiles the steps of 32 and 128 tokens
    (the budget is always one) and nothing else, warm-up included; four 20-token prompts (80 tokens:
    the 128 step) then their decode (4 tokens: the 32 step) give HF transformers' greedy tokens."""
    g = Generator.from_pretrained(hf_model_dir(BUCKETED_MODEL), **BUCKETED, token_buckets=[32])
    runner = g.engine.runner
    assert runner.token_buckets == [32, 128] and g.engine.scheduler.cfg.token_buckets == (32, 128)
    assert runner.step._cache_size() == 2            # one program per token bucket (one block bucket: XLA)
    rng = np.random.RandomState(5)
    prompts = [rng.randint(3, 131, 20).tolist() for _ in range(4)]
    outs = g.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert runner.step._cache_size() == 2 and g.engine.stats()["compilations_after_warmup"] == 0
    _assert_hf_greedy(BUCKETED_MODEL, prompts, outs, 6)


def test_padding_aware_cut_keeps_hf_greedy_tokens(hf_model_dir):
    """Four 20-token prompts under a 128-token budget on CPU: the ridge is the host-CPU assumption's,
    1 TFLOP/s over 50 GB/s times 4 bytes a float32 parameter over 2 = 40 tokens, so the 80-token
    step (padded to 128) is cut to 64 (the newest row keeps 4 tokens) and its 16 left follow in the
    next step. Every request's greedy tokens are still HF transformers' own."""
    g = Generator.from_pretrained(hf_model_dir(BUCKETED_MODEL), **BUCKETED, warmup=False)
    assert g.engine.scheduler.cfg.compute_bound_tokens == pytest.approx(1e12 / 50e9 * 4 / 2, rel=1e-3)
    plans = []
    schedule = g.engine.scheduler.schedule

    def spy():
        out = schedule()
        plans.append([seq.num_tokens for seq in out.seqs])
        return out
    g.engine.scheduler.schedule = spy
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, 131, 20).tolist() for _ in range(4)]
    outs = g.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert plans[0] == [20, 20, 20, 4] and plans[1] == [1, 1, 1, 16]
    _assert_hf_greedy(BUCKETED_MODEL, prompts, outs, 6)
