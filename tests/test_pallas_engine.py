"""The engine with attention="pallas" (kernels interpreted on CPU, compiled on a GPU) gives the same
greedy tokens as with attention="xla", on the foundation's test models: GQA, sliding window, ALiBi,
MQA; and Medusa's tree verification (the tree mask in the ragged kernel) as with "xla" and as naive
greedy decoding."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxinfer import Generator, SamplingParams
from tests.precision import attention_rtol, rel_err
from tests.two_rounds import naive_greedy

pytestmark = pytest.mark.device

# an 8-token budget: one token bucket per engine to compile (the ragged kernel runs one query tile per
# step at T=8 as at T=16); the prompts below are still prefilled in chunks beside decoding rows.
# num_blocks: 4 sequences of 64 tokens (+ the null block), so that on a GPU the two engines alive at
# once do not each size a pool from the device's memory
KW = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=8, max_num_seqs=4, block_size=8,
          num_blocks=4 * 64 // 8 + 1, warmup=False)


@pytest.mark.parametrize("name", ["llama-gqa-llama3", "mistral-window", "qwen2-window", pytest.param(
    "bloom-6heads-postnorm", marks=pytest.mark.cpu_only("head_dim 8: the Triton kernels need a power of two >= 16"))])
def test_pallas_equals_xla_greedy(name, hf_model_dir):
    path = hf_model_dir(name)
    xla = Generator.from_pretrained(path, attention="xla", **KW)
    pallas = Generator.from_pretrained(path, attention="pallas", **KW)
    rng = np.random.RandomState(0)
    vocab = xla.model_cfg.vocab_size
    prompts = [rng.randint(3, vocab, n).tolist() for n in (21, 3, 11)]   # chunked prefill + decode mixed
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in pallas.generate(prompts, params)] == [o.token_ids for o in xla.generate(prompts, params)]
    ids = rng.randint(3, vocab, 37).tolist()
    a, b = pallas.logits(ids), xla.logits(ids)                            # flash attention, dense path
    # each layer's attention differs by at most attention_rtol between the two paths (float32)
    mc = xla.model_cfg
    assert rel_err(a, b) < mc.n_layers * attention_rtol("float32", keys=len(ids), head_dim=mc.head_dim)


BUNDLED = Path(__file__).resolve().parents[1] / "checkpoints" / "jaxinfer-tiny-llama"


def test_medusa_pallas_equals_xla_and_naive_greedy():
    """Medusa (the bundled model and heads) with the tree mask in the Pallas ragged kernel: the same
    greedy tokens as with attention="xla" and as naive greedy decoding (repeated full forwards, no
    cache, no speculation), two rows verifying trees at once and several rounds per step; the heads'
    proposals are accepted, so nodes' logits (each under its own path's mask) decide tokens."""
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=16, token_buckets=[16], max_num_seqs=2,
              block_size=16, num_blocks=2 * 128 // 16 + 1, speculative_method="medusa", speculative_max_batch=2,
              warmup=False)
    pallas = Generator.from_pretrained(str(BUNDLED), attention="pallas", **kw)
    assert pallas.engine.runner.settings.attention == "pallas"
    drawn, update = [], pallas.engine.scheduler.update

    def spy(plan, samples, **kw):   # the most tokens one row drew in each step
        drawn.append(max(map(len, samples.values()), default=0))
        return update(plan, samples, **kw)
    pallas.engine.scheduler.update = spy
    xla = Generator.from_pretrained(str(BUNDLED), attention="xla", **kw)
    ids = xla.tokenizer.encode((BUNDLED / "heldout.txt").read_text(), add_special_tokens=False)
    prompts = [ids[100:120], ids[2000:2013]]
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in pallas.generate(prompts, params)]
    assert got == [o.token_ids for o in xla.generate(prompts, params)]
    assert got == [naive_greedy(xla, p, 14) for p in prompts]
    assert pallas.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    # some step ran several rounds on the device (the tree mask moved with them): a row drew more
    # than 1 + the tree's depth (3) tokens
    assert max(drawn) > 1 + 3
