"""Sequence-classification checkpoints (HF's `XForSequenceClassification` of a supported decoder
family: reward models, sentiment and intent classifiers, one-label cross-encoder scorers).

transformers' forward is the decoder's final-norm hidden states, `score` (a [num_labels, d] linear
map, no bias) applied to each, and the row of the last non-padding token taken; an unpadded prompt's
is its last token. Here the decoder runs in the engine as an embedding model (prefill-only requests
pooled at the last token, not normalized: jaxinfer/embedding.py) and the head on the host, in
float64 from the float32 pooled state. The probabilities follow vLLM's classify activation
(its get_classification_activation_function, aligned with transformers' loss for the config's
problem_type): "regression" -> the logits as they are; "multi_label_classification" -> sigmoid;
otherwise softmax over the labels, or sigmoid for a single label (a cross-encoder's relevance).
Labels are config.json's id2label, in id order (transformers' LABEL_i where it has none).

A one-label model is a cross-encoder (a reranker): Generator.score and the server's /score and
/rerank score each (query, document) pair by its probability (the sigmoid of the logit, what
sentence-transformers' CrossEncoder.predict returns), the pair tokenized as vLLM tokenizes it:
tokenizer(query, document), the tokenizer's pair template (Tokenizer.encode_pair), or, where
config.json says use_sep_token: false (vLLM's flag, use_pad_token before, for an "LLM as reranker"
checkpoint whose prompt format is written into the texts), the two texts joined into one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Classifier", "read_classifier"]


@dataclass(frozen=True)
class Classifier:
    weight: np.ndarray              # float32 [num_labels, d]: the checkpoint's score.weight
    labels: tuple[str, ...]
    activation: str                 # "softmax" | "sigmoid" | "identity"
    pair_template: bool = True      # config.json's use_sep_token: a pair is tokenizer(a, b), else tokenizer(a + b)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def logits(self, pooled: np.ndarray) -> np.ndarray:
        """[n, d] pooled hidden states -> [n, num_labels] float64 logits."""
        return np.asarray(pooled, np.float64) @ self.weight.astype(np.float64).T

    def probabilities(self, pooled: np.ndarray, activation: bool = True) -> np.ndarray:
        """[n, d] -> [n, num_labels] float32: the activation of the logits (activation False, vLLM's
        use_activation false: the logits themselves, e.g. a reward model's raw score)."""
        z = self.logits(pooled)
        if activation and self.activation == "sigmoid":
            z = 1.0 / (1.0 + np.exp(-z))
        elif activation and self.activation == "softmax":
            z = np.exp(z - z.max(axis=-1, keepdims=True))
            z = z / z.sum(axis=-1, keepdims=True)
        return z.astype(np.float32)

    def check_cross_encoder(self) -> None:
        """A model of several labels is no cross-encoder: ValueError saying so."""
        if self.num_labels != 1:
            raise ValueError(f"this model classifies into {self.num_labels} labels ({', '.join(self.labels)}); "
                             "scoring pairs needs a one-label cross-encoder (or an embedding model)")

    def relevance(self, pooled: np.ndarray, activation: bool = True) -> np.ndarray:
        """[n, d] pooled states of (query, document) pairs -> [n] float32 scores: a one-label
        model's probability (its logit without activation)."""
        self.check_cross_encoder()
        return self.probabilities(pooled, activation)[:, 0]

    def pair_ids(self, tokenizer, query: str, document: str, truncate: int | None = None,
                 side: str = "right") -> list[int]:
        """A (query, document) pair's token ids as vLLM's get_score_prompt makes them; truncate: at
        most that many, as transformers' tokenizer(query, document, truncation=True, max_length=...)
        cuts them (Tokenizer.encode_pair)."""
        if self.pair_template:
            return tokenizer.encode_pair(query, document, truncate=truncate, side=side)
        return tokenizer.encode(query + document, truncate=truncate, side=side)


def read_classifier(folder: str | Path, read_tensor, tokenizer=None) -> Classifier | None:
    """The folder's Classifier when config.json's architecture is a `...ForSequenceClassification`,
    else None. read_tensor(name) -> np.ndarray reads a checkpoint tensor (SafetensorsFolder.get);
    tokenizer (jaxinfer.tokenizer.Tokenizer): the vocabulary a causal LM's head is converted by."""
    config_file = Path(folder) / "config.json"
    if not config_file.exists():
        return None
    config = json.loads(config_file.read_text())
    archs = config.get("architectures") or []
    if not (archs and str(archs[0]).endswith("ForSequenceClassification")):
        return None
    method = _conversion(config, config_file)
    if method is None:
        weight = np.asarray(read_tensor("score.weight"), np.float32)
    else:
        weight = _head_from_tokens(config, method, read_tensor, tokenizer, config_file)
    if weight.ndim != 2:
        raise ValueError(f"{config_file.parent}: score.weight has shape {weight.shape}, expected [num_labels, d]")
    n = weight.shape[0]
    id2label = config.get("id2label") or {}
    if len(id2label) != n:   # a converted head's label count is its tokens', not config.json's default two
        id2label = {}
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))
    problem = config.get("problem_type") or ""
    activation = ("identity" if problem == "regression" else
                  "sigmoid" if problem == "multi_label_classification" or n < 2 else "softmax")
    # vLLM: a checkpoint's own head pairs by the tokenizer's template unless use_sep_token (its older
    # name use_pad_token, which wins where both are set) is false; an "LLM as reranker" (a converted
    # causal LM) joins the texts unless it is true
    flag = config.get("use_pad_token")
    flag = config.get("use_sep_token") if flag is None else flag
    pair_template = method is None if flag is None else flag is True
    return Classifier(weight, labels, activation, pair_template=pair_template)


def _conversion(config: dict, config_file: Path) -> str | None:
    """vLLM's online conversion of a causal LM into a classifier (its hf_overrides): config.json's
    `method` ("from_2_way_softmax" | "no_post_processing") with `classifier_from_token`, or
    `is_original_qwen3_reranker` (Qwen3-Reranker: from_2_way_softmax over ["no", "yes"]); None for a
    checkpoint with its own score head."""
    method = config.get("method")
    tokens = config.get("classifier_from_token")
    if config.get("is_original_qwen3_reranker"):
        if not (isinstance(tokens, list) and len(tokens) == 2):
            raise ValueError(f"{config_file}: is_original_qwen3_reranker needs classifier_from_token, two tokens "
                             "(the false one, then the true one: [\"no\", \"yes\"])")
        method = "from_2_way_softmax"
    if method is None:
        return None
    if method not in ("from_2_way_softmax", "no_post_processing"):
        raise ValueError(f"{config_file}: method {method!r} is not a classifier conversion (from_2_way_softmax, "
                         "no_post_processing)")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"{config_file}: method {method!r} needs classifier_from_token, a list of tokens")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"{config_file}: from_2_way_softmax needs two classifier_from_token entries, got {tokens}")
    return method


def _head_from_tokens(config: dict, method: str, read_tensor, tokenizer, config_file: Path) -> np.ndarray:
    """The score head a causal LM's output rows make (vLLM's load_weights_using_from_2_way_softmax
    and load_weights_no_post_processing): from_2_way_softmax, one row W[true] - W[false], so the
    sigmoid of its logit is the softmax of the two tokens' logits; no_post_processing, the tokens'
    rows as they are. W: lm_head.weight, or the embedding where the model ties them."""
    tokens = config["classifier_from_token"]
    if tokenizer is None:
        raise ValueError(f"{config_file.parent}: classifier_from_token needs the model's tokenizer")
    ids = []
    for t in tokens:
        i = tokenizer.token_to_id(t)
        if i is None:
            raise ValueError(f"{config_file}: classifier_from_token {t!r} is not a token of the model's vocabulary")
        ids.append(i)
    from jaxinfer.models.hf_configs import model_config_from_hf
    from jaxinfer.models.hf_maps import hf_weight_map
    cfg = model_config_from_hf(config)
    if cfg.lm_head_bias:
        raise ValueError(f"{config_file}: classifier_from_token over {cfg.architecture}'s LM head, which has a bias, "
                         "is not supported")
    name = hf_weight_map(cfg)["embed" if cfg.tie_embeddings else "lm_head"][0][0]   # (GPT-NeoX: embed_out)
    w = np.asarray(read_tensor(name), np.float32)
    if method == "from_2_way_softmax":
        return (w[ids[1]].astype(np.float64) - w[ids[0]].astype(np.float64)).astype(np.float32)[None]
    return w[ids]
