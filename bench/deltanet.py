"""The Gated DeltaNet's recurrence on its own (jaxinfer/models/deltanet.py): gated_delta_rule with its
chunks in closed form (what a GPU runs) and token by token (what a CPU runs), against
gated_delta_rule_reference (every token of the step in one lax.scan, as transformers'
torch_recurrent_gated_delta_rule). One layer at Qwen3.5-2B's Gated DeltaNet shapes (16 value heads of
128 x 128 float32 state, 16 key heads of 128) on three steps: 64 decode rows, one 512-token prefill
chunk, and a 448-token chunk beside 64 decode rows.

    python -m bench.deltanet [--reps 7] [--out bench/results/...-deltanet.json]

Medians of --reps timed calls after one warm call, the variants of a case interleaved round by round
so that load from other processes hits all alike. Decode rows move their states once each way: the
report gives the bytes of state read and written per call and the rate that implies.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_info, device_slug, results_path, write_report
from jaxinfer.models.deltanet import gated_delta_rule, gated_delta_rule_reference

HV, DK, DV = 16, 128, 128
CASES = {"decode-64": (64, 65, lambda: np.arange(64)),
         "prefill-512": (512, 2, lambda: np.zeros(512)),
         "mixed-448+64": (512, 66, lambda: np.r_[np.zeros(448), np.arange(1, 65)])}


def _inputs(t: int, s: int, rows: np.ndarray):
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(keys[0], (t, HV, DK))) * DK ** -0.5
    k = unit(jax.random.normal(keys[1], (t, HV, DK)))
    v = jax.random.normal(keys[2], (t, HV, DV))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (t, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (t, HV)))
    h0 = jax.random.normal(keys[5], (s, HV, DK, DV))
    row = jnp.asarray(rows, jnp.int32)
    positions = jnp.asarray(np.arange(t) + 1, jnp.int32)   # (continuing sequences: every state read)
    return q, k, v, g, beta, row, positions, jnp.ones(t, bool), h0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = {"reference": jax.jit(gated_delta_rule_reference),
                "closed_form": jax.jit(lambda *a: gated_delta_rule(*a, closed_form=True)),
                "by_token": jax.jit(lambda *a: gated_delta_rule(*a, closed_form=False))}
    info = device_info()
    points = []
    for case, (t, s, rows) in CASES.items():
        inputs = _inputs(t, s, rows())
        ref = variants["reference"](*inputs)
        times: dict[str, list[float]] = {name: [] for name in variants}
        err = {}
        for name, f in variants.items():   # the warm call, and the outputs against the reference's
            o, h = jax.block_until_ready(f(*inputs))
            err[name] = float(jnp.abs(o - ref[0]).max() / jnp.abs(ref[0]).max())
        for _ in range(args.reps):
            for name, f in variants.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(*inputs))
                times[name].append(time.perf_counter() - t0)
        med = {name: float(np.median(v)) * 1e3 for name, v in times.items()}
        state_bytes = 2 * s * HV * DK * DV * 4
        for name in variants:
            points.append({"case": case, "variant": name, "tokens": t, "rows": s - 1, "median_ms": med[name],
                           "vs_reference": med["reference"] / med[name], "max_rel_err": err[name],
                           "state_gb_per_s": state_bytes / med[name] / 1e6})
            print(f"{case:14s} {name:12s} {med[name]:8.2f} ms  {med['reference'] / med[name]:5.2f}x the reference"
                  f"  (outputs within {err[name]:.1e} of its max)")
    out = results_path(args.out, device_slug(info), "deltanet")
    write_report({"device": info, "args": vars(args), "shapes": {"value_heads": HV, "k_dim": DK, "v_dim": DV},
                  "points": points}, out, "variant", "Gated DeltaNet recurrence", plot=False)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
