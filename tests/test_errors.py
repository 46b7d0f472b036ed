"""Bad input gets one clear error naming the file, tensor or field."""
from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
import torch

from jaxinfer import Generator
from jaxinfer.config import ConfigError
from jaxinfer.weights import CheckpointError
from tests.hf_models import build_hf_model


def _load(path):
    return Generator.from_pretrained(path, dtype="float32", max_model_len=64, max_num_batched_tokens=16,
                                     max_num_seqs=2, warmup=False)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no such model folder"):
        _load(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        _load(tmp_path)


def test_missing_weights(hf_model_dir, tmp_path):
    shutil.copy(f"{hf_model_dir('gpt2')}/config.json", tmp_path)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        _load(tmp_path)


def test_missing_shard(tmp_path):
    build_hf_model("bloom").save_pretrained(tmp_path, max_shard_size="20KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        _load(tmp_path)


def test_truncated_safetensors_names_file_and_tensor(hf_model_dir, tmp_path):
    src = hf_model_dir("llama-gqa-llama3")
    shutil.copytree(src, tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated.*tensor '"):
        _load(tmp_path / "m")


def test_corrupt_header(hf_model_dir, tmp_path):
    shutil.copytree(hf_model_dir("gpt2"), tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[10:20] = b"\xff" * 10
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        _load(tmp_path / "m")


def test_wrong_shape_names_the_tensor(tmp_path):
    from safetensors.torch import save_file

    hf = build_hf_model("llama-gqa-llama3")
    hf.save_pretrained(tmp_path)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    name = "model.layers.1.mlp.up_proj.weight"
    sd[name] = torch.zeros(95, 64)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*\(95, 64\)"):
        _load(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import save_file

    hf = build_hf_model("gpt2")
    hf.save_pretrained(tmp_path)
    sd = {k: v.clone() for k, v in hf.state_dict().items() if "h.1.ln_2" not in k and "lm_head" not in k}
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"transformer\.h\.1\.ln_2"):
        _load(tmp_path)


def test_unknown_architecture(tmp_path, hf_model_dir):
    shutil.copytree(hf_model_dir("gpt2"), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="MambaForCausalLM"):
        _load(tmp_path / "m")


def test_string_prompt_without_tokenizer(hf_model_dir):
    gen = _load(hf_model_dir("gpt2"))
    with pytest.raises(ValueError, match="no tokenizer.*token ids"):
        gen.generate("hello")
    with pytest.raises(ValueError, match="no tokenizer"):
        gen.logits("hello")


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    from jaxinfer.cli import main

    assert main(["generate", "--model", str(tmp_path / "missing"), "hi"]) == 2
    err = capsys.readouterr().err
    assert "no such model folder" in err and "Traceback" not in err
