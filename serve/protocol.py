"""OpenAI request schemas -> SamplingParams, and the response bodies. Shared by the HTTP server
and the offline batch script so both speak exactly the same dialect.

Every request body is checked before its fields are: text must be valid Unicode (JSON's "\\ud800"
escapes parse to lone surrogates that no tokenizer can encode), OpenAI fields we do not implement
are refused (UNSUPPORTED_FIELDS), unknown extras are ignored with a logged warning. Sampling bounds
themselves live in SamplingParams; this module only maps OpenAI's field names onto it."""
from __future__ import annotations

import logging
import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from jaxinfer.config import SamplingParams, SamplingParamsError

log = logging.getLogger("jaxinfer.serve")

# OpenAI request fields this server does not implement. Each is refused with a 400 naming it unless
# it carries its no-op value: a client that asked for JSON, a tool call or a logit bias must not get
# plain text that it believes honours the request.
UNSUPPORTED_FIELDS = {
    "logit_bias": lambda v: v is None or v == {},
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text" and len(v) == 1),
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "parallel_tool_calls": lambda v: v is None,
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
    "best_of": lambda v: v is None or v == 1,
    "suffix": lambda v: v is None or v == "",
    "audio": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    # vLLM's structured-output extras: the same promise as response_format
    "guided_json": lambda v: v is None, "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None, "guided_grammar": lambda v: v is None,
    "structured_outputs": lambda v: v is None,
}


class OpenAIError(Exception):
    """An error with an HTTP status and the OpenAI error JSON shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def find_invalid_text(obj: Any) -> str | None:
    """The path of the first string (or key) in a parsed JSON value that is not valid Unicode text
    (a lone UTF-16 surrogate such as "\\ud800" parses to one), else None. Iterative: a body nested
    as deep as the JSON parser allows must not overflow the stack here."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            items = []
            for k, v in value.items():
                if not _is_text(k):
                    return path or "body"
                items.append((f"{path}.{k}" if path else k, v))
            stack.extend(reversed(items))
        elif isinstance(value, list):
            stack.extend(reversed([(f"{path}[{i}]", v) for i, v in enumerate(value)]))
    return None


def _is_text(s: Any) -> bool:
    try:
        s.encode("utf-8")
    except (UnicodeEncodeError, AttributeError):
        return False
    return True


def _refuse(param: str, message: str) -> PydanticCustomError:
    # ctx["param"] becomes the error JSON's "param" (serve.app._validation_error)
    return PydanticCustomError("invalid_field", "{message}", {"message": message, "param": param})


class _Body(BaseModel):
    """A request body: strings must be valid Unicode; unknown extras are ignored with a warning."""
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        bad = find_invalid_text(data)
        if bad is not None:
            raise _refuse(bad.split(".")[0].split("[")[0],
                          f"{bad}: not valid Unicode text (it contains a lone UTF-16 surrogate)")
        for name, is_noop in UNSUPPORTED_FIELDS.items():
            if name in data and name not in cls.model_fields and not is_noop(data[name]):
                raise _refuse(name, f"{name} is not supported by this server")
        unknown = sorted(set(data) - set(cls.model_fields) - set(UNSUPPORTED_FIELDS))
        if unknown:
            log.warning("ignoring unknown request field(s) %s", unknown)
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields both endpoints share (OpenAI's names) plus vLLM-style extras. Only types are checked
    here: every bound is SamplingParams' (jaxinfer.config), so the server and the Python API accept
    exactly the same values; a refused value becomes a 400 naming this request's field."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # extras (vLLM names)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # prefix caching (vLLM's name): requests share cached prompt blocks only under the same salt
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                seed=self.seed, stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                logprobs=logprobs, n=self.n)
        except SamplingParamsError as e:
            raise OpenAIError(400, str(e), param=self.request_field(e.fields[0])) from None

    def request_field(self, name: str) -> str:
        """The name this request uses for SamplingParams field `name`."""
        return name


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    max_tokens: int | None = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):   # content parts: only text parts are supported
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(400, "only text content parts are supported", param="messages")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None

    def request_field(self, name: str) -> str:
        if name == "logprobs":
            return "top_logprobs"
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return name


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _lp(v: float) -> float:
    """JSON has no infinities: OpenAI reports an impossible token's logprob as -9999.0."""
    return v if math.isfinite(v) else -9999.0


def completion_logprobs(outs: list, token_str) -> dict:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for d in outs:
        for i, t in enumerate(d.token_ids):
            s = token_str(t)
            offsets.append(offset)
            offset += len(s)
            tokens.append(s)
            lps.append(_lp(d.logprobs[i]))
            tops.append({token_str(a): _lp(b) for a, b in d.top_logprobs[i]} if d.top_logprobs else {})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(outs: list, token_str) -> dict:
    """OpenAI chat logprobs: content = [{token, logprob, bytes, top_logprobs}]."""
    content = []
    for d in outs:
        for i, t in enumerate(d.token_ids):
            s = token_str(t)
            tops = [{"token": token_str(a), "logprob": _lp(b), "bytes": list(token_str(a).encode())}
                    for a, b in (d.top_logprobs[i] if d.top_logprobs else [])]
            content.append({"token": s, "logprob": _lp(d.logprobs[i]), "bytes": list(s.encode()), "top_logprobs": tops})
    return {"content": content}


def cached_tokens(groups: list[list], n: int) -> int:
    """Prompt tokens served from the prefix cache: once per prompt (its n choices share the prompt)."""
    return sum(max((d.num_cached_tokens for g in groups[i:i + n] for d in g), default=0)
               for i in range(0, len(groups), n))


def completion_body(rid: str, created: int, model: str, groups: list[list], n_prompt: int, token_str,
                    logprobs: bool, n: int = 1) -> dict:
    """A non-streaming /v1/completions response from each choice's deltas."""
    choices = [{"index": i, "text": "".join(d.text for d in g),
                "logprobs": completion_logprobs(g, token_str) if logprobs else None,
                "finish_reason": g[-1].finish_reason} for i, g in enumerate(groups)]
    n_out = sum(len(d.token_ids) for g in groups for d in g)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(n_prompt, n_out, cached_tokens(groups, n))}


def chat_body(rid: str, created: int, model: str, groups: list[list], n_prompt: int, token_str,
              logprobs: bool, n: int = 1) -> dict:
    """A non-streaming /v1/chat/completions response from each choice's deltas."""
    choices = [{"index": i, "message": {"role": "assistant", "content": "".join(d.text for d in g)},
                "logprobs": chat_logprobs(g, token_str) if logprobs else None,
                "finish_reason": g[-1].finish_reason} for i, g in enumerate(groups)]
    n_out = sum(len(d.token_ids) for g in groups for d in g)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(n_prompt, n_out, cached_tokens(groups, n))}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens counts prefix-cache hits."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def now() -> int:
    return int(time.time())
