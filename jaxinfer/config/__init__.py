"""Configuration, one module per concern; every name is importable from jaxinfer.config.

  model.py     ModelConfig (the architecture; every supported HF family maps onto its fields) and
               RopeScaling; ConfigError
  sampling.py  SamplingParams (one request's decoding knobs) and StructuredOutputs
  engine.py    EngineConfig (the engine's settings as the user gave them, each field's default and
               help written once) and the values each setting takes (*_CHOICES)
  resolve.py   resolve_config: EngineConfig + model -> ResolvedConfig (every "auto" and None
               decided once; what every layer below the engine reads), the KV pool's sizing
               (PoolInputs, size_pool, check_pool_fits)
  flags.py     the CLI's engine flags derived from EngineConfig's fields

All are frozen, keyword-only dataclasses. Nothing here imports jax.
"""
from jaxinfer.config.engine import (ATTENTION_CHOICES, BATCHING_CHOICES, DEFAULT_SPECULATIVE_MAX_BATCH,
                                    DEFAULT_SPECULATIVE_MAX_BATCH_ACCELERATOR, DTYPE_CHOICES, KV_DTYPE_CHOICES,
                                    MAX_SPECULATIVE_TOKENS, MIN_TOKEN_BUDGET, QUANTIZE_CHOICES, SCHEDULING_POLICIES,
                                    SPECULATIVE_METHODS, EngineConfig, settings)
from jaxinfer.config.model import MAX_POSITIONS, ConfigError, ModelConfig, RopeScaling, _is_int, _is_number
from jaxinfer.config.resolve import (PoolInputs, ResolvedConfig, check_pool_fits, pallas_unsupported, resolve_config,
                                     resolve_dtype_name, resolve_impl_name, size_pool)
from jaxinfer.config.sampling import (MAX_LOGIT_BIAS, MAX_PROMPT_LOGPROBS, MAX_STOP_LENGTH, MAX_STOP_STRINGS, SamplingParams,
                                      SamplingParamsError, StructuredOutputs)

__all__ = [
    "ATTENTION_CHOICES", "BATCHING_CHOICES", "DEFAULT_SPECULATIVE_MAX_BATCH",
    "DEFAULT_SPECULATIVE_MAX_BATCH_ACCELERATOR", "DTYPE_CHOICES", "KV_DTYPE_CHOICES", "MAX_SPECULATIVE_TOKENS",
    "MIN_TOKEN_BUDGET", "QUANTIZE_CHOICES", "SCHEDULING_POLICIES", "SPECULATIVE_METHODS", "EngineConfig", "settings",
    "MAX_POSITIONS",
    "ConfigError", "ModelConfig", "RopeScaling", "PoolInputs", "ResolvedConfig", "check_pool_fits",
    "pallas_unsupported", "resolve_config", "resolve_dtype_name", "resolve_impl_name", "size_pool",
    "MAX_LOGIT_BIAS", "MAX_PROMPT_LOGPROBS", "MAX_STOP_LENGTH", "MAX_STOP_STRINGS", "SamplingParams", "SamplingParamsError",
    "StructuredOutputs",
]
