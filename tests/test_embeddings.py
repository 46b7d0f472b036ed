"""Embeddings (issue 54): sentence-transformers folders of decoder models through gen.embed and the
engine, against sentence-transformers itself on the same weights.

Two tiny random folders, each as sentence-transformers would ship it:
  qwen3: the bare Qwen3Model (keys without `model.`, no lm_head, tie_word_embeddings false), last-token
         pooling + Normalize, a tokenizer.json only (its post-processor appends EOS), a "query" prompt
  llama: LlamaForCausalLM with its LM head, mean pooling, no Normalize, BOS + EOS by the post-processor
sentence-transformers reads a copy of each folder with a tokenizer_config.json beside (its
AutoTokenizer needs the class and the pad token); jaxinfer reads the folder as shipped.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.engine import RequestError
from tests.precision import assert_rel_close, dot_chain_rtol

torch = pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

# different lengths, non-ASCII included; the longest runs past the 16-token budget (chunked prefill)
TEXTS = ["the quick brown fox", "héllo wörld", "你好 世界", "a",
         "the lazy dog jumps over the quick brown fox again and again, ñandú 你好"]
ENGINE = dict(dtype="float32", max_num_batched_tokens=16, token_buckets=[16], max_num_seqs=8, block_size=8,
              num_blocks=64, max_model_len=64)
QUERY_PROMPT = "Instruct: find the text\nQuery: "


def _tokenizer(bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "héllo wörld 你好 世界 ñandú",
                             QUERY_PROMPT] * 4, trainer)
    single = "<s> $A </s>" if bos else "$A </s>"
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 1), ("</s>", 2)])
    return tok


def _st_folder(root: Path, family: str) -> tuple[Path, Path]:
    """(the folder as shipped, a copy sentence-transformers loads)."""
    torch.manual_seed(0 if family == "qwen3" else 1)
    tok = _tokenizer(bos=family == "llama")
    common = dict(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    folder = root / family
    if family == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=8, tie_word_embeddings=False, **common)
        model = transformers.Qwen3Model(cfg)            # the bare base model: no `model.` prefix, no lm_head
        pooling, normalize = "lasttoken", True
    else:
        cfg = transformers.LlamaConfig(tie_word_embeddings=False, **common)
        model = transformers.LlamaForCausalLM(cfg)
        pooling, normalize = "mean", False
    with torch.no_grad():   # random norms, so that a norm left out or misplaced shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode": pooling, "include_prompt": True}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
         "similarity_fn_name": "cosine"}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    ref = root / f"{family}-st"
    shutil.copytree(folder, ref)
    (ref / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>",
         "model_max_length": 128}))
    return folder, ref


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    return {family: _st_folder(root, family) for family in ("qwen3", "llama")}


@pytest.fixture(scope="module")
def reference(folders):
    """sentence-transformers' embeddings of TEXTS (and with the query prompt) per family."""
    out = {}
    for family, (_, ref) in folders.items():
        model = st.SentenceTransformer(str(ref), device="cpu")
        out[family] = (model.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS)),
                       model.encode(TEXTS, prompt_name="query", convert_to_numpy=True, batch_size=len(TEXTS)),
                       model)
    return out


@pytest.fixture(scope="module")
def gens(folders):
    from jaxinfer import Generator
    return {family: Generator.from_pretrained(folder, **ENGINE) for family, (folder, _) in folders.items()}


def assert_close_vectors(got: np.ndarray, want: np.ndarray) -> None:
    """The issue's bar, per vector: cosine >= 0.99999 and max abs difference <= 1e-4."""
    assert got.shape == want.shape and got.dtype == np.float32
    for i, (a, b) in enumerate(zip(got, want)):
        cos = float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
        assert cos >= 0.99999, (i, cos)
        assert float(np.max(np.abs(a - b))) <= 1e-4, (i, float(np.max(np.abs(a - b))))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_embed_matches_sentence_transformers(gens, reference, family):
    gen, (want, want_query, model) = gens[family], reference[family]
    assert_close_vectors(gen.embed(TEXTS), want)
    assert_close_vectors(gen.embed(TEXTS, prompt_name="query"), want_query)
    # token ids as given: the ids sentence-transformers' tokenizer made (special tokens included)
    ids = [model.tokenizer(t)["input_ids"] for t in TEXTS]
    assert ids == [gen.tokenizer.encode(t) for t in TEXTS]
    assert_close_vectors(gen.embed(ids), want)
    if family == "qwen3":   # Normalize listed: unit vectors; llama's mean is not normalized
        np.testing.assert_allclose(np.linalg.norm(want, axis=1), 1.0, rtol=1e-6)
    else:
        assert not np.allclose(np.linalg.norm(want, axis=1), 1.0, rtol=1e-2)
    assert gen.stats()["kv_blocks_used"] == 0   # no KV kept (only what the prefix cache holds, unreferenced)
    # Generator.score (vLLM's LLM.score) of an embedding model: the cosine of sentence-transformers'
    # embeddings, 1:N and N:N (cosines of unit-scale vectors within float32 rounding of them)
    cos = lambda a, b: float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))  # noqa: E731
    np.testing.assert_allclose(gen.score(TEXTS[0], TEXTS[1:3]), [cos(want[0], want[1]), cos(want[0], want[2])],
                               atol=1e-5)
    np.testing.assert_allclose(gen.score(TEXTS[:2], TEXTS[2:4]), [cos(want[0], want[2]), cos(want[1], want[3])],
                               atol=1e-5)


# Batch invariance holds up to the order of float32 sums: a neighbour moves where an input's prompt
# is cut into chunks (the token budget is shared) and so which positions one matmul or attention
# holds and how the chunks' pooled sums add up. Each layer's path: q/k/v (K = d_model), attention
# (head_dim, then at most max_model_len keys), o (d_model), gate/up (d_model), down (ffn); then
# the mean over at most max_model_len positions.
LAYER_PATH = (32, 8, 64, 32, 32, 64)
INVARIANCE_RTOL = dot_chain_rtol(*LAYER_PATH, *LAYER_PATH, 64)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_batch_invariance(gens, family):
    """An input's embedding does not depend on its neighbours (alone, or among others, in any order)."""
    gen = gens[family]
    together = gen.embed(TEXTS)
    for i, text in enumerate(TEXTS):
        assert_rel_close(gen.embed([text])[0], together[i], INVARIANCE_RTOL, f"{family} input {i} alone")
    assert_rel_close(gen.embed(TEXTS[::-1])[::-1], together, INVARIANCE_RTOL, f"{family} reversed")
    padded = gen.embed([TEXTS[4]] * 3 + TEXTS)[3:]                 # behind three long neighbours
    assert_rel_close(padded, together, INVARIANCE_RTOL, f"{family} behind others")


def test_embedding_and_generation_share_steps(gens, reference):
    """Embedding requests submitted beside generation requests: both come out as they do alone."""
    from jaxinfer import SamplingParams
    from jaxinfer.client import Completion
    gen = gens["llama"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = gen.generate(["the quick", "héllo"], params)
    spec = gen.embedding
    rids = gen.client.submit([gen.tokenizer.encode("the quick"), gen.tokenizer.encode("héllo")], params)
    ids = [gen.tokenizer.encode(t) for t in TEXTS]
    embed_rids = gen.client.submit(ids, params, poolings=[spec.pooling_state(len(x)) for x in ids])
    done: dict[str, Completion] = {}
    while gen.client.has_unfinished():
        for d in gen.client.step():
            done.setdefault(d.request_id, Completion()).add(d)
    assert [done[r].token_ids for r in rids] == [o.token_ids for o in alone]
    assert_close_vectors(np.stack([done[r].embedding for r in embed_rids]), reference["llama"][0])
    for r in rids + embed_rids:
        gen.client.release(r, abort=False)
    assert gen.stats()["kv_blocks_used"] == 0


def test_embedding_only_model_refuses_generation_and_long_inputs(gens):
    from jaxinfer import SamplingParams
    gen = gens["qwen3"]
    assert not gen.embedding.generates and gens["llama"].embedding.generates
    with pytest.raises(RequestError, match="embedding model"):
        gen.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="input 1: .*maximum context length is 64 tokens.*65 tokens"):
        gen.embed([[5] * 64, [5] * 65])
    assert gen.embed([[5] * 64]).shape == (1, 32)   # a full context is fine: nothing is generated
    with pytest.raises(ValueError, match="matryoshka"):
        gen.embed(["a"], dimensions=8)
    assert gen.stats()["kv_blocks_used"] == 0


def test_pooling_settings_make_a_causal_lm_embed(folders, reference):
    """--pooling / --normalize on a plain causal-LM folder (no sentence-transformers files)."""
    from jaxinfer import Generator
    folder, _ = folders["llama"]
    plain = folder.parent / "llama-plain"
    shutil.copytree(folder, plain, ignore=shutil.ignore_patterns("modules.json", "1_Pooling", "config_sentence*"))
    gen = Generator.from_pretrained(plain, pooling="mean", normalize=True, **ENGINE)
    want = reference["llama"][0]
    assert_close_vectors(gen.embed(TEXTS), want / np.linalg.norm(want, axis=1, keepdims=True))
    assert gen.generate("the")[0].token_ids


# --------------------------------------------------------------------------- the HTTP server
class InProcessServer:
    """serve.app's app over the module's Generator, served by uvicorn on a thread (the same HTTP
    routes `jaxinfer serve` runs, without starting a process and compiling its engine again)."""

    def __init__(self, gen):
        import socket
        import threading
        import time
        import uvicorn
        from serve.app import build_app
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(gen, "tiny"), host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def servers(gens):
    """A server per folder: qwen3 only embeds, llama embeds and generates."""
    out = {family: InProcessServer(gen) for family, gen in gens.items()}
    yield out
    for s in out.values():
        s.close()


def _client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_openai_client_embeddings_match_sentence_transformers(servers, reference, family):
    client = _client(servers[family])
    want, _, model = reference[family]
    n_tokens = sum(len(model.tokenizer(t)["input_ids"]) for t in TEXTS)
    got = client.embeddings.create(model="tiny", input=TEXTS)          # the client's default: base64
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    assert_close_vectors(np.array([d.embedding for d in got.data], np.float32), want)
    assert got.usage.prompt_tokens == n_tokens == got.usage.total_tokens
    got = client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float")
    assert_close_vectors(np.array([got.data[0].embedding], np.float32), want[1:2])
    ids = [model.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    got = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert_close_vectors(np.array([d.embedding for d in got.data], np.float32), want[:2])


def test_pooling_route_embeds_as_sentence_transformers(servers, reference):
    """vLLM's POST /pooling on an embedding model (its task "embed"): sentence-transformers'
    vectors, float or base64; the classify task is refused, naming `task`."""
    import base64

    import httpx
    want = reference["qwen3"][0]
    url = servers["qwen3"].url
    r = httpx.post(f"{url}/pooling", json={"model": "tiny", "input": TEXTS[:3]}, timeout=120)
    assert r.status_code == 200, r.text
    assert_close_vectors(np.array([d["data"] for d in r.json()["data"]], np.float32), want[:3])
    r = httpx.post(f"{url}/pooling", json={"input": TEXTS[3], "task": "embed", "encoding_format": "base64"}, timeout=120)
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["data"]), "<f4")
    assert_close_vectors(vec[None].astype(np.float32), want[3:4])
    r = httpx.post(f"{url}/pooling", json={"input": "x", "task": "classify"}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"


def test_score_is_the_cosine_of_embeddings(servers, reference):
    import httpx
    want = reference["qwen3"][0]
    cos = lambda a, b: float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))  # noqa: E731
    r = httpx.post(f"{servers['qwen3'].url}/v1/score", json={"model": "tiny", "text_1": TEXTS[0], "text_2": TEXTS[1:]},
                   timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    np.testing.assert_allclose([d["score"] for d in body["data"]], [cos(want[0], w) for w in want[1:]], atol=1e-5)
    r = httpx.post(f"{servers['qwen3'].url}/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[2:4]}, timeout=120)
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]],
                               [cos(want[0], want[2]), cos(want[1], want[3])], atol=1e-5)
    r = httpx.post(f"{servers['qwen3'].url}/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[2:5]}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"


def test_rerank_orders_documents_by_their_cosine_to_the_query(servers, reference):
    """/v1/rerank (and /rerank, /v2/rerank): the documents by sentence-transformers' cosine to the
    query, best first, cut to top_n; documents as strings or {"text"} objects; return_documents
    false leaves the text out; usage counts the query's and documents' tokens."""
    import httpx
    want, _, model = reference["qwen3"]
    cos = [float(np.dot(want[0], w) / (np.linalg.norm(want[0]) * np.linalg.norm(w))) for w in want[1:]]
    best = [int(i) for i in np.argsort(-np.array(cos), kind="stable")]
    assert len(set(np.round(cos, 4))) == len(cos)       # the order is decided well above float error
    url = servers["qwen3"].url
    r = httpx.post(f"{url}/v1/rerank", json={"model": "tiny", "query": TEXTS[0], "documents": TEXTS[1:]}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["index"] for x in body["results"]] == best
    np.testing.assert_allclose([x["relevance_score"] for x in body["results"]], [cos[i] for i in best], atol=1e-5)
    assert [x["document"]["text"] for x in body["results"]] == [TEXTS[1 + i] for i in best]
    assert body["usage"]["total_tokens"] == sum(len(model.tokenizer(t)["input_ids"]) for t in TEXTS)
    for route in ("/rerank", "/v2/rerank"):
        r = httpx.post(f"{url}{route}", json={"query": TEXTS[0], "documents": [{"text": t} for t in TEXTS[1:]],
                                              "top_n": 2, "return_documents": False}, timeout=120)
        assert [x["index"] for x in r.json()["results"]] == best[:2], r.text
        assert all("document" not in x for x in r.json()["results"])
    for body, param in (({"query": "a", "documents": []}, "documents"),
                        ({"query": "a", "documents": [{"txt": "b"}]}, "documents"),
                        ({"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
                        ({"query": "a", "documents": ["b"], "max_chunks_per_doc": 2}, "max_chunks_per_doc")):
        r = httpx.post(f"{url}/v1/rerank", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_batch_script_embeds_as_sentence_transformers(gens, reference, tmp_path):
    """`jaxinfer batch` lines with url /v1/embeddings (vLLM's run-batch takes them): the vectors
    sentence-transformers makes, base64 or float, token-id inputs as given; a bad body is its own
    error line; a generation line on this embedding-only model is refused on its line."""
    import base64

    from serve.batch import run_batch
    want, _, model = reference["qwen3"]
    lines = [{"custom_id": "a", "url": "/v1/embeddings", "body": {"model": "tiny", "input": TEXTS[:3]}},
             {"custom_id": "b", "url": "/v1/embeddings",
              "body": {"input": model.tokenizer(TEXTS[3])["input_ids"], "encoding_format": "base64"}},
             {"custom_id": "c", "url": "/v1/embeddings", "body": {"input": "x", "dimensions": 8}},
             {"custom_id": "d", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 2}},
             {"custom_id": "e", "url": "/v1/score", "body": {"text_1": TEXTS[0], "text_2": TEXTS[1:3]}},
             {"custom_id": "f", "url": "/rerank", "body": {"query": TEXTS[0], "documents": TEXTS[1:4], "top_n": 2}},
             {"custom_id": "g", "url": "/v1/score", "body": {"text_1": TEXTS[:2], "text_2": TEXTS[1:4]}},
             {"custom_id": "h", "url": "/v1/embeddings", "body": {"input": "x", "encoding_format": "bytes"}},
             {"custom_id": "i", "url": "/v1/embeddings", "body": {"input": "x", "request_id": "r-7"}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"method": "POST", **x}) + "\n" for x in lines))
    run_batch(gens["qwen3"], src, out, "tiny", progress=False)
    recs = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    body = recs["a"]["response"]["body"]
    assert_close_vectors(np.array([d["embedding"] for d in body["data"]], np.float32), want[:3])
    assert body["usage"]["prompt_tokens"] == sum(len(model.tokenizer(t)["input_ids"]) for t in TEXTS[:3])
    vec = np.frombuffer(base64.b64decode(recs["b"]["response"]["body"]["data"][0]["embedding"]), "<f4")
    assert_close_vectors(vec[None].astype(np.float32), want[3:4])
    assert recs["c"]["error"] is not None and "dimensions" in recs["c"]["error"]["message"]
    assert recs["d"]["error"] is not None and recs["a"]["error"] is None
    # score and rerank lines (vLLM's run-batch takes them too): sentence-transformers' cosines
    cos = [float(np.dot(want[0], w) / (np.linalg.norm(want[0]) * np.linalg.norm(w))) for w in want[1:4]]
    np.testing.assert_allclose([d["score"] for d in recs["e"]["response"]["body"]["data"]], cos[:2], atol=1e-5)
    ranked = recs["f"]["response"]["body"]["results"]
    assert [r["index"] for r in ranked] == [int(i) for i in np.argsort(-np.array(cos))[:2]]
    np.testing.assert_allclose([r["relevance_score"] for r in ranked], sorted(cos, reverse=True)[:2], atol=1e-5)
    assert recs["g"]["error"] is not None and "1:1, 1:N or N:N" in recs["g"]["error"]["message"]
    assert recs["h"]["response"]["status_code"] == 400 and "'bytes'" in recs["h"]["error"]["message"]
    assert recs["i"]["response"]["body"]["id"] == recs["i"]["response"]["request_id"] == "embd-r-7"


def _vllm_bytes(vector: list[float], embed_dtype: str, endianness: str) -> bytes:
    """vLLM's tensor2binary, by torch: the float32 vector .to(embed_dtype), viewed as its bytes (16-bit
    floats as float16, fp8 as uint8: numpy lacks their types), byte-swapped unless `endianness` is
    native or the machine's."""
    import sys

    import torch
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[embed_dtype]
    view = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.float16,
            "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8}[embed_dtype]
    a = torch.tensor(np.asarray(vector, np.float32)).to(dtype).flatten().contiguous().view(view).numpy()
    if endianness != "native" and endianness != sys.byteorder:
        a = a.byteswap()
    return a.tobytes()


def test_embed_dtype_endianness_and_bytes_as_vllm(servers):
    """vLLM's binary encodings of a vector: base64 of its bytes in embed_dtype (float32 .. fp8_e5m2,
    rounded as torch's .to() rounds) and endianness, the same bytes as torch makes them from the float
    response's values; "bytes" returns them as the body with vLLM's `metadata` header (byte ranges,
    shapes, usage), "bytes_only" the body alone; /pooling takes the same fields."""
    import base64

    import httpx
    url = servers["qwen3"].url
    post = lambda route, **body: httpx.post(f"{url}{route}", json={"input": TEXTS[:2], **body}, timeout=120)  # noqa: E731
    floats = post("/v1/embeddings").json()
    vectors = [d["embedding"] for d in floats["data"]]
    for dt, end in (("float32", "native"), ("float16", "little"), ("bfloat16", "big"), ("fp8_e4m3", "little"),
                    ("fp8_e5m2", "big"), ("float32", "big")):
        r = post("/v1/embeddings", encoding_format="base64", embed_dtype=dt, endianness=end)
        assert r.status_code == 200, r.text
        got = [base64.b64decode(d["embedding"]) for d in r.json()["data"]]
        assert got == [_vllm_bytes(v, dt, end) for v in vectors], (dt, end)
    r = post("/v1/embeddings", encoding_format="bytes", embed_dtype="bfloat16", endianness="big")
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    meta = json.loads(r.headers["metadata"])
    want = [_vllm_bytes(v, "bfloat16", "big") for v in vectors]
    assert r.content == b"".join(want)
    d = len(vectors[0])
    assert meta["data"] == [{"index": i, "embed_dtype": "bfloat16", "endianness": "big", "start": 2 * d * i,
                             "end": 2 * d * (i + 1), "shape": [d]} for i in range(2)]
    assert meta["usage"] == floats["usage"] and meta["model"] == "tiny"
    r = post("/v1/embeddings", encoding_format="bytes_only", embed_dtype="fp8_e4m3")
    assert r.content == b"".join(_vllm_bytes(v, "fp8_e4m3", "native") for v in vectors)
    assert "metadata" not in r.headers
    r = post("/pooling", encoding_format="bytes", embed_dtype="float16")
    assert r.content == b"".join(_vllm_bytes(v, "float16", "native") for v in vectors)
    assert json.loads(r.headers["metadata"])["data"][1]["start"] == 2 * d
    r = post("/v1/embeddings", encoding_format="base64", embed_dtype="int8")
    assert r.status_code == 400 and "embed_dtype" in r.text
    # values past a type's range (a classifier's logits on /pooling, an unnormalized vector): e4m3 has no
    # infinity and torch saturates it at 448; e5m2 and the 16-bit floats overflow to inf as torch does
    from serve.embeddings import EmbeddingRequest
    wide = [500.0, -1e9, float("inf"), 70000.0, 1.0, -3.5e-3]
    for dt in ("fp8_e4m3", "fp8_e5m2", "float16", "bfloat16"):
        req = EmbeddingRequest(input="x", encoding_format="base64", embed_dtype=dt, endianness="little")
        assert req.binary(np.asarray(wide, np.float32)) == _vllm_bytes(wide, dt, "little"), dt


def test_pooling_bodies_take_vllms_request_id(servers):
    """vLLM's request_id on every pooling body: the response's id is "<prefix>-<request_id>" (embd,
    pool, score, rerank), an X-Request-Id header winning, a new id without either."""
    import httpx
    url = servers["qwen3"].url
    bodies = {"/v1/embeddings": ("embd", {"input": "x"}), "/pooling": ("pool", {"input": "x"}),
              "/v1/score": ("score", {"text_1": "x", "text_2": "y"}),
              "/v1/rerank": ("rerank", {"query": "x", "documents": ["y"]})}
    for route, (prefix, body) in bodies.items():
        r = httpx.post(f"{url}{route}", json={**body, "request_id": "abc-1"}, timeout=120)
        assert r.status_code == 200 and r.json()["id"] == f"{prefix}-abc-1", (route, r.text)
        r = httpx.post(f"{url}{route}", json={**body, "request_id": "abc-1"}, headers={"X-Request-Id": "hdr"},
                       timeout=120)
        assert r.json()["id"] == f"{prefix}-hdr"
        rid = httpx.post(f"{url}{route}", json=body, timeout=120).json()["id"]
        assert rid.startswith(f"{prefix}-") and len(rid) > len(prefix) + 8
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "x", "request_id": ""}, timeout=120)
    assert r.status_code == 400 and "request_id" in r.text


def test_embeddings_and_scores_run_the_adapter_model_names(folders, tmp_path):
    """/v1/embeddings and /v1/score with `model` naming a loaded LoRA adapter embed with it, as PEFT's
    adapted model does (mean of the last hidden states), and answer under its name (they returned
    the base model's vectors: 3.7 away)."""
    import torch
    import transformers
    from fastapi.testclient import TestClient
    from jaxinfer import Generator
    from serve.app import build_app
    from tests.hf_models import seeded_peft
    folder, _ = folders["llama"]
    pm = seeded_peft(transformers.LlamaForCausalLM.from_pretrained(folder),
                     dict(r=4, lora_alpha=8, target_modules="all-linear"), 3, 0.3)
    pm.save_pretrained(tmp_path / "ad")
    gen = Generator.from_pretrained(folder, **ENGINE, lora_modules={"ad": str(tmp_path / "ad")}, max_lora_rank=8,
                                    warmup=False)
    ids = [gen.tokenizer.encode(t) for t in TEXTS[:3]]
    with torch.no_grad():
        want = np.stack([pm(torch.tensor([x]), output_hidden_states=True).hidden_states[-1][0].mean(0).numpy()
                         for x in ids])
    with TestClient(build_app(gen, "tiny")) as http:
        r = http.post("/v1/embeddings", json={"model": "ad", "input": ids})
        assert r.status_code == 200 and r.json()["model"] == "ad"
        assert_close_vectors(np.array([d["embedding"] for d in r.json()["data"]], np.float32), want)
        r = http.post("/v1/score", json={"model": "ad", "text_1": TEXTS[0], "text_2": TEXTS[1:3]})
        cos = lambda a, b: float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))  # noqa: E731
        assert r.status_code == 200 and r.json()["model"] == "ad"
        np.testing.assert_allclose([d["score"] for d in r.json()["data"]], [cos(want[0], want[i]) for i in (1, 2)],
                                   atol=1e-5)


def test_server_refusals(servers):
    import httpx
    openai = pytest.importorskip("openai")
    qwen, llama = _client(servers["qwen3"]), _client(servers["llama"])
    with pytest.raises(openai.BadRequestError, match="embedding model"):      # embedding-only: 400, no crash
        qwen.completions.create(model="tiny", prompt="the quick", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        qwen.embeddings.create(model="tiny", input="a", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 64") as e:
        qwen.embeddings.create(model="tiny", input=[[5] * 3, [5] * 65])
    assert e.value.body["param"] == "input"
    r = httpx.post(f"{servers['qwen3'].url}/v1/embeddings", json={"input": "a", "truncate": True, "x": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate" and "'x'" in r.json()["error"]["message"]
    for route in ("/v1/embeddings", "/v1/score", "/v1/rerank"):     # a lone-surrogate key: 400 (it was a 500)
        r = httpx.post(f"{servers['qwen3'].url}{route}", content=b'{"input": "hi", "\\ud800": 1}',
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and "Unicode" in r.json()["error"]["message"], (route, r.text)
    assert httpx.get(f"{servers['qwen3'].url}/health", timeout=10).status_code == 200
    # the llama folder serves both
    assert llama.completions.create(model="tiny", prompt="the quick", max_tokens=3).choices[0].text is not None
    assert len(llama.embeddings.create(model="tiny", input="the quick").data[0].embedding) == 32


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_truncate_prompt_tokens_cuts_as_sentence_transformers_max_seq_length(gens, servers, reference, family):
    """vLLM's truncate_prompt_tokens on the pooling routes: each text cut to N tokens from the right,
    special tokens kept (vLLM's default for pooling models) -- sentence-transformers' own cut at
    max_seq_length N; truncation_side "left": the ids transformers' tokenizer keeps from the left;
    token ids: their first N; -1: max_model_len (nothing cut here); usage counts the kept tokens.
    0, more than max_model_len, fewer than the special tokens, or another side: a 400 naming it."""
    import httpx
    _, _, model = reference[family]
    tok, n = model.tokenizer, 5
    saved = model.max_seq_length
    model.max_seq_length = n
    try:
        want = model.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    finally:
        model.max_seq_length = saved
    assert np.abs(want - reference[family][0]).max() > 0.05      # the cut changes the vectors
    assert_close_vectors(gens[family].embed(TEXTS, truncate_prompt_tokens=n), want)
    url = servers[family].url
    post = lambda route, body: httpx.post(f"{url}{route}", json=body, timeout=120)  # noqa: E731
    r = post("/v1/embeddings", {"input": TEXTS, "encoding_format": "float", "truncate_prompt_tokens": n})
    assert r.status_code == 200, r.text
    assert_close_vectors(np.array([d["embedding"] for d in r.json()["data"]], np.float32), want)
    assert r.json()["usage"]["prompt_tokens"] == sum(len(tok(t, truncation=True, max_length=n)["input_ids"])
                                                     for t in TEXTS)
    r = post("/pooling", {"input": TEXTS[:2], "truncate_prompt_tokens": n})
    assert_close_vectors(np.array([d["data"] for d in r.json()["data"]], np.float32), want[:2])
    cos = lambda a, b: float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))  # noqa: E731
    r = post("/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:3], "truncate_prompt_tokens": n})
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], [cos(want[0], w) for w in want[1:3]], atol=1e-5)
    tok.truncation_side = "left"
    try:
        left = [tok(t, truncation=True, max_length=n)["input_ids"] for t in TEXTS]
    finally:
        tok.truncation_side = "right"
    r = post("/v1/embeddings", {"input": TEXTS, "encoding_format": "float", "truncate_prompt_tokens": n,
                                "truncation_side": "left"})
    assert_close_vectors(np.array([d["embedding"] for d in r.json()["data"]], np.float32), gens[family].embed(left))
    ids = tok(TEXTS[4])["input_ids"]
    r = post("/v1/embeddings", {"input": ids, "encoding_format": "float", "truncate_prompt_tokens": 3})
    assert r.json()["usage"]["prompt_tokens"] == 3
    assert_close_vectors(np.array([r.json()["data"][0]["embedding"]], np.float32), gens[family].embed(ids[:3]))
    # the left side keeps token ids' last N; an N past the input (-1: max_model_len) keeps it whole
    for keep, want_ids in ((3, ids[-3:]), (-1, ids), (len(ids) + 5, ids)):
        r = post("/v1/embeddings", {"input": ids, "encoding_format": "float", "truncate_prompt_tokens": keep,
                                    "truncation_side": "left"})
        assert r.json()["usage"]["prompt_tokens"] == len(want_ids), keep
        assert_close_vectors(np.array([r.json()["data"][0]["embedding"]], np.float32), gens[family].embed(want_ids))
    r = post("/v1/embeddings", {"input": TEXTS, "encoding_format": "float", "truncate_prompt_tokens": -1})
    assert_close_vectors(np.array([d["embedding"] for d in r.json()["data"]], np.float32), reference[family][0])
    n_special = len(tok("")["input_ids"])
    r = post("/v1/embeddings", {"input": TEXTS[0], "truncate_prompt_tokens": n_special})   # the specials alone
    assert r.json()["usage"]["prompt_tokens"] == n_special, r.text
    for body, param in (({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
                        ({"truncate_prompt_tokens": max(1, n_special - 1)} if n_special > 1 else
                         {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
                        ({"truncate_prompt_tokens": 3, "truncation_side": "middle"}, "truncation_side")):
        for route, inputs in (("/v1/embeddings", {"input": "the quick"}), ("/v1/score", {"text_1": "a", "text_2": "b"})):
            r = post(route, {**inputs, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, body, r.text)


def test_normalize_add_special_tokens_and_priority_as_vllm(gens, servers, reference):
    """vLLM's embedding fields: normalize false returns the pooled vector before the model's
    Normalize module (sentence-transformers without that module), normalize true normalizes a model
    that does not (numpy); add_special_tokens false embeds the text's ids without the tokenizer's
    special tokens (transformers' own); priority other than 0 under fcfs is a 400 naming it."""
    import httpx
    want, _, model = reference["qwen3"]
    bare = st.SentenceTransformer(modules=[model[0], model[1]], device="cpu")     # no Normalize
    raw = bare.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    assert np.abs(np.linalg.norm(raw, axis=1) - 1).max() > 0.1
    post = lambda family, body: httpx.post(f"{servers[family].url}/v1/embeddings", timeout=120,  # noqa: E731
                                           json={"encoding_format": "float", **body})
    r = post("qwen3", {"input": TEXTS, "normalize": False})
    assert_close_vectors(np.array([d["embedding"] for d in r.json()["data"]], np.float32), raw)
    assert_close_vectors(gens["qwen3"].embed(TEXTS, normalize=False), raw)
    # /pooling's embed task: vLLM's use_activation (and its older names) is the normalization switch
    for field in ("use_activation", "softmax"):
        r = httpx.post(f"{servers['qwen3'].url}/pooling", json={"input": TEXTS, "task": "embed", field: False},
                       timeout=120)
        assert_close_vectors(np.array([d["data"] for d in r.json()["data"]], np.float32), raw)
    r = httpx.post(f"{servers['qwen3'].url}/pooling", timeout=120,
                   json={"input": "a", "task": "embed", "use_activation": False, "normalize": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_activation"
    llama = reference["llama"][0]
    r = post("llama", {"input": TEXTS, "normalize": True})
    assert_close_vectors(np.array([d["embedding"] for d in r.json()["data"]], np.float32),
                         (llama / np.linalg.norm(llama, axis=1, keepdims=True)).astype(np.float32))
    tok = reference["llama"][2].tokenizer
    plain = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    r = post("llama", {"input": TEXTS, "add_special_tokens": False})
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, plain)) < sum(len(tok(t)["input_ids"]) for t in TEXTS)
    assert_close_vectors(np.array([d["embedding"] for d in r.json()["data"]], np.float32), gens["llama"].embed(plain))
    for route, body in (("/v1/embeddings", {"input": "a", "priority": 1}),
                        ("/v1/score", {"text_1": "a", "text_2": "b", "priority": 1}),
                        ("/pooling", {"input": "a", "task": "embed", "priority": 1})):
        r = httpx.post(f"{servers['qwen3'].url}{route}", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", (route, r.text)


# --------------------------------------------------------------------------- host-side pieces, no model
def test_matryoshka_dimensions_cut_then_normalize():
    """vLLM's order: the pooled vector cut to `dimensions`, then L2-normalized (numpy reference)."""
    from jaxinfer.embedding import EmbeddingSpec
    spec = EmbeddingSpec(pooling="mean", normalize=True, matryoshka_dimensions=(8, 16))
    with pytest.raises(ValueError, match="not one of this model's matryoshka dimensions"):
        spec.check_dimensions(12, 32)
    spec.check_dimensions(8, 32)
    rng = np.random.default_rng(0)
    chunks = [rng.standard_normal(32) for _ in range(3)]    # three chunks' sums of a 10-token input
    state = spec.pooling_state(10, dimensions=8)
    for c in chunks:
        state.add(c)
    want = (sum(chunks) / 10)[:8]
    np.testing.assert_allclose(state.embedding(), want / np.linalg.norm(want), rtol=1e-6)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        EmbeddingSpec(pooling="last", normalize=False).check_dimensions(8, 32)


def test_sentence_transformers_pooling_configs(tmp_path):
    from jaxinfer.embedding import EmbeddingError, read_embedding_spec
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3Model"]}))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    pooling = tmp_path / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    spec = read_embedding_spec(tmp_path)
    assert (spec.pooling, spec.normalize, spec.include_prompt) == ("cls", False, True)
    assert read_embedding_spec(tmp_path, pooling="mean", normalize=True).pooling == "mean"
    pooling.write_text(json.dumps({"pooling_mode": "weightedmean"}))
    with pytest.raises(EmbeddingError, match="pooling mode 'weightedmean' is not supported"):
        read_embedding_spec(tmp_path)


@pytest.mark.parametrize("name", ["gpt2", "gpt-neox"])
def test_pooling_over_a_causal_lm_of_another_head_name_still_generates(name, hf_model_dir):
    """--pooling over GPT2LMHeadModel (not named ...ForCausalLM) and GPT-NeoX (its head in embed_out):
    the model embeds and still generates with its own head, the greedy tokens transformers' generate
    gives."""
    from jaxinfer import Generator, SamplingParams
    from tests.hf_models import build_hf_model
    gen = Generator.from_pretrained(hf_model_dir(name), pooling="mean", **ENGINE)
    assert gen.embedding.generates and gen.embed([[5, 6, 7]]).shape == (1, gen.model_cfg.d_model)
    hf = build_hf_model(name)
    ids = [5, 17, 42, 9, 60, 33]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    got = gen.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    assert got == want
