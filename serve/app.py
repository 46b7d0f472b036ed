"""The OpenAI-compatible HTTP server (FastAPI, run by uvicorn) on one Generator's engine.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (serve.responses),
Anthropic's POST /v1/messages (serve.messages; all with `stream: true` as server-sent events),
POST /v1/embeddings, /v1/score, /v1/rerank, /classify and /pooling (serve.embeddings), GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /metrics, and vLLM's
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (serve.lora_routes; a request whose `model`
is a loaded adapter's name runs with it).
Every error uses OpenAI's error JSON {"error": {"message", "type", "param", "code"}} (Anthropic's on
its /v1/messages routes, serve.guard.error_bytes): bad requests
(malformed JSON or UTF-8, wrong types, out-of-range values, text that is not valid Unicode, fields we
do not implement, prompts longer than the context, more sequences than the queue holds) get 400,
an unknown model or route 404, a wrong method 405, a body over --max-request-bytes 413, a full
queue 429 with Retry-After, a missing or wrong API key 401 (serve.guard), a stopped engine 503.
A client that disconnects, streaming or not, aborts its request. Tokenization and chat templating
run on a worker thread, never on the event loop.

The routes are module-level handlers on one APIRouter; each finds the ServerState (engine bridge,
tokenizer, chat template, metrics) on `app.state.server`, which `build_app` sets. Streaming and the
wait for a whole response live in serve.stream, whose one helper writes every SSE event and ending.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxinfer.config import SamplingParams
from jaxinfer.engine import RequestError
from jaxinfer.errors import FieldError
from jaxinfer.fim import FimError, fills_in, fim_prompt, with_fim_stops
from jaxinfer.tokenizer import cut_ids
from jaxinfer.generator import Generator
from serve import embeddings
from serve.beam import beam_submission
from serve.bridge import AsyncEngine, EngineDeadError
from serve.chat_template import ChatTemplates
from serve.echo import Echo, first_prompt_logprobs, vllm_prompt_logprobs
from serve.guard import DEFAULT_MAX_REQUEST_BYTES, RequestGuard, error_bytes
from serve.lora_routes import router as lora_router
from serve.metrics import ServerMetrics
from serve.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                            OpenAIError, TokenizeRequest, chat_body, completion_body, json_body, now,
                            response_id, validated, with_token_ids)
from serve.stream import ChatChoices, CompletionChoices, respond, stream_response
from serve.reasoning import (REASONING_PARSERS, REASONING_TAGS, SPECIAL_TAG_PARSERS, OutputParsers,
                             default_reasoning_parser, prompt_state, reasoning_prefix)
from serve.messages import router as messages_router
from serve.responses import router as responses_router
from serve.tool_parsers import SPECIAL_TOKEN_PARSERS, TOOL_PARSERS, default_tool_parser
from serve.tools import ToolPlan


class ServerState:
    """What every route reads, built once per app and kept on `app.state.server`: the engine bridge,
    tokenizer, chat template and metrics. It also turns request bodies into prompts and sampling params,
    so that the batch script (serve.batch) validates exactly as the server does."""

    def __init__(self, gen: Generator, model_name: str, api_key: str | None, max_queue: int,
                 reasoning_parser: str | None = None, tool_call_parser: str | None = None,
                 chat_template: str | None = None, trust_request_chat_template: bool = False):
        """reasoning_parser: serve.reasoning's names, "none", or None for the one the chat template
        shows; tool_call_parser: serve.tool_parsers' names, or None for the template's; chat_template:
        a Jinja template replacing the tokenizer's; trust_request_chat_template: requests may bring
        their own (vLLM's --trust-request-chat-template)."""
        self.gen, self.model_name, self.api_key = gen, model_name, api_key
        self.trust_request_chat_template = trust_request_chat_template
        self.tokenizer = gen.tokenizer
        self.max_model_len = gen.client.max_model_len
        self.metrics = ServerMetrics(model_name)
        self.engine = AsyncEngine(gen, self.metrics, max_queue)
        self.chat = ChatTemplates.for_model(self.tokenizer, chat_template)
        template = self.chat.text
        for value, choices, flag in ((reasoning_parser, REASONING_PARSERS + ("none",), "reasoning_parser"),
                                     (tool_call_parser, TOOL_PARSERS, "tool_call_parser")):
            if value is not None and value not in choices:
                raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")
        self.reasoning_parser = (default_reasoning_parser(template) if reasoning_parser is None
                                 else None if reasoning_parser == "none" else reasoning_parser)
        self.tool_call_parser = tool_call_parser or default_tool_parser(
            template, None if self.tokenizer is None else self.tokenizer.token_to_id)
        # the reasoning tags that are added tokens (a grammar must name them as tokens: reasoning_prefix)
        self.tag_ids = {} if self.tokenizer is None else {
            t: i for t in REASONING_TAGS if (i := self.tokenizer.added_token_id(t)) is not None}

    # -------------------------------------------------------------- inputs
    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model's name, or none given);
        an unknown name is a 404."""
        if name is None or name == self.model_name:
            return None
        adapters = self.gen.lora_adapters()
        if name in adapters:
            return name
        served = ", ".join(repr(n) for n in [self.model_name, *adapters])
        raise OpenAIError(404, f"The model '{name}' does not exist; this server serves {served}",
                          param="model", code="model_not_found")

    def encode(self, text: str, add_special_tokens: bool = True, truncate: int | None = None,
               side: str = "left") -> list[int]:
        """truncate: at most that many tokens, as vLLM's tokenizer(text, truncation=True, max_length=N)
        cuts a text prompt (the special tokens the tokenizer adds stay; side "left", a generating
        model's default there, keeps the text's end)."""
        if self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer: send prompts as lists of token ids", param="prompt")
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, truncate=truncate, side=side)
        except UnicodeError:   # the request models refuse such text first; this is the backstop
            raise OpenAIError(400, "the prompt is not valid Unicode text", param="prompt") from None
        except FieldError as e:
            raise OpenAIError(400, str(e), param=e.field) from None

    def encode_chat(self, text: str, own_template: bool = False) -> list[int]:
        # as transformers and vLLM encode a rendered chat: the template writes BOS where the model
        # wants it (the plain template does not: the tokenizer's rule adds it), its special tokens
        # as text that names them (Tokenizer.encode_rendered). own_template: the request's template
        # rendered it (never the plain one)
        plain = self.chat.plain and not own_template
        if plain or self.tokenizer is None:
            return self.encode(text, add_special_tokens=plain)
        try:
            return self.tokenizer.encode_rendered(text, list(self.chat.special_tokens.values()))
        except UnicodeError:
            raise OpenAIError(400, "the messages are not valid Unicode text", param="messages") from None

    def tokenize_chat(self, req: TokenizeRequest) -> list[int]:
        """/tokenize's messages: the ids a chat request with the same messages and template options
        would send (chat_request's rendering)."""
        template, kwargs = self.request_template(req)
        text = self.render_chat_text(req.messages, req.tool_plan(), kwargs, req.add_generation_prompt,
                                     req.continue_final_message, req.documents, template)
        return self.encode_chat(text, own_template=template is not None)

    def render_chat_text(self, messages: list[ChatMessage], tools: ToolPlan | None = None,
                         template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                         continue_final_message: bool = False, documents: list | None = None,
                         template: str | None = None) -> str:
        """The prompt as text (serve.chat_template: the template for the request, HF's variables,
        the request's chat_template_kwargs and documents; template: the request's own, which the
        server must trust: request_template checked it)."""
        return self.chat.render([m.template_dict() for m in messages], tools, template_kwargs,
                                add_generation_prompt, continue_final_message, documents, template,
                                self.tool_call_parser)

    def request_template(self, req) -> tuple[str | None, dict | None]:
        """(the request's own chat template, its chat_template_kwargs without it): vLLM's
        `chat_template` field or chat_template_kwargs' `chat_template`, refused unless the server
        trusts request templates (--trust-request-chat-template), as vLLM refuses it."""
        kwargs = req.chat_template_kwargs
        template = req.chat_template
        if kwargs and "chat_template" in kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k != "chat_template"}
            template = template if template is not None else req.chat_template_kwargs["chat_template"]
        if template is None:
            return None, kwargs
        field = "chat_template" if req.chat_template is not None else "chat_template_kwargs"
        if not self.trust_request_chat_template:
            raise OpenAIError(400, "Chat template is passed with request, but --trust-request-chat-template is not "
                                   "set. Refused request with untrusted chat template.", param=field)
        if not isinstance(template, str) or not template:
            raise OpenAIError(400, "chat_template must be a non-empty string", param=field)
        return template, kwargs

    def truncation(self, keep: int | None) -> int | None:
        """vLLM's truncate_prompt_tokens resolved: None (no cut), -1 max_model_len, else >= 1."""
        if keep is None:
            return None
        if keep == -1:
            return self.max_model_len
        if not isinstance(keep, int) or keep < 1:
            raise OpenAIError(400, f"truncate_prompt_tokens must be -1 or >= 1, got {keep!r}",
                              param="truncate_prompt_tokens")
        return keep

    def truncated(self, prompt: list[int], keep: int | None, side: str | None = None) -> list[int]:
        """A token-id prompt cut by vLLM's truncate_prompt_tokens: its last `keep` tokens (-1:
        max_model_len's worth); truncation_side "right": the first ones."""
        return cut_ids(prompt, self.truncation(keep), side or "left")

    def completion_inputs(self, req: CompletionRequest) -> tuple[list[list[int]], SamplingParams]:
        """A /v1/completions body -> its prompts as token ids and the sampling params (both front
        doors, server and batch script, validate through here)."""
        return self.completion_request(req)[:2]

    def completion_request(self, req: CompletionRequest) -> tuple[list[list[int]], SamplingParams, Echo]:
        """completion_inputs, and what the response echoes (serve.echo): with echo and max_tokens 0
        the engine draws one token that is not returned (vLLM's way)."""
        self.check_model(req.model)
        p = req.prompt
        texts = None
        # a text prompt is cut as the tokenizer cuts it (its special tokens stay), token ids by slicing
        cut = dict(truncate=self.truncation(req.truncate_prompt_tokens), side=req.truncation_side or "left")
        # each prompt: a text, or token ids
        if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
            items = [p if isinstance(p, str) else list(p)]
        elif p and all(isinstance(x, (str, list)) for x in p):
            items = list(p)
        else:
            raise OpenAIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")
        fim = fills_in(self.tokenizer, req.suffix)
        if fim:
            prompts = self.fim_prompts(req, items)
        else:
            prompts = [self.encode(x, req.add_special_tokens, **cut) if isinstance(x, str) else
                       self.truncated(list(x), req.truncate_prompt_tokens, req.truncation_side) for x in items]
            texts = items if isinstance(items[0], str) else None
        if req.truncate_prompt_tokens is not None:
            texts = None          # the echo is the kept tokens' text
        echo_only = req.echo and req.max_tokens == 0
        # lengths are the engine's to check (Engine.add_request, with max_tokens_must_fit)
        max_tokens = 1 if echo_only else self.default_max_tokens(max(len(x) for x in prompts), req.max_tokens)
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and req.echo and req.logprobs is not None:
            prompt_logprobs = req.logprobs
        params = req.sampling_params(max_tokens, req.logprobs, prompt_logprobs, defaults=self.gen.sampling_defaults)
        if fim:       # what ends an infill besides EOS
            params = with_fim_stops(self.tokenizer, params)
        if req.echo and texts is None:
            texts = [self.tokenizer.decode(x) if self.tokenizer is not None else "".join(map(self.token_str, x))
                     for x in prompts]
        echo = Echo(texts or [], prompts, req.echo, echo_only, req.prompt_logprobs is not None)
        self.compile_grammar(params, req)
        return prompts, params, echo

    def fim_prompts(self, req: CompletionRequest, prefixes: list) -> list[list[int]]:
        """`suffix` (OpenAI's, DeepSeek's FIM completion): each prompt (text, or token ids) is the
        prefix, and the model is asked for the middle in its fill-in-the-middle format (jaxinfer.fim)."""
        for name in ("echo", "truncate_prompt_tokens"):
            if getattr(req, name) not in (None, False):
                raise OpenAIError(400, f"{name} cannot be used with suffix", param=name)
        if self.tokenizer is None:
            raise OpenAIError(400, "suffix needs the model's tokenizer, which this model lacks", param="suffix")
        try:
            return [fim_prompt(self.tokenizer, x, req.suffix, req.add_special_tokens) for x in prefixes]
        except FimError as e:
            raise OpenAIError(400, f"suffix: {e}", param="suffix") from None

    def chat_inputs(self, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """A /v1/chat/completions body -> the rendered prompt's token ids and the sampling params."""
        prompt, params, _ = self.chat_request(req)
        return prompt, params

    def chat_request(self, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams, OutputParsers]:
        """chat_inputs, and how the output is read (reasoning and tool-call parsers, from the prompt).
        A structured-output constraint (response_format, a forced tool call) starts after the
        reasoning section (serve.reasoning.reasoning_prefix)."""
        self.check_model(req.model)
        if req.chat_template_kwargs is not None and not isinstance(req.chat_template_kwargs, dict):
            raise OpenAIError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
        template, kwargs = self.request_template(req)
        if req.reasoning_effort is not None:
            if self.reasoning_parser is None:
                raise OpenAIError(400, "reasoning_effort is not supported by this server for this model: it runs "
                                       "no reasoning parser (--reasoning-parser)", param="reasoning_effort")
            kwargs = {"reasoning_effort": req.reasoning_effort, **(kwargs or {})}
        text = self.render_chat_text(req.messages, req.tool_plan(), kwargs, req.add_generation_prompt,
                                     req.continue_final_message, req.documents, template)
        prompt = self.truncated(self.encode_chat(text, own_template=template is not None),
                                req.truncate_prompt_tokens, req.truncation_side)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.default_max_tokens(len(prompt), requested)   # 0 is refused, not taken as unset
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        decisive = self.reasoning_context(req, kwargs, template, text)
        parsers = OutputParsers(self.reasoning_parser, decisive, self.tool_call_parser)
        prefix = (reasoning_prefix(self.reasoning_parser, prompt_state(self.reasoning_parser, decisive), self.tag_ids)
                  if self.reasoning_parser else None)
        params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                     req.prompt_logprobs, prefix=prefix, defaults=self.gen.sampling_defaults)
        plan = req.tool_plan()
        if self.reasoning_parser in SPECIAL_TAG_PARSERS or (plan is not None and plan.parses and
                                                                 self.tool_call_parser in SPECIAL_TOKEN_PARSERS):
            # these formats are written in special tokens (harmony's markers, [TOOL_CALLS], <|python_tag|>,
            # Seed-OSS's <seed:think> / <seed:tool_call>, Magistral's [THINK], DeepSeek's and Kimi's call
            # sections, GLM's tags)
            params = dataclasses.replace(params, skip_special_tokens=False)
        self.compile_grammar(params, req)
        return prompt, params, parsers

    def reasoning_context(self, req, kwargs: dict | None, template: str | None, text: str) -> str:
        """The part of the rendered prompt `text` that settles where the output starts (in the
        reasoning or the answer: serve.reasoning.prompt_state): the generation prompt the template
        added, i.e. the text past the same messages rendered without it, so that a tag a message
        quotes ("what does <think> do?") cannot; under continue_final_message, the continued message
        (with its header: the text past the messages before it). The whole prompt where there is
        neither (add_generation_prompt false) or where the template renders the earlier messages
        differently then."""
        if self.reasoning_parser in (None, "gpt_oss") or not (req.add_generation_prompt or req.continue_final_message):
            return text
        earlier = req.messages[:-1] if req.continue_final_message else req.messages
        try:
            base = self.render_chat_text(earlier, req.tool_plan(), kwargs, False, False, req.documents, template)
        except OpenAIError:
            return text
        return text[len(base):] if text.startswith(base) else text

    def compile_grammar(self, params: SamplingParams, req) -> None:
        """The request's grammar built here, on the worker thread that prepares the request (its
        submit then finds it cached): a large one never stalls the event loop or the engine."""
        try:
            self.gen.client.compile_grammar(params)
        except RequestError as e:
            raise OpenAIError(400, str(e), param=req.request_field(e.param)) from None

    def cache_written(self, n_prompt: int, cached: int) -> int:
        """Prompt tokens a request put into the prefix cache (Responses' cache_write_tokens,
        Messages' cache_creation_input_tokens): with prefix caching, every full block of its prompt
        that it computed (its cached tokens are whole blocks) is kept by its hash."""
        r = self.gen.client.resolved
        return max(0, n_prompt // r.block_size * r.block_size - cached) if r.enable_prefix_caching else 0

    def default_max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """The request's max_tokens, else the model's default (generation_config.json's
        max_new_tokens) within what the context leaves, else all it leaves; at most the cap of a
        generation_config folder or --override-generation-config's max_new_tokens (vLLM's
        get_max_tokens). A request's own value past the context is the engine's to refuse."""
        if requested is None:
            left = max(1, self.max_model_len - prompt_len)
            fallback = self.gen.sampling_defaults.get("max_tokens")
            requested = left if fallback is None else min(left, fallback)
        cap = self.gen.max_tokens_cap
        return requested if cap is None else min(requested, cap)

    def logprob_token_str(self, req) -> Callable[[int], str]:
        """How a request's logprobs name tokens: token_str, or vLLM's "token_id:N" under
        return_tokens_as_token_ids."""
        return (lambda t: f"token_id:{t}") if req.return_tokens_as_token_ids else self.token_str

    def token_str(self, token_id: int) -> str:
        """A token as text for logprobs, unique per id (OpenAI keys top_logprobs by it): SentencePiece
        pieces with the word marker as a space (byte pieces stay '<0x..>'); byte-level BPE decoded,
        or its raw piece where it is a partial UTF-8 character."""
        tok = self.tokenizer
        if tok is None:
            return f"token_id:{token_id}"
        if tok.kind == "sentencepiece":
            return tok.id_to_piece(token_id).replace("\u2581", " ")
        text = tok.decode([token_id], skip_special_tokens=False)
        return text if text and "\ufffd" not in text else tok.id_to_piece(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        """A token's bytes for chat logprobs (OpenAI's `bytes`: a byte piece is its one byte, not the
        text of '<0x0A>'; the pieces of a split multi-byte character join into its UTF-8)."""
        if self.tokenizer is None:
            return list(self.token_str(token_id).encode())
        return list(self.tokenizer.token_bytes(token_id))


def _error_response(e: OpenAIError, request: Request) -> Response:
    return Response(error_bytes(e, request.url.path), status_code=e.status, headers=e.headers,
                    media_type="application/json")


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """pydantic's errors -> one 400 whose param is the first field at fault."""
    parts, param = [], None
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":
            return OpenAIError(400, f"the request body is not valid JSON: {err.get('msg')}")
        ctx = err.get("ctx") or {}
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path"))
        param = param or ctx.get("param") or (loc.split(".")[0] if loc else None)
        parts.append(err.get("msg") if "param" in ctx else f"{loc or 'body'}: {err.get('msg')}")
    return OpenAIError(400, "; ".join(parts) or "invalid request", param=param)


_HTTP_ERRORS = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed"),
                413: ("invalid_request_error", "request_too_large")}


def _http_error(request: Request, exc: StarletteHTTPException) -> OpenAIError:
    """Starlette's own errors (unknown route, wrong method, unreadable body) in OpenAI's shape."""
    type_, code = _HTTP_ERRORS.get(exc.status_code, ("invalid_request_error", None))
    message = str(exc.detail)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    elif exc.status_code == 400 and exc.__cause__ is not None:   # FastAPI: the body could not be parsed
        message = f"the request body is not valid JSON ({type(exc.__cause__).__name__}: {exc.__cause__})"[:500]
    if exc.status_code >= 500:
        type_ = "server_error"
    return OpenAIError(exc.status_code, message, type_=type_, code=code, headers=dict(exc.headers or {}))


async def _openai_error(request: Request, exc: OpenAIError) -> Response:
    return _error_response(exc, request)


async def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
    return _error_response(_validation_error(exc), request)


async def _starlette_error(request: Request, exc: StarletteHTTPException) -> Response:
    return _error_response(_http_error(request, exc), request)


async def _internal_error(request: Request, exc: Exception) -> Response:
    return _error_response(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error"),
                           request)


_EXCEPTION_HANDLERS = ((OpenAIError, _openai_error), (RequestValidationError, _invalid_request),
                       (StarletteHTTPException, _starlette_error), (Exception, _internal_error))


# Route handlers carry no return annotations: FastAPI would take one for a response_model.
router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/health")
async def health(request: Request):
    state = _state(request)
    if not state.engine.alive:
        return _error_response(EngineDeadError(state.engine.error), request)   # code engine_dead
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    return PlainTextResponse(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _model_cards(state: ServerState) -> list[dict]:
    """The served model's card, then each loaded LoRA adapter's (vLLM's cards: root, parent)."""
    card = lambda name, parent: {"id": name, "object": "model", "created": now(), "owned_by": "jaxinfer",  # noqa: E731
                                 "root": name, "parent": parent, "max_model_len": state.max_model_len}
    return [card(state.model_name, None)] + [card(name, state.model_name) for name in state.gen.lora_adapters()]


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": _model_cards(_state(request))}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request):
    """OpenAI's retrieve (client.models.retrieve): one card, a 404 for a model this server lacks."""
    state = _state(request)
    state.check_model(model)
    return next(card for card in _model_cards(state) if card["id"] == model)


@router.get("/version")
async def version():
    """vLLM's route: the server's version (the installed package's)."""
    from importlib.metadata import version as installed
    return {"version": installed("jaxinfer")}


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    state = _state(request)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError(400, "give exactly one of prompt or messages")
    ids = await run_in_threadpool(lambda: state.encode(req.prompt, req.add_special_tokens)
                                  if req.prompt is not None else state.tokenize_chat(req))
    body = {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}
    if req.return_token_strs:   # vLLM's: the tokenizer's pieces (convert_ids_to_tokens)
        body["token_strs"] = [state.tokenizer.id_to_piece(i) for i in ids]
    return body


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    state = _state(request)
    state.check_model(req.model)
    if state.tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer")
    vocab = state.gen.model_cfg.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise OpenAIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": await run_in_threadpool(state.tokenizer.decode, req.tokens)}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    state = _state(request)
    prompts, params, echo = await run_in_threadpool(state.completion_request, req)
    lora = state.check_model(req.model)
    if req.use_beam_search:
        sub = await beam_submission(state, request, prompts, params, req, lora)
        if isinstance(sub, Response):
            return sub
    else:
        sub = state.engine.submit(prompts, params, cache_salt=req.cache_salt, request_field=req.request_field,
                                  priority=req.priority, lora=lora)
    rid, created, model = response_id("cmpl", request.headers, req.request_id), now(), lora or state.model_name
    n_prompt = sum(len(x) for x in prompts)
    token_str = state.logprob_token_str(req)
    if req.stream:
        base = {"id": rid, "object": "text_completion", "created": created, "model": model}
        return stream_response(state.engine, sub, base, [len(x) for x in prompts], req.stream_options,
                               CompletionChoices(sub, token_str, req.logprobs is not None, echo),
                               count_output=not echo.echo_only, prompt_ids=prompts if req.return_token_ids else None)

    def build(groups):
        body = echo.apply(completion_body(rid, created, model, groups, n_prompt, token_str,
                                          req.logprobs is not None, sub.n),
                          groups, token_str, req.logprobs is not None, sub.n)
        if not req.return_token_ids:
            return body      # (echo with max_tokens 0: the one token drawn is not an output)
        return with_token_ids(body, [[] for _ in groups] if echo.echo_only else groups, prompts, sub.n)
    return await respond(state.engine, sub, request, build)


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    state = _state(request)
    prompt, params, parsers = await run_in_threadpool(state.chat_request, req)
    lora = state.check_model(req.model)
    if req.use_beam_search:
        sub = await beam_submission(state, request, [prompt], params, req, lora)
        if isinstance(sub, Response):
            return sub
    else:
        sub = state.engine.submit([prompt], params, cache_salt=req.cache_salt, request_field=req.request_field,
                                  priority=req.priority, lora=lora)
    rid, created, model = response_id("chatcmpl", request.headers, req.request_id), now(), lora or state.model_name
    token_str = state.logprob_token_str(req)
    if req.stream:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        choices = ChatChoices(sub.n, req.tool_plan(), token_str, bool(req.logprobs), parsers, state.token_bytes,
                              req.response_role(), req.echo_text())
        return stream_response(state.engine, sub, base, [len(prompt)], req.stream_options, choices, choices.head,
                               prompt_ids=[prompt] if req.return_token_ids else None)

    def build(groups):
        body = chat_body(rid, created, model, groups, len(prompt), token_str, req.logprobs, sub.n,
                         tools=req.tool_plan(), parsers=parsers, token_bytes=state.token_bytes,
                         role=req.response_role(), echo=req.echo_text())
        if req.prompt_logprobs is not None:   # vLLM's place: the response's top level
            entries = first_prompt_logprobs(groups[0])
            body["prompt_logprobs"] = None if entries is None else vllm_prompt_logprobs(entries, prompt,
                                                                                        token_str)
        return with_token_ids(body, groups, [prompt], sub.n) if req.return_token_ids else body
    return await respond(state.engine, sub, request, build)


@router.get("/ping")
@router.post("/ping")
async def ping(request: Request):
    """SageMaker's health check (vLLM serves it): /health's answer."""
    return await health(request)


# SageMaker's one entry (vLLM's /invocations): the route a body is for, by the field only its request
# type requires, in vLLM's order of trying them (chat, completions, embeddings, score, rerank)
_INVOCATIONS = (("messages", ChatCompletionRequest, chat_completions), ("prompt", CompletionRequest, completions),
                ("input", embeddings.EmbeddingRequest, embeddings.embeddings),
                ("text_1", embeddings.ScoreRequest, embeddings.score),
                ("query", embeddings.RerankRequest, embeddings.rerank))


@router.post("/invocations")
async def invocations(request: Request):
    """The body goes to the route its request type is for (its errors name their fields as there);
    one that is none of them is a 400 listing what is expected."""
    body = await json_body(request)
    for key, model, handler in _INVOCATIONS:
        if isinstance(body, dict) and key in body:
            return await handler(validated(model, body), request)
    raise OpenAIError(400, "Cannot find suitable handler for request. Expected one of: " + ", ".join(
        f"{model.__name__} (with {key})" for key, model, _ in _INVOCATIONS))


def build_app(gen: Generator, model_name: str, api_key: str | None = None, max_queue: int = 1024,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, reasoning_parser: str | None = None,
              tool_call_parser: str | None = None, chat_template: str | None = None,
              trust_request_chat_template: bool = False, enable_sleep_mode: bool = False) -> FastAPI:
    """api_key: required on every route but /health (serve.guard); max_queue: sequences (prompts x n)
    waiting for the engine before 429; max_request_bytes: larger bodies get 413; reasoning_parser,
    tool_call_parser, chat_template, trust_request_chat_template: ServerState's. enable_sleep_mode:
    the sleep / wake_up / is_sleeping and update_weights_from_disk routes (serve.sleep_routes)."""
    state = ServerState(gen, model_name, api_key, max_queue, reasoning_parser, tool_call_parser, chat_template,
                        trust_request_chat_template)
    app = FastAPI(title="jaxinfer", version="0.1.0",
                  description="OpenAI-compatible completions and chat completions on the jaxinfer engine")
    app.state.server = state
    # event handlers, not a lifespan: a lifespan would skip the on_shutdown hooks callers append
    app.router.add_event_handler("startup", state.engine.start)
    app.router.add_event_handler("shutdown", state.engine.stop)
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes)
    for exc_type, handler in _EXCEPTION_HANDLERS:
        app.add_exception_handler(exc_type, handler)
    app.include_router(router)
    app.include_router(lora_router)
    app.include_router(embeddings.router)   # /v1/embeddings, /v1/score, /v1/rerank, /classify, /pooling
    app.include_router(responses_router)
    app.include_router(messages_router)      # Anthropic's /v1/messages
    if enable_sleep_mode:
        from serve.sleep_routes import router as sleep_router
        app.include_router(sleep_router)
    return app
