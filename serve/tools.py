"""OpenAI tool calls for /v1/chat/completions: checking `tools`/`tool_choice`, the JSON schema that
constrains a forced call, rendering tools into prompts, and parsing calls out of generated text.

Pure Python (no jax, no server): the request models (serve.protocol), the app (serve.app) and its
streamed chat choices (serve.stream, through ToolStream) use it, and a bad field is a `ToolSpecError`
naming the request field at fault, which they turn into a 400.

tool_choice:
  "none"      tools are rendered into the prompt (as vLLM does) but calls are never parsed;
  "auto"      unconstrained decoding; `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
              naming a known tool become tool_calls (the text outside them stays the content);
  "required"  decoding constrained by a JSON schema: with parallel_tool_calls (the default) an array
              (at least one item) of {"name": <a tool>, "arguments": <its parameters>}; without, one
              such object; the output is parsed into tool_calls;
  {"type": "function", "function": {"name": F}}   exactly one call of F, whatever parallel_tool_calls
              says (as OpenAI and vLLM answer it): one {"name": F, "arguments": <F's parameters>}.
The default when tools are given is "auto" ("none" without tools), as in OpenAI's API. A function
without `parameters` takes none: its arguments are {} (OpenAI: "an empty parameter list").

An output cut by max_tokens ends with finish_reason "length", calls or not (as OpenAI does, and as
vLLM's fixes for its "tool_calls" relabelling of cut turns settled on): a client must be able to tell
a finished turn from a cut one before it runs anything. The calls written whole before the cut come
back as tool_calls (each one's arguments valid JSON); the one being written when the cut came is
dropped ("required") or stays content ("auto", whose streamed calls went out as they completed).

Chat templates that mention `tools` (HF templates with tool support) get `tools=[...]` and the
messages with their `tool_calls` / `tool_call_id`; other templates get the plain rendering below:
a system preamble listing each function as JSON and asking for `<tool_call>` blocks, assistant
tool calls written back as those blocks, tool results as `tool` messages.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from serve.reasoning import partial_suffix
from serve.tool_parsers import (FAMILY_PARSERS, HeldSpace, make_call, model_call,  # noqa: F401 (new_call_id: re-exported)
                                new_call_id, parse_glm_call, parse_xml_call, strict_json)

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
SEED_TOOL_CALL_OPEN, SEED_TOOL_CALL_CLOSE = "<seed:tool_call>", "</seed:tool_call>"

PLAIN_PREAMBLE = (
    "You can call the following functions. Each is described by a JSON object:\n{tools}\n"
    "To call a function, answer with one block per call, exactly in this form:\n"
    '<tool_call>{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}</tool_call>')
# The families whose templates write an assistant's calls in the family's own format but never list
# the tools (DeepSeek-V3 / R1's and V3.1's published templates): the plain preamble lists them and asks
# for that format, and the calls sent back are the template's to write.
FAMILY_PREAMBLES = {
    "deepseek_v3": (
        "You can call the following functions. Each is described by a JSON object:\n{tools}\n"
        "To call functions, answer with all the calls in one section, exactly in this form:\n"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><function name>\n```json\n"
        "<arguments as JSON>\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n"
        "with one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> per call, on its own line."),
    "deepseek_v31": (
        "You can call the following functions. Each is described by a JSON object:\n{tools}\n"
        "To call functions, answer with all the calls in one section, exactly in this form:\n"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><function name><｜tool▁sep｜><arguments as JSON>"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n"
        "with one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> per call, chained with nothing between them."),
}


class ToolSpecError(ValueError):
    """A `tools`/`tool_choice`/`parallel_tool_calls`/`messages` value that cannot be honoured."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param, self.message = param, message


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools, checked once. mode: none | auto | required | named."""
    tools: tuple[dict, ...]            # the request's tools, normalised to OpenAI's shape
    mode: str
    name: str | None = None            # the forced function (mode "named")
    parallel: bool = True
    names: frozenset[str] = field(default_factory=frozenset)

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    @property
    def array(self) -> bool:
        """A forced output is an array of calls ("required" with parallel_tool_calls), else one call."""
        return self.mode == "required" and self.parallel

    def schema(self) -> dict:
        """The JSON schema that constrains a forced call (modes required and named)."""
        chosen = [t for t in self.tools if self.mode != "named" or t["function"]["name"] == self.name]
        options = [{"type": "object",
                    "properties": {"name": {"const": t["function"]["name"]},
                                   "arguments": t["function"]["parameters"]},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
        one = options[0] if len(options) == 1 else {"anyOf": options}
        return {"type": "array", "minItems": 1, "items": one} if self.array else one


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolPlan | None:
    """Check a request's tool fields; None when it has no tools and no tool_choice that needs them."""
    if tools is not None and not isinstance(tools, list):
        raise ToolSpecError("tools", "tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    tools = tools or []
    checked, names = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ToolSpecError("tools", f"{where}: only tools of type \"function\" are supported")
        f = t.get("function")
        if not isinstance(f, dict):
            raise ToolSpecError("tools", f"{where}.function must be an object")
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolSpecError("tools", f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or "
                                         f"'-', got {name!r}")
        if name in names:
            raise ToolSpecError("tools", f"{where}: the function name {name!r} is used twice")
        params = f.get("parameters")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
            raise ToolSpecError("tools", f"{where}.function.parameters must be a JSON schema of type \"object\"")
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolSpecError("tools", f"{where}.function.description must be a string")
        names.add(name)
        fn = {"name": name}
        if desc is not None:
            fn["description"] = desc
        # a function declared without parameters takes none: its arguments are {} and nothing else
        fn["parameters"] = params if params is not None else {"type": "object", "properties": {},
                                                              "additionalProperties": False}
        if f.get("strict") is not None:
            fn["strict"] = f["strict"]
        checked.append({"type": "function", "function": fn})
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolSpecError("parallel_tool_calls", "parallel_tool_calls must be true or false")
    parallel = parallel_tool_calls is not False

    choice = tool_choice if tool_choice is not None else ("auto" if checked else "none")
    name = None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolSpecError("tool_choice", f"tool_choice must be \"none\", \"auto\", \"required\" or "
                                               f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")
        mode = choice
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolSpecError("tool_choice", "a named tool_choice is {\"type\": \"function\", "
                                               "\"function\": {\"name\": ...}}")
        mode, name = "named", fn["name"]
        if name not in names:
            raise ToolSpecError("tool_choice", f"tool_choice names the function {name!r}, which is not among "
                                               f"the tools ({sorted(names) or 'none given'})")
    else:
        raise ToolSpecError("tool_choice", "tool_choice must be a string or an object")
    if mode == "required" and not checked:
        raise ToolSpecError("tool_choice", "tool_choice \"required\" needs a non-empty tools list")
    if not checked:
        return None
    return ToolPlan(tuple(checked), mode, name, parallel, frozenset(names))


# ------------------------------------------------------------------ rendering
def template_messages(messages: list[dict], plan: ToolPlan | None, native: bool,
                      family: str | None = None) -> list[dict]:
    """The messages as a chat template receives them. native: the template handles tools itself
    (assistant tool_calls get their arguments as objects, as HF templates expect); otherwise the
    plain rendering: tool calls written back as <tool_call> blocks and, with tools, a preamble
    merged into the first system message (or a new one). family: a FAMILY_PREAMBLES name where the
    template writes calls in that family's format (the preamble asks for it; the template writes the
    calls sent back)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            if native or family is not None:
                m["tool_calls"] = [_template_call(c) for c in calls]
            else:
                blocks = "".join(f"{TOOL_CALL_OPEN}{json.dumps(_call_object(c), ensure_ascii=False)}{TOOL_CALL_CLOSE}"
                                 for c in calls)
                m["content"] = (m.get("content") or "") + blocks
        if not native and family is None:
            m.pop("tool_call_id", None)
        out.append(m)
    if plan is not None and not native:
        preamble = FAMILY_PREAMBLES.get(family, PLAIN_PREAMBLE).format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": preamble + ("\n\n" + out[0]["content"] if out[0].get("content") else "")}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return strict_json(arguments)
        except (ValueError, RecursionError):
            return arguments
    return arguments


def _call_object(call: dict) -> dict:
    fn = call.get("function") or {}
    return {"name": fn.get("name"), "arguments": _arguments_object(fn.get("arguments"))}


class TemplateArguments(dict):
    """A call's arguments as a chat template receives them: the object HF templates expect (they
    iterate it or apply tojson), which also concatenates as the JSON text the client sent, for the
    templates that write `'...' + arguments` and so take the text (DeepSeek's published ones)."""

    def __init__(self, value: dict, text: str):
        super().__init__(value)
        self.text = text

    def __add__(self, other):
        return self.text + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return other + self.text if isinstance(other, str) else NotImplemented


def _template_call(call: dict) -> dict:
    """A call sent back, as a template receives it: its arguments as TemplateArguments, and its
    "type" ("function", which clients may leave out and DeepSeek's templates write)."""
    fn = call.get("function") or {}
    raw = fn.get("arguments")
    args = _arguments_object(raw)
    if isinstance(args, dict):
        args = TemplateArguments(args, raw if isinstance(raw, str) else json.dumps(args, ensure_ascii=False))
    return {"type": "function", **call, "function": {**fn, "arguments": args}}


def check_message_tool_calls(calls: Any) -> None:
    """An assistant message's tool_calls, as a client sends them back."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ToolSpecError("messages", "tool_calls must be a list")
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", ""), (str, dict)):
            raise ToolSpecError("messages", "each tool call is {\"id\", \"type\": \"function\", "
                                            "\"function\": {\"name\", \"arguments\"}}")


# ------------------------------------------------------------------ parsing
def _forced_call(item: Any, plan: ToolPlan) -> dict | None:
    if not (isinstance(item, dict) and item.get("name") in plan.names and isinstance(item.get("arguments"), dict)):
        return None
    return make_call(item["name"], item["arguments"])


def parse_forced(text: str, plan: ToolPlan) -> list[dict] | None:
    """The tool calls of a constrained (required / named) output, or None where it does not parse
    (the output was cut by max_tokens)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_forced_call(item, plan) for item in items]
    return calls if calls and None not in calls else None


_JSON_WS = " \t\n\r"


def complete_calls(text: str, plan: ToolPlan) -> list[dict]:
    """The calls a forced array output holds whole before the point where it was cut: the items of
    `[{call},{call},{"name":...` up to the first one that does not parse. [] for one-call forms."""
    if not plan.array:
        return []
    decoder, calls = json.JSONDecoder(), []
    i = len(text) - len(text.lstrip(_JSON_WS))
    if not text.startswith("[", i):
        return []
    i += 1
    while True:
        while i < len(text) and text[i] in _JSON_WS:
            i += 1
        try:
            item, i = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError):
            return calls
        call = _forced_call(item, plan)
        if call is None:
            return calls
        calls.append(call)
        while i < len(text) and text[i] in _JSON_WS:
            i += 1
        if not text.startswith(",", i):
            return calls
        i += 1


def _parse_block(body: str, plan: ToolPlan) -> dict | None:
    try:
        value = strict_json(body)     # NaN / Infinity are no JSON
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or value.get("name") not in plan.names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        args = _arguments_object(args)
    if not isinstance(args, dict):
        return None
    return model_call(value["name"], args)


class AutoToolParser(HeldSpace):
    """Incremental parser for tool_choice "auto": feed() text as it is generated and get back the
    content that is safe to show now and the tool calls completed so far; text that may be the start
    of a `<tool_call>` block is held back until it is known. A block whose JSON does not parse or
    names an unknown tool stays content. With calls, trailing whitespace of the content is dropped
    and whitespace-only content becomes null. Without parallel_tool_calls only the first call is kept."""

    def __init__(self, plan: ToolPlan, parse_block=None, tags: tuple[str, str] = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)):
        self.plan = plan
        self.open_tag, self.close_tag = tags     # the blocks' tags (Seed-OSS: <seed:tool_call>)
        # a block's body -> its call, or None (the block stays content): hermes' JSON by default
        self.parse_block = parse_block or _parse_block
        self.pending = ""        # text not yet classified
        self.in_block = False
        self.calls: list[dict] = []

    def _call(self, call: dict) -> list[dict]:
        if self.calls and not self.plan.parallel:
            return []
        self.calls.append(call)
        return [call]

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, calls = "", []
        while self.pending:
            if self.in_block:
                end = self.pending.find(self.close_tag)
                if end < 0:
                    break
                body = self.pending[:end]
                self.pending = self.pending[end + len(self.close_tag):]
                self.in_block = False
                call = self.parse_block(body.strip(), self.plan)
                if call is None:
                    content += self._content(self.open_tag + body + self.close_tag)
                else:
                    calls += self._call(call)
            else:
                start = self.pending.find(self.open_tag)
                if start >= 0:
                    content += self._content(self.pending[:start])
                    self.pending = self.pending[start + len(self.open_tag):]
                    self.in_block = True
                    continue
                keep = partial_suffix(self.pending, self.open_tag)
                content += self._content(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
        return content, calls

    def finish(self) -> tuple[str, list[dict]]:
        """The rest at the end of the output: an unfinished block is content."""
        rest = (self.open_tag if self.in_block else "") + self.pending
        self.pending, self.in_block = "", False
        return self._content(rest) + self._last_space(), []


def auto_parser(name: str, plan: ToolPlan):
    """tool_choice "auto"'s parser for a family's format: `<tool_call>` blocks here (hermes' JSON
    bodies, or qwen3_coder's XML ones), the others serve.tool_parsers'."""
    if name in ("hermes", "qwen3_coder"):
        return AutoToolParser(plan, parse_xml_call if name == "qwen3_coder" else None)
    if name == "seed_oss":   # qwen3_coder's XML calls in Seed-OSS's own blocks
        return AutoToolParser(plan, parse_xml_call, (SEED_TOOL_CALL_OPEN, SEED_TOOL_CALL_CLOSE))
    if name in ("glm45", "glm47"):      # <tool_call> blocks of a name and <arg_key> / <arg_value> pairs
        return AutoToolParser(plan, parse_glm_call)
    return FAMILY_PARSERS[name](plan)


def parse_auto(text: str, plan: ToolPlan, parser: str = "hermes") -> tuple[str | None, list[dict]]:
    """A whole "auto" output -> (content or None, tool calls); the same rules as streaming.
    parser: the family's format (serve.tool_parsers)."""
    p = auto_parser(parser, plan)
    c1, calls = p.feed(text)
    c2, more = p.finish()
    calls = calls + more
    content = c1 + c2
    return (content if content or not calls else None), calls


def forced_result(text: str, plan: ToolPlan, finish_reason: str | None) -> tuple[str | None, list[dict]]:
    """A whole forced (required / named) output -> (content, calls): the calls when it parses; cut by
    max_tokens, the calls written whole before the cut (content None) or, with none, the text."""
    calls = parse_forced(text, plan) or (complete_calls(text, plan) if finish_reason == "length" else [])
    return (None, calls) if calls else (text, [])


def parse_output(text: str, plan: ToolPlan | None, finish_reason: str | None = None,
                 parser: str = "hermes") -> tuple[str | None, list[dict]]:
    """A chat choice's text -> (content, tool calls) under the request's plan."""
    if plan is None or not plan.parses:
        return text, []
    if plan.constrained:
        return forced_result(text, plan, finish_reason)
    return parse_auto(text, plan, parser)


def choice_finish_reason(finish_reason: str | None, has_calls: bool, plan: ToolPlan | None) -> str | None:
    """OpenAI's finish_reason for a chat choice: "length" wins (a cut turn is never reported as
    finished calls); otherwise calls make it "tool_calls", except under a named tool_choice, whose
    call answers "stop" (OpenAI's rule, as vLLM's serving_chat applies it)."""
    if not has_calls or finish_reason == "length" or (plan is not None and plan.mode == "named"):
        return finish_reason
    return "tool_calls"


def parse_choice(text: str, plan: ToolPlan | None, finish_reason: str | None,
                 parser: str = "hermes") -> tuple[str | None, list[dict], str | None]:
    """A chat choice's whole text and the engine's finish_reason -> (content, tool calls, finish_reason)."""
    content, calls = parse_output(text, plan, finish_reason, parser)
    return content, calls, choice_finish_reason(finish_reason, bool(calls), plan)


class ToolStream:
    """One streamed chat choice under a tool plan: its text -> the chunk deltas to send. Forced calls
    (required / named) are buffered whole and sent when the output ends (cut by max_tokens: the calls
    written whole before the cut); "auto" streams content and holds back what may be a <tool_call>
    block (AutoToolParser). A tool call goes out as OpenAI does: a delta with its index, id, type and
    name (arguments ""), then one with the arguments. The finish_reason is the non-streamed one
    (choice_finish_reason: "length" wins over "tool_calls")."""

    def __init__(self, plan: ToolPlan, parser: str = "hermes"):
        self.plan = plan
        self.auto = None if plan.constrained else auto_parser(parser, plan)
        self.buffer = ""
        self.n_calls = 0

    def _call_deltas(self, calls: list[dict]) -> list[dict]:
        out = []
        for c in calls:
            i, self.n_calls = self.n_calls, self.n_calls + 1
            out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                        "function": {"name": c["function"]["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
        return out

    def feed(self, text: str, finished: bool, finish_reason: str | None = None) -> list[dict]:
        """The deltas to send for this piece of text (the last one carries the finish_reason; an
        empty delta {} where there is nothing to send)."""
        out: list[dict] = []
        if self.auto is None:
            self.buffer += text
            if finished:
                _, calls = forced_result(self.buffer, self.plan, finish_reason)
                out = self._call_deltas(calls) if calls else ([{"content": self.buffer}] if self.buffer else [])
        else:
            content, calls = self.auto.feed(text)
            if finished:
                rest, more = self.auto.finish()
                content += rest
                calls = calls + more
            if content:
                out.append({"content": content})
            out += self._call_deltas(calls)
        return out or [{}]

    def finish_reason(self, reason: str | None) -> str | None:
        return choice_finish_reason(reason, self.n_calls > 0, self.plan)
