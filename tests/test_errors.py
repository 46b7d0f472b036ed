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


def test_a_model_config_refusal_names_the_fields_set_even_with_an_array_among_them():
    """ModelConfig's refusal lists the fields that differ from their defaults; a field holding a numpy
    array (a programmatic caller's sliding_layers) is shown, not compared into a ValueError."""
    import numpy as np

    from jaxinfer.config import ModelConfig
    with pytest.raises(ConfigError, match=r"invalid ModelConfig field\(s\) \['norm'\].*sliding_layers=array"):
        ModelConfig(vocab_size=10, d_model=8, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=4, ffn_dim=8,
                    norm="bogus", sliding_layers=np.array([True, False]))


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("field,value,needle", [
    ("hidden_size", "256", "'hidden_size' must be a positive integer, got '256'"),
    ("num_attention_heads", 4.5, "'num_attention_heads' must be a positive integer"),
    ("rms_norm_eps", "tiny", "'rms_norm_eps' must be a number"),
    ("max_position_embeddings", 1e9, "'max_position_embeddings' must be a positive integer"),
    ("max_position_embeddings", 10**9, "'max_position_embeddings' = 1000000000 is beyond"),
])
def test_config_field_of_wrong_type_or_size_is_one_clear_line(hf_model_dir, tmp_path, capsys, field, value, needle):
    from jaxinfer.cli import main

    folder = _edit_config(hf_model_dir("llama-gqa-llama3"), tmp_path / "m", **{field: value})
    with pytest.raises(ConfigError, match="config.json: field " + needle.replace("(", r"\(")):
        _load(folder)
    capsys.readouterr()   # (transformers' progress bar, where this test is the first to save the model)
    assert main(["generate", "--model", str(folder), "--ids", "1,2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json" in err and field in err and "Traceback" not in err


def test_native_config_field_of_wrong_type_names_file_and_field(tmp_path):
    from jaxinfer.weights import save_native

    src = tmp_path / "native"
    save_native(_tiny_native_model(tmp_path), src, "float32")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model"]["d_model"] = "64"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: .*d_model='64' must be an integer"):
        _load(src)


def test_truncated_native_checkpoint_is_one_line_naming_the_tensor(tmp_path):
    from jaxinfer.weights import save_native

    src = tmp_path / "native"
    save_native(_tiny_native_model(tmp_path), src, "float32")
    data = max((src / "params").rglob("d/*"), key=lambda p: p.stat().st_size)   # the largest data file
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError) as e:
        _load(src)
    message = str(e.value)
    assert len(message.splitlines()) == 1 and len(message) < 600, message
    assert str(src / "params") in message and "cannot restore tensor '" in message and "truncated" in message


def _tiny_native_model(tmp_path):
    from jaxinfer.weights import load_model

    folder = tmp_path / "hf"
    build_hf_model("llama-gqa-llama3").save_pretrained(folder)
    return load_model(folder, "float32")[0]


def test_a_pool_too_small_for_max_model_len_is_refused(tmp_path):
    """--num-blocks 20: the model's 256 positions do not fit in 19 blocks of 8 tokens. The engine
    refuses to start, naming the numbers and what to change (as vLLM does), instead of silently
    shortening the context; with max_model_len 152 (what the error offers) it serves, and a chat
    without max_tokens fills exactly the pool."""
    from serve.app import ServerState
    from serve.protocol import ChatCompletionRequest
    from tests.hf_models import save_text_model

    model = save_text_model(tmp_path / "model")   # max_position_embeddings 256
    kw = dict(dtype="float32", num_blocks=20, block_size=8, max_num_seqs=2, max_num_batched_tokens=16, warmup=False)
    for max_model_len, what in ((None, "max_model_len (the model's max_position_embeddings)"), (256, "max_model_len")):
        with pytest.raises(ConfigError) as err:
            Generator.from_pretrained(model, max_model_len=max_model_len, **kw)
        assert (f"cannot hold one sequence of {what} = 256 tokens: num_blocks=20 holds 152 tokens (19 blocks of 8" in str(err.value)
                and "Set num_blocks to at least 33, or max_model_len to at most 152" in str(err.value)), str(err.value)
    gen = Generator.from_pretrained(model, max_model_len=152, **kw)
    assert gen.engine.max_model_len == 152
    state = ServerState(gen, "tiny", None, max_queue=8)
    prompt, params = state.chat_inputs(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]))
    assert len(prompt) + params.max_tokens == 152
    rid = gen.engine.add_request(prompt, params)
    gen.abort(rid)
    assert gen.stats()["kv_blocks_used"] == 0
