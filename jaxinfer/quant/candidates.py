"""Launch configs for the quantized matmul: which kernel (tiled, split-K or XLA's dequantize-and-
dot) with which block sizes, for one problem shape on one device kind.

The untuned defaults and the occupancy rule behind them are data in
pallas_kernels/quant_matmul_tuned.py (per device kind); this module turns them into a list of
valid candidates whose first is the default, which the autotuner (dispatch.select_blocks) measures.
It computes nothing on arrays and never dispatches.
"""
from __future__ import annotations

from pallas_kernels import autotune as _autotune
from pallas_kernels import quant_matmul_tuned as _tuned
from pallas_kernels.quant_matmul import REDUCE_MAX_M, SPLITK_INNER, SPLITK_MAX_M, default_block_m, splitk_rows

__all__ = ["XLA_MATMUL", "pallas_block_candidates", "splitk_candidates", "matmul_class",
           "SPLITK_TARGET_PROGRAMS", "SPLITK_DEFAULT_MAX_M"]

_BLOCK_NK = (256, 128, 64, 32, 16)
XLA_MATMUL = {"kernel": "xla"}     # the launch config "XLA's dequantize-and-dot" (dispatch._xla_matmul)

_SPLITK_DEFAULT = _tuned.SPLITK_DEFAULTS[_tuned.DEFAULT_KIND]
SPLITK_TARGET_PROGRAMS = _SPLITK_DEFAULT["programs_per_sm"] * _SPLITK_DEFAULT["sm_count"]   # the default row's
SPLITK_DEFAULT_MAX_M = _SPLITK_DEFAULT["max_m"]  # the default row's: split-K up to here, the tiled kernel above


def _device(device_kind: str | None) -> str:
    return _autotune.device_kind() if device_kind is None else device_kind


def _valid_bk(bk: int, k: int, bits: int, g: int | None) -> bool:
    if k % bk or bk < 16:      # the kernels' GPU floor (Triton's dot: a K of 16 at least)
        return False
    if bits == 4 and bk < 32:
        return False
    return g is None or bk % g == 0 or g % bk == 0


def _tiled_smem_bytes(c: dict, bits: int) -> int:
    """Shared memory of a tiled config, estimated: num_stages pipelined (x, w) tile pairs (x as bf16)
    plus the f32 [block_m, block_n] accumulator's layout conversion."""
    x_tile = c["block_m"] * c["block_k"] * 2
    w_tile = c["block_k"] * c["block_n"] * bits // 8
    return c["num_stages"] * (x_tile + w_tile) + c["block_m"] * c["block_n"] * 4


def _tiled_candidates(m: int, k: int, n: int, bits: int, group_size: int | None, row: dict) -> list[dict]:
    """quant_matmul's (tiled) launch configs valid on GPU; [0] its default (`row`: TILED_DEFAULTS).
    Configs past the row's shared memory (_tiled_smem_bytes) are left out. [] if none fits."""
    if bits not in (8, 4):
        return []
    bns = [b for b in _BLOCK_NK if n % b == 0]
    bks = [b for b in _BLOCK_NK if _valid_bk(b, k, bits, group_size)]
    if not bns or not bks:
        return []
    bm0 = default_block_m(m)
    bn0 = next((b for b in bns if b <= row["max_block_n"]), bns[-1])
    bk0 = next((b for b in bks if b <= row["max_block_k"]), bks[-1])
    default = dict(block_m=bm0, block_n=bn0, block_k=bk0, num_warps=row["num_warps"], num_stages=row["num_stages"])
    cands = [default]
    bms = [bm0, 128] if m > 64 else [bm0]      # bm0 = 16/32/64 by M (<= 64 for m > 64)

    def add(**kw):
        c = dict(default, **kw)
        if c not in cands and _tiled_smem_bytes(c, bits) <= row["smem_bytes"]:
            cands.append(c)

    for bm in bms:
        for bn in bns[:3]:
            for bk in bks[:3]:
                add(block_m=bm, block_n=bn, block_k=bk)
    add(num_warps=8)
    add(num_stages=4)
    add(num_stages=2)
    return cands[:16]


def _splitk_config(m: int, k: int, n: int, bits: int, g: int | None, bn: int, bk: int, inner: str,
                   row: dict, splits: int | None = None) -> dict | None:
    """A valid split-K config (num_splits by the occupancy rule of `row`, SPLITK_DEFAULTS, unless
    given), or None."""
    ks_ok = lambda s: k % s == 0 and (k // s) % bk == 0 and (g is None or (k // s) % g == 0)  # noqa: E731
    if n % bn or not _valid_bk(bk, k, bits, g) or (splits is not None and not ks_ok(splits)):
        return None
    if splits is None:
        mp = splitk_rows(m, inner)
        ok = [s for s in (1, 2, 4, 8, 16, 32, 64)
              if ks_ok(s) and (s == 1 or ((k // s) // bk >= row["min_k_steps"]
                                          and s * mp <= row["max_partial_rows"]))]
        if not ok:
            return None
        target = row["programs_per_sm"] * row["sm_count"]
        splits = next((s for s in ok if n // bn * s >= target), ok[-1])
    return dict(kernel="splitk", num_splits=splits, block_n=bn, block_k=bk, inner=inner,
                num_warps=row["num_warps"], num_stages=row["num_stages"])


def splitk_candidates(m: int, k: int, n: int, bits: int, group_size: int | None, *,
                      device_kind: str | None = None) -> list[dict]:
    """quant_matmul_splitk launch configs valid on GPU for M <= 64 ([] above); [0] its default.
    device_kind: the SPLITK_DEFAULTS row (None: the default device's)."""
    if bits not in (8, 4) or m > SPLITK_MAX_M:
        return []
    row = _tuned.for_device(_tuned.SPLITK_DEFAULTS, _device(device_kind))
    inners = [row["inner"]] + [i for i in SPLITK_INNER if i != row["inner"]]      # the default first
    inners = [i for i in inners if i == "dot" or m <= REDUCE_MAX_M]
    cands: list[dict] = []

    def add(c):
        if c is not None and c not in cands:
            cands.append(c)

    def bk_for(inner):   # reduce: Mp * block_k = 128 products per column and step (>= 32 for int4)
        return max(128 // splitk_rows(m, inner), 32 if bits == 4 else 16) if inner == "reduce" else row["block_k"]
    bns = [row["block_n"]] + [b for b in (64, 128, 32) if b != row["block_n"]]
    for inner in inners:
        for bn in bns:
            add(_splitk_config(m, k, n, bits, group_size, bn, bk_for(inner), inner, row))
    if not cands:
        return []
    d = cands[0]
    for s in (d["num_splits"] * 2, d["num_splits"] // 2):
        if s >= 1:
            add(_splitk_config(m, k, n, bits, group_size, d["block_n"], d["block_k"], d["inner"], row, s))
    # the next block_n's twice the splits (the H200 sweep of 2026-12-04: S8 with block_n 64 was the
    # fastest int4 down projection at M = 1 and 16 and int8 qkv at M = 16)
    nxt = next((c for c in cands[1:] if c["inner"] == d["inner"] and c["block_n"] != d["block_n"]), None)
    if nxt is not None:
        add(_splitk_config(m, k, n, bits, group_size, nxt["block_n"], nxt["block_k"], nxt["inner"], row,
                           nxt["num_splits"] * 2))
    for bk in (2 * d["block_k"], d["block_k"] // 2):
        add(_splitk_config(m, k, n, bits, group_size, d["block_n"], bk, d["inner"], row, d["num_splits"]))
    # (num_warps=2 left out: it won nowhere in that sweep, and lost up to 40%)
    for kw in (dict(num_warps=8), dict(num_stages=4), dict(num_stages=2)):
        add(dict(d, **kw))
    return cands


def pallas_block_candidates(m: int, k: int, n: int, bits: int, group_size: int | None, *,
                            weight_only: bool = True, device_kind: str | None = None) -> list[dict]:
    """Launch configs valid on GPU for this problem, at most 16; [0] is the default. [] if no kernel
    can run it (no int3 format: qdot then takes the XLA path, or refuses impl="pallas").

    A config is quant_matmul's keywords (the tiled kernel; what `blocks=` has always taken), or
    {"kernel": "splitk", ...} (quant_matmul_splitk's keywords), or XLA_MATMUL (XLA's dequantize-and-
    dot, so that the tuner keeps it where it is fastest). M <= the split-K row's max_m (16): the
    split-K configs first (the default: the occupancy rule of pallas_kernels/quant_matmul_tuned.py),
    then XLA, then the tiled default and one more; larger M: the tiled configs first, then up to 3
    split-K ones (M <= 64), then XLA. weight_only=False (W8A8): the tiled w8a8_matmul configs only.
    Grouped 8-bit (bits 8 with a group_size): XLA first, the one path already measured on a GPU for
    these formats, so that the kernels serve only where the tuner (or a shipped TUNED row) has
    seen them win. device_kind: whose rows of the tables (None: the default device's).
    """
    dev = _device(device_kind)
    tiled = _tiled_candidates(m, k, n, bits, group_size, _tuned.for_device(_tuned.TILED_DEFAULTS, dev))
    if not weight_only or not tiled:
        return tiled
    split = splitk_candidates(m, k, n, bits, group_size, device_kind=dev)
    if m <= _tuned.for_device(_tuned.SPLITK_DEFAULTS, dev)["max_m"] and split:
        cands = split[:13] + [dict(XLA_MATMUL)] + tiled[:2]
    else:
        cands = tiled[:12] + split[:3] + [dict(XLA_MATMUL)]
    if bits == 8 and group_size is not None:
        cands = [dict(XLA_MATMUL)] + [c for c in cands if c != XLA_MATMUL][:15]
    return cands[:16]


def matmul_class(m: int) -> int:
    """The autotuner's M bucket: M <= 16 by power of two (1, 2, 4, 8, 16: the split-K tile heights
    and inner-product choices change there), larger M by power of two up to 512."""
    return min(_next_pow2(m), 512)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
