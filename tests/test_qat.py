"""Quantization-aware training (jaxinfer.quantize.qat) on a tiny random Llama: the fake-quantized
weights are exactly what export writes, the fake-quant forward is the quantized model's forward,
the straight-through gradient is the float gradient at the fake-quantized weights, and a few steps
reduce the fake-quant loss (deterministically)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import Decoder, abstract_decoder
from jaxinfer.quant import QuantizedWeight, dequantize
from jaxinfer.quantize import QuantizeSettings
from jaxinfer.quantize.qat import (apply_fake_quant, export, linear_vars, make_qat_loss,
                                   qat_finetune, qat_train, split_trainable)

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
    return dict(W4PC, tokens=token_stream(), steps=3, batch=2, window=WINDOW, lr=1e-2, seed=SEED,
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
    return floats(model), model


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


@pytest.mark.cpu_only("bit-equal gradients: a GPU's scatter-add (the embedding's gradient) is not deterministic")
def test_ste_gradient_is_the_float_gradient_at_the_fake_quantized_weights():
    model = tiny_model()
    settings = QuantizeSettings("rtn", **W4PC)
    windows = fixed_batch()
    graphdef, params, rest = split_trainable(model, "all")
    g_ste = jax.jit(jax.grad(make_qat_loss(graphdef, settings)))(params, rest, windows)
    # reference: the plain float forward (no fake quant) with the weights set to fq(w)
    ref_model = fake_quantized(model, settings, ste=False)
    g2, params2, rest2 = split_trainable(ref_model, "all")
    float_grad = jax.jit(jax.grad(make_qat_loss(g2, None)))
    g_ref = float_grad(params2, rest2, windows)
    a = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in g_ste.flat_state()}
    b = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in g_ref.flat_state()}
    assert a.keys() == b.keys()
    lin = {floats_path(model, o, n) for o, n in linear_vars(model)}
    assert lin <= a.keys() and len(lin) == 7 * CFG.n_layers
    for k in a:
        # the same float computation on the same values (the STE's backward is the identity): exact
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        assert np.any(a[k] != 0), k
    # and it is not the float model's own gradient (the weights it is taken at differ)
    _, params3, rest3 = split_trainable(model, "all")
    g_float = float_grad(params3, rest3, windows)
    key = floats_path(model, model.layers[0].mlp, "down")
    assert not np.array_equal(a[key], np.asarray(dict((("/".join(map(str, p)), v.get_value())
                                                       for p, v in g_float.flat_state()))[key]))


def test_training_reduces_the_fake_quant_loss(trained):
    _, model = trained
    settings = QuantizeSettings("rtn", **W4PC)
    windows = fixed_batch()
    graphdef, _, _ = split_trainable(model, "all")
    loss = jax.jit(make_qat_loss(graphdef, settings))

    def fq_loss(m):
        _, params, rest = split_trainable(m, "all")     # committed, as the trained model's are: one compile
        return float(loss(*jax.device_put((params, rest), jax.devices()[0]), windows))

    before, after = fq_loss(tiny_model()), fq_loss(model)
    assert after < before - 0.1, (before, after)


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


def test_fused_or_quantized_model_is_refused():
    from jaxinfer.models.decoder import fuse_decoder, quantize_decoder
    with pytest.raises(ValueError, match="unfused"):
        qat_finetune(fuse_decoder(tiny_model()), **train_kwargs(steps=1))
    with pytest.raises(ValueError, match="float32"):
        qat_finetune(quantize_decoder(tiny_model(), "int8"), **train_kwargs(steps=1))
