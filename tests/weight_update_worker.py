"""update_weights and sleep mode under tensor and pipeline parallelism, run by
tests/test_weight_update.py in a subprocess with 8 fake CPU devices (tests/fake_devices.py). Prints one
line `RESULT {json}`.

    python -m tests.weight_update_worker TMP_DIR     # TMP_DIR/a, TMP_DIR/b: two draws of one HF config
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = [[5, 9, 17, 3, 88, 41, 7, 120, 64, 2, 33, 19], [40, 2, 8]]
SETTINGS = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4, block_size=8,
                num_blocks=33, token_buckets=[32], warmup=False)


def main(tmp: Path) -> dict:
    """At TP 2 and at PP 2: A's greedy tokens, then B's after update_weights(B), again after
    sleep(1) / wake_up(), and A's after sleep(2) / wake_up() (read from the folder the engine started
    from); every weight's and page's sharding as before, and no step program compiled after the first run."""
    import jax

    from jaxinfer.config import SamplingParams
    from jaxinfer.generator import Generator

    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = {"n_devices": len(jax.devices())}
    for label, extra in (("tp2", dict(tensor_parallel=2)), ("pp2", dict(pipeline_parallel=2))):
        gen = Generator.from_pretrained(tmp / "a", **SETTINGS, **extra)
        runner = gen.engine.runner
        tokens = lambda: [o.token_ids for o in gen.generate(PROMPTS, sp)]  # noqa: E731
        specs = lambda: [str(x.sharding) for x in jax.tree.leaves((runner.params, runner.kv_pages))]  # noqa: E731
        step = runner.pipeline_step if label == "pp2" else runner.step
        run = {"a": tokens()}
        before, programs = specs(), step._cache_size()
        gen.update_weights(tmp / "b")
        run["b"] = tokens()
        gen.sleep(1)
        gen.wake_up()
        run["b_again"] = tokens()
        gen.sleep(2)
        gen.wake_up()
        run["a_again"] = tokens()
        run["same_shardings"] = specs() == before
        run["devices"] = len(jax.tree.leaves(runner.params)[0].sharding.device_set)
        run["programs"] = [programs, step._cache_size()]
        out[label] = run
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
