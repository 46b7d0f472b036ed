"""Embedding models: what a sentence-transformers folder of a decoder model says about its embeddings.

A sentence-transformers (ST) folder (Qwen3-Embedding, gte-Qwen2, E5-Mistral) holds
  modules.json                      the module pipeline: Transformer, Pooling, an optional Normalize
  config_sentence_transformers.json prompts ({name: text}) and default_prompt_name
  1_Pooling/config.json             pooling_mode ("lasttoken" | "mean" | "cls"; or the older
                                    pooling_mode_*_token booleans) and include_prompt
  config.json, *.safetensors        the transformer, often saved as the bare base model (`Qwen3Model`
                                    keys without `model.`, no lm_head); the tokenizer may be only
                                    tokenizer.json
read here into an EmbeddingSpec; sentence-transformers' own semantics (its
sentence_transformer/modules/pooling.py and base/modules/transformer.py): a prompt is prepended to
the text before tokenizing (special tokens by the tokenizer's post-processor), and with
include_prompt=false mean and CLS pooling skip the prompt's tokens (its length without a trailing
special token). A plain causal-LM folder embeds with the `pooling` / `normalize` settings.
Matryoshka: as vLLM decides it, config.json's `matryoshka_dimensions` (the sizes allowed) or
`is_matryoshka` (any size) makes a request's `dimensions` honoured; otherwise it is refused.

Never imports jax.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxinfer.host.pooling import POOLING_METHODS, PoolingState

__all__ = ["EmbeddingError", "EmbeddingSpec", "read_embedding_spec", "score_pairs", "pair_cosines", "cosine"]

# Pooling's pooling_mode names -> ours (the modes our step pools; ST's others are refused by name)
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_LEGACY = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
              "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
              "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
              "pooling_mode_weightedmean_tokens": "weightedmean"}


class EmbeddingError(ValueError):
    """A sentence-transformers folder this engine cannot embed with (the message names the file)."""


@dataclass(frozen=True, kw_only=True)
class EmbeddingSpec:
    """How a model embeds: pooling, normalization, prompts, Matryoshka sizes, and whether it also
    generates (it has an LM head)."""
    pooling: str                                  # "last" | "mean" | "cls"
    normalize: bool
    include_prompt: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None   # None: not Matryoshka; (): any size
    generates: bool = True
    model_path: Path | None = None                # the Transformer module's folder (config.json, weights)

    @property
    def matryoshka(self) -> bool:
        return self.matryoshka_dimensions is not None

    def prompt_text(self, prompt_name: str | None = None, prompt: str | None = None) -> str:
        """The text prepended to every text input (ST's encode: `prompt`, else prompts[prompt_name],
        else the default prompt's)."""
        if prompt is not None:
            return prompt
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            raise ValueError(f"prompt_name {name!r} is not one of this model's prompts {sorted(self.prompts)}")
        return self.prompts[name]

    def check_dimensions(self, dimensions: int | None, hidden: int) -> None:
        """A ValueError unless `dimensions` is None or a size this Matryoshka model allows."""
        if dimensions is None:
            return
        if not self.matryoshka:
            raise ValueError("this model does not support matryoshka representation: `dimensions` cannot be set")
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= hidden:
            raise ValueError(f"dimensions must be an integer in [1, {hidden}], got {dimensions!r}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions {dimensions} is not one of this model's matryoshka dimensions "
                             f"{list(self.matryoshka_dimensions)}")

    def pooling_state(self, num_tokens: int, prompt_tokens: int = 0, dimensions: int | None = None,
                      normalize: bool | None = None) -> PoolingState:
        """The host pooling of one input of num_tokens tokens whose first prompt_tokens are the prompt;
        normalize: L2-normalize or not (vLLM's request field), None: as the model says."""
        skip = 0 if self.include_prompt or self.pooling == "last" else min(prompt_tokens, max(num_tokens - 1, 0))
        return PoolingState(self.pooling, num_tokens, normalize=self.normalize if normalize is None else normalize,
                            skip=skip, dimensions=dimensions)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise EmbeddingError(f"{path}: missing (listed in modules.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EmbeddingError(f"{path} is not valid JSON: {e}") from None


def _st_pooling(path: Path) -> tuple[str, bool]:
    """(our pooling method, include_prompt) from a Pooling module's config.json."""
    cfg = _read_json(path / "config.json")
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _ST_LEGACY.items() if cfg.get(key)]
        mode = modes[0] if len(modes) == 1 else modes
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise EmbeddingError(f"{path / 'config.json'}: pooling mode {mode!r} is not supported "
                             f"(supported: {sorted(_ST_MODES)})")
    return _ST_MODES[mode], bool(cfg.get("include_prompt", True))


def _matryoshka(config: dict) -> tuple[int, ...] | None:
    dims = config.get("matryoshka_dimensions")
    if dims is not None:
        return tuple(int(d) for d in dims)
    return () if config.get("is_matryoshka") else None


def read_embedding_spec(folder: str | Path, pooling: str | None = None, normalize: bool = False,
                        has_lm_head: bool = True) -> EmbeddingSpec | None:
    """The folder's EmbeddingSpec: its ST files' (`pooling`, `normalize=True` override them), or for a
    plain causal-LM folder the `pooling` setting's (None: the folder does not embed).
    has_lm_head: whether the checkpoint holds an LM head (or ties it): else it only embeds."""
    folder = Path(folder)
    if pooling is not None and pooling not in POOLING_METHODS:
        raise ValueError(f"pooling={pooling!r} is not one of {POOLING_METHODS}")
    modules_file = folder / "modules.json"
    if not modules_file.exists():
        if pooling is None:
            return None
        config = _read_json(folder / "config.json") if (folder / "config.json").exists() else {}
        return EmbeddingSpec(pooling=pooling, normalize=normalize, matryoshka_dimensions=_matryoshka(config),
                             generates=has_lm_head, model_path=folder)
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise EmbeddingError(f"{modules_file}: expected a list of modules")
    model_path, st_pooling, st_normalize = None, None, False
    for m in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        sub = folder / m.get("path", "")
        if kind == "Transformer":
            model_path = sub
        elif kind == "Pooling":
            st_pooling = _st_pooling(sub)
        elif kind == "Normalize":
            st_normalize = True
        else:
            raise EmbeddingError(f"{modules_file}: module {m.get('type')!r} is not supported "
                                 "(supported: Transformer, Pooling, Normalize)")
    if model_path is None or st_pooling is None:
        raise EmbeddingError(f"{modules_file}: expected a Transformer and a Pooling module")
    st_cfg_file = folder / "config_sentence_transformers.json"
    st_cfg = _read_json(st_cfg_file) if st_cfg_file.exists() else {}
    prompts = st_cfg.get("prompts") or {}
    default = st_cfg.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise EmbeddingError(f"{st_cfg_file}: default_prompt_name {default!r} is not one of its prompts")
    config = _read_json(model_path / "config.json")
    return EmbeddingSpec(pooling=pooling or st_pooling[0], normalize=normalize or st_normalize,
                         include_prompt=st_pooling[1], prompts=dict(prompts), default_prompt_name=default,
                         matryoshka_dimensions=_matryoshka(config), generates=has_lm_head, model_path=model_path)


def score_pairs(first: list, second: list) -> list[tuple]:
    """vLLM's score pairing of text_1 against text_2: 1:1, 1:N (the one first text against each
    second) or N:N; anything else, or an empty side, is a ValueError naming it."""
    if not first or not second:
        raise ValueError(f"{'text_1' if not first else 'text_2'} must not be empty")
    if len(first) != 1 and len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: the pairs must be 1:1, 1:N or N:N")
    return list(zip(first * len(second) if len(first) == 1 else first, second))


def pair_cosines(vectors, n_first: int) -> list[float]:
    """The score_pairs pairs' cosines from the embeddings of the first texts then the second ones
    (each text embedded once: one first text stands against every second one)."""
    first, second = vectors[:n_first], vectors[n_first:]
    return [cosine(first[0 if n_first == 1 else i], v) for i, v in enumerate(second)]


def cosine(a, b) -> float:
    """torch.nn.CosineSimilarity(dim=0)'s value (eps 1e-8), what vLLM scores embedding pairs by."""
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.dot(a, b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-8))
