"""OpenAI's Responses API: POST /v1/responses (streamed or not, in the background or not), GET and
DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel, GET /v1/responses/{id}/input_items.

A Responses request becomes a chat completion request (the same template, parsers, sampling and
structured outputs as /v1/chat/completions, serve.app.ServerState.chat_request), and its output
becomes Responses output items: a `reasoning` item (the reasoning parser's text, as reasoning_text
content), a `message` item (output_text) and one `function_call` item per tool call; the body's
`output_text` is the messages' text joined (the SDKs compute the same property from the items). Streaming sends
OpenAI's documented event sequence: response.created, response.in_progress, then per item
response.output_item.added, (reasoning: response.reasoning_text.delta ... .done; message:
response.content_part.added, response.output_text.delta ... response.output_text.done,
response.content_part.done; function call: response.function_call_arguments.delta, .done),
response.output_item.done, and last response.completed (or response.incomplete when
max_output_tokens cut it); every event carries its sequence_number; an engine that dies mid-stream
ends it with an `error` event.

Input: `input` as a string (one user message) or a list of items: messages ({"role", "content"} with
a string or input_text / output_text parts, "type": "message" optional), function_call items (sent
back as the assistant's tool calls) and function_call_output items (as tool messages, which each
family's chat template renders its own way); one model turn's reasoning item, message and function
calls become one assistant message, the reasoning as its reasoning_content (templates render the
current turn's reasoning, and drop earlier turns'). `instructions` is a system message, not carried
to the next turn by previous_response_id (input system messages are). tools: function tools
({"type": "function", "name", "parameters", ...}); tool_choice: "none" | "auto" | "required" |
{"type": "function", "name"}; text.format: text | json_object | json_schema; reasoning: accepted only
where the server runs a reasoning parser (400 otherwise); its effort goes to the template as
`reasoning_effort` (gpt-oss's template reads it).

store / previous_response_id: a stored response (store defaults to true, as OpenAI's) keeps its
whole conversation in memory, as Responses items with ids (ResponseStore), in a bounded LRU
(RESPONSE_STORE entries) that a restart empties; a request naming an unknown (or evicted)
previous_response_id gets a 404. An input `item_reference` (or an item with only an id) stands for
the stored item with that id. include ["reasoning.encrypted_content"] (clients that store nothing,
Codex among them) puts each reasoning item's text, base64 behind a marker (_seal: not encrypted),
in its encrypted_content, which stands for the text when the item comes back. Fields not implemented get a 400 naming them
(UNSUPPORTED_RESPONSE_FIELDS).

include message.output_text.logprobs: an output_text part carries its own tokens' logprobs
(ChatChoices.answer_logprobs: a delta's tokens outside the reasoning, matched to the text they
write; a call's are dropped), non-streamed too (_replayed: the items as the stream builds them).
truncation "auto" leaves the earliest turns out of a prompt too long for the context (_fitted);
max_tool_calls, a limit on built-in tools' calls, has none here to limit.

background (needs store): the request is answered at once with status "queued" and runs on the
server's event loop whoever listens (_Run), stored "in_progress" until it ends (completed,
incomplete, "failed" with the error where the engine died); GET ?stream=true replays its events
after starting_after and follows the rest, cancel aborts it ("cancelled"), DELETE stops it too.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import threading
from collections import OrderedDict
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, field_validator
from starlette.concurrency import run_in_threadpool

from serve.bridge import EngineDeadError
from serve.protocol import ChatCompletionRequest, OpenAIError, _Body, json_body, new_id, now, renamed, validated
from serve.reasoning import reasoning_tokens
from serve.stream import ChatChoices, next_delta, respond

log = logging.getLogger("jaxinfer.serve")
RESPONSE_STORE = 1024
INCLUDABLE = ("reasoning.encrypted_content", "message.output_text.logprobs")

# Responses fields this server does not implement: a 400 naming the field unless its value is a no-op
UNSUPPORTED_RESPONSE_FIELDS = {
    "conversation": lambda v: v is None,
    "include": lambda v: v is None or (isinstance(v, list) and all(x in INCLUDABLE for x in v)),
    "prompt": lambda v: v is None,
    "safety_identifier": lambda v: v is None,
    "service_tier": lambda v: v is None or v in ("auto", "default"),
    # stream obfuscation (random padding on delta events) is not done: only asking for none is a no-op
    "stream_options": lambda v: v is None or v == {} or v == {"include_obfuscation": False},
    "context_management": lambda v: v is None,
}

router = APIRouter()


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    # "auto": a conversation longer than the context loses its earliest turns (_fitted)
    truncation: Literal["auto", "disabled"] | None = None
    # calls to built-in tools, of which this server has none: accepted, with nothing to limit
    max_tool_calls: int | None = Field(default=None, ge=0)
    # with include message.output_text.logprobs: each output_text token's alternatives (vLLM's rule:
    # without that include no logprobs are returned)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    # OpenAI routes requests with one key to one cache; this server has one cache, used automatically
    prompt_cache_key: str | None = None

    @property
    def sealed(self) -> bool:
        """include reasoning.encrypted_content: reasoning items carry their text for a client that
        stores nothing (store false) to send back."""
        return "reasoning.encrypted_content" in (self.include or [])

    @property
    def logprobs(self) -> bool:
        """include message.output_text.logprobs: each output_text part carries its tokens' logprobs."""
        return "message.output_text.logprobs" in (self.include or [])

    @field_validator("stream", "store", "background", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info) -> Any:
        """null is the default (the SDK's types make both nullable)."""
        return cls.model_fields[info.field_name].default if v is None else v

    @classmethod
    def check_unsupported(cls, data: Any) -> None:
        if isinstance(data, dict):
            for name, is_noop in UNSUPPORTED_RESPONSE_FIELDS.items():
                if name in data and not is_noop(data[name]):
                    raise OpenAIError(400, f"{name} is not supported by this server's /v1/responses", param=name)


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(400, f"{where}.content must be a string or a list of text parts", param="input")
    parts = []
    for p in content:
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(p.get("text"), str):
            raise OpenAIError(400, f"{where}.content: only input_text / output_text parts are supported",
                              param="input")
        parts.append(p["text"])
    return "".join(parts)


_SEAL = "jaxinfer-reasoning-v1:"


def _seal(text: str) -> str:
    """A reasoning item's encrypted_content: not encrypted (this server keeps no secret), its text in
    base64 behind a marker, opaque to clients as OpenAI's is, and read back by _reasoning_text."""
    return _SEAL + base64.b64encode(text.encode()).decode("ascii")


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary's text, else its
    encrypted_content (_seal's)."""
    sealed = item.get("encrypted_content")
    if not item.get("content") and not item.get("summary") and sealed is not None:
        try:
            if not isinstance(sealed, str) or not sealed.startswith(_SEAL):
                raise ValueError
            return base64.b64decode(sealed[len(_SEAL):], validate=True).decode()
        except ValueError:      # binascii.Error and UnicodeDecodeError are ValueErrors
            raise OpenAIError(400, f"{where}: encrypted_content this server did not write", param="input") from None
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise OpenAIError(400, f"{where}: a reasoning item's content / summary is a list of text parts", param="input")
    return "".join(p["text"] for p in parts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """Responses input -> chat messages. One model turn's items (its reasoning, its message, its
    function calls) become one assistant message, as chat has it: the reasoning as its
    reasoning_content (the templates render it in the current turn), the calls as its tool_calls."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning: str | None = None      # a reasoning item's text, for the assistant message that follows

    def assistant(content: str = "") -> dict:
        """The turn's assistant message: the last one when the previous item was part of it."""
        nonlocal reasoning
        if reasoning is None and out and out[-1]["role"] == "assistant" and not content:
            return out[-1]
        m: dict = {"role": "assistant", "content": content}
        if reasoning is not None:
            m["reasoning_content"], reasoning = reasoning, None
        out.append(m)
        return m
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(400, f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if reasoning is not None and (kind == "function_call_output"
                                      or kind == "message" and item.get("role") != "assistant"):
            assistant()       # a turn that ended in its reasoning (cut by max_output_tokens)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(400, f"{where}.role must be user, system, developer or assistant", param="input")
            if role == "assistant":
                assistant(_text(item.get("content"), where))
            else:
                out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise OpenAIError(400, f"{where}: a function_call item has call_id, name and arguments (strings)",
                                  param="input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise OpenAIError(400, f"{where}.call_id must be a string", param="input")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": output if isinstance(output, str) else _text(output, where)})
        elif kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(item, where)
        else:
            raise OpenAIError(400, f"{where}: input items of type {kind!r} are not supported (message, "
                                   "function_call, function_call_output, reasoning, item_reference)", param="input")
    if reasoning is not None:
        assistant()
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise OpenAIError(400, f"tools[{i}]: only function tools are supported", param="tools")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None or not isinstance(fmt, dict):
        if fmt is not None:
            raise OpenAIError(400, "text.format must be an object", param="text")
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise OpenAIError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}", param="text")


class ResponseStore:
    """Stored responses: id -> (response body, its input items). A response's input items are its
    whole conversation before its output, as Responses items with ids: the previous response's
    input items and output, then this request's input (instructions are not items). Every stored
    item is also found by its id (an `item_reference`), for as long as a response holding it is
    stored. Bounded (least recently used out first), in memory, lost on restart."""

    def __init__(self, size: int = RESPONSE_STORE):
        self.size, self._lock = size, threading.Lock()
        self._responses: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self._by_id: dict[str, list] = {}      # item id -> [item, how many stored responses hold it]

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            if rid in self._responses:
                self._responses.move_to_end(rid)
                return self._responses[rid]
            return None

    def __contains__(self, rid: str) -> bool:     # (no use: the order of eviction unchanged)
        with self._lock:
            return rid in self._responses

    def item(self, item_id: str) -> dict | None:
        with self._lock:
            found = self._by_id.get(item_id)
            return found[0] if found else None

    def put(self, rid: str, body: dict, items: list[dict]) -> None:
        with self._lock:
            self._drop(rid)
            self._responses[rid] = (body, items)
            for item in items + body["output"]:
                self._by_id.setdefault(item["id"], [item, 0])[1] += 1
            while len(self._responses) > self.size:
                self._drop(next(iter(self._responses)))

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        found = self._responses.pop(rid, None)
        if found is None:
            return False
        for item in found[1] + found[0]["output"]:
            held = self._by_id[item["id"]]
            held[1] -= 1
            if held[1] == 0:
                del self._by_id[item["id"]]
        return True


def _store(state) -> ResponseStore:
    if not hasattr(state, "response_store"):
        state.response_store = ResponseStore()
    return state.response_store


def _stored_item(item: dict) -> dict:
    """An input item as the store keeps and input_items lists it: with an id and a status, and a
    message's content as a list of parts (an assistant's output_text parts with their annotations)."""
    kind = item.get("type", "message")
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[kind]
    out = {**item, "type": kind, "id": item.get("id") or new_id(prefix), "status": item.get("status") or "completed"}
    if kind == "message":
        part = "output_text" if item["role"] == "assistant" else "input_text"
        content = item.get("content")
        content = [{"type": part, "text": content or ""}] if content is None or isinstance(content, str) else content
        out["content"] = [{**p, "annotations": p.get("annotations", [])} if p["type"] == "output_text" else p
                          for p in content]
    elif kind == "reasoning":
        out.setdefault("summary", [])
    return out


def _input_items(store: ResponseStore, req: ResponsesRequest, history: list[dict]) -> list[dict]:
    """This request's input as stored items: item_references replaced by the stored items they
    name (a 400 for an unknown id), every item checked (input_messages) and given an id; an item
    already in previous_response_id's conversation is a 400 (OpenAI's duplicate-item rule: it would
    be in the prompt twice)."""
    if isinstance(req.input, str):
        return [_stored_item({"type": "message", "role": "user", "content": req.input})]
    items, held = [], {i["id"] for i in history}
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if isinstance(item, dict) and item.get("id") is not None and not isinstance(item["id"], str):
            raise OpenAIError(400, f"{where}.id must be a string", param="input")
        if isinstance(item, dict) and (item.get("type") == "item_reference" or
                                       "type" not in item and "role" not in item and "id" in item):
            found = store.item(item["id"]) if isinstance(item.get("id"), str) else None
            if found is None:
                raise OpenAIError(400, f"{where}: no stored item with id {item.get('id')!r} (items are kept with "
                                       "their stored responses, in memory)", param="input")
            item = found
        if isinstance(item, dict) and item.get("id") in held:
            raise OpenAIError(400, f"{where}: duplicate item {item['id']!r}: it is already part of the "
                                   "previous_response_id's conversation", param="input")
        items.append(item)
    input_messages(items)          # each item checked, the errors naming its index in input
    return [_stored_item(item) for item in items]


def _fitted(state, req: ResponsesRequest):
    """The chat request, its input items, and the rendered prompt, sampling params and parsers
    (ServerState.chat_request). truncation "auto": while the prompt and max_output_tokens (at least
    one token) overflow max_model_len, the conversation's earliest turns are left out of the prompt,
    a whole turn at a time (from a user message up to the next), the instructions and system or
    developer messages kept; the stored input items stay whole. The last turn is never cut: a
    conversation whose last user message and what follows it overflow is a 400."""
    chat, items = _chat_request(state, req)
    rendered = state.chat_request(chat)
    if req.truncation != "auto":
        return chat, items, *rendered
    room = state.max_model_len - (req.max_output_tokens or 1)
    turns = [i for i, item in enumerate(items) if i and item.get("type", "message") == "message"
             and item.get("role") == "user"]
    for skip in turns:
        if len(rendered[0]) <= room:
            break
        chat = _chat_request(state, req, skip)[0]
        rendered = state.chat_request(chat)
    return chat, items, *rendered


def _chat_request(state, req: ResponsesRequest, skip: int = 0) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request a Responses request stands for, and its input items (kept for the store);
    skip: how many of the conversation's first items the prompt leaves out (_fitted)."""
    store, history = _store(state), []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id)
        if found is None:
            raise OpenAIError(404, f"no stored response with id {req.previous_response_id!r} (responses are kept "
                                   "in memory, a bounded number, and lost when the server restarts)",
                              type_="not_found_error", param="previous_response_id", code="response_not_found")
        body, items = found
        history = items + body["output"]     # the conversation so far (its instructions are not part of it)
    if req.reasoning is not None and state.reasoning_parser is None:
        raise OpenAIError(400, "reasoning: this model is served without a reasoning parser "
                               "(start the server with --reasoning-parser)", param="reasoning")
    items = history + _input_items(store, req, history)
    kept = [i for i in items[:skip] if i.get("type", "message") == "message" and i.get("role") in ("system", "developer")]
    conversation = input_messages(kept + items[skip:])
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
                            "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
                            "parallel_tool_calls": req.parallel_tool_calls,
                            "response_format": response_format(req.text)}
    for name in ("temperature", "top_p"):   # left out: the model's default, which the response reports
        if getattr(req, name) is None and name in state.gen.sampling_defaults:
            setattr(req, name, state.gen.sampling_defaults[name])
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.logprobs:
        body |= {"logprobs": True, "top_logprobs": req.top_logprobs or 0}
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["chat_template_kwargs"] = {"reasoning_effort": effort}
    return validated(ChatCompletionRequest, body), items     # its errors renamed by create_response


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": new_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str, status: str = "completed", sealed: bool = False) -> dict:
    item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}
    if sealed:
        item["encrypted_content"] = _seal(text)
    return item


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _response(rid: str, created: int, model: str, req: ResponsesRequest, output: list[dict], status: str,
              usage: dict | None, cut: bool) -> dict:
    tools = [t for t in (req.tools or [])]
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "output_text": "".join(c["text"] for item in output if item["type"] == "message"
                                                     for c in item["content"] if c["type"] == "output_text"),
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": req.instructions, "metadata": req.metadata or {}, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": tools,
            "text": req.text or {"format": {"type": "text"}}, "reasoning": req.reasoning,
            "previous_response_id": req.previous_response_id, "store": req.store, "background": req.background,
            "truncation": req.truncation or "disabled", "max_tool_calls": req.max_tool_calls, "usage": usage}


def _usage(n_prompt: int, n_out: int, cached: int, reasoning: int | None, written: int = 0) -> dict:
    """written: prompt tokens this request put into the prefix cache (cache_write_tokens)."""
    return {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": reasoning or 0},
            "total_tokens": n_prompt + n_out}


# the chat request's fields that a Responses request's own fields become (_chat_request)
_RESPONSES_FIELDS = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input",
                     "chat_template_kwargs": "reasoning"}


def prepared(state, req: ResponsesRequest):
    """_fitted, its errors named by this API's fields (create_response and the batch script)."""
    try:
        return _fitted(state, req)
    except OpenAIError as e:
        raise renamed(e, _RESPONSES_FIELDS) from None


def _finish(state, req: ResponsesRequest, rid: str, created: int, model: str, items: list[dict],
            output: list[dict], usage: dict, cut: bool) -> dict:
    body = _response(rid, created, model, req, output, "incomplete" if cut else "completed", usage, cut)
    if req.store:
        _store(state).put(rid, body, items)
    return body


def _choices(state, req: ResponsesRequest, chat: ChatCompletionRequest, parsers) -> ChatChoices:
    return ChatChoices(1, chat.tool_plan(), state.token_str, req.logprobs, parsers, state.token_bytes)


def final_body(state, req: ResponsesRequest, rid: str, created: int, model: str, chat: ChatCompletionRequest,
               items: list[dict], parsers, deltas: list, n_prompt: int) -> dict:
    """A finished, non-streamed response's body from its one choice's deltas (stored where req.store)."""
    from serve.protocol import chat_message
    g = deltas
    message, finish_reason = chat_message("".join(d.text for d in g), g[-1].finish_reason, chat.tool_plan(), parsers)
    if req.logprobs:     # the items as streamed, whose output_text parts carry their tokens
        output = _replayed(g, _choices(state, req, chat, parsers), req.sealed)
    else:
        output = [_reasoning_item(message["reasoning_content"], sealed=req.sealed)] if message.get(
            "reasoning_content") else []
        output += [_message_item(message["content"])] if message.get("content") else []
        output += [_call_item(c) for c in message.get("tool_calls") or []]
    n_out = sum(len(d.token_ids) for d in g)
    n_reason = reasoning_tokens(parsers, g) if parsers.reasoning else 0
    cached = max((d.num_cached_tokens for d in g), default=0)
    usage = _usage(n_prompt, n_out, cached, n_reason, state.cache_written(n_prompt, cached))
    return _finish(state, req, rid, created, model, items, output, usage, finish_reason == "length")


@router.post("/v1/responses")
async def create_response(request: Request):
    state = request.app.state.server
    raw = await json_body(request)
    ResponsesRequest.check_unsupported(raw)
    req = validated(ResponsesRequest, raw)
    if req.background and not req.store:
        raise OpenAIError(400, "background responses must be stored: background needs store true", param="background")
    chat, items, prompt, params, parsers = await run_in_threadpool(prepared, state, req)
    try:
        lora = state.check_model(req.model)    # a loaded LoRA adapter's name runs with it, as on chat
        field = lambda name: _RESPONSES_FIELDS.get(chat.request_field(name), name)   # noqa: E731
        sub = state.engine.submit([prompt], params, request_field=field, lora=lora)
    except OpenAIError as e:   # errors name this request's fields, not the chat request's
        raise renamed(e, _RESPONSES_FIELDS) from None
    rid, created, model = new_id("resp"), now(), lora or state.model_name
    finish = functools.partial(_finish, state, req, rid, created, model, items)
    if req.background:
        return _run_in_background(state, req, sub, items, finish, _choices(state, req, chat, parsers),
                                  _response(rid, created, model, req, [], "queued", None, False), len(prompt))
    if not req.stream:
        return await respond(state.engine, sub, request, lambda groups: final_body(
            state, req, rid, created, model, chat, items, parsers, groups[0], len(prompt)))
    start = _response(rid, created, model, req, [], "in_progress", None, False)
    return StreamingResponse(_events(state, sub, _choices(state, req, chat, parsers), start, len(prompt), finish,
                                     req.sealed), media_type="text/event-stream")


class _EventWriter:
    """One streamed response's output items, built from its chat chunks, and the Responses events
    that announce them (each numbered by sequence_number)."""

    def __init__(self, sealed: bool = False):
        self.seq, self.output, self.sealed = 0, [], sealed
        self.open_item: dict | None = None        # the reasoning or message item being written
        # answer tokens' logprobs not yet matched to text: they go with the next output_text delta
        # (text a parser held back comes out later), or are dropped where a tool call comes first
        self.pending: list[dict] = []
        self.cut = False

    def tokens(self, logprobs: list[dict]) -> None:
        self.pending += logprobs

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        body = {"type": kind, "sequence_number": self.seq - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def close(self) -> list[str]:
        item, self.open_item = self.open_item, None
        if item is None:
            return []
        idx, part = self.output.index(item), item["content"][0]
        item["status"] = "completed"
        if item["type"] == "reasoning":
            if self.sealed:
                item["encrypted_content"] = _seal(part["text"])
            return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                               text=part["text"]),
                    self.event("response.output_item.done", output_index=idx, item=item)]
        return [self.event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                           text=part["text"], logprobs=part["logprobs"]),
                self.event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=idx, item=item)]

    def text(self, kind: str, delta: str) -> list[str]:
        """A reasoning or message delta: the item opened first where needed."""
        events = []
        if self.open_item is not None and self.open_item["type"] != kind:
            events += self.close()
        if self.open_item is None:
            item = _reasoning_item("", "in_progress") if kind == "reasoning" else _message_item("", "in_progress")
            self.output.append(item)
            self.open_item = item
            shown, idx = json.loads(json.dumps(item)), len(self.output) - 1
            if kind == "message":     # its part arrives with content_part.added, not inside the item
                events.append(self.event("response.output_item.added", output_index=idx, item={**shown, "content": []}))
                events.append(self.event("response.content_part.added", item_id=item["id"], output_index=idx,
                                         content_index=0, part=shown["content"][0]))
            else:
                events.append(self.event("response.output_item.added", output_index=idx, item=shown))
        item = self.open_item
        item["content"][0]["text"] += delta
        kind_delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {}
        if kind == "message":
            extra["logprobs"], self.pending = self.pending, []
            item["content"][0]["logprobs"] += extra["logprobs"]
        return events + [self.event(kind_delta, item_id=item["id"], output_index=self.output.index(item),
                                    content_index=0, delta=delta, **extra)]

    def tool_call(self, tc: dict) -> list[str]:
        """A streamed tool-call delta: the call's id and name (the item opens), then its arguments."""
        self.pending = []           # a call's tokens are no output_text's
        if "id" in tc:
            events = self.close()
            item = _call_item({"id": tc["id"], "function": {"name": tc["function"]["name"], "arguments": ""}},
                              "in_progress")
            self.output.append(item)
            return events + [self.event("response.output_item.added", output_index=len(self.output) - 1,
                                        item=dict(item))]
        item = [i for i in self.output if i["type"] == "function_call"][-1]
        args, idx = tc["function"]["arguments"], self.output.index(item)
        item["arguments"] += args
        item["status"] = "completed"
        return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=idx, delta=args),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                           arguments=item["arguments"], name=item["name"]),
                self.event("response.output_item.done", output_index=idx, item=item)]

    def delta(self, choices: ChatChoices, d) -> list[str]:
        """One engine delta of the choice: its chat chunks' events, its answer tokens matched to text."""
        chunks = choices(d)
        self.tokens(choices.answer_logprobs)
        return [e for chunk in chunks for e in self.chunk(chunk)]

    def chunk(self, chunk: dict) -> list[str]:
        self.cut = self.cut or chunk.get("finish_reason") == "length"     # max_output_tokens ended it
        delta, events = chunk["delta"], []
        if delta.get("reasoning_content"):
            events += self.text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self.text("message", delta["content"])
        for tc in delta.get("tool_calls") or []:
            events += self.tool_call(tc)
        return events


def _replayed(deltas: list, choices: ChatChoices, sealed: bool) -> list[dict]:
    """A finished choice's deltas -> its output items, as the stream builds them."""
    w = _EventWriter(sealed)
    for d in deltas:
        if d.text or d.token_ids or d.finished:
            w.delta(choices, d)
    w.close()
    return w.output


async def _events(state, sub, choices: ChatChoices, start: dict, n_prompt: int, finish, sealed: bool):
    w, done, n_out, cached = _EventWriter(sealed), False, 0, 0
    try:
        yield w.event("response.created", response=start)
        yield w.event("response.in_progress", response={**start, "status": "in_progress"})
        remaining = 1
        while remaining:
            d = await next_delta(sub)
            remaining -= d.finished
            n_out += len(d.token_ids)
            cached = max(cached, d.num_cached_tokens)
            if not (d.text or d.token_ids or d.finished):
                continue
            for e in w.delta(choices, d):
                yield e
        done = True
        for e in w.close():
            yield e
        body = finish(w.output, _usage(n_prompt, n_out, cached, choices.reasoning_tokens,
                                       state.cache_written(n_prompt, cached)), w.cut)
        yield w.event("response.incomplete" if w.cut else "response.completed", response=body)
    except EngineDeadError as e:   # the spec's error event (type "error", numbered like the rest)
        yield w.event("error", code=e.code, message=e.message, param=e.param)
    finally:
        state.engine.release(sub, done)


class _Run:
    """A background response (background: true) running on the server's event loop whoever
    listens: its events so far (each one's index is its sequence_number), which GET
    /v1/responses/{id}?stream=true replays from starting_after and then follows; its task, which
    cancel stops (the engine request aborted, its blocks freed)."""

    def __init__(self, events, body: dict, items: list[dict]):
        self.events: list[str] = []
        self.done = False
        self.body, self.items = body, items      # as stored at the start (the store may drop it)
        self._signal = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(events))

    async def stop(self) -> None:
        """Cancel the run (its engine request aborted) and wait for it to end."""
        if not self.task.done():
            self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):   # (an error is the run's own)
            await self.task

    async def _run(self, events) -> None:
        try:
            async for e in events:
                self.events.append(e)
                self._wake()
        finally:
            self.done = True
            self._wake()

    def _wake(self) -> None:
        signal, self._signal = self._signal, asyncio.Event()
        signal.set()

    async def follow(self, after: int):
        i = after + 1
        while True:
            signal = self._signal
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await signal.wait()

    def error(self) -> dict | None:
        """What ended it without a response, as a response's `error`: the error event of an engine
        that died, or an exception of its own (a 500's server_error); None: a response, or cancel."""
        if self.events and '"type": "error"' in self.events[-1]:
            e = json.loads(self.events[-1].split("data: ", 1)[1])
            return {"code": e.get("code") or "server_error", "message": e["message"]}
        if self.task.done() and not self.task.cancelled() and (exc := self.task.exception()) is not None:
            return {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"}
        return None


def _runs(state) -> dict[str, _Run]:
    if not hasattr(state, "response_runs"):
        state.response_runs = {}
    return state.response_runs


def _run_in_background(state, req: ResponsesRequest, sub, items: list[dict], finish, choices: ChatChoices,
                       queued: dict, n_prompt: int):
    """background: true: stored at once (in progress), answered "queued"; the run goes on without
    the client, streamed to it where it asked (stream true) and to whoever asks later."""
    store, runs = _store(state), _runs(state)
    for rid in [r for r, run in runs.items() if run.done and r not in store]:
        del runs[rid]                   # finished runs whose response the store has dropped
    body = {**queued, "status": "in_progress"}
    store.put(queued["id"], body, items)
    run = runs[queued["id"]] = _Run(_events(state, sub, choices, queued, n_prompt, finish, req.sealed), body, items)

    def ended(_task) -> None:           # an engine that died, or an error of the run: stored failed
        found = store.get(queued["id"])
        if found is not None and found[0]["status"] == "in_progress" and (error := run.error()) is not None:
            store.put(queued["id"], {**found[0], "status": "failed", "error": error}, found[1])
            log.error("background response %s failed: %s", queued["id"], error["message"])
    run.task.add_done_callback(ended)
    if req.stream:
        return StreamingResponse(run.follow(-1), media_type="text/event-stream")
    return queued


def _stored(request: Request, response_id: str) -> tuple[dict, list[dict]]:
    found = _store(request.app.state.server).get(response_id)
    if found is None:
        raise OpenAIError(404, f"no stored response with id {response_id!r}", type_="not_found_error",
                          param="response_id", code="response_not_found")
    return found


def _no_query(request: Request, noop: dict) -> None:
    """Query parameters of a GET this server does not implement: a 400 naming them."""
    for name, value in request.query_params.multi_items():
        if name in noop and not noop[name](value):
            raise OpenAIError(400, f"{name}={value!r} is not supported by this server", param=name)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, stream: bool = False, starting_after: int | None = None):
    """A stored response; stream=true: a background response's events after starting_after (its
    sequence_number; all of them without it), then the rest as they come."""
    _no_query(request, {"include[]": lambda v: False, "include": lambda v: False})
    body = _stored(request, response_id)[0]
    if starting_after is not None and (not stream or starting_after < 0):
        raise OpenAIError(400, "starting_after is a sequence number (0 or more), with stream=true, got "
                               f"{starting_after}", param="starting_after")
    if not stream:
        return body
    run = _runs(request.app.state.server).get(response_id)
    if run is None:
        raise OpenAIError(400, "stream=true replays a background response's events; this response was not "
                               "run in the background", param="stream")
    return StreamingResponse(run.follow(-1 if starting_after is None else starting_after),
                             media_type="text/event-stream")


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request):
    """Stop a background response: its engine request aborted, its status "cancelled" (again: the
    same response); a response that was not run in the background, or has ended, is a 400."""
    state = request.app.state.server
    run = _runs(state).get(response_id)
    if run is None:
        _stored(request, response_id)
        raise OpenAIError(400, "Cannot cancel a synchronous response.", param="response_id")
    await run.stop()
    # (a running response the store dropped, with 1024 newer ones, is stored again, cancelled)
    body, items = _store(state).get(response_id) or (run.body, run.items)
    if body["status"] == "in_progress":
        body = {**body, "status": "cancelled"}
        _store(state).put(response_id, body, items)
    elif body["status"] != "cancelled":
        raise OpenAIError(400, f"Cannot cancel a response that is {body['status']}.", param="response_id")
    return body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    run = _runs(request.app.state.server).pop(response_id, None)
    if run is None:
        _stored(request, response_id)
    else:            # a background response still running stops (found even where the store dropped it)
        await run.stop()
    _store(request.app.state.server).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, after: str | None = None, limit: int = 20,
                           order: str = "desc"):
    """A stored response's input items (its conversation before its output), a page at a time:
    OpenAI's cursor list (limit 1-100, default 20; order desc, the default, or asc; after an item id)."""
    _no_query(request, {"include[]": lambda v: False, "include": lambda v: False})
    if not 1 <= limit <= 100:
        raise OpenAIError(400, f"limit must be between 1 and 100, got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise OpenAIError(400, f"order must be asc or desc, got {order!r}", param="order")
    items = _stored(request, response_id)[1]
    items = items[::-1] if order == "desc" else items
    start = 0
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise OpenAIError(400, f"after: no input item {after!r} in response {response_id!r}", param="after")
        start = ids.index(after) + 1
    page = items[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}
