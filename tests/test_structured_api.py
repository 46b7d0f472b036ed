"""Structured outputs, logit_bias and tool calls through the OpenAI API (issue #18, the API layer).

Two parts. Unit tests of the request -> SamplingParams mapping, the tool-call schema, rendering and
parsing (no engine), with issue 44's named tool_choice (one call) and "length" over "tool_calls" for a
cut turn. Then the real server with the official `openai` client: one module-scoped
server (16-token step budget, compiled once) that serves every constrained request. Expected values
come from outside the code under test: jsonschema validation, re.fullmatch, the request's own tool
schemas, and the SentencePiece model file for token pieces.
"""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from jaxinfer.config import StructuredOutputs
from serve.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from serve.tools import (AutoToolParser, ToolSpecError, complete_calls, parse_auto, parse_choice, parse_forced,
                         plan_tools, template_messages)

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["paris", "rome", "oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSG = [{"role": "user", "content": "the weather in paris"}]


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MSG, **kw)


def _refused(make, param: str) -> str:
    with pytest.raises(OpenAIError) as e:
        make()
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    return e.value.message


# ====================================================================== unit: request mapping
def test_response_format_guided_and_structured_outputs_map_onto_sampling_params():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        (dict(response_format={"type": "json_object"}), StructuredOutputs(json_object=True)),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}),
         StructuredOutputs(json=schema)),
        (dict(guided_json=schema), StructuredOutputs(json=schema)),
        (dict(guided_json=json.dumps(schema)), StructuredOutputs(json=schema)),
        (dict(guided_regex="[a-z]{3}"), StructuredOutputs(regex="[a-z]{3}")),
        (dict(guided_choice=["yes", "no"]), StructuredOutputs(choice=("yes", "no"))),
        (dict(guided_grammar='start: "a"+'), StructuredOutputs(grammar='start: "a"+')),
        (dict(structured_outputs={"regex": "x+", "json": None}), StructuredOutputs(regex="x+")),
        (dict(structured_outputs={"json_object": True}), StructuredOutputs(json_object=True)),
        (dict(structured_outputs={"json": schema, "disable_any_whitespace": False}),
         StructuredOutputs(json=schema, whitespace_flexible=True)),
        (dict(response_format={"type": "text"}), None),
        ({}, None),
    ]
    for kw, want in cases:
        for req in (CompletionRequest(prompt="x", **kw), _chat(**kw)):
            assert req.sampling_params(8, None).structured_outputs == want, kw


def test_constraint_errors_name_the_field():
    c = lambda **kw: (lambda: CompletionRequest(prompt="x", **kw).sampling_params(8, None))  # noqa: E731
    _refused(c(response_format={"type": "json_schema", "json_schema": {"schema": {}}}), "response_format")
    _refused(c(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format")
    _refused(c(response_format={"type": "json_schema"}), "response_format")
    _refused(c(response_format={"type": "yaml"}), "response_format")
    _refused(c(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}), "response_format")
    _refused(c(guided_json="{not json"), "guided_json")
    _refused(c(guided_choice=[]), "guided_choice")
    _refused(c(guided_regex=""), "guided_regex")
    assert "structural_tag" in _refused(c(structured_outputs={"structural_tag": "x"}), "structured_outputs")
    _refused(c(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs")
    _refused(c(structured_outputs={}), "structured_outputs")
    # two constraints at once: refused naming the second
    msg = _refused(c(response_format={"type": "json_object"}, guided_regex="a+"), "guided_regex")
    assert "response_format" in msg
    _refused(lambda: _chat(tools=TOOLS, tool_choice="required", guided_choice=["a"]).sampling_params(8, None),
             "tool_choice")
    # an engine error about the constraint maps back to the field this request used
    assert CompletionRequest(prompt="x", guided_json={}).request_field("structured_outputs") == "guided_json"
    assert _chat(response_format={"type": "json_object"}).request_field("structured_outputs") == "response_format"
    assert _chat(tools=TOOLS, tool_choice="required").request_field("structured_outputs") == "tools"
    assert _chat().request_field("logit_bias") == "logit_bias"


def test_unsupported_message_fields_are_refused_not_dropped():
    import pydantic
    for name, value in (("function_call", {"name": "f", "arguments": "{}"}), ("audio", {"id": "a1"}),
                        ("refusal", "no")):
        with pytest.raises(pydantic.ValidationError) as e:
            ChatCompletionRequest(messages=[{"role": "assistant", "content": "x", name: value}])
        err = e.value.errors()[0]
        assert err["type"] == "invalid_field" and err["ctx"]["param"] == "messages" and name in err["msg"]
    # null is what clients send for "none": accepted
    ChatCompletionRequest(messages=[{"role": "assistant", "content": "x", "function_call": None, "refusal": None}])


def test_logit_bias_maps_ids_and_checks_bounds():
    p = CompletionRequest(prompt="x", logit_bias={"5": 100, "12": -3.5}).sampling_params(8, None)
    assert dict(p.logit_bias) == {5: 100.0, 12: -3.5}
    assert CompletionRequest(prompt="x", logit_bias={}).sampling_params(8, None).logit_bias is None
    for bad in ({"fox": 1}, {"5.5": 1}, {"": 1}):
        _refused(lambda: CompletionRequest(prompt="x", logit_bias=bad).sampling_params(8, None), "logit_bias")
    for bad in ({"5": 101}, {"5": -1000}, {"-3": 1}):
        _refused(lambda: _chat(logit_bias=bad).sampling_params(8, None), "logit_bias")


# ====================================================================== unit: tools
def test_tool_specs_are_checked_naming_the_field():
    bad_tools = [
        [{"type": "retrieval"}],
        [{"type": "function"}],
        [{"type": "function", "function": {"parameters": {}}}],
        [{"type": "function", "function": {"name": "has space"}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
        [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
        [WEATHER, WEATHER],
    ]
    for tools in bad_tools:
        with pytest.raises(ToolSpecError) as e:
            plan_tools(tools, None, None)
        assert e.value.param == "tools", tools
    for choice in ("always", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}, 3):
        with pytest.raises(ToolSpecError) as e:
            plan_tools(TOOLS, choice, None)
        assert e.value.param == "tool_choice"
    with pytest.raises(ToolSpecError) as e:
        plan_tools(None, "required", None)
    assert e.value.param == "tool_choice"
    assert plan_tools(None, None, None) is None and plan_tools([], "none", None) is None
    assert plan_tools(None, "auto", None) is None
    assert plan_tools(TOOLS, None, None).mode == "auto" and plan_tools(TOOLS, "none", None).mode == "none"
    # through the request model: the same 400s
    _refused(lambda: _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}).sampling_params(
        8, None), "tool_choice")
    _refused(lambda: _chat(tools=[{"type": "x"}]).sampling_params(8, None), "tools")


def _valid(instance, schema) -> bool:
    try:
        jsonschema.validate(instance, schema)
        return True
    except jsonschema.ValidationError:
        return False


def test_forced_call_schema_accepts_exactly_the_tools_calls():
    """The constraint's schema, judged by jsonschema against calls built from the request's tools."""
    w = {"name": "get_weather", "arguments": {"city": "rome", "days": 3}}
    t = {"name": "get_time", "arguments": {"zone": "utc"}}
    required = plan_tools(TOOLS, "required", None).schema()
    jsonschema.Draft202012Validator.check_schema(required)
    assert _valid([w], required) and _valid([w, t], required)
    assert not _valid([], required) and not _valid(w, required)
    assert not _valid([{"name": "get_weather", "arguments": {"zone": "utc"}}], required)
    assert not _valid([{"name": "nope", "arguments": {}}], required)
    assert not _valid([{**w, "extra": 1}], required)
    single = plan_tools(TOOLS, "required", False).schema()
    assert _valid(w, single) and _valid(t, single) and not _valid([w], single)
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False).schema()
    assert _valid(t, named) and not _valid(w, named)
    # a named function is exactly one call of it, parallel_tool_calls or not (issue 44: it was an array of
    # any number of them, and the model wrote them until max_tokens)
    for parallel in (True, None):
        named_many = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, parallel).schema()
        assert _valid(t, named_many) and not _valid([t, t], named_many) and not _valid([t], named_many)
        assert not _valid(w, named_many)
    no_params = plan_tools([{"type": "function", "function": {"name": "ping"}}], "required", False).schema()
    assert _valid({"name": "ping", "arguments": {}}, no_params)
    # a function declared without parameters takes none (OpenAI: "an empty parameter list")
    assert not _valid({"name": "ping", "arguments": {"x": 1}}, no_params)


def test_forced_and_auto_outputs_parse_into_tool_calls():
    plan = plan_tools(TOOLS, "required", None)
    calls = parse_forced('[{"name": "get_weather", "arguments": {"city": "oslo", "days": 2}}]', plan)
    assert len(calls) == 1 and re.fullmatch(r"call_[0-9a-f]{24}", calls[0]["id"]) and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "oslo", "days": 2}
    assert parse_forced('[{"name": "get_weather", "arguments": {"ci', plan) is None   # cut by max_tokens
    assert parse_forced('[{"name": "other", "arguments": {}}]', plan) is None

    auto = plan_tools(TOOLS, "auto", None)
    text = 'Let me look.\n<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>\n' \
           '<tool_call>{"name": "get_weather", "arguments": {"city": "rome", "days": 1}}</tool_call>'
    content, calls = parse_auto(text, auto)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    content, calls = parse_auto('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>  ', auto)
    assert content is None and len(calls) == 1
    for plain in ("no calls here", 'a <tool_call>{"name": "unknown", "arguments": {}}</tool_call> b',
                  "<tool_call>not json</tool_call>", '<tool_call>{"name": "get_time", "arg',
                  "less < than <tool", ""):
        assert parse_auto(plain, auto) == (plain, []), plain
    one = plan_tools(TOOLS, "auto", False)
    assert len(parse_auto(text, one)[1]) == 1


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_cut_forced_array_keeps_its_complete_calls():
    """An array of forced calls cut anywhere by max_tokens: the calls whose JSON closed before the cut
    (known here from how the text was built), each with valid arguments; one-call forms have none."""
    items = [{"name": "get_weather", "arguments": {"city": "rome", "days": 2}},
             {"name": "get_time", "arguments": {"zone": "utc"}},
             {"name": "get_weather", "arguments": {"city": "oslo", "days": 7}}]
    plan = plan_tools(TOOLS, "required", None)
    for sep in (",", ", "):
        parts = [json.dumps(item, separators=(sep, ":")) for item in items]
        text = "[" + sep.join(parts) + "]"
        ends = [len("[" + sep.join(parts[:i + 1])) for i in range(len(parts))]   # where each call closes
        for cut in range(len(text)):
            want = [(it["name"], it["arguments"]) for it, end in zip(items, ends) if end <= cut]
            assert _calls(complete_calls(text[:cut], plan)) == want, text[:cut]
        assert _calls(parse_forced(text, plan)) == [(it["name"], it["arguments"]) for it in items]
    assert complete_calls('[{"name": "nope", "arguments": {}}, {"name": "get_time"', plan) == []
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    assert complete_calls('{"name": "get_time", "arguments": {"zone": "u', named) == []


def test_finish_reason_length_wins_over_tool_calls():
    """The decision on a turn cut by max_tokens (serve.tools docstring): finish_reason "length" with the
    calls written whole before the cut, for required, auto and named, streamed or not."""
    required = plan_tools(TOOLS, "required", None)
    cut = '[{"name": "get_time", "arguments": {"zone": "cet"}}, {"name": "get_weather", "arguments": {"ci'
    content, calls, reason = parse_choice(cut, required, "length")
    assert content is None and reason == "length" and _calls(calls) == [("get_time", {"zone": "cet"})]
    whole = cut[:cut.index("}}") + 2] + "]"
    assert parse_choice(whole, required, "stop")[2] == "tool_calls"
    # nothing whole before the cut: the text, as before
    assert parse_choice(cut[:30], required, "length") == (cut[:30], [], "length")
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    assert parse_choice('{"name": "get_time", "arg', named, "length") == ('{"name": "get_time", "arg', [], "length")
    # a named choice's whole call finishes "stop" (OpenAI's rule, as vLLM's serving_chat applies it)
    assert parse_choice('{"name": "get_time", "arguments": {"zone": "cet"}}', named, "stop")[2] == "stop"
    auto = plan_tools(TOOLS, "auto", None)
    text = 'Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call> <tool_call>{"name": "get_w'
    content, calls, reason = parse_choice(text, auto, "length")
    assert reason == "length" and _calls(calls) == [("get_time", {"zone": "utc"})]
    block = '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    assert content == text.replace(block, "")      # the unfinished block stays content, as it always has
    assert parse_choice(text[:text.index(" <tool_call>{\"name\": \"get_w")], auto, "stop")[2] == "tool_calls"

    # streamed, in pieces of every size: the same calls and finish_reason as the whole text
    from serve.tools import ToolStream
    for plan, t in ((required, cut), (auto, text)):
        want_content, want_calls, want_reason = parse_choice(t, plan, "length")
        for size in (1, 3, 7, len(t)):
            ts, deltas = ToolStream(plan), []
            pieces = [t[i:i + size] for i in range(0, len(t), size)]
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                deltas += ts.feed(piece, last, "length" if last else None)
            streamed = [(d["tool_calls"][0]["function"]["name"], json.loads(n["tool_calls"][0]["function"]["arguments"]))
                        for d, n in zip(deltas, deltas[1:]) if "tool_calls" in d and "id" in d["tool_calls"][0]]
            assert streamed == _calls(want_calls) and ts.finish_reason("length") == want_reason
            assert ("".join(d.get("content") or "" for d in deltas) or None) == want_content


def test_auto_parser_streams_the_same_result_at_any_split():
    """Fed in pieces (every split point, and token-sized pieces), the streaming parser emits the
    content and calls that the whole-text parse gives; nothing that may open a block leaks early."""
    auto = plan_tools(TOOLS, "auto", None)
    texts = ['Sure <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call> done  ',
             'x<tool_cal y <tool_call>bad</tool_call>z', "plain text < tool", "  \n",
             '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>\n']
    for text in texts:
        want_content, want_calls = parse_auto(text, auto)
        for cuts in [[i] for i in range(len(text) + 1)] + [list(range(0, len(text), 3))]:
            p = AutoToolParser(auto)
            content, calls, prev = "", [], 0
            for c in cuts + [len(text)]:
                piece, more = p.feed(text[prev:c])
                prev = c
                content += piece
                calls += more
                assert "<tool_call>" not in content or "bad" in text
            rest, _ = p.finish()
            content += rest
            assert (content if content or not calls else None) == want_content, (text, cuts)
            assert [c["function"] for c in calls] == [c["function"] for c in want_calls]


def test_plain_rendering_lists_tools_and_writes_calls_back():
    plan = plan_tools(TOOLS, "auto", None)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "time?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}]
    plain = template_messages(msgs, plan, native=False)
    assert plain[0]["role"] == "system" and plain[0]["content"].endswith("be brief")
    for t in TOOLS:
        assert json.dumps(t["function"]["name"]) in plain[0]["content"]
    assert "<tool_call>" in plain[0]["content"]
    assert plain[2]["content"] == '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    assert plain[3] == {"role": "tool", "content": "12:00"}
    assert template_messages(msgs[1:], plan, native=False)[0]["role"] == "system"
    native = template_messages(msgs, plan, native=True)
    assert native[1:] != msgs[1:] and native[2]["tool_calls"][0]["function"]["arguments"] == {"zone": "utc"}
    assert native[3]["tool_call_id"] == "call_1" and native[0] == msgs[0]
    assert template_messages(msgs[:2], None, native=False) == msgs[:2]


def test_templates_that_know_tools_receive_them():
    """An HF-style template that mentions `tools` gets them and the structured tool calls (arguments as
    objects); the plain template gets the preamble instead."""
    from serve.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplates
    from serve.protocol import ChatMessage
    hf = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
          "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
          "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.zone }}]{% endfor %}"
          "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}")
    call = {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
    msgs = [ChatMessage(role="user", content="time?"), ChatMessage(role="assistant", tool_calls=[call]),
            ChatMessage(role="tool", content="12:00", tool_call_id="call_9")]
    plan = plan_tools(TOOLS, None, None)

    def render(template: str) -> str:
        return ChatTemplates({"default": template}).render([m.template_dict() for m in msgs], plan)

    assert render(hf) == "<tools>get_weather;get_time;</tools><user>time?<assistant>[get_time utc]<tool>12:00(call_9)"
    plain = render(DEFAULT_CHAT_TEMPLATE)
    assert plain.startswith("System: You can call the following functions") and "<tools>" not in plain
    assert 'Assistant: <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>\nTool: 12:00\n' in plain


# ====================================================================== the server
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.hf_models import save_text_model
    return save_text_model(tmp_path_factory.mktemp("structured") / "model", max_positions=1024)


@pytest.fixture(scope="module")
def server(model_dir):
    from tests.test_server import Server
    # the tool preamble needs a longer context than test_server's 128 tokens
    s = Server(model_dir, "--max-model-len", "1024", "--max-num-seqs", "32")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def aclient(server):
    return lambda: openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def pieces(model_dir):
    """Token id <-> text piece, from the SentencePiece model file itself (not the server)."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    return sp


def _post(server, route, body):
    return httpx.post(f"{server.url}{route}", json={"model": "tiny", **body}, timeout=120)


def test_tools_render_into_the_prompt(server):
    """/tokenize renders a conversation with tools exactly as a chat request would."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
    msgs = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}]
    toks = httpx.post(f"{server.url}/tokenize", json={"messages": msgs, "tools": TOOLS}, timeout=30).json()
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": toks["tokens"]}, timeout=30).json()["prompt"]
    assert text.startswith("System: You can call the following functions")
    assert '"name": "get_weather"' in text and '"name": "get_time"' in text
    # (this SentencePiece model normalises newlines to spaces)
    assert ' Assistant: <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call> Tool: 12:00 ' \
           'Assistant:' in " ".join(text.split())


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
     "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 3},
                                      "b": {"type": "string", "maxLength": 3}},
     "required": ["a"], "additionalProperties": False},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "boolean"},
    {"type": "object", "properties": {"level": {"type": "string", "enum": ["low", "mid", "high"]},
                                      "score": {"type": "integer", "minimum": 0, "maximum": 10}},
     "required": ["level", "score"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["id"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 5}, "admin": {"type": "boolean"}},
        "required": ["name", "admin"], "additionalProperties": False},
        "roles": {"type": "array", "items": {"enum": ["r", "w"]}, "maxItems": 2}},
     "required": ["user", "roles"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "null"}}, "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5},
                                                      {"type": "boolean"}]}},
     "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["p"],
     "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 3}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"opt": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "req": {"enum": ["x", "y"]}},
     "required": ["req"], "additionalProperties": False},
]


def _gather(aclient, make_calls):
    async def run():
        c = aclient()
        return await asyncio.wait_for(asyncio.gather(*make_calls(c)), timeout=600)
    return asyncio.run(run())


def test_twenty_json_schemas_validate(aclient):
    """20 schemas, half through response_format on chat, half through guided_json / structured_outputs
    on completions, all at once; every output parses and validates (jsonschema)."""
    assert len(SCHEMAS) == 20

    def calls(c):
        out = []
        for i, schema in enumerate(SCHEMAS):
            if i % 3 == 0:
                out.append(c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"give json {i}"}], max_tokens=120,
                    temperature=0, response_format={"type": "json_schema",
                                                    "json_schema": {"name": f"s{i}", "schema": schema}}))
            elif i % 3 == 1:
                out.append(c.completions.create(model="tiny", prompt=f"json {i}:", max_tokens=120, temperature=0.8,
                                                seed=i, extra_body={"guided_json": schema}))
            else:
                out.append(c.completions.create(model="tiny", prompt=f"json {i}:", max_tokens=120, temperature=0,
                                                extra_body={"structured_outputs": {"json": schema}}))
        return out

    for schema, r in zip(SCHEMAS, _gather(aclient, calls)):
        choice = r.choices[0]
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert choice.finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice(aclient):
    regexes = [r"[a-z]{3}-[0-9]{2}", r"(yes|no)!", r"0x[0-9a-f]{4}", r"[A-Z][a-z]{1,5} [0-9]{1,3}"]
    choices = [["red", "green", "blue"], ["the quick fox", "lazy dog"], ["a", "ab", "abc"]]

    def calls(c):
        out = [c.completions.create(model="tiny", prompt=f"code {i}:", max_tokens=40, temperature=0.7, seed=i,
                                    extra_body={"guided_regex": rx}) for i, rx in enumerate(regexes)]
        out += [c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "pick"}], max_tokens=20,
                                          temperature=0, extra_body={"structured_outputs": {"regex": regexes[0]}})]
        out += [c.completions.create(model="tiny", prompt=f"pick {i}:", max_tokens=20, temperature=0.9, seed=i,
                                     extra_body={"guided_choice": ch}) for i, ch in enumerate(choices)]
        out += [c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "pick"}], max_tokens=20,
                                          temperature=0, extra_body={"structured_outputs": {"choice": choices[0]}})]
        out += [c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "obj"}], max_tokens=120,
                                          temperature=0, response_format={"type": "json_object"})]
        return out

    rs = _gather(aclient, calls)
    text = lambda r: r.choices[0].message.content if hasattr(r.choices[0], "message") else r.choices[0].text  # noqa
    for rx, r in zip(regexes + [regexes[0]], rs[:5]):
        assert re.fullmatch(rx, text(r)), (rx, text(r))
        assert r.choices[0].finish_reason == "stop"
    for ch, r in zip(choices + [choices[0]], rs[5:9]):
        assert text(r) in ch and r.choices[0].finish_reason == "stop"
    obj = rs[9]
    if obj.choices[0].finish_reason == "stop":   # any JSON object: a random model may run long
        assert isinstance(json.loads(text(obj)), dict)
    else:
        assert text(obj).startswith("{")


def test_streamed_constrained_output_equals_non_streamed(client):
    kw = dict(model="tiny", prompt="code:", max_tokens=30, temperature=0.8, seed=5,
              extra_body={"guided_regex": r"[a-z]{2,4}@[a-z]{2,4}\.(com|org)"})
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **kw) if ch.choices)
    assert streamed == full and re.fullmatch(r"[a-z]{2,4}@[a-z]{2,4}\.(com|org)", full)


def _generated_ids(r, sp) -> list[int]:
    """The generated token ids, from the logprobs' token strings and the SentencePiece model file."""
    return [sp.piece_to_id(t.replace(" ", "\u2581")) for t in r.choices[0].logprobs.tokens]


def test_logit_bias_forces_and_bans_tokens(client, pieces):
    kw = dict(model="tiny", prompt="the quick brown", max_tokens=8, temperature=0, logprobs=1)
    base = _generated_ids(client.completions.create(**kw), pieces)
    assert len(base) == 8
    forced = pieces.piece_to_id("\u2581fox")
    assert forced != pieces.unk_id()
    r = client.completions.create(**kw, extra_body={"logit_bias": {str(forced): 100}, "ignore_eos": True})
    assert _generated_ids(r, pieces) == [forced] * 8
    # banning greedy's first choice: it appears nowhere in the output
    first = base[0]
    banned = _generated_ids(client.completions.create(**kw, logit_bias={str(first): -100}), pieces)
    assert first not in banned
    # chat too
    chat = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5, temperature=0, logprobs=True,
                                          logit_bias={str(forced): 100})
    assert [c.token for c in chat.choices[0].logprobs.content] == [" fox"] * chat.usage.completion_tokens


def _check_calls(calls, allowed: set[str]):
    assert calls
    for call in calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_choice_required_yields_valid_calls(client, parallel):
    kw = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
              max_tokens=200, temperature=0.7, seed=3)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c.message
    _check_calls(c.message.tool_calls, set(PARAMS))
    if not parallel:
        assert len(c.message.tool_calls) == 1
    # streamed: the openai client reassembles the tool-call deltas
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    s = final.choices[0]
    assert s.finish_reason == "tool_calls"
    _check_calls(s.message.tool_calls, set(PARAMS))
    assert [(t.function.name, json.loads(t.function.arguments)) for t in s.message.tool_calls] == \
           [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]


def test_named_tool_choice_yields_that_function(client):
    for stream in (False, True):
        kw = dict(model="tiny", messages=MSG, tools=TOOLS, max_tokens=200, temperature=0.9, seed=11,
                  tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
        if stream:
            with client.chat.completions.stream(**kw) as s:
                r = s.get_final_completion()
        else:
            r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"     # a named choice's call: OpenAI's rule, as vLLM
        _check_calls(r.choices[0].message.tool_calls, {"get_time"})


def test_tool_results_and_auto_are_accepted(client):
    """A conversation that sends a call and its result back; tool_choice auto and none answer (the
    tiny random model writes no <tool_call> blocks, so content comes back: the parsing itself is
    unit-tested above)."""
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
    msgs = MSG + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_abc", "content": "12:00"}]
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice=choice,
                                           max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and isinstance(r.choices[0].message.content, str)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model="tiny", messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=8, temperature=0, stream=True)
            if ch.choices)
        assert streamed == r.choices[0].message.content


def test_auto_turns_tool_call_blocks_into_calls(client):
    """tool_choice auto parses what the model writes: here a guided_choice makes the tiny model write
    text and a <tool_call> block (the request itself says what must come back)."""
    written = 'Checking. <tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>'
    kw = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice="auto", max_tokens=120, temperature=0,
              extra_body={"guided_choice": [written]})
    r = client.chat.completions.create(**kw)
    with client.chat.completions.stream(**kw) as stream:
        s = stream.get_final_completion()
    for c in (r.choices[0], s.choices[0]):
        assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
        (call,) = c.message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "cet"}
    none = client.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert none.choices[0].message.content == written and not none.choices[0].message.tool_calls


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ("/v1/completions", {"guided_json": {"type": "nonsense"}}, "guided_json"),
    ("/v1/completions", {"guided_regex": "a[b"}, "guided_regex"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("/v1/completions", {"guided_grammar": "start: ::= nonsense ("}, "guided_grammar"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
        "tool_choice": "required"}, "tools"),
    ("/v1/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"999999": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"fox": 5}}, "logit_bias"),
    ("/v1/completions", {"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),   # the second in order
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
     "tool_choice"),
    ("/v1/completions", {"tools": TOOLS}, "tools"),
    ("/v1/chat/completions", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
])
def test_bad_constraints_get_400_naming_the_field(server, route, body, param):
    body = {**body, "max_tokens": 4}
    body |= {"prompt": "fox"} if route == "/v1/completions" else {"messages": MSG}
    r = _post(server, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_no_compilations_after_constrained_requests(server, client):
    """Runs after the constrained requests above (module order): none of them compiled anything."""
    client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"guided_choice": ["a", "b"]})
    assert server.metric("jaxinfer_compilations_after_warmup") == 0
    from tests.test_server import _wait_blocks_free
    assert _wait_blocks_free(server) == 0


def test_batch_script_takes_the_same_fields(model_dir, tmp_path):
    """The batch script maps bodies through the same protocol module: a choice, a forced tool call and
    a JSON schema run; a malformed response_format and a bad logit_bias are reported per line."""
    from jaxinfer import Generator
    from serve.batch import run_batch

    bodies = [("/v1/completions", {"prompt": "pick:", "max_tokens": 10, "guided_choice": ["left", "right"]}),
              ("/v1/chat/completions", {"messages": MSG, "tools": TOOLS, "tool_choice": "required",
                                        "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}),
              ("/v1/chat/completions", {"messages": MSG, "max_tokens": 60, "temperature": 0, "response_format": {
                  "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[3]}}}),
              ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema"}}),
              ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1000}})]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url,
                                       "body": {"model": "tiny", **body}}) + "\n" for i, (url, body) in enumerate(bodies)))
    gen = Generator.from_pretrained(model_dir, dtype="float32", max_model_len=1024, max_num_batched_tokens=32,
                                    token_buckets=[32], max_num_seqs=4, block_size=8, warmup=False)
    summary = run_batch(gen, inp, out, "tiny", progress=False)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["ran"] == 3 and [r["error"] is None for r in recs] == [True, True, True, False, False]
    assert recs[0]["response"]["body"]["choices"][0]["text"] in ("left", "right")
    msg = recs[1]["response"]["body"]["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] is None
    (call,) = msg["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])
    jsonschema.validate(json.loads(recs[2]["response"]["body"]["choices"][0]["message"]["content"]), SCHEMAS[3])
    assert "response_format" in recs[3]["error"]["message"] and "logit_bias" in recs[4]["error"]["message"]
    assert gen.stats()["kv_blocks_used"] == 0
