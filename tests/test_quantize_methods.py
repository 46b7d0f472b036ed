"""Calibrated weight quantization (jaxinfer.quantize): int3 packing and per-channel groups against
numpy written here, GPTQ against a numpy transcription of the paper's algorithm, GPTQ below RTN on
correlated inputs, AWQ's scale search on planted outliers, and every method through save/load and
the engine on a tiny random HF model."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.quant import QuantizedWeight, dequantize, pack_int3, quantize, unpack_int3
from jaxinfer.quantize import QuantizeSettings, quantize_model
from jaxinfer.quantize.awq import search_clip, search_scale
from jaxinfer.quantize.calibrate import calibration_windows
from jaxinfer.quantize.gptq import gptq_quantize
from tests.precision import unit_roundoff

SEED = 1234


# ------------------------------------------------------------------------------ numpy references

def np_grid(w: np.ndarray, bits: int, sym: bool, axis: int):
    """RTN grid per slice reduced over `axis` (the documented formats of jaxinfer/quant.py)."""
    if sym:
        qmax = 2 ** (bits - 1) - 1
        amax = np.abs(w).max(axis=axis)
        return np.where(amax > 0, amax / qmax, 1.0).astype(np.float32), None
    maxq = 2 ** bits - 1
    lo, hi = np.minimum(w.min(axis=axis), 0), np.maximum(w.max(axis=axis), 0)
    s = np.where(hi > lo, (hi - lo) / maxq, 1.0).astype(np.float32)
    return s, np.clip(np.round(-lo / s), 0, maxq).astype(np.float32)


def np_quant(w, s, z, bits):
    if z is None:
        qmax = 2 ** (bits - 1) - 1
        q = np.clip(np.round(w / s), -127 if bits == 8 else -qmax - 1, qmax)
        return q, q * s
    q = np.clip(np.round(w / s) + z, 0, 2 ** bits - 1)
    return q, (q - z) * s


def np_rtn(w: np.ndarray, bits: int, g: int, sym: bool) -> np.ndarray:
    """w [K, N] -> dequantized RTN weight, groups of g along K."""
    k, n = w.shape
    wg = w.reshape(k // g, g, n)
    s, z = np_grid(wg, bits, sym, axis=1)
    return np_quant(wg, s[:, None], None if z is None else z[:, None], bits)[1].reshape(k, n)


def gptq_reference(w: np.ndarray, H: np.ndarray, bits: int, g: int, sym: bool, act_order: bool,
                   percdamp: float = 0.01):
    """GPTQ, Algorithm 1 of Frantar et al. (2022), column by column with every update applied at
    once (no lazy batching), float64, on W^T (rows = outputs). Groups: grid from the updated
    weights at each group's first column; with act_order, static groups from the original weights.
    Returns codes [K, N] in the original column order."""
    W = w.T.astype(np.float64).copy()
    H = H.astype(np.float64).copy()
    n, k = W.shape
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    if act_order or g == k:
        fixed = [np_grid(W[:, j * g:(j + 1) * g], bits, sym, axis=1) for j in range(k // g)]
    order = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(k)
    W, H = W[:, order], H[np.ix_(order, order)]
    H += percdamp * np.mean(np.diag(H)) * np.eye(k)
    Hinv = np.linalg.cholesky(np.linalg.inv(H)).T          # upper Cholesky factor of H^-1
    Q = np.zeros((n, k))
    for j in range(k):
        if act_order or g == k:
            s, z = fixed[order[j] // g]
        elif j % g == 0:
            s, z = np_grid(W[:, j:j + g], bits, sym, axis=1)
        Q[:, j], deq = np_quant(W[:, j], s, z, bits)
        err = (W[:, j] - deq) / Hinv[j, j]
        W[:, j:] -= np.outer(err, Hinv[j, j:])
    return Q[:, np.argsort(order)].T


def correlated_inputs(rng, t: int, k: int) -> np.ndarray:
    """x [t, k] with strongly correlated channels (a random low-rank mixing plus noise)."""
    z = rng.standard_normal((t, k // 8))
    return (z @ rng.standard_normal((k // 8, k)) + 0.1 * rng.standard_normal((t, k))).astype(np.float32)


# ------------------------------------------------------------------------------ formats

def test_pack_int3_bit_layout():
    rng = np.random.default_rng(SEED)
    q = rng.integers(0, 8, size=(16, 5))
    word = sum(q.reshape(2, 8, 5)[:, j].astype(np.int64) << (3 * j) for j in range(8))     # (2, 5)
    expected = np.stack([(word >> s) & 0xFF for s in (0, 8, 16)], axis=1).reshape(6, 5)
    packed = np.asarray(pack_int3(jnp.asarray(q)))
    np.testing.assert_array_equal(packed, expected)
    np.testing.assert_array_equal(np.asarray(unpack_int3(packed, signed=False)), q)
    signed = q - 4
    np.testing.assert_array_equal(np.asarray(unpack_int3(pack_int3(jnp.asarray(signed)), signed=True)), signed)


@pytest.mark.parametrize("bits,g,sym", [(3, 32, True), (3, 32, False), (3, -1, False), (4, -1, True),
                                        (4, -1, False), (3, 16, True)])
def test_rtn_formats_match_numpy(bits, g, sym):
    rng = np.random.default_rng(SEED)
    w = rng.standard_normal((64, 24)).astype(np.float32)
    qw = quantize(jnp.asarray(w), bits, group_size=g, symmetric=sym)
    gg = 64 if g == -1 else g
    assert qw.group_size == gg and qw.scales.shape == (64 // gg, 24)
    assert qw.q.shape == (64 * bits // 8, 24)
    ref = np_rtn(w.astype(np.float64), bits, gg, sym)
    # both compute (q - z) * s with the same f32 scale; they differ only by f32 rounding of the product
    np.testing.assert_allclose(np.asarray(dequantize(qw), np.float64), ref, rtol=0, atol=2e-7 * np.abs(w).max())


def test_int3_qdot_refuses_pallas_and_runs_on_xla():
    from jaxinfer.quant import qdot
    rng = np.random.default_rng(SEED)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    qw = quantize(jnp.asarray(w), 3, group_size=32, symmetric=False)
    with pytest.raises(ValueError, match="no int3 format"):
        qdot(jnp.asarray(x), qw, impl="pallas")
    y = np.asarray(qdot(jnp.asarray(x), qw, impl="xla"), np.float64)
    ref = x.astype(np.float64) @ np_rtn(w.astype(np.float64), 3, 32, False)
    np.testing.assert_allclose(y, ref, rtol=0, atol=64 * 2 ** -22 * np.abs(x).max() * np.abs(w).max())


# ------------------------------------------------------------------------------ GPTQ

@pytest.mark.parametrize("bits,g,sym,act_order", [(4, 32, False, False), (3, -1, True, False),
                                                  (4, 32, True, True), (8, -1, True, False),
                                                  (3, 64, False, True)])
def test_gptq_matches_numpy_algorithm(bits, g, sym, act_order):
    rng = np.random.default_rng(SEED)
    k, n = 256, 48                               # K spans two lazy blocks of 128
    x = correlated_inputs(rng, 512, k)
    x[:, 7] = 0.0                                # a dead input channel
    H = x.T.astype(np.float64) @ x.astype(np.float64)
    w = rng.standard_normal((k, n)).astype(np.float32)
    codes, scales, zeros = gptq_quantize(w, H, bits=bits, group_size=g, symmetric=sym, act_order=act_order)
    ref = gptq_reference(w, H, bits, k if g == -1 else g, sym, act_order)
    # both run in float64; the lazy block update only reorders sums (~1e-13 relative), which cannot
    # move a code unless a value sits within that of a rounding boundary: codes must agree exactly
    np.testing.assert_array_equal(codes, ref.astype(np.int32))


def test_gptq_grid_search_is_the_least_error_shrink():
    """search_grid: per output column, the range shrink p in {1 - i/100 : i < 80} of least
    sum |w - dequant(w)|^2.4 -- checked by brute force over every p in numpy, float64."""
    from jaxinfer.quantize.gptq import search_grid
    rng = np.random.default_rng(SEED + 7)
    w = rng.standard_t(3, size=(64, 5))                      # heavy tails: a shrink pays off
    for bits, sym in ((4, False), (3, True)):
        s, z = search_grid(w, bits, sym, axis=0)
        qmax = 2 ** (bits - 1) - 1
        for col in range(w.shape[1]):
            c = w[:, col]
            best = None
            for i in range(80):
                p = 1 - i / 100
                if sym:
                    sc = p * np.abs(c).max() / qmax
                    deq = np.clip(np.round(c / sc), -qmax - 1, qmax) * sc
                    zc = None
                else:
                    lo, hi = min(p * c.min(), 0), max(p * c.max(), 0)
                    sc = (hi - lo) / (2 ** bits - 1)
                    zc = np.clip(np.round(-lo / sc), 0, 2 ** bits - 1)
                    deq = (np.clip(np.round(c / sc) + zc, 0, 2 ** bits - 1) - zc) * sc
                err = np.sum(np.abs(deq - c) ** 2.4)
                if best is None or err < best[0]:
                    best = (err, sc, zc)
            assert s[col] == pytest.approx(best[1], rel=1e-6)
            if not sym:
                assert z[col] == best[2]
        assert np.any(s < grid_scale(w, bits, sym) * 0.99)       # it did shrink somewhere


def grid_scale(w, bits, sym):
    if sym:
        return np.abs(w).max(0) / (2 ** (bits - 1) - 1)
    return (np.maximum(w.max(0), 0) - np.minimum(w.min(0), 0)) / (2 ** bits - 1)


def test_gptq_layer_error_below_rtn_on_correlated_inputs():
    rng = np.random.default_rng(SEED + 1)
    k, n = 256, 64
    x = correlated_inputs(rng, 1024, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    H = x.T.astype(np.float64) @ x.astype(np.float64)
    for bits, g in ((4, -1), (3, 128)):
        errs = []
        for clip_search in (False, True):
            codes, scales, zeros = gptq_quantize(w, H, bits=bits, group_size=g, symmetric=False,
                                                 clip_search=clip_search)
            gg = k if g == -1 else g
            wq = ((codes.reshape(k // gg, gg, n) - zeros[:, None]) * scales[:, None]).reshape(k, n)
            errs.append(np.linalg.norm(x @ w - x @ wq))
        err_rtn = np.linalg.norm(x @ w - x @ np_rtn(w.astype(np.float64), bits, gg, False))
        assert max(errs) < 0.7 * err_rtn, (bits, g, errs, err_rtn)


# ------------------------------------------------------------------------------ AWQ

def test_awq_scale_beats_rtn_on_planted_outliers():
    rng = np.random.default_rng(SEED + 2)
    t, k, n = 512, 128, 64
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, [3, 40, 99]] *= 30.0                    # salient input channels
    w = rng.standard_normal((k, n)).astype(np.float32)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    h = (x64.T @ x64 / t).astype(np.float32)
    s, alpha, errors, _ = search_scale(h, np.abs(x64).mean(axis=0), w, bits=3, group_size=128, symmetric=False,
                                       clip=False)
    assert len(errors) == 21 and alpha is not None

    # AutoAWQ's duo scaling transcribed in numpy (float64), independent of the code under test
    s_x = np.abs(x64).mean(axis=0)
    s_w = (np.abs(w64) / np.abs(w64).max(axis=0, keepdims=True)).mean(axis=1)   # one group: K = 128
    ref = np.maximum(s_x ** alpha / (s_w ** (1 - alpha) + 1e-4), 1e-4)
    ref /= np.sqrt(ref.max() * ref.min())
    np.testing.assert_allclose(s, ref, rtol=1e-4)

    def err(scale):       # the error on the rows themselves (the code reads it from X^T X / T)
        wq = np_rtn((w64 * scale[:, None]), 3, 128, False) / scale[:, None]
        return np.sum((x64 @ (w64 - wq)) ** 2) / t

    e0, e_best = err(np.ones(k)), err(ref)
    # float32 sums over K = 128 of terms whose magnitudes reach the total: 1e-4 relative is ~10x the
    # accumulated rounding (128 * 2^-24 ~ 1e-5), far below a different rounding decision's change
    np.testing.assert_allclose([errors[0], min(errors)], [e0, e_best], rtol=1e-4)
    assert e_best < 0.8 * e0, (e_best, e0)

    # scored with the clipping search, no candidate does worse than its unclipped self (r = 1 is a
    # candidate of every column, and with one group per column the column errors add up exactly)
    s_c, _, errors_c, _ = search_scale(h, np.abs(x64).mean(axis=0), w, bits=3, group_size=128, symmetric=False)
    assert all(c <= u * (1 + 1e-5) for c, u in zip(errors_c, errors)), (errors_c, errors)


@pytest.mark.parametrize("n_grid", [20, None])   # None: search_clip's default (awq.CLIP_GRID)
def test_awq_clip_search_matches_numpy_brute_force(n_grid):
    """For each output column (one group per column) the kept clip ratio is the one whose quantized
    column has the least output error on the rows, by a numpy search over the ratios 1 - i / n_grid,
    i < n_grid / 2 (the default grid: steps of 0.01)."""
    rng = np.random.default_rng(SEED + 4)
    t, k, n = 256, 64, 16
    x = correlated_inputs(rng, t, k).astype(np.float64)
    w = rng.standard_normal((k, n))
    w[rng.integers(0, k, 8), rng.integers(0, n, 8)] *= 6.0          # outlier weights worth clipping
    kw = {} if n_grid is None else {"n_grid": n_grid}
    got = search_clip((x.T @ x / t).astype(np.float32), w.astype(np.float32), bits=3, group_size=k, symmetric=False,
                      **kw)
    grid = n_grid or QuantizeSettings().awq_clip_grid
    ratios = [1.0 - i / grid for i in range(grid // 2)]
    for col in range(n):
        errs, cands = [], []
        for r in ratios:
            wc = np.clip(w[:, col], r * w[:, col].min(), r * w[:, col].max())
            wq = np_rtn(wc[:, None], 3, k, False)[:, 0]
            errs.append(np.sum((x @ (w[:, col] - wq)) ** 2))
            cands.append(wc)
        best = int(np.argmin(errs))
        # ties within float32 rounding of the two errors may pick either: accept any near-best ratio
        ok = [i for i, e in enumerate(errs) if e <= errs[best] * (1 + 1e-4)]
        # elementwise, no sums: a clip bound r * max in float32 against float64 rounds r, the product and
        # the float32 copy of w, each by at most u of the value itself
        assert any(np.allclose(got[:, col], cands[i], rtol=4 * unit_roundoff("float32"), atol=0) for i in ok), \
            (col, errs)
    assert not np.allclose(got, w.astype(np.float32)), "no column clipped: the planted outliers should be"


def test_calibration_replays_granites_scaled_residuals(hf_model_dir):
    """The calibration taps replay a block as transformers computes it, Granite's residual multiplier
    included (each branch's output times 0.22 before its add): layer 0's output from the embeddings
    it was given, against transformers' hidden states, within the float32 rounding of the layer's dots."""
    import torch

    from jaxinfer.quantize.calibrate import _taps
    from jaxinfer.weights import load_model
    from tests.hf_models import build_hf_model
    from tests.precision import assert_rel_close, dot_chain_rtol

    hf = build_hf_model("granite")
    model, cfg = load_model(hf_model_dir("granite"), "float32")
    ids = np.random.default_rng(SEED).integers(3, cfg.vocab_size, 16)
    with torch.no_grad():
        hs = hf(torch.tensor(ids[None]), output_hidden_states=True).hidden_states
    out = _taps(model.layers[0], jnp.asarray(hs[0][0].numpy()), jnp.arange(16, dtype=jnp.int32))["out"]
    d, f, hd = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    assert_rel_close(out, hs[1][0].numpy(), dot_chain_rtol(d, hd, 16, d, d, f), "layer 0")


def test_awq_folds_keep_the_float_block(hf_model_dir):
    """Dividing each tap's producer by s and multiplying the consuming rows by s leaves the float
    block's output unchanged (up to f32 rounding), for every fold AWQ uses (norms, v -> o, up -> down)."""
    from jaxinfer.quantize import linears
    from jaxinfer.quantize.calibrate import _taps
    from jaxinfer.quantize.methods import _fold
    from jaxinfer.weights import load_model

    model, cfg = load_model(hf_model_dir(TINY), "float32")
    block = model.layers[0]
    x = jnp.asarray(np.random.default_rng(SEED).standard_normal((16, cfg.d_model)), jnp.float32)
    pos = jnp.arange(16, dtype=jnp.int32)
    before = np.asarray(_taps(block, x, pos)["out"])
    rng = np.random.default_rng(SEED + 3)
    for tap, group in linears(block).items():
        k = np.prod(getattr(*group[0]).get_value().shape[:2 if tap == "o_in" else 1])
        s = rng.uniform(0.5, 2.0, size=k).astype(np.float32)
        if tap == "o_in":     # one factor per KV-head channel, repeated over the heads sharing it
            g = cfg.n_heads // cfg.n_kv_heads
            s = np.repeat(s.reshape(cfg.n_kv_heads, g, cfg.head_dim)[:, :1], g, axis=1).reshape(-1)
        assert _fold(block, tap, s)
        for owner, name in group:
            var = getattr(owner, name)
            w = var.get_value()
            c = 2 if name == "o" else 1                     # contracted (input) dims
            var.set_value(w * jnp.asarray(s).reshape(w.shape[:c] + (1,) * (w.ndim - c)))
    after = np.asarray(_taps(block, x, pos)["out"])
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-4 * np.abs(before).max())


def test_awq_moments_stream_the_taps_second_moments(hf_model_dir):
    """BlockRunner's "moments:TAP" (what AWQ's searches read) equals X^T X and sum_t |X_t| of the
    tap's activations computed in numpy (float64) from the same windows, across chunks."""
    from jaxinfer.quantize import linears
    from jaxinfer.quantize.calibrate import BlockRunner
    from jaxinfer.weights import load_model

    model, cfg = load_model(hf_model_dir(TINY), "float32")
    block = model.layers[0]
    x = jnp.asarray(np.random.default_rng(SEED + 5).standard_normal((5, 16, cfg.d_model)), jnp.float32)
    runner = BlockRunner(16)
    for tap in linears(block):
        a = np.asarray(runner.run(block, tap, x, chunk=5), np.float64)
        a = a.reshape(-1, a.shape[-1])
        xtx, abs_sum = runner.run(block, f"moments:{tap}", x, chunk=2)        # chunks of 2, 2, 1 windows
        ref = a.T @ a
        # float32 sums of 80 products (and 3 chunk partials): ~80 * 2^-24 of the largest entry
        np.testing.assert_allclose(np.asarray(xtx), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        np.testing.assert_allclose(np.asarray(abs_sum), np.abs(a).sum(axis=0), rtol=1e-5)


# ------------------------------------------------------------------------------ end to end

TINY = "llama-gqa-llama3"          # d 64, 4 heads / 2 KV heads, FFN 96, 2 layers
PROMPT = [5, 17, 33, 2, 90, 41, 7, 12]
SETTINGS = {
    "rtn-w3-g32": QuantizeSettings("rtn", bits=3, group_size=32, symmetric=False),
    "gptq-w4-pc-act": QuantizeSettings("gptq", bits=4, group_size=-1, symmetric=False, act_order=True),
    "awq-w4-g32": QuantizeSettings("awq", bits=4, group_size=32, symmetric=True),
    "gptq-w8": QuantizeSettings("gptq", bits=8, group_size=-1, symmetric=True),
    "smoothquant-w8a8": QuantizeSettings("smoothquant", bits=8, group_size=-1, symmetric=True),
    "smoothquant-static-mse": QuantizeSettings("smoothquant", bits=8, group_size=-1, symmetric=True,
                                               act_scales="static", act_calib="mse"),
    "smoothquant-static-asym-pct": QuantizeSettings("smoothquant", bits=8, group_size=-1, symmetric=True,
                                                    act_scales="static", act_calib="percentile",
                                                    act_symmetric=False),
    "fp8": QuantizeSettings("fp8", bits=8, group_size=-1, symmetric=True),
}


class _QuantizedDirs:
    """name -> (native folder of the quantized tiny model, the in-memory quantized Decoder), each
    quantized on first use: the device tests (`pytest -m device`) quantize only the two checkpoints
    they run, not every method's."""

    def __init__(self, path, tmp_path_factory):
        self.path, self.tmp, self.done = path, tmp_path_factory, {}
        ids = np.random.default_rng(SEED).integers(3, 131, size=8 * 64)
        self.windows = calibration_windows(ids, 8 * 64, 64)

    def __getitem__(self, name: str):
        from jaxinfer.weights import load_model, save_native
        if name not in self.done:
            settings = SETTINGS[name]
            model, _ = load_model(self.path, "float32")
            quantize_model(model, settings, self.windows, progress=False)
            folder = self.tmp.mktemp(name)
            save_native(model, folder, "float32", extra={"quantization": settings.to_json()})
            self.done[name] = (folder, model)
        return self.done[name]


@pytest.fixture(scope="module")
def quantized_dirs(hf_model_dir, tmp_path_factory):
    return _QuantizedDirs(hf_model_dir(TINY), tmp_path_factory)


def _flat(model):
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.state(model, nnx.Param).flat_state()}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_round_trip_and_engine(quantized_dirs, name):
    from jaxinfer import Generator, SamplingParams
    from jaxinfer.models.decoder import Decoder
    from jaxinfer.weights import load_model

    folder, model = quantized_dirs[name]
    settings = SETTINGS[name]
    meta = json.loads((folder / "config.json").read_text())
    assert meta["quantization"]["method"] == settings.method
    assert meta["quantized_weights"]["layers/0/attn/o"]["bits"] == settings.bits
    loaded, _ = load_model(folder, "float32")
    before, after = _flat(model), _flat(loaded)
    assert before.keys() == after.keys()
    for key, v in before.items():            # bit-exact round trip of every array
        if isinstance(v, QuantizedWeight):
            w = after[key]
            assert isinstance(w, QuantizedWeight)
            assert (w.bits, w.group_size, w.shape, w.fp8, w.act_bits, w.layout) == (
                v.bits, v.group_size, v.shape, v.fp8, v.act_bits, v.layout)
            for a, b in ((v.q, w.q), (v.scales, w.scales), (v.zeros, w.zeros), (v.act_scale, w.act_scale),
                         (v.act_zero, w.act_zero)):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.dtype == b.dtype
                    np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                                  np.asarray(b).reshape(-1).view(np.uint8))
        else:
            np.testing.assert_array_equal(np.asarray(v), np.asarray(after[key]))

    # the reference: a float Decoder holding the dequantized weights, greedy by full forwards (W8A8:
    # the weights as they are, whose int8 activation products test_w8a8_* check against numpy)
    ref = Decoder(model.cfg, jnp.float32, rngs=nnx.Rngs(0))
    for path, var in nnx.state(ref, nnx.Param).flat_state():
        v = before["/".join(map(str, path))]
        var.set_value(dequantize(v) if isinstance(v, QuantizedWeight) and v.act_bits is None else v)
    if settings.method == "smoothquant":
        assert all(v.act_bits == 8 and (v.act_scale is not None) == (settings.act_scales == "static")
                   and (v.act_zero is None) == settings.act_symmetric
                   for v in before.values() if isinstance(v, QuantizedWeight))
    if settings.method == "fp8":
        assert all(v.fp8 for v in before.values() if isinstance(v, QuantizedWeight))
    tokens = list(PROMPT)
    width = len(PROMPT) + 8   # one padded length: causal, so the padding never reaches logits[n - 1]
    for _ in range(8):
        n = len(tokens)
        logits, _ = ref(jnp.asarray(tokens + [0] * (width - n), jnp.int32), jnp.arange(width, dtype=jnp.int32))
        tokens.append(int(np.argmax(np.asarray(logits[n - 1]))))
    # fp8: attention="xla" (so the XLA matmuls too): on a GPU "auto" would run fp8 weights natively,
    # with activations rounded to e4m3, which this float reference does not
    # (test_fp8_engine_on_the_gpu_path checks that path against its own reference)
    attention = "xla" if settings.method == "fp8" else "auto"
    gen = Generator.from_pretrained(str(folder), dtype="float32", attention=attention, max_num_seqs=2, num_blocks=16,
                                    max_model_len=64, max_num_batched_tokens=16, warmup=False, max_decode_steps=1,
                                    async_scheduling=False)
    out = gen.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    # the engine computes the same dequantized products (fused, paged): identical greedy tokens
    assert out.token_ids == tokens[len(PROMPT):]


@pytest.mark.device
def test_w8a8_engine_on_the_pallas_kernel(quantized_dirs, monkeypatch):
    """attention="pallas" routes the quantized matmuls to the kernels (interpreted on CPU): a static
    asymmetric W8A8 checkpoint runs every linear through w8a8_matmul and gives the greedy tokens of
    the XLA engine (the integer products are exact on both paths; only the attention kernels sum in
    another order)."""
    from jaxinfer import Generator, SamplingParams
    import jaxinfer.quant.dispatch as quant
    # the checkpoint first: quantized_dirs builds it on first use, and SmoothQuant's calibration runs
    # the quantized model with impl="auto" (the kernel on a GPU, as seen there on 2026-11-26)
    folder = quantized_dirs["smoothquant-static-asym-pct"][0]
    calls = []
    kernel = quant.w8a8_matmul
    monkeypatch.setattr(quant, "w8a8_matmul", lambda *a, **kw: calls.append(a[1].shape) or kernel(*a, **kw))
    kw = dict(dtype="float32", max_num_seqs=2, num_blocks=16, max_model_len=64, max_num_batched_tokens=8,
              block_size=8, warmup=False, max_decode_steps=1, async_scheduling=False)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = Generator.from_pretrained(str(folder), attention="xla", **kw).generate([PROMPT], params)[0].token_ids
    assert not calls
    got = Generator.from_pretrained(str(folder), attention="pallas", **kw).generate([PROMPT], params)[0].token_ids
    assert got == want
    # traced once per shape: q/k/v fused [64, 128], o [64, 64], gate/up fused [64, 192], down [96, 64]
    assert {(64, 128), (64, 64), (64, 192), (96, 64)} <= set(calls), set(calls)


@pytest.mark.device
def test_fp8_engine_on_the_gpu_path(quantized_dirs, monkeypatch):
    """attention="pallas" (the GPU default) runs fp8 weights natively: every linear quantizes its
    activations per token to e4m3 and takes the fp8 x fp8 dot (quant.fp8_native_matmul, checked
    against ml_dtypes in test_quant.py). The paged engine gives the greedy tokens of the same
    arithmetic in a plain causal forward of the unfused model (only the attention sums differ)."""
    from jaxinfer import Generator, SamplingParams
    from jaxinfer.models.decoder import set_matmul_impl
    from jaxinfer.weights import load_model
    import jaxinfer.quant.dispatch as quant
    calls = []
    native = quant.fp8_native_matmul
    monkeypatch.setattr(quant, "fp8_native_matmul", lambda x, w: calls.append(w.shape) or native(x, w))
    folder = quantized_dirs["fp8"][0]
    ref, _ = load_model(folder, "float32")
    set_matmul_impl(ref, "pallas")
    tokens = list(PROMPT)
    width = len(PROMPT) + 6
    for _ in range(6):
        n = len(tokens)
        logits, _ = ref(jnp.asarray(tokens + [0] * (width - n), jnp.int32), jnp.arange(width, dtype=jnp.int32))
        tokens.append(int(np.argmax(np.asarray(logits[n - 1]))))
    # the unfused model's q [64, 4, 16], k / v [64, 2, 16], o [4, 16, 64], gate / up [64, 96], down [96, 64]
    assert {(64, 4, 16), (64, 2, 16), (4, 16, 64), (64, 96), (96, 64)} <= set(calls), set(calls)
    calls.clear()
    kw = dict(dtype="float32", max_num_seqs=2, num_blocks=16, max_model_len=64, max_num_batched_tokens=8,
              block_size=8, warmup=False, max_decode_steps=1, async_scheduling=False)
    got = Generator.from_pretrained(str(folder), attention="pallas", **kw).generate(
        [PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    assert got == tokens[len(PROMPT):]
    # traced once per shape: q/k/v fused [64, 128], o [4, 16, 64], gate/up fused [64, 192], down [96, 64]
    assert {(64, 128), (4, 16, 64), (64, 192), (96, 64)} <= set(calls), set(calls)


def test_quantizing_a_quantized_checkpoint_again_is_refused(quantized_dirs):
    from jaxinfer.models.decoder import quantize_decoder
    from jaxinfer.weights import load_model
    model, _ = load_model(quantized_dirs["gptq-w8"][0], "float32")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_decoder(model, "int4")


# pallas: the w8a8_matmul kernel, interpreted on CPU, compiled on a GPU
W8A8_IMPLS = ["xla", pytest.param("pallas", marks=pytest.mark.device)]


@pytest.mark.parametrize("impl", W8A8_IMPLS)
def test_w8a8_matmul_within_the_int8_error_bound(impl):
    """y = qdot(x, W8A8 weight) against numpy: exactly (xq @ wq) * sx * sw (integer products, then
    f32 scaling), and against the float x @ w within the int8 bound
    sum_k dx |w_k| + |x_k| dw_n + dx dw_n, dx = sx / 2 per token, dw_n = sw_n / 2 per column."""
    import dataclasses
    from jaxinfer.quant import qdot, quantize_int8
    rng = np.random.default_rng(SEED + 4)
    m, k, n = 6, 96, 48   # N: tiles of 16 (the kernel's smallest GPU block)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 5] *= 40.0                                   # an outlier channel
    w = (0.1 * rng.standard_normal((k, n))).astype(np.float32)
    qw = dataclasses.replace(quantize_int8(jnp.asarray(w)), act_bits=8)
    y = np.asarray(qdot(jnp.asarray(x), qw, impl=impl), np.float64)
    sx = np.where(np.abs(x).max(1) > 0, np.abs(x).max(1).astype(np.float32) / np.float32(127), 1).astype(np.float32)
    xq = np.clip(np.round(x / sx[:, None]), -127, 127).astype(np.int64)
    sw = np.abs(w).max(0).astype(np.float32) / np.float32(127)
    wq = np.clip(np.round(w / sw), -127, 127).astype(np.int64)
    exact = (xq @ wq).astype(np.float64) * sx[:, None].astype(np.float64) * sw[None, :].astype(np.float64)
    np.testing.assert_allclose(y, exact, rtol=4 * 2 ** -24, atol=0)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    dx, dw = sx.astype(np.float64)[:, None] / 2, sw.astype(np.float64)[None, :] / 2
    bound = dx * np.abs(w).sum(0)[None, :] + np.abs(x).sum(1)[:, None] * dw + k * dx * dw
    assert np.all(np.abs(y - ref) <= bound * (1 + 1e-5)), np.max(np.abs(y - ref) / bound)


@pytest.mark.parametrize("zero", [None, 4])
def test_static_activation_codes_match_compressed_tensors(zero):
    """A static W8A8 input's int8 codes are compressed-tensors' quantizer's (the producer of
    llmcompressor's W8A8 checkpoints, and vLLM's static int8 kernel clips the same way): round half
    to even, then clip to [-128, 127] on both sides, symmetric or with a zero point. (compressed-
    tensors rounds x / s + z, vLLM's kernel and jaxinfer round x / s and add z: the same codes but at
    a tie x / s = k + 1/2 with an odd z, so the zero point here is even and the ties are tested.)"""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from jaxinfer.quant.dispatch import quantize_rows_int8
    rng = np.random.default_rng(SEED + 6)
    sa = np.float32(0.2)
    x = np.concatenate([np.array([-30.0, -25.7, -25.6, -25.5, -25.45, -25.3, -0.1, 0.1, 0.3, 25.4, 25.5, 30.0]),
                        rng.uniform(-30, 30, 52)]).astype(np.float32).reshape(4, 16)
    args = QuantizationArgs(num_bits=8, type="int", symmetric=zero is None, strategy="tensor", dynamic=False)
    ref = quantize(torch.from_numpy(x), torch.tensor([float(sa)]), torch.tensor([zero or 0], dtype=torch.int8),
                   args).numpy()
    codes, sx = quantize_rows_int8(jnp.asarray(x), jnp.asarray(sa), None if zero is None else jnp.int32(zero))
    assert np.array_equal(np.asarray(codes).astype(np.float32), ref) and ref.min() == -128
    assert np.all(np.asarray(sx) == sa)


@pytest.mark.parametrize("impl", W8A8_IMPLS)
def test_w8a8_static_scale_matmul_against_numpy(impl):
    """A static activation scale: every row quantized with the one calibrated scale, values beyond
    127 * scale (below -128 * scale) clipped; y equals numpy's integer product exactly as above, and rows that do not
    clip stay within the int8 bound with dx = scale / 2."""
    import dataclasses
    from jaxinfer.quant import qdot, quantize_int8
    rng = np.random.default_rng(SEED + 5)
    m, k, n = 8, 64, 32
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[2, 7] = 60.0                                    # an outlier row: clips at 127 * sa = 25.4
    x[5, 3] = -60.0                                   # and one that clips at -128 * sa = -25.6
    w = (0.1 * rng.standard_normal((k, n))).astype(np.float32)
    sa = np.float32(0.2)
    qw = dataclasses.replace(quantize_int8(jnp.asarray(w)), act_bits=8, act_scale=jnp.asarray(sa))
    y = np.asarray(qdot(jnp.asarray(x), qw, impl=impl), np.float64)
    xq = np.clip(np.round(x / sa), -128, 127).astype(np.int64)
    sw = np.asarray(qw.scales)
    wq = np.asarray(qw.q).astype(np.int64)
    exact = (xq @ wq).astype(np.float64) * np.float64(sa) * sw[None, :].astype(np.float64)
    np.testing.assert_allclose(y, exact, rtol=4 * 2 ** -24, atol=0)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    dx, dw = np.float64(sa) / 2, sw.astype(np.float64)[None, :] / 2
    bound = dx * np.abs(w).sum(0)[None, :] + np.abs(x).sum(1)[:, None] * dw + k * dx * dw
    ok = np.abs(x).max(1) <= 127 * sa
    assert not ok[2] and not ok[5] and ok.sum() == m - 2
    assert np.all(np.abs(y - ref)[ok] <= bound[ok] * (1 + 1e-5))


@pytest.mark.parametrize("impl", W8A8_IMPLS)
def test_w8a8_static_asymmetric_matmul_against_numpy(impl):
    """A static asymmetric grid (scale sa, zero point z): codes clip(round(x / sa) + z, -128, 127);
    y = ((xq - z) @ q) * sa * sw, computed here in int64 numpy, equals qdot's up to the f32 rescale,
    and rows inside the grid's range stay within the int8 bound with dx = sa / 2."""
    import dataclasses
    from jaxinfer.quant import qdot, quantize_int8
    rng = np.random.default_rng(SEED + 7)
    m, k, n = 8, 64, 32
    x = np.abs(rng.standard_normal((m, k))).astype(np.float32) - 0.3    # one-sided, as after an activation
    x[4, 9] = 40.0                                    # beyond the grid's top: clips
    w = (0.1 * rng.standard_normal((k, n))).astype(np.float32)
    sa, z = np.float32(0.02), -113                    # range [(-128 - z) sa, (127 - z) sa] = [-0.3, 4.8]
    qw = dataclasses.replace(quantize_int8(jnp.asarray(w)), act_bits=8, act_scale=jnp.asarray(sa),
                             act_zero=jnp.asarray(z, jnp.int32))
    y = np.asarray(qdot(jnp.asarray(x), qw, impl=impl), np.float64)
    xq = np.clip(np.round(x / sa) + z, -128, 127).astype(np.int64)
    sw = np.asarray(qw.scales)
    wq = np.asarray(qw.q).astype(np.int64)
    exact = ((xq - z) @ wq).astype(np.float64) * np.float64(sa) * sw[None, :].astype(np.float64)
    np.testing.assert_allclose(y, exact, rtol=4 * 2 ** -24, atol=0)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    dx, dw = np.float64(sa) / 2, sw.astype(np.float64)[None, :] / 2
    bound = dx * np.abs(w).sum(0)[None, :] + np.abs(x).sum(1)[:, None] * dw + k * dx * dw
    ok = (x.max(1) <= (127 - z) * sa) & (x.min(1) >= (-128 - z) * sa)
    assert not ok[4] and ok.sum() == m - 1
    assert np.all(np.abs(y - ref)[ok] <= bound[ok] * (1 + 1e-5))


def test_static_act_range_calibrations():
    """Asymmetric static grids: (scale, zero) = ((hi - lo) / 255, round(-128 - lo / scale)) for
    [lo, hi] = [min, max] (minmax), numpy's percentiles (percentile), or the shrink of [min, max]
    of least output error through w, found here by brute force in float64 (mse)."""
    from jaxinfer.quantize.smoothquant import static_act_range
    rng = np.random.default_rng(SEED + 8)
    # 80,000 rows: an asymmetric grid's rounding error is 4x a symmetric one's, so the clipped
    # outlier's cost must be spread over more rows than in the symmetric test for clipping to win
    x = (np.abs(rng.standard_normal((80000, 32))) - 0.2).astype(np.float32)
    x[17, 3] = 60.0                                   # one planted outlier
    w = rng.standard_normal((32, 8)).astype(np.float32)

    def params(lo, hi):
        s = (hi - lo) / 255
        return s, int(np.round(-128 - lo / s))
    lo = float(x.min())
    for (got_s, got_z), (s, z) in (
            (static_act_range(x, "minmax"), params(lo, 60.0)),
            (static_act_range(x, "percentile", 99.9), params(np.percentile(x, 0.1), np.percentile(x, 99.9)))):
        assert got_s == pytest.approx(s, rel=1e-6) and got_z == z
    got = static_act_range(x, "mse", w=w, max_rows=100_000)

    def err(p):
        s, z = p
        e = (np.clip(np.round(x.astype(np.float64) / s) + z, -128, 127) - z) * s - x
        return np.mean((e @ w.astype(np.float64)) ** 2)
    grid = [params(lo * i / 100, 60.0 * i / 100) for i in range(1, 101)]
    best = grid[int(np.argmin([err(p) for p in grid]))]
    assert got[0] == pytest.approx(best[0], rel=1e-6) and got[1] == best[1]
    assert err(got) < err(params(lo, 60.0)) / 2           # the outlier clips, the rest resolve
    with pytest.raises(ValueError, match="act-calib"):
        static_act_range(x, "entropy")


def test_static_act_scale_calibrations():
    """minmax: max|x| / 127; percentile: numpy's percentile of |x| / 127; mse: the grid point
    (max|x| * i / 100) of least output error through w, found here by brute force in float64."""
    from jaxinfer.quantize.smoothquant import static_act_scale
    rng = np.random.default_rng(SEED + 6)
    x = rng.standard_normal((20000, 32)).astype(np.float32)
    x[17, 3] = 80.0                                   # one planted outlier
    w = rng.standard_normal((32, 8)).astype(np.float32)
    amax = 80.0
    assert static_act_scale(x, "minmax") == pytest.approx(amax / 127, rel=1e-7)
    assert static_act_scale(x, "percentile", 99.9) == pytest.approx(np.percentile(np.abs(x), 99.9) / 127,
                                                                     rel=1e-6)
    got = static_act_scale(x, "mse", w=w, max_rows=100_000)

    def err(s):
        e = np.clip(np.round(x.astype(np.float64) / s), -127, 127) * s - x
        return np.mean((e @ w.astype(np.float64)) ** 2)
    grid = [amax * i / 100 / 127 for i in range(1, 101)]
    best = grid[int(np.argmin([err(s) for s in grid]))]
    assert got == pytest.approx(best, rel=1e-6)
    assert got < amax / 127 / 2 and err(got) < err(amax / 127) / 2      # the outlier clips, the rest resolve
    with pytest.raises(ValueError, match="act-calib"):
        static_act_scale(x, "entropy")


def test_smoothing_factors_formula():
    from jaxinfer.quantize.smoothquant import smoothing_factors
    a = np.array([1.0, 16.0, 4.0])
    w = np.array([[4.0, -1.0], [0.25, 1.0], [-9.0, 0.0]])
    # s = a^0.5 / max|w|^0.5: [1/2, 4/1, 2/3]
    np.testing.assert_allclose(smoothing_factors(a, w, 0.5), [0.5, 4.0, 2.0 / 3.0], rtol=1e-6)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown --method 'hqq'"):
        QuantizeSettings("hqq")
    with pytest.raises(ValueError, match="training text"):
        quantize_model(None, QuantizeSettings("qat", bits=4, group_size=-1))
    with pytest.raises(ValueError, match="W8A8"):
        QuantizeSettings("smoothquant", bits=4)
    with pytest.raises(ValueError, match="per output channel"):
        QuantizeSettings("gptq", bits=8, group_size=128)
    with pytest.raises(ValueError, match="e4m3 per output channel"):
        QuantizeSettings("fp8", bits=4)
    with pytest.raises(ValueError, match="smoothquant"):
        QuantizeSettings("rtn", act_scales="static")
    with pytest.raises(ValueError, match="act-calib"):
        QuantizeSettings("smoothquant", bits=8, group_size=-1, act_scales="static", act_calib="kl")
    with pytest.raises(ValueError, match="act-asym"):
        QuantizeSettings("smoothquant", bits=8, group_size=-1, act_symmetric=False)


def test_existing_int8_int4_formats_unchanged():
    from jaxinfer.quant import quantize_int4, quantize_int8
    w = jnp.asarray(np.random.default_rng(SEED).standard_normal((64, 16)), jnp.float32)
    for a, b in ((quantize(w, 8), quantize_int8(w)), (quantize(w, 4, group_size=32), quantize_int4(w, 32))):
        assert (a.bits, a.group_size) == (b.bits, b.group_size)
        np.testing.assert_array_equal(np.asarray(a.q), np.asarray(b.q))
        np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))


@pytest.mark.parametrize("method", ["gptq", "awq", "smoothquant"])
def test_calibrated_methods_refuse_gemma(hf_model_dir, method):
    """Calibration replays each block tap by tap without Gemma's post-attention / post-MLP norms, and
    AWQ / SmoothQuant would fold into its (1 + w) norms as if they were w: refused, naming why."""
    from jaxinfer.weights import load_model

    model, _ = load_model(hf_model_dir("gemma2"), "float32")
    kw = dict(bits=8, group_size=-1) if method == "smoothquant" else dict(bits=4)
    with pytest.raises(ValueError, match=rf"--method {method} cannot quantize this model: .*Gemma.*use --method rtn"):
        quantize_model(model, QuantizeSettings(method=method, **kw), windows=np.zeros((1, 16), np.int32))


@pytest.mark.parametrize("method", ["rtn", "gptq", "qat"])
def test_quantize_refuses_mixtures_of_experts(hf_model_dir, method):
    """Every method works on one [K, N] matrix per linear; stacked experts are refused up front (load-time
    --quantize handles them), instead of failing at the model's first forward."""
    from jaxinfer.weights import load_model

    model, _ = load_model(hf_model_dir("mixtral-gqa"), "float32")
    with pytest.raises(ValueError, match=r"cannot quantize MixtralForCausalLM: its MLPs are mixtures of experts"):
        quantize_model(model, QuantizeSettings(method=method, bits=4), windows=np.zeros((1, 16), np.int32),
                       train_tokens=np.zeros(4096, np.int32))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_on_weightless_norms(hf_model_dir, method):
    """OLMo 1's LayerNorms have no weight to fold AWQ's scales into: AWQ keeps to its clip search there
    (GPTQ never folds). 8-bit per channel, the logits stay within int8's rounding of transformers' float
    ones: 2^-8 relative per weight, a few percent over two layers."""
    import torch

    from jaxinfer.weights import load_model
    from tests.hf_models import build_hf_model

    model, cfg = load_model(hf_model_dir("olmo"), "float32")
    assert cfg.norm == "layernorm_noparam"
    windows = np.random.RandomState(0).randint(3, cfg.vocab_size, (4, 32)).astype(np.int32)
    quantize_model(model, QuantizeSettings(method=method, bits=8, group_size=-1), windows=windows, progress=False)
    assert all(b.attn_norm.scale is None and b.mlp_norm.scale is None for b in model.layers)
    assert isinstance(model.layers[0].attn.q.get_value(), QuantizedWeight)
    ids = np.random.RandomState(1).randint(3, cfg.vocab_size, 24).tolist()
    with torch.no_grad():
        ref = build_hf_model("olmo")(torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(model(jnp.asarray(ids, jnp.int32), jnp.arange(24, dtype=jnp.int32))[0])
    assert np.abs(got - ref).max() < 5e-2 * np.abs(ref).max()
