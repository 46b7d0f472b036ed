"""Worker for tests/test_lora.py (fake CPU devices): LoRA under tensor parallelism. argv[1]: a folder
with base/ (HF model), adapter folders and run.json {"adapters": [...], "prompt": [...], "tp": N}.
Prints RESULT {n_devices, logits: {adapter: [[...]]}, mixed: [[tokens]], alone: [[tokens]]}."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import jax

    from jaxinfer import Generator, SamplingParams
    root = Path(sys.argv[1])
    run = json.loads((root / "run.json").read_text())
    names = run["adapters"]
    gen = Generator.from_pretrained(root / "base", tensor_parallel=run["tp"], max_model_len=64,
                                    max_num_batched_tokens=8, max_num_seqs=4, block_size=8, num_blocks=24,
                                    lora_modules={n: str(root / n) for n in names}, max_loras=len(names),
                                    max_lora_rank=8)
    prompt = run["prompt"]
    logits = {n: gen.logits(prompt, lora=n).tolist() for n in names}
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    mixed = [o.token_ids for o in gen.generate([prompt] * (len(names) + 1), greedy, lora=[*names, None])]
    alone = [gen.generate([prompt], greedy, lora=n)[0].token_ids for n in [*names, None]]
    print("RESULT " + json.dumps({"n_devices": jax.device_count(), "logits": logits, "mixed": mixed,
                                  "alone": alone, "compilations": gen.stats()["compilations_after_warmup"]}))


if __name__ == "__main__":
    main()
