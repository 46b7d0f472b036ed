"""A model's default sampling parameters (jaxinfer/generation_defaults.py), as vLLM takes them:
generation_config.json's temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens
(as max_tokens) for every field a request leaves out (vLLM's ModelConfig.get_diff_sampling_param
and its requests' to_sampling_params, transcribed: a field set in the file and not null is taken,
do_sample is not read); --generation-config vllm ignores the file; --override-generation-config
is merged over it. Expected values are the hand-written files' own."""
from __future__ import annotations

import json

import pytest

from jaxinfer import Generator
from jaxinfer.config import SamplingParams
from jaxinfer.generation_defaults import sampling_defaults

QWEN3_LIKE = {"bos_token_id": 1, "eos_token_id": [2], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
              "top_k": 20, "min_p": None, "max_new_tokens": 32, "transformers_version": "4.51.0"}


def test_defaults_read_as_vllm_reads_them(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3_LIKE))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 32}
    assert sampling_defaults(tmp_path, "vllm") == {}
    assert sampling_defaults(tmp_path, "vllm", {"temperature": 0.2}) == {"temperature": 0.2}
    assert sampling_defaults(tmp_path, "auto", {"top_k": 5, "repetition_penalty": 1.1}) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 5, "repetition_penalty": 1.1, "max_tokens": 32}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert sampling_defaults(tmp_path, str(other)) == {"temperature": 0.3}        # a folder of its own
    assert sampling_defaults(tmp_path / "none") == {}                              # no file: nothing
    with pytest.raises(ValueError, match="neither auto, vllm nor a folder"):
        sampling_defaults(tmp_path, "hf")
    (other / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults(tmp_path, str(other))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny SentencePiece Llama with a generation_config.json recommending top_k 1 (greedy
    whatever the temperature), temperature 0.3 and max_new_tokens 4."""
    from tests.hf_models import save_text_model
    folder = save_text_model(tmp_path_factory.mktemp("gen") / "m")
    cfg = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**cfg, "top_k": 1, "temperature": 0.3, "max_new_tokens": 4}))
    return folder


def test_requests_that_leave_fields_out_take_the_models_defaults(model):
    from fastapi.testclient import TestClient

    from serve.app import build_app
    kw = dict(dtype="float32", max_model_len=64, max_num_seqs=4, token_buckets=[16], max_num_batched_tokens=16)
    g = Generator.from_pretrained(model, **kw, warmup=False)
    assert g.default_sampling_params() == SamplingParams(top_k=1, temperature=0.3, max_tokens=4)
    prompt = "the lazy dog"
    greedy = g.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
    assert len(greedy) == 4
    assert g.generate(prompt)[0].token_ids == greedy[:len(g.generate(prompt)[0].token_ids)]
    with TestClient(build_app(g, "m")) as client:
        # chat without max_tokens: the file's max_new_tokens; top_k 1 whatever the temperature
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": prompt}], "ignore_eos": True, "temperature": 1.5, "seed": 3,
            "return_token_ids": True}).json()
        want = g.generate(chat["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=4,
                                                                   ignore_eos=True))[0].token_ids
        assert chat["choices"][0]["token_ids"] == want and chat["usage"]["completion_tokens"] == 4
        # completions' max_tokens defaults to 16 (OpenAI's and vLLM's), so the file's does not apply
        body = client.post("/v1/completions", json={"prompt": prompt, "ignore_eos": True, "seed": 3,
                                                    "temperature": 1.5}).json()
        assert body["usage"]["completion_tokens"] == 16
        assert body["choices"][0]["text"].startswith(g.tokenizer.decode(greedy[:3]))
        longer = client.post("/v1/completions", json={"prompt": prompt, "ignore_eos": True, "max_tokens": 6,
                                                      "top_k": 0, "temperature": 0}).json()
        assert longer["usage"]["completion_tokens"] == 6                       # a request's own values win
        beam = client.post("/v1/completions", json={"prompt": prompt, "use_beam_search": True, "n": 2,
                                                    "max_tokens": 3})
        assert beam.status_code == 200, beam.text                              # no default reaches the search
        resp = client.post("/v1/responses", json={"input": prompt, "max_output_tokens": 2}).json()
        assert resp["temperature"] == 0.3 and resp["top_p"] == 1.0           # the response reports what ran
    g.close()
    g = Generator.from_pretrained(model, **kw, warmup=False, generation_config="vllm",
                                  override_generation_config='{"temperature": 0.25, "max_new_tokens": 5}')
    assert g.default_sampling_params() == SamplingParams(temperature=0.25, max_tokens=5)
    with TestClient(build_app(g, "m")) as client:   # the override's max_new_tokens caps every request
        body = client.post("/v1/completions", json={"prompt": prompt, "ignore_eos": True, "max_tokens": 9}).json()
        assert body["usage"]["completion_tokens"] == 5
    g.close()


def test_flags(model):
    from jaxinfer.cli import build_parser
    from jaxinfer.config.flags import engine_kwargs
    args = engine_kwargs(build_parser().parse_args(["serve", "--generation-config", "vllm",
                                                    "--override-generation-config", '{"top_p": 0.5}']))
    assert args["generation_config"] == "vllm" and json.loads(args["override_generation_config"]) == {"top_p": 0.5}
