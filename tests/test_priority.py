"""Request priority (issue 57), vLLM's semantics: `priority` (an integer, lower first) on
Generator.generate / stream, the engine client and the HTTP bodies; a priority other than 0 under
the fcfs policy is refused (vLLM's "Got priority ... but Priority scheduling is not enabled").

References: hand counts of engine steps (a request admitted when a sequence slot frees holds its
first token within max_tokens + 2 steps of its arrival: the running rows' remaining tokens, plus
one step of async scheduling's lag), greedy decoding by full forwards (gen.logits) for the
outputs, which must not depend on the order requests ran in.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from fastapi.testclient import TestClient

from jaxinfer import Generator, SamplingParams
from serve.app import build_app

SMALL = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=32, max_num_seqs=2, block_size=8)
LOW = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
URGENT = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gen(hf_model_dir) -> Generator:
    return Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **SMALL, scheduling_policy="priority",
                                     warmup=False)


def _greedy(gen: Generator, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(gen.logits(ids)[-1])))
    return ids[len(prompt):]


def test_urgent_request_overtakes_a_saturated_queue_and_nothing_starves(gen):
    client = gen.client
    events: list[tuple[int, str, int]] = []   # (step, request id, tokens in the delta)
    step = [0]
    route = lambda d: events.append((step[0], d.request_id, len(d.token_ids)))  # noqa: E731
    low_prompts = [[3 + i, 7, 9 + i, 11] for i in range(6)]
    low = client.submit(low_prompts, LOW, route=route, priority=5)
    for _ in range(2):                  # two requests run, four wait
        step[0] += 1
        client.step()
    arrived = step[0]
    [urgent] = client.submit([[40, 41, 42]], URGENT, route=route, priority=-1)
    while client.has_unfinished():
        step[0] += 1
        client.step()
    first = {rid: min(s for s, r, n in events if r == rid and n) for rid in [*low, urgent]}
    # the queue was full (max_num_seqs=2): the urgent request waits only for a slot to free, at most
    # the running rows' remaining LOW.max_tokens steps, plus one of async scheduling's lag
    assert first[urgent] - arrived <= LOW.max_tokens + 2
    # ... and takes the first slot that frees, ahead of the low-priority requests waiting when it
    # arrived (two slots: at most one of them starts in the same step)
    waiting_then = [rid for rid in low if first[rid] > arrived]
    assert len(waiting_then) == 4 and all(first[urgent] <= first[rid] for rid in waiting_then)
    assert sum(first[rid] == first[urgent] for rid in waiting_then) <= 1
    # nothing starves: every low-priority request finished
    assert sum(n for _, r, n in events if r == urgent) == URGENT.max_tokens
    for rid in low:
        assert sum(n for _, r, n in events if r == rid) == LOW.max_tokens
        client.release(rid, abort=False)
    client.release(urgent, abort=False)
    s = gen.stats()
    assert s["kv_blocks_used"] == 0 and s["num_waiting"] == 0 and s["num_running"] == 0


def test_generate_and_stream_take_priority(gen):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    outs = gen.generate(prompts, LOW, priority=[3, -2, 0])
    for p, o in zip(prompts, outs):
        assert o.token_ids == _greedy(gen, p, LOW.max_tokens)
    streamed = [t for d in gen.stream([5, 6, 7, 8], LOW, priority=-7) for t in d.token_ids]
    assert streamed == outs[0].token_ids
    with pytest.raises(ValueError, match="priorities for 3 prompts"):
        gen.generate(prompts, LOW, priority=[1, 2])


def test_priority_under_fcfs_is_refused_as_vllm_does(hf_model_dir):
    fcfs = Generator.from_pretrained(hf_model_dir("llama-gqa-llama3"), **SMALL, warmup=False)
    with pytest.raises(ValueError, match=r"priority 3 but priority scheduling is not enabled.*--scheduling-policy"):
        fcfs.generate([[5, 6, 7]], LOW, priority=3)
    q: deque = deque()
    with pytest.raises(ValueError, match="priority must be an integer"):
        fcfs.client.submit([[5, 6]], LOW, route=q.append, priority=1.5)
    assert not fcfs.client.has_unfinished()
    with TestClient(build_app(fcfs, "tiny")) as http:
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "priority": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert "--scheduling-policy priority" in r.json()["error"]["message"]
        # ignore_eos: the request samples at temperature 1 from a 131-token vocabulary, where EOS
        # comes ~1 time in 131 and would end it after one token
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "priority": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_http_bodies_carry_priority(gen):
    with TestClient(build_app(gen, "tiny")) as http:
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0,
                                               "ignore_eos": True, "priority": -3, "logprobs": 0})
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]   # no tokenizer: "token_id:N"
        assert tokens == [f"token_id:{t}" for t in _greedy(gen, [5, 6, 7, 8], 6)]
        r = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "priority": "high"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
