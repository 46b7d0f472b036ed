"""The engine with attention="pallas" (kernels interpreted on CPU) gives the same greedy tokens as
with attention="xla", on the foundation's test models: GQA, sliding window, ALiBi, MQA."""
from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import Generator, SamplingParams

# an 8-token budget: one token bucket per engine to compile (the ragged kernel runs one query tile per
# step at T=8 as at T=16); the prompts below are still prefilled in chunks beside decoding rows
KW = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=8, max_num_seqs=4, block_size=8,
          warmup=False)


@pytest.mark.parametrize("name", ["llama-gqa-llama3", "mistral-window", "bloom-6heads-postnorm",
                                  "qwen2-window"])
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
    assert np.abs(a - b).max() / np.abs(b).max() < 1e-5
