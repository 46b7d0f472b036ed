"""Pre-quantized checkpoints (jaxinfer/prequant): every quantization_config is loaded exactly or
refused naming the method and the field; the weights stay packed; logits match references computed
by the producing library's own code (tests/prequant_models.py says which)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from jaxinfer import Generator
from jaxinfer.quant import QuantizedWeight
from jaxinfer.weights import CheckpointError, SafetensorsFolder, load_model
from tests import prequant_models as pm
from tests.precision import assert_rel_close, dot_chain_rtol

IDS = [1, 5, 9, 20, 33, 40, 7, 64, 3, 88, 12]
# the float32 chain of a 2-layer Llama of d=64, ffn=128: each layer's q/k/v/o (K=64) and MLP (64, 128)
# dots, and the head's; the dequantized weights are the same numbers on both sides
F32_RTOL = dot_chain_rtol(64, 64, 64, 128, 64, 64, 64, 128, 64)

CT_CASES = {   # name -> (preset, strategy override, group size)
    "w4a16-g32": ("W4A16", None, 32),
    "w4a16-asym-g32": ("W4A16_ASYM", None, 32),
    "w4a16-channel": ("W4A16", "channel", None),
    "w4a16-asym-channel": ("W4A16_ASYM", "channel", None),
    "w8a16-g32": ("W8A16", None, 32),
    "w8a16-channel": ("W8A16", "channel", None),
    "w8a8": ("W8A8", None, None),
    "fp8-dynamic": ("FP8_DYNAMIC", None, None),
    "fp8-tensor-static": ("FP8", None, None),
}


def _scheme(case):
    preset, strategy, g = CT_CASES[case]
    scheme = pm.ct_scheme(preset, g)
    if strategy:
        scheme.weights.strategy, scheme.weights.group_size = strategy, None
    return scheme


@pytest.fixture(scope="module")
def ct(tmp_path_factory):
    """case -> (folder, float model, reference model), built on first use."""
    made = {}

    def get(case):
        if case not in made:
            folder, base = pm.save_compressed_tensors(tmp_path_factory.mktemp(case), _scheme(case))
            made[case] = (folder, base, pm.ct_reference(folder, base))
        return made[case]
    return get


def _ours(folder, ids=IDS):
    import jax.numpy as jnp
    model, _ = load_model(folder, "float32")
    return model, np.asarray(model(jnp.asarray(ids), jnp.arange(len(ids)))[0])


@pytest.mark.parametrize("case", ["w4a16-g32", "w4a16-asym-g32", "w4a16-channel", "w4a16-asym-channel",
                                  "w8a16-g32", "w8a16-channel", "fp8-tensor-static"])
def test_compressed_tensors_weight_only_matches_decompressed(ct, case):
    folder, base, ref = ct(case)
    model, ours = _ours(folder)
    assert isinstance(model.layers[0].attn.q.get_value(), QuantizedWeight)
    assert not isinstance(model.lm_head.get_value(), QuantizedWeight)      # "ignore": ["lm_head"]
    assert_rel_close(ours, pm.logits(ref, IDS), F32_RTOL, case)
    # the quantization is visible: the float model is measurably elsewhere
    assert np.abs(pm.logits(base, IDS) - ours).max() > 10 * F32_RTOL * np.abs(ours).max()


def test_compressed_tensors_fp8_dynamic_weights(ct):
    """FP8_DYNAMIC: per-channel e4m3 weights; the activations' per-token e4m3 rounding happens on
    jaxinfer's GPU path only (quant/format.py), so on CPU the reference is the decompressed weights
    with unquantized activations: transformers with compressed_tensors' decompression and no hook."""
    folder, base, _ = ct("fp8-dynamic")
    ref = pm.ct_reference(folder, base, activations=False)
    _, ours = _ours(folder)
    assert_rel_close(ours, pm.logits(ref, IDS), F32_RTOL, "fp8-dynamic")


def test_compressed_tensors_w8a8_int8_activations(ct):
    """W8A8 (the checkpoint that once loaded silently wrong): int8 per-channel weights and int8
    per-token dynamic activations, scale max|x_t| / 127 as vLLM's dynamic_scaled_int8_quant and
    jaxinfer compute it. Reference: the decompressed weights, inputs fake-quantized that way in torch.
    Tolerance: float32 rounding upstream can flip the rounding of an activation code that lies on a
    half step; one flip moves one of a dot's K terms by one step (max|x| / 127 times |w|), about
    1/(127 sqrt(K)) of the output's scale; a handful of flips along the chain stays below 1e-3."""
    folder, base, _ = ct("w8a8")
    model, ours = _ours(folder)
    w = model.layers[0].mlp.down.get_value()
    assert isinstance(w, QuantizedWeight) and w.act_bits == 8 and w.act_scale is None
    ref = pm.ct_reference(folder, base, activations="vllm")
    assert_rel_close(ours, pm.logits(ref, IDS), 1e-3, "w8a8 vs int8 per-token activations")
    # compressed_tensors' own fake quantizer uses max|x| / 127.5: a different, equally valid grid, one
    # activation step apart at most (relative 1/127 per term)
    assert_rel_close(ours, pm.logits(pm.ct_reference(folder, base), IDS), 2e-2, "w8a8 vs ct fake-quant")


def test_overlapping_config_groups_follow_compressed_tensors(tmp_path):
    """Config groups whose targets overlap on a module (a mixed-precision llm-compressor recipe):
    the module gets the scheme compressed-tensors gives it (its most specific target: exact names,
    then regexes in string order), checked against compressed-tensors' own assignment and
    decompression. The first group in file order won before: down_proj loaded symmetric with its
    zero points ignored (off by a quarter of max|w|)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file
    from jaxinfer.quant import dequantize
    groups = {"group_0": pm.ct_scheme("W4A16"), "group_1": pm.ct_scheme("W4A16_ASYM"), "group_2": pm.ct_scheme("W8A16")}
    for g, targets in zip(groups.values(), (["re:.*mlp.*"], ["re:.*down_proj"], ["model.layers.1.mlp.up_proj"])):
        g.targets = targets
    folder, _ = pm.save_compressed_tensors(tmp_path, groups)
    probe = pm.tiny_llama(0)
    apply_quantization_config(probe, QuantizationConfig(config_groups=groups, ignore=["lm_head"]))
    tensors = load_file(str(folder / "model.safetensors"))
    fmt = json.loads((folder / "config.json").read_text())["quantization_config"]["format"]
    model, _ = load_model(folder, "float32")
    for layer, part in ((0, "down"), (0, "gate"), (1, "up"), (1, "down")):
        name = f"model.layers.{layer}.mlp.{part}_proj"
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        scheme = probe.get_submodule(name).quantization_scheme
        ref = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)["weight"].float().numpy()
        ours = np.asarray(dequantize(getattr(model.layers[layer].mlp, part).get_value()), np.float32).T
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6 * np.abs(ref).max(), err_msg=name)


def test_compression_config_key_is_read(ct, tmp_path):
    """Older compressed-tensors checkpoints keep the config under `compression_config` (read after
    `quantization_config` by compressed_tensors' get_quantization_config and by vLLM): the same
    int8 codes and scales load packed (they were read as float weights, logits 1.4x off)."""
    folder, base, _ = ct("w8a8")
    moved = tmp_path / "m"
    shutil.copytree(folder, moved)
    cfg = json.loads((moved / "config.json").read_text())
    cfg["compression_config"] = cfg.pop("quantization_config")
    (moved / "config.json").write_text(json.dumps(cfg))
    model, ours = _ours(moved)
    assert isinstance(model.layers[0].mlp.down.get_value(), QuantizedWeight)
    assert_rel_close(ours, pm.logits(pm.ct_reference(folder, base, activations="vllm"), IDS), 1e-3, "w8a8")


def test_codes_without_their_config_are_refused_naming_the_tensor(ct, tmp_path):
    """int8 codes with no quantization_config to say how to read them: refused, naming the file and
    the tensor, never read as float weights."""
    folder, _, _ = ct("w8a8")
    bare = tmp_path / "m"
    shutil.copytree(folder, bare)
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["quantization_config"]
    (bare / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\..*' stores int8"):
        load_model(bare, "float32")


def test_a_fused_projection_quantized_in_part_is_refused_by_name(tmp_path):
    """compressed-tensors told to skip v_proj: q, k and v are one fused matmul when served, so the
    engine refuses, naming the parts and which are float (it failed with an AttributeError)."""
    folder, _ = pm.save_compressed_tensors(tmp_path / "m", _scheme("w8a8"), ignore=("lm_head", "re:.*v_proj"))
    with pytest.raises(ValueError, match=r"layers/0/attn/q, layers/0/attn/k, layers/0/attn/v are served as one "
                                         r"fused matmul.*layers/0/attn/v float"):
        Generator.from_pretrained(folder, dtype="float32", max_model_len=64, token_buckets=[16],
                                  max_num_batched_tokens=16)


def test_packed_bytes_in_memory(ct):
    """The loaded matmul weights hold the checkpoint's packed codes and scales, not floats: int4
    codes take exactly the bytes of weight_packed, scales stay one f32 per group and column."""
    folder, _, _ = ct("w4a16-g32")
    model, _ = load_model(folder, "float32")
    st = SafetensorsFolder(folder)
    for i in range(2):
        for ours, hf in (("attn/q", "self_attn.q_proj"), ("attn/o", "self_attn.o_proj"), ("mlp/down", "mlp.down_proj")):
            layer = model.layers[i]
            qw = getattr(getattr(layer, ours.split("/")[0]), ours.split("/")[1]).get_value()
            packed = st.get(f"model.layers.{i}.{hf}.weight_packed")
            scale = st.get(f"model.layers.{i}.{hf}.weight_scale")
            assert qw.q.nbytes == packed.nbytes and qw.q.dtype == np.uint8
            assert qw.scales.size == scale.size and qw.zeros is None
            assert qw.nbytes == packed.nbytes + scale.size * 4
            assert qw.nbytes < qw.k * qw.n * 4 / 6        # vs float32: 1/8 for the codes + 1/8 per group of 32


@pytest.mark.parametrize("case", ["w4a16-asym-g32", "w8a8", "fp8-dynamic"])
def test_generator_logits(ct, case):
    """The public path: Generator.from_pretrained(FOLDER) with no flag, then gen.logits."""
    folder, base, _ = ct(case)
    gen = Generator.from_pretrained(str(folder), dtype="float32", warmup=False, max_model_len=32,
                                    max_num_seqs=2, num_blocks=5)
    _, ours = _ours(folder)
    assert_rel_close(gen.logits(IDS), ours, F32_RTOL, case)


# ------------------------------------------------------------------------------------ refusals

def _with_qc(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit,needles", [
    (lambda q: q.update(quant_method="hqq"), ["'hqq'", "quant_method"]),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), ["compressed-tensors", "kv_cache_scheme"]),
    (lambda q: q.update(quantization_status="frozen"), ["quantization_status", "frozen"]),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3), ["weights.num_bits", "3"]),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block"), ["weights.strategy", "block"]),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int",
                                                                       "strategy": "token", "dynamic": True}),
     ["input_activations", "weight-only"]),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), ["weights.actorder"]),
    (lambda q: q["config_groups"]["group_0"].update(format="marlin-24"), ["group_0.format", "marlin-24"]),
    (lambda q: q.update(some_new_field=1), ["some_new_field"]),
])
def test_unknown_quantization_config_refused(ct, tmp_path, edit, needles):
    folder = _with_qc(ct("w4a16-g32")[0], tmp_path / "m", edit)
    with pytest.raises(CheckpointError) as e:
        load_model(folder, "float32")
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_w8a8_refusals(ct, tmp_path):
    folder = _with_qc(ct("w8a8")[0], tmp_path / "m", lambda q: q["config_groups"]["group_0"][
        "input_activations"].update(symmetric=False))
    with pytest.raises(CheckpointError, match="input_activations.symmetric"):
        load_model(folder, "float32")


def test_bad_packed_shape_names_tensor(ct, tmp_path):
    from safetensors.numpy import load_file, save_file
    src = ct("w4a16-g32")[0]
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    t["model.layers.1.mlp.up_proj.weight_packed"] = t["model.layers.1.mlp.up_proj.weight_packed"][:, :-1].copy()
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight_packed has shape \(128, 7\).*"
                                              r"expected int32 \(128, 8\)"):
        load_model(dst, "float32")


# ---------------------------------------------------------------------------- fine-grained FP8

@pytest.fixture(scope="module")
def fp8_block(tmp_path_factory):
    folder, _ = pm.save_fp8_block(tmp_path_factory.mktemp("fp8-block"))
    return folder, pm.fp8_block_reference(folder)


def test_fp8_block_matches_transformers(fp8_block):
    """transformers on CPU dequantizes the same folder (Fp8Dequantize); jaxinfer keeps e4m3 codes
    and per-block scales and dequantizes per call: the same numbers, float32 rounding apart."""
    folder, ref = fp8_block
    model, ours = _ours(folder)
    qw = model.layers[0].mlp.gate.get_value()
    st = SafetensorsFolder(folder)
    w = st.get("model.layers.0.mlp.gate_proj.weight")
    assert qw.fp8 and qw.group_size == 32 and qw.q.nbytes == w.nbytes          # one byte a weight
    assert qw.scales.shape == (64 // 32, 128)                                    # a block's scale per column
    assert_rel_close(ours, pm.logits(ref, IDS), F32_RTOL, "fp8 block")


def test_fp8_block_deepseek_latent_attention_and_experts(tmp_path):
    """DeepSeek-V3's published form at a tiny size: every linear layer fine-grained FP8, the routed
    experts one tensor each. Their e4m3 codes stay packed, stacked per layer with a scale per block
    (the latent projections, which models/mla.py multiplies in their absorbed form, dequantized at
    load); the logits are transformers' on the same folder (Fp8Dequantize), float32 rounding apart."""
    from jaxinfer.quant import QuantizedWeight
    folder, _ = pm.save_fp8_block_deepseek(tmp_path / "ds")
    ref = pm.fp8_block_reference(folder)
    model, ours = _ours(folder)
    experts = model.layers[1].mlp.gate.get_value()
    assert isinstance(experts, QuantizedWeight) and experts.batch == 1 and experts.shape == (8, 64, 16)
    assert experts.q.dtype.name == "float8_e4m3fn" and experts.group_size == 8
    assert isinstance(model.layers[1].mlp.shared.down.get_value(), QuantizedWeight)
    # per layer (d=64): q_a 64, q_b 24, kv_a 64, the absorbed query 16, the score over latent + rope 32,
    # v_up 24, o 64; then the dense MLP (64, 48) on layer 0, the experts and the shared expert (64, 16
    # each) on layers 1 and 2; the LM head 64
    attn = (64, 24, 64, 16, 32, 24, 64)
    chain = attn + (64, 48) + 2 * (attn + (64, 16, 64, 16)) + (64,)
    assert_rel_close(ours, pm.logits(ref, IDS), dot_chain_rtol(*chain), "fp8 block deepseek")


def test_fp8_per_tensor_static_matches_transformers(tmp_path):
    """Per-tensor FP8 with static activation scales (Ministral 3's, Devstral 2's uploads): one e4m3
    code a weight and its tensor's multiplier; the logits are transformers' on the same folder (on CPU
    it dequantizes the weights at load and leaves the activations unquantized, as jaxinfer's XLA
    path does), float32 rounding apart."""
    folder, _ = pm.save_fp8_per_tensor(tmp_path / "pt")
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (qc["activation_scheme"], qc["weight_block_size"]) == ("static", None)
    model, ours = _ours(folder)
    qw = model.layers[0].mlp.gate.get_value()
    w = SafetensorsFolder(folder).get("model.layers.0.mlp.gate_proj.weight")
    assert qw.fp8 and qw.q.nbytes == w.nbytes and np.unique(np.asarray(qw.scales)).size == 1
    assert_rel_close(ours, pm.logits(pm.fp8_block_reference(folder), IDS), F32_RTOL, "fp8 per tensor")


@pytest.mark.parametrize("edit,needle", [
    (lambda q: q.update(activation_scheme="static"), "'activation_scheme' = 'static'"),
    (lambda q: q.pop("weight_block_size"),
     r"q_proj\.weight_scale_inv has shape \(2, 2\); per-tensor fp8 \(no weight_block_size\) stores one scale"),
    (lambda q: q.update(scale_fmt="ue8m0"), "'scale_fmt' = 'ue8m0'"),
    (lambda q: q.update(weight_block_size=[32, 16]),
     r"q_proj\.weight_scale_inv has shape \(2, 2\); expected \(2, 4\) for weight \[64, 64\]"),
])
def test_fp8_block_refusals(fp8_block, tmp_path, edit, needle):
    folder = _with_qc(fp8_block[0], tmp_path / "m", edit)
    with pytest.raises(CheckpointError, match=needle):
        load_model(folder, "float32")


# --------------------------------------------------------------------------------- gpt-oss MXFP4

@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return pm.save_gpt_oss_mxfp4(tmp_path_factory.mktemp("gpt-oss-mxfp4"))


OSS_IDS = [1, 5, 9, 20, 33, 40, 7, 11, 60, 90, 100, 3]
# 4 layers: q/k/v/o, router, gate/up and down dots of K = 64 each, and the head's
OSS_RTOL = dot_chain_rtol(*([64] * 6 * 4), 64)


def test_gpt_oss_mxfp4_matches_transformers(gpt_oss):
    """Experts stay MXFP4 (4-bit codes, one e8m0 byte per 32), attention and router stay float;
    logits match transformers' own MXFP4 dequantization (Mxfp4Config(dequantize=True))."""
    folder, ref = gpt_oss
    model, ours = _ours(folder, OSS_IDS)
    st = SafetensorsFolder(folder)
    for i in range(4):
        gate, up, down = (getattr(model.layers[i].mlp, n).get_value() for n in ("gate", "up", "down"))
        assert all(isinstance(w, QuantizedWeight) and w.mxfp4 and w.batch == 1 for w in (gate, up, down))
        blocks = st.get(f"model.layers.{i}.mlp.experts.gate_up_proj_blocks")
        scales = st.get(f"model.layers.{i}.mlp.experts.gate_up_proj_scales")
        assert gate.q.nbytes + up.q.nbytes == blocks.nbytes and gate.scales.nbytes + up.scales.nbytes == scales.nbytes
        assert not isinstance(model.layers[i].mlp.router.get_value(), QuantizedWeight)
        assert not isinstance(model.layers[i].attn.q.get_value(), QuantizedWeight)
    assert_rel_close(ours, pm.logits(ref, OSS_IDS), OSS_RTOL, "gpt-oss mxfp4")


def test_gpt_oss_mxfp4_generator(gpt_oss):
    folder, ref = gpt_oss
    gen = Generator.from_pretrained(str(folder), dtype="float32", warmup=False, max_model_len=32,
                                    max_num_seqs=2, num_blocks=5)
    assert_rel_close(gen.logits(OSS_IDS), pm.logits(ref, OSS_IDS), OSS_RTOL, "gpt-oss mxfp4 generator")


def test_gpt_oss_mxfp4_refusals(gpt_oss, tmp_path):
    folder = _with_qc(gpt_oss[0], tmp_path / "m", lambda q: q.update(block_size=64))
    with pytest.raises(CheckpointError, match="'mxfp4'.*'block_size' = 64"):
        load_model(folder, "float32")
