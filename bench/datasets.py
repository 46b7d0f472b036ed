"""Benchmark workloads: N (prompt token ids, max_tokens) pairs from a length distribution.

    fixed               every prompt input_len tokens, every output output_len tokens
    uniform             prompt / output lengths uniform (inclusive) in input_range / output_range
    sharegpt-synthetic  log-normal prompt and output lengths shaped like ShareGPT conversations
                        (medians SHAREGPT_PROMPT_MEDIAN / SHAREGPT_OUTPUT_MEDIAN tokens, long right
                        tails), at least 4 tokens each; pairs with prompt + output > max_model_len
                        are drawn again (vLLM's ShareGPT loader drops such pairs), so the shape is
                        the distribution conditioned on fitting the context rather than spikes at
                        the limit; only a context too short for that (< 1% of pairs fit) is clipped
    jsonl:PATH          one {"prompt": str | [ids], "max_tokens": int} per line, in file order

Prompt tokens are windows cut from the model folder's heldout.txt when it has one (and a
tokenizer), else random ids in [3, vocab). uniform and sharegpt-synthetic lengths are clipped so that
prompt + output <= max_model_len (sharegpt-synthetic: redrawn, see above); fixed lengths that do not
fit are an error. Never imports jax.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

# ShareGPT (vLLM's ShareGPT_V3 filtered set, Llama tokenizer) is long-tailed: most prompts are short
# questions, a few are pasted documents; answers are a few hundred tokens. A log-normal with these
# medians and shapes matches that: prompt mean ~ 1.6x median, output mean ~ 1.3x median.
SHAREGPT_PROMPT_MEDIAN, SHAREGPT_PROMPT_SIGMA = 150.0, 1.0
SHAREGPT_OUTPUT_MEDIAN, SHAREGPT_OUTPUT_SIGMA = 200.0, 0.7
MIN_SHAREGPT_LEN = 4

DATASETS = ("fixed", "uniform", "sharegpt-synthetic", "jsonl:PATH")


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int


def parse_range(text: str | Sequence[int]) -> tuple[int, int]:
    lo, hi = (int(x) for x in (text.split(",") if isinstance(text, str) else text))
    if not 1 <= lo <= hi:
        raise ValueError(f"a length range must be 'min,max' with 1 <= min <= max, got {text!r}")
    return lo, hi


def sample_lengths(kind: str, n: int, rng: np.random.RandomState, max_model_len: int, input_len: int = 128,
                   output_len: int = 128, input_range: tuple[int, int] = (16, 256),
                   output_range: tuple[int, int] = (16, 256)) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths (int arrays of n) for fixed | uniform | sharegpt-synthetic."""
    if kind == "fixed":
        if input_len + output_len > max_model_len:
            raise ValueError(f"--input-len {input_len} + --output-len {output_len} exceeds the context "
                             f"({max_model_len} tokens)")
        return np.full(n, input_len, np.int64), np.full(n, output_len, np.int64)
    if kind == "uniform":
        p = rng.randint(input_range[0], input_range[1] + 1, n)
        o = rng.randint(output_range[0], output_range[1] + 1, n)
        lo = 1
    elif kind == "sharegpt-synthetic":
        lo = MIN_SHAREGPT_LEN
        p, o = _sharegpt_pairs(n, rng, max_model_len)
    else:
        raise ValueError(f"unknown dataset {kind!r}; choose one of {DATASETS}")
    if max_model_len < 2 * lo:
        raise ValueError(f"the context ({max_model_len} tokens) is too short for this dataset")
    p = np.clip(p, lo, max_model_len - lo)
    o = np.clip(o, lo, max_model_len - p)
    return p.astype(np.int64), o.astype(np.int64)


def _sharegpt_pairs(n: int, rng: np.random.RandomState, max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
    def draw(m: int) -> tuple[np.ndarray, np.ndarray]:
        p = np.round(rng.lognormal(np.log(SHAREGPT_PROMPT_MEDIAN), SHAREGPT_PROMPT_SIGMA, m)).astype(np.int64)
        o = np.round(rng.lognormal(np.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_SIGMA, m)).astype(np.int64)
        return np.maximum(p, MIN_SHAREGPT_LEN), np.maximum(o, MIN_SHAREGPT_LEN)

    ps, os_, drawn = [], [], 0
    while sum(len(x) for x in ps) < n and drawn < 100 * max(n, 100):
        p, o = draw(4 * max(n, 100))
        drawn += len(p)
        keep = p + o <= max_model_len
        ps.append(p[keep])
        os_.append(o[keep])
    p, o = np.concatenate(ps)[:n], np.concatenate(os_)[:n]
    if len(p) < n:      # the context is too short to condition on: clip the rest (done by the caller)
        rest_p, rest_o = draw(n - len(p))
        p, o = np.concatenate([p, rest_p]), np.concatenate([o, rest_o])
    return p, o


def token_pool(tokenizer: Any, vocab_size: int, model_path: str | Path | None, rng: np.random.RandomState,
               min_len: int = 0, size: int = 200_000) -> tuple[list[int], str]:
    """Token ids to cut prompts from: the model's heldout.txt, else random ids. Returns (pool, source)."""
    heldout = Path(model_path) / "heldout.txt" if model_path is not None else None
    if tokenizer is not None and heldout is not None and heldout.exists():
        pool = tokenizer.encode(heldout.read_text(encoding="utf-8"), add_special_tokens=False)
        source = str(heldout)
    else:
        pool, source = [], "random ids"
    if not pool:
        pool = rng.randint(min(3, vocab_size - 1), vocab_size, size).tolist()
        source = "random ids"
    while len(pool) <= min_len:
        pool = pool + pool
    return pool, source


def cut_prompts(pool: list[int], lengths: Sequence[int], rng: np.random.RandomState) -> list[list[int]]:
    out = []
    for length in lengths:
        start = int(rng.randint(0, len(pool) - int(length) + 1))
        out.append(pool[start: start + int(length)])
    return out


def load_jsonl(path: str | Path, n: int | None, tokenizer: Any, max_model_len: int) -> tuple[list[BenchRequest], int]:
    """Requests from a JSONL file; returns (requests, number skipped as too long for the context)."""
    reqs, skipped = [], 0
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if n is not None and len(reqs) >= n:
            break
        try:
            item = json.loads(line)
            prompt, max_tokens = item["prompt"], int(item["max_tokens"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": str, \"max_tokens\": int}}: {e}") from None
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"{path}:{lineno}: a text prompt needs a model with a tokenizer")
            ids = tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids or len(ids) >= max_model_len or max_tokens < 1:
            skipped += 1
            continue
        reqs.append(BenchRequest(ids, min(max_tokens, max_model_len - len(ids))))
    if not reqs:
        raise ValueError(f"{path}: no usable requests")
    return reqs, skipped


def build_requests(dataset: str, n: int, *, tokenizer: Any, vocab_size: int, max_model_len: int,
                   model_path: str | Path | None = None, seed: int = 0, input_len: int = 128,
                   output_len: int = 128, input_range: tuple[int, int] = (16, 256),
                   output_range: tuple[int, int] = (16, 256)) -> tuple[list[BenchRequest], dict[str, Any]]:
    """The workload and a summary of it (for the results JSON)."""
    rng = np.random.RandomState(seed)
    info: dict[str, Any] = {"name": dataset, "seed": seed}
    if dataset.startswith("jsonl:"):
        reqs, skipped = load_jsonl(dataset[len("jsonl:"):], n, tokenizer, max_model_len)
        info |= {"source": dataset[len("jsonl:"):], "skipped": skipped}
    else:
        p, o = sample_lengths(dataset, n, rng, max_model_len, input_len, output_len, input_range, output_range)
        pool, source = token_pool(tokenizer, vocab_size, model_path, rng, int(p.max()))
        reqs = [BenchRequest(ids, int(m)) for ids, m in zip(cut_prompts(pool, p, rng), o)]
        info["source"] = source
        if dataset == "fixed":
            info |= {"input_len": input_len, "output_len": output_len}
        elif dataset == "uniform":
            info |= {"input_range": list(input_range), "output_range": list(output_range)}
    pl = np.array([len(r.prompt_ids) for r in reqs])
    ol = np.array([r.max_tokens for r in reqs])
    stats = lambda a: {"mean": float(a.mean()), "p50": float(np.median(a)), "min": int(a.min()),  # noqa: E731
                       "max": int(a.max())}
    info |= {"num_requests": len(reqs), "max_model_len": max_model_len,
             "prompt_tokens": stats(pl), "output_tokens": stats(ol)}
    return reqs, info
