"""OpenAI request schemas -> SamplingParams, and the response bodies. Shared by the HTTP server
and the offline batch script so both speak exactly the same dialect.

Every request body is checked before its fields are: text must be valid Unicode (JSON's "\\ud800"
escapes parse to lone surrogates that no tokenizer can encode), OpenAI fields we do not implement
are refused (UNSUPPORTED_FIELDS), unknown extras are ignored with a logged warning. Sampling bounds
themselves live in SamplingParams; this module only maps OpenAI's field names onto it.

Structured outputs: at most one constraint per request, from OpenAI's `response_format`
(json_object, json_schema), vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
or its `structured_outputs` object, or a forced tool call (chat `tool_choice` "required" or named,
serve.tools); it becomes SamplingParams.structured_outputs, and an error about it (here, or the
engine's when the grammar does not compile) names the field this request used."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from jaxinfer.config import SamplingParams, SamplingParamsError, StructuredOutputs
from serve.reasoning import OutputParsers, reasoning_tokens, split_reasoning
from serve.tool_parsers import strict_json
from serve.tools import ToolPlan, ToolSpecError, check_message_tool_calls, parse_choice, plan_tools

log = logging.getLogger("jaxinfer.serve")

# OpenAI request fields this server does not implement (on an endpoint whose model does not declare
# them: tools are chat-only). Each is refused with a 400 naming it unless it carries its no-op value:
# a client that asked for a tool call must not get plain text that it believes honours the request.
UNSUPPORTED_FIELDS = {
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
    # OpenAI chat fields for features this server does not have: stored completions, service
    # tiers, reasoning models' effort and verbosity, OpenAI's own prompt-cache routing and abuse
    # monitoring (the prefix cache here keys on the prompt and `cache_salt`)
    "store": lambda v: v is None or v is False,
    "metadata": lambda v: v is None or v == {},
    "service_tier": lambda v: v is None or v in ("auto", "default"),
    "reasoning_effort": lambda v: v is None,
    "verbosity": lambda v: v is None,
    "prompt_cache_key": lambda v: v is None,
    "safety_identifier": lambda v: v is None,
    # vLLM's sampling and rendering extras this server does not implement (clients written for vLLM
    # send them expecting their effect); all but spaces_between_special_tokens are served by
    # completions and chat (fields of _Sampling), refused by the APIs that do not declare them
    # (Responses, Messages)
    "min_tokens": lambda v: v is None or v == 0,
    "bad_words": lambda v: v is None or v == [],
    "allowed_token_ids": lambda v: v is None,
    "use_beam_search": lambda v: v is None or v is False,
    "length_penalty": lambda v: v is None or v == 1.0,
    "spaces_between_special_tokens": lambda v: v is None or v is True,
    # vLLM's request fields that would change the output and are not implemented: prompt embeddings,
    # custom logits processors, an outlines whitespace pattern, and chat's add_special_tokens true
    # (special tokens added on top of the template's; completions declare the field and honour it)
    "prompt_embeds": lambda v: v is None,
    "logits_processors": lambda v: v is None or v == [],
    "guided_whitespace_pattern": lambda v: v is None,
    "add_special_tokens": lambda v: v is None or v is False,
    # chat's template inputs (ChatCompletionRequest and TokenizeRequest declare them), on routes that
    # render no chat request's template (Responses, Messages)
    "documents": lambda v: v is None,
    "chat_template": lambda v: v is None,
    # chat template options (declared by chat requests; on completions they would be silently dropped)
    "add_generation_prompt": lambda v: v is None or v is True,
    "continue_final_message": lambda v: v is None or v is False,
}

# vLLM's structured_outputs object: the constraint keys, and the one option we honour
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_SO_OPTIONS = ("disable_any_whitespace",)


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



async def json_body(request) -> Any:
    """A route's body parsed as strict JSON (routes that validate it themselves: Responses,
    Messages): NaN, Infinity and numbers out of float range are refused, as is nesting past
    Python's recursion limit, with a 400 (they came back as 500s, and a stored NaN made the
    stored response unserializable)."""
    try:
        return strict_json(await request.body())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON ({type(e).__name__}: {e})"[:500]) from None


def validated(model: type[BaseModel], data: Any) -> Any:
    """model.model_validate(data), its first error a 400 naming the field at fault."""
    try:
        return model.model_validate(data)
    except ValueError as e:
        errors = getattr(e, "errors", lambda: [])()
        first = errors[0] if errors else {}
        loc = ".".join(str(x) for x in first.get("loc", ()))
        param = (first.get("ctx") or {}).get("param") or loc.split(".")[0] or None
        msg = first.get("msg", e)
        raise OpenAIError(400, msg if (first.get("ctx") or {}).get("param") else f"{loc or 'body'}: {msg}",
                          param=param) from None


def renamed(e: OpenAIError, names: dict[str, str]) -> OpenAIError:
    """An error of the chat request a route stands for (Responses, Messages), naming that route's own
    field where the chat field came from one of its own (names: chat field -> the route's)."""
    name = names.get(e.param, e.param)
    if name != e.param:
        e.message, e.param = re.sub(rf"\b{e.param}\b", name, e.message), name
    return e


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
    continuous_usage_stats: bool = False     # vLLM's: with include_usage, every chunk carries usage


# the sampling fields a request may leave to the model's defaults, with the neutral value of each:
# SamplingParams' own (vLLM's _DEFAULT_SAMPLING_PARAMS)
_DEFAULTED = {name: getattr(SamplingParams(), name)
              for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}


class _Sampling(_Body):
    """Fields both endpoints share (OpenAI's names) plus vLLM-style extras. Only types are checked
    here: every bound is SamplingParams' (jaxinfer.config), so the server and the Python API accept
    exactly the same values; a refused value becomes a 400 naming this request's field."""
    model: str | None = None
    max_tokens: int | None = None
    # None (left out): the model's default (generation_config.json, as vLLM takes it), else neutral
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # extras (vLLM names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # vLLM's: the prompt's and each choice's token ids in the response (RL trainers read them)
    return_token_ids: bool = False
    # vLLM's: special tokens kept in the text (False); a stop string kept at the end of the text; only
    # the prompt's last N tokens (-1: max_model_len) kept; logprobs' tokens as "token_id:N"
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None   # vLLM's: right keeps the first N tokens
    # vLLM's: no EOS, stop id or stop string before this many tokens; the only tokens the output may
    # hold; words it must not contain (SamplingParams)
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's beam search (serve/beam.py): n beams, ranked by cumulative logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0
    return_tokens_as_token_ids: bool = False
    # vLLM's: lower runs first under --scheduling-policy priority (other than 0 refused under fcfs)
    priority: int = 0
    # vLLM's: the response's id is "<prefix>-<request_id>" (an X-Request-Id header wins; response_id)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    # prefix caching (vLLM's name): requests share cached prompt blocks only under the same salt
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # token id (as a string, OpenAI's shape) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    # structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_stream_options(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_options") is not None and not data.get("stream"):
            raise _refuse("stream_options", "stream_options is only allowed when stream is true")   # as vLLM
        return data

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        prefix: str | None = None, defaults: dict | None = None) -> SamplingParams:
        """prefix: the reasoning section a constraint starts after (StructuredOutputs.prefix);
        defaults: the model's default sampling parameters (Generator.sampling_defaults), for the
        fields left out (not under use_beam_search, which takes none of them), else neutral ones."""
        d = {} if self.use_beam_search else (defaults or {})
        given = {name: getattr(self, name) for name in _DEFAULTED}
        chosen = {name: v if v is not None else d.get(name, _DEFAULTED[name]) for name, v in given.items()}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = self.logit_bias_ids()
        constraint = self.constraint()
        if constraint is not None and prefix is not None:
            constraint = dataclasses.replace(constraint, prefix=prefix)
        try:
            return SamplingParams(
                max_tokens=max_tokens, **chosen,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                seed=self.seed, stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                logprobs=logprobs, n=self.n, logit_bias=bias, structured_outputs=constraint,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, min_tokens=self.min_tokens,
                allowed_token_ids=self.allowed_token_ids, bad_words=tuple(self.bad_words or ()))
        except SamplingParamsError as e:
            raise OpenAIError(400, str(e), param=self.request_field(e.fields[0])) from None

    def request_field(self, name: str) -> str:
        """The name this request uses for SamplingParams field `name`."""
        if name == "structured_outputs":
            return self.constraint_field() or name
        return name

    # ------------------------------------------------------------ logit_bias
    def logit_bias_ids(self) -> dict[int, float] | None:
        """OpenAI's {"token id": bias} with the ids as integers (bounds: SamplingParams, the vocabulary:
        the engine)."""
        if not self.logit_bias:
            return None
        bad = [k for k in self.logit_bias if not re.fullmatch(r"-?[0-9]{1,19}", k)]
        if bad:
            raise OpenAIError(400, f"logit_bias keys must be token ids (integers as strings), got {bad[:3]}",
                              param="logit_bias")
        return {int(k): v for k, v in self.logit_bias.items()}

    # ------------------------------------------------------------ structured outputs
    def constraint_sources(self) -> list[str]:
        """The fields of this request that ask for a constraint (more than one is refused)."""
        rf = self.response_format
        found = ["response_format"] if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text") else []
        found += [f for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
                  if getattr(self, f) is not None]
        return found

    def constraint_field(self) -> str | None:
        found = self.constraint_sources()
        return found[0] if found else None

    def constraint(self) -> StructuredOutputs | None:
        """This request's structured-output constraint, or None; a 400 naming the field when it is
        malformed or when a second field asks for another one."""
        found = self.constraint_sources()
        if len(found) > 1:
            raise OpenAIError(400, f"at most one structured-output constraint per request, got {' and '.join(found)}",
                              param=found[1])
        if not found:
            return None
        field_name = found[0]
        try:
            return self._build_constraint(field_name)
        except SamplingParamsError as e:
            raise OpenAIError(400, f"{field_name}: {e}", param=field_name) from None

    def _build_constraint(self, name: str) -> StructuredOutputs:
        if name == "response_format":
            return _response_format(self.response_format)
        if name == "guided_json":
            return StructuredOutputs(json=_schema_object(self.guided_json, "guided_json"))
        if name == "guided_regex":
            return StructuredOutputs(regex=self.guided_regex)
        if name == "guided_choice":
            return StructuredOutputs(choice=tuple(self.guided_choice))
        if name == "guided_grammar":
            return StructuredOutputs(grammar=self.guided_grammar)
        return _structured_outputs(self.structured_outputs)


def _schema_object(value: Any, param: str) -> dict:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as e:
            raise OpenAIError(400, f"{param}: the JSON schema is not valid JSON ({e})", param=param) from None
    if not isinstance(value, dict):
        raise OpenAIError(400, f"{param}: the JSON schema must be an object", param=param)
    return value


def _response_format(rf: dict) -> StructuredOutputs:
    """OpenAI's response_format (type text is no constraint and never reaches here)."""
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise OpenAIError(400, "response_format.json_schema must be an object with name and schema",
                              param="response_format")
        name = spec.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise OpenAIError(400, "response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'",
                              param="response_format")
        if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
            raise OpenAIError(400, "response_format.json_schema.strict must be a boolean", param="response_format")
        if "schema" not in spec:
            raise OpenAIError(400, "response_format.json_schema.schema is required", param="response_format")
        return StructuredOutputs(json=_schema_object(spec["schema"], "response_format"))
    raise OpenAIError(400, f"response_format.type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}",
                      param="response_format")


def _structured_outputs(so: dict) -> StructuredOutputs:
    """vLLM's structured_outputs object: one of json, regex, choice, grammar, json_object (null values
    are absent), and disable_any_whitespace (JSON: default true here, compact JSON)."""
    unknown = sorted(set(so) - set(_SO_KEYS) - set(_SO_OPTIONS))
    if unknown:
        raise OpenAIError(400, f"structured_outputs: unsupported key(s) {unknown}; supported: "
                               f"{list(_SO_KEYS + _SO_OPTIONS)}", param="structured_outputs")
    kw: dict[str, Any] = {}
    for key in _SO_KEYS:
        v = so.get(key)
        if v is None:
            continue
        if key == "json":
            kw["json"] = _schema_object(v, "structured_outputs")
        elif key == "json_object":
            if not isinstance(v, bool):
                raise OpenAIError(400, "structured_outputs.json_object must be a boolean", param="structured_outputs")
            kw["json_object"] = v
        elif key == "choice":
            if not isinstance(v, list):
                raise OpenAIError(400, "structured_outputs.choice must be a list of strings", param="structured_outputs")
            kw["choice"] = tuple(v)
        else:
            kw[key] = v
    daw = so.get("disable_any_whitespace")
    if daw is not None and not isinstance(daw, bool):
        raise OpenAIError(400, "structured_outputs.disable_any_whitespace must be a boolean", param="structured_outputs")
    return StructuredOutputs(**kw, whitespace_flexible=daw is False)


def _check_prompt_logprobs(data: Any) -> Any:
    """vLLM's rule: prompt logprobs come with the whole response, never streamed."""
    if isinstance(data, dict) and data.get("stream") and data.get("prompt_logprobs") is not None:
        raise _refuse("prompt_logprobs", "prompt_logprobs are not available when stream is true")
    return data


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    max_tokens: int | None = 16
    prompt_logprobs: int | None = None      # vLLM's extension (echo with logprobs implies logprobs' k)
    # OpenAI's: the text after the completion; the prompt is then the prefix (fill in the middle)
    suffix: str | None = None
    # vLLM's: text prompts get the tokenizer's special tokens (BOS); false encodes them as they are
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _check_streamed(cls, data: Any) -> Any:
        return _check_prompt_logprobs(data)

    def request_field(self, name: str) -> str:
        if name == "prompt_logprobs" and self.prompt_logprobs is None:
            return "logprobs"     # echo's prompt logprobs are logprobs' k
        return super().request_field(name)


# message fields OpenAI defines that this server does not implement: refused when set, never dropped
UNSUPPORTED_MESSAGE_FIELDS = ("audio", "function_call", "refusal")


class ChatMessage(BaseModel):
    """One chat message; other unknown keys are ignored with a logged warning (clients send extras
    such as ids)."""
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in UNSUPPORTED_MESSAGE_FIELDS:
                if data.get(name) is not None:
                    raise _refuse("messages", f"messages[].{name} is not supported by this server")
            unknown = sorted(set(data) - set(cls.model_fields) - set(UNSUPPORTED_MESSAGE_FIELDS))
            if unknown:
                log.warning("ignoring unknown message field(s) %s", unknown)
        return data

    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None     # assistant: the calls it made
    tool_call_id: str | None = None                    # tool: the call this result answers
    reasoning_content: str | None = None               # assistant: its reasoning, sent back

    def template_dict(self) -> dict:
        """The message as the chat template receives it (an assistant's reasoning as both
        `reasoning_content`, Qwen3's name, and `thinking`, gpt-oss's)."""
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.reasoning_content is not None:
            m["reasoning_content"] = m["thinking"] = self.reasoning_content
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls:
            try:
                check_message_tool_calls(self.tool_calls)
            except ToolSpecError as e:
                raise OpenAIError(400, e.message, param="messages") from None
            m["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m

    def text(self) -> str:
        if isinstance(self.content, list):   # content parts: only text parts are supported
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    # a vision-language checkpoint is served as its language model (hf_configs._MULTIMODAL)
                    raise OpenAIError(400, f"content part of type {part.get('type')!r} is not supported: only text "
                                      "content parts are (jaxinfer serves text models, and a vision-language "
                                      "checkpoint as its language model)", param="messages")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    # tool calls (serve.tools)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    prompt_logprobs: int | None = None      # vLLM's extension: the rendered prompt's logprobs
    # extra variables for the chat template, e.g. Qwen3's {"enable_thinking": false} (vLLM's name)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's; given to the template as reasoning_effort (gpt-oss reads it), only under a reasoning parser
    reasoning_effort: str | None = None
    # vLLM's (transformers' apply_chat_template options): no generation prompt; or the last message
    # left open for the model to continue (a prefilled reply; add_generation_prompt must be false)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's (transformers' apply_chat_template options): documents for a RAG template, as given;
    # the request's own template (only under --trust-request-chat-template)
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    _plan: Any = PrivateAttr(default=False)

    # vLLM's: the response begins with the last message's content where that message has the
    # response's role (an assistant message the model continues: continue_final_message)
    echo: bool = False

    @model_validator(mode="before")
    @classmethod
    def _check_chat_extras(cls, data: Any) -> Any:
        return _check_prompt_logprobs(data)

    def response_role(self) -> str:
        """vLLM's get_chat_request_role: "assistant" under a generation prompt, else the last
        message's role (the model continues that message)."""
        return "assistant" if self.add_generation_prompt or not self.messages else self.messages[-1].role

    def echo_text(self) -> str:
        """vLLM's chat echo: the last message's content (its text parts joined by newlines) where that
        message has the response's role, else ""; "" without echo."""
        if not self.echo or not self.messages or self.messages[-1].role != self.response_role():
            return ""
        content = self.messages[-1].content
        if isinstance(content, list):
            return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict) and "text" in part)
        return content or ""

    def request_field(self, name: str) -> str:
        if name == "logprobs":
            return "top_logprobs"
        if name == "prompt":
            return "messages"     # the rendered conversation (one too long for the context)
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if name == "structured_outputs" and self.constraint_field() == "tool_choice":
            return "tools"        # the forced call's schema is made of the tools' parameters
        return super().request_field(name)

    def tool_plan(self) -> ToolPlan | None:
        """The request's tools and tool_choice, checked (a 400 naming the field), computed once."""
        if self._plan is False:
            try:
                self._plan = plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
            except ToolSpecError as e:
                raise OpenAIError(400, e.message, param=e.param) from None
        return self._plan

    def constraint_sources(self) -> list[str]:
        plan = self.tool_plan()
        return super().constraint_sources() + (["tool_choice"] if plan is not None and plan.constrained else [])

    def _build_constraint(self, name: str) -> StructuredOutputs:
        if name == "tool_choice":
            return StructuredOutputs(json=self.tool_plan().schema())
        return super()._build_constraint(name)


class TokenizeRequest(_Body):
    """vLLM's /tokenize bodies: a prompt (TokenizeCompletionRequest) or messages rendered as a chat
    request renders them (TokenizeChatRequest: its template options, tools, documents, the request's
    own template under --trust-request-chat-template); return_token_strs adds each id's piece."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    tools: list[dict[str, Any]] | None = None     # with messages: rendered as a chat request renders them
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    documents: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _check_flags(self) -> "TokenizeRequest":
        if self.continue_final_message and self.add_generation_prompt:
            raise _refuse("continue_final_message", "Cannot set both `continue_final_message` and "
                                                    "`add_generation_prompt` to True.")
        if self.prompt is not None:
            for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template",
                         "documents"):
                if name in self.model_fields_set:
                    raise _refuse(name, f"{name} applies to messages, not to a prompt")
        elif self.add_special_tokens and "add_special_tokens" in self.model_fields_set:
            # as on chat completions: special tokens on top of the template's are not implemented
            raise _refuse("add_special_tokens", "add_special_tokens: true is not supported with messages (the chat "
                                                "template writes the special tokens)")
        return self

    def tool_plan(self) -> ToolPlan | None:
        try:
            return plan_tools(self.tools, None, None)
        except ToolSpecError as e:
            raise OpenAIError(400, e.message, param=e.param) from None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _lp(v: float) -> float:
    """JSON has no infinities: OpenAI reports an impossible token's logprob as -9999.0."""
    return v if math.isfinite(v) else -9999.0


def completion_logprobs(outs: list, token_str) -> dict:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs (the top-k and the sampled
    token itself: up to logprobs + 1 entries, as OpenAI and vLLM), text_offset: where each token's
    text begins in the choice's text. A delta holds one token (OutputProcessor) and its text is
    what that token added, so the offsets follow the text itself, not the tokens' display strings
    (a byte piece shows as '<0x0A>' and adds one character, a held-back stop prefix adds none)."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for d in outs:
        for i, t in enumerate(d.token_ids):
            s = token_str(t)
            offsets.append(offset)
            tokens.append(s)
            lps.append(_lp(d.logprobs[i]))
            top = {token_str(a): _lp(b) for a, b in d.top_logprobs[i]} if d.top_logprobs else {}
            if d.top_logprobs:
                top.setdefault(s, _lp(d.logprobs[i]))
            tops.append(top)
        offset += len(d.text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(outs: list, token_str, token_bytes=None) -> dict:
    """OpenAI chat logprobs: content = [{token, logprob, bytes, top_logprobs}]; token_bytes: a token
    id's bytes (ServerState.token_bytes; None: its token_str's UTF-8)."""
    token_bytes = token_bytes or (lambda t: list(token_str(t).encode()))
    content = []
    for d in outs:
        for i, t in enumerate(d.token_ids):
            tops = [{"token": token_str(a), "logprob": _lp(b), "bytes": token_bytes(a)}
                    for a, b in (d.top_logprobs[i] if d.top_logprobs else [])]
            content.append({"token": token_str(t), "logprob": _lp(d.logprobs[i]), "bytes": token_bytes(t),
                            "top_logprobs": tops})
    return {"content": content}


def cached_tokens(groups: list[list], n: int) -> int:
    """Prompt tokens served from the prefix cache: once per prompt (its n choices share the prompt).
    The least of its samples': the first computes what the cache lacked and the others fork its
    blocks, so theirs count the whole prompt as cached, even for a prompt never seen before."""
    return sum(min((d.num_cached_tokens for g in groups[i:i + n] for d in g), default=0)
               for i in range(0, len(groups), n))


def completion_body(rid: str, created: int, model: str, groups: list[list], n_prompt: int, token_str,
                    logprobs: bool, n: int = 1) -> dict:
    """A non-streaming /v1/completions response from each choice's deltas."""
    choices = [{"index": i, "text": "".join(d.text for d in g),
                "logprobs": completion_logprobs(g, token_str) if logprobs else None,
                "finish_reason": g[-1].finish_reason, "stop_reason": g[-1].stop_reason} for i, g in enumerate(groups)]
    n_out = sum(len(d.token_ids) for g in groups for d in g)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(n_prompt, n_out, cached_tokens(groups, n))}


def chat_message(text: str, finish_reason: str | None, plan: ToolPlan | None,
                 parsers: OutputParsers | None = None, role: str = "assistant") -> tuple[dict, str | None]:
    """A chat choice's message and finish_reason: the reasoning split off first (serve.reasoning, as
    reasoning_content), then tool calls parsed out of the answer under the request's tool plan
    (serve.tools, in the family's format) come back as tool_calls with finish_reason "tool_calls", or
    "length" where max_tokens cut the output (the calls written whole before the cut)."""
    parsers = parsers or OutputParsers()
    reasoning, answer = split_reasoning(parsers.reasoning, parsers.prompt, text)
    content, calls, finish_reason = parse_choice(answer, plan, finish_reason, parsers.tools)
    # the parser's content, calls or not: the harmony parser drops the headers of the messages it
    # passes on, as streaming does (the answer itself still holds them)
    message: dict[str, Any] = {"role": role, "content": content}
    if parsers.reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message, finish_reason


def chat_body(rid: str, created: int, model: str, groups: list[list], n_prompt: int, token_str,
              logprobs: bool, n: int = 1, tools: ToolPlan | None = None, parsers: OutputParsers | None = None,
              token_bytes=None, role: str = "assistant", echo: str = "") -> dict:
    """A non-streaming /v1/chat/completions response from each choice's deltas; role: the messages'
    (ChatCompletionRequest.response_role); echo: text each message's content begins with
    (ChatCompletionRequest.echo_text, vLLM's chat echo)."""
    choices, n_reasoning = [], 0
    for i, g in enumerate(groups):
        message, finish = chat_message("".join(d.text for d in g), g[-1].finish_reason, tools, parsers, role)
        if echo:
            message["content"] = echo + (message["content"] or "")
        lp = chat_logprobs(g, token_str, token_bytes) if logprobs else None
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish,
                        "stop_reason": g[-1].stop_reason})
        if parsers is not None and parsers.reasoning is not None:
            n_reasoning += reasoning_tokens(parsers, g)
    n_out = sum(len(d.token_ids) for g in groups for d in g)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(n_prompt, n_out, cached_tokens(groups, n),
                           n_reasoning if parsers is not None and parsers.reasoning is not None else None)}


def with_token_ids(body: dict, groups: list[list], prompts: list[list[int]], n: int) -> dict:
    """vLLM's return_token_ids: each choice's generated ids (its end-of-sequence token included) as
    `token_ids`, and the prompt's ids as `prompt_token_ids` (on each completion choice; chat: once, at
    the top level)."""
    for i, c in enumerate(body["choices"]):
        c["token_ids"] = [t for d in groups[i] for t in d.token_ids]
        if body["object"] == "text_completion":
            c["prompt_token_ids"] = prompts[i // n]
    if body["object"] == "chat.completion":
        body["prompt_token_ids"] = prompts[0]
    return body


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def response_id(prefix: str, headers, body_id: str | None) -> str:
    """vLLM's request id of a chat or completions response: "<prefix>-" and the X-Request-Id header
    where the request has one, else the body's request_id, else a new random id."""
    given = headers.get("x-request-id") if headers is not None else None
    given = given or body_id
    return f"{prefix}-{given}" if given else new_id(prefix)


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0, reasoning: int | None = None) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens counts prefix-cache hits;
    completion_tokens_details.reasoning_tokens where a reasoning parser runs."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def now() -> int:
    return int(time.time())
