"""What speculative decoding can gain on this machine at batch 1: bare XLA's cost of a forward over
T tokens against one, for the bundled model's shapes, and the speed-up that bounds.

    python -m bench.verify_floor [--model PATH] [--draft PATH] [--context 256]
        [--spec-results bench/results/DATE-cpu-speculative.json] [--out PATH]

Speculation pays because verifying k proposals costs one forward over 1 + k tokens, which on a
memory-bound accelerator costs about what one token does. Whether that holds here is measured, not
assumed: a bare jnp Llama-style decoder (random float32 weights of the model's shapes, fused qkv
and gate/up, a dense KV context of --context positions per layer, greedy argmax on device; no
paging, sampler or scheduler, as ../shared/tools/xla_decode_floor.py) runs one jitted forward over
T tokens, T = 1 .. 17 and the Medusa tree's size; each figure is the median of 7 timings of 50 calls.

The bound on a method's batch-1 speed-up with mean acceptance length A (tokens per round):
    n-gram   A * t(1) / t(1 + k)                              (the lookup costs ~nothing)
    draft    A * t(1) / (t(1 + k) + k * t_draft(1))           (k draft forwards of one token)
    Medusa   A * t(1) / t(1 + nodes)                          (the tree's nodes in one forward)
with A read from --spec-results (bench/speculative.py's batch-1 free and copy workloads; not json,
whose baseline also pays the grammar's host work per token). The bound is against the bare
one-token forward; the engine's none decodes slower than that (a one-row step padded to the
8-token bucket, bench/decode_bucket.py), so its own ratios over none can exceed the bound: compare
a method's tok/s with 1 / t(1) too. Writes bench/results/<date>-<device>-verify-floor.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_info, device_slug, model_config, model_path, results_path


def bare_forward(cfg, context: int, seed: int = 0):
    """-> (params, jitted fwd(params, tokens [T]) -> argmax ids [T]) for a model of cfg's shapes."""
    v, d, h, hkv, hd, f = cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8 * cfg.n_layers + 2))

    def w(*shape):
        return jax.random.normal(next(keys), shape, jnp.float32) * 0.05

    params = {"emb": w(v, d), "layers": [
        {"wqkv": w(d, (h + 2 * hkv) * hd), "wo": w(h * hd, d), "wgu": w(d, 2 * f), "wd": w(f, d),
         "kc": w(hkv, context, hd), "vc": w(hkv, context, hd)} for _ in range(cfg.n_layers)]}

    def rms(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)

    @jax.jit
    def fwd(params, toks):
        x = params["emb"][toks]                                                     # (T, D)
        t = toks.shape[0]
        for lp in params["layers"]:
            qkv = rms(x) @ lp["wqkv"]
            q = qkv[:, :h * hd].reshape(t, hkv, h // hkv, hd)
            p = jax.nn.softmax(jnp.einsum("tkgd,kld->tkgl", q, lp["kc"]) / hd ** 0.5, -1)
            x = x + jnp.einsum("tkgl,kld->tkgd", p, lp["vc"]).reshape(t, h * hd) @ lp["wo"]
            gu = rms(x) @ lp["wgu"]
            x = x + (jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ lp["wd"]
        return jnp.argmax(rms(x) @ params["emb"].T, -1).astype(jnp.int32)

    return params, fwd


def time_call(fwd, params, t: int, reps: int = 7, calls: int = 50) -> float:
    toks = jnp.arange(t, dtype=jnp.int32) + 5
    fwd(params, toks).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fwd(params, toks)
        out.block_until_ready()
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="checkpoints/jaxinfer-tiny-llama-draft")
    ap.add_argument("--medusa", default="checkpoints/jaxinfer-tiny-llama-medusa")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--spec-results", default=None, help="a bench/speculative.py JSON: its acceptance lengths")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    path = model_path(args.model)
    cfg = model_config(path)
    tree = json.loads((Path(args.medusa) / "medusa.json").read_text())["tree"]
    params, fwd = bare_forward(cfg, args.context)
    sizes = sorted({*range(1, 18), 1 + len(tree)})
    target = {t: time_call(fwd, params, t) for t in sizes}
    dparams, dfwd = bare_forward(model_config(Path(args.draft)), args.context, seed=1)
    draft1 = time_call(dfwd, dparams, 1)
    report = {"benchmark": "speculation's bound: bare XLA forward cost over T tokens", "date": time.strftime("%Y-%m-%d"),
              "time": time.strftime("%H:%M:%S"), "device": device_info(), "jax": jax.__version__, "model": str(path),
              "draft": args.draft, "config": vars(args),
              "target_ms": {t: 1e3 * v for t, v in target.items()},
              "target_ratio_vs_1": {t: v / target[1] for t, v in target.items()},
              "draft_1_token_ms": 1e3 * draft1, "bare_one_token_tok_s": 1 / target[1], "medusa_tree_tokens": 1 + len(tree)}
    k = args.k
    round_cost = {"ngram": target[1 + k] / target[1], "draft": (target[1 + k] + k * draft1) / target[1],
                  "medusa": target[1 + len(tree)] / target[1]}
    report["round_cost_vs_one_token"] = round_cost
    if args.spec_results:
        spec = json.loads(Path(args.spec_results).read_text())
        bounds = {}
        for wname, w in spec["workloads"].items():
            if w.get("batch") != 1 or wname == "json":   # json: none pays the grammar per token too
                continue
            for m, cost in round_cost.items():
                a = (w.get(m) or {}).get("mean_acceptance_length")
                if a:
                    bounds.setdefault(wname, {})[m] = {"mean_acceptance_length": a, "bound": a / cost,
                                                       "measured_ratio_vs_none": w[m]["ratio_vs_none"]}
        report["spec_results"] = args.spec_results
        report["bounds"] = bounds
    out = results_path(args.out, device_slug(report["device"]), "verify-floor")
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps({"ratio_vs_1": {t: round(v, 2) for t, v in report["target_ratio_vs_1"].items()},
                      "round_cost": {m: round(v, 2) for m, v in round_cost.items()},
                      "bounds": report.get("bounds")}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
