"""`jaxinfer convert` and `jaxinfer generate` end to end (in-process; argparse and all)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxinfer.cli import main
from tests.hf_models import build_hf_model


def test_convert_then_generate_matches_hf(hf_model_dir, tmp_path, capsys):
    src = hf_model_dir("mistral-window")
    out = tmp_path / "native"
    assert main(["convert", src, str(out), "--dtype", "float32"]) == 0
    assert json.loads((out / "config.json").read_text())["format"] == "jaxinfer"
    ids = [5, 17, 42, 8, 99, 3, 61]
    # --max-num-batched-tokens 8: `generate` warms up every token bucket, and the default (256) would
    # compile six step shapes for a 7-token prompt; with 8 it compiles one
    assert main(["generate", "--model", str(out), "--dtype", "float32", "--ids", ",".join(map(str, ids)),
                 "--max-tokens", "12", "--ignore-eos", "--json", "--max-num-batched-tokens", "8"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with torch.no_grad():
        ref = build_hf_model("mistral-window").generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                                        eos_token_id=None, pad_token_id=0)[0, len(ids):]
    assert line["token_ids"] == ref.tolist()
    assert line["finish_reason"] == "length"


def test_export_hf_round_trip_loads_in_transformers(hf_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    for name in ("llama-gqa-llama3", "qwen2-window", "mistral-window"):
        src = hf_model_dir(name)
        assert main(["export-hf", str(tmp_path / name), "--model", src]) == 0
        ref = build_hf_model(name)
        back = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        ids = torch.tensor([[5, 9, 33, 2, 41, 7, 19, 60, 3, 11]])
        with torch.no_grad():
            np.testing.assert_allclose(back(ids).logits.numpy(), ref(ids).logits.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
     "beta_fast": 16.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
     "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]},
])
def test_export_hf_keeps_yarn_and_longrope(tmp_path, rope):
    """YaRN's and LongRoPE's parameters reach the exported config (only `factor` did: the YaRN
    export was another model, 3e-3 off in its logits, and transformers refused the LongRoPE one),
    so transformers computes the same logits on the export as on the original over 100 positions."""
    from transformers import AutoModelForCausalLM
    from tests.hf_models import save_hf_model
    src = tmp_path / "src"
    save_hf_model("llama-gqa-llama3", src, overrides={"rope_scaling": None, "rope_parameters": rope,
                                                      "max_position_embeddings": 128})
    assert main(["export-hf", str(tmp_path / "out"), "--model", str(src)]) == 0
    ids = torch.tensor([list(np.random.default_rng(0).integers(3, 90, size=100))])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(src).eval()(ids).logits.numpy()
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(ids).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_export_hf_refuses_quantized_weights(hf_model_dir, tmp_path, capsys):
    """A quantized model is refused by name with exit code 2 (it crashed with a TypeError)."""
    src = tmp_path / "q"
    # --bits 8 alone: 8-bit weights are per channel (the method's w4 group size 128 was taken, and refused)
    assert main(["quantize", hf_model_dir("llama-gqa-llama3"), str(src), "--method", "rtn", "--bits", "8"]) == 0
    assert json.loads((src / "config.json").read_text())["quantization"]["group_size"] == -1
    assert main(["export-hf", str(tmp_path / "x"), "--model", str(src)]) == 2
    assert "quantized" in capsys.readouterr().err


@pytest.mark.parametrize("flags,needle", [(["--calib-window", "999"], "longer than the model's context (256 positions)"),
                                          (["--calib-window", "0"], "--calib-window must be >= 1"),
                                          (["--calib-tokens", "-5"], "--calib-tokens and --calib-window must be >= 1")])
def test_quantize_refuses_calibration_windows_it_cannot_run(hf_model_dir, tmp_path, capsys, flags, needle):
    """Calibration (and QAT) windows start at position 0, so one longer than the context would read
    positions the model does not have (learned position tables clamp them silently); empty or
    negative sizes are refused by name (a ZeroDivisionError, or all but the last N tokens)."""
    assert main(["quantize", hf_model_dir("llama-gqa-llama3"), str(tmp_path / "q"), "--method", "gptq", *flags]) == 2
    assert needle in capsys.readouterr().err


def test_export_hf_refuses_other_families(hf_model_dir, tmp_path, capsys):
    assert main(["export-hf", str(tmp_path / "x"), "--model", hf_model_dir("gpt2")]) == 2
    assert "Llama family" in capsys.readouterr().err


@pytest.fixture
def jax_cache_config():
    """jax's own defaults for its cache settings during the test (no folder, a 1 s threshold; the
    test process's own cache from conftest is set aside), the process's settings restored after
    it, and jax's cache object reset both times: once jax has compiled with a folder it keeps
    writing there for the process."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cc

    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    jax_cc.reset_cache()
    yield (None, 1.0)
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    jax_cc.reset_cache()


def test_compilation_cache_folder_from_env_or_off(monkeypatch, tmp_path, jax_cache_config):
    import jax

    from jaxinfer.compilation_cache import enable_compilation_cache
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("JAXINFER_COMPILATION_CACHE", "off")     # what conftest sets for every test
    assert enable_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir == before
    monkeypatch.setenv("JAXINFER_COMPILATION_CACHE", str(tmp_path / "xla"))
    try:
        assert enable_compilation_cache() == str(tmp_path / "xla")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
        # jax keeps only executables that took >= 1 s to compile unless told otherwise: every one here
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
        # idempotent: a second call (the CLI's, then the Generator's) changes nothing
        monkeypatch.setenv("JAXINFER_COMPILATION_CACHE", str(tmp_path / "other"))
        assert enable_compilation_cache() == str(tmp_path / "xla")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_compilation_cache_never_overrides_the_users_folder_or_threshold(monkeypatch, tmp_path, jax_cache_config):
    import jax

    from jaxinfer.compilation_cache import enable_compilation_cache
    monkeypatch.setenv("JAXINFER_COMPILATION_CACHE", str(tmp_path / "ours"))
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    assert enable_compilation_cache() == str(tmp_path / "theirs")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == jax_cache_config[1] == 1.0
    # a threshold of the user's own stays too
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.5)
    assert enable_compilation_cache() == str(tmp_path / "ours")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5
    # $JAX_COMPILATION_CACHE_DIR, which jax reads into the same setting when it is imported
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "env"),
               JAXINFER_COMPILATION_CACHE=str(tmp_path / "ours"))
    out = subprocess.run([sys.executable, "-c", "import jax; from jaxinfer.compilation_cache import "
                          "enable_compilation_cache as e; print(e(), jax.config.jax_compilation_cache_dir)"],
                         env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
    assert out.stdout.split() == [str(tmp_path / "env")] * 2


def test_generator_turns_the_compilation_cache_on(hf_model_dir, monkeypatch, tmp_path, jax_cache_config):
    """The Python API (and so the server and the batch script) gets the cache, not only the CLI:
    a Generator's own compiles land in the folder; "off" and a user's folder are left alone."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cc

    from jaxinfer import Generator
    src = hf_model_dir("llama-gqa-llama3")
    monkeypatch.setenv("JAXINFER_COMPILATION_CACHE", "off")
    Generator.from_pretrained(src, dtype="float32", max_num_seqs=2, warmup=False)
    assert jax.config.jax_compilation_cache_dir is None

    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    monkeypatch.setenv("JAXINFER_COMPILATION_CACHE", str(tmp_path / "xla"))
    Generator.from_pretrained(src, dtype="float32", max_num_seqs=2, warmup=False)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs")
    jax.config.update("jax_compilation_cache_dir", None)
    jax_cc.reset_cache()         # as in a new process: jax keeps the folder it first compiled with
    # what jax wrote into the user's folder while it was set (loading compiles the fused projections'
    # column shuffles); nothing may be added to it from here on
    theirs = lambda: sorted(p.name for p in (tmp_path / "theirs").iterdir()) if (tmp_path / "theirs").exists() else []  # noqa: E731
    theirs_before = theirs()

    gen = Generator.from_pretrained(src, dtype="float32", max_num_seqs=2, warmup=False)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    gen.logits([5, 9, 33])       # a fresh jit of this Generator's: compiled now, so written now
    written = [p.name for p in (tmp_path / "xla").iterdir()]
    assert any(name.startswith("jit__lambda") for name in written), written
    assert theirs() == theirs_before


def test_export_hf_tokenizer_reads_the_same_in_transformers(tmp_path):
    """The bundled model's SentencePiece has no dummy prefix: without tokenizer_config.json saying
    add_prefix_space false, transformers (and llama.cpp's converter) read "And" as "_And"."""
    from transformers import AutoTokenizer

    from jaxinfer.generator import default_model_path
    from jaxinfer.tokenizer import load_tokenizer

    out = tmp_path / "hf"
    assert main(["export-hf", str(out)]) == 0
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["add_prefix_space"] is False and config["add_bos_token"] is True
    ours = load_tokenizer(default_model_path())
    theirs = AutoTokenizer.from_pretrained(out)
    texts = ["And God said", " And God said", "hello  world\n\nfoo", "Ünïcode ☃ 123", "  lead", "x<s>y</s>z",
             "\tTab  \n ", "end. ", "Let there be light: and there was light."]
    for text in texts:
        assert theirs.encode(text) == ours.encode(text), text
        assert theirs.decode(theirs.encode(text), skip_special_tokens=True) == ours.decode(ours.encode(text))
    assert ours.encode("And God said") == [1, 313, 415, 411]   # the example
    assert theirs.eos_token_id == ours.eos_ids[0] and theirs.bos_token_id == ours.bos_id


# ------------------------------------------------------------------------------ engine flags from EngineConfig
def _parse(*argv: str):
    from jaxinfer.cli import build_parser
    return build_parser().parse_args(list(argv))


def test_engine_flags_default_to_engine_config():
    """Every engine setting has a flag on serve and batch, at EngineConfig's default; generate has all
    but max_num_seqs (its --n), with its own smaller step budget."""
    from jaxinfer.config import EngineConfig, settings
    from jaxinfer.config.flags import engine_kwargs

    defaults = {f.name: getattr(EngineConfig(), f.name) for f in settings()}
    for cmd in (["serve"], ["batch", "in.jsonl", "out.jsonl"]):
        assert engine_kwargs(_parse(*cmd)) == {**defaults, "speculative_model": None}, cmd
    without_batch = {k: v for k, v in defaults.items() if k != "max_num_seqs"}
    assert engine_kwargs(_parse("generate", "hi")) == {**without_batch, "speculative_model": None,
                                                       "max_num_batched_tokens": 256}
    assert _parse("eval-ppl").dtype == "float32"


def test_every_existing_engine_flag_name_still_parses():
    from jaxinfer.config.flags import engine_kwargs

    flags = ["--dtype", "float32", "--max-num-seqs", "3", "--max-num-batched-tokens", "32", "--max-model-len", "128",
             "--block-size", "8", "--num-blocks", "40", "--gpu-memory-utilization", "0.5", "--batching", "static",
             "--kv-dtype", "int8", "--max-decode-steps", "2", "--no-async-scheduling", "--no-prefix-caching",
             "--speculative-method", "ngram", "--speculative-model", "heads", "--num-speculative-tokens", "3",
             "--speculative-max-batch", "2", "--tensor-parallel", "2"]
    want = dict(dtype="float32", max_num_seqs=3, max_num_batched_tokens=32, max_model_len=128, block_size=8,
                num_blocks=40, memory_fraction=0.5, batching="static", kv_dtype="int8", max_decode_steps=2,
                async_scheduling=False, enable_prefix_caching=False, speculative_method="ngram",
                speculative_model="heads", num_speculative_tokens=3, speculative_max_batch=2, tensor_parallel=2)
    for cmd in (["serve"], ["batch", "in.jsonl", "out.jsonl"]):
        got = engine_kwargs(_parse(*cmd, *flags, "--served-model-name", "m", "--coordinator-address", "h:1",
                                   "--num-processes", "2", "--process-id", "1"))
        assert {k: got[k] for k in want} == want, cmd
    assert _parse("serve", "--memory-fraction", "0.25").memory_fraction == 0.25   # the older alias
    gen_flags = [f for i, f in enumerate(flags) if f != "--max-num-seqs" and flags[i - 1] != "--max-num-seqs"]
    got = engine_kwargs(_parse("generate", "--ids", "1,2", "--n", "2", *gen_flags))
    assert {k: got[k] for k in want if k != "max_num_seqs"} == {k: v for k, v in want.items() if k != "max_num_seqs"}
    with pytest.raises(SystemExit):
        _parse("serve", "--batching", "eager")          # choices come from BATCHING_CHOICES


def test_token_buckets_flag_and_resolution():
    """--token-buckets T ... reaches EngineConfig sorted and without repeats; resolution adds the
    budget, defaults to the powers of two from 8 (listed by hand), and refuses a size over the budget
    or a value that is not an integer >= 1, naming it."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.config.flags import engine_kwargs
    from jaxinfer.config.resolve import resolve_token_buckets

    kw = engine_kwargs(_parse("serve", "--token-buckets", "64", "16", "64"))
    assert kw["token_buckets"] == [64, 16, 64]
    assert EngineConfig(token_buckets=kw["token_buckets"]).token_buckets == (16, 64)
    assert _parse("serve").token_buckets is None
    assert resolve_token_buckets(None, 512) == (8, 16, 32, 64, 128, 256, 512)
    assert resolve_token_buckets(None, 100) == (8, 16, 32, 64, 100)
    assert resolve_token_buckets(None, 8) == (8,)
    assert resolve_token_buckets((16, 64), 512) == (16, 64, 512)
    assert resolve_token_buckets((16,), 16) == (16,)
    with pytest.raises(ValueError, match=r"token_buckets \[1024\] exceed max_num_batched_tokens=512"):
        resolve_token_buckets((16, 1024), 512)
    for bad in ([], [0, 16], ["16"], [True], 16, "16"):
        with pytest.raises(ValueError, match="token_buckets must be"):
            EngineConfig(token_buckets=bad)
    with pytest.raises(SystemExit):
        _parse("serve", "--token-buckets", "sixteen")


def test_bench_engine_flags_keep_their_names():
    off = _parse("bench", "offline", "--max-num-batched-tokens", "64", "--max-model-len", "96", "--block-size", "8",
                 "--num-blocks", "30", "--kv-dtype", "fp8", "--no-prefix-caching", "--speculative-method", "draft",
                 "--speculative-model", "d", "--num-speculative-tokens", "2", "--speculative-max-batch", "4")
    assert (off.max_num_batched_tokens, off.max_model_len, off.block_size, off.num_blocks, off.kv_dtype,
            off.enable_prefix_caching, off.speculative_method, off.speculative_model, off.num_speculative_tokens,
            off.speculative_max_batch) == (64, 96, 8, 30, "fp8", False, "draft", "d", 2, 4)
    assert off.dtype is None and _parse("bench", "offline").max_num_batched_tokens == 512
    assert _parse("bench", "serving", "--max-num-seqs", "5").max_num_seqs == 5
    assert _parse("bench", "serving").max_num_seqs == 64


def test_serve_flags_reach_from_pretrained(monkeypatch):
    """The flags arrive as from_pretrained's keywords, by name, with the multi-host ones."""
    from jaxinfer import Generator
    from jaxinfer.cli import _generator

    seen = {}
    monkeypatch.setattr(Generator, "from_pretrained", classmethod(lambda cls, path, **kw: seen.update(path=path, **kw)))
    _generator(_parse("serve", "--model", "m", "--max-num-seqs", "3", "--no-prefix-caching", "--process-id", "0"))
    assert seen["path"] == "m" and seen["max_num_seqs"] == 3 and seen["enable_prefix_caching"] is False
    assert seen["process_id"] == 0 and seen["memory_fraction"] == 0.9 and seen["speculative_model"] is None


def test_from_pretrained_keywords_are_engine_config_settings():
    """DESIGN.md's keywords at their defaults, every EngineConfig setting in the signature at its
    field's default, and an unknown keyword refused by name before anything loads."""
    import inspect

    from jaxinfer import Generator
    from jaxinfer.config import EngineConfig, settings

    params = inspect.signature(Generator.from_pretrained).parameters
    design = dict(path=None, dtype="auto", attention="auto", quantize=None, kv_dtype=None, tensor_parallel=1,
                  pipeline_parallel=1, max_num_seqs=64, block_size=16, num_blocks=None, batching="continuous",
                  enable_prefix_caching=True, speculative_method=None, speculative_model=None,
                  num_speculative_tokens=4, memory_fraction=0.9, max_model_len=None, max_num_batched_tokens=512,
                  warmup=True, coordinator_address=None, num_processes=None, process_id=None,
                  pipeline_microbatches=None, max_decode_steps=8, async_scheduling=True, speculative_max_batch=None)
    assert {k: params[k].default for k in design} == design
    assert {f.name: params[f.name].default for f in settings()} == \
        {f.name: getattr(EngineConfig(), f.name) for f in settings()}
    assert all(f.name in (Generator.from_pretrained.__doc__ or "") for f in settings())
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'"):
        Generator.from_pretrained(max_num_seq=4)


def test_bad_log_level_and_prompt_with_ids_refused_before_anything_loads(capsys):
    """--log-level takes uvicorn's levels (a typo crashed uvicorn after the model had loaded and
    compiled); `generate` with both a prompt and --ids is refused (the prompt was dropped)."""
    from jaxinfer.cli import cmd_generate
    with pytest.raises(SystemExit):
        _parse("serve", "--log-level", "warn")
    assert "invalid choice: 'warn'" in capsys.readouterr().err
    assert _parse("serve", "--log-level", "WARNING").log_level == "warning"
    with pytest.raises(SystemExit, match="not both"):
        cmd_generate(_parse("generate", "And God said", "--ids", "1,2,3"))
