"""Two rounds of requests that exercise prefix caching and n-gram speculation together, shared by the
family tests (tests/test_families.py: Gemma 2; tests/test_moe.py: Qwen3-MoE)."""
from __future__ import annotations

import numpy as np

from jaxinfer import Generator, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def two_round_prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two rounds: the second shares a 21-token prefix with the first (prefix caching) and repeats a
    pattern (n-gram proposals); lengths cross 8-token chunks (and Gemma 2's window of 6)."""
    rng = np.random.RandomState(3)
    prefix = rng.randint(3, vocab, 21).tolist()
    pattern = rng.randint(3, vocab, 5).tolist()
    first = [prefix + rng.randint(3, vocab, 4).tolist(), pattern * 4, rng.randint(3, vocab, 9).tolist()]
    second = [prefix + rng.randint(3, vocab, 7).tolist(), prefix + pattern * 2, list(first[1])]
    return first, second


def naive_greedy(gen: Generator, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens by repeated full forwards (gen.logits: no cache, no speculation)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(gen.logits(ids)[-1])))
    return ids[len(prompt):]


def serve_two_rounds(gen: Generator, want: dict) -> None:
    """Both rounds give `want`'s tokens ({"first": [...], "second": [...]}), the second reusing the
    shared whole blocks and keeping verified proposals; every block is free afterwards."""
    first, second = two_round_prompts(gen.model_cfg.vocab_size)
    assert [o.token_ids for o in gen.generate(first, GREEDY)] == want["first"]
    hits = gen.stats()["prefix_cache_hits"]
    assert [o.token_ids for o in gen.generate(second, GREEDY)] == want["second"]
    stats = gen.stats()
    assert stats["prefix_cache_hits"] - hits >= 16 + 16 + 16           # the shared whole blocks reused
    assert stats["spec_decode_num_accepted_tokens"] > 0                  # proposals were verified and kept
    assert stats["kv_blocks_used"] == 0
