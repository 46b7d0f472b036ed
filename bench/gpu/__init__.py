"""The GPU benchmarks: each measures on one lent GPU in one command, every part in a process of its
own with its own timeout, and writes one JSON (bench/results/<date>-<gpu>-<name>.json).

    python -m bench.gpu               everything GPU-specific: ceilings, the 8B-shaped engine in
                                      bf16 / int8 / int4 / fp8, kernels, HF transformers (run.py)
    python -m bench.gpu.decode        batch-1 decode against the bandwidth limit: profile, MBU, knee
    python -m bench.gpu.attention     the serving attention kernels on their real workloads
    python -m bench.gpu.quant_sweep   every weight-only matmul launch config on the 8B projections

run.py          bench.gpu's parts and the driver every script shares: a part per subprocess
                (run_worker), the parent's loop over parts under one deadline (run_parts,
                take_device), the run's facts (nvidia-smi, versions, the command line)
parts.py        what bench.gpu's parts measure, and the timing helpers the other scripts use
workload.py     the 8B-shaped model and the counts of the real and smoke runs
report.py       ratios, MBU, the README table and the PNG from raw records (never imports jax)
trace.py        profiler traces -> per-op summaries (decode's profile part; never imports jax)

Importing this package imports nothing, so a part's subprocess loads only what it runs.
"""
