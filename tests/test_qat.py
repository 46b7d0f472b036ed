"""Quantization-aware training (jaxinfer.quantize.qat) on a tiny random Llama: the fake-quantized
weights are exactly what export writes, the fake-quant forward is the quantized model's forward,
the distillation loss is numpy's KL(float || fake-quantized) (zero for the float model against
itself, with zero gradient), the straight-through gradient is the float gradient at the fake-
quantized weights, the held-out slice never meets a training window, early stopping exports the
best epoch, and a few steps reduce the loss (deterministically)."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import Decoder, abstract_decoder, window_logits
from jaxinfer.quant import QuantizedWeight, dequantize
from jaxinfer.quantize import QuantizeSettings
from jaxinfer.quantize.qat import (apply_fake_quant, export, linear_vars, make_qat_loss,
                                   qat_finetune, qat_train, split_heldout, split_trainable)

SEED = 1234
# d 64, 4 heads, FFN 64, 2 layers, untied LM head: every linear is a [64, 64] matrix, because export
# (quantize_rtn) runs eagerly and compiles each of its ops once per distinct shape (test time)
CFG = ModelConfig(vocab_size=131, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=64,
                  activation="silu", gated_mlp=True, norm="rmsnorm", norm_eps=1e-5, position="rope",
                  max_position_embeddings=64, tie_embeddings=False)
W4PC = dict(bits=4, group_size=-1, symmetric=False)           # the QAT format of the fixture
WINDOW = 16
FORMATS = [(4, -1, False), (3, 32, True)]     # int4 per channel asymmetric, int3 groups of 32 symmetric


def tiny_model() -> Decoder:
    """Random weights drawn with numpy (std 0.02; norm scales 1 + 0.1 N(0, 1), so every one matters)."""
    model = abstract_decoder(CFG, jnp.float32)
    rng = np.random.default_rng(SEED)
    for path, var in nnx.state(model, nnx.Param).flat_state():
        shape = var.get_value().shape
        w = 1 + 0.1 * rng.standard_normal(shape) if path[-1] == "scale" else 0.02 * rng.standard_normal(shape)
        var.set_value(jnp.asarray(w, jnp.float32))
    return model


def token_stream() -> np.ndarray:
    """A learnable stream: a random period of 24 tokens, repeated."""
    return np.tile(np.random.default_rng(SEED).integers(3, CFG.vocab_size, size=24), 40).astype(np.uint16)


def train_kwargs(**kw):
    return dict(W4PC, tokens=token_stream(), steps=3, batch=2, window=WINDOW, lr=1e-4, seed=SEED,
                progress=False) | kw


def fixed_batch() -> jnp.ndarray:
    t = token_stream().astype(np.int32)
    return jnp.asarray(np.stack([t[i * 7: i * 7 + WINDOW + 1] for i in range(4)]))


def floats(model) -> dict:
    """path -> numpy array (or the QuantizedWeight itself) of every parameter."""
    out = {}
    for p, v in nnx.state(model, nnx.Param).flat_state():
        value = v.get_value()
        out["/".join(map(str, p))] = value if isinstance(value, QuantizedWeight) else np.asarray(value)
    return out


@pytest.fixture(scope="module")
def trained():
    """(float parameters after 3 QAT steps, the model holding them)."""
    model = qat_train(tiny_model(), **train_kwargs())
    start, values = floats(tiny_model()), floats(model)
    # early stopping kept the trained weights (epoch 1), not the starting ones (epoch 0)
    assert any(not np.array_equal(start[k], values[k]) for k in values)
    return values, model


def test_fake_quant_is_the_exported_weight_bit_for_bit(trained):
    _, model = trained
    for bits, g, sym in FORMATS:
        settings = QuantizeSettings("rtn", bits=bits, group_size=g, symmetric=sym)
        fq_jit = floats(fake_quantized(model, settings))         # fq as the training step computes it
        exported = export(nnx.clone(model), settings)
        for owner, name in linear_vars(exported):
            qw = getattr(owner, name).get_value()
            key = floats_path(exported, owner, name)
            assert isinstance(qw, QuantizedWeight) and qw.bits == bits
            deq = np.asarray(dequantize(qw))
            np.testing.assert_array_equal(fq_jit[key], deq, err_msg=f"{key} {bits, g, sym} in jit")


def fake_quantized(model, settings, ste=True):
    """A copy of model whose linears hold fq(w), computed as training does: inside one jit over the
    whole model (apply_fake_quant; the STE's forward, or plain fake_quant with ste=False)."""
    graphdef, state = nnx.split(model)
    fq = jax.jit(lambda s: nnx.state(apply_fake_quant(nnx.merge(graphdef, s), settings, ste)))
    return nnx.merge(graphdef, fq(state))


def floats_path(model, owner, name) -> str:
    target = id(getattr(owner, name))
    return next("/".join(map(str, p)) for p, v in nnx.iter_graph(model) if id(v) == target)


@pytest.mark.cpu_only("bit-equal logits of two dot layouts is XLA:CPU's lowering; on a GPU the exported "
                      "weights take the Pallas quant_matmul")
def test_fake_quant_forward_is_the_quantized_forward(trained):
    _, model = trained
    settings = QuantizeSettings("rtn", **W4PC)
    tokens = fixed_batch()
    fq_model = fake_quantized(model, settings)                 # a float Decoder holding fq(w)
    exported = export(nnx.clone(model), settings)

    def logits(m):
        g, s = nnx.split(m)
        pos = jnp.arange(WINDOW + 1, dtype=jnp.int32)
        return np.asarray(jax.jit(lambda s, t: jax.vmap(lambda x: nnx.merge(g, s)(x, pos)[0])(t))(s, tokens))

    a, b = logits(fq_model), logits(exported)
    # Both forwards multiply the same activations by bit-identical f32 weights (test above); the fake-
    # quant forward contracts with lax.dot_general on the logical N-D weight, the quantized one with
    # jnp.dot on the [K, N] matrix (quant._xla_matmul). Both are f32 dots with f32 accumulation; if XLA
    # ran them in different summation orders each output could differ by ~K * 2^-24 * sum_k |x_k w_k|,
    # compounding through the layers. On XLA:CPU both lower to the same dot on [T, K] x [K, N], so
    # the logits agree exactly: that is asserted (a change here means the two paths diverged).
    np.testing.assert_array_equal(a, b)


def np_log_softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def np_kl(teacher_logits: np.ndarray, student_logits: np.ndarray, t: float = 1.0) -> np.ndarray:
    """KL(softmax(teacher / t) || softmax(student / t)) per position, in float64."""
    logp, logq = np_log_softmax(teacher_logits / t), np_log_softmax(student_logits / t)
    return np.sum(np.exp(logp) * (logp - logq), axis=-1)


def logits_of(model, windows) -> np.ndarray:
    """[B, L, V] float32 logits of windows[:, :-1], the plain forward (decoder.window_logits)."""
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, w: window_logits(nnx.merge(graphdef, s), w))(state, windows))


def kl_tolerance(*logits: np.ndarray) -> float:
    """The f32 loss against float64 numpy on the same logits: each log-softmax entry is within a
    few ulp of its magnitude (|z| + log-sum-exp), and KL = sum_v p_v (logp_v - logq_v) is a
    p-weighted mean of such differences, so its error is at most ~4 ulp of the largest |log p|
    (the logits themselves come from separate jits: the same f32 dots, a few ulp at most)."""
    big = max(np.abs(z).max() for z in logits) + np.log(CFG.vocab_size)
    return 4 * np.finfo(np.float32).eps * big


def test_distillation_loss_is_numpy_kl_zero_against_itself_positive_after_quantization():
    model = tiny_model()
    settings = QuantizeSettings("rtn", **W4PC)
    windows = fixed_batch()
    graphdef, params, rest = split_trainable(model, "linears")
    z_float = logits_of(model, windows)
    z_fq = logits_of(fake_quantized(model, settings, ste=False), windows)
    # the float model against itself: both log-softmaxes are the same f32 numbers, KL exactly 0
    itself = float(jax.jit(make_qat_loss(graphdef, None))(params, rest, params, windows))
    assert itself == 0.0 and np_kl(z_float, z_float).mean() == 0.0
    # after quantization: the loss is numpy's KL(float || fq), and positive
    got = float(jax.jit(make_qat_loss(graphdef, settings, 0.0, 1.0))(params, rest, params, windows))
    ref = np_kl(z_float, z_fq).mean()
    tol = kl_tolerance(z_float, z_fq)
    assert ref > 10 * tol, (ref, tol)                           # w4 moves the outputs well above rounding
    assert abs(got - ref) <= tol, (got, ref, tol)
    # mixed with next-token NLL, at temperature 2: (1 - w) T^2 KL_T + w NLL, as the docstring writes
    w, t = 0.3, 2.0
    mixed = float(jax.jit(make_qat_loss(graphdef, settings, w, t))(params, rest, params, windows))
    nll = -np.take_along_axis(np_log_softmax(z_fq), np.asarray(windows)[:, 1:, None], axis=-1).mean()
    ref_mixed = (1 - w) * t ** 2 * np_kl(z_float, z_fq, t).mean() + w * nll
    assert abs(mixed - ref_mixed) <= (1 - w) * t ** 2 * tol + w * tol, (mixed, ref_mixed)


@pytest.mark.cpu_only("bit-equal gradients: a GPU's scatter-add (the embedding's gradient) is not deterministic")
def test_ste_gradient_is_the_float_gradient_at_the_fake_quantized_weights():
    model = tiny_model()
    settings = QuantizeSettings("rtn", **W4PC)
    windows = fixed_batch()
    graphdef, params, rest = split_trainable(model, "all")
    teacher = params                                            # the float weights
    g_ste = jax.jit(jax.grad(make_qat_loss(graphdef, settings)))(params, rest, teacher, windows)
    # reference: the plain float forward (no fake quant) with the weights set to fq(w), same teacher
    ref_model = fake_quantized(model, settings, ste=False)
    g2, params2, rest2 = split_trainable(ref_model, "all")
    float_grad = jax.jit(jax.grad(make_qat_loss(g2, None)))
    g_ref = float_grad(params2, rest2, teacher, windows)
    a = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in g_ste.flat_state()}
    b = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in g_ref.flat_state()}
    assert a.keys() == b.keys()
    lin = {floats_path(model, o, n) for o, n in linear_vars(model)}
    assert lin <= a.keys() and len(lin) == 7 * CFG.n_layers
    for k in a:
        # the same float computation on the same values (the STE's backward is the identity): exact
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        assert np.any(a[k] != 0), k
    # the float model against itself: d KL / d z_student = q * sum(p) - p, zero but for the f32 sum of
    # the V probabilities (|1 - sum p| <= V * 2^-24), where fake quantization gives q - p with
    # |q - p| / p ~ sqrt(2 KL); the chain rule carries both through the same Jacobian, so each
    # float gradient is at most ~V * 2^-24 / sqrt(2 KL) of the QAT one
    g_float = float_grad(params, rest, teacher, windows)
    kl = np_kl(logits_of(model, windows), logits_of(ref_model, windows)).mean()
    bound = CFG.vocab_size * 2.0 ** -24 / np.sqrt(2 * kl)
    c = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in g_float.flat_state()}
    for k in a:
        assert np.abs(c[k]).max() <= bound * np.abs(a[k]).max(), (k, np.abs(c[k]).max(), np.abs(a[k]).max())


def test_heldout_slice_never_meets_a_training_window():
    for n, window, fraction in ((43_981, 256, 0.1), (960, 16, 0.1), (5000, 30, 0.25)):
        train, held = split_heldout(n, window, fraction)
        size = 8 * (window + 1)
        blocks = n // size
        k = max(1, round(fraction * blocks))
        held_tokens = np.zeros(n, bool)
        for s in held:
            assert not held_tokens[s:s + window + 1].any()          # non-overlapping held-out windows
            held_tokens[s:s + window + 1] = True
        assert len(held) == 8 * k and held_tokens.sum() == k * size
        # brute force: a start trains iff its window touches no held-out token
        every = [s for s in range(n - window) if not held_tokens[s:s + window + 1].any()]
        np.testing.assert_array_equal(train, every)
        # the held-out blocks are spread: one in each k-th of the text
        first = np.flatnonzero(held_tokens)[::size] // size
        np.testing.assert_array_equal(np.sort(first), ((np.arange(k) + 0.5) * blocks / k).astype(int))


def test_training_reduces_the_distillation_loss_and_exports_the_best_epoch():
    events = []
    model = qat_train(tiny_model(), **train_kwargs(steps=50, log=events.append))
    epochs = [e for e in events if e["event"] == "qat_epoch"]
    done = next(e for e in events if e["event"] == "qat_done")
    data = next(e for e in events if e["event"] == "qat_data")
    # 960 tokens, one held-out block of 8 x 17: 824 train, an epoch ceil(824 / (2 x 16)) = 26 steps
    assert (data["train_tokens"], data["heldout_tokens"], data["steps_per_epoch"]) == (824, 136, 26)
    assert [e["epoch"] for e in epochs] == [0, 1, 2] and [e["step"] for e in epochs] == [0, 26, 50]
    best = min(epochs, key=lambda e: e["heldout_kl"])
    assert (done["best_epoch"], done["heldout_kl"]) == (best["epoch"], best["heldout_kl"])
    assert best["heldout_kl"] < 0.5 * epochs[0]["heldout_kl"], epochs     # training helped the held-out KL
    # the returned weights are that epoch's: numpy's KL of their fake-quantized forward against the
    # float model on the held-out windows is the logged score
    tokens = token_stream()
    _, held = split_heldout(tokens.size, WINDOW)
    windows = jnp.asarray(np.stack([tokens[s:s + WINDOW + 1] for s in held]).astype(np.int32))
    z_float = logits_of(tiny_model(), windows)
    z_fq = logits_of(fake_quantized(model, QuantizeSettings("rtn", **W4PC), ste=False), windows)
    assert abs(np_kl(z_float, z_fq).mean() - best["heldout_kl"]) <= kl_tolerance(z_float, z_fq)


def test_small_text_warns_and_too_small_is_refused():
    with pytest.warns(UserWarning, match="times"):        # 120 steps x 2 x 16 tokens over ~820: 4.7 times
        qat_train(tiny_model(), **train_kwargs(steps=120, patience=1))
    with pytest.raises(ValueError, match="early stopping"):
        qat_train(tiny_model(), **train_kwargs(tokens=token_stream()[:200]))


def test_quantize_model_reports_tokens_and_each_epochs_heldout_kl(capsys):
    from jaxinfer.quantize import quantize_model
    settings = QuantizeSettings("qat", **W4PC, calib_window=WINDOW, qat_steps=30, qat_batch=2, qat_lr=1e-4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantize_model(tiny_model(), settings, progress=False, train_tokens=token_stream())
    assert not [w for w in caught if "QAT" in str(w.message)]        # 1.2 passes: below REPEAT_WARNING
    err = capsys.readouterr().err
    assert "QAT: training on 824 tokens of the text (136 more held out for early stopping)" in err
    assert "30 steps x 2 x 16 tokens = 1.2 epochs of 26 steps" in err
    assert [line.split(":")[0] for line in err.splitlines() if line.startswith("QAT epoch")] == [
        "QAT epoch 0 (step 0)", "QAT epoch 1 (step 26)", "QAT epoch 2 (step 30)"]
    assert "QAT: exporting epoch" in err


@pytest.mark.cpu_only("bit-for-bit retraining: a GPU's scatter-add (the embedding's gradient) is not deterministic")
def test_qat_finetune_is_deterministic(trained):
    values, model = trained
    settings = QuantizeSettings("rtn", **W4PC)
    # qat_finetune with the fixture's arguments: the same training (same seed, bit for bit), then export
    out = qat_finetune(tiny_model(), **train_kwargs())
    ref = floats(export(nnx.clone(model), settings))
    got = floats(out)
    assert got.keys() == ref.keys() == values.keys()
    for k in ref:
        assert isinstance(ref[k], QuantizedWeight) == isinstance(got[k], QuantizedWeight), k
        for a, b in zip(jax.tree.leaves(ref[k]), jax.tree.leaves(got[k])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=k)
    assert sum(isinstance(v, QuantizedWeight) for v in got.values()) == 7 * CFG.n_layers


def test_qat_defaults_are_one_set():
    """qat.py's defaults, QuantizeSettings' and the CLI's are the same numbers (chosen once)."""
    from jaxinfer import cli
    from jaxinfer.quantize import qat
    args = cli.build_parser().parse_args(["quantize", "model", "out", "--method", "qat"])
    s = QuantizeSettings("qat")
    names = ("steps", "lr", "batch", "trainable", "nll_weight", "temperature", "heldout")
    assert [getattr(args, f"qat_{n}") for n in names] == [getattr(s, f"qat_{n}") for n in names] == [
        getattr(qat, f"DEFAULT_{n.upper()}") for n in names]


def test_fused_or_quantized_model_is_refused():
    from jaxinfer.models.decoder import fuse_decoder, quantize_decoder
    with pytest.raises(ValueError, match="unfused"):
        qat_finetune(fuse_decoder(tiny_model()), **train_kwargs(steps=1))
    with pytest.raises(ValueError, match="float32"):
        qat_finetune(quantize_decoder(tiny_model(), "int8"), **train_kwargs(steps=1))
