"""The HTTP server as a real process on 127.0.0.1, driven by the official `openai` client and httpx.

Every loop here is bounded in count and time, and every process started is killed at the end.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.hf_models import save_text_model

openai = pytest.importorskip("openai")

# a 16-token budget: each server warms up two step shapes (8, 16) where 64 would compile four
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-batched-tokens", "16",
                "--token-buckets", "16", "--max-num-seqs", "16", "--block-size", "8"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(model.parent / f"server-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", str(model), "--port", str(self.port),
             "--served-model-name", "tiny", "--log-level", "warning", *ENGINE_FLAGS, *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError("server did not become healthy in 240 s")

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_text_model(tmp_path_factory.mktemp("served") / "model")


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


def _wait_blocks_free(server: Server, timeout: float = 30) -> float:
    deadline = time.monotonic() + timeout
    used = server.metric("jaxinfer_kv_blocks_used")
    while used and time.monotonic() < deadline:
        time.sleep(0.2)
        used = server.metric("jaxinfer_kv_blocks_used")
    return used


def test_models_and_completions(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    again = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=12, temperature=0)
    assert again.choices[0].text == r.choices[0].text


def test_chat_and_streaming_chat_agree(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "seven wizards"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0.8, seed=11)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0.8, seed=11,
                                            stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


def test_n_seed_stop_and_logprobs(client):
    r = client.completions.create(model="tiny", prompt="hackers write", max_tokens=16, temperature=1.0, n=2, seed=3)
    assert len(r.choices) == 2 and {c.index for c in r.choices} == {0, 1}
    r2 = client.completions.create(model="tiny", prompt="hackers write", max_tokens=16, temperature=1.0, n=2, seed=3)
    assert [c.text for c in r.choices] == [c.text for c in r2.choices]
    # stop string: cut a free-running greedy text at a substring
    free = client.completions.create(model="tiny", prompt="lazy dog", max_tokens=30, temperature=0).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 3]
    cut = client.completions.create(model="tiny", prompt="lazy dog", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"
    # vLLM's stop_reason: the stop string (None for max_tokens); streamed on the chunk with finish_reason
    assert cut.choices[0].model_extra["stop_reason"] == stop
    assert client.completions.create(model="tiny", prompt="lazy dog", max_tokens=3,
                                     temperature=0).choices[0].model_extra["stop_reason"] is None
    chunks = [c.choices[0] for c in client.completions.create(model="tiny", prompt="lazy dog", max_tokens=30,
                                                               temperature=0, stop=[stop], stream=True) if c.choices]
    assert [c.model_extra.get("stop_reason") for c in chunks if c.finish_reason] == [stop]
    lp = client.completions.create(model="tiny", prompt="lazy dog", max_tokens=5, temperature=0, logprobs=3)
    block = lp.choices[0].logprobs
    assert len(block.token_logprobs) == len(block.tokens) == 5
    assert all(len(t) == 3 for t in block.top_logprobs)
    assert all(v <= 0 for v in block.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(t.values()) - v) < 1e-5 for t, v in zip(block.top_logprobs, block.token_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "fox"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 for c in chat.choices[0].logprobs.content)


def test_return_token_ids_as_vllm_returns_them(server, client):
    """vLLM's return_token_ids: each choice's generated ids (they decode to its text: /detokenize) and
    its prompt's ids (what /tokenize makes of the prompt or the rendered messages), on each completion
    choice and once at the top of a chat response; streamed, the same ids across the chunks, the
    prompt's once."""
    prompts = ["lazy dog", "hackers write"]
    kw = dict(model="tiny", prompt=prompts, max_tokens=6, temperature=0, n=2, extra_body={"return_token_ids": True})
    r = client.completions.create(**kw)
    for i, c in enumerate(r.choices):
        extra = c.model_extra
        assert extra["prompt_token_ids"] == httpx.post(f"{server.url}/tokenize", json={"prompt": prompts[i // 2]}).json()["tokens"]
        assert httpx.post(f"{server.url}/detokenize", json={"tokens": extra["token_ids"]}).json()["prompt"] == c.text
    assert sum(len(c.model_extra["token_ids"]) for c in r.choices) == r.usage.completion_tokens
    got: dict[int, list] = {}
    prompt_ids: dict[int, list] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            got.setdefault(c.index, []).extend(c.model_extra["token_ids"])
            if "prompt_token_ids" in c.model_extra:
                assert c.index not in prompt_ids
                prompt_ids[c.index] = c.model_extra["prompt_token_ids"]
    assert [got[i] for i in range(4)] == [c.model_extra["token_ids"] for c in r.choices]
    assert [prompt_ids[i] for i in range(4)] == [c.model_extra["prompt_token_ids"] for c in r.choices]
    messages = [{"role": "user", "content": "lazy dog"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == \
        httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    ids = chat.choices[0].model_extra["token_ids"]
    assert len(ids) == chat.usage.completion_tokens
    # (decoded after its prompt: SentencePiece drops a leading space from a text decoded alone)
    whole = chat.model_extra["prompt_token_ids"] + ids
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": whole}).json()["prompt"].endswith(
        chat.choices[0].message.content)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert [c.model_extra.get("prompt_token_ids") for c in chunks if c.model_extra.get("prompt_token_ids")] == \
        [chat.model_extra["prompt_token_ids"]]
    assert [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids", [])] == ids


def test_min_tokens_allowed_token_ids_and_bad_words_reach_the_engine(server, client):
    """vLLM's min_tokens, allowed_token_ids and bad_words on completions and chat (extra_body, as
    vLLM's clients send them): sampled ids stay in the allowed set; min_tokens holds EOS, made the
    likeliest token by logit_bias, back for exactly that many tokens; a bad word's text never
    appears where it did."""
    allowed = list(range(40, 60))
    r = client.completions.create(model="tiny", prompt="lazy dog", max_tokens=12, temperature=1.5, seed=1,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True})
    assert set(r.choices[0].model_extra["token_ids"]) <= set(allowed) and r.usage.completion_tokens == 12
    eos = 2   # save_text_model's SentencePiece eos_id
    kw = dict(model="tiny", prompt="lazy dog", max_tokens=12, temperature=0, logit_bias={str(eos): 100})
    assert client.completions.create(**kw).usage.completion_tokens <= 1
    held = client.completions.create(**kw, extra_body={"min_tokens": 5, "return_token_ids": True})
    assert held.choices[0].finish_reason == "stop" and eos not in held.choices[0].model_extra["token_ids"][:5]
    assert held.usage.completion_tokens in (5, 6)
    # a bad word that is one token of the free output (its text encodes back to that token alone)
    messages = [{"role": "user", "content": "lazy dog"}]
    kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0)
    free = client.chat.completions.create(**kw, extra_body={"return_token_ids": True, "ignore_eos": True})
    post = lambda route, body: httpx.post(f"{server.url}{route}", json=body).json()  # noqa: E731
    token, word = next((t, w) for t in free.choices[0].model_extra["token_ids"]
                       for w in [post("/detokenize", {"tokens": [t]})["prompt"].strip()]
                       if w and post("/tokenize", {"prompt": w, "add_special_tokens": False})["tokens"] == [t])
    banned = client.chat.completions.create(**kw, extra_body={"return_token_ids": True, "ignore_eos": True,
                                                              "bad_words": [word]})
    assert token not in banned.choices[0].model_extra["token_ids"]


def test_use_beam_search_matches_transformers(server, client, model_dir):
    """vLLM's use_beam_search on completions (n = beam width) against HF transformers' beam search on
    the served checkpoint (no EOS: ignore_eos), best first, non-streamed and streamed; fields the
    search would drop are 400s naming them."""
    import torch
    import transformers as tf
    from tests.test_beam_search import _vllm_beam_search
    prompt = httpx.post(f"{server.url}/tokenize", json={"prompt": "lazy dog"}).json()["tokens"]
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.generation_config.eos_token_id = None
    _vllm_beam_search(model, prompt, 3, 5, eos=-1, ignore_eos=True, length_penalty=1.0, include_stop=False)
    ref = model.generate(torch.as_tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                         max_new_tokens=5, length_penalty=0.0, early_stopping=False, pad_token_id=0)
    kw = dict(model="tiny", prompt="lazy dog", max_tokens=5, n=3, logprobs=1,
              extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(**kw)
    assert [c.model_extra["token_ids"] for c in r.choices] == ref[:, len(prompt):].tolist()
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 15
    assert all(c.finish_reason == "length" and len(c.logprobs.token_logprobs) == 5 for c in r.choices)
    texts: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [c.text for c in r.choices]
    # one beam is greedy decoding: the same tokens, logprobs and text offsets as a greedy request
    one, greedy = (client.completions.create(model="tiny", prompt="lazy dog", max_tokens=5, logprobs=1, temperature=0,
                                             extra_body={"ignore_eos": True, "use_beam_search": beam})
                   for beam in (True, False))
    assert one.choices[0].logprobs.tokens == greedy.choices[0].logprobs.tokens
    assert one.choices[0].logprobs.text_offset == greedy.choices[0].logprobs.text_offset
    np.testing.assert_allclose(one.choices[0].logprobs.token_logprobs, greedy.choices[0].logprobs.token_logprobs,
                               atol=1e-5)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "lazy dog"}],
                                          max_tokens=4, n=2, extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content is not None
    for extra, param in [({"stop": ["x"]}, "stop"), ({"top_p": 0.5}, "top_p"), ({"n": 11}, "n"),
                         ({"frequency_penalty": 1.0}, "frequency_penalty"), ({"max_tokens": 4000}, "max_tokens")]:
        body = {"model": "tiny", "prompt": "lazy dog", "max_tokens": 5, "use_beam_search": True, **extra}
        e = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert e.status_code == 400 and e.json()["error"]["param"] == param, e.text


def test_vllm_sampling_and_prompt_extras(server, client, model_dir):
    """vLLM's extras that its clients send expecting their effect: include_stop_str_in_output keeps
    the stop string; truncate_prompt_tokens keeps the prompt's last N tokens (the same output as those
    N sent alone); return_tokens_as_token_ids names logprobs' tokens "token_id:N" (the ids
    return_token_ids gives); skip_special_tokens false keeps EOS pieces as SentencePiece names them."""
    import sentencepiece as spm
    free = client.completions.create(model="tiny", prompt="lazy dog", max_tokens=30, temperature=0).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 3]
    kept = client.completions.create(model="tiny", prompt="lazy dog", max_tokens=30, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert (kept.text, kept.finish_reason) == (free[: free.index(stop) + len(stop)], "stop")
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "the lazy dog jumps over hackers"}).json()["tokens"]
    cut = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 3})
    alone = client.completions.create(model="tiny", prompt=ids[-3:], max_tokens=5, temperature=0)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == alone.choices[0].text
    # truncation_side right (vLLM's): the first N instead
    first = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 3, "truncation_side": "right"})
    head = client.completions.create(model="tiny", prompt=ids[:3], max_tokens=5, temperature=0)
    assert first.usage.prompt_tokens == 3 and first.choices[0].text == head.choices[0].text
    # a text prompt is cut as vLLM's tokenizer(text, truncation=True, max_length=N) cuts it (the left
    # side for a generating model): the BOS the tokenizer adds stays, then the text's last N - 1 pieces
    sp_ids = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model")).encode(
        "the lazy dog jumps over hackers")
    assert ids == [1] + sp_ids
    for side, want in (("left", [1] + sp_ids[-2:]), ("right", [1] + sp_ids[:2])):
        body = {"prompt": "the lazy dog jumps over hackers", "max_tokens": 1, "truncate_prompt_tokens": 3,
                "return_token_ids": True, **({"truncation_side": side} if side == "right" else {})}
        got = httpx.post(f"{server.url}/v1/completions", json=body).json()
        assert got["choices"][0]["prompt_token_ids"] == want and got["usage"]["prompt_tokens"] == 3, got
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
    lp = client.completions.create(model="tiny", prompt="lazy dog", max_tokens=4, temperature=0, logprobs=1,
                                   extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}).choices[0]
    assert lp.logprobs.tokens == [f"token_id:{t}" for t in lp.model_extra["token_ids"]]
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    eos = sp.eos_id()
    body = dict(model="tiny", prompt="lazy dog", max_tokens=3, temperature=0, ignore_eos=True,
                logit_bias={str(eos): 100})
    plain = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["text"]
    kept = httpx.post(f"{server.url}/v1/completions", json={**body, "skip_special_tokens": False}).json()
    assert plain == "" and kept["choices"][0]["text"] == sp.id_to_piece(eos) * 3


def test_chat_echo_begins_the_reply_with_the_continued_message(server, client):
    """vLLM's chat echo (its get_chat_request_role and echo rules): the response's role is the
    assistant's under a generation prompt, else the last message's; where the last message has that
    role its content (text parts joined by newlines) begins the reply's content, streamed as one
    chunk right after the role chunk; a user's last message under a generation prompt is not echoed."""
    msgs = [{"role": "user", "content": "tell me about the fox"}, {"role": "assistant", "content": "The fox"}]
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    kw = dict(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kw, extra_body=cont).choices[0].message.content
    echoed = client.chat.completions.create(**kw, extra_body={**cont, "echo": True}).choices[0].message
    assert (echoed.role, echoed.content) == ("assistant", "The fox" + plain)
    chunks = [c.choices[0].delta for c in client.chat.completions.create(**kw, extra_body={**cont, "echo": True},
                                                                         stream=True) if c.choices]
    assert chunks[0].role == "assistant" and chunks[1].content == "The fox"
    assert "".join(d.content or "" for d in chunks) == "The fox" + plain
    parts = [{**msgs[0]}, {"role": "assistant", "content": [{"type": "text", "text": "The"}, {"type": "text", "text": "fox"}]}]
    body = {"messages": parts, "max_tokens": 3, "temperature": 0, **cont, "echo": True}
    got = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert got.startswith("The\nfox")
    asked = dict(model="tiny", messages=msgs[:1], max_tokens=4, temperature=0)
    assert (client.chat.completions.create(**asked, extra_body={"echo": True}).choices[0].message.content
            == client.chat.completions.create(**asked).choices[0].message.content)
    user = httpx.post(f"{server.url}/v1/chat/completions",
                      json={"messages": msgs[:1], "max_tokens": 2, "add_generation_prompt": False}).json()
    assert user["choices"][0]["message"]["role"] == "user"


def test_request_id_names_the_response_as_vllm(server):
    """vLLM's request ids: a chat response's id is "chatcmpl-" and the X-Request-Id header where the
    request has one, else the body's request_id; completions' "cmpl-" likewise (streamed chunks
    too); without either, a random id."""
    chat = {"messages": [{"role": "user", "content": "fox"}], "max_tokens": 2}
    url = server.url
    assert httpx.post(f"{url}/v1/chat/completions", json={**chat, "request_id": "abc"}).json()["id"] == "chatcmpl-abc"
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "request_id": "abc"}, headers={"X-Request-Id": "hdr"})
    assert r.json()["id"] == "chatcmpl-hdr"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "fox", "max_tokens": 2, "request_id": "c1", "stream": True})
    ids = {json.loads(line[6:])["id"] for line in r.text.splitlines() if line.startswith("data: {")}
    assert ids == {"cmpl-c1"}
    a, b = (httpx.post(f"{url}/v1/completions", json={"prompt": "fox", "max_tokens": 2}).json()["id"] for _ in "ab")
    assert a != b and a.startswith("cmpl-")


def test_64_concurrent_streams_equal_non_streaming(server, client):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)

        async def one(i):
            kw = dict(model="tiny", prompt=f"zebras {i} and hackers", max_tokens=8 + i % 17, temperature=0.9,
                      seed=i)
            text = ""
            async for chunk in await aclient.completions.create(stream=True, **kw):
                text += chunk.choices[0].text if chunk.choices else ""
            return text, kw

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), timeout=600)

    results = asyncio.run(run())
    assert len(results) == 64
    for text, kw in results:
        assert client.completions.create(**kw).choices[0].text == text
    assert _wait_blocks_free(server) == 0


def test_disconnects_free_their_blocks(server):
    body = {"model": "tiny", "prompt": "the night", "max_tokens": 100, "temperature": 0.5, "seed": 1,
            "stream": True, "ignore_eos": True}
    for _ in range(6):
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i == 4:
                    break              # hang up mid-stream
    assert _wait_blocks_free(server) == 0
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("body,raw,status,needle", [
    (None, b"{not json", 400, "not valid JSON"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, None, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -5}, None, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "n": 10000}, None, 400, "n"),
    ({"model": "tiny", "prompt": "x", "temperature": "hot"}, None, 400, "temperature"),
    ({"model": "tiny", "prompt": "fox " * 200, "max_tokens": 4}, None, 400, "maximum context length is 128"),
    ({"model": "gpt-9", "prompt": "x"}, None, 404, "gpt-9"),
    ({"model": "tiny"}, None, 400, "prompt"),
    ({"model": "tiny", "prompt": [1, 2, 999999]}, None, 400, "outside the vocabulary"),
])
def test_bad_requests_get_clear_4xx(server, body, raw, status, needle):
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30) if raw is None else httpx.post(
        f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


def test_chat_validation_and_tokenize_round_trip(server, model_dir):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400
    toks = httpx.post(f"{server.url}/tokenize", json={"prompt": "seven wizards"}, timeout=30).json()
    assert toks["count"] == len(toks["tokens"]) > 1
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": toks["tokens"]}, timeout=30).json()["prompt"]
    assert text == "seven wizards"
    # vLLM's return_token_strs: each id's piece, as the tokenizer names it (SentencePiece's id_to_piece)
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    strs = httpx.post(f"{server.url}/tokenize", json={"prompt": "seven wizards", "return_token_strs": True}).json()
    assert strs["token_strs"] == [sp.id_to_piece(i) for i in toks["tokens"]] and strs["tokens"] == toks["tokens"]
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "add_generation_prompt": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_generation_prompt", r.text


def test_metrics_report_latencies_and_counters(server, client):
    client.completions.create(model="tiny", prompt="fox", max_tokens=5, temperature=0)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in ("jaxinfer_time_to_first_token_seconds_count", "jaxinfer_inter_token_latency_seconds_count",
                 "jaxinfer_e2e_request_latency_seconds_count", "jaxinfer_generation_tokens_total",
                 "jaxinfer_prompt_tokens_total", "jaxinfer_num_requests_waiting", "jaxinfer_kv_blocks_used",
                 "jaxinfer_num_preemptions_total", "jaxinfer_compilations_after_warmup"):
        assert name in text, name
    assert server.metric("jaxinfer_compilations_after_warmup") == 0


def test_api_key_and_queue_limit(model_dir):
    s = Server(model_dir, "--api-key", "sekret", "--max-queue", "2")
    try:
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekret", timeout=120, max_retries=0)
        assert c.completions.create(model="tiny", prompt="fox", max_tokens=3).choices

        async def flood():
            async with httpx.AsyncClient(timeout=120) as h:
                return await asyncio.gather(*(h.post(
                    f"{s.url}/v1/completions", headers={"Authorization": "Bearer sekret"},
                    json={"model": "tiny", "prompt": "fox", "max_tokens": 30}) for _ in range(24)))
        codes = [r.status_code for r in asyncio.run(flood())]
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
        limited = next(r for r in asyncio.run(flood()) if r.status_code == 429) if 429 in codes else None
        assert limited is None or limited.headers.get("retry-after") == "1"
    finally:
        s.close()


def test_schemathesis_finds_no_server_errors(server):
    st = Path(sys.executable).with_name("schemathesis")   # a test dependency (pyproject [test])
    result = subprocess.run(
        [str(st), "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error", "--max-examples", "25",
         "--request-timeout", "60", "--seed", "1", "--no-color"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_prefix_cache_salt_usage_and_metrics(server, client):
    """Prefix caching through the API: usage.prompt_tokens_details.cached_tokens counts the prompt
    tokens served from the cache (whole blocks of 8, never the last prompt token), a different
    cache_salt shares nothing, and /metrics counts the queries and hits."""
    prompt = list(range(5, 45))      # 40 token ids: blocks 0-3 (32 tokens) can be reused
    queries0 = server.metric("jaxinfer_prefix_cache_queries_total")
    hits0 = server.metric("jaxinfer_prefix_cache_hits_total")
    kw = dict(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    first = client.completions.create(**kw, extra_body={"cache_salt": "salt-one"})
    assert first.usage.prompt_tokens == 40 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(**kw, extra_body={"cache_salt": "salt-one"})
    assert again.usage.prompt_tokens_details.cached_tokens == 32 and again.choices[0].text == first.choices[0].text
    other = client.completions.create(**kw, extra_body={"cache_salt": "salt-two"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    # chat, streamed with usage: the rendered conversation's second turn reuses the first's blocks
    msgs = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 4}]
    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0)
    usage = None
    for chunk in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 8 * 8 > 0
    r = httpx.post(f"{server.url}/v1/completions", json={**kw, "cache_salt": ""}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert server.metric("jaxinfer_prefix_cache_queries_total") - queries0 >= 3 * 40
    assert server.metric("jaxinfer_prefix_cache_hits_total") - hits0 >= 32 + usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),        # 0 refused like max_tokens 0, not read as unset
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}},
     "stream_options"),               # vLLM: only with stream true
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream_options": {}},
     "stream_options"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),   # its own name
    # vLLM's extras that would change the output: refused, never silently dropped
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "spaces_between_special_tokens": False},
     "spaces_between_special_tokens"),
    ("/v1/responses", {"input": "x", "min_tokens": 2}, "min_tokens"),   # declared by completions and chat only
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "truncation_side": "middle"}, "truncation_side"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True},
     "add_special_tokens"),      # (chat's default is false: the template writes them)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
     "chat_template"),           # vLLM's refusal without --trust-request-chat-template
    ("/v1/responses", {"input": "x", "documents": [{"text": "d"}]}, "documents"),
    # vLLM's bounds on min_tokens / allowed_token_ids / bad_words, named by the request's field
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "bad_words": [" "]}, "bad_words"),
    # chat-only template options on completions
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "continue_final_message": True}, "continue_final_message"),
])
def test_refusals_name_the_field_the_request_sent(server, route, body, param):
    r = httpx.post(f"{server.url}{route}", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert route != "/v1/responses" or "max_tokens" not in err["message"], err


def test_continuous_usage_stats_give_each_chunk_its_choices_usage(server):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): every chunk carries its
    choice's usage so far; two samples of 5 tokens each end at 5, and the final usage counts 10."""
    body = {"model": "tiny", "prompt": "seven wizards", "max_tokens": 5, "n": 2, "temperature": 1.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    prompt, final = None, None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            c = json.loads(line[6:])
            u = c["usage"]
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
            if not c["choices"]:
                final = u
                continue
            prompt = prompt or u["prompt_tokens"]
            assert u["prompt_tokens"] == prompt
            per_choice[c["choices"][0]["index"]].append(u["completion_tokens"])
    for counts in per_choice.values():
        assert counts == sorted(counts) and counts[-1] == 5 and counts[0] >= 1
    assert final["completion_tokens"] == 10 and final["prompt_tokens"] == prompt


def test_vllm_extras_at_their_no_op_values_are_accepted(server):
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "x", "max_tokens": 2, "min_tokens": 0, "include_stop_str_in_output": False,
        "skip_special_tokens": True, "stream_options": None, "truncation_side": "left", "prompt_embeds": None})
    assert r.status_code == 200, r.text
    # vLLM's add_special_tokens on completions: false encodes the text without the BOS SentencePiece's
    # rule adds (its ids as /tokenize makes them either way)
    for add in (True, False):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "lazy dog", "max_tokens": 2, "add_special_tokens": add, "return_token_ids": True})
        want = httpx.post(f"{server.url}/tokenize", json={"prompt": "lazy dog", "add_special_tokens": add}).json()
        assert r.json()["choices"][0]["prompt_token_ids"] == want["tokens"] and (want["tokens"][0] == 1) == add


def test_logprobs_keep_the_sampled_token_and_follow_the_text(server):
    """OpenAI's legacy logprobs hold the sampled token beside the top-k (up to k + 1 entries) and
    text_offset is where each token's text starts in the choice's text, streamed or not; chat
    logprobs' `bytes` of a byte-fallback piece is that one byte, other pieces their text's UTF-8."""
    body = {"model": "tiny", "prompt": "seven wizards", "max_tokens": 24, "temperature": 2.0, "seed": 5,
            "logprobs": 1, "ignore_eos": True}
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    lp = choice["logprobs"]
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[tok] == v and 1 <= len(top) <= 2
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(choice["text"])
    streamed = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["logprobs"]["text_offset"]
    assert streamed == offsets
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "seven wizards"}], "max_tokens": 24,
        "temperature": 2.0, "seed": 5, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}).json()
    entries = chat["choices"][0]["logprobs"]["content"]
    entries += [t for e in entries for t in e["top_logprobs"]]
    for e in entries:
        tok = e["token"]
        byte_piece = len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">")
        assert e["bytes"] == ([int(tok[3:5], 16)] if byte_piece else list(tok.encode())), e
    assert any(len(e["token"]) == 6 and e["token"].startswith("<0x") for e in entries)   # the case was met


def test_usage_of_echo_only_streams_and_of_a_new_prompt_sampled_n_times(server):
    """echo with max_tokens 0 returns no completion tokens, streamed as not; a prompt never seen
    before has no cached tokens, however many samples fork its blocks."""
    body = {"model": "tiny", "prompt": "jolly hackers", "max_tokens": 0, "echo": True}
    plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["usage"]
    usage = None
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("usage"):
                usage = json.loads(line[6:])["usage"]
    assert plain["completion_tokens"] == usage["completion_tokens"] == 0
    assert usage["total_tokens"] == usage["prompt_tokens"] == plain["prompt_tokens"]
    fresh = " ".join(["quietly lazy wizards hex seven jolly dogs"] * 3)    # 3 blocks and more, new here
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": fresh, "max_tokens": 2, "n": 4, "temperature": 1.0}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": fresh, "max_tokens": 2}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0      # now it is cached


def test_completion_logprobs_by_hand():
    """Four one-token deltas (OutputProcessor's shape): ' the', a newline from the byte piece <0x0A>
    (one character of text, six of display), a token whose text is held back (it may start a stop
    string) and the token that releases it. Offsets count the text: 0, 4, 5, 5."""
    from jaxinfer.output_processor import RequestOutput
    from serve.protocol import completion_logprobs
    names = {5: " the", 6: "<0x0A>", 7: "fo", 8: "x"}
    deltas = [RequestOutput("r", 0, " the", [5], [-0.5], [[(7, -0.1)]]),
              RequestOutput("r", 0, "\n", [6], [-2.0], [[(6, -2.0)]]),
              RequestOutput("r", 0, "", [7], [-0.25], [[(5, -0.2)]]),
              RequestOutput("r", 0, "fox", [8], [-1.0], [[(5, -0.75)]])]
    lp = completion_logprobs(deltas, names.get)
    assert lp["tokens"] == [" the", "<0x0A>", "fo", "x"]
    assert lp["text_offset"] == [0, 4, 5, 5]
    assert lp["top_logprobs"] == [{"fo": -0.1, " the": -0.5}, {"<0x0A>": -2.0}, {" the": -0.2, "fo": -0.25},
                                  {" the": -0.75, "x": -1.0}]


def test_sagemaker_ping_and_invocations(server):
    """vLLM's SageMaker routes: /ping answers as /health does (GET and POST); /invocations sends a
    body to the route its request type is for (greedy: the same answer as that route's), its
    refusals naming the field as there; a body of no known type is a 400."""
    post = lambda route, body: httpx.post(f"{server.url}{route}", json=body, timeout=60)  # noqa: E731
    assert httpx.get(f"{server.url}/ping").status_code == 200 and httpx.post(f"{server.url}/ping").status_code == 200
    for route, body in (("/v1/completions", {"prompt": "lazy dog"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "lazy dog"}]})):
        body = {"model": "tiny", "max_tokens": 6, "temperature": 0, **body}
        direct, routed = post(route, body).json(), post("/invocations", body).json()
        assert routed["object"] == direct["object"] and routed["choices"] == direct["choices"]
    bad = post("/invocations", {"model": "tiny", "prompt": "x", "min_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens"
    none = post("/invocations", {"model": "tiny", "text": "x"})
    assert none.status_code == 400 and "Expected one of" in none.json()["error"]["message"]
