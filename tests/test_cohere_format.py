"""Command R7B / A's output format (the cohere_command3 / cohere_command4 parsers) against Cohere's own
reader of it, cohere_melody (what vLLM's parsers of those names call): the thinking, the answer
without its markers, and the calls with the model's ids, whole and streamed in pieces of every size."""
from __future__ import annotations

import json

import pytest

from serve.reasoning import ThinkParser, default_reasoning_parser, split_reasoning
from serve.tool_parsers import default_tool_parser
from serve.tools import auto_parser, parse_auto, plan_tools

melody = pytest.importorskip("cohere_melody")

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}} for name in ("get_weather", "get_time")]
ACTION = ('<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris", '
          '"days": 3}},\n    {"tool_call_id": "1", "tool_name": "get_time", "parameters": {"city": "Oslo"}}\n]'
          '<|END_ACTION|>')
OUTPUTS = [
    "<|START_THINKING|>Two cities: I call both tools.<|END_THINKING|>" + ACTION,
    ACTION,
    "<|START_THINKING|>Nothing to look up.<|END_THINKING|><|START_RESPONSE|>It is 4 o'clock.<|END_RESPONSE|>",
    "<|START_RESPONSE|>Hello there, how can I help?<|END_RESPONSE|>",
    '<|START_THINKING|>One call.<|END_THINKING|><|START_ACTION|>[{"tool_call_id": "7", "tool_name": "get_time", '
    '"parameters": {}}]<|END_ACTION|>',
]


def _theirs(text: str, options) -> tuple:
    r = melody.PyFilter(options).process_full_text(text)
    # a call without parameters: melody's arguments are "", OpenAI's (and ours) "{}"
    calls = [(c.id, c.name, json.loads(c.arguments or "{}")) for c in r.tool_calls]
    return r.reasoning, r.content, calls


def _ours(parser: str, text: str, pieces: int | None = None) -> tuple:
    plan = plan_tools(TOOLS, None, None)
    if pieces is None:
        reasoning, content = split_reasoning(parser, "", text)
        content, calls = parse_auto(content, plan, parser)
    else:   # streamed: the reasoning parser's content goes on to the tool-call parser piece by piece
        think, tools = ThinkParser(parser, "open"), auto_parser(parser, plan)
        reasoning, content, calls = "", "", []
        for i in range(0, len(text), pieces):
            r, c = think.feed(text[i:i + pieces])
            c, more = tools.feed(c)
            reasoning, content, calls = reasoning + r, content + c, calls + more
        r, c = think.finish()
        c1, more = tools.feed(c)
        c2, last = tools.finish()
        reasoning, content, calls = reasoning + r, content + c1 + c2, calls + more + last
        reasoning, content = reasoning or None, content or None
    return reasoning, content, [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                                for c in calls]


@pytest.mark.parametrize("parser", ["cohere_command3", "cohere_command4"])
@pytest.mark.parametrize("text", OUTPUTS)
def test_as_cohere_melody_reads_it(parser, text):
    options = getattr(melody.PyFilterOptions(), parser.removeprefix("cohere_command").replace("3", "cmd3")
                      .replace("4", "cmd4"))()
    want = _theirs(text, options)
    assert _ours(parser, text) == want
    for pieces in (1, 2, 3, 5, 8, 13):
        assert _ours(parser, text, pieces) == want, pieces


def test_picked_by_the_template():
    """A template that writes Cohere's thinking and action markers picks both parsers."""
    template = ("{% for m in messages %}<|START_OF_TURN_TOKEN|>{{ m['content'] }}<|END_OF_TURN_TOKEN|>{% endfor %}"
                "{% if tools %}<|START_ACTION|>...<|END_ACTION|>{% endif %}"
                "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>...<|END_THINKING|>")
    assert (default_reasoning_parser(template), default_tool_parser(template)) == ("cohere_command3",
                                                                                    "cohere_command3")
