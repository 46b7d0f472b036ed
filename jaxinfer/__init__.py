"""jaxinfer: a JAX/XLA inference stack for decoder-only language models.

    from jaxinfer import Generator, SamplingParams

Attributes are imported lazily so that light modules (config, tokenizer, host/) can be used
without importing jax.
"""
from jaxinfer.versions import check_jax_flax

check_jax_flax()   # before anything imports flax: a broken jax / flax pair gets one clear error

from jaxinfer.config import EngineConfig, ModelConfig, SamplingParams, StructuredOutputs
from jaxinfer.host.beam_search import BeamSearchParams

__all__ = ["Generator", "SamplingParams", "BeamSearchParams", "StructuredOutputs", "ModelConfig", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Generator":
        from jaxinfer.generator import Generator
        return Generator
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
