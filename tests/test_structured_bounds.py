"""Structured outputs that always parse (issue 44), through the official `openai` client against
`jaxinfer serve` on the bundled model, where the issue was found: a named tool_choice is one call, JSON
numbers end within the digit bounds at any temperature, and a tool-call turn cut by max_tokens says
"length" and keeps its whole calls.

References outside the code under test: jsonschema on every output, json's own parse hooks for each
number's text, digit counts restated from the README (tests/test_structured.within_bounds), each
schema's longest output computed here from the JSON grammar, and the raw text of the same constrained
decode for the calls a cut turn holds.
"""
from __future__ import annotations

import asyncio
import json
import os
import re

import pytest

from jaxinfer.generator import default_model_path
from tests.test_structured import numbers_of, within_bounds

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

VERSE = {"type": "function", "function": {
    "name": "get_verse", "description": "a verse of a book",
    "parameters": {"type": "object", "properties": {
        "book": {"type": "string", "enum": ["genesis", "psalms", "john"]},
        "chapter": {"type": "integer", "minimum": 1, "maximum": 150},
        "verse": {"type": "integer", "minimum": 1, "maximum": 176}},
        "required": ["book", "chapter", "verse"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [VERSE, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSG = [{"role": "user", "content": "Read me John 3:16."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.test_server import Server
    # the bundled checkpoint, linked into a temporary folder (the server writes its log beside the model)
    folder = tmp_path_factory.mktemp("bundled")
    os.symlink(os.path.abspath(default_model_path()), folder / "model")
    s = Server(folder / "model", "--max-model-len", "1024", "--max-num-seqs", "32")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)


def _check_calls(calls, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_named_tool_choice_is_exactly_one_call(server):
    """The issue's request: tool_choice naming get_verse, parallel_tool_calls at its default (true),
    max_tokens=120, temperature 0, came back as content holding a cut JSON array of get_verse calls.
    Now, greedy and seeded at temperature 1.0, parallel_tool_calls unset or true, streamed or not: one
    call of that function, its arguments valid against its parameters, finish_reason "stop" (a named
    choice's, as OpenAI and vLLM answer it).
    The 24 requests go in at once (the server batches them; each one's tokens are what it would
    draw alone: greedy, or keyed by its seed and position)."""
    kws = [dict(model="tiny", messages=MSG, tools=TOOLS, max_tokens=120, **sampling, **parallel,
                tool_choice={"type": "function", "function": {"name": name}})
           for name in ("get_verse", "get_time")
           for sampling in (dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=1.0, seed=2))
           for parallel in ({}, {"parallel_tool_calls": True})]

    async def run():
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)

        async def both(kw):
            r = await c.chat.completions.create(**kw)
            async with c.chat.completions.stream(**kw) as stream:
                s = await stream.get_final_completion()
            return r, s
        return await asyncio.wait_for(asyncio.gather(*(both(kw) for kw in kws)), timeout=600)

    for kw, (r, s) in zip(kws, asyncio.run(run())):
        name = kw["tool_choice"]["function"]["name"]
        for c in (r.choices[0], s.choices[0]):
            assert c.finish_reason == "stop" and not c.message.content, c.message   # named: OpenAI's rule
            (call,) = c.message.tool_calls
            assert call.function.name == name
            _check_calls([call], {name})
        assert s.choices[0].message.tool_calls[0].function.arguments == \
            r.choices[0].message.tool_calls[0].function.arguments


# Schemas of bounded fields only (numbers, integers, booleans, enums, strings with maxLength, arrays with
# maxItems), the issue's `{"ok": boolean, "score": number in [-1, 1]}` first
BOUNDED = [
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "score": {"type": "number", "minimum": -1, "maximum": 1}},
     "required": ["ok", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number"}, "n": {"type": "integer"},
                                      "level": {"type": "string", "enum": ["low", "mid", "high"]}},
     "required": ["x", "n", "level"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                               "maxItems": 2}},
     "required": ["name", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"vals": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                                      "mean": {"type": "number"},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["vals", "mean", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number"},
                                                                                  "y": {"type": "number"}},
                                                "required": ["x", "y"], "additionalProperties": False},
                                      "unit": {"enum": ["m", "km"]}, "flag": {"type": "boolean"}},
     "required": ["point", "unit", "flag"], "additionalProperties": False},
]


def longest_json(schema: dict) -> int:
    """The most bytes compact JSON valid for schema can take under the README's bounds: a number 25
    (`-0.`, 17 digits, `e-`, 3 digits), an integer 21 (`-`, 20 digits) or its range's longer end, a
    string 2 + 12 per character (a surrogate pair written as two \\u escapes), every optional part
    present, no whitespace."""
    if "enum" in schema:
        return max(len(json.dumps(v, separators=(",", ":"))) for v in schema["enum"])
    kind = schema["type"]
    if kind == "boolean":
        return len("false")
    if kind == "integer":
        if "minimum" in schema and "maximum" in schema:
            return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
        return 1 + 20
    if kind == "number":
        return len("-0.") + 17 + len("e-") + 3
    if kind == "string":
        return 2 + 12 * schema["maxLength"]
    if kind == "array":
        n = schema["maxItems"]
        return 2 + n * longest_json(schema["items"]) + max(n - 1, 0)
    assert kind == "object" and schema["additionalProperties"] is False
    props = schema["properties"]
    return 2 + sum(len(json.dumps(k)) + 1 + longest_json(v) for k, v in props.items()) + len(props) - 1


def test_twenty_sampled_json_outputs_parse(server):
    """20 seeded requests at temperature 1.0 with max_tokens=200 (without the digit bounds half of them run
    into max_tokens inside a number on this model), half through chat response_format, half through
    completions guided_json, all at once: every output stops, parses, validates, and every number is
    within the digit bounds. Nothing is unbounded: each schema's longest output is at most 158 bytes, so
    at most 158 tokens (each spells a byte or more) and an end-of-sequence fit in 200."""
    assert [longest_json(s) for s in BOUNDED] == [46, 72, 158, 121, 96]

    async def run():
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)
        calls = []
        for i in range(20):
            schema = BOUNDED[i % len(BOUNDED)]
            if i % 2 == 0:
                calls.append(c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"json {i}"}], max_tokens=200,
                    temperature=1.0, seed=i,
                    response_format={"type": "json_schema", "json_schema": {"name": f"b{i}", "schema": schema}}))
            else:
                calls.append(c.completions.create(model="tiny", prompt=f"json {i}:", max_tokens=200, temperature=1.0,
                                                  seed=i, extra_body={"guided_json": schema}))
        return await asyncio.wait_for(asyncio.gather(*calls), timeout=600)

    numbers, parsed = [], 0
    for i, r in enumerate(asyncio.run(run())):
        choice = r.choices[0]
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert choice.finish_reason == "stop" and r.usage.completion_tokens < 200, (i, text)
        jsonschema.validate(json.loads(text), BOUNDED[i % len(BOUNDED)])
        parsed += 1
        numbers += numbers_of(text)
    assert parsed == 20 and all(within_bounds(n) for n in numbers), numbers
    assert max(map(len, numbers)) > 12        # the model writes long numbers: the bounds are what end them


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def test_a_cut_tool_call_array_returns_its_complete_calls(client):
    """tool_choice "required" (parallel) at temperature 0: this model writes calls until max_tokens cuts
    one. The answer is finish_reason "length" with, as tool_calls, the calls written whole before the
    cut, streamed or not. The reference is the same prompt (tools rendered, tool_choice "none") under
    the array schema built here from the tools: its raw text, whose whole calls the test finds itself
    by closing the array after each `}`."""
    array = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                          "arguments": t["function"]["parameters"]},
         "required": ["name", "arguments"], "additionalProperties": False} for t in TOOLS]}}
    base = dict(model="tiny", messages=MSG, tools=TOOLS, max_tokens=150, temperature=0)
    raw = client.chat.completions.create(**base, tool_choice="none", response_format={
        "type": "json_schema", "json_schema": {"name": "calls", "schema": array}}).choices[0]
    assert raw.finish_reason == "length", raw.message.content
    text = raw.message.content
    whole = max((json.loads(text[:k] + "]") for k in range(1, len(text) + 1)
                 if text[k - 1] == "}" and _parses(text[:k] + "]")), key=len)
    assert len(whole) >= 2 and not _parses(text)
    kw = dict(base, tool_choice="required")
    r = client.chat.completions.create(**kw)
    # the client's stream helper reassembles the deltas, then refuses a "length" ending, carrying the
    # reassembled completion on the error
    with pytest.raises(openai.LengthFinishReasonError) as cut:
        with client.chat.completions.stream(**kw) as stream:
            stream.get_final_completion()
    for c in (r.choices[0], cut.value.completion.choices[0]):
        assert c.finish_reason == "length" and not c.message.content, c.message
        assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
               [(w["name"], w["arguments"]) for w in whole]
        _check_calls(c.message.tool_calls, set(PARAMS))


def test_no_compilations_and_every_block_free(server, client):
    """After the requests above (module order): nothing compiled after warm-up, every KV block free."""
    client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"guided_choice": ["a", "b"]})
    assert server.metric("jaxinfer_compilations_after_warmup") == 0
    from tests.test_server import _wait_blocks_free
    assert _wait_blocks_free(server) == 0
