"""Issue 14: the server attacked as a hostile client and a careless operator would.

One Generator serves an in-process uvicorn server on 127.0.0.1 (a thread; real sockets), so tests
can use the engine's test-only step hook (`Engine.fault_injector`) and read its stats directly.
The dead-engine test runs its own server process, since it kills the engine and sends SIGTERM.
Every loop is bounded in count and time.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from jaxinfer import Generator, SamplingParams
from jaxinfer.config import MAX_STOP_LENGTH
from jaxinfer.tokenizer import hold_back
from serve.app import build_app
from tests.hf_models import save_text_model
from tests.prometheus import metric_sum

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUE = 32
MAX_BYTES = 4 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """build_app(gen) under uvicorn on a thread, bound to 127.0.0.1."""

    def __init__(self, gen: Generator, **app_kwargs):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(gen, "tiny", **app_kwargs)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.started, "uvicorn did not start in 60 s"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_text_model(tmp_path_factory.mktemp("hardening") / "model")


@pytest.fixture(scope="module")
def gen(model_dir) -> Generator:
    return Generator.from_pretrained(model_dir, dtype="float32", max_model_len=128, max_num_batched_tokens=64,
                                     token_buckets=[8, 64], max_num_seqs=16, block_size=8, warmup=False)


@pytest.fixture(scope="module")
def srv(gen):
    s = ThreadServer(gen, api_key=KEY, max_queue=MAX_QUEUE, max_request_bytes=MAX_BYTES)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _no_fault(request):
    yield
    if "gen" in request.fixturenames:
        request.getfixturevalue("gen").engine.fault_injector = None


def _post(srv, path: str, body=None, content: bytes | None = None, headers=None, timeout=60) -> httpx.Response:
    headers = {**AUTH, **(headers or {})}
    if content is not None:
        headers.setdefault("content-type", "application/json")
        return httpx.post(srv.url + path, content=content, headers=headers, timeout=timeout)
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=timeout)


def _openai_error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    return err


def _wait_idle(gen: Generator, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    s = gen.stats()
    while (s["kv_blocks_used"] or s["num_running"] or s["num_waiting"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        s = gen.stats()
    return s


# ------------------------------------------------------------------ 1. a dead engine answers everyone
_DYING_SERVER = """
import sys, time
from pathlib import Path
import uvicorn
from jaxinfer import Generator
from serve.app import build_app

model, port, trigger = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
gen = Generator.from_pretrained(model, dtype="float32", max_model_len=128, max_num_batched_tokens=64,
                                token_buckets=[8, 64], max_num_seqs=8, block_size=8, warmup=False, max_decode_steps=1)

def fault():   # the test-only step hook: slow steps, then an engine that dies once the trigger exists
    time.sleep(0.03)
    if trigger.exists():
        raise RuntimeError("injected fault")

gen.engine.fault_injector = fault
app = build_app(gen, "tiny")
app.router.on_shutdown.append(lambda: print("graceful shutdown ran", flush=True))
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""


def test_dead_engine_fails_every_request_and_sigterm_exits(model_dir, tmp_path):
    port, trigger = _free_port(), tmp_path / "die"
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", _DYING_SERVER, str(model_dir), str(port), str(trigger)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": "the night", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
        results: dict[str, object] = {}

        def stream():
            lines = []
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 2:
                        results["streaming"] = True
            results["stream"] = lines

        def plain():
            results["plain"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while "streaming" not in results and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "streaming" in results, "the stream never started"
        # a background response (a string of 1000 characters or more: no EOS before it ends)
        schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 1000}}, "required": ["a"]}
        bg = httpx.post(f"{url}/v1/responses", timeout=60, json={
            "model": "tiny", "input": "the night", "background": True, "max_output_tokens": 100, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}})
        assert bg.status_code == 200 and bg.json()["status"] == "queued", bg.text
        trigger.touch()
        t_fault = time.monotonic()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a request in flight never got an answer"
        answered_in = time.monotonic() - t_fault
        assert answered_in < 15, answered_in   # 'within a second' on an idle machine; a loaded one is slower

        events = results["stream"]
        assert events[-1] == "data: [DONE]"
        error_event = json.loads(events[-2].removeprefix("data: "))
        assert error_event["error"]["type"] == "server_error" and "injected fault" in error_event["error"]["message"]
        plain_r = results["plain"]
        assert plain_r.status_code == 503 and _openai_error(plain_r)["code"] == "engine_dead"
        deadline = time.monotonic() + 30     # the background response is stored failed, with the error
        while (stored := httpx.get(f"{url}/v1/responses/{bg.json()['id']}", timeout=10).json())["status"] == \
                "in_progress" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stored["status"] == "failed" and "injected fault" in stored["error"]["message"], stored
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and _openai_error(health)["code"] == "engine_dead"
        assert "injected fault" in _openai_error(health)["message"]
        t0 = time.monotonic()
        late = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert late.status_code == 503 and time.monotonic() - t0 < 10
        assert "injected fault" in _openai_error(late)["message"]

        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal so the exit status tells it
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "graceful shutdown ran" in (tmp_path / "server.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


# ------------------------------------------------------------------ 2. non-streaming disconnects abort
def test_non_streaming_disconnect_aborts_and_frees_blocks(srv, gen):
    """Eight non-streaming clients hang up mid-generation: the server aborts each of their requests
    while it still runs, and every KV block comes back. The server's own /metrics tell how each
    request ended: finish_reason "abort" (the engine's abort of a running request), not "length"
    (it ran to its 120 tokens). Not a count of the tokens that came out in some time: a step
    decodes up to max_decode_steps = 8 tokens per row, and how many steps pass while the eight
    requests arrive depends on the machine's load (a loaded run saw 491 tokens before and after the
    hang-up, over a bound of 480 that assumed a quiet machine). 120 tokens take >= 15 steps at
    >= 0.5 s each (the injected delay): the hang-up comes within a few steps of the eighth request
    starting, and the server polls for disconnects every 0.2 s."""
    gen.engine.fault_injector = lambda: time.sleep(0.5)
    n, max_tokens = 8, 120

    def ended(reason: str) -> float:
        return metric_sum(srv.url, "jaxinfer_request_success_total", AUTH, finish_reason=reason)

    before = {reason: ended(reason) for reason in ("abort", "length")}
    payload = json.dumps({"model": "tiny", "prompt": "the night", "max_tokens": max_tokens, "ignore_eos": True,
                          "temperature": 0.7, "seed": 5}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
    socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(n)]
    for s in socks:
        s.sendall(request)
    deadline = time.monotonic() + 60
    while gen.stats()["num_running"] < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gen.stats()["num_running"] == n
    for s in socks:
        s.close()                               # the clients hang up
    s = _wait_idle(gen, timeout=30)
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
    # the server counts a request when it releases it, just after the engine's abort
    deadline = time.monotonic() + 30
    while ended("abort") - before["abort"] < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (ended("abort") - before["abort"], ended("length") - before["length"]) == (n, 0)


# ------------------------------------------------------------------ 13. unsupported fields are refused
@pytest.mark.parametrize("route,field,value", [
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "suffix", " the end"),     # a model with no fill-in-the-middle tokens (tests/test_fim.py)
    ("/v1/chat/completions", "suffix", " the end"),
    # tools are chat-only (tests/test_structured_api.py covers them, structured outputs and logit_bias)
    ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("/v1/completions", "tool_choice", "required"),
    ("/v1/completions", "parallel_tool_calls", True),
    ("/v1/chat/completions", "tool_choice", "required"),     # with no tools
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "store", True),
    ("/v1/chat/completions", "metadata", {"run": "a"}),
    ("/v1/chat/completions", "service_tier", "flex"),
    ("/v1/chat/completions", "reasoning_effort", "high"),
    ("/v1/chat/completions", "verbosity", "low"),
    ("/v1/chat/completions", "prompt_cache_key", "k"),
    ("/v1/chat/completions", "safety_identifier", "u1"),
])
def test_unsupported_fields_get_400_naming_them(srv, route, field, value):
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body |= {"prompt": "fox"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "fox"}]}
    r = _post(srv, route, body)
    assert r.status_code == 400, r.text
    err = _openai_error(r)
    assert err["param"] == field and field in err["message"]


def test_noop_values_of_unsupported_fields_and_unknown_extras_are_accepted(srv):
    r = _post(srv, "/v1/chat/completions", {
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "fox"}], "logit_bias": {},
        "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "best_of": 1, "suffix": None,
        "store": False, "metadata": {}, "service_tier": "auto", "some_vendor_extra": 1})
    assert r.status_code == 200, r.text


def test_unknown_extras_are_ignored_with_a_logged_warning(caplog):
    """Fields OpenAI does not define (a body's vendor extra, a message's id) are dropped, each named
    in a warning; the request is served as if they were absent."""
    from serve.protocol import ChatCompletionRequest
    with caplog.at_level("WARNING", logger="jaxinfer.serve"):
        req = ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": "fox", "id": "m1"}], "max_tokens": 2, "some_vendor_extra": 1})
    assert req.messages[0].text() == "fox" and req.max_tokens == 2
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "some_vendor_extra" in warned and "'id'" in warned


# ------------------------------------------------------------------ 3. lone surrogates
@pytest.mark.parametrize("route,raw,param", [
    ("/v1/completions", '{"model": "tiny", "prompt": "abc\\ud800def", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "x\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "abc", "max_tokens": 2}', "model"),
    ("/v1/completions", '{"model": "tiny", "prompt": "abc", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi\\ud800"}]}',
     "messages"),
    ("/tokenize", '{"prompt": "abc\\ud800def"}', "prompt"),
    ("/tokenize", '{"model": "\\udc00", "prompt": "abc"}', "model"),
])
def test_lone_surrogates_get_400_naming_the_field(srv, route, raw, param):
    r = _post(srv, route, content=raw.encode())
    assert r.status_code == 400, r.text
    err = _openai_error(r)
    assert err["param"] == param and param in err["message"] and "Unicode" in err["message"]


# ------------------------------------------------------------------ 7. framework errors in OpenAI's shape
@pytest.mark.parametrize("method,path,content,status", [
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400),         # invalid UTF-8
    ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400),                   # deep JSON
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "x", "n": "lots"}', 400),  # validation
    ("GET", "/v1/nothing-here", None, 404),
    ("POST", "/v1/models", b"{}", 405),
    ("GET", "/v1/completions", None, 405),
])
def test_framework_errors_use_openai_error_json(srv, method, path, content, status):
    r = httpx.request(method, srv.url + path, content=content, headers={**AUTH, "content-type": "application/json"},
                      timeout=60)
    assert r.status_code == status, r.text
    assert "detail" not in r.json()
    _openai_error(r)


@pytest.mark.parametrize("depth", [500, 900, 990, 5000])
def test_deeply_nested_extras_never_give_a_server_error(srv, depth):
    raw = b'{"model": "tiny", "prompt": "x", "max_tokens": 1, "extra": ' + b"[" * depth + b"]" * depth + b"}"
    r = _post(srv, "/v1/completions", content=raw)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        _openai_error(r)


# ------------------------------------------------------------------ 4. body limit; tokenizing off the loop
def test_oversized_bodies_get_413(srv):
    big = json.dumps({"model": "tiny", "prompt": "x" * MAX_BYTES}).encode()
    r = _post(srv, "/v1/completions", content=big)
    assert r.status_code == 413 and _openai_error(r)["code"] == "request_too_large"

    def chunks():   # no Content-Length: counted as it arrives
        for _ in range(MAX_BYTES // 65536 + 2):
            yield b" " * 65536
    r = httpx.post(srv.url + "/tokenize", content=chunks(), headers=AUTH, timeout=60)
    assert r.status_code == 413 and _openai_error(r)["code"] == "request_too_large"


def test_tokenizing_a_large_prompt_does_not_block_the_event_loop(srv):
    prompt = "the lazy dog jumps over " * (MAX_BYTES // 30)   # ~3.4 MB: about a second of SentencePiece
    done = threading.Event()
    result = {}

    def tokenize():
        result["r"] = _post(srv, "/tokenize", {"prompt": prompt}, timeout=120)
        done.set()

    t = threading.Thread(target=tokenize)
    t.start()
    answered_meanwhile = 0
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        r = httpx.get(srv.url + "/health", timeout=60)
        if not done.is_set() and r.status_code == 200:
            answered_meanwhile += 1
        time.sleep(0.01)
    t.join(timeout=60)
    assert result["r"].status_code == 200 and result["r"].json()["count"] > 500_000
    assert answered_meanwhile >= 3, "the event loop was blocked while the prompt was tokenized"


# ------------------------------------------------------------------ 6. the API key guards every route
@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/redoc"),
    ("GET", "/no-such-route"), ("POST", "/invocations"),
])
def test_api_key_is_required_on_every_route_but_health(srv, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.request(method, srv.url + path, headers=headers, timeout=30)
        assert r.status_code == 401, (path, headers, r.status_code)
        assert _openai_error(r)["type"] == "authentication_error"
    assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    assert httpx.get(srv.url + "/ping", timeout=30).status_code == 200    # SageMaker's health check


def test_api_key_scheme_is_case_insensitive(srv):
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}, timeout=30)
        assert r.status_code == 200, scheme
    assert httpx.get(srv.url + "/metrics", headers=AUTH, timeout=30).status_code == 200


def test_api_key_from_the_environment(monkeypatch):
    from jaxinfer.cli import _api_key, build_parser

    monkeypatch.setenv("JAXINFER_API_KEY", "from-env")
    assert _api_key(build_parser().parse_args(["serve"])) == "from-env"
    assert _api_key(build_parser().parse_args(["serve", "--api-key", "flag"])) == "flag"
    monkeypatch.delenv("JAXINFER_API_KEY")
    assert _api_key(build_parser().parse_args(["serve"])) is None


# ------------------------------------------------------------------ 8. the queue counts sequences
def test_a_request_that_can_never_fit_the_queue_is_400_not_429(srv):
    r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": [[5, 6, 7]] * (MAX_QUEUE + 1), "max_tokens": 1})
    assert r.status_code == 400 and "sequences" in _openai_error(r)["message"]
    # n samples are sequences too: 3 prompts x n=16 = 48 > 32
    r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": ["a", "b", "c"], "n": 16, "max_tokens": 1})
    assert r.status_code == 400 and _openai_error(r)["param"] == "n"
    r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": ["a", "b"], "n": 16, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 32


# ------------------------------------------------------------------ 5. stop strings: bounded and incremental
def test_stop_strings_are_bounded_in_length(srv):
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_LENGTH} characters"):
        SamplingParams(stop=["x" * (MAX_STOP_LENGTH + 1)])
    SamplingParams(stop=["x" * MAX_STOP_LENGTH] * 16)
    with pytest.raises(ValueError, match="at most 16"):
        SamplingParams(stop=[f"s{i}" for i in range(17)])
    r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": "fox", "stop": ["y" * 100_000] * 16})
    assert r.status_code == 400 and _openai_error(r)["param"] == "stop"


def test_hold_back_matches_the_definition_and_reads_only_the_tail():
    def reference(text, stops):   # the longest suffix of text that is a proper prefix of a stop
        return max([k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1)
                    if text.endswith(s[:k])], default=0)

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(0, 3))]
        assert hold_back(text, stops) == reference(text, stops), (text, stops)
    long_stop = "a" * (MAX_STOP_LENGTH - 1) + "b"
    assert hold_back("b" * 10**6 + "a" * 700, [long_stop]) == MAX_STOP_LENGTH - 1


def test_long_stop_strings_still_cut_the_stream(srv):
    body = {"model": "tiny", "prompt": "the lazy dog", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    free = _post(srv, "/v1/completions", body).json()["choices"][0]["text"]
    stop = free[10:30]
    text, finish = "", None
    with httpx.stream("POST", srv.url + "/v1/completions", headers=AUTH, timeout=60,
                      json={**body, "stream": True, "stop": [stop] + ["q" * MAX_STOP_LENGTH] * 15}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    assert text == free[:free.index(stop)] and finish == "stop"
