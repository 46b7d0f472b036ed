"""Anthropic's Messages API: POST /v1/messages (streamed or not) and POST /v1/messages/count_tokens,
the routes Anthropic's SDKs and agents (Claude Code among them) call, as vLLM serves them.

A Messages request becomes a chat completion request (the same template, parsers, sampling and
structured outputs as /v1/chat/completions, serve.app.ServerState.chat_request), and its output
becomes content blocks: `thinking` (the reasoning parser's text; its signature is empty, this server
signs nothing), `text`, and one `tool_use` per tool call (its arguments parsed into `input`).
stop_reason: end_turn, max_tokens, stop_sequence (with the stop_sequence that ended it) or tool_use.
usage follows Anthropic's split of the prompt: input_tokens (computed), cache_read_input_tokens
(found in the prefix cache), cache_creation_input_tokens (computed and kept there), output_tokens.
Streaming sends Anthropic's events: message_start, then per block content_block_start,
content_block_delta (text_delta, thinking_delta, input_json_delta) ... content_block_stop, then
message_delta (stop_reason, usage) and message_stop; an engine that dies mid-stream ends it with an
`error` event.

Input: `system` (a string or text blocks), `messages` of user / assistant turns whose content is a
string or blocks: text; an assistant's thinking (sent back as its reasoning) and tool_use (as its tool
calls); a user's tool_result (a tool message, before the turn's text, as Anthropic orders them).
`tools` (custom tools: name, description, input_schema), `tool_choice` (auto, any, tool, none;
disable_parallel_tool_use), `stop_sequences`, `temperature`, `top_p`, `top_k`, `max_tokens`,
`metadata`, `user_profile_id`, `workspace_id` and a top-level `cache_control` (accepted, unused:
prefix caching is automatic), `thinking` ({"type": "disabled"} sets the template's
enable_thinking false; "enabled" needs a reasoning parser, and its budget_tokens is not enforced:
the model thinks as its template lets it, within max_tokens, as on vLLM), `output_config.format`
(a json_schema, as response_format) and `output_config.effort` (the template's reasoning_effort). Errors come in Anthropic's shape ({"type": "error", "error":
{"type", "message"}}, serve.guard.error_bytes); blocks and fields not implemented (images,
documents, server tools, ...) are a 400 naming them.
"""
from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import field_validator
from starlette.concurrency import run_in_threadpool

from serve.bridge import EngineDeadError
from serve.protocol import ChatCompletionRequest, OpenAIError, _Body, chat_message, json_body, new_id, renamed, validated
from serve.stream import ChatChoices, next_delta, respond

router = APIRouter()

# fields this server does not implement: a 400 naming the field unless its value is a no-op
UNSUPPORTED_MESSAGES_FIELDS = {
    "container": lambda v: v is None,
    "mcp_servers": lambda v: v is None or v == [],
    "context_management": lambda v: v is None,
    "service_tier": lambda v: v is None or v in ("auto", "standard_only"),
    "diagnostics": lambda v: v is None,
    "inference_geo": lambda v: v is None,
    "speed": lambda v: v is None or v == "standard",
}


class MessagesRequest(_Body):
    model: str | None = None
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # Anthropic's values (auto, standard_only), checked by UNSUPPORTED_MESSAGES_FIELDS: declared so that
    # the OpenAI list of _Body (auto, default) does not refuse them
    service_tier: str | None = None

    @field_validator("stream", mode="before")
    @classmethod
    def _null_is_false(cls, v: Any) -> Any:
        return False if v is None else v


class CountTokensRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


def _text_blocks(blocks: Any, where: str) -> str:
    """A string, or text blocks joined (their cache_control is a hint this server's automatic prefix
    caching does not need)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise OpenAIError(400, f"{where} must be a string or a list of text blocks", param=where.split("[")[0])
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise OpenAIError(400, f"{where}[{j}]: blocks of type {kind!r} are not supported here (text)",
                              param=where.split("[")[0].split(".")[0])
        out.append(b["text"])
    return "\n\n".join(out)


def chat_messages(system: Any, messages: list[dict]) -> list[dict]:
    """Messages API turns -> chat messages (the shape /v1/chat/completions takes)."""
    out: list[dict] = [] if system is None else [{"role": "system", "content": _text_blocks(system, "system")}]
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise OpenAIError(400, f"{where}.role must be user or assistant", param="messages")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise OpenAIError(400, f"{where}.content must be a string or a list of blocks", param="messages")
        texts, calls, results, thinking = [], [], [], None
        for j, b in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_result" and role == "user" and isinstance(b.get("tool_use_id"), str):
                result = b.get("content")
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": "" if result is None else _text_blocks(result, f"{at}.content")})
            elif kind == "tool_use" and role == "assistant" and isinstance(b.get("id"), str) \
                    and isinstance(b.get("name"), str) and isinstance(b.get("input"), dict):
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
            elif kind == "thinking" and role == "assistant" and isinstance(b.get("thinking"), str):
                thinking = (thinking or "") + b["thinking"]
            else:
                raise OpenAIError(400, f"{at}: a {role} block of type {kind!r} is not supported, or lacks its "
                                       "fields (user: text, tool_result; assistant: text, thinking, tool_use)",
                                  param="messages")
        out += results            # a user turn's tool results come first (Anthropic's order)
        if role == "user" and (texts or not results):
            out.append({"role": "user", "content": "\n\n".join(texts)})
        elif role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if thinking is not None:
                msg["reasoning_content"] = thinking
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise OpenAIError(400, f"tools[{i}]: only custom tools (name, description, input_schema) are "
                                   f"supported, not {kind!r}", param="tools")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """(the chat tool_choice, parallel_tool_calls) of a Messages tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = False if kind is not None and choice.get("disable_parallel_tool_use") else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise OpenAIError(400, "tool_choice.name is required when its type is tool", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel
    raise OpenAIError(400, "tool_choice.type must be auto, any, tool or none", param="tool_choice")


def _chat_request(state, req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages request stands for."""
    choice, parallel = chat_tool_choice(req.tool_choice)
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req.system, req.messages),
                            "tools": chat_tools(req.tools), "tool_choice": choice, "parallel_tool_calls": parallel}
    thinking = req.thinking
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind == "disabled":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        elif kind in ("enabled", "adaptive"):
            if state.reasoning_parser is None:
                raise OpenAIError(400, "thinking: this model is served without a reasoning parser (start the "
                                       "server with --reasoning-parser)", param="thinking")
        else:
            raise OpenAIError(400, "thinking.type must be enabled, adaptive or disabled", param="thinking")
    config = req.output_config or {}
    if not isinstance(config, dict) or set(config) - {"format", "effort"}:
        raise OpenAIError(400, "output_config: only format and effort are supported", param="output_config")
    if config.get("effort") is not None:     # to the template as reasoning_effort (gpt-oss's reads it)
        if state.reasoning_parser is None:
            raise OpenAIError(400, "output_config.effort: this model is served without a reasoning parser",
                              param="output_config")
        body["reasoning_effort"] = config["effort"]
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise OpenAIError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                              param="output_config")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences)
        body.update({k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p),
                                       ("top_k", req.top_k)) if v is not None})
    return validated(ChatCompletionRequest, body)       # its errors renamed by the routes


# the chat request's fields that a Messages request's own fields become (_chat_request)
_MESSAGES_FIELDS = {"stop": "stop_sequences", "response_format": "output_config", "reasoning_effort": "output_config",
                    "chat_template_kwargs": "thinking", "parallel_tool_calls": "tool_choice"}


async def _request(request: Request, model: type):
    """The body as `model`: fields not implemented refused by name first."""
    raw = await json_body(request)
    if isinstance(raw, dict):
        for name, is_noop in UNSUPPORTED_MESSAGES_FIELDS.items():
            if name in raw and not is_noop(raw[name]):
                raise OpenAIError(400, f"{name} is not supported by this server's /v1/messages", param=name)
    return validated(model, raw)


def _blocks(message: dict) -> list[dict]:
    """A chat message (serve.protocol.chat_message) as content blocks."""
    blocks = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                "input": json.loads(c["function"]["arguments"] or "{}")} for c in message.get("tool_calls") or []]
    return blocks


def _stop(finish_reason: str | None, stop_string: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat finish_reason."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    return ("stop_sequence", stop_string) if stop_string is not None else ("end_turn", None)


def _usage(state, n_prompt: int, cached: int, n_out: int) -> dict:
    written = state.cache_written(n_prompt, cached)
    return {"input_tokens": n_prompt - cached - written, "cache_creation_input_tokens": written,
            "cache_read_input_tokens": cached, "output_tokens": n_out}


@router.post("/v1/messages")
async def create_message(request: Request):
    state = request.app.state.server
    req = await _request(request, MessagesRequest)
    try:
        chat = await run_in_threadpool(_chat_request, state, req)
        prompt, params, parsers = await run_in_threadpool(state.chat_request, chat)
        lora = state.check_model(req.model)       # a loaded LoRA adapter's name runs with it, as on chat
        field = lambda name: _MESSAGES_FIELDS.get(chat.request_field(name), name)   # noqa: E731
        sub = state.engine.submit([prompt], params, request_field=field, lora=lora)
    except OpenAIError as e:     # errors name this request's fields, not the chat request's
        raise renamed(e, _MESSAGES_FIELDS) from None
    mid, model, plan = new_id("msg"), lora or state.model_name, chat.tool_plan()

    def message(content: list[dict], stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    if not req.stream:
        def build(groups):
            g = groups[0]
            m, finish = chat_message("".join(d.text for d in g), g[-1].finish_reason, plan, parsers)
            cached = max((d.num_cached_tokens for d in g), default=0)
            return message(_blocks(m), _stop(finish, g[-1].stop_reason),
                           _usage(state, len(prompt), cached, sum(len(d.token_ids) for d in g)))
        return await respond(state.engine, sub, request, build)
    choices = ChatChoices(1, plan, state.token_str, False, parsers)
    return StreamingResponse(_events(state, sub, choices, len(prompt), message), media_type="text/event-stream")


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class _BlockWriter:
    """One streamed message's content blocks, built from its chat chunks, as Anthropic's events."""

    def __init__(self):
        self.index, self.kind = -1, None        # the open block

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", index=self.index)]

    def open(self, kind: str, block: dict) -> list[str]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return events + [_event("content_block_start", index=self.index, content_block=block)]

    def chunk(self, delta: dict) -> list[str]:
        events = []
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                events += self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(_event("content_block_delta", index=self.index,
                                 delta={"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.kind != "text":
                events += self.open("text", {"type": "text", "text": ""})
            events.append(_event("content_block_delta", index=self.index,
                                 delta={"type": "text_delta", "text": delta["content"]}))
        for tc in delta.get("tool_calls") or []:
            if "id" in tc:
                events += self.open("tool_use", {"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                                                 "input": {}})
            args = (tc.get("function") or {}).get("arguments")
            if args:
                events.append(_event("content_block_delta", index=self.index,
                                     delta={"type": "input_json_delta", "partial_json": args}))
        return events


async def _events(state, sub, choices: ChatChoices, n_prompt: int, message):
    w, done, n_out, started, finish, stop_string = _BlockWriter(), False, 0, False, None, None
    try:
        while not done:
            d = await next_delta(sub)
            done = d.finished
            n_out += len(d.token_ids)
            if not started:    # the prompt's cached tokens are known with the first delta
                started, usage = True, _usage(state, n_prompt, d.num_cached_tokens, 0)
                yield _event("message_start", message=message([], (None, None), usage))
            if not (d.text or d.token_ids or d.finished):
                continue
            stop_string = d.stop_reason if d.finished else stop_string
            for chunk in choices(d):
                for e in w.chunk(chunk["delta"]):
                    yield e
                finish = chunk.get("finish_reason") or finish
        for e in w.close():
            yield e
        stop_reason, stop_sequence = _stop(finish, stop_string)
        yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                     usage={"output_tokens": n_out})
        yield _event("message_stop")
    except EngineDeadError as e:
        yield _event("error", error={"type": "api_error", "message": e.message})
    finally:
        state.engine.release(sub, done)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    """The prompt's tokens as /v1/messages would render them (the template with its tools)."""
    state = request.app.state.server
    req = await _request(request, CountTokensRequest)
    state.check_model(req.model)
    try:
        chat = await run_in_threadpool(_chat_request, state, req)
    except OpenAIError as e:
        raise renamed(e, _MESSAGES_FIELDS) from None
    text = await run_in_threadpool(state.render_chat_text, chat.messages, chat.tool_plan(), chat.chat_template_kwargs)
    return {"input_tokens": len(await run_in_threadpool(state.encode_chat, text))}
