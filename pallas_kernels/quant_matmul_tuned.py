"""Launch sizes of the quantized-matmul kernels (quant_matmul.py) per device kind, as data.

Three tables, each keyed by the device kind as jax names it (``jax.devices()[0].device_kind``, e.g.
"NVIDIA H200"), with a "default" row for every device not listed (for_device):

* TILED_DEFAULTS: quant_matmul's untuned launch config (block_n / block_k are the largest of the
  powers of two that divide N / K up to these; block_m goes by M, quant_matmul.default_block_m).
* SPLITK_DEFAULTS: quant_matmul_splitk's untuned launch config and the occupancy rule that picks
  its num_splits (comments below).
* TUNED: launch configs measured on a device and shipped with the code, per kernel name and shape
  class (the autotuner's names: autotune.cache_key). A config found here is used as a cached winner
  would be (autotune.autotune); a winner measured on this machine takes precedence.

What runs when nothing is measured (autotuning off, or its budget spent) is the TUNED config for the
key where there is one, else the default the first two give (autotune.untuned_config); the
autotuner (autotune.py) measures the candidates around them (jaxinfer.quant.candidates) and caches
the winner per device kind.

This module is plain data and imports nothing.
"""
from __future__ import annotations

DEFAULT_KIND = "default"

# smem_bytes: the shared memory one program may take (Hopper: 227 KiB). Candidates whose pipelined
# tiles would need more are not offered (candidates._tiled_smem_bytes, the estimate; the H200 sweep of
# 2026-12-04 had int8 m64-n256-k256 at 3 stages fail to compile asking 360,448 bytes, which the
# estimate gives exactly).
TILED_DEFAULTS: dict[str, dict] = {
    DEFAULT_KIND: dict(max_block_n=128, max_block_k=128, num_warps=4, num_stages=3, smem_bytes=232448),
}

# The split-K kernel's untuned default -- a prediction from SM occupancy, not yet measured on a GPU.
# A decode matmul (M <= 16) reads K * N weight bytes once and does next to no arithmetic: its speed is
# the HBM bandwidth the programs in flight can draw. The tiled kernel launches N / block_n programs
# (32 for N = 4096 at block_n = 128), a quarter of an H200's 132 SMs, and streamed the weights well
# below the bf16 dot's speed there. Split-K multiplies the programs by num_splits; the default takes
# the smallest power of two with
#     N / block_n * num_splits >= programs_per_sm * sm_count
# (two programs per SM, so one's loads overlap the other's arithmetic), keeping
#     (K / num_splits) / block_k >= min_k_steps      (num_stages = 3 needs a few steps to pipeline)
#     num_splits * Mp <= max_partial_rows             (each split writes, and the wrapper reads back,
#                                                      an f32 [Mp, N] partial: 64 rows are 512 bytes
#                                                      per column against K / 2 = 2 KiB of int4 codes
#                                                      at K = 4096; most of it stays in L2).
# block_n = 128 (measured; the prediction was 64: an int8 [128, 64] step of 8 KiB per program, 3 stages
# in flight, two programs ~48 KiB per SM, about what Little's law asks of ~4.8 TB/s at ~1 us latency
# over 132 SMs). The H200 sweep of 2026-12-04 (bench/results/2026-12-04-h200-quant-sweep.json) timed
# both on the 8B projections: at M = 1 the rule with block_n 128 gives each projection's fastest int8
# config (qkv S4 22.5 us, o S4 16.3, gate_up S2 70.7, down S4 33.2, against 22.8, 18.7, 91.4 and 47.2
# with block_n 64): the four together 1.21x the bf16 dot (0.96x with 64); int4 0.98x (0.85x).
# inner = "dot" (M padded to 16): the same Triton operations as the tiled kernel, which
# compiles and runs on GPUs, so an untuned engine cannot fail on a lowering the tiled kernel never
# used; the multiply-reduce ("reduce", no padding; block_k = 128 / Mp keeps 64 f32 products per
# thread) is the next candidate for M <= 8 and the tuner keeps it where it wins. With Mp = 16 the cap
# is num_splits <= 4. For the 8B projections at M = 1..16 that gives qkv 96 x 4 = 384 programs,
# o 64 x 4 = 256, gate_up 448 x 1 = 448, down 64 x 4 = 256 (K/S = 3584), against 48, 32, 224 and 32
# programs of the tiled default; the tiled kernel's bandwidth grows with its program count, which is
# why programs are the lever. Predicted (untested): int8 at M = 1 reaches ~1.7-2 TB/s on every
# projection, about what 1.65x the bf16 dot needs; int4 (unpacking and two dots per K block)
# ~1-1.3 TB/s: ~1.6-2.1x bf16, short of 2.6x, which needs ~1.6 TB/s of packed codes.
# Measured (the sweep above, the best config of each): int8 at M = 1 drew 1.1 and 1.0 TB/s on qkv and o
# (25 and 17 MB: each call is 16-23 us where the copy ceiling's bandwidth would take 5-7), 1.7 TB/s
# on gate_up and down; int4 0.4-0.9 TB/s. The bf16 dot drew 1.75 TB/s on qkv and 3.1 TB/s on gate_up.
# max_m: the default is split-K up to this M, the tiled kernel above.
# Devices without a row use the default, which is the H200's rule.
_SPLITK_H200 = dict(sm_count=132, programs_per_sm=2, min_k_steps=4, max_partial_rows=64, block_n=128,
                    block_k=128, inner="dot", num_warps=4, num_stages=3, max_m=16)
SPLITK_DEFAULTS: dict[str, dict] = {
    DEFAULT_KIND: _SPLITK_H200,
    "NVIDIA H200": _SPLITK_H200,
}

# device kind -> kernel name -> shape class (jaxinfer.quant.tuning_key) -> launch config: the fastest
# config of each 8B projection, M and format that an H200 sweep timed, where it is not the untuned
# default (`python -m bench.gpu.quant_sweep --tuned bench/results/2026-12-04-h200-quant-sweep.json`;
# the projections' K x N: qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672, down 14336 x 4096).
# M = 1 and 16 of every projection and gate_up's M = 64 were timed; M = 2..8 run the defaults until
# a sweep times them. Used wherever the tuner measures nothing (autotune.untuned_config) and as a
# cached winner where it would; a config that is no longer a candidate is ignored.
TUNED: dict[str, dict[str, dict[str, dict]]] = {
    'NVIDIA H100 80GB HBM3': {   # bench/results/2026-12-06-h100-quant-sweep-gguf.json (gpu_session.sh 7)
        'quant_matmul_fp8_g128_sym': {
            '128x4096x32768_bfloat16': dict(block_k=128, block_m=64, block_n=128, num_stages=3, num_warps=4),
            '128x4096x8192_bfloat16': dict(block_k=128, block_m=64, block_n=128, num_stages=3, num_warps=4),
            '16x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=4, num_warps=4),
            '16x4096x32768_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '16x4096x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=4, num_warps=4),
            '16x4096x8192_bfloat16':
                dict(block_k=64, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '1x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=4, num_warps=4),
            '1x4096x32768_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '1x4096x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '1x4096x8192_bfloat16':
                dict(block_k=128, block_n=128, inner='reduce', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '2x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '2x4096x32768_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '2x4096x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=4, num_warps=4),
            '2x4096x8192_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=2, num_stages=3, num_warps=4),
            '4x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=4, num_warps=4),
            '4x4096x32768_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '4x4096x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=4, num_warps=4),
            '4x4096x8192_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '64x16384x4096_bfloat16':
                dict(block_k=128, block_n=32, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '64x4096x32768_bfloat16': dict(block_k=128, block_m=64, block_n=128, num_stages=3, num_warps=4),
            '64x4096x4096_bfloat16':
                dict(block_k=128, block_n=32, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '64x4096x8192_bfloat16':
                dict(block_k=128, block_n=32, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '8x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=4, num_warps=4),
            '8x4096x32768_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '8x4096x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=4, num_warps=4),
            '8x4096x8192_bfloat16':
                dict(block_k=64, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
        },
        'quant_matmul_int4_g32_fzero': {
            '128x16384x4096_bfloat16': dict(kernel='xla'),
            '128x4096x32768_bfloat16': dict(kernel='xla'),
            '128x4096x4096_bfloat16': dict(kernel='xla'),
            '128x4096x8192_bfloat16': dict(kernel='xla'),
            '16x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '16x4096x32768_bfloat16':
                dict(block_k=64, block_n=128, inner='dot', kernel='splitk', num_splits=2, num_stages=3, num_warps=4),
            '16x4096x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '16x4096x8192_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '1x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '1x4096x32768_bfloat16':
                dict(block_k=64, block_n=128, inner='dot', kernel='splitk', num_splits=2, num_stages=3, num_warps=4),
            '1x4096x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '1x4096x8192_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '2x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '2x4096x32768_bfloat16':
                dict(block_k=64, block_n=128, inner='dot', kernel='splitk', num_splits=2, num_stages=3, num_warps=4),
            '2x4096x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '2x4096x8192_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '4x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '4x4096x32768_bfloat16':
                dict(block_k=64, block_n=128, inner='dot', kernel='splitk', num_splits=2, num_stages=3, num_warps=4),
            '4x4096x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '4x4096x8192_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '64x16384x4096_bfloat16':
                dict(block_k=128, block_n=32, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '64x4096x32768_bfloat16':
                dict(block_k=128, block_n=32, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '64x4096x4096_bfloat16':
                dict(block_k=128, block_n=32, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '64x4096x8192_bfloat16':
                dict(block_k=128, block_n=32, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '8x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '8x4096x32768_bfloat16':
                dict(block_k=64, block_n=128, inner='dot', kernel='splitk', num_splits=2, num_stages=3, num_warps=4),
            '8x4096x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '8x4096x8192_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
        },
        'quant_matmul_int8_g32_sym': {
            '16x16384x4096_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '16x4096x32768_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '16x4096x4096_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '16x4096x8192_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '1x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '1x4096x32768_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '1x4096x4096_bfloat16':
                dict(block_k=64, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '1x4096x8192_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '2x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '2x4096x32768_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '2x4096x4096_bfloat16':
                dict(block_k=64, block_n=128, inner='reduce', kernel='splitk', num_splits=16, num_stages=3, num_warps=4),
            '2x4096x8192_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '4x16384x4096_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '4x4096x32768_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '4x4096x4096_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '4x4096x8192_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '64x16384x4096_bfloat16':
                dict(block_k=128, block_n=32, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '64x4096x32768_bfloat16':
                dict(block_k=128, block_n=32, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '64x4096x4096_bfloat16':
                dict(block_k=128, block_n=32, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '64x4096x8192_bfloat16':
                dict(block_k=128, block_n=32, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
            '8x16384x4096_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '8x4096x32768_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '8x4096x4096_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '8x4096x8192_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
        },
    },
    'NVIDIA H200': {
        'quant_matmul_int4_g128_sym': {
            '16x16384x4096_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '16x4096x32768_bfloat16': dict(block_k=128, block_m=16, block_n=128, num_stages=3, num_warps=4),
            '16x4096x4096_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=4, num_stages=3, num_warps=4),
            '1x16384x4096_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '1x4096x32768_bfloat16': dict(block_k=128, block_m=16, block_n=128, num_stages=3, num_warps=4),
            '64x4096x32768_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
        },
        'quant_matmul_int8': {
            '16x16384x4096_bfloat16': dict(kernel='xla'),
            '16x4096x32768_bfloat16': dict(block_k=128, block_m=16, block_n=128, num_stages=3, num_warps=4),
            '16x4096x8192_bfloat16':
                dict(block_k=128, block_n=64, inner='dot', kernel='splitk', num_splits=8, num_stages=3, num_warps=4),
            '64x4096x32768_bfloat16':
                dict(block_k=128, block_n=128, inner='dot', kernel='splitk', num_splits=1, num_stages=3, num_warps=4),
        },
    },
}


def _kind(device_kind: str) -> str:
    """'gpu:NVIDIA H200' (the autotuner's form) or 'NVIDIA H200' -> 'NVIDIA H200'."""
    return device_kind.split(":", 1)[1] if ":" in device_kind else device_kind


def for_device(table: dict[str, dict], device_kind: str) -> dict:
    """The row of `table` for this device kind, or its default row."""
    return table.get(_kind(device_kind), table[DEFAULT_KIND])


def tuned_config(device_kind: str, kernel_name: str, shape_class: str) -> dict | None:
    """A shipped launch config for this kernel and shape class on this device kind, or None."""
    cfg = TUNED.get(_kind(device_kind), {}).get(kernel_name, {}).get(shape_class)
    return None if cfg is None else dict(cfg)
