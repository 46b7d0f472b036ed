"""vLLM's LoRA adapter routes: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"}. They need no flag or environment variable (vLLM asks for
VLLM_ALLOW_RUNTIME_LORA_UPDATING). A load that fails (a bad folder, a rank above --max-lora-rank, a
name already loaded, speculative decoding) is a 400 naming the problem and registers nothing;
unloading an unknown name is a 404. Loading runs on a worker thread: it reads the folder and, for
the engine's first adapter, compiles the LoRA steps.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from jaxinfer.lora.adapter import LoraError
from serve.protocol import OpenAIError

router = APIRouter()


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None   # vLLM's optional id; names identify adapters here


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoraAdapterRequest, request: Request):
    state = request.app.state.server
    if not req.lora_name or req.lora_name == state.model_name:
        raise OpenAIError(400, f"lora_name {req.lora_name!r} must be non-empty and differ from the base model's "
                               "name", param="lora_name")
    try:
        await run_in_threadpool(state.gen.load_lora, req.lora_name, req.lora_path)
    except LoraError as e:
        raise OpenAIError(400, str(e), param="lora_path" if "already loaded" not in str(e) else "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoraAdapterRequest, request: Request):
    state = request.app.state.server
    try:
        await run_in_threadpool(state.gen.unload_lora, req.lora_name)
    except ValueError as e:
        raise OpenAIError(404, str(e), type_="not_found_error", param="lora_name", code="model_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
