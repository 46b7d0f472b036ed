"""Multi-LoRA serving: many adapters mixed in one batch against the base model alone, same run.

    python -m bench.lora [--model PATH] [--requests 16] [--adapters 4] [--rank 16] [--reps 5]
        [--prompt-len 64] [--output-len 64] [--out PATH]

Adapters: --adapters PEFT LoRA adapters over the model's shape (rank --rank, every linear layer:
q, k, v, o, gate, up, down; PEFT's target_modules="all-linear"), made here with PEFT from seeded
random A and B and saved as PEFT saves them (adapter_config.json + adapter_model.safetensors).
Generators (warmed up, alive together, measured interleaved, every other setting at its default):
  base   no adapters: the engine with no LoRA work in its step;
  lora   --adapters adapters in as many slots (max_loras), max_lora_rank --rank.
Workloads, each --requests requests submitted at once (greedy, --output-len tokens each, ignore_eos,
seeded random prompts of --prompt-len tokens, different prompts per rep, the same for every workload):
  base       the base engine;
  mixed      the LoRA engine, request i with adapter i mod --adapters (every step mixes them all);
  lora_base  the LoRA engine with no adapter on any request (what carrying LoRA costs the base).
Output tok/s = output tokens / wall time of the whole batch; per rep the three run back to back (order
rotated each rep), ratios are per rep against base, then the median.
Results: bench/results/<date>-<device>-lora.json.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import device_info, device_slug, model_config, model_path, results_path, vars_of, write_report


def make_adapters(cfg, folder: Path, count: int, rank: int, seed: int = 0) -> dict[str, str]:
    """count PEFT adapters for a model of ModelConfig cfg (Llama-style), rank `rank`, all linear layers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
                     num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                     num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                     tie_word_embeddings=cfg.tie_embeddings)
    paths = {}
    for i in range(count):
        torch.manual_seed(seed + i)
        model = get_peft_model(LlamaForCausalLM(hf), LoraConfig(r=rank, lora_alpha=2 * rank,
                                                                target_modules="all-linear"))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.02)
        name = f"adapter{i}"
        model.save_pretrained(folder / name)
        paths[name] = str(folder / name)
    return paths


def run(gen, prompts: list[list[int]], output_len: int, lora) -> dict:
    from jaxinfer import SamplingParams
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = gen.generate(prompts, params, lora=lora)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--requests", dest="num_requests", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from jaxinfer import Generator
    path = model_path(args.model)
    cfg = model_config(path)
    info = device_info()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(cfg, Path(tmp), args.adapters, args.rank)
        base = Generator.from_pretrained(path)
        lora = Generator.from_pretrained(path, lora_modules=adapters, max_loras=args.adapters, max_lora_rank=args.rank)
    names = list(adapters)
    mixed = [names[i % len(names)] for i in range(args.num_requests)]
    workloads = {"base": (base, None), "mixed": (lora, mixed), "lora_base": (lora, None)}
    rng = np.random.RandomState(0)
    warm = [rng.randint(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.num_requests)]
    for gen, names_ in workloads.values():   # one unmeasured batch each: first-use costs
        run(gen, warm, 8, names_)
    order = list(workloads)
    runs: dict[str, list[dict]] = {k: [] for k in workloads}
    for rep in range(args.reps):
        prompts = [rng.randint(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.num_requests)]
        for k in order[rep % len(order):] + order[:rep % len(order)]:
            gen, names_ = workloads[k]
            runs[k].append(run(gen, prompts, args.output_len, names_))
    med = {k: float(np.median([r["tok_s"] for r in v])) for k, v in runs.items()}
    ratios = {k: float(np.median([r["tok_s"] / b["tok_s"] for r, b in zip(runs[k], runs["base"])]))
              for k in ("mixed", "lora_base")}
    compilations = {"base": base.stats()["compilations_after_warmup"],
                    "lora": lora.stats()["compilations_after_warmup"]}
    report = {"bench": "lora", "device": info, "config": vars_of(args), "median_tok_s": med,
              "ratio_vs_base": ratios, "compilations_after_warmup": compilations, "runs": runs,
              "points": [{"label": k, "x": args.num_requests, "y": v} for k, v in med.items()]}
    out = results_path(args.out, device_slug(info), "lora")
    write_report(report, out, "label", "LoRA: output tok/s", plot=False)
    print(f"output tok/s (median of {args.reps}): " + ", ".join(f"{k} {v:.0f}" for k, v in med.items()))
    print("ratio to base: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()) + f"  -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
