"""POST /v1/embeddings (OpenAI's shape), POST /v1/score, /v1/rerank and /classify (vLLM's).

/v1/embeddings: `input` is a string, a list of strings, a list of token ids or a list of token-id
lists; text is tokenized as gen.embed tokenizes it (the model's default prompt first, special tokens
by the tokenizer's post-processor), token ids are used as given. `encoding_format` "float" (lists of
numbers) or "base64" (each vector's bytes, by default little-endian float32: what the openai client
sends by default and decodes), and vLLM's binary forms: `embed_dtype` (float32, float16, bfloat16,
fp8_e4m3, fp8_e5m2: the float32 vector rounded to nearest, as torch's .to() rounds) and `endianness`
(native, big, little) of those bytes, and `encoding_format` "bytes" (the vectors' bytes one after
another as the body, application/octet-stream, with a `metadata` header: JSON {id, created, model,
data: [{index, embed_dtype, endianness, start, end, shape}], usage}) or "bytes_only" (the body
alone); `dimensions` only for a model that declares Matryoshka sizes (the vector is
cut, then normalized where the model normalizes: vLLM's order); usage.prompt_tokens counts every
input's tokens, special tokens included. An input longer than max_model_len is a 400 naming its
index; a field this endpoint does not know is a 400 naming it.

/v1/score (also /score): `text_1` (one string or a list) against `text_2` (a list, or one string):
1:1, 1:N or N:N pairs, as {"data": [{"index", "object": "score", "score"}], "usage"}, each scored
as vLLM scores it for the model loaded: a one-label sequence-classification checkpoint (a
cross-encoder reranker) reads the pair as one input and scores its probability
(jaxinfer/classify.py; a classifier of several labels is a 400 naming `model`); an embedding model
scores the cosine similarity of the two texts' embeddings.

/v1/rerank (also /rerank, /v2/rerank; vLLM's shape, which Jina's and Cohere's clients read): `query`
against `documents` (strings, or {"text"} objects as Jina and Cohere v1 send them), each scored as
/v1/score scores it, as {"id", "model", "usage", "results": [{"index", "document": {"text"},
"relevance_score"}]}, best first; `top_n` > 0 keeps that many (0, the default, keeps all);
`return_documents` false (Jina's and Cohere's field) leaves each result's document out.

Every pooling body takes vLLM's `truncate_prompt_tokens` (-1: max_model_len) and `truncation_side`
(default "right" for these routes, as vLLM's pooling tokenizers): each input, or a cross-encoder's
pair, cut as transformers' tokenizer(..., truncation=True, max_length=N) cuts it (Generator.embed).

Every input is one prefill-only engine request (Engine.add_request(pooling=...)), submitted all or
nothing through the same bridge as generation, so embeddings share the engine's steps with it.
"""
from __future__ import annotations

import base64
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, Literal

import ml_dtypes
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, model_validator
from starlette.concurrency import run_in_threadpool

from jaxinfer.embedding import pair_cosines, score_pairs
from jaxinfer.engine import EMBEDDING_PARAMS
from jaxinfer.errors import FieldError
from serve.protocol import OpenAIError, _Body, _refuse, find_invalid_text, new_id, now, response_id
from serve.stream import respond

router = APIRouter()


class _StrictBody(_Body):
    """A body whose unknown fields are refused (400 naming them), not ignored."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict) and find_invalid_text(data) is None:   # (_Body refuses that text by name)
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise _refuse(unknown[0], f"unknown field(s) {', '.join(map(repr, unknown))} "
                                          f"(this endpoint takes {', '.join(sorted(cls.model_fields))})")
        return data


class _PoolingFields(_StrictBody):
    """vLLM's fields of every pooling request: truncation (each input cut to at most
    truncate_prompt_tokens tokens (-1: max_model_len), special tokens included, from the right
    (keep the start: vLLM's default for pooling models) or, with truncation_side "left", from the
    left; a pair is cut as transformers cuts a pair: Generator.embed, Generator.score), priority
    (lower runs first under --scheduling-policy priority; other than 0 refused under fcfs) and
    request_id (the response's id is "<prefix>-<request_id>", an X-Request-Id header winning, as
    for chat: protocol.response_id)."""
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: int = 0
    request_id: str | None = Field(default=None, min_length=1, max_length=256)

    def cut(self) -> dict:
        return {"truncate_prompt_tokens": self.truncate_prompt_tokens, "truncation_side": self.truncation_side}


class _TextInputs(_PoolingFields):
    """vLLM's add_special_tokens of the single-text pooling requests (embeddings, classify, pooling)."""
    add_special_tokens: bool = True

    def cut(self) -> dict:
        return {**super().cut(), "add_special_tokens": self.add_special_tokens}


# vLLM's embed_dtype names -> the numpy dtype of each element's bytes (ml_dtypes for the 16- and 8-bit
# floats numpy lacks): what vLLM's tensor2binary writes after torch's .to(dtype)
EMBED_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                "bfloat16": np.dtype(ml_dtypes.bfloat16), "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
                "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}


class _VectorEncoding(_StrictBody):
    """How a pooled vector is sent (vLLM's fields): "float" (a list of numbers), "base64" (its bytes),
    "bytes" / "bytes_only" (the response body is the vectors' bytes: _bytes_response); the bytes are
    embed_dtype's in endianness ("native": this server's byte order)."""
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"

    def binary(self, v: np.ndarray) -> bytes:
        """One vector's bytes: float32 rounded to embed_dtype (to nearest even; e4m3, which has no
        infinity, saturating at +-448 as torch's conversion does), in endianness."""
        a = np.asarray(v, np.float32)
        if self.embed_dtype == "fp8_e4m3":
            a = np.clip(a, -448.0, 448.0)
        with np.errstate(over="ignore"):   # past float16's range: inf, as torch converts it
            a = a.astype(EMBED_DTYPES[self.embed_dtype])
        if self.endianness not in ("native", sys.byteorder):
            a = a.view(f"u{a.itemsize}").byteswap()
        return a.tobytes()

    def vector(self, v: np.ndarray):
        if self.encoding_format == "float":
            return [float(x) for x in v]
        return base64.b64encode(self.binary(v)).decode("ascii")


class EmbeddingRequest(_TextInputs, _VectorEncoding):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    dimensions: int | None = None
    normalize: bool | None = None    # vLLM's: L2-normalize or not (None: as the model says)
    user: str | None = None          # OpenAI's end-user id: accepted, not used


class _ActivationFields(_PoolingFields):
    """vLLM's classifier switches: use_activation false returns a classifier's logits, not its
    probabilities (a reward model's raw score); `activation` and `softmax` are its older names."""
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    def given_activation(self) -> bool | None:
        """vLLM's get_use_activation: softmax, else activation, else use_activation (None: none given)."""
        return next((v for v in (self.softmax, self.activation, self.use_activation) if v is not None), None)

    def wants_activation(self) -> bool:
        """The activation asked for, default true."""
        v = self.given_activation()
        return True if v is None else v


class ScoreRequest(_ActivationFields):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None


class ClassifyRequest(_ActivationFields, _TextInputs):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None


class RerankRequest(_ActivationFields):
    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]
    top_n: int = 0
    return_documents: bool = True
    user: str | None = None


class PoolingRequest(_ActivationFields, _TextInputs, _VectorEncoding):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    task: str | None = None          # "embed" | "classify"; None: the model's own
    dimensions: int | None = None
    normalize: bool | None = None    # the embed task's (EmbeddingRequest's)
    user: str | None = None


def _inputs(inp) -> list:
    """The request's inputs: each a string or a token-id list."""
    if isinstance(inp, str):
        return [inp]
    if not inp:
        raise OpenAIError(400, "input must not be empty", param="input")
    if all(isinstance(x, int) for x in inp):
        return [list(inp)]
    return list(inp)


def _encode(state, inputs: list, dimensions: int | None, cut: dict | None = None, normalize: bool | None = None
            ) -> tuple[list[list[int]], list]:
    """(token ids per input, their PoolingStates), or a 400 naming what is wrong; cut: the body's
    truncation and special-token fields (_PoolingFields.cut); normalize: the body's (None: the model's)."""
    gen = state.gen
    if gen.embedding is None:
        raise OpenAIError(400, f"the model '{state.model_name}' does not serve embeddings (load a "
                               "sentence-transformers folder, or start the server with --pooling)", param="model")
    if any(isinstance(x, str) for x in inputs) and gen.tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer: send inputs as lists of token ids", param="input")
    try:
        gen.embedding.check_dimensions(dimensions, gen.model_cfg.d_model)
    except ValueError as e:
        raise OpenAIError(400, str(e), param="dimensions") from None
    if any(isinstance(x, str) and not x for x in inputs) or any(isinstance(x, list) and not x for x in inputs):
        raise OpenAIError(400, "an input is empty", param="input")
    try:
        encoded = gen.embedding_inputs(inputs, **(cut or {}))
    except ValueError as e:
        raise OpenAIError(400, str(e), param=e.field if isinstance(e, FieldError) else "input") from None
    return ([ids for ids, _ in encoded],
            [gen.embedding.pooling_state(len(ids), n, dimensions, normalize) for ids, n in encoded])


async def _embed(state, request: Request, inputs: list, dimensions: int | None = None, lora: str | None = None,
                 body: _PoolingFields | None = None, normalize: bool | None = None) -> tuple[list[np.ndarray], int]:
    """Every input's embedding, in order, and the tokens they held; lora: the adapter `model` named
    (check_model), None for the base model; body: the request (its truncation, special tokens and
    priority)."""
    cut = body.cut() if body is not None else None
    ids, poolings = await run_in_threadpool(_encode, state, inputs, dimensions, cut, normalize)
    return await _embed_encoded(state, request, ids, poolings, lora, body.priority if body is not None else 0)


async def _embed_encoded(state, request: Request, ids: list[list[int]], poolings: list, lora: str | None,
                         priority: int = 0) -> tuple[list[np.ndarray], int]:
    try:
        sub = state.engine.submit(ids, EMBEDDING_PARAMS, poolings=poolings, lora=lora, priority=priority)
    except OpenAIError as e:
        if e.param in ("prompt", None):
            e.param = "input"
        raise
    out = await respond(state.engine, sub, request, lambda groups: [g[-1].embedding for g in groups])
    if not isinstance(out, list):   # the client hung up (a Response: 499)
        return out, 0
    return out, sum(len(x) for x in ids)


def _bytes_response(req: _VectorEncoding, rid: str, model: str, vectors: list[np.ndarray], n_tokens: int
                    ) -> Response:
    """vLLM's "bytes" / "bytes_only" response: the vectors' bytes (req.binary) one after another;
    "bytes" adds the `metadata` header naming each vector's byte range and shape."""
    parts = [req.binary(v) for v in vectors]
    headers = None
    if req.encoding_format == "bytes":
        items, start = [], 0
        for i, (b, v) in enumerate(zip(parts, vectors)):
            items.append({"index": i, "embed_dtype": req.embed_dtype, "endianness": req.endianness,
                          "start": start, "end": start + len(b), "shape": list(np.shape(v))})
            start += len(b)
        headers = {"metadata": json.dumps({"id": rid, "created": now(), "model": model, "data": items,
                                           "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})}
    return Response(content=b"".join(parts), media_type="application/octet-stream", headers=headers)


def encode_embedding_inputs(state, req: EmbeddingRequest) -> tuple[list[list[int]], list]:
    """An embeddings body's inputs as (token ids, PoolingStates): the route's and the batch script's."""
    return _encode(state, _inputs(req.input), req.dimensions, req.cut(), req.normalize)


def embeddings_body(req: EmbeddingRequest, model: str, vectors: list[np.ndarray], n_tokens: int,
                    rid: str | None = None) -> dict:
    """OpenAI's embeddings body, with vLLM's id ("embd-...") and created."""
    return {"id": rid or new_id("embd"), "object": "list", "created": now(), "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": req.vector(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, request: Request):
    state = request.app.state.server
    lora = state.check_model(req.model)
    vectors, n_tokens = await _embed(state, request, _inputs(req.input), req.dimensions, lora, req, req.normalize)
    if not isinstance(vectors, list):
        return vectors
    rid = response_id("embd", request.headers, req.request_id)
    if req.encoding_format in ("bytes", "bytes_only"):
        return _bytes_response(req, rid, lora or state.model_name, vectors, n_tokens)
    return embeddings_body(req, lora or state.model_name, vectors, n_tokens, rid)


@dataclass
class ScorePlan:
    """What one /v1/score or /v1/rerank body needs embedded (token ids, PoolingStates) and how the
    pooled vectors, in that order, make its response body: the route's and the batch script's."""
    ids: list[list[int]]
    poolings: list
    body: Callable[..., dict]     # (vectors, model name, tokens read, response id or None: a new one) -> body
    prefix: str                   # the response id's prefix: "score" or "rerank"


def _pair_plan(state, first: list[str], second: list[str], activation: bool = True, cut: dict | None = None
               ) -> tuple[list[list[int]], list, Callable]:
    """The (first, second) pairs' inputs (1:1, 1:N or N:N) and vectors -> scores: a one-label
    classifier (a cross-encoder) reads each pair as one input (Classifier.pair_ids) and scores its
    probability; an embedding model embeds each text once and scores the cosine similarity. cut:
    the body's truncation fields (a cross-encoder's pair cut as a pair, else each text alone)."""
    try:
        pairs = score_pairs(first, second)
    except ValueError as e:
        raise OpenAIError(400, str(e), param="text_1" if str(e).startswith("text_1 must") else "text_2") from None
    gen = state.gen
    head = gen.classifier
    if head is None:
        ids, poolings = _encode(state, first + second, None, cut)
        return ids, poolings, lambda v, n=len(first): pair_cosines(v, n)
    try:
        pair_ids = gen.cross_encoder_inputs(pairs, **(cut or {}))
    except ValueError as e:
        raise OpenAIError(400, str(e), param=e.field if isinstance(e, FieldError) else "model") from None
    ids, poolings = _encode(state, pair_ids, None)
    return ids, poolings, lambda v: [float(x) for x in head.relevance(np.stack(v), activation)]


def score_plan(state, req: ScoreRequest) -> ScorePlan:
    first = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
    second = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
    ids, poolings, scores_of = _pair_plan(state, first, second, req.wants_activation(), req.cut())

    def body(vectors, model: str, n_tokens: int, rid: str | None = None) -> dict:
        return {"id": rid or new_id("score"), "object": "list", "created": now(), "model": model,
                "data": [{"index": i, "object": "score", "score": x} for i, x in enumerate(scores_of(vectors))],
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0}}
    return ScorePlan(ids, poolings, body, "score")


def rerank_plan(state, req: RerankRequest) -> ScorePlan:
    docs = []
    for i, d in enumerate(req.documents):
        if isinstance(d, dict) and (set(d) != {"text"} or not isinstance(d["text"], str)):
            raise OpenAIError(400, f"documents[{i}] must be a string or an object {{\"text\": string}}",
                              param="documents")
        docs.append(d if isinstance(d, str) else d["text"])
    if not docs:
        raise OpenAIError(400, "documents must not be empty", param="documents")
    if req.top_n < 0:
        raise OpenAIError(400, f"top_n must be 0 (all) or more, got {req.top_n}", param="top_n")
    ids, poolings, scores_of = _pair_plan(state, [req.query], docs, req.wants_activation(), req.cut())

    def body(vectors, model: str, n_tokens: int, rid: str | None = None) -> dict:
        scores = scores_of(vectors)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n or None]
        return {"id": rid or new_id("rerank"), "model": model,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
                "results": [{"index": i, "relevance_score": scores[i],
                             **({"document": {"text": docs[i]}} if req.return_documents else {})} for i in order]}
    return ScorePlan(ids, poolings, body, "rerank")


async def _run_plan(state, request: Request, plan_of, req):
    lora = state.check_model(req.model)
    plan = await run_in_threadpool(plan_of, state, req)
    vectors, n_tokens = await _embed_encoded(state, request, plan.ids, plan.poolings, lora, req.priority)
    if not isinstance(vectors, list):
        return vectors
    return plan.body(vectors, lora or state.model_name, n_tokens, response_id(plan.prefix, request.headers, req.request_id))


@router.post("/v1/score")
@router.post("/score")
async def score(req: ScoreRequest, request: Request):
    return await _run_plan(request.app.state.server, request, score_plan, req)


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(req: RerankRequest, request: Request):
    return await _run_plan(request.app.state.server, request, rerank_plan, req)


@router.post("/classify")
@router.post("/v1/classify")
async def classify(req: ClassifyRequest, request: Request):
    """vLLM's classification API: each input's label probabilities (jaxinfer/classify.py) and its
    likeliest label, {"id", "object": "list", "created", "model", "data": [{"index", "label",
    "probs", "num_classes"}], "usage"}."""
    state = request.app.state.server
    lora = state.check_model(req.model)
    head = state.gen.classifier
    if head is None:
        raise OpenAIError(400, f"the model '{state.model_name}' does not classify (load a "
                               "...ForSequenceClassification checkpoint)", param="model")
    vectors, n_tokens = await _embed(state, request, _inputs(req.input), lora=lora, body=req)
    if not isinstance(vectors, list):
        return vectors
    probs = head.probabilities(np.stack(vectors), req.wants_activation())
    return {"id": response_id("classify", request.headers, req.request_id), "object": "list", "created": now(),
            "model": lora or state.model_name,
            "data": [{"index": i, "label": head.labels[int(np.argmax(p))], "probs": [float(x) for x in p],
                      "num_classes": head.num_labels} for i, p in enumerate(probs)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0}}


@router.post("/pooling")
async def pooling(req: PoolingRequest, request: Request):
    """vLLM's generic pooling API: each input's pooled output, {"id", "object": "list", "created",
    "model", "data": [{"index", "object": "pooling", "data"}], "usage"}: a classifier's label
    probabilities (task "classify", its default; logits with use_activation false: a reward
    model's score), an embedding model's vector as /v1/embeddings makes it (task "embed"); each in
    /v1/embeddings' encodings (float, base64, bytes, bytes_only; embed_dtype, endianness).
    Per-token tasks (token_embed, token_classify) are refused, naming `task`."""
    state = request.app.state.server
    lora = state.check_model(req.model)
    head = state.gen.classifier
    task = req.task or ("classify" if head is not None else "embed")
    if task not in ("embed", "classify") or (task == "classify") != (head is not None):
        can = "classify" if head is not None else "embed"
        raise OpenAIError(400, f"task {task!r} is not available: this model's pooling task is {can!r}", param="task")
    if task == "classify" and req.dimensions is not None:
        raise OpenAIError(400, "dimensions applies to the embed task", param="dimensions")
    normalize = req.normalize
    if task == "embed" and req.given_activation() is not None:   # vLLM: an embedding's activation is its L2 norm
        if normalize is not None and normalize != req.given_activation():
            raise OpenAIError(400, "use_activation and normalize disagree (for the embed task both say whether "
                                   "to L2-normalize)", param="use_activation")
        normalize = req.given_activation()
    if task == "classify" and req.normalize is not None:
        raise OpenAIError(400, "normalize applies to the embed task", param="normalize")
    vectors, n_tokens = await _embed(state, request, _inputs(req.input), req.dimensions, lora, req, normalize)
    if not isinstance(vectors, list):
        return vectors
    if task == "classify":
        vectors = list(head.probabilities(np.stack(vectors), req.wants_activation()))
    rid = response_id("pool", request.headers, req.request_id)
    if req.encoding_format in ("bytes", "bytes_only"):
        return _bytes_response(req, rid, lora or state.model_name, vectors, n_tokens)
    return {"id": rid, "object": "list", "created": now(), "model": lora or state.model_name,
            "data": [{"index": i, "object": "pooling", "data": req.vector(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0}}
