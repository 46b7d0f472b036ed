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

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from jaxinfer.errors import CheckpointError
from serve.protocol import OpenAIError

router = APIRouter()


def _busy(e: Exception) -> OpenAIError:
    return OpenAIError(409, str(e), type_="invalid_request_error", code="engine_busy")


@router.post("/sleep")
async def sleep(request: Request, level: int = Query(1)):
    if level not in (1, 2):
        raise OpenAIError(400, f"level must be 1 (weights kept in host memory) or 2 (discarded), got {level}",
                          param="level")
    from jaxinfer.engine import EngineBusyError
    try:
        await run_in_threadpool(request.app.state.server.gen.sleep, level)
    except EngineBusyError as e:
        raise _busy(e) from None
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(None)):
    from jaxinfer.weight_update import SLEEP_TAGS
    unknown = [t for t in tags or () if t not in SLEEP_TAGS]
    if unknown:
        raise OpenAIError(400, f"tags {unknown} are not {list(SLEEP_TAGS)}", param="tags")
    await run_in_threadpool(request.app.state.server.gen.wake_up, tags)
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    return {"is_sleeping": request.app.state.server.gen.is_sleeping()}


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's UpdateWeightFromDiskReqInput: the fields that change what happens are honoured or
    refused; bookkeeping ones (weight_version, is_async, torch_empty_cache, token_step, ...) and
    unknown extras are accepted and ignored."""
    model_config = ConfigDict(extra="ignore")
    model_path: str
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
    except (CheckpointError, ValueError, OSError, TypeError) as e:
        return _failed(400, str(e))
    return {"success": True, "message": f"Succeeded to update model weights from {req.model_path}."}
