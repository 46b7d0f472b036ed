"""Prompt logprobs (issue 57): SamplingParams(prompt_logprobs=k), completions' `echo` with `logprobs`
in OpenAI's legacy shape, `max_tokens: 0` with echo, vLLM's `prompt_logprobs` extension on
completions and chat, and the refusals (echo on chat, k over the server's limit, streamed prompt
logprobs).

References: HF transformers' log_softmax of its own forward on the same weights (values, ranks and
top-k ids), with tolerances from the arithmetic (tests/precision.py); the request alone for batch
invariance; the prompt's own text for echo.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import LlamaForCausalLM

from jaxinfer import Generator, SamplingParams
from jaxinfer.config import MAX_PROMPT_LOGPROBS
from serve.app import build_app
from tests.hf_models import save_text_model
from tests.precision import assert_rel_close, attention_rtol, dot_chain_rtol

# the text model: d_model 64, ffn 96, 2 layers, head_dim 16. Every logit passes the q/k/v/o, gate/up
# and down projections of both layers and the LM head; log_softmax adds the log-sum-exp's rounding.
PROMPT_RTOL = dot_chain_rtol(*[64, 64, 64, 64, 64, 96] * 2, 64) + 2 * attention_rtol("float32", 64, 16)
# an 8-token budget: a 20-token prompt is prefilled in three chunks (one target crosses each boundary)
SETTINGS = dict(dtype="float32", max_model_len=96, max_num_batched_tokens=8, max_num_seqs=4, block_size=8)
TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_text_model(tmp_path_factory.mktemp("plp") / "model")


@pytest.fixture(scope="module")
def gen(model_dir) -> Generator:
    return Generator.from_pretrained(model_dir, **SETTINGS)     # warmed up: serving compiles nothing


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    hf = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def run(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()   # (T, V)
    return run


@pytest.fixture(scope="module")
def http(gen):
    with TestClient(build_app(gen, "tiny")) as client:
        yield client


def _check_against_hf(entries: list, ids: list[int], ref: np.ndarray, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    got = np.array([e[0] for e in entries[1:]])
    want = np.array([ref[p, ids[p + 1]] for p in range(len(ids) - 1)])
    assert_rel_close(got, want, PROMPT_RTOL, "prompt logprobs")
    for p, (lp, rank, top) in enumerate(entries[1:]):
        row = ref[p]
        margin = np.abs(row - row[ids[p + 1]]).min(initial=np.inf, where=np.arange(len(row)) != ids[p + 1])
        if margin > 2 * PROMPT_RTOL * np.abs(ref).max():     # a rank is exact unless a neighbour ties
            assert rank == 1 + int((row > row[ids[p + 1]]).sum())
        assert len(top) == k
        assert_rel_close([v for _, v in top], np.sort(row)[::-1][:k], PROMPT_RTOL, "top-k logprobs")
        assert [row[t] for t, _ in top] == sorted((row[t] for t, _ in top), reverse=True)


def test_prompt_logprobs_match_hf_through_chunked_prefill(gen, hf_logprobs):
    ids = gen.tokenizer.encode(TEXT)
    assert len(ids) > 2 * SETTINGS["max_num_batched_tokens"]
    out = gen.generate([ids], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=5))[0]
    _check_against_hf(out.prompt_logprobs, ids, hf_logprobs(ids), 5)
    assert gen.stats()["compilations_after_warmup"] == 0
    # nobody asked: no prompt logprobs
    assert gen.generate([ids], SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_batch_invariance_and_samples_share_them(gen):
    ids = gen.tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3)
    alone = gen.generate([ids], params)[0].prompt_logprobs
    others = [gen.tokenizer.encode("a cat sleeps"), list(range(5, 40)), gen.tokenizer.encode("the dog")]
    mixed = gen.generate([others[0], ids, others[1], others[2]],
                         [SamplingParams(max_tokens=6), params, params, SamplingParams(max_tokens=2, n=2)])
    assert mixed[1].prompt_logprobs == alone          # identical, whatever else the steps held
    assert mixed[0].prompt_logprobs is None and len(mixed[2].prompt_logprobs) == len(others[1])
    two = gen.generate([ids], SamplingParams(max_tokens=2, temperature=1.0, seed=3, n=2, prompt_logprobs=3))[0]
    assert two.samples[0].prompt_logprobs == two.samples[1].prompt_logprobs == alone


def test_cached_prefix_is_recomputed_for_prompt_logprobs(gen, hf_logprobs):
    ids = gen.tokenizer.encode(TEXT + " again")
    gen.generate([ids], SamplingParams(max_tokens=1))               # its full blocks are now cached
    hits = gen.stats()["prefix_cache_hits"]
    out = gen.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert out.num_cached_tokens == 0 and gen.stats()["prefix_cache_hits"] == hits   # bypassed
    _check_against_hf(out.prompt_logprobs, ids, hf_logprobs(ids), 2)
    assert gen.generate([ids], SamplingParams(max_tokens=1))[0].num_cached_tokens > 0   # still cached


def test_sampling_params_bound():
    with pytest.raises(ValueError, match=rf"prompt_logprobs must be an integer in \[0, {MAX_PROMPT_LOGPROBS}\]"):
        SamplingParams(prompt_logprobs=MAX_PROMPT_LOGPROBS + 1)


# ------------------------------------------------------------------------------------- HTTP
def test_echo_with_logprobs_in_openai_legacy_shape(gen, http, hf_logprobs):
    ids = gen.tokenizer.encode(TEXT)
    r = http.post("/v1/completions", json={"prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 1,
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and choice["text"].startswith(TEXT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf_logprobs(ids)
    assert_rel_close(lp["token_logprobs"][1:len(ids)], [ref[p, ids[p + 1]] for p in range(len(ids) - 1)],
                     PROMPT_RTOL, "echoed logprobs")
    token_str = lambda t: gen.tokenizer.id_to_piece(t).replace("\u2581", " ")  # noqa: E731
    assert lp["tokens"][:len(ids)] == [token_str(t) for t in ids]
    for p in range(1, len(ids)):        # top-k (2) plus the prompt token itself, as vLLM
        assert set(lp["top_logprobs"][p]) >= {token_str(t) for t in np.argsort(-ref[p - 1])[:2]} | {lp["tokens"][p]}
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1])
    # the generated token is the greedy one after the prompt, its logprob last
    assert lp["tokens"][-1] == token_str(int(np.argmax(ref[-1])))
    assert abs(lp["token_logprobs"][-1] - ref[-1].max()) <= PROMPT_RTOL * np.abs(ref).max()


def test_echo_with_max_tokens_0_is_the_prompt_alone(gen, http):
    ids = gen.tokenizer.encode(TEXT)
    r = http.post("/v1/completions", json={"prompt": [TEXT, "the dog"], "echo": True, "logprobs": 1,
                                           "max_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    a, b = body["choices"]
    assert a["text"] == TEXT and b["text"] == "the dog" and len(a["logprobs"]["tokens"]) == len(ids)
    assert body["usage"]["completion_tokens"] == 0
    # the same values as with a generated token after them
    r1 = http.post("/v1/completions", json={"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 1})
    assert r1.json()["choices"][0]["logprobs"]["token_logprobs"][:-1] == a["logprobs"]["token_logprobs"]
    # token ids in, text echoed
    r2 = http.post("/v1/completions", json={"prompt": ids, "echo": True, "max_tokens": 0})
    assert r2.status_code == 200 and r2.json()["choices"][0]["text"] == gen.tokenizer.decode(ids)
    r3 = http.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 0})
    assert r3.status_code == 400 and r3.json()["error"]["param"] == "max_tokens"


def test_streamed_echo(gen, http):
    body = {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    text, tokens, offsets = "", [], []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                tokens += c["logprobs"]["tokens"]
                offsets += c["logprobs"]["text_offset"]
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
    # the prompt's offsets and the first generated token's (later ones count the streamed text sent,
    # as streaming without echo does)
    n = len(gen.tokenizer.encode(TEXT)) + 1
    assert offsets[:n] == whole["logprobs"]["text_offset"][:n] and offsets == sorted(offsets)


def test_vllm_prompt_logprobs_extension(gen, http, hf_logprobs):
    ids = gen.tokenizer.encode(TEXT)
    ref = hf_logprobs(ids)
    r = http.post("/v1/completions", json={"prompt": TEXT, "prompt_logprobs": 3, "max_tokens": 1})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        entry = plp[p][str(ids[p])]
        assert abs(entry["logprob"] - ref[p - 1, ids[p]]) <= PROMPT_RTOL * np.abs(ref).max()
        assert {int(t) for t, e in plp[p].items() if e["rank"] <= 3} >= set(np.argsort(-ref[p - 1])[:3].tolist())
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "the cat"}],
                                                   "prompt_logprobs": 1, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    prompt = http.post("/tokenize", json={"messages": [{"role": "user", "content": "the cat"}]}).json()["tokens"]
    cref = hf_logprobs(prompt)
    cplp = chat.json()["prompt_logprobs"]
    assert cplp[0] is None and len(cplp) == len(prompt)
    got = [cplp[p][str(prompt[p])]["logprob"] for p in range(1, len(prompt))]
    assert_rel_close(got, [cref[p - 1, prompt[p]] for p in range(1, len(prompt))], PROMPT_RTOL, "chat prompt_logprobs")


def test_refusals(http):
    for url, body in (("/v1/completions", {"prompt": "x"}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = http.post(url, json={**body, "prompt_logprobs": MAX_PROMPT_LOGPROBS + 1})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt_logprobs" and f"[0, {MAX_PROMPT_LOGPROBS}]" in err["message"]
        r = http.post(url, json={**body, "prompt_logprobs": 1, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = http.post("/v1/completions", json={"prompt": "x", "echo": True, "logprobs": MAX_PROMPT_LOGPROBS + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_plain_completions_are_unchanged(gen, http):
    """Token-id and text prompts without echo or prompt_logprobs: the body has no prompt in it."""
    ids = gen.tokenizer.encode(TEXT)
    for prompt in (ids, [ids, ids[:5]], TEXT):
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                                               "logprobs": 1})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert "prompt_logprobs" not in c and len(c["logprobs"]["tokens"]) == 2
    r = http.post("/v1/completions", json={"prompt": ids[:5], "max_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 200 and len(r.json()["choices"][0]["prompt_logprobs"]) == 5
    assert r.json()["usage"]["completion_tokens"] == 1 and not r.json()["choices"][0]["text"].startswith(TEXT[:5])
