"""The split-K decode kernel (pallas_kernels.quant_matmul.quant_matmul_splitk) against the exact
product in numpy float64 and against quant_matmul_reference, its launch checks, and how qdot and the
autotuner's candidate lists (jaxinfer.quant.pallas_block_candidates) reach it.

Tolerances (tests/test_quant.dot_error_bound, Higham ch. 3): the kernel sums the K products of
each output in float32 in an order of its own (block_k steps inside a split, then the splits' f32
partials added in XLA), so |y - exact| <= gamma_{K+2} * sum_k |x_k w_k| (gamma_n = n 2^-24 / (1 - n
2^-24): K - 1 additions, int8's scale after the sum, the dequantize's rounding), whatever the order;
the tensor-core dot rounds the dequantized int4 weight to bfloat16 for bf16 activations (2^-8 more,
relative, per product; int8 codes are exact in bf16), and a bf16 output is rounded once more (2^-8
of |y|). The multiply-reduce inner product keeps f32 weights (bf16 activations convert exactly).
"""
from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import quant
from jaxinfer.quant import QuantizedWeight, qdot
from pallas_kernels import autotune as at
from pallas_kernels.quant_matmul import quant_matmul_reference, quant_matmul_splitk
from tests.test_quant import assert_within, dot_error_bound, grouped8_operands, np_dequant, np_pack

K, N = 256, 128
# (name, bits, group_size, symmetric): g=32 puts 2 groups in a 64-row K block, g=128 a 64-row block
# inside one group, and a split of K/4 = 64 rows half a group (rejected: see the error test)
KINDS = [("int8", 8, None, True), ("int4_g32_sym", 4, 32, True), ("int4_g64_asym", 4, 64, False),
         ("int4_g128_sym", 4, 128, True), ("int4_g128_asym", 4, 128, False),
         ("int4_g32_fzero", 4, 32, "float"),   # float zero points (GGUF's Q4_K)
         # grouped 8-bit: Q5_K's float zero points (g32), GPTQ 8-bit's int8 ones (g64), fine-grained
         # FP8's e4m3 codes (g128)
         ("int8_g32_fzero", 8, 32, "float"), ("int8_g64_asym", 8, 64, "int"), ("fp8_g128", 8, 128, "fp8")]


def operands(rng, bits, g, symmetric, k=K, n=N):
    """Random kernel-format weights: int8 codes in [-127, 127] with column scales, or packed int4
    codes (numpy's own packing) with group scales and zero points."""
    if bits == 8 and g is None:
        return (jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8),
                jnp.asarray(rng.uniform(1e-3, 2e-2, n), jnp.float32), None)
    if bits == 8:
        return grouped8_operands(rng, g, symmetric, k, n)
    q = rng.integers(-8, 8, (k, n)) if symmetric is True else rng.integers(0, 16, (k, n))
    s = jnp.asarray(rng.uniform(1e-3, 5e-2, (k // g, n)), jnp.float32)
    z = (None if symmetric is True else jnp.asarray(rng.uniform(0.0, 15.0, (k // g, n)), jnp.float32)
         if symmetric == "float" else jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8))
    return jnp.asarray(np_pack(q)), s, z


def _cases():
    out = []
    for name, bits, g, sym in KINDS:
        for m in (1, 3, 16):
            for inner in ("dot", "reduce"):
                if inner == "reduce" and m > 8:
                    continue
                splits = 4 if g is None or g <= 64 else 2     # each split whole groups: K/S % g == 0
                dtype = "bfloat16" if (m == 3 or name == "int8" and m == 16) else "float32"
                out.append(pytest.param(name, bits, g, sym, m, inner, splits, dtype,
                                        id=f"{name}-M{m}-{inner}-S{splits}-{dtype}"))
    return out


@pytest.mark.device
@pytest.mark.parametrize("name,bits,g,sym,m,inner,splits,dtype", _cases())
def test_splitk_matches_exact_product_and_reference(name, bits, g, sym, m, inner, splits, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{name}-{m}-{inner}-{dtype}".encode()))
    w, s, z = operands(rng, bits, g, sym)
    x = jnp.asarray(rng.standard_normal((m, K)), dtype)
    y = quant_matmul_splitk(x, w, s, z, bits=bits, group_size=g, num_splits=splits, block_n=64, block_k=64,
                            inner=inner)
    assert y.shape == (m, N) and y.dtype == x.dtype
    qw = QuantizedWeight(w, s, z, bits=bits, group_size=g, shape=(K, N))
    x64, w64 = np.asarray(x, np.float64), np_dequant(qw)
    exact = x64 @ w64
    bf16, fz = dtype == "bfloat16", sym == "float"
    assert_within(y, exact, dot_error_bound(x64, w64, operands_bf16=bf16 and inner == "dot", out_bf16=bf16,
                                            float_zeros=fz))
    ref = quant_matmul_reference(x.astype(jnp.float32), w, s, z, bits=bits, group_size=g)
    assert_within(ref, exact, dot_error_bound(x64, w64, operands_bf16=False, out_bf16=False, float_zeros=fz))


@pytest.mark.device
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_splitk_any_split_count_is_the_same_sum(splits):
    """num_splits 1 (no split), 2, 8 (K/S = 32: one block_k step per program) of int4 g32 asym,
    f32 activations: each within the f32 bound of the exact product."""
    rng = np.random.default_rng(40 + splits)
    w, s, z = operands(rng, 4, 32, False)
    x = jnp.asarray(rng.standard_normal((2, K)), jnp.float32)
    y = quant_matmul_splitk(x, w, s, z, bits=4, group_size=32, num_splits=splits, block_n=32, block_k=32,
                            inner="reduce")
    w64 = np_dequant(QuantizedWeight(w, s, z, bits=4, group_size=32, shape=(K, N)))
    x64 = np.asarray(x, np.float64)
    assert_within(y, x64 @ w64, dot_error_bound(x64, w64, operands_bf16=False, out_bf16=False))


def test_splitk_rejects_bad_launches():
    rng = np.random.default_rng(3)
    w8, s8, _ = operands(rng, 8, None, True)
    w4, s4, _ = operands(rng, 4, 128, True)
    x = jnp.ones((2, K), jnp.float32)
    run8 = lambda **kw: quant_matmul_splitk(x, w8, s8, bits=8, **{"interpret": True, **kw})  # noqa: E731
    with pytest.raises(ValueError, match="K=256 is not divisible by num_splits=3"):
        run8(num_splits=3)
    with pytest.raises(ValueError, match="num_splits must be a positive integer"):
        run8(num_splits=0)
    with pytest.raises(ValueError, match="block_k"):
        run8(num_splits=2, block_k=96)                      # K/S = 128 is not a multiple of 96
    with pytest.raises(ValueError, match="block_n"):
        run8(num_splits=2, block_n=48)                      # N = 128
    with pytest.raises(ValueError, match="inner"):
        run8(num_splits=2, inner="wmma")
    with pytest.raises(ValueError, match="M=9 > 8"):
        quant_matmul_splitk(jnp.ones((9, K)), w8, s8, bits=8, num_splits=2, inner="reduce", interpret=True)
    with pytest.raises(ValueError, match="M=65 > 64"):
        quant_matmul_splitk(jnp.ones((65, K)), w8, s8, bits=8, num_splits=2, inner="dot", interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        run8(num_splits=2, block_n=32, block_k=8, interpret=False)
    with pytest.raises(ValueError, match="group_size=128"):     # K/4 = 64 rows: half a group each
        quant_matmul_splitk(x, w4, s4, bits=4, group_size=128, num_splits=4, interpret=True)
    with pytest.raises(TypeError, match="int8"):
        quant_matmul_splitk(x, w4, s4, bits=8, num_splits=2, interpret=True)


# ------------------------------------------------------------------------------ candidates, qdot

EIGHT_B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def test_decode_defaults_follow_the_occupancy_rule():
    """candidates[0] for M <= 16 and the 8B projections, by hand: the tensor-core dot (M padded to
    Mp = 16), block_n 128, the smallest power-of-two num_splits with N/128 * S >= 264 (2 programs on
    each of 132 SMs), >= 4 block_k = 128 steps per split and S * Mp <= 64 (S <= 4): qkv 48 tiles ->
    S = 4 (192 programs: capped), o 32 -> 4 (128: capped), gate_up 224 -> 2 (448), down 32 -> 4
    (K/S = 3584). The multiply-reduce with the same tiles is a candidate for M <= 8, none at M = 16."""
    want = {"qkv": 4, "o": 4, "gate_up": 2, "down": 4}
    for name, (k, n) in EIGHT_B.items():
        for bits, g in ((8, None), (4, 128)):
            c1 = quant.pallas_block_candidates(1, k, n, bits, g)
            default = {"kernel": "splitk", "num_splits": want[name], "block_n": 128, "block_k": 128,
                       "inner": "dot", "num_warps": 4, "num_stages": 3}
            assert c1[0] == default, (name, bits, c1[0])
            assert {c.get("inner") for c in c1} >= {"dot", "reduce"}
            c16 = quant.pallas_block_candidates(16, k, n, bits, g)
            assert c16[0] == default and all(c.get("inner") != "reduce" for c in c16)
            for m, cands in ((1, c1), (16, c16), (64, quant.pallas_block_candidates(64, k, n, bits, g)),
                             (128, quant.pallas_block_candidates(128, k, n, bits, g))):
                assert 2 <= len(cands) <= 16 and quant.XLA_MATMUL in cands
                assert len({repr(sorted(c.items())) for c in cands}) == len(cands)
                for c in cands:     # every config passes the GPU launch checks (no kernel compiled)
                    if c.get("kernel") == "splitk":
                        from pallas_kernels.quant_matmul import _check_splitk_blocks
                        params = {key: v for key, v in c.items() if key not in ("kernel", "num_warps", "num_stages")}
                        _check_splitk_blocks(m, k, n, bits, g, interpret=False, **params)
    # M > 16: the tiled kernel stays the default; W8A8 weights get tiled configs only
    assert "kernel" not in quant.pallas_block_candidates(64, 4096, 4096, 8, None)[0]
    assert all("kernel" not in c for c in quant.pallas_block_candidates(1, 4096, 4096, 8, None, weight_only=False))


def test_tiled_candidates_fit_in_shared_memory():
    """The H200 refused the int8 tiled config m64-n256-k256 at 3 stages asking for 360,448 bytes of
    shared memory against 232,448 (the 2026-12-04 sweep's compile error): 3 x (64 x 256 x 2 + 256 x 256)
    + 64 x 256 x 4 by hand. The estimate says so, and no tiled candidate of the 8B projections at
    M = 64 or 128 asks for more than the limit (that config among them before)."""
    from jaxinfer.quant.candidates import _tiled_smem_bytes
    from pallas_kernels.quant_matmul_tuned import DEFAULT_KIND, TILED_DEFAULTS
    refused = dict(block_m=64, block_n=256, block_k=256, num_warps=4, num_stages=3)
    assert _tiled_smem_bytes(refused, 8) == 3 * (64 * 256 * 2 + 256 * 256) + 64 * 256 * 4 == 360448
    limit = TILED_DEFAULTS[DEFAULT_KIND]["smem_bytes"]
    for m in (64, 128):
        for k, n in EIGHT_B.values():
            for bits, g in ((8, None), (4, 128)):
                tiled = [c for c in quant.pallas_block_candidates(m, k, n, bits, g) if "kernel" not in c]
                assert tiled and all(_tiled_smem_bytes(c, bits) <= limit for c in tiled)
                assert refused not in tiled


def test_shipped_configs_are_candidates_and_serve_untuned(monkeypatch):
    """Every launch config shipped for the H200 (quant_matmul_tuned.TUNED, from the 2026-12-04 sweep
    of the 8B projections) is one of the tuner's candidates for the shape it was measured on, so none
    is silently dropped; with measuring off (JAXINFER_AUTOTUNE=0) it is what runs, on that device kind
    only (the default row elsewhere)."""
    from pallas_kernels.quant_matmul_tuned import TUNED
    monkeypatch.setenv("JAXINFER_AUTOTUNE", "0")
    at.clear_memory_cache()
    shipped = TUNED["NVIDIA H200"]
    found = 0
    for k, n in EIGHT_B.values():
        for m in (1, 16, 64):
            for bits, g in ((8, None), (4, 128)):
                kname, key = quant.tuning_key(m, k, n, jnp.bfloat16, bits=bits, group_size=g)
                cfg = shipped.get(kname, {}).get(key)
                cands = quant.pallas_block_candidates(m, k, n, bits, g, device_kind="gpu:NVIDIA H200")
                got = at.untuned_config(kname, key, cands, device_key="gpu:NVIDIA H200")
                assert got == (cands[0] if cfg is None else cfg), (kname, key)
                assert at.autotune(kname, key, cands, lambda c: pytest.fail("measured"),
                                   device_key="gpu:NVIDIA H200") == got
                assert at.untuned_config(kname, key, cands, device_key="gpu:NVIDIA H100") == cands[0]
                found += cfg is not None
    assert found == sum(len(v) for v in shipped.values())
    at.clear_memory_cache()


def test_shipped_h100_rows_are_candidates_and_serve_untuned(monkeypatch):
    """The H100 rows (quant_matmul_tuned.TUNED, `bench.gpu.quant_sweep --tuned` of 2026-12-06: GGUF
    Q4_K as int4 g32 with float zero points, Q8_0 as grouped int8 g32, fine-grained FP8 as e4m3 g128,
    on the 8B projections) are each one of the tuner's candidates for their shape class and format,
    what runs with measuring off on that device kind, and not used on another."""
    from pallas_kernels.quant_matmul_tuned import TUNED
    monkeypatch.setenv("JAXINFER_AUTOTUNE", "0")
    at.clear_memory_cache()
    kind = "gpu:NVIDIA H100 80GB HBM3"
    formats = {"quant_matmul_int4_g32_fzero": (4, 32), "quant_matmul_int8_g32_sym": (8, 32),
               "quant_matmul_fp8_g128_sym": (8, 128)}
    shipped = TUNED["NVIDIA H100 80GB HBM3"]
    assert set(shipped) == set(formats)
    for kname, rows in shipped.items():
        bits, g = formats[kname]
        for key, cfg in rows.items():
            m, k, n = (int(x) for x in key.split("_")[0].split("x"))
            cands = quant.pallas_block_candidates(m, k, n, bits, g, device_kind=kind)
            assert cfg in cands, (kname, key, cfg)
            assert at.untuned_config(kname, key, cands, device_key=kind) == cfg
            assert at.untuned_config(kname, key, cands, device_key="gpu:NVIDIA H200") == cands[0]
    at.clear_memory_cache()


@pytest.mark.device
def test_qdot_runs_every_candidate_of_a_decode_shape():
    """qdot(blocks=cfg) for every candidate at M = 1 (split-K with both inner products, the tiled
    kernel, XLA): each within the f32 bound of the exact product; XLA_MATMUL is impl="xla" exactly."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    qw = quant.quantize_int4(w, 64, False)
    x = jnp.asarray(rng.standard_normal((1, K)), jnp.float32)
    cands = quant.pallas_block_candidates(1, K, N, 4, 64)
    kinds = {c.get("kernel", "tiled") for c in cands}
    assert kinds == {"splitk", "xla", "tiled"} and {c.get("inner") for c in cands} >= {"dot", "reduce"}
    x64, w64 = np.asarray(x, np.float64), np_dequant(qw)
    bound = dot_error_bound(x64, w64, operands_bf16=False, out_bf16=False)
    for cfg in cands:
        assert_within(qdot(x, qw, impl="pallas", blocks=cfg), x64 @ w64, bound)
    np.testing.assert_array_equal(np.asarray(qdot(x, qw, impl="pallas", blocks=quant.XLA_MATMUL)),
                                  np.asarray(qdot(x, qw, impl="xla")))
    with pytest.raises(ValueError, match="unknown quantized matmul kernel"):
        qdot(x, qw, impl="pallas", blocks={"kernel": "cutlass"})


@pytest.mark.device
def test_grouped8_serves_xla_untuned_and_every_candidate_runs(monkeypatch):
    """Grouped 8-bit weights (GGUF's Q8_0 as loaded: int8 codes, a scale per 32; fine-grained FP8:
    e4m3 codes, a scale per 128) reach the kernels through qdot: XLA is the tuner's untuned default
    (candidates[0], what serves until a measurement or a shipped row says a kernel wins), every
    candidate of a decode shape is within the f32 bound of the exact product (Q8_0; FP8: one of
    each kernel kind), and each format tunes under its own key."""
    monkeypatch.setenv("JAXINFER_AUTOTUNE", "0")
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((1, K)), jnp.float32)
    x64 = np.asarray(x, np.float64)
    keys = set()
    for g, kind in ((32, True), (128, "fp8")):
        w, s, z = grouped8_operands(rng, g, kind, K, N)
        qw = QuantizedWeight(w, s, z, bits=8, group_size=g, shape=(K, N))
        cands = quant.pallas_block_candidates(1, K, N, 8, g)
        assert cands[0] == quant.XLA_MATMUL and quant.XLA_MATMUL not in cands[1:]
        assert {c.get("kernel", "tiled") for c in cands} == {"splitk", "xla", "tiled"}
        assert quant.select_blocks(1, K, N, qw, jnp.float32) == quant.XLA_MATMUL
        if kind == "fp8":
            cands = [next(c for c in cands if c.get("inner") == "reduce"),
                     next(c for c in cands if c.get("inner") == "dot"), cands[-1]]
        w64 = np_dequant(qw)
        bound = dot_error_bound(x64, w64, operands_bf16=False, out_bf16=False)
        for cfg in cands:
            assert_within(qdot(x, qw, impl="pallas", blocks=cfg), x64 @ w64, bound)
        np.testing.assert_array_equal(np.asarray(qdot(x, qw, impl="pallas", blocks=quant.XLA_MATMUL)),
                                      np.asarray(qdot(x, qw, impl="xla")))
        keys.add(quant.tuning_key(1, K, N, jnp.bfloat16, bits=8, group_size=g, fp8_codes=qw.fp8)[0])
    assert keys == {"quant_matmul_int8_g32_sym", "quant_matmul_fp8_g128_sym"}


@pytest.mark.device
def test_select_blocks_measures_splitk_and_xla(tmp_path, monkeypatch):
    """The tuner times the split-K, XLA and tiled candidates alike (forced, as on a GPU) and keeps
    one of them; the winner is cached under the M class (1, 2, 4, 8, 16, ...) of the call."""
    monkeypatch.setenv("JAXINFER_AUTOTUNE_BUDGET_S", "inf")
    at.clear_memory_cache()
    path = str(tmp_path / "qm.json")
    qw = quant.quantize_int8(np.random.default_rng(8).standard_normal((K, N)).astype(np.float32))
    cands = quant.pallas_block_candidates(3, K, N, 8, None)
    cfg = quant.select_blocks(3, K, N, qw, jnp.float32, cache_path=path, force=True)
    assert cfg in cands
    (entry,) = at.load_cache(path).values()
    assert entry["failed"] == 0 and len(entry["measured"]) == len(cands)
    assert entry["shape_class"] == "4x256x128_float32" and entry["kernel"] == "quant_matmul_int8"
    at.clear_memory_cache()


@pytest.mark.cpu_only("lowers for cuda from a CPU backend (a GPU compiles them for real in the tests above)")
def test_every_candidate_lowers_to_triton():
    """Every Pallas launch config of the tuner's lists (split-K with both inner products, tiled) for
    the 8B o projection (K = N = 4096) at M = 1, 8, 16, 64, int8 and int4 g128 sym / asym / float zero
    points (and g16 sym / float zero points: GGUF's Q3_K and Q2_K, at M = 1 and 16; grouped 8-bit:
    Q8_0, Q6_K, GPTQ 8-bit with zero points, Q5_K's float zero points, e4m3 codes), passes Pallas's
    Triton lowering (power-of-two tiles, supported primitives), lowered for "cuda" with no
    GPU present. (Triton's own compile to PTX -- registers, shared memory -- needs the GPU.)"""
    import jax

    k, n = EIGHT_B["o"]
    count = 0
    for bits, g, zdt, rows in ((8, None, None, (1, 8, 16, 64)), (4, 128, None, (1, 8, 16, 64)),
                               (4, 128, jnp.uint8, (1, 8, 16, 64)), (4, 128, jnp.float32, (1, 8, 16, 64)),
                               (4, 16, None, (1, 16)), (4, 16, jnp.float32, (1, 16)),
                               (8, 32, None, (1, 16)), (8, 16, None, (1,)), (8, 128, jnp.int8, (1,)),
                               (8, 32, jnp.float32, (1,)), (8, 128, "fp8", (1, 16))):
        codes = jnp.float8_e4m3fn if zdt == "fp8" else jnp.int8 if bits == 8 else jnp.uint8
        zdt = None if zdt == "fp8" else zdt
        zeros = None if zdt is None else jax.ShapeDtypeStruct((k // g, n), zdt)
        q = jax.ShapeDtypeStruct((k, n) if bits == 8 else (k // 2, n), codes)
        s = jax.ShapeDtypeStruct((n,) if g is None else (k // g, n), jnp.float32)
        qw = QuantizedWeight(q, s, zeros, bits=bits, group_size=g, shape=(k, n))
        for m in rows:
            x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
            for cfg in quant.pallas_block_candidates(m, k, n, bits, qw.group_size):
                if cfg == quant.XLA_MATMUL:
                    continue
                fn = jax.jit(lambda x, w, cfg=cfg: qdot(x, w, impl="pallas", blocks=cfg, interpret=False))
                text = fn.trace(x, qw).lower(lowering_platforms=("cuda",)).as_text()
                assert "xla.gpu.triton" in text, cfg     # the Triton custom call, its IR inside
                count += 1
    assert count >= 250


def test_candidates_keep_the_kernels_gpu_block_k_floor():
    """No candidate, for any M, K or format, has a block_k the kernels refuse on a GPU (a power of
    two >= 16: quant_matmul_splitk's check). The split-K list halved a multiply-reduce default of
    16 to 8 for int8 at M = 5..8 with K not a multiple of 128 (a failed compile per tuning)."""
    for k in range(32, 1025, 32):
        for m in (1, 5, 8, 16, 33):
            for bits, g in ((8, None), (4, 32), (4, 128 if k % 128 == 0 else 32)):
                for cfg in quant.pallas_block_candidates(m, k, 64, bits, g):
                    bk = cfg.get("block_k")
                    assert bk is None or (bk >= 16 and bk & (bk - 1) == 0 and k % bk == 0), (m, k, bits, cfg)
