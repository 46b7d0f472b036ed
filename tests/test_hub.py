"""Models by Hugging Face id (issue 57): `--model ORG/NAME[@REVISION]` and
Generator.from_pretrained("ORG/NAME", revision=...) through huggingface_hub's cache, offline.

The cache is laid out as huggingface_hub lays it out (models--ORG--NAME/blobs/<hash>,
snapshots/<commit>/<file> -> ../../blobs/<hash>, refs/<branch or tag> holding the commit) from a tiny
model, under a temporary HF_HOME with HF_HUB_OFFLINE=1, in a subprocess (huggingface_hub reads its
environment when imported). References: HF transformers' greedy continuation of the same weights,
huggingface_hub's own pattern filter for what a download fetches, the files' bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx2
import pytest
import torch
from huggingface_hub.errors import RevisionNotFoundError
from huggingface_hub.utils import filter_repo_objects
from transformers import LlamaForCausalLM

from jaxinfer import hub
from tests.fake_devices import HANG_GUARD_S
from tests.hf_models import save_text_model

ROOT = Path(__file__).resolve().parent.parent
REPO = "tiny-org/tiny-llama"
MAIN = "a" * 40       # commit hashes: 40 hex digits, as the Hub's
TAGGED = "b" * 40


def lay_out_hf_cache(hf_home: Path, repo_id: str, folder: Path, refs: dict[str, str]) -> Path:
    """huggingface_hub's cache layout for repo_id with folder's files at every commit of refs
    ({ref name: commit}); returns the repository's cache folder."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for ref, commit in refs.items():
        (repo / "refs" / ref).write_text(commit)      # no newline, as huggingface_hub writes it
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True, exist_ok=True)
        for f in folder.iterdir():
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return repo


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_text_model(tmp_path_factory.mktemp("hub") / "model")


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, model_dir) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    lay_out_hf_cache(home, REPO, model_dir, {"main": MAIN, "v1": TAGGED})
    return home


SCRIPT = textwrap.dedent("""
    import json, os, sys
    from jaxinfer import Generator, SamplingParams
    from jaxinfer.cli import _served_name, build_parser
    from jaxinfer.hub import ModelSpecError, resolve_model_path
    out = {"main": str(resolve_model_path("tiny-org/tiny-llama")),
           "tag": str(resolve_model_path("tiny-org/tiny-llama@v1")),
           "kw": str(resolve_model_path("tiny-org/tiny-llama", revision="v1"))}
    errors = {}
    for spec in ("tiny-org/absent", "tiny-org/tiny-llama@nope", "not an id"):
        try:
            resolve_model_path(spec)
        except ModelSpecError as e:
            errors[spec] = str(e)
    out["errors"] = errors
    gen = Generator.from_pretrained("tiny-org/tiny-llama", revision="v1", dtype="float32", max_model_len=64,
                                    max_num_batched_tokens=16, max_num_seqs=2, warmup=False)
    o = gen.generate(["the quick brown fox"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    out["prompt"], out["tokens"] = o.prompt_token_ids, o.token_ids
    args = build_parser().parse_args(["serve", "--model", "tiny-org/tiny-llama@v1"])
    out["served"] = _served_name(args)
    os.makedirs("tiny-org/tiny-llama")      # a local folder of that name wins
    out["local"] = str(resolve_model_path("tiny-org/tiny-llama"))
    print("RESULT " + json.dumps(out))
""")


def test_offline_ids_resolve_through_the_cache(hf_home, model_dir, tmp_path):
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    repo = hf_home / "hub" / "models--tiny-org--tiny-llama"
    assert out["main"] == str(repo / "snapshots" / MAIN)
    assert out["tag"] == out["kw"] == str(repo / "snapshots" / TAGGED)
    for f in model_dir.iterdir():    # the snapshot's files are the model's bytes
        assert (Path(out["tag"]) / f.name).read_bytes() == f.read_bytes()
    absent = out["errors"]["tiny-org/absent"]
    assert "tiny-org/absent" in absent and "HF_HUB_OFFLINE=1" in absent and str(hf_home) in absent
    nope = out["errors"]["tiny-org/tiny-llama@nope"]
    assert "tiny-org/tiny-llama" in nope and "'nope'" in nope and "HF_HUB_OFFLINE" in nope
    assert "no such model folder (nor a Hugging Face model id" in out["errors"]["not an id"]
    assert out["served"] == REPO                      # vLLM's default: the id
    assert out["local"] == "tiny-org/tiny-llama"
    # the model loaded by id decodes as HF transformers does on the same weights
    hf = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([out["prompt"]]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(out["prompt"]):].tolist()
    assert out["tokens"] == ref


def test_download_fetches_only_what_the_model_needs():
    # a Llama repository's files as the Hub lists them (meta-llama/Llama-3.2-1B's shape, plus the
    # formats other repositories carry); huggingface_hub's own filter applies ALLOW_PATTERNS
    listing = ["config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
               "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
               "pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json",
               "original/consolidated.00.pth", "original/params.json", "original/tokenizer.model",
               "onnx/model.onnx", "model.gguf", "flax_model.msgpack", "tf_model.h5", "README.md", "LICENSE.txt",
               ".gitattributes", "USE_POLICY.md",
               # fnmatch's * crosses '/': safetensors in a subfolder, and Mistral's consolidated copy
               "original/model.safetensors", "onnx/model.safetensors", "consolidated.safetensors"]
    got = set(filter_repo_objects(listing, allow_patterns=list(hub.ALLOW_PATTERNS),
                                  ignore_patterns=list(hub.IGNORE_PATTERNS)))
    assert got == {"config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
                   "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt"}


def test_tokenizer_download_fetches_no_weights():
    """--tokenizer ORG/NAME: the tokenizer's files, its chat template and config.json (special ids),
    never the weights (the same listing, huggingface_hub's filter)."""
    listing = ["config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "tokenizer.model", "vocab.json", "merges.txt", "pytorch_model.bin", "original/tokenizer.model",
               "model.gguf", "onnx/tokenizer.json"]
    got = set(filter_repo_objects(listing, allow_patterns=list(hub.TOKENIZER_PATTERNS),
                                  ignore_patterns=list(hub.IGNORE_PATTERNS)))
    assert got == {"config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt"}


def test_download_fetches_a_sentence_transformers_models_modules():
    """An embedding model's repository (Qwen3-Embedding's shape): the module list and prompts at the
    top, then the Pooling module's folder named by modules.json (they were never fetched: the model
    loaded as a plain causal LM or failed)."""
    listing = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "modules.json",
               "config_sentence_transformers.json", "1_Pooling/config.json", "README.md", "onnx/model.onnx"]
    first = set(filter_repo_objects(listing, allow_patterns=list(hub.ALLOW_PATTERNS),
                                    ignore_patterns=list(hub.IGNORE_PATTERNS)))
    assert first == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "modules.json",
                     "config_sentence_transformers.json"}
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    assert set(filter_repo_objects(listing, allow_patterns=hub.module_patterns(modules))) == {"1_Pooling/config.json"}


def test_unknown_revision_online_is_one_clear_error(monkeypatch):
    import huggingface_hub

    def refuse(repo_id, revision=None, **_):
        raise RevisionNotFoundError(f"404 revision {revision}", response=httpx2.Response(
            404, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{repo_id}/revision/{revision}")))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(hub.ModelSpecError, match=r"tiny-org/x: revision 'v9' does not exist on the Hugging Face Hub"):
        hub.resolve_model_path("tiny-org/x@v9")
    with pytest.raises(hub.ModelSpecError, match="two revisions given"):
        hub.resolve_model_path("tiny-org/x@v1", revision="v2")


def test_a_revision_needs_a_hub_id():
    """revision= with no model (the bundled one has no revisions) is refused before anything loads,
    as with a local folder (it was ignored)."""
    from jaxinfer import Generator
    with pytest.raises(hub.ModelSpecError, match="revision='v1' applies to Hugging Face ids"):
        Generator.from_pretrained(None, revision="v1")


def test_served_name_and_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.served_name("org/name@rev", tmp_path) == "org/name"
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.served_name("org/name", tmp_path) == "name"          # the local folder wins
    assert hub.resolve_model_path("org/name") == Path("org/name")
    with pytest.raises(hub.ModelSpecError, match="applies to Hugging Face ids"):
        hub.resolve_model_path("org/name", revision="main")
