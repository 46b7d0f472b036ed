"""The Gated DeltaNet's recurrence on its own (jaxinfer/models/deltanet.py): gated_delta_rule with its
chunks in closed form (what a GPU runs) and token by token (what a CPU runs), against
gated_delta_rule_reference (every token of the step in one lax.scan, as transformers'
torch_recurrent_gated_delta_rule). One layer at Qwen3.5-2B's Gated DeltaNet shapes (16 value heads of
128 x 128 float32 state, 16 key heads of 128) on three steps: 64 decode rows, one 512-token prefill
chunk, and a 448-token chunk beside 64 decode rows. With --rule mamba2: the same rule without its
delta correction (Granite 4.0-H's Mamba-2 layers, models/mamba2.py) at Granite 4.0-H-Tiny's shapes
(48 heads of 64, state size 128, one group), its steps dt = softplus(N(0, 1) + 1) and decays
A = -exp(A_log) of A_log = log(U[1, 16]) (Mamba-2's initialization): log-decays dt A up to ~-50 a
token, the far end of what the closed form's cumulative sums see.

    python -m bench.deltanet [--rule deltanet | mamba2] [--reps 7] [--out bench/results/...-deltanet.json]

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

SHAPES = {"deltanet": (16, 128, 128), "mamba2": (48, 128, 64)}   # value heads, k dim, v dim
CASES = {"decode-64": (64, 65, lambda: np.arange(64)),
         "prefill-512": (512, 2, lambda: np.zeros(512)),
         "mixed-448+64": (512, 66, lambda: np.r_[np.zeros(448), np.arange(1, 65)])}


def _inputs(t: int, s: int, rows: np.ndarray, rule: str):
    hv, dk, dv = SHAPES[rule]
    keys = jax.random.split(jax.random.PRNGKey(0), 7)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    v = jax.random.normal(keys[2], (t, hv, dv))
    h0 = jax.random.normal(keys[5], (s, hv, dk, dv))
    if rule == "mamba2":   # q = C, k = B (one group: every head's the same), beta = dt, g = dt A
        c, b = (jnp.broadcast_to(jax.random.normal(key, (t, 1, dk)), (t, hv, dk)) for key in keys[:2])
        beta = jax.nn.softplus(jax.random.normal(keys[4], (t, hv)) + 1.0)
        a = -jax.random.uniform(keys[6], (hv,), minval=1.0, maxval=16.0)
        q, k, g = c, b, beta * a
    else:
        q = unit(jax.random.normal(keys[0], (t, hv, dk))) * dk ** -0.5
        k = unit(jax.random.normal(keys[1], (t, hv, dk)))
        g = -jax.nn.softplus(jax.random.normal(keys[3], (t, hv)))
        beta = jax.nn.sigmoid(jax.random.normal(keys[4], (t, hv)))
    row = jnp.asarray(rows, jnp.int32)
    positions = jnp.asarray(np.arange(t) + 1, jnp.int32)   # (continuing sequences: every state read)
    return q, k, v, g, beta, row, positions, jnp.ones(t, bool), h0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rule", choices=sorted(SHAPES), default="deltanet")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    delta = args.rule == "deltanet"
    hv, dk, dv = SHAPES[args.rule]
    variants = {"reference": jax.jit(lambda *a: gated_delta_rule_reference(*a, delta=delta)),
                "closed_form": jax.jit(lambda *a: gated_delta_rule(*a, closed_form=True, delta=delta)),
                "by_token": jax.jit(lambda *a: gated_delta_rule(*a, closed_form=False, delta=delta))}
    info = device_info()
    points = []
    for case, (t, s, rows) in CASES.items():
        inputs = _inputs(t, s, rows(), args.rule)
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
        state_bytes = 2 * s * hv * dk * dv * 4
        for name in variants:
            points.append({"case": case, "variant": name, "tokens": t, "rows": s - 1, "median_ms": med[name],
                           "vs_reference": med["reference"] / med[name], "max_rel_err": err[name],
                           "state_gb_per_s": state_bytes / med[name] / 1e6})
            print(f"{case:14s} {name:12s} {med[name]:8.2f} ms  {med['reference'] / med[name]:5.2f}x the reference"
                  f"  (outputs within {err[name]:.1e} of its max)")
    out = results_path(args.out, device_slug(info), "deltanet" if delta else "mamba2")
    write_report({"device": info, "args": vars(args), "shapes": {"value_heads": hv, "k_dim": dk, "v_dim": dv},
                  "points": points}, out, "variant", "Gated DeltaNet recurrence" if delta else "Mamba-2 recurrence",
                 plot=False)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
