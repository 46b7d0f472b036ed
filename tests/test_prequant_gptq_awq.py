"""GPTQ and AWQ checkpoints (jaxinfer/prequant/gptq.py, awq.py) against the producers' own packing
and dequantization, written after GPTQModel's and AutoAWQ's published functions (tests/prequant_models.py
names each): transformers on the weights those functions dequantize is the reference."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.quant import QuantizedWeight
from jaxinfer.weights import CheckpointError, load_model
from tests import prequant_models as pm
from tests.precision import assert_rel_close, dot_chain_rtol
from tests.test_prequant import F32_RTOL, IDS, _ours

GPTQ_CASES = {   # name -> (bits, group_size, sym, v1)
    "gptq-4b-g32-sym": (4, 32, True, True),
    "gptq-4b-g64-asym": (4, 64, False, True),
    "gptq-4b-channel-asym": (4, -1, False, True),
    "gptq-4b-g32-asym-v2": (4, 32, False, False),
    "gptq-8b-g32-sym": (8, 32, True, True),
    "gptq-8b-channel-sym": (8, -1, True, True),
    "gptq-8b-g64-asym": (8, 64, False, True),
}
DESC_ACT = {   # name -> (bits, group_size, sym)
    "gptq-4b-g32-sym-desc": (4, 32, True),
    "gptq-4b-g32-asym-desc": (4, 32, False),
    "gptq-8b-g32-sym-desc": (8, 32, True),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    cache = {}

    def get(case):
        if case not in cache:
            folder = tmp_path_factory.mktemp(case)
            if case in DESC_ACT:
                bits, g, sym = DESC_ACT[case]
                cache[case] = pm.save_gptq(folder, bits, g, sym, desc_act=True)
            elif case.startswith("gptq"):
                bits, g, sym, v1 = GPTQ_CASES[case]
                cache[case] = pm.save_gptq(folder, bits, g, sym, v1=v1)
            else:
                cache[case] = pm.save_awq(folder, int(case.split("-g")[1]) if "-g" in case else -1)
        return cache[case]
    return get


@pytest.mark.parametrize("case", sorted(GPTQ_CASES) + ["awq-g32", "awq-g64", "awq-channel"])
def test_logits_match_producer_dequantization(made, case):
    folder, ref = made(case)
    model, ours = _ours(folder)
    qw = model.layers[1].mlp.up.get_value()
    assert isinstance(qw, QuantizedWeight)
    bits = GPTQ_CASES[case][0] if case in GPTQ_CASES else 4
    assert qw.bits == bits and qw.q.dtype == (np.uint8 if bits == 4 else np.int8)
    assert_rel_close(ours, pm.logits(ref, IDS), F32_RTOL, case)


def test_gptq_packed_bytes(made):
    """int4 GPTQ codes occupy exactly qweight's bytes; scales are one f32 per group and column
    (the checkpoint's fp16, widened), zeros one byte (the checkpoint packs them 8 per int32)."""
    folder, _ = made("gptq-4b-g64-asym")
    model, _ = load_model(folder, "float32")
    from jaxinfer.weights import SafetensorsFolder
    st = SafetensorsFolder(folder)
    qw = model.layers[0].mlp.down.get_value()
    assert qw.q.nbytes == st.get("model.layers.0.mlp.down_proj.qweight").nbytes
    assert qw.scales.size == st.get("model.layers.0.mlp.down_proj.scales").size
    assert qw.zeros.size == st.get("model.layers.0.mlp.down_proj.qzeros").size * 8


def _edit(src, dst, qc=None, tensors=None):
    shutil.copytree(src, dst)
    if qc:
        cfg = json.loads((dst / "config.json").read_text())
        qc(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        from safetensors.numpy import load_file, save_file
        t = load_file(str(dst / "model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("bits", [2, 3])
def test_gptq_low_bits_refused(made, tmp_path, bits):
    folder = _edit(made("gptq-4b-g32-sym")[0], tmp_path / "m", qc=lambda q: q.update(bits=bits))
    with pytest.raises(CheckpointError, match=f"'bits' = {bits} .*{bits}-bit GPTQ"):
        load_model(folder, "float32")


def test_gptq_qweight_shape_refused(made, tmp_path):
    """group_size 32 on a checkpoint packed with groups of 64: scales disagree; a qweight of the
    wrong bit width: it names the tensor and the shape it expected."""
    folder = _edit(made("gptq-4b-g64-asym")[0], tmp_path / "a", qc=lambda q: q.update(group_size=32))
    with pytest.raises(CheckpointError, match=r"self_attn\.q_proj\.scales has shape \(1, 64\); expected \(2, 64\)"):
        load_model(folder, "float32")
    folder = _edit(made("gptq-4b-g64-asym")[0], tmp_path / "b", tensors=lambda t: t.update({
        "model.layers.0.mlp.down_proj.qweight": np.zeros((32, 64), np.int32)}))
    with pytest.raises(CheckpointError, match=r"mlp\.down_proj\.qweight has shape \(32, 64\) int32; "
                                              r"expected int32 \(16, 64\)"):
        load_model(folder, "float32")


@pytest.mark.parametrize("case", sorted(DESC_ACT))
def test_gptq_desc_act(made, case):
    """desc_act: g_idx an activation order; rows reordered at load (QuantizedWeight.perm), x gathered."""
    folder, ref = made(case)
    model, ours = _ours(folder)
    qw = model.layers[0].attn.q.get_value()
    g_idx = np.asarray(load_model.__globals__["SafetensorsFolder"](folder).get("model.layers.0.self_attn.q_proj.g_idx"))
    assert qw.perm is not None and not np.array_equal(np.asarray(qw.perm), np.arange(64))
    assert np.array_equal(g_idx[np.asarray(qw.perm)], np.arange(64) // DESC_ACT[case][1])   # groups contiguous
    assert_rel_close(ours, pm.logits(ref, IDS), F32_RTOL, case)


def test_gptq_desc_act_generator_and_native_roundtrip(made, tmp_path):
    """Fused projections share the row order; the native format stores it."""
    from jaxinfer import Generator
    from jaxinfer.weights import save_native
    folder, ref = made("gptq-4b-g32-asym-desc")
    gen = Generator.from_pretrained(str(folder), dtype="float32", warmup=False, max_model_len=32,
                                    max_num_seqs=2, num_blocks=5)
    assert_rel_close(gen.logits(IDS), pm.logits(ref, IDS), F32_RTOL, "generator desc_act")
    model, _ = load_model(folder, "float32")
    save_native(model, tmp_path / "native", "float32")
    _, again = _ours(tmp_path / "native")
    assert_rel_close(again, pm.logits(ref, IDS), F32_RTOL, "native round trip")


def test_gptq_bad_g_idx_refused(made, tmp_path):
    folder = _edit(made("gptq-4b-g32-sym")[0], tmp_path / "m", tensors=lambda t: t.update({
        "model.layers.0.self_attn.k_proj.g_idx": np.zeros(64, np.int32)}))
    with pytest.raises(CheckpointError, match=r"k_proj\.g_idx does not assign 32 input rows to each of the 2 groups"):
        load_model(folder, "float32")


@pytest.mark.parametrize("field,value,needle", [
    ("checkpoint_format", "marlin", "'checkpoint_format' = 'marlin'"),
    ("dynamic", {"-:.*down.*": {}}, "'dynamic'"),
    ("some_future_field", 3, "'some_future_field'"),
])
def test_gptq_fields_refused(made, tmp_path, field, value, needle):
    folder = _edit(made("gptq-4b-g32-sym")[0], tmp_path / "m", qc=lambda q: q.update({field: value}))
    with pytest.raises(CheckpointError, match=needle):
        load_model(folder, "float32")


@pytest.mark.parametrize("version", ["gemv", "gemv_fast", "marlin", "exllama", "ipex"])
def test_awq_other_versions_refused(made, tmp_path, version):
    folder = _edit(made("awq-g32")[0], tmp_path / "m", qc=lambda q: q.update(version=version))
    with pytest.raises(CheckpointError, match=f"'version' = '{version}'.*gemm"):
        load_model(folder, "float32")


def test_awq_modules_to_not_convert(made, tmp_path):
    """A module AWQ left in float (modules_to_not_convert) is read as float."""
    import torch
    folder, ref = made("awq-g32")
    src_w = pm.awq_dequantize({k: torch.from_numpy(np.array(v)) for k, v in (
        (n, load_model.__globals__["SafetensorsFolder"](folder).get(f"model.layers.0.mlp.down_proj.{n}"))
        for n in ("qweight", "qzeros", "scales"))}, 32)

    def floats(t):
        for n in ("qweight", "qzeros", "scales"):
            del t[f"model.layers.0.mlp.down_proj.{n}"]
        t["model.layers.0.mlp.down_proj.weight"] = src_w.numpy()
    folder2 = _edit(folder, tmp_path / "m", qc=lambda q: q.update(modules_to_not_convert=["model.layers.0.mlp.down_proj"]),
                    tensors=floats)
    model, ours = _ours(folder2)
    assert not isinstance(model.layers[0].mlp.down.get_value(), QuantizedWeight)
    assert isinstance(model.layers[0].mlp.up.get_value(), QuantizedWeight)
    assert_rel_close(ours, pm.logits(ref, IDS), dot_chain_rtol(64, 64, 64, 128, 64, 64, 64, 128, 64), "awq skip")


def test_serve_gptq_folder(tmp_path):
    """`jaxinfer serve --model FOLDER` builds Generator.from_pretrained(FOLDER) and serve.app.build_app
    on it (cli.cmd_serve): the same, in process. A GPTQ folder with a tokenizer answers /v1/completions
    with transformers' greedy continuation on GPTQModel's dequantized weights."""
    import torch
    from fastapi.testclient import TestClient
    from transformers import LlamaForCausalLM

    from jaxinfer import Generator
    from serve.app import build_app
    from tests.hf_models import save_text_model

    text = save_text_model(tmp_path / "text")
    folder, ref = pm.save_gptq(tmp_path / "gptq", 4, 32, True, model=LlamaForCausalLM.from_pretrained(str(text)).eval())
    shutil.copy(text / "tokenizer.model", folder / "tokenizer.model")
    prompt = [1, 17, 42, 99, 250, 7]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    gen = Generator.from_pretrained(str(folder), dtype="float32", warmup=False, max_model_len=64,
                                    max_num_seqs=2, num_blocks=9)
    with TestClient(build_app(gen, "gptq")) as client:
        r = client.post("/v1/completions", json={"model": "gptq", "prompt": prompt, "max_tokens": 6,
                                                 "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == gen.tokenizer.decode(ids[len(prompt):])


def _rewrite(src, dst, names=None, config=None):
    """A copy of a checkpoint folder with its tensors renamed (names: old -> new) and its
    config.json edited in place (config(cfg))."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    if names is not None:
        for f in dst.glob("*.safetensors"):
            save_file({names(k): v for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("case", ["gptq-4b-g64-asym", "awq-g32"])
def test_tensors_without_the_model_prefix_load_quantized(made, tmp_path, case):
    """A bare model's names ("layers.0...", as embedding models ship) reach the quantized readers as
    they reach the float loader: the same codes, the same logits (they were not seen as quantized:
    refused, or for fp8 / int8 codes read as floats)."""
    folder, ref = made(case)
    bare = _rewrite(folder, tmp_path / "bare", names=lambda k: k[len("model."):] if k.startswith("model.") else k)
    model, ours = _ours(bare)
    assert isinstance(model.layers[1].mlp.up.get_value(), QuantizedWeight)
    assert_rel_close(ours, pm.logits(ref, IDS), F32_RTOL, case)


def test_configs_as_transformers_writes_them_load(made, tmp_path):
    """transformers 5's AwqConfig (a GPTQConfig) writes its calibration fields and `format` beside
    `version`; older GPTQConfig writes disable_exllama / model_seqlen: none changes the stored codes,
    so each loads as the producer's own config does; a format that contradicts version is refused."""
    from transformers import AwqConfig

    folder, ref = made("awq-g32")
    resaved = _rewrite(folder, tmp_path / "awq", config=lambda c: c.update(quantization_config=json.loads(
        json.dumps(AwqConfig.from_dict(c["quantization_config"]).to_dict(), default=str))))
    assert "damp_percent" in json.loads((resaved / "config.json").read_text())["quantization_config"]
    assert_rel_close(_ours(resaved)[1], pm.logits(ref, IDS), F32_RTOL, "awq resaved")
    bad = _rewrite(folder, tmp_path / "awq-bad", config=lambda c: c["quantization_config"].update(format="gemv"))
    with pytest.raises(CheckpointError, match="format"):
        load_model(bad, "float32")
    folder, ref = made("gptq-4b-g64-asym")
    old = _rewrite(folder, tmp_path / "gptq", config=lambda c: c["quantization_config"].update(
        disable_exllama=True, model_seqlen=2048))
    assert_rel_close(_ours(old)[1], pm.logits(ref, IDS), F32_RTOL, "gptq optimum config")


def test_gptq_experts_refused_naming_them(tmp_path):
    """A GPTQ mixture of experts, each expert's gate / up / down packed as GPTQModel writes them:
    refused naming the experts' tensors (never read as a fused experts tensor it does not hold)."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.hf_models import save_hf_model
    folder = Path(save_hf_model("qwen3moe-gqa", tmp_path / "m"))
    state = load_file(folder / "model.safetensors")
    for name in [n for n in state if ".experts." in n and n.endswith("_proj.weight")]:
        packed = pm.gptq_pack(state.pop(name).float(), 4, 32, True, False)
        state.update({f"{name[:-len('.weight')]}.{k}": v for k, v in packed.items()})
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
                                  "checkpoint_format": "gptq"}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert torch.is_tensor(state["model.layers.0.mlp.experts.0.gate_proj.qweight"])
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj.*one tensor per expert"):
        load_model(folder, "float32")
