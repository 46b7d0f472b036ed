"""Weight layout and fused projections for XLA:CPU's skinny matmuls.

    python bench/weight_layout.py [--rounds 15] [--out bench/results/2026-11-22-cpu-weight-layout.json]

Two questions (issue 13, "the step, rebuilt"):

1. Layout. A decode step multiplies M = 1..64 activation rows by every weight. Is XLA:CPU faster
   with weights stored [in, out] (today: x @ W) or [out, in] (x contracted with W's last axis, as
   torch.nn.Linear stores them)? Measured per projection kind and for a whole layer's matmuls, for
   the bundled model's shapes (checkpoints/jaxinfer-tiny-llama: d 256, 4 heads x 64, 2 KV heads,
   ffn 704, vocab 4096 tied) and a 30M Llama (d 512, 8 layers, 8 heads x 64, 4 KV heads, ffn 1408,
   vocab 8000 tied: 27.7M parameters), float32, with separate q/k/v/gate/up and with them fused.
   Each program runs the kind's matmul for all n_layers (distinct weights, as a step reads them), so
   the per-call dispatch is amortised the way a step amortises it.
2. Fusion end to end: the jitted Decoder.__call__ on 8 tokens without a cache (the bundled model),
   unfused against models.decoder.fuse_decoder, in the same run.

Variants are timed in interleaved rounds (every variant once per round, the order rotating), and
each figure is the median over rounds of the median of the calls in a round, so load from other
processes on a shared host hits every variant alike.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import device_info, device_slug, results_path  # noqa: E402

SHAPES = {
    "tiny-llama (bundled)": dict(d=256, heads=4, kv_heads=2, head_dim=64, ffn=704, vocab=4096, layers=8),
    "llama-30M": dict(d=512, heads=8, kv_heads=4, head_dim=64, ffn=1408, vocab=8000, layers=8),
}
ROWS = (1, 8, 64)


def projections(s: dict, fused: bool) -> dict[str, tuple[int, int]]:
    """kind -> (in, out) of one layer's matmuls (and the LM head)."""
    d, q, kv, f = s["d"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["ffn"]
    attn = {"qkv": (d, q + 2 * kv)} if fused else {"q": (d, q), "k": (d, kv), "v": (d, kv)}
    mlp = {"gate_up": (d, 2 * f)} if fused else {"gate": (d, f), "up": (d, f)}
    return {**attn, "o": (q, d), **mlp, "down": (f, d)}


def _matmul(x, w, layout: str):
    if layout == "in_out":        # w [in, out]
        return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))   # w [out, in]


def _weights(key, n_layers: int, k: int, n: int, layout: str) -> list:
    """One array per layer, as the model holds them. (Not one stacked [L, ...] array: XLA:CPU
    fuses the slice w[l] into the dot and runs that fusion 10-250x slower than the plain dot.)"""
    shape = (k, n) if layout == "in_out" else (n, k)
    return [0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) for i in range(n_layers)]


def kind_program(layout: str):
    """x [M, K], w: L weights -> sum over layers of x @ w[l] (L matmuls in one program)."""
    def f(x, w):
        out = _matmul(x, w[0], layout)
        for layer in range(1, len(w)):
            out = out + _matmul(x, w[layer], layout)
        return out
    return jax.jit(f)


def layer_program(layout: str, kinds: list[str]):
    """One layer's matmuls in sequence, as the model chains them, for all layers (attention and
    norms left out: only the matmuls and the elementwise glue between them)."""
    def f(x, ws):
        for layer in range(len(ws[kinds[0]])):
            mm = lambda name, a: _matmul(a, ws[name][layer], layout)  # noqa: E731
            if "qkv" in ws:
                a = mm("qkv", x)
                q = a[:, :ws["o"][0].shape[0 if layout == "in_out" else 1]]
                q = q + a[:, q.shape[1]:].sum(-1, keepdims=True)
            else:
                q = mm("q", x) + mm("k", x).sum(-1, keepdims=True) + mm("v", x).sum(-1, keepdims=True)
            x = x + mm("o", q)
            if "gate_up" in ws:
                g = mm("gate_up", x)
                half = g.shape[1] // 2
                h = jax.nn.silu(g[:, :half]) * g[:, half:]
            else:
                h = jax.nn.silu(mm("gate", x)) * mm("up", x)
            x = x + mm("down", h)
        return x
    return jax.jit(f)


def timed(fn, args, calls: int) -> list[float]:
    """Seconds of each of `calls` calls (each blocking)."""
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return ts


def interleaved(variants: dict[str, tuple], rounds: int, calls: int, with_min: bool = False) -> dict:
    """name -> median call time over all rounds (microseconds), or (median, min) with with_min;
    every variant compiled and warmed first."""
    for fn, args in variants.values():
        jax.block_until_ready(fn(*args))
    names = list(variants)
    per: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            per[n] += timed(*variants[n], calls)
    med = {n: 1e6 * statistics.median(v) for n, v in per.items()}
    return {n: (med[n], 1e6 * min(per[n])) for n in names} if with_min else med


def bench_layout(rounds: int, calls: int) -> dict:
    out = {}
    key = jax.random.key(0)
    for model, s in SHAPES.items():
        res = out[model] = {"shape": s, "kinds": {}, "layer_matmuls": {}}
        kinds = {**projections(s, False), **projections(s, True), "lm_head": (s["d"], s["vocab"])}
        for m in ROWS:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, s["d"]), jnp.float32)
            for kind, (k, n) in kinds.items():
                layers = 1 if kind == "lm_head" else s["layers"]
                xk = x if k == s["d"] else jax.random.normal(key, (m, k), jnp.float32)
                variants = {lay: (kind_program(lay), (xk, _weights(key, layers, k, n, lay)))
                            for lay in ("in_out", "out_in")}
                t = interleaved(variants, rounds, calls)
                res["kinds"].setdefault(kind, {})[f"M={m}"] = {"in_out_us": t["in_out"], "out_in_us": t["out_in"],
                                                               "out_in_speedup": t["in_out"] / t["out_in"],
                                                               "in": k, "out": n, "layers": layers}
            variants = {}
            for fused in (False, True):
                pk = projections(s, fused)
                for lay in ("in_out", "out_in"):
                    ws = {name: _weights(jax.random.fold_in(key, i), s["layers"], k, n, lay)
                          for i, (name, (k, n)) in enumerate(pk.items())}
                    variants[f"{'fused' if fused else 'unfused'}/{lay}"] = (layer_program(lay, list(pk)), (x, ws))
            res["layer_matmuls"][f"M={m}"] = {n: round(v, 1) for n, v in interleaved(variants, rounds, calls).items()}
            print(model, f"M={m}", res["layer_matmuls"][f"M={m}"], flush=True)
    return out


def bench_forward(rounds: int, tokens: int = 8) -> dict:
    """The bundled model's jitted no-cache forward, unfused and fused, in two regimes: calls
    alternating between the two (each call finds the other model's weights in the caches: cold) and
    blocks of 10 calls (the model's 27 MB of weights mostly stay in the 32 MB L3: warm)."""
    from flax import nnx

    from jaxinfer.generator import default_model_path
    from jaxinfer.models.decoder import fuse_decoder
    from jaxinfer.weights import load_model

    model, cfg = load_model(default_model_path(), "float32")
    toks = jnp.asarray(np.random.RandomState(0).randint(3, cfg.vocab_size, tokens), jnp.int32)
    pos = jnp.arange(tokens, dtype=jnp.int32)
    variants, logits, ops = {}, {}, {}
    for name, m in (("unfused", model), ("fused", fuse_decoder(model))):
        graphdef, params = nnx.split(m)
        fn = jax.jit(lambda p, t, q, g=graphdef: nnx.merge(g, p)(t, q)[0])
        variants[name] = (fn, (params, toks, pos))
        logits[name] = np.asarray(fn(params, toks, pos))
        hlo = fn.lower(params, toks, pos).compile().as_text()
        entry = hlo.split("ENTRY")[1]   # the thunks the step runs: one per top-level instruction
        ops[name] = {"entry_instructions": entry.count(" = "), "dots": hlo.count(" dot("),
                     "fusions": entry.count(" fusion(")}
    out = {"model": str(default_model_path().name), "tokens": tokens, "hlo": ops,
           "logits_max_rel_diff": float(np.max(np.abs(logits["fused"] - logits["unfused"])) /
                                        np.max(np.abs(logits["unfused"])))}
    for regime, calls, n_rounds in (("alternating", 1, 10 * rounds), ("blocks_of_10", 10, rounds)):
        t = interleaved(variants, n_rounds, calls, with_min=True)
        out[regime] = {"median_us": {n: v[0] for n, v in t.items()}, "min_us": {n: v[1] for n, v in t.items()},
                       "fused_speedup_median": t["unfused"][0] / t["fused"][0],
                       "fused_speedup_min": t["unfused"][1] / t["fused"][1]}
    return out


def summarize(report: dict) -> dict:
    """The decision figures: per model and M, the geometric-mean [out, in] speedup over the
    projection kinds a step runs (>1: [out, in] faster) and the layer-matmul ratios."""
    out = {}
    for model, res in report["layout"].items():
        for m in ROWS:
            key = f"M={m}"
            sp = [d[key]["out_in_speedup"] for kind, d in res["kinds"].items() if kind != "lm_head"]
            lm = res["layer_matmuls"][key]
            out[f"{model} {key}"] = {
                "out_in_speedup_geomean": float(np.exp(np.mean(np.log(sp)))),
                "out_in_speedup_layer_unfused": lm["unfused/in_out"] / lm["unfused/out_in"],
                "out_in_speedup_layer_fused": lm["fused/in_out"] / lm["fused/out_in"],
                "fused_speedup_layer_in_out": lm["unfused/in_out"] / lm["fused/in_out"]}
    for t, fwd in report["forward"].items():
        for regime in ("alternating", "blocks_of_10"):
            out[f"forward {t} {regime}: fused speedup (median, min)"] = [
                fwd[regime]["fused_speedup_median"], fwd[regime]["fused_speedup_min"]]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20, help="calls per variant per round")
    ap.add_argument("--out", default=None)
    ap.add_argument("--summarize", metavar="JSON", help="only recompute the summary of an existing report")
    args = ap.parse_args(argv)
    if args.summarize:
        path = Path(args.summarize)
        report = json.loads(path.read_text())
        report["summary"] = summarize(report)
        path.write_text(json.dumps(report, indent=2))
        print(json.dumps(report["summary"], indent=2))
        return 0
    info = device_info()
    report = {"device": info, "jax": jax.__version__, "rounds": args.rounds, "calls_per_round": args.calls,
              "forward": {f"T={t}": bench_forward(args.rounds, t) for t in (1, 8)}}
    print("forward", json.dumps(report["forward"]), flush=True)
    report["layout"] = bench_layout(args.rounds, args.calls)
    report["device"]["loadavg_after"] = list(__import__("os").getloadavg())
    report["summary"] = summarize(report)
    out = results_path(args.out, device_slug(info), "weight-layout")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
