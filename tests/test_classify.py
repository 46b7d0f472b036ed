"""Sequence-classification checkpoints (jaxinfer/classify.py, Generator.classify, POST /classify).

Reference: transformers' own LlamaForSequenceClassification on the same checkpoint (its logits at
the last token; softmax / sigmoid by hand in float64, the activation vLLM applies for the config's
problem_type and label count). Tolerances: float32 forwards of a 2-layer model whose logits are
O(1) differ by a few 1e-6; probabilities by less.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxinfer import Generator

TEXTS = ["the lazy dog", "seven wizards write code", "hackers"]


def _classifier(tmp_path, num_labels: int, problem_type: str | None = None):
    import torch
    import transformers as tf
    from tests.hf_models import save_text_model
    path = save_text_model(tmp_path / f"cls{num_labels}")
    cfg = tf.LlamaConfig.from_pretrained(path)
    cfg.num_labels = num_labels
    cfg.id2label = {i: f"class-{i}" for i in range(num_labels)}
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    cfg.problem_type = problem_type
    torch.manual_seed(num_labels)
    model = tf.LlamaForSequenceClassification(cfg).eval()
    (path / "model.safetensors").unlink()
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("num_labels,problem_type", [(3, None), (1, None), (2, "multi_label_classification")])
def test_probabilities_match_transformers(tmp_path, num_labels, problem_type):
    import torch
    path, model = _classifier(tmp_path, num_labels, problem_type)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    g = Generator.from_pretrained(path, dtype="float32", max_model_len=64, max_num_seqs=4, warmup=False)
    ids = [g.tokenizer.encode(t) for t in TEXTS]
    with torch.no_grad():
        ref = np.stack([model(torch.as_tensor([x])).logits[0].double().numpy() for x in ids])   # [n, labels]
    np.testing.assert_allclose(g.classifier.logits(g.embed(ids)), ref, atol=2e-5)
    if num_labels == 1 or problem_type == "multi_label_classification":
        want = 1 / (1 + np.exp(-ref))
    else:
        want = np.exp(ref - ref.max(-1, keepdims=True))
        want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(g.classify(TEXTS), want, atol=1e-5)
    assert g.classifier.labels == tuple(f"class-{i}" for i in range(num_labels))
    with pytest.raises(ValueError, match="generation|embedding model"):   # it has no LM head to generate with
        g.generate("the lazy dog")
    with pytest.raises(ValueError, match="sequence-classification"):
        Generator.from_pretrained(path, dtype="float32", max_model_len=64, pooling="mean", warmup=False)


def test_classify_route(tmp_path):
    """POST /classify (vLLM's shape): each input's probabilities, its label (the likeliest), usage;
    a model that does not classify is a 400 naming the model."""
    from fastapi.testclient import TestClient

    from serve.app import build_app
    path, _ = _classifier(tmp_path, 3)
    g = Generator.from_pretrained(path, dtype="float32", max_model_len=64, max_num_seqs=4, warmup=False)
    with TestClient(build_app(g, "cls")) as client:
        r = client.post("/classify", json={"model": "cls", "input": TEXTS})
        assert r.status_code == 200, r.text
        body = r.json()
        probs = g.classify(TEXTS)
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
        for d, p in zip(body["data"], probs):
            np.testing.assert_allclose(d["probs"], p, atol=1e-6)
            assert d["label"] == f"class-{int(np.argmax(p))}" and d["num_classes"] == 3
        assert body["usage"]["prompt_tokens"] == sum(len(g.tokenizer.encode(t)) for t in TEXTS)
        one = client.post("/classify", json={"model": "cls", "input": "hackers"}).json()
        np.testing.assert_allclose(one["data"][0]["probs"], probs[2], atol=1e-6)
        bad = client.post("/classify", json={"model": "cls", "input": "x", "top_k": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k"
