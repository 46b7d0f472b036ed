"""Mixture of experts against a dense model with the same active parameters, same run.

    python -m bench.moe [--reps 5] [--batch-sizes 1,64] [--prompt-len 32] [--output-len 64] [--out PATH]

Models (random weights, built with transformers in a temporary folder; float32, the CPU default):
  moe    Mixtral-shaped: d_model 256, 4 layers, 8 heads (2 KV heads, head_dim 32), vocab 2048, 8 experts
         of FFN 512, top-2: each token runs 2 x 3 x 256 x 512 expert parameters per layer;
  dense  the same with one SwiGLU MLP of FFN 1024 (= 2 x 512) per layer: the same active parameters
         but for the router (256 x 8 per layer: 0.04% of them).
Generators, all warmed up and alive together, each rep running every one back to back on the same
prompts (greedy, ignore_eos): dense; moe (the expert tile loop, jaxinfer/moe.py's CPU default);
moe-ragged_dot (jax.lax.ragged_dot, opt-in: XLA:CPU lowers it densely); moe-int8 (int8 experts,
dequantized per expert per call). Figures: decode tok/s = (output tokens - batch) / (wall time from
the first first token to the end), output tok/s = output tokens / wall time, medians over --reps.

Then the grouped matmul itself, one MoE layer of the moe model's shape in isolation (medians of
--layer-reps jitted calls): tiles against ragged_dot at 8 and 32 experts (top-2 of each, so the
active work is the same), and float against int8 / int4 experts. FLOP accounting, per layer,
2 FLOPs per multiply-add, for the decode step at each batch (the engine's token bucket T >= batch)
and a 256-token prefill chunk: the useful FLOPs 2 x (tokens x k) x 3 d F; what the tile loop computes,
counted from its schedule on the model's own routing of real tokens (rows = sum over used experts of
ceil(rows_e / tile) x tile); what ragged_dot gets (T k static rows, the padding tokens' rows outside
every group) and what XLA:CPU's lowering of it costs by XLA's own HLO cost analysis.
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import device_info, device_slug, results_path, write_report
from bench.prefix_cache import run_batch

SHAPE = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
EXPERTS, TOP_K, EXPERT_FFN = 8, 2, 512


def build_models(folder: Path) -> dict[str, Path]:
    import torch
    import transformers as tf
    torch.manual_seed(0)
    moe = tf.MixtralForCausalLM(tf.MixtralConfig(**SHAPE, intermediate_size=EXPERT_FFN, num_local_experts=EXPERTS,
                                                 num_experts_per_tok=TOP_K))
    dense = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE, intermediate_size=TOP_K * EXPERT_FFN))
    paths = {"moe": folder / "moe", "dense": folder / "dense"}
    moe.save_pretrained(paths["moe"])
    dense.save_pretrained(paths["dense"])
    return paths


@contextlib.contextmanager
def moe_impl(impl: str | None):
    """Traces inside pick `impl` (the engine compiles every step shape while warming up)."""
    import jaxinfer.moe as moe_module
    real = moe_module.default_impl
    if impl is not None:
        moe_module.default_impl = lambda: impl
    try:
        yield
    finally:
        moe_module.default_impl = real


def engine_runs(paths: dict[str, Path], args) -> dict:
    from jaxinfer import Generator
    common = dict(dtype="float32", max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=256,
                  max_model_len=args.prompt_len + args.output_len + 16, enable_prefix_caching=False)
    specs = {"dense": (paths["dense"], None, None), "moe": (paths["moe"], None, None),
             "moe-ragged_dot": (paths["moe"], None, "ragged_dot"), "moe-int8": (paths["moe"], "int8", None)}
    gens = {}
    for name, (path, quant, impl) in specs.items():
        with moe_impl(impl):
            t0 = time.perf_counter()
            gens[name] = Generator.from_pretrained(str(path), quantize=quant, **common)
            print(f"{name}: warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.RandomState(0)
    out: dict = {}
    for batch in args.batch_sizes:
        runs: dict[str, list] = {n: [] for n in gens}
        for rep in range(args.reps):
            prompts = [rng.randint(3, SHAPE["vocab_size"], args.prompt_len).tolist() for _ in range(batch)]
            for name, gen in gens.items():
                r = run_batch(gen, prompts, args.output_len)
                decode_s = r["wall_s"] - min(r["ttfts"])
                runs[name].append({"decode_tok_s": (r["output_tokens"] - batch) / decode_s,
                                   "output_tok_s": r["output_tokens"] / r["wall_s"], "steps": r["steps"]})
            print(f"batch {batch} rep {rep}: " + ", ".join(
                f"{n} {runs[n][-1]['decode_tok_s']:.0f}" for n in gens), flush=True)
        out[str(batch)] = {n: {"decode_tok_s": float(np.median([r["decode_tok_s"] for r in rs])),
                               "output_tok_s": float(np.median([r["output_tok_s"] for r in rs])),
                               "all_decode_tok_s": [r["decode_tok_s"] for r in rs]} for n, rs in runs.items()}
        for name in gens:
            out[str(batch)][name]["decode_vs_dense"] = out[str(batch)][name]["decode_tok_s"] / out[str(batch)]["dense"][
                "decode_tok_s"]
    return out


def _layer(num_experts: int, quant: str | None = None):
    import jax.numpy as jnp
    from flax import nnx

    from jaxinfer.config import ModelConfig
    from jaxinfer.moe import MoE
    from jaxinfer.quant import quantize_experts
    cfg = ModelConfig(vocab_size=8, d_model=SHAPE["hidden_size"], n_layers=1, n_heads=8, n_kv_heads=2, head_dim=32,
                      ffn_dim=EXPERT_FFN, num_experts=num_experts, num_experts_per_tok=TOP_K)
    moe = MoE(cfg, jnp.float32, nnx.Rngs(0), shards=1)
    if quant:
        for p in (moe.gate_up, moe.down):
            p.set_value(quantize_experts(p.get_value(), quant))
    return moe


def _time(fn, x, reps: int) -> float:
    fn(x).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def layer_runs(args) -> dict:
    """One MoE layer: ms per call by implementation, expert count and weight format."""
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    out: dict = {}
    for tokens in (8, 64, 256):
        x = jnp.asarray(rng.standard_normal((tokens, SHAPE["hidden_size"])), jnp.float32)
        row: dict = {}
        for experts in (8, 32):
            for impl in ("tiles", "ragged_dot"):
                layer = _layer(experts)
                layer.impl = impl
                row[f"{impl} E={experts}"] = _time(jax.jit(lambda a, m=layer: m(a)), x, args.layer_reps)
        for quant in ("int8", "int4"):
            layer = _layer(EXPERTS, quant)
            row[f"tiles E=8 {quant}"] = _time(jax.jit(lambda a, m=layer: m(a)), x, args.layer_reps)
        out[str(tokens)] = row
        print(f"layer T={tokens}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()), flush=True)
    return out


def _group_sizes(path: Path, tokens: int) -> list[np.ndarray]:
    """Rows per expert in each MoE layer of one eager forward over `tokens` real tokens."""
    import jax.numpy as jnp

    import jaxinfer.moe as moe_module
    from jaxinfer.weights import load_model
    model, _ = load_model(path, "float32")
    seen, real = [], moe_module.sort_rows

    def spy(*a):
        order, sizes = real(*a)
        seen.append(np.asarray(sizes))
        return order, sizes
    moe_module.sort_rows = spy
    try:
        ids = np.random.RandomState(1).randint(3, SHAPE["vocab_size"], tokens)
        model(jnp.asarray(ids, jnp.int32), jnp.arange(tokens, dtype=jnp.int32))
    finally:
        moe_module.sort_rows = real
    return seen


def _ragged_dot_hlo_flops(rows: int, k_dim: int, n_dim: int, experts: int) -> float:
    """XLA's cost analysis of ragged_dot [rows, K] x [E, K, N] as lowered on this backend."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    fn = jax.jit(lambda x, w, g: lax.ragged_dot(x, w, g, precision=lax.Precision.HIGHEST))
    compiled = fn.lower(jnp.zeros((rows, k_dim)), jnp.zeros((experts, k_dim, n_dim)),
                        jnp.zeros((experts,), jnp.int32)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def flop_accounting(path: Path, batch_sizes: list[int]) -> dict:
    """Per MoE layer, per step shape (module docstring)."""
    from jaxinfer.moe import tile_rows
    d, f, e, k = SHAPE["hidden_size"], EXPERT_FFN, EXPERTS, TOP_K
    per_row = 2 * (d * 2 * f + f * d)                  # gate_up then down, 2 FLOPs per multiply-add
    cases = [(f"decode batch {b}", b, max(8, 1 << (b - 1).bit_length())) for b in batch_sizes]
    cases.append(("prefill chunk 256", 256, 256))
    out: dict = {}
    for label, real, bucket in cases:
        rows_static = bucket * k
        tile = tile_rows(rows_static, e)
        sizes = _group_sizes(path, real)
        computed = [int(sum(-(-int(n) // tile) * tile for n in s)) for s in sizes]
        hlo = (_ragged_dot_hlo_flops(rows_static, d, 2 * f, e) + _ragged_dot_hlo_flops(rows_static, f, d, e))
        out[label] = {
            "tokens": real, "token_bucket_T": bucket, "rows_T_times_k": rows_static, "real_rows": real * k,
            "useful_flops": real * k * per_row,
            "tiles": {"tile_rows": tile, "rows_computed_per_layer": computed,
                      "flops_per_layer": [c * per_row for c in computed],
                      "ratio_to_useful": [c / (real * k) for c in computed]},
            "ragged_dot": {"rows_given": rows_static, "rows_in_groups": real * k,
                           "xla_cpu_hlo_flops": hlo, "ratio_to_useful": hlo / (real * k * per_row)}}
        print(f"{label}: tiles {out[label]['tiles']['ratio_to_useful']} x useful, ragged_dot on XLA:CPU "
              f"{out[label]['ragged_dot']['ratio_to_useful']:.1f} x", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layer-reps", type=int, default=20)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    from jaxinfer.models.hf_configs import model_config_from_hf
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_models(Path(tmp))
        cfgs = {n: model_config_from_hf(p) for n, p in paths.items()}
        report = {
            "bench": "moe", "device": device_info(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "settings": vars(args),
            "models": {n: {"num_params": c.num_params(), "num_active_params": c.num_active_params()}
                       for n, c in cfgs.items()},
            "flops": flop_accounting(paths["moe"], args.batch_sizes),
            "layer_ms": layer_runs(args),
            "engine": engine_runs(paths, args),
        }
    report["points"] = []
    out = results_path(args.out, device_slug(report["device"]), "moe")
    write_report(report, out, "label", "moe", plot=False)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
