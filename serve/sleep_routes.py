"""The routes of reinforcement-learning loops and shared accelerators, served with `--enable-sleep-mode`
(none of them exists without it):

- vLLM's `POST /sleep?level=1|2`, `POST /wake_up` (`?tags=weights&tags=kv_cache`, none: both) and
  `GET /is_sleeping` -> {"is_sleeping": bool} (Generator.sleep / wake_up / is_sleeping);
- SGLang's `POST /update_weights_from_disk` {"model_path": ...} -> {"success": bool, "message": str}
  (Generator.update_weights: a folder of the same architecture, read on the server's machine).

Each runs between requests: while some are unfinished the answer is a 409 naming how many (SGLang's
body for its route: {"success": false, "message"}). Requests
sent while the engine sleeps get a 503 (serve.bridge). The work runs on a worker thread (reading a
checkpoint takes seconds), under the engine's lock.
"""
from __future__ import annotations

import logging
from typing import Any

import jax
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.concurrency import run_in_threadpool

from serve.protocol import OpenAIError

router = APIRouter()
log = logging.getLogger(__name__)


async def _run(fn, param: str, *args) -> None:
    """fn(*args) on a worker thread; the Generator's refusals as OpenAI errors: busy (requests
    unfinished) a 409, a bad value (ValueError, naming it) or a model or checkpoint it cannot serve
    so (RuntimeError, CheckpointError, OSError) a 400."""
    from jaxinfer.engine import EngineBusyError
    try:
        await run_in_threadpool(fn, *args)
    except EngineBusyError as e:
        raise OpenAIError(409, str(e), type_="invalid_request_error", code="engine_busy") from None
    except ValueError as e:   # CheckpointError is one
        raise OpenAIError(400, str(e), param=param) from None
    except (RuntimeError, OSError) as e:
        if isinstance(e, jax.errors.JaxRuntimeError):   # the device failed (out of memory): not the request's fault
            raise
        raise OpenAIError(400, str(e)) from None


@router.post("/sleep")
async def sleep(request: Request, level: int = Query(1)):
    await _run(request.app.state.server.gen.sleep, "level", level)
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(None)):
    await _run(request.app.state.server.gen.wake_up, "tags", tags)
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    return {"is_sleeping": request.app.state.server.gen.is_sleeping()}


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's UpdateWeightFromDiskReqInput: the fields that change what happens are honoured or
    refused; bookkeeping ones (weight_version, is_async, torch_empty_cache, token_step, ...) and
    unknown extras are ignored with a logged warning."""
    model_config = ConfigDict(extra="ignore")
    model_path: str

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        """SGLang's bookkeeping fields and unknown extras: ignored with a logged warning, as the
        OpenAI routes ignore theirs (serve.protocol._Body)."""
        if isinstance(data, dict):
            ignored = sorted(set(data) - set(cls.model_fields))
            if ignored:
                log.warning("update_weights_from_disk: ignoring field(s) %s", ignored)
        return data
    load_format: str | None = None      # "auto" and "safetensors" are what this server reads
    abort_all_requests: bool = False    # True: refused (requests are never dropped here: 409 while some run)
    flush_cache: bool = True            # the prefix cache is always emptied (its K/V came from the old weights)
    keep_pause: bool = False


def _failed(status: int, message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest, request: Request):
    """SGLang's answers: {"success", "message"}, a 400 with success false when the update fails."""
    from jaxinfer.engine import EngineBusyError
    if req.load_format not in (None, "auto", "safetensors"):
        return _failed(400, f"load_format {req.load_format!r}: this server reads safetensors folders (auto, safetensors)")
    for name, default in (("abort_all_requests", False), ("flush_cache", True), ("keep_pause", False)):
        if getattr(req, name) != default:
            return _failed(400, f"{name}={getattr(req, name)!r} is not supported: the update runs between requests "
                                "and always empties the prefix cache")
    try:
        await run_in_threadpool(request.app.state.server.gen.update_weights, req.model_path)
    except EngineBusyError as e:
        return _failed(409, str(e))
    except (ValueError, RuntimeError, OSError, TypeError) as e:   # CheckpointError is a ValueError
        if isinstance(e, jax.errors.JaxRuntimeError):
            return _failed(500, f"the device failed while copying the weights ({e}); the engine sleeps with its "
                                "weights discarded: POST /wake_up reads the original checkpoint again")
        return _failed(400, str(e))
    return {"success": True, "message": f"Succeeded to update model weights from {req.model_path}."}
