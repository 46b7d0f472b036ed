"""What every HTTP request passes before routing or body parsing: the API key and the body-size limit.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware), so streaming responses and client
disconnects pass through untouched. Errors use OpenAI's error JSON (serve.protocol.OpenAIError),
Anthropic's on its routes (error_bytes).

- API key: with a key set, every route except OPEN_PATHS needs `Authorization: Bearer KEY`
  (scheme case-insensitive) or `x-api-key: KEY` (Anthropic's SDKs), compared in constant time. /health
  (and SageMaker's /ping) stay open so that load balancers and orchestrators can probe liveness
  without the key, as in vLLM and llama.cpp.
- Body size: a declared Content-Length above the limit gets a 413 before anything is read; a
  chunked body is counted as it arrives and refused with a 413 once it passes the limit.
"""
from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.protocol import OpenAIError

OPEN_PATHS = frozenset({"/health", "/ping"})   # /ping: SageMaker's health check (serve/app.py)
DEFAULT_MAX_REQUEST_BYTES = 4 << 20   # 4 MiB: ~1M tokens of text, far beyond any context we serve


# Anthropic's error types by status (its Messages API routes answer in its shape)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 529: "overloaded_error"}


def error_bytes(e: OpenAIError, path: str = "") -> bytes:
    """The error's JSON: OpenAI's shape, or Anthropic's on its routes (/v1/messages...)."""
    body = e.body()
    if path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(e.status, "api_error"),
                                           "message": e.message}}
    # ensure_ascii: messages quote user input, which may hold lone surrogates UTF-8 cannot encode
    return json.dumps(body, ensure_ascii=True).encode("ascii")


async def send_error(send: Send, e: OpenAIError, path: str = "") -> None:
    body = error_bytes(e, path)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                            "(--max-request-bytes)", code="request_too_large")


class RequestGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int):
        self.app, self.max_request_bytes = app, max_request_bytes
        self.api_key = api_key.encode() if api_key else None

    def authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
            if name == b"x-api-key":       # what Anthropic's SDKs send
                return hmac.compare_digest(value.strip(), self.api_key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not self.authorized(scope):
            await send_error(send, OpenAIError(401, "missing or invalid API key (Authorization: Bearer ..., or "
                                               "x-api-key)", type_="authentication_error", code="invalid_api_key"),
                             scope["path"])
            return
        limit = self.max_request_bytes
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await send_error(send, too_large(limit) if declared.isdigit() else
                             OpenAIError(400, "invalid Content-Length header"), scope["path"])
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI re-raises HTTPException from body reading; serve.app renders it
                    raise HTTPException(413, too_large(limit).message)
            return message

        await self.app(scope, counted_receive, send)
