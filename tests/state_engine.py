"""The check that a model whose layers keep a state per sequence (LFM2's conv layers, Qwen3-Next's and
Qwen3.5's Gated DeltaNet layers, Granite 4.0-H's, Bamba's and Nemotron-H's Mamba-2 layers) carries it
through the paged engine, against transformers' own model (tests/test_lfm2.py, tests/test_qwen3_next.py,
tests/test_granite_hybrid.py, tests/test_nemotron_h.py)."""
from __future__ import annotations

import numpy as np

TOKENS = 12
ENGINE = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=16, token_buckets=[16], block_size=8,
              warmup=False)


def hf_greedy(hf, prompt: list[int], n: int = TOKENS) -> list[int]:
    """n greedy tokens by full forwards of transformers' model (no cache: nothing of ours)."""
    import torch
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def served(hf, folder, prompt_lens: tuple[int, ...], seed: int):
    """transformers' model `hf` saved to `folder` and served by a float32 Generator (16-token chunks, two
    rows) -> (the Generator, prompts of prompt_lens tokens, transformers' logits of the first)."""
    import torch

    from jaxinfer import Generator
    hf.save_pretrained(folder)
    prompts = [np.random.RandomState(seed).randint(3, 100, n).tolist() for n in prompt_lens]
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]])).logits[0].numpy()
    gen = Generator.from_pretrained(folder, dtype="float32", max_model_len=64, max_num_seqs=2, block_size=8,
                                    num_blocks=17, max_num_batched_tokens=16, warmup=False)
    return gen, prompts, ref


def check_state_engine(folder, hf, prompts: list[list[int]], want: list[list[int]], model=None) -> None:
    """Five prompts of 5 to 45 tokens, prefilled in 16-token chunks beside other rows' decode tokens,
    through two state slots (max_num_seqs 2: each finished request's slot is taken by the next) and a
    pool of 8 blocks, too small for two sequences (preempted, then recomputed from position 0):
    every continuation is transformers' greedy one (`want`). Each of n = 2 greedy samples of the third
    prompt computes its own prompt (no fork: a shared block holds no state) and gives it too. Then,
    teacher-forced, the 45-token prompt's logprobs (three chunks, each reading the state the previous
    one left) are transformers' log-softmax to float32 rounding relative to the logits' magnitude.
    model: an already loaded (and altered) model to serve instead of the folder's."""
    import torch

    from jaxinfer import Generator, SamplingParams
    if model is None:
        gen = Generator.from_pretrained(folder, max_num_seqs=2, num_blocks=9, **ENGINE)
    else:
        from jaxinfer.config import EngineConfig
        cfg = EngineConfig(max_num_seqs=2, num_blocks=9, **{k: tuple(v) if isinstance(v, list) else v
                                                             for k, v in ENGINE.items() if k != "warmup"})
        gen = Generator(model, None, cfg, warmup=False)
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in gen.generate(prompts, greedy)] == want
    stats = gen.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0
    assert not gen.engine.resolved.enable_prefix_caching and not gen.engine.blocks.state_of
    two = gen.generate([prompts[2]], SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, n=2))[0]
    assert [s.token_ids for s in two.samples] == [want[2], want[2]]
    ids = prompts[1]
    out = gen.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    ref = torch.log_softmax(logits, -1).numpy()
    got = np.array([e[0] for e in out.prompt_logprobs[1:]])
    assert np.abs(got - [ref[p, ids[p + 1]] for p in range(len(ids) - 1)]).max() <= 1e-5 * float(logits.abs().max())
