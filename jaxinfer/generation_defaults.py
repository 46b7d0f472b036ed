"""A model's default sampling parameters, as vLLM takes them (its --generation-config and
--override-generation-config; ModelConfig.get_diff_sampling_param).

The model creator's generation_config.json often recommends sampling settings (Llama 3.1
Instruct: temperature 0.6, top_p 0.9; Qwen3: temperature 0.6, top_p 0.95, top_k 20). vLLM uses
them for every request field a client leaves out, and so does jaxinfer: `auto` (the default)
reads the model folder's generation_config.json, `vllm` the neutral defaults, a folder path that
folder's file; override_generation_config (a JSON object) is merged over what was read. Only
repetition_penalty, temperature, top_k, top_p, min_p and max_new_tokens (as max_tokens) are taken,
each where it is set (not null); do_sample is not read, as vLLM does not. The defaults' max_tokens
fills a request that gives none; a hard cap on every request's max_tokens comes from a folder's
file (generation_config=PATH) or the override's max_new_tokens (max_tokens_cap), as vLLM's
get_max_tokens decides. Never imports jax.
"""
from __future__ import annotations

import json
from pathlib import Path

from jaxinfer.config import SamplingParams, SamplingParamsError
from jaxinfer.errors import CheckpointError

__all__ = ["sampling_defaults", "max_tokens_cap", "SAMPLING_KEYS"]

SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def sampling_defaults(model_path: str | Path, source: str = "auto", override: dict | None = None) -> dict:
    """{SamplingParams field: value} the model's requests default to (max_new_tokens as max_tokens);
    {} where nothing is recommended. A value SamplingParams refuses is a ValueError naming where it
    came from; a malformed file a CheckpointError naming it."""
    config: dict = {}
    where = "override_generation_config"
    if source != "vllm":
        folder = Path(model_path) if source == "auto" else Path(source)
        if source != "auto" and not folder.is_dir():
            raise ValueError(f"generation_config={source!r} is neither auto, vllm nor a folder")
        file = folder / "generation_config.json"
        if file.is_file():
            try:
                config = json.loads(file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{file}: not valid JSON ({e})") from None
            if not isinstance(config, dict):
                raise CheckpointError(f"{file}: not a JSON object")
            where = f"{file} (or override_generation_config)"
    config = {**config, **(override or {})}
    out = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    try:
        SamplingParams(**out)
    except (SamplingParamsError, TypeError) as e:
        raise ValueError(f"{where}: default sampling parameters {out} are not valid: {e}") from None
    return out


def max_tokens_cap(source: str, override: dict | None, defaults: dict) -> int | None:
    """vLLM's override_max_tokens: with generation_config a folder, the defaults' max_tokens; else
    the override's max_new_tokens (None: no cap beyond the context)."""
    if source not in ("auto", "vllm"):
        return defaults.get("max_tokens")
    cap = (override or {}).get("max_new_tokens")
    return int(cap) if cap is not None else None
