"""What a speculative engine is built from, checked once when the engine is (engine.Engine): the
draft model or Medusa heads that go with speculative_method, and the targets they work with. Each
error names the setting at fault."""
from __future__ import annotations

from jaxinfer.config import EngineConfig
from jaxinfer.models.decoder import Decoder
from jaxinfer.pipeline import PipelinedDecoder
from jaxinfer.sharding import model_mesh


def check_medusa(model, heads: tuple | None, cfg: EngineConfig) -> tuple | None:
    """Medusa heads go with speculative_method="medusa", an unsharded target, and num_speculative_tokens
    at most their number (the tree is cut to that depth). -> (heads, the tree cut to depth) or None."""
    if cfg.speculative_method == "medusa" and heads is None:
        raise ValueError('speculative_method="medusa" needs Medusa heads (speculative_model=PATH)')
    if heads is None:
        return None
    if cfg.speculative_method != "medusa":
        raise ValueError(f'Medusa heads are only used with speculative_method="medusa", not {cfg.speculative_method!r}')
    if isinstance(model, PipelinedDecoder):   # (tensor parallel: the runner replicates the heads)
        raise ValueError("speculative decoding with Medusa heads is not available with pipeline_parallel > 1")
    mh, tree = heads
    if cfg.num_speculative_tokens > mh.num_heads:
        raise ValueError(f"num_speculative_tokens={cfg.num_speculative_tokens} is more than the {mh.num_heads} Medusa heads")
    return mh, tree.truncated(cfg.num_speculative_tokens)


def check_draft(model, draft: Decoder | None, cfg: EngineConfig) -> None:
    """A draft model goes with speculative_method="draft" and must share the target's vocabulary."""
    if cfg.speculative_method == "draft" and draft is None:
        raise ValueError('speculative_method="draft" needs a draft model (speculative_model=PATH)')
    if draft is None:
        return
    if cfg.speculative_method != "draft":
        raise ValueError(f'a draft model is only used with speculative_method="draft", not {cfg.speculative_method!r}')
    if isinstance(model, PipelinedDecoder) or model_mesh(draft) is not None:
        # (a tensor-parallel target is fine: the runner replicates the draft on its mesh)
        raise ValueError("speculative decoding with a draft model needs a one-stage target (no pipeline_parallel) "
                         "and an unsharded draft")
    if draft.cfg.has_state:   # (its runner keeps KV pages for every layer and no state slots)
        raise ValueError(f"a draft model with state layers ({draft.cfg.architecture}: conv / Gated DeltaNet / "
                         "Mamba-2) is not supported; draft with an attention-only model")
    if draft.cfg.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.cfg.vocab_size} tokens) differs from the "
                         f"target's ({model.cfg.vocab_size}): a draft must share the target's tokenizer")
