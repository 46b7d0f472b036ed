"""Speculative decoding: each method against none, same run, the bundled model.

    python -m bench.speculative [--model PATH] [--reps 5] [--k 4] [--batch-sizes 16,64]
        [--methods draft,ngram,medusa,medusa-chain] [--out PATH]

Generators (all warmed up, alive together, measured interleaved):
  none    the engine's defaults (multi-step decoding 8, async scheduling);
  draft   the bundled draft (checkpoints/jaxinfer-tiny-llama-draft), k proposals per step;
  ngram   prompt lookup, k proposals per step;
  medusa  the bundled Medusa heads (checkpoints/jaxinfer-tiny-llama-medusa) with their tree, k deep;
  medusa-chain  the same heads with a single chain (each head's top token): what the tree adds;
  medusa-tree:N the same heads with the tree of N nodes medusa.choose_tree picks from their
                validation rank accuracies (the bundled tree has 7: with its root, one row fills
                the engine's smallest step bucket of 8 tokens).
Workloads:
  free      batch 1, greedy, a held-out prompt (--prompt-len tokens), --output-len tokens: decode tok/s
            = (output tokens - 1) / (time from the first token to the last), so prefill is excluded;
  copy      batch 1, a copy-heavy prompt: a held-out passage (--passage-len tokens), then its first
            16 tokens again, so that a model which copies from its context repeats the passage; the
            JSON's copy_check says whether none's answers did (the bundled 7M-parameter model does
            not: its answers follow the passage for 0 to 3 tokens, and prompt lookup's hits there
            come from the answers repeating themselves);
  json      batch 1, structured output: the answer must match the JSON schema {"quote": string} and
            the prompt holds a held-out passage as {"quote":"..."} twice, so the constrained answer
            tends to repeat it (speculation under a grammar: host/structured.py); each output runs
            until the grammar closes or --output-len tokens;
  load      --batch-sizes: that many requests at once (free prompts), output tok/s over the run, with
            the load policy on (speculation off above speculative_max_batch) and, for the crossover,
            forced on (speculative_max_batch = the batch); one method at a time beside the same
            "none" engine (the "none" figure: its runs beside the last method); each new engine
            first runs another prompt set of the same size, unmeasured (its one-time costs, which
            "none" paid earlier), then --load-reps paired reps in alternating order.
Each figure is the median over --reps prompts (different prompts per rep, the same for every method);
ratios are per rep (same prompt, back to back), then the median. Beside every speed-up: the mean
acceptance length (1 + accepted / drafts, vLLM's definition) over that workload.
Results: bench/results/<date>-<device>-speculative.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import prefix_cache
from bench.common import device_info, device_slug, model_path, results_path, write_report


def _spec_counts(gen) -> tuple[int, int]:
    st = gen.client.stats()
    return st.get("spec_decode_num_drafts") or 0, st.get("spec_decode_num_accepted_tokens") or 0


def run(gen, prompts: list[list[int]], output_len: int, params=None) -> dict:
    from jaxinfer import SamplingParams
    d0, a0 = _spec_counts(gen)
    r = prefix_cache.run_batch(gen, prompts, output_len, params or SamplingParams(max_tokens=output_len, temperature=0.0,
                                                                                  ignore_eos=True))
    d1, a1 = _spec_counts(gen)
    decode_s = r["wall_s"] - min(r["ttfts"])
    return {"wall_s": r["wall_s"], "output_tokens": r["output_tokens"], "steps": r["steps"],
            "decode_tok_s": (r["output_tokens"] - len(prompts)) / decode_s, "output_tok_s": r["output_tokens"] / r["wall_s"],
            "drafts": d1 - d0, "accepted": a1 - a0, "outputs": r["outputs"]}


def summarise(runs: dict[str, list[dict]], key: str) -> dict:
    """Per method: median figure, median paired ratio to none, mean acceptance length, and whether
    every output matched none's (greedy: it must)."""
    out = {}
    for m, rs in runs.items():
        vals = [r[key] for r in rs]
        drafts, acc = sum(r["drafts"] for r in rs), sum(r["accepted"] for r in rs)
        out[m] = {key: float(np.median(vals)), "all": vals,
                  "ratio_vs_none": float(np.median([r[key] / b[key] for r, b in zip(rs, runs["none"])])),
                  "mean_acceptance_length": 1 + acc / drafts if drafts else None,
                  "same_outputs_as_none": all(r["outputs"] == b["outputs"] for r, b in zip(rs, runs["none"]))}
    return out


def copy_check(prompts: list[list[int]], outputs: list[list[int]], continuations: list[list[int]], n: int = 4) -> dict:
    """Whether the copy workload's answers do copy: per prompt, how many leading output tokens equal
    the passage's continuation, and the share of output tokens that complete an n-gram (n - 1
    tokens of context, then the token) which occurs in the prompt: what prompt lookup can find there."""
    follow, share = [], []
    for p, out, cont in zip(prompts, outputs, continuations):
        m = next((i for i, (a, b) in enumerate(zip(out, cont)) if a != b), min(len(out), len(cont)))
        grams = {tuple(p[i: i + n]) for i in range(len(p) - n + 1)}
        seq = list(p) + list(out)
        hits = sum(tuple(seq[len(p) + j - n + 1: len(p) + j + 1]) in grams for j in range(len(out)))
        follow.append(m)
        share.append(hits / max(len(out), 1))
    return {"tokens_following_the_passage": follow, f"share_of_output_{n}grams_in_prompt": share}


def _heads_with_tree(method: str, k: int) -> str:
    """A copy of the bundled Medusa heads with another tree: "medusa-chain", one chain of each
    head's top token, k deep; "medusa-tree:N", the N-node tree medusa.choose_tree picks."""
    from jaxinfer.generator import CHECKPOINTS, DEFAULT_MEDUSA
    from jaxinfer.spec_decode.medusa import choose_tree
    src, out = CHECKPOINTS / DEFAULT_MEDUSA, Path(tempfile.mkdtemp(prefix="medusa-tree-"))
    shutil.copy(src / "heads.safetensors", out)
    info = json.loads((src / "medusa.json").read_text())
    if method == "medusa-chain":
        info["tree"] = [[0] * d for d in range(1, k + 1)]
    else:
        tree = choose_tree(np.asarray(info["validation_rank_accuracy"]), int(method.split(":")[1]))
        info["tree"] = [list(p) for p in tree.paths]
    (out / "medusa.json").write_text(json.dumps(info))
    return str(out)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--passage-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--load-reps", type=int, default=4, help="paired reps per batch size under load")
    ap.add_argument("--load-output-len", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=128)
    ap.add_argument("--methods", default="draft,ngram,medusa,medusa-chain")
    ap.add_argument("--workloads", default="free,copy,json", help="batch-1 workloads (load: --batch-sizes)")
    ap.add_argument("--out", default=None)
    return ap


def _generators(path: Path, methods: list[str], k: int, engine: dict) -> dict:
    """"none" and one warmed-up Generator per method (medusa-chain / medusa-tree:N: the bundled
    heads with another tree), all alive together."""
    from jaxinfer import Generator
    gens = {"none": Generator.from_pretrained(str(path), **engine)}
    for m in methods:
        kw = dict(speculative_method=m, num_speculative_tokens=k)
        if m == "medusa-chain" or m.startswith("medusa-tree:"):
            kw = dict(speculative_method="medusa", speculative_model=_heads_with_tree(m, k),
                      num_speculative_tokens=k)
        gens[m] = Generator.from_pretrained(str(path), **engine, **kw)
    return gens


def _batch1_prompts(args, tokenizer, ids: list[int], starts: np.ndarray) -> tuple[dict, list[list[int]]]:
    """The batch-1 workloads' prompts -> ({"free" | "copy" | "json": (prompts, params)}, the copy
    prompts' continuations of their passages)."""
    from jaxinfer import SamplingParams, StructuredOutputs
    free = [ids[s: s + args.prompt_len] for s in starts[: args.reps]]
    copy, copy_continuations = [], []
    for s in starts[args.reps: 2 * args.reps]:
        passage = ids[s: s + args.passage_len]
        copy.append(passage + ids[s + args.passage_len: s + args.passage_len + 8] + passage[:16])
        copy_continuations.append(passage[16:])
    json_prompts = []
    for s in starts[len(starts) - args.reps:]:            # past what the load workloads read
        words = tokenizer.decode(ids[s: s + args.passage_len]).replace("\n", " ").replace('"', "'")
        record = json.dumps({"quote": " ".join(words.split())}, separators=(",", ":"), ensure_ascii=False)
        json_prompts.append(tokenizer.encode(f"{record}\n{record}\n", add_special_tokens=False))
    json_params = SamplingParams(max_tokens=args.output_len, temperature=0.0, structured_outputs=StructuredOutputs(
        json=json.dumps({"type": "object", "properties": {"quote": {"type": "string"}}, "required": ["quote"],
                         "additionalProperties": False})))
    return {"free": (free, None), "copy": (copy, None), "json": (json_prompts, json_params)}, copy_continuations


def _run_batch1(args, gens: dict, workloads: dict, copy_continuations: list[list[int]], report: dict) -> None:
    """Each batch-1 workload, every method on the same prompt back to back, into report["workloads"]."""
    for name in [w for w in args.workloads.split(",") if w]:
        prompts, params = workloads[name]
        runs = {m: [] for m in gens}
        for p in prompts:
            for m, g in gens.items():
                runs[m].append(run(g, [p], args.output_len, params))
        report["workloads"][name] = {"batch": 1, **summarise(runs, "decode_tok_s")}
        if name == "copy":   # none's greedy answers: do they repeat the passage?
            report["workloads"][name]["copy_check"] = copy_check(prompts, [r["outputs"][0] for r in runs["none"]],
                                                                 copy_continuations)
            print("copy check", report["workloads"][name]["copy_check"], flush=True)
        print(name, {m: (round(v["decode_tok_s"], 1), round(v["ratio_vs_none"], 2), v["mean_acceptance_length"])
                     for m, v in report["workloads"][name].items() if m in gens}, flush=True)


def _run_load(args, none, path: Path, engine: dict, methods: list[str], batch_sizes: list[int],
              load_prompts: dict, warm_prompts: dict) -> dict:
    """load: one method at a time (its engine under the default policy and one forced on), beside the
    same "none" engine, so that few engines live at once: each engine's XLA:CPU programs map about
    1,100 memory regions apiece, and the kernel allows a process 65,530 (vm.max_map_count).
    -> {batch: {method: {"none" | method | "forced": [run, ...]}}}"""
    from jaxinfer import Generator
    runs = {b: {} for b in batch_sizes}
    for m in [m for m in methods if m in ("draft", "ngram", "medusa") and batch_sizes]:
        none.reset_prefix_cache()   # every engine meets each prompt set first in the same rep
        spec = dict(speculative_method=m, num_speculative_tokens=args.k)
        engines = {m: Generator.from_pretrained(str(path), **engine, **spec),
                   "forced": Generator.from_pretrained(str(path), **engine, **spec,
                                                       speculative_max_batch=engine["max_num_seqs"])}
        for b in batch_sizes:
            for g in engines.values():   # unmeasured: the new engines' one-time costs, as "none" paid before
                run(g, warm_prompts[b], args.load_output_len)
            order = [("none", none), *engines.items()]
            for rep in range(args.load_reps):
                # alternate the order rep by rep, so that a drift of the machine's speed within a
                # rep favours no engine
                for name, g in (order if rep % 2 == 0 else order[::-1]):
                    runs[b].setdefault(m, {}).setdefault(name, []).append(run(g, load_prompts[b], args.load_output_len))
        del engines
        gc.collect()
    return runs


def _load_point(runs: dict) -> dict:
    """One batch size's load runs -> per method: its summary (and none's) with the forced-on figures."""
    point = {}
    for m, r in runs.items():
        point["none"] = summarise({"none": r["none"]}, "output_tok_s")["none"]
        point[m] = summarise({"none": r["none"], m: r[m]}, "output_tok_s")[m]
        drafts, acc = sum(x["drafts"] for x in r["forced"]), sum(x["accepted"] for x in r["forced"])
        point[m]["forced_on"] = {"output_tok_s": float(np.median([x["output_tok_s"] for x in r["forced"]])),
                                 "ratio_vs_none": float(np.median([x["output_tok_s"] / n["output_tok_s"]
                                                                   for x, n in zip(r["forced"], r["none"])])),
                                 "mean_acceptance_length": 1 + acc / drafts if drafts else None}
    return point


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    path = model_path(args.model)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    engine = dict(max_num_seqs=max([1, *batch_sizes]), max_num_batched_tokens=args.max_num_batched_tokens)
    gens = _generators(path, methods, args.k, engine)
    tokenizer = gens["none"].tokenizer
    ids = tokenizer.encode((path / "heldout.txt").read_text(), add_special_tokens=False)
    rng = np.random.RandomState(0)
    starts = rng.randint(0, len(ids) - 2 * args.passage_len, 4 * args.reps + 2 * sum(batch_sizes))
    workloads, copy_continuations = _batch1_prompts(args, tokenizer, ids, starts)
    report = {"benchmark": "speculative decoding", "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
              "device": device_info(), "model": str(path), "config": vars(args), "workloads": {}}
    _run_batch1(args, gens, workloads, copy_continuations, report)

    offset = 2 * args.reps
    load_prompts, warm_prompts = {}, {}
    for b in batch_sizes:
        load_prompts[b] = [ids[s: s + args.prompt_len] for s in starts[offset: offset + b]]
        offset += b
    for b in batch_sizes:             # other prompts of the same sizes: a new engine's first run
        warm_prompts[b] = [ids[s: s + args.prompt_len] for s in starts[offset: offset + b]]
        offset += b
    for m in [m for m in gens if m != "none"]:
        del gens[m]
    gc.collect()
    runs = _run_load(args, gens["none"], path, engine, methods, batch_sizes, load_prompts, warm_prompts)
    for b in batch_sizes:
        point = _load_point(runs[b])
        report["workloads"][f"load-{b}"] = {"batch": b, **point}
        print(f"load {b}", {m: (round(v["output_tok_s"], 1), round(v["ratio_vs_none"], 2),
                                v.get("forced_on", {}).get("ratio_vs_none"))
                            for m, v in point.items()}, flush=True)
    for w in report["workloads"].values():
        for v in w.values():
            if isinstance(v, dict):
                v.pop("outputs", None)
    out = results_path(args.out, device_slug(report["device"]), "speculative")
    write_report(report, out, "", "", plot=False)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
