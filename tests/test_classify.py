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
    import torch
    path, model = _classifier(tmp_path, 3)
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
        # vLLM's use_activation false (and its older names): the logits, transformers' own
        ids = [g.tokenizer.encode(t) for t in TEXTS]
        with torch.no_grad():
            ref = np.stack([model(torch.as_tensor([x])).logits[0].double().numpy() for x in ids])
        for field in ("use_activation", "activation", "softmax"):
            raw = client.post("/classify", json={"input": TEXTS, field: False}).json()
            np.testing.assert_allclose([d["probs"] for d in raw["data"]], ref, atol=2e-5)
        np.testing.assert_allclose(g.classify(TEXTS, use_activation=False), ref, atol=2e-5)
        # truncate_prompt_tokens 2 (vLLM's; from the right for a pooling model): BOS and the first
        # piece, the logits transformers gives those two tokens
        with torch.no_grad():
            cut = np.stack([model(torch.as_tensor([x[:2]])).logits[0].double().numpy() for x in ids])
        r = client.post("/classify", json={"input": TEXTS, "truncate_prompt_tokens": 2, "use_activation": False})
        assert r.json()["usage"]["prompt_tokens"] == sum(min(len(x), 2) for x in ids) and max(map(len, ids)) > 2
        np.testing.assert_allclose([d["probs"] for d in r.json()["data"]], cut, atol=2e-5)
        np.testing.assert_allclose(g.classify(TEXTS, use_activation=False, truncate_prompt_tokens=2), cut, atol=2e-5)
        # vLLM's /pooling: a classifier's probabilities (its default task), logits without activation
        pooled = client.post("/pooling", json={"input": TEXTS}).json()
        assert [d["object"] for d in pooled["data"]] == ["pooling"] * 3 and pooled["id"].startswith("pool")
        np.testing.assert_allclose([d["data"] for d in pooled["data"]], probs, atol=1e-6)
        raw = client.post("/pooling", json={"input": TEXTS, "task": "classify", "use_activation": False}).json()
        np.testing.assert_allclose([d["data"] for d in raw["data"]], ref, atol=2e-5)
        for body, param in (({"input": "x", "task": "embed"}, "task"), ({"input": "x", "task": "token_classify"}, "task"),
                            ({"input": "x", "dimensions": 8}, "dimensions")):
            r = client.post("/pooling", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------------------ cross-encoders

QUERY = "the quick brown fox"
DOCS = ["the lazy dog", "jumps over the dog", "brown fox jumps", "quick quick fox"]


def _cross_encoder(root, num_labels: int = 1):
    """A one-label LlamaForSequenceClassification with a byte-level BPE tokenizer.json whose
    post-processor has a pair template (BERT/RoBERTa-style separators, as rerankers ship them)."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([QUERY, *DOCS, "the quick brown fox jumps over the lazy dog"] * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B:1 </s>:1", special_tokens=[("<s>", 1), ("</s>", 2)])
    folder = root / f"cross{num_labels}"
    cfg = tf.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, num_labels=num_labels)
    torch.manual_seed(5)
    model = tf.LlamaForSequenceClassification(cfg).eval()
    with torch.no_grad():   # a score head large enough that the pairs' probabilities differ visibly
        model.score.weight.mul_(20)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder, model


def test_cross_encoder_scores_match_sentence_transformers(tmp_path):
    """A one-label classifier scores (query, document) pairs as sentence-transformers' CrossEncoder
    does (tokenizer(query, document) through the pair template, the sigmoid of the logit), through
    Generator.score, POST /score (1:N and N:N) and POST /rerank (best first, top_n)."""
    import transformers as tf
    from fastapi.testclient import TestClient
    from sentence_transformers import CrossEncoder

    from serve.app import build_app
    import torch
    folder, model = _cross_encoder(tmp_path)
    ref = np.asarray(CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in DOCS]), np.float64)
    assert ref.shape == (len(DOCS),) and np.ptp(ref) > 0.05       # distinct scores: the order is a real check
    g = Generator.from_pretrained(folder, dtype="float32", max_model_len=64, max_num_seqs=4, warmup=False)
    hf_tok = tf.AutoTokenizer.from_pretrained(folder)
    for d in DOCS:   # the pair template's ids, separators included
        assert g.classifier.pair_ids(g.tokenizer, QUERY, d) == hf_tok(QUERY, d)["input_ids"]
    # probabilities of float32 forwards whose O(1-10) logits differ by ~1e-5 (sigmoid' <= 1/4)
    np.testing.assert_allclose(g.score(QUERY, DOCS), ref, atol=1e-5)
    np.testing.assert_allclose(g.score([QUERY] * 2, DOCS[:2]), ref[:2], atol=1e-5)
    with TestClient(build_app(g, "rr")) as client:
        body = client.post("/score", json={"model": "rr", "text_1": QUERY, "text_2": DOCS}).json()
        np.testing.assert_allclose([d["score"] for d in body["data"]], ref, atol=1e-5)
        assert body["usage"]["prompt_tokens"] == sum(len(hf_tok(QUERY, d)["input_ids"]) for d in DOCS)
        nn = client.post("/v1/score", json={"text_1": [QUERY, DOCS[0]], "text_2": [DOCS[1], DOCS[2]]}).json()
        want = CrossEncoder(str(folder), device="cpu").predict([(QUERY, DOCS[1]), (DOCS[0], DOCS[2])])
        np.testing.assert_allclose([d["score"] for d in nn["data"]], want, atol=1e-5)
        rr = client.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3}).json()
        assert [r["index"] for r in rr["results"]] == list(np.argsort(-ref)[:3])
        np.testing.assert_allclose([r["relevance_score"] for r in rr["results"]], np.sort(ref)[::-1][:3], atol=1e-5)
        bad = client.post("/score", json={"text_1": [QUERY] * 2, "text_2": DOCS})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
        # use_activation false: the cross-encoder's logits, transformers' own on the pair's ids
        with torch.no_grad():
            logit = np.array([model(torch.as_tensor([hf_tok(QUERY, d)["input_ids"]])).logits[0, 0].item() for d in DOCS])
        raw = client.post("/rerank", json={"query": QUERY, "documents": DOCS, "use_activation": False}).json()
        np.testing.assert_allclose([r["relevance_score"] for r in raw["results"]], np.sort(logit)[::-1], atol=2e-5)
        np.testing.assert_allclose(g.score(QUERY, DOCS, use_activation=False), logit, atol=2e-5)
        # truncate_prompt_tokens: each pair cut as CrossEncoder(max_length=N) cuts it (transformers'
        # longest_first: the longer text first), separators kept
        n = 9
        cut = CrossEncoder(str(folder), device="cpu", max_length=n).predict([(QUERY, d) for d in DOCS])
        assert np.abs(cut - ref).max() > 1e-3
        np.testing.assert_allclose(g.score(QUERY, DOCS, truncate_prompt_tokens=n), cut, atol=1e-5)
        rr = client.post("/rerank", json={"query": QUERY, "documents": DOCS, "truncate_prompt_tokens": n}).json()
        np.testing.assert_allclose([r["relevance_score"] for r in rr["results"]], np.sort(cut)[::-1], atol=1e-5)
        assert rr["usage"]["prompt_tokens"] == sum(len(hf_tok(QUERY, d, truncation=True, max_length=n)["input_ids"])
                                                   for d in DOCS)
        bad = client.post("/score", json={"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
    # the batch script's score and rerank lines (vLLM's run-batch urls)
    from serve.batch import run_batch
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "s", "method": "POST", "url": "/v1/score",
                               "body": {"text_1": QUERY, "text_2": DOCS}}) + "\n" +
                   json.dumps({"custom_id": "r", "method": "POST", "url": "/v2/rerank",
                               "body": {"query": QUERY, "documents": [{"text": d} for d in DOCS]}}) + "\n")
    run_batch(g, src, out, "rr", progress=False)
    recs = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
    np.testing.assert_allclose([d["score"] for d in recs["s"]["data"]], ref, atol=1e-5)
    assert [r["index"] for r in recs["r"]["results"]] == list(np.argsort(-ref))


def test_cross_encoder_without_pair_template_and_several_labels(tmp_path):
    """config.json's use_pad_token / use_sep_token: false (vLLM's "LLM as reranker" flag) scores tokenizer(query +
    document), one input; a classifier of several labels is no cross-encoder: a ValueError and a
    400 naming `model`, where vLLM fails the request too."""
    import torch
    import transformers as tf
    from fastapi.testclient import TestClient

    from serve.app import build_app
    folder, model = _cross_encoder(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "use_pad_token": False}))
    hf_tok = tf.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = np.array([model(torch.as_tensor([hf_tok(QUERY + d)["input_ids"]])).logits[0, 0].item() for d in DOCS])
    g = Generator.from_pretrained(folder, dtype="float32", max_model_len=64, max_num_seqs=4, warmup=False)
    np.testing.assert_allclose(g.score(QUERY, DOCS), 1 / (1 + np.exp(-logits)), atol=1e-5)
    # vLLM's newer name for the flag, use_sep_token; use_pad_token wins where both are set
    from jaxinfer.classify import read_classifier
    from jaxinfer.weights import SafetensorsFolder
    for extra, joined in (({"use_sep_token": False}, True), ({"use_sep_token": False, "use_pad_token": True}, False),
                          ({}, False)):
        (folder / "config.json").write_text(json.dumps({**cfg, **extra}))
        assert read_classifier(folder, SafetensorsFolder(folder).get).pair_template is not joined, extra

    folder3, _ = _cross_encoder(tmp_path, num_labels=3)
    g3 = Generator.from_pretrained(folder3, dtype="float32", max_model_len=64, max_num_seqs=4, warmup=False)
    with pytest.raises(ValueError, match="3 labels"):
        g3.score(QUERY, DOCS)
    with TestClient(build_app(g3, "c3")) as client:
        for route, body in (("/score", {"text_1": QUERY, "text_2": DOCS}), ("/rerank", {"query": QUERY, "documents": DOCS})):
            r = client.post(route, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "3 labels" in r.text, r.text


# ------------------------------------------------------------------------------ a causal LM as a reranker

RERANK_PREFIX = "judge: yes or no\nquery: "


def _causal_reranker(root, tie: bool = False):
    """A tiny Qwen3ForCausalLM whose byte-level BPE vocabulary holds "yes" and "no" (as
    Qwen3-Reranker's does), saved as a causal LM: vLLM's hf_overrides make it a classifier."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["yes", "no", RERANK_PREFIX, QUERY, *DOCS] * 4, trainer)
    assert tok.token_to_id("yes") is not None and tok.token_to_id("no") is not None
    folder = root / f"causal-reranker{'-tied' if tie else ''}"
    cfg = tf.Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         tie_word_embeddings=tie, eos_token_id=0)
    torch.manual_seed(7)
    model = tf.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():   # final states large enough that the pairs' scores differ visibly
        model.model.norm.weight.mul_(12)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder, model, tok


@pytest.mark.parametrize("tie", [False, True])
def test_hf_overrides_make_a_causal_lm_a_reranker(tmp_path, monkeypatch, tie):
    """vLLM's hf_overrides for Qwen3-Reranker ({"architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}) score a pair as its
    model card computes it with transformers: the last token's logits of "no" and "yes", softmaxed,
    P(yes); the texts joined (no pair template: vLLM's "LLM as reranker"). bge-reranker-v2-gemma's
    ("classifier_from_token": ["yes"], "method": "no_post_processing"): the sigmoid of the yes logit."""
    import torch
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "cache"))     # where the overridden config goes
    folder, model, tok = _causal_reranker(tmp_path, tie)
    docs = [d + "\nanswer:" for d in DOCS]
    with torch.no_grad():
        last = np.stack([model(torch.as_tensor([tok.encode(RERANK_PREFIX + QUERY + d).ids])).logits[0, -1].double().numpy()
                         for d in docs])
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    p_yes = np.exp(last[:, yes] - np.logaddexp(last[:, yes], last[:, no]))        # the model card's P(yes)
    assert np.ptp(p_yes) > 0.05
    qwen3 = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
             "is_original_qwen3_reranker": True}
    g = Generator.from_pretrained(folder, dtype="float32", max_model_len=64, max_num_seqs=4, warmup=False,
                                  hf_overrides=qwen3)
    assert g.classifier.num_labels == 1 and not g.classifier.pair_template
    # float32 forwards: logits within ~1e-5 of each other, probabilities (slope <= 1/4) closer still
    np.testing.assert_allclose(g.score(RERANK_PREFIX + QUERY, docs), p_yes, atol=1e-5)
    g.close()
    bge = json.dumps({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["yes"],
                      "method": "no_post_processing"})      # the CLI's JSON text
    g = Generator.from_pretrained(folder, dtype="float32", max_model_len=64, max_num_seqs=4, warmup=False,
                                  hf_overrides=bge)
    np.testing.assert_allclose(g.score(RERANK_PREFIX + QUERY, docs), 1 / (1 + np.exp(-last[:, yes])), atol=1e-5)
    g.close()
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]  # untouched
    assert len(list((tmp_path / "cache" / "hf-overrides").iterdir())) == 2    # one folder per merged config


def test_hf_overrides_refusals_and_flags(tmp_path, monkeypatch):
    from jaxinfer.cli import build_parser
    from jaxinfer.config.flags import engine_kwargs
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "cache"))
    folder, _, _ = _causal_reranker(tmp_path)
    over = '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], ' \
           '"is_original_qwen3_reranker": true}'
    for flag in ("--hf-overrides", "--hf_overrides"):   # vLLM's spellings
        args = build_parser().parse_args(["serve", flag, over])
        assert json.loads(engine_kwargs(args)["hf_overrides"]) == json.loads(over)
    kw = dict(dtype="float32", max_model_len=64, warmup=False)
    with pytest.raises(ValueError, match="not a token of the model's vocabulary"):
        Generator.from_pretrained(folder, hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                                        "classifier_from_token": ["nope", "yes"],
                                                        "is_original_qwen3_reranker": True}, **kw)
    with pytest.raises(ValueError, match="needs classifier_from_token"):
        Generator.from_pretrained(folder, hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                                        "is_original_qwen3_reranker": True}, **kw)
    with pytest.raises(ValueError, match="must be a JSON object"):
        Generator.from_pretrained(folder, hf_overrides="[1, 2]", **kw)
    with pytest.raises(ValueError, match="not valid JSON"):
        Generator.from_pretrained(folder, hf_overrides="{architectures", **kw)
