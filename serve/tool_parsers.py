"""Tool-call parsers per model family (vLLM's `--tool-call-parser` names) for tool_choice "auto":
the text a model writes -> OpenAI tool_calls, streamed and not. Pure Python, no jax.

  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen 2.5/3, Hermes;
               serve.tools.AutoToolParser);
  qwen3_coder  `<tool_call>` blocks holding `<function=NAME>` and one `<parameter=P>VALUE</parameter>`
               per argument (Qwen3-Coder, Qwen3.5): each value's text becomes the type its schema
               declares (parse_xml_call); the same block handling as hermes;
  llama3_json  Llama 3.1+/3.2 JSON calls: an output that is (after an optional `<|python_tag|>`) one
               or more `{"name": ..., "parameters": {...}}` objects separated by `;`, or text and then
               `<|python_tag|>` and the calls (the text is content);
  llama4_json  Llama 4's JSON calls (its published template): llama3_json's objects, after an optional
               `<|python_start|>`; the template writes a turn with calls as `<|python_start|>TEXT<|python_end|>`
               (the text: content) and then the objects one after another; calls inside the tags are read too;
  mistral      `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (Mistral v0.3 / Nemo), or
               `[TOOL_CALLS]name[ARGS]{...}` (the v11+ tokenizers' form), or
               `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` (v11+ with call ids: mistral-common's
               decode_tool_calls); text before it is content; an id the model wrote (`[CALL_ID]`, or
               an array item's "id") is the call's id, else a new 9-character one;
  seed_oss     `<seed:tool_call>` blocks holding qwen3_coder's `<function=NAME>` XML (Seed-OSS);
  openai       gpt-oss harmony: a message whose header names a recipient `to=functions.NAME` is a call
               of NAME with the message body as its JSON arguments; other messages' bodies are content;
  deepseek_v3  DeepSeek-V3 / R1 (the published V3-0324 and R1-0528 templates): a section
               `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>` of calls
               `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + "\n```json\n" + ARGS + "\n```<｜tool▁call▁end｜>";
  deepseek_v31 DeepSeek-V3.1: the same section, each call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`;
  kimi_k2      Kimi K2: `<|tool_calls_section_begin|>...<|tool_calls_section_end|>` of calls
               `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>ARGS<|tool_call_end|>`;
               the call's id is the model's `functions.NAME:N` (Kimi's templates write it back);
  pythonic     Llama 3.2 / Llama 4's Python calls: an output that is one list `[NAME(ARG=VALUE, ...), ...]`
               of calls with keyword arguments whose values are literals (strings, numbers, True / False /
               None, and JSON's true / false / null, lists, dicts);
  llama4_pythonic  pythonic's list, optionally inside `<|python_start|>` ... `<|python_end|>` (vLLM's parser
               for its Llama 4 pythonic template);
  lfm2         LFM2 / LFM2.5 (Liquid's format, as llama.cpp reads it): text, then blocks
               `<|tool_call_start|>[NAME(ARG=VALUE, ...), ...]<|tool_call_end|>` of pythonic's calls (one bare
               call without the brackets too, or a JSON array of `{"name", "arguments"}`, the form a system
               prompt may ask for); the text around the blocks is content;
  olmo3        OLMo 3's: the same calls, one per line, in `<function_calls>...</function_calls>` (text
               before it is content);
  phi4_mini_json  Phi-4-mini: `functools` then a JSON array of `{"name", "arguments"}` (text before it is
               content; vLLM's phi4_mini_json);
  granite      Granite 3.x: an output that is `<|tool_call|>` (3.0's token) or `<tool_call>` (3.1+'s text),
               then a JSON array of `{"name", "arguments"}` (vLLM's granite parser);
  cohere_command3, cohere_command4  Command R7B / A and Command A Reasoning: `<|START_ACTION|>` then a JSON
               array of `{"tool_call_id", "tool_name", "parameters"}` and `<|END_ACTION|>` (the ids the
               model wrote kept, as vLLM's parsers keep cohere_melody's); the answer's
               `<|START_RESPONSE|>` / `<|END_RESPONSE|>` markers are dropped from the content;
  minimax_m2   MiniMax-M2 / M2.1 / M2.5: a section `<minimax:tool_call>...</minimax:tool_call>` of calls
               `<invoke name="NAME">` with one `<parameter name="P">VALUE</parameter>` per argument and
               `</invoke>`: each value's text (its surrounding whitespace dropped, as MiniMax's own parser
               drops it) becomes the type its schema declares (parse_xml_call's rules);
  glm45        GLM-4.5 / 4.6 / 4.7: `<tool_call>NAME` then one `<arg_key>K</arg_key><arg_value>V</arg_value>`
               per argument (strings written as they are, other values as JSON) and `</tool_call>`;
               glm47 is the same parser (vLLM's name for GLM-4.7, which writes no newline after NAME).

Every parser has the interface of AutoToolParser: feed(text) -> (content safe to show now, calls
completed so far), finish() -> (the rest). A call whose JSON does not parse, or that names a function
not in the request's tools, stays content (as vLLM leaves it), so a malformed call never fails the
request. Calls in the llama3_json, mistral, pythonic, olmo3, granite, phi4_mini_json and cohere forms are known
only when the output ends, so their streamed tool_calls come with the last chunk; the others go out
as each one closes.
"""
from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
import uuid
from typing import Any

from serve.reasoning import (COHERE_PARSERS, COHERE_RESPONSE, H_CALL, H_END, H_MESSAGE, H_RETURN, KIMI_SECTION,
                             DropMarkers, partial_suffix)

TOOL_PARSERS = ("hermes", "qwen3_coder", "llama3_json", "llama4_json", "llama4_pythonic", "lfm2", "mistral", "openai",
                "seed_oss", "deepseek_v3", "deepseek_v31", "kimi_k2", "minimax_m2", "glm45", "glm47", "pythonic", "olmo3",
                "granite", "phi4_mini_json", *COHERE_PARSERS)
# the parsers whose formats are written in special tokens: the output is detokenized with them
SPECIAL_TOKEN_PARSERS = ("llama3_json", "llama4_json", "llama4_pythonic", "lfm2", "mistral", "openai", "seed_oss",
                         "deepseek_v3", "deepseek_v31", "kimi_k2", "minimax_m2", "glm45", "glm47", "olmo3", "granite",
                         *COHERE_PARSERS)

PYTHON_TAG = "<|python_tag|>"
PY_START, PY_END = "<|python_start|>", "<|python_end|>"   # Llama 4's
LFM2_CALL, LFM2_CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI_CALLS, KIMI_CALLS_END = KIMI_SECTION, "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_CALL_END, KIMI_ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
MINIMAX_CALLS, MINIMAX_CALLS_END = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX_CALL, MINIMAX_CALL_END = "<invoke name=", "</invoke>"


def default_tool_parser(template: str | None, token_id=None) -> str:
    """The parser a chat template shows; hermes (the `<tool_call>` form our own plain rendering asks
    for) when it shows none. token_id: the model tokenizer's token_to_id, where known: DeepSeek's
    section format is the default only for a tokenizer that has its markers as tokens (the models
    distilled from R1 keep R1's template but were never taught its calls)."""
    t = template or ""
    if "<|channel|>" in t and "to=" in t:
        return "openai"
    if DS_SEP in t and (token_id is None or token_id(DS_CALLS) is not None):
        return "deepseek_v3" if "```json" in t else "deepseek_v31"
    if KIMI_ARGS in t or "<|im_system|>tool_declare" in t:
        return "kimi_k2"
    if MINIMAX_CALLS in t:
        return "minimax_m2"
    if "<arg_key>" in t:
        return "glm45"
    if COHERE_ACTION in t:
        return "cohere_command3"
    if "<function_calls>" in t:
        return "olmo3"
    if GRANITE_CALL in t:
        return "granite"
    if PHI4_CALLS in t:
        return "phi4_mini_json"
    if LFM2_CALL in t or "<|tool_list_start|>" in t:
        return "lfm2"
    if "<|header_start|>" in t:   # Llama 4's headers: its pythonic template (vLLM's) or the published JSON one
        return "llama4_pythonic" if "[func_name1(" in t else "llama4_json"
    if "[func_name1(" in t:
        return "pythonic"
    if "<seed:tool_call>" in t:
        return "seed_oss"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|start_header_id|>" in t and ("\"parameters\"" in t or "ipython" in t):
        return "llama3_json"
    return "hermes"


def mistral_call_id() -> str:
    """Mistral's templates refuse tool-call ids that are not 9 letters or digits (vLLM makes the same)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any) -> dict:
    """An OpenAI tool call (arguments as JSON text)."""
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def model_call(name: str, arguments: Any) -> dict | None:
    """make_call for arguments read from model output: None where they cannot be JSON (a value too
    deeply nested to write back, a number beyond float range)."""
    try:
        return {"id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False, allow_nan=False)}}
    except (ValueError, RecursionError):
        return None


def no_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def strict_json(text: str | bytes) -> Any:
    """JSON as clients can read it back (request bodies, model output): NaN, Infinity and numbers
    beyond float range are refused (ValueError)."""
    return json.loads(text, parse_constant=no_json_constant, parse_float=finite_float)


STRICT_DECODER = json.JSONDecoder(parse_constant=no_json_constant, parse_float=finite_float)


def json_object(text: str) -> dict | None:
    """`text` as a strict JSON object (strict_json), else None."""
    try:
        value = strict_json(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _call(plan, name, args, mistral: bool = False, call_id: str | None = None):
    """A call of a known tool, or None. Arguments given as text keep the model's own text (so a
    template that writes them back as text renders what the model wrote) once it reads as an object."""
    if not isinstance(name, str) or name not in plan.names:
        return None
    text = None
    if isinstance(args, str):
        text, args = args.strip(), json_object(args)
    if args is None and text is None:
        args = {}
    if not isinstance(args, dict):
        return None
    call = model_call(name, args)
    if call is None:
        return None
    if text is not None:
        call["function"]["arguments"] = text
    if mistral:   # the model's own id where Mistral's templates take it back (9 letters and digits)
        ok = isinstance(call_id, str) and re.fullmatch(r"[A-Za-z0-9]{9}", call_id)
        call["id"] = call_id if ok else mistral_call_id()
    return call


def _json_values(text: str, sep: str) -> list | None:
    """`text` as JSON values separated by `sep` (and whitespace; sep "": by nothing); None unless all of it is."""
    dec, out, i = STRICT_DECODER, [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        try:
            value, i = dec.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        out.append(value)
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return out
        if not text.startswith(sep, i):
            return None
        i += len(sep)


def _first_json(text: str) -> list | None:
    """[the JSON value `text` starts with] (whatever follows it ignored), or None."""
    try:
        return [STRICT_DECODER.raw_decode(text)[0]]
    except (ValueError, RecursionError):
        return None


def _object_calls(items: Any, plan, first: str = "arguments") -> list[dict] | None:
    """A list of `{"name", "arguments" | "parameters"}` objects (`first` looked up first) -> their
    calls; None unless it is a non-empty list whose every item is a call of a known tool."""
    if not isinstance(items, list) or not items or not all(isinstance(v, dict) for v in items):
        return None
    second = "parameters" if first == "arguments" else "arguments"
    calls = [_call(plan, v.get("name"), v.get(first, v.get(second))) for v in items]
    return None if None in calls else calls


class _Buffered:
    """Shared by llama3_json and mistral: content streams until the call marker; from there the rest
    is held and parsed when the output ends (kept as content if it does not parse)."""

    def __init__(self, plan):
        self.plan = plan
        self.pending = ""
        self.held: str | None = None     # the text from the marker on
        self.calls: list[dict] = []

    def _limit(self, calls: list[dict]) -> list[dict]:
        calls = [c for c in calls if c is not None]
        return calls[:1] if calls and not self.plan.parallel else calls

    def _until(self, marker: str, text: str) -> tuple[str, list[dict]]:
        """Content streams up to `marker`; from it on the text is held (a marker split across pieces
        is held back until it is known)."""
        self.pending += text
        i = self.pending.find(marker)
        if i >= 0:
            content, self.held, self.pending = self.pending[:i], self.pending[i:], ""
            return content, []
        keep = partial_suffix(self.pending, marker)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, []

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.pending = self.pending, ""
        if self.held is None:
            return rest, []
        held, self.held = self.held + rest, None
        read = self._read(held)
        if read is None:
            return held, []
        self.calls = self._limit(read[1])
        return read[0], self.calls

    def _read(self, held: str) -> tuple[str, list[dict]] | None:
        """(content, calls) of the held text, or None where it holds no valid call (it stays content)."""
        calls = self._parse(held)
        return ("", calls) if calls else None


class _MarkedCalls(_Buffered):
    """Content streams up to MARKER; from there the output is held and read as calls when it ends."""

    MARKER = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.held is not None:
            self.held += text
            return "", []
        return self._until(self.MARKER, text)


class Llama3JsonParser(_Buffered):
    plain = False      # the output did not start with a call: text, up to a `<|python_tag|>` if any
    TAG = PYTHON_TAG

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.held is None and self.plain:     # Llama 3.1 may write text, then the tag and a call
            return self._until(self.TAG, text)
        if self.held is not None:
            self.held += text
            return "", []
        self.pending += text
        head = self.pending.lstrip()
        if not head:
            return "", []
        if head.startswith("{") or head.startswith(self.TAG):
            self.held, self.pending = self.pending, ""
            return "", []
        if self.TAG.startswith(head):
            return "", []
        self.plain = True
        text, self.pending = self.pending, ""
        return self._until(self.TAG, text)

    def _parse(self, text: str) -> list[dict] | None:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):]
        return _object_calls(_json_values(body, ";"), self.plan, "parameters")


class Llama4JsonParser(Llama3JsonParser):
    """llama4_json (module docstring): the calls after `<|python_start|>TEXT<|python_end|>` (TEXT is
    content), or inside the tags, or the whole output; objects separated by `;` or by nothing."""

    TAG = PY_START

    def _read(self, held: str) -> tuple[str, list[dict]] | None:
        content, body = "", held.strip()
        if body.startswith(PY_START):
            inner, end, after = body[len(PY_START):].partition(PY_END)
            content, body = (inner, after) if end and after.strip() else ("", inner)
        calls = _object_calls(_json_values(body, ";") or _json_values(body, ""), self.plan, "parameters")
        return (content, calls) if calls else None


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _py_value(node: ast.expr) -> Any:
    """A call argument's literal (JSON's true / false / null taken too, as models write them)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_py_value(k): _py_value(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)       # constants, and signed numbers


def _python_calls(text: str, plan) -> list[dict] | None:
    """`[NAME(ARG=VALUE, ...), ...]` -> its calls; None unless every item is a keyword-argument call of a
    known tool with literal values."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(k.arg is not None for k in node.keywords)):
                return None
            calls.append(_call(plan, node.func.id, {k.arg: _py_value(k.value) for k in node.keywords}))
        return None if None in calls else calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class _StartsWithCalls(_Buffered):
    """An output that starts (after whitespace) with one of MARKERS is held and read as calls when it
    ends; any other output is content as it comes."""

    MARKERS: tuple[str, ...] = ()
    plain = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.plain:
            return text, []
        if self.held is not None:
            self.held += text
            return "", []
        self.pending += text
        head = self.pending.lstrip()
        if not head or any(m.startswith(head) for m in self.MARKERS):    # maybe a marker, not yet whole
            return "", []
        if head.startswith(self.MARKERS):
            self.held, self.pending = self.pending, ""
            return "", []
        self.plain = True
        text, self.pending = self.pending, ""
        return text, []


class PythonicParser(_StartsWithCalls):
    """pythonic: an output that starts with `[` is read as a call list when it ends; any other output
    is content (as vLLM's parser reads it)."""

    MARKERS = ("[",)

    def _parse(self, text: str) -> list[dict] | None:
        return _python_calls(text, self.plan)


class Llama4PythonicParser(PythonicParser):
    """llama4_pythonic: pythonic's list, optionally between `<|python_start|>` and `<|python_end|>`."""

    MARKERS = ("[", PY_START)

    def _parse(self, text: str) -> list[dict] | None:
        return _python_calls(text.strip().removeprefix(PY_START).strip().removesuffix(PY_END), self.plan)


class Lfm2Parser(_MarkedCalls):
    """lfm2 (module docstring): content streams up to the first `<|tool_call_start|>`; from there the
    output is held and read when it ends: every block's calls, the text between and after the blocks
    as content; a block that does not parse (or is not closed) keeps the whole held text as content."""

    MARKER = LFM2_CALL

    def _read(self, held: str) -> tuple[str, list[dict]] | None:
        calls, content, i = [], [], 0
        while (j := held.find(LFM2_CALL, i)) >= 0:
            content.append(held[i:j])
            k = held.find(LFM2_CALL_END, j)
            got = None if k < 0 else self._block(held[j + len(LFM2_CALL):k])
            if not got:
                return None
            calls += got
            i = k + len(LFM2_CALL_END)
        content.append(held[i:])
        return "".join(content), calls

    def _block(self, body: str) -> list[dict] | None:
        body = body.strip()
        if body.startswith("[{"):
            values = _json_values(body, "")
            return _object_calls(values[0], self.plan) if values and len(values) == 1 else None
        return _python_calls(body if body.startswith("[") else f"[{body}]", self.plan)


GRANITE_CALL = "<|tool_call|>"


class GraniteParser(_StartsWithCalls):
    """granite: an output that starts with `<|tool_call|>`, `<tool_call>` or `[` is read as a JSON
    array of calls when it ends; any other output is content."""

    MARKERS = ("[", GRANITE_CALL, "<tool_call>")

    def _parse(self, text: str) -> list[dict] | None:
        body = text.strip().removeprefix(GRANITE_CALL).removeprefix("<tool_call>").strip()
        try:
            return _object_calls(strict_json(body), self.plan)
        except (ValueError, RecursionError):
            return None


PHI4_CALLS = "functools"


class Phi4MiniParser(_MarkedCalls):
    """phi4_mini_json: content streams up to `functools`; from there the JSON array of calls after it
    is read when the output ends (what follows the array is dropped, as vLLM's parser drops it)."""

    MARKER = PHI4_CALLS

    def _parse(self, text: str) -> list[dict] | None:
        body = text[len(PHI4_CALLS):].lstrip()
        values = _first_json(body) if body.startswith("[") else None
        return _object_calls(values[0], self.plan) if values else None


OLMO_CALLS, OLMO_CALLS_END = "<function_calls>", "</function_calls>"


class Olmo3Parser(_MarkedCalls):
    """olmo3: content streams up to `<function_calls>`; from there the calls (one per line) are read
    when the output ends."""

    MARKER = OLMO_CALLS

    def _parse(self, text: str) -> list[dict] | None:
        body = text[len(OLMO_CALLS):]
        end = body.find(OLMO_CALLS_END)
        if end < 0 or body[end + len(OLMO_CALLS_END):].strip():
            return None
        lines = [line.strip() for line in body[:end].splitlines() if line.strip()]
        return _python_calls("[" + ", ".join(lines) + "]", self.plan) if lines else None


COHERE_ACTION, COHERE_ACTION_END = "<|START_ACTION|>", "<|END_ACTION|>"


class CohereParser(_MarkedCalls):
    """cohere_command3 / cohere_command4: content (its answer markers dropped) streams up to
    `<|START_ACTION|>`; from there the output is read as a JSON array of calls when it ends."""

    MARKER = COHERE_ACTION

    def __init__(self, plan):
        super().__init__(plan)
        self.answer = DropMarkers(COHERE_RESPONSE)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, calls = super().feed(text)
        return self.answer.feed(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = super().finish()
        return self.answer.feed(content) + self.answer.finish(), calls

    def _parse(self, text: str) -> list[dict] | None:
        body = text[len(COHERE_ACTION):]
        end = body.find(COHERE_ACTION_END)
        items = _first_json(body[:end] if end >= 0 else body)
        if items is None or not isinstance(items[0], list) or not items[0]:
            return None
        calls = []
        for v in items[0]:
            if not isinstance(v, dict):
                return None
            call = _call(self.plan, v.get("tool_name"), v.get("parameters"))
            if call is not None and isinstance(v.get("tool_call_id"), (str, int)) and str(v["tool_call_id"]):
                call["id"] = str(v["tool_call_id"])   # the model's id, as vLLM's Cohere parsers keep it
            calls.append(call)
        return None if None in calls else calls


# possessive \s*+ : the spaces around the optional groups are never rescanned (linear on any text)
_MISTRAL_V11 = re.compile(r"([A-Za-z0-9_.\-]+)\s*+(?:\[CALL_ID\]\s*+([A-Za-z0-9_\-]+)\s*+)?(?:\[ARGS\])?\s*+(\{.*\})\s*$",
                          re.S)


class MistralParser(_MarkedCalls):
    MARKER = MISTRAL_CALLS

    def _parse(self, text: str) -> list[dict] | None:
        calls: list = []
        for part in text.split(MISTRAL_CALLS)[1:]:
            part = part.strip()
            if part.startswith("[") or part.startswith("{"):
                # an array of calls: what the model writes after it is dropped (as vLLM's parser does)
                values = _first_json(part) if part.startswith("[") else _json_values(part, ",")
                if values is None:
                    return None
                items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
                if not all(isinstance(v, dict) for v in items):
                    return None
                calls += [_call(self.plan, v.get("name"), v.get("arguments", v.get("parameters")), True, v.get("id"))
                          for v in items]
            else:                                   # name[CALL_ID]id[ARGS]{...}, name[ARGS]{...} or name{...}
                m = _MISTRAL_V11.match(part)
                if not m:
                    return None
                calls.append(_call(self.plan, m.group(1), m.group(3), True, m.group(2)))
        return None if not calls or None in calls else calls


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?", re.S)
# a value ends at its closing tag, or (a model that left it out) where the next parameter or the
# function's end begins
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.S)


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows (its anyOf / oneOf branches' too), in order."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    types = [kind] if isinstance(kind, str) else [t for t in kind if isinstance(t, str)] if isinstance(kind, list) else []
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            types += [t for t in _schema_types(branch) if t not in types]
    if not types and "enum" in schema:
        types = ["string"]
    return types


def _xml_value(text: str, schema: Any) -> Any:
    """A parameter's text as the value its schema declares (the template wrote strings as they are,
    numbers and booleans as Python's str(), objects and arrays as JSON): a string stays text; a
    value that does not read as any declared type stays text too (as vLLM's qwen3_coder parser)."""
    types, t = _schema_types(schema), text.strip()
    # null: "null" where no string is allowed, or "None" (the template's str(None)) where null is
    if (t in ("null", "None") and "string" not in types) or (t == "None" and "null" in types):
        return None
    for kind in types:
        if kind == "string":
            return text
        if kind == "integer" and re.fullmatch(r"\s*-?\d{1,4000}\s*", text):   # (Python's digit limit)
            return int(text)
        if kind == "number":
            try:
                number = int(text) if re.fullmatch(r"\s*-?\d{1,4000}\s*", text) else float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return number
        if kind == "boolean" and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        if kind in ("object", "array"):
            try:
                value = strict_json(text)
            except (ValueError, RecursionError):
                continue
            if isinstance(value, dict if kind == "object" else list):
                return value
    return text


def _properties(plan, name: str) -> dict:
    """The argument schemas of the request's tool `name` (a name in plan.names)."""
    tool = next(t["function"] for t in plan.tools if t["function"]["name"] == name)
    return (tool.get("parameters") or {}).get("properties") or {}


def parse_xml_call(body: str, plan) -> dict | None:
    """One qwen3_coder `<tool_call>` block's body -> a call, or None (the block stays content) when it
    is not `<function=NAME>` of a known tool. Each value loses the newline the template writes after
    its opening tag and before its closing one."""
    m = _XML_FUNCTION.fullmatch(body)
    if m is None or m.group(1).strip() not in plan.names:
        return None
    name = m.group(1).strip()
    props = _properties(plan, name)
    args = {}
    for p in _XML_PARAMETER.finditer(m.group(2)):
        text = p.group(2)
        text = text[1:] if text.startswith("\n") else text
        text = text[:-1] if text.endswith("\n") else text
        key = p.group(1).strip()
        args[key] = _xml_value(text, props.get(key, {"type": "string"}))
    return model_call(name, args)


_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")


class HarmonyToolParser:
    """openai (gpt-oss): harmony messages in the text (as the model writes them, or as the gpt_oss
    reasoning parser passes on the ones that are not analysis or final)."""

    def __init__(self, plan):
        self.plan = plan
        self.pending = ""
        self.header: str | None = None     # set while inside a message body
        self.calls: list[dict] = []

    def _take_call(self, header: str, body: str, marker: str) -> tuple[str, list[dict]]:
        m = _RECIPIENT.search(header)
        if m is None:
            return body, []
        call = _call(self.plan, m.group(1), body.strip())
        if call is None or (self.calls and not self.plan.parallel):
            return header + H_MESSAGE + body + marker, []
        self.calls.append(call)
        return "", [call]

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, calls = "", []
        while self.pending:
            if self.header is None:
                i = self.pending.find(H_MESSAGE)
                if i < 0:
                    break
                self.header, self.pending = self.pending[:i], self.pending[i + len(H_MESSAGE):]
                continue
            ends = [(self.pending.find(m), m) for m in (H_CALL, H_END, H_RETURN)]
            ends = [e for e in ends if e[0] >= 0]
            is_call = _RECIPIENT.search(self.header) is not None
            if not ends:
                if not is_call:          # a plain body streams
                    keep = max(partial_suffix(self.pending, m) for m in (H_CALL, H_END, H_RETURN))
                    content += self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                break
            i, marker = min(ends)
            body, self.pending = self.pending[:i], self.pending[i + len(marker):]
            c, new = self._take_call(self.header, body, marker) if is_call else (body, [])
            content += c
            calls += new
            self.header = None
        return content, calls

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.pending = self.pending, ""
        if self.header is None:
            return rest, []
        header, self.header = self.header, None
        if _RECIPIENT.search(header) is not None:       # the output ended inside the call's body
            return self._take_call(header, rest, "")
        return rest, []


def _args_text(text: str) -> str:
    return text.strip() or "{}"      # a call written with no arguments at all


_DS_V3_CALL = re.compile(r"\s*(\w+)" + DS_SEP + r"([^\n]*)\n```(?:json)?[ \t]*\n(.*?)\n?```\s*", re.S)
_DS_V31_CALL = re.compile(r"\s*([^\s<]+?)\s*" + DS_SEP + r"(.*)", re.S)
_KIMI_CALL = re.compile(r"\s*((?:functions\.)?([^\s<]+?):\d+)\s*" + re.escape(KIMI_ARGS) + r"(.*)", re.S)


def _deepseek_v3_call(body: str, plan) -> dict | None:
    m = _DS_V3_CALL.fullmatch(body)
    return None if m is None or m.group(1) != "function" else _call(plan, m.group(2).strip(), _args_text(m.group(3)))


def _deepseek_v31_call(body: str, plan) -> dict | None:
    m = _DS_V31_CALL.fullmatch(body)
    return None if m is None else _call(plan, m.group(1), _args_text(m.group(2)))


# a name in double or single quotes, or bare (MiniMax's own parser takes each)
_MINIMAX_QUOTED = r"(?:\"([^\"\n]+)\"|'([^'\n]+)'|([^\s\"'>]+))"
_MINIMAX_NAME = re.compile(r"\s*" + _MINIMAX_QUOTED + r"\s*>", re.S)
_MINIMAX_PARAMETER = re.compile(r"\s*<parameter name=" + _MINIMAX_QUOTED + r"\s*>(.*?)</parameter>", re.S)


def _minimax_call(body: str, plan) -> dict | None:
    """One `<invoke name=` call's rest (`"NAME">` and its parameters) -> a call, or None (it stays
    content) when NAME is not a known tool or anything but whole parameters follows it."""
    m = _MINIMAX_NAME.match(body)
    name = None if m is None else next(g for g in m.groups() if g is not None)
    if name not in plan.names:
        return None
    props = _properties(plan, name)
    args, i = {}, m.end()
    while (p := _MINIMAX_PARAMETER.match(body, i)) is not None:
        key = next(g for g in p.groups()[:3] if g is not None)
        args[key], i = _xml_value(p.group(4).strip(), props.get(key, {"type": "string"})), p.end()
    return model_call(name, args) if not body[i:].strip() else None


def _kimi_call(body: str, plan) -> dict | None:
    m = _KIMI_CALL.fullmatch(body)
    call = None if m is None else _call(plan, m.group(2), _args_text(m.group(3)))
    if call is not None:
        call["id"] = m.group(1)     # `functions.NAME:N`, as Kimi's template writes the id back
    return call


class HeldSpace:
    """Content whose trailing whitespace is held back: dropped if calls follow, shown at the end
    otherwise (the auto parsers' rule: with calls, whitespace-only content becomes null)."""

    held_ws = ""

    def _content(self, text: str) -> str:
        if not text:
            return ""
        text = self.held_ws + text
        stripped = text.rstrip()
        self.held_ws = text[len(stripped):]
        return stripped

    def _last_space(self) -> str:
        """At the output's end: the held whitespace, unless calls followed it."""
        held, self.held_ws = self.held_ws, ""
        return "" if self.calls else held


class SectionToolParser(HeldSpace):
    """deepseek_v3 / deepseek_v31 / kimi_k2 / minimax_m2: content streams until the section's opening marker;
    inside it each call goes out as its closing marker arrives; after the section's end the text is
    content again. A call that does not parse, or names an unknown tool, stays content as written
    (told when the section ends); a section with no call that parses, or one the output cut before
    its end, is content whole, markers and all. Calls past the first without parallel_tool_calls are
    dropped, and the content's trailing whitespace before calls too (AutoToolParser's rules)."""

    FORMATS = {"deepseek_v3": (DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, _deepseek_v3_call),
               "deepseek_v31": (DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, _deepseek_v31_call),
               "kimi_k2": (KIMI_CALLS, KIMI_CALLS_END, KIMI_CALL, KIMI_CALL_END, _kimi_call),
               "minimax_m2": (MINIMAX_CALLS, MINIMAX_CALLS_END, MINIMAX_CALL, MINIMAX_CALL_END, _minimax_call)}

    def __init__(self, plan, name: str):
        self.plan = plan
        self.open, self.close, self.call_open, self.call_close, self.parse = self.FORMATS[name]
        self.pending = ""
        self.section: str | None = None    # the open section's text as written so far (None: outside one)
        self.kept = ""                     # its calls that stay content
        self.taken = 0                     # its calls that parsed
        self.calls: list[dict] = []

    def _take(self, segment: str) -> list[dict]:
        """One `<call_open>body` segment (its closing marker cut off) -> [its call], or [] (kept as
        content, or dropped past the first call without parallel_tool_calls)."""
        head = segment.lstrip()
        call = self.parse(head[len(self.call_open):], self.plan) if head.startswith(self.call_open) else None
        if call is None:
            self.kept += segment + self.call_close
            return []
        self.taken += 1
        if self.calls and not self.plan.parallel:
            return []
        self.calls.append(call)
        return [call]

    def _end_section(self, rest: str) -> str:
        """The content a section leaves when it ends (rest: its text after the last call)."""
        content = self.kept + (rest if rest.strip() else "") if self.taken else self.section
        self.section, self.kept, self.taken = None, "", 0
        return content

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, calls = "", []
        while self.pending:
            if self.section is None:
                i = self.pending.find(self.open)
                if i < 0:
                    keep = partial_suffix(self.pending, self.open)
                    content += self._content(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content += self._content(self.pending[:i])
                self.section, self.pending = self.open, self.pending[i + len(self.open):]
                continue
            ends = [(i, m) for i, m in ((self.pending.find(m), m) for m in (self.call_close, self.close)) if i >= 0]
            if not ends:
                break
            i, marker = min(ends)
            segment, self.pending = self.pending[:i], self.pending[i + len(marker):]
            self.section += segment + marker
            if marker == self.close:
                content += self._content(self._end_section(segment))
            else:
                calls += self._take(segment)
        return content, calls

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.pending = self.pending, ""
        if self.section is not None:        # cut inside the section
            self.section += rest
            rest = self._end_section(rest)
        return self._content(rest) + self._last_space(), []


_GLM_NAME = re.compile(r"\s*([^\s<]+)", re.S)
_GLM_ARG = re.compile(r"\s*<arg_key>((?:(?!</arg_key>).)*)</arg_key>\s*<arg_value>((?:(?!</arg_value>).)*)</arg_value>",
                      re.S)


def _glm_value(text: str, schema: Any) -> Any:
    """An `<arg_value>`: the type its schema declares (parse_xml_call's rules); an argument the schema
    does not declare is JSON where it reads as JSON (the template wrote non-strings with tojson)."""
    if schema is not None:
        return _xml_value(text, schema)
    try:
        return strict_json(text)
    except (ValueError, RecursionError):
        return text


def parse_glm_call(body: str, plan) -> dict | None:
    """One glm45 `<tool_call>` block's body -> a call, or None (the block stays content) when it is
    not a known tool's name followed by whole key / value pairs and nothing else."""
    m = _GLM_NAME.match(body)
    if m is None or m.group(1) not in plan.names:
        return None
    props = _properties(plan, m.group(1))
    args, i = {}, m.end()
    while (pair := _GLM_ARG.match(body, i)) is not None:
        key = pair.group(1).strip()
        args[key], i = _glm_value(pair.group(2), props.get(key)), pair.end()
    return model_call(m.group(1), args) if not body[i:].strip() else None


FAMILY_PARSERS = {"llama3_json": Llama3JsonParser, "llama4_json": Llama4JsonParser, "lfm2": Lfm2Parser,
                  "llama4_pythonic": Llama4PythonicParser, "mistral": MistralParser, "openai": HarmonyToolParser,
                  "pythonic": PythonicParser, "olmo3": Olmo3Parser, "granite": GraniteParser,
                  "phi4_mini_json": Phi4MiniParser, **dict.fromkeys(COHERE_PARSERS, CohereParser),
                  "deepseek_v3": lambda plan: SectionToolParser(plan, "deepseek_v3"),
                  "deepseek_v31": lambda plan: SectionToolParser(plan, "deepseek_v31"),
                  "kimi_k2": lambda plan: SectionToolParser(plan, "kimi_k2"),
                  "minimax_m2": lambda plan: SectionToolParser(plan, "minimax_m2")}
# hermes is serve.tools.AutoToolParser (serve.tools.auto_parser picks between them)
