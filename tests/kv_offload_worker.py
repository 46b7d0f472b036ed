"""The prefix cache's host tier under tensor parallelism, run by tests/test_kv_offload.py in a
subprocess with 8 fake CPU devices (tests/fake_devices.py). Prints one line `RESULT {json}`.

    python -m tests.kv_offload_worker TMP_DIR     # TMP_DIR/vocab136/: tests/sharding_worker.save_llama
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def turns(gen, convs: int = 3, rounds: int = 3) -> list:
    """Multi-turn rounds (tests/test_kv_offload._multiturn's shape): a shared 16-token system prompt,
    each conversation's history and a new 5-token message, one request at a time."""
    import numpy as np

    from jaxinfer.config import SamplingParams

    rng = np.random.RandomState(0)
    system = rng.randint(3, 136, 16).tolist()
    history = [list(system) for _ in range(convs)]
    out = []
    for _ in range(rounds):
        for c in range(convs):
            prompt = history[c] + rng.randint(3, 136, 5).tolist()
            o = gen.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
            out.append([o.token_ids, o.num_cached_tokens])
            history[c] = prompt + o.token_ids
    return out


def _part_rows(held, group) -> list:
    """A held block's row of each part of a group: a replicated group keeps one array per part; a
    split one keeps the gathered [parts, row bytes] array, whose shard on each part's device is that
    part's row."""
    if isinstance(held, list):
        return held
    return [next(s.data for s in held.addressable_shards if s.device == p.devices[0]) for p in group.parts]


def main(tmp: Path) -> dict:
    """TP 2 (the 2 KV heads split, one per device) with the draft model (the target itself, its pages
    replicated) and the tier on, against the one-device engine with neither: the same greedy tokens;
    blocks restored; the target's leaves kept as one pinned host row per device shard (1 head each: a
    row holds that device's half of every target leaf's block) and the draft's once; nothing compiled when the workload runs again."""
    import jax

    from jaxinfer.generator import Generator
    from jaxinfer.runner import CompileCounter

    folder = tmp / "vocab136"
    kw = dict(dtype="float32", attention="xla", max_num_seqs=2, block_size=8, num_blocks=9, max_model_len=64,
              max_num_batched_tokens=16, token_buckets=[16], max_decode_steps=2, warmup=False)
    ref = Generator.from_pretrained(folder, **kw)
    out = {"n_devices": len(jax.devices()), "ref": turns(ref)}
    ref.close()
    gen = Generator.from_pretrained(folder, **kw, tensor_parallel=2, speculative_method="draft",
                                    speculative_model=folder, num_speculative_tokens=2, speculative_max_batch=2,
                                    kv_offload_gb=1 / 1024)
    out["tier"] = turns(gen)
    gen.reset_prefix_cache()
    c0 = CompileCounter.count
    out["tier_again"] = turns(gen)
    out["compiles_again"] = CompileCounter.count - c0
    s = gen.stats()
    out["stats"] = {k: v for k, v in s.items() if k.startswith("kv_host") or k.startswith("spec_decode_num")}
    store = gen.engine.runner.host_kv
    target, draft = gen.engine.runner.kv_pages
    n_target = len(jax.tree.leaves(target))
    block_bytes = lambda leaves: sum(x.nbytes // x.shape[1] for x in leaves)   # noqa: E731
    out["block_bytes"] = [block_bytes(jax.tree.leaves(target)), block_bytes(jax.tree.leaves(draft))]
    # per group of leaves: whose leaves, and per part (a distinct device shard) of a block the tier
    # holds: how many devices hold that shard, the bytes of its host row, that row's memory kind and
    # whether it is on the part's first device
    held = [r for r in store.rows if r is not None]
    out["slots_held"] = [len(held), store.num_slots]
    out["groups"] = [{"draft": min(g.leaves) >= n_target, "target": max(g.leaves) < n_target,
                      "parts": [[len(p.devices), row.nbytes, row.sharding.memory_kind, row.devices() == {p.devices[0]}]
                                for p, row in zip(g.parts, _part_rows(held[0][gi], g))]}
                     for gi, g in enumerate(store.groups)]
    gen.engine.blocks.host.check()
    out["kv_blocks_used"] = s["kv_blocks_used"]
    gen.close()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
