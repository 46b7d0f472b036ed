"""New weights and sleep mode on the bundled model (or another), same run.

    python -m bench.weight_update [--model PATH] [--reps 5] [--out PATH]

Figures, medians over --reps on a warmed-up Generator (from_pretrained's defaults): update_weights
from the model's own folder (read, fused, checked, copied leaf by leaf), sleep(1) + wake_up(),
sleep(2) + wake_up() (the folder read again); the device bytes sleep(1) frees (jax's live arrays
before and after) against the weights' and the KV pool's bytes; the greedy tokens of one prompt
after all of it against before, and the step programs compiled after warm-up (0: nothing recompiled).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: the bundled model)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()

    import jax

    from jaxinfer import Generator, SamplingParams
    from jaxinfer.generator import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    gen = Generator.from_pretrained(path)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] if gen.tokenizer is None else "And God said"
    before = gen.generate([prompt], greedy)[0].token_ids
    live = lambda: sum(x.nbytes for x in jax.live_arrays())  # noqa: E731
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(gen.client.served_params()))
    kv_bytes = gen.client.debug.kv_pool_bytes()

    def timed(fn) -> float:
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    update_s = timed(lambda: gen.update_weights(path))
    held = live()
    gen.sleep(1)
    freed = held - live()
    gen.wake_up()
    sleep1_s = timed(lambda: (gen.sleep(1), gen.wake_up()))
    sleep2_s = timed(lambda: (gen.sleep(2), gen.wake_up()))
    after = gen.generate([prompt], greedy)[0].token_ids
    out = {"model": str(path), "backend": jax.default_backend(), "reps": args.reps,
           "update_weights_s": update_s, "sleep1_wake_s": sleep1_s, "sleep2_wake_s": sleep2_s,
           "weight_bytes": weight_bytes, "kv_pool_bytes": kv_bytes, "sleep1_freed_bytes": freed,
           "same_tokens": after == before, "compilations_after_warmup": gen.stats()["compilations_after_warmup"]}
    print(json.dumps(out, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
