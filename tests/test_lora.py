"""Multi-LoRA serving against PEFT itself: logits per adapter, greedy tokens in mixed batches, load /
unload, LRU eviction, the prefix cache keyed by adapter, and every bad adapter refused by name."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from jaxinfer import Generator, SamplingParams
from jaxinfer.host.lora_slots import LoraSlots
from jaxinfer.lora.adapter import LoraError
from tests.hf_models import CONFIGS, build_hf_model, save_hf_model, seeded_peft
from tests.precision import assert_rel_close, attention_rtol, dot_chain_rtol

PROMPT = [5, 17, 42, 9, 88, 3, 61, 27, 14, 70, 33, 8, 51, 96, 22, 40, 7, 64, 12]   # 19 tokens: 2 blocks of 8 + 3
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

# per family: adapters of different ranks, targets, alphas and scalings (PEFT's LoraConfig keywords)
ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "b": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
              rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 3}),
    "c": dict(r=6, lora_alpha=5, use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
}


def _peft(name: str, config: dict, seed: int):
    """A PEFT model over the family's tiny base with seeded non-zero A and B (PEFT starts B at zero)."""
    return seeded_peft(build_hf_model(name), config, seed, 0.2)


def _rtol(cfg: dict, ranks: int, keys: int) -> float:
    """Float32 rounding on the logits' path (_chain_rtol) of a tests/hf_models.py config."""
    d = cfg["hidden_size"]
    return _chain_rtol(d, cfg["intermediate_size"], cfg.get("head_dim", d // 4), cfg["num_hidden_layers"], ranks, keys)


def _chain_rtol(d: int, f: int, hd: int, layers: int, ranks: int, keys: int) -> float:
    """Float32 rounding on the logits' path: every layer's projections (the adapters add an r-long
    and an input-long contraction beside each), its attention, then the LM head."""
    per_layer = [d, d, 4 * hd, f, ranks, ranks]
    return dot_chain_rtol(*(per_layer * layers), d) + attention_rtol("float32", keys, hd)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(base folder, {adapter: (folder, PEFT model)}) for the tiny Llama."""
    root = tmp_path_factory.mktemp("lora-llama")
    base = save_hf_model("llama-gqa-llama3", root / "base")
    adapters = {}
    for i, (name, config) in enumerate(ADAPTERS.items()):
        model = _peft("llama-gqa-llama3", config, seed=10 + i)
        model.save_pretrained(root / name)
        adapters[name] = (str(root / name), model)
    return base, adapters


@pytest.fixture(scope="module")
def gen(llama):
    """Two slots for three adapters (LRU eviction), rank up to 8; two token buckets (8, 16)."""
    base, adapters = llama
    return Generator.from_pretrained(base, lora_modules={"a": adapters["a"][0], "b": adapters["b"][0]},
                                     max_loras=2, max_lora_rank=8, max_model_len=64, max_num_batched_tokens=16,
                                     max_num_seqs=4, block_size=8, num_blocks=40)


def _peft_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_logits_per_adapter_match_peft(gen, llama):
    _, adapters = llama
    gen.load_lora("c", adapters["c"][0])
    cfg = CONFIGS["llama-gqa-llama3"][1]
    for name, (_, model) in adapters.items():
        with torch.no_grad():
            ref = model(torch.tensor([PROMPT])).logits[0].numpy()
            with model.disable_adapter():
                base = model(torch.tensor([PROMPT])).logits[0].numpy()
        assert np.abs(ref - base).max() > 0.05 * np.abs(base).max(), "the adapter must change the logits"
        assert_rel_close(gen.logits(PROMPT, lora=name), ref, _rtol(cfg, 8, len(PROMPT)), name)
        assert_rel_close(gen.logits(PROMPT), base, _rtol(cfg, 0, len(PROMPT)), "base")


def test_adapter_keys_without_the_peft_model_prefix(gen, llama, tmp_path):
    """An adapter saved from a transformers model (its PEFT integration) names tensors by module alone
    ("model.layers.0...lora_A.weight", no "base_model.model."), as vLLM also loads: the same logits
    as PEFT's for adapter b."""
    from safetensors.numpy import load_file, save_file
    _, adapters = llama
    folder = shutil.copytree(adapters["b"][0], tmp_path / "b-bare")
    f = folder / "adapter_model.safetensors"
    save_file({k.removeprefix("base_model.model."): v for k, v in load_file(str(f)).items()}, str(f))
    gen.load_lora("b-bare", str(folder))
    try:
        with torch.no_grad():
            ref = adapters["b"][1](torch.tensor([PROMPT])).logits[0].numpy()
        assert_rel_close(gen.logits(PROMPT, lora="b-bare"), ref, _rtol(CONFIGS["llama-gqa-llama3"][1], 8, len(PROMPT)),
                         "b-bare")
    finally:
        gen.unload_lora("b-bare")


def test_mixed_batch_equals_alone_and_peft(gen, llama):
    """Base and three adapters over two slots in one generate call: every row's greedy tokens are
    what it draws alone, and what PEFT's own greedy decoding draws."""
    _, adapters = llama
    if "c" not in gen.lora_adapters():
        gen.load_lora("c", adapters["c"][0])
    names = [None, "a", "b", "c", "a", None]
    prompts = [PROMPT[i:] for i in range(len(names))]
    mixed = gen.generate(prompts, GREEDY, lora=names)
    for prompt, name, out in zip(prompts, names, mixed):
        alone = gen.generate([prompt], GREEDY, lora=name)[0]
        assert out.token_ids == alone.token_ids, name
    for name in ("a", "b", "c"):
        assert mixed[names.index(name)].token_ids == _peft_greedy(adapters[name][1], prompts[names.index(name)], 10)
    assert gen.stats()["compilations_after_warmup"] == 0


def test_load_unload_and_eviction(gen, llama):
    _, adapters = llama
    want = gen.generate([PROMPT], GREEDY, lora="a")[0].token_ids
    gen.load_lora("a-again", adapters["a"][0])
    assert gen.generate([PROMPT], GREEDY, lora="a-again")[0].token_ids == want
    gen.unload_lora("a")
    assert "a" not in gen.lora_adapters()
    with pytest.raises(ValueError, match="'a' does not exist"):
        gen.generate([PROMPT], GREEDY, lora="a")
    with pytest.raises(ValueError, match="'a' does not exist"):
        gen.unload_lora("a")
    # every other adapter through the two slots, then "a" loaded again (a new load, a new slot)
    for name in ("b", "c", "b"):
        if name not in gen.lora_adapters():
            gen.load_lora(name, adapters[name][0])
        gen.generate([PROMPT], GREEDY, lora=name)
    gen.load_lora("a", adapters["a"][0])
    assert gen.generate([PROMPT], GREEDY, lora="a")[0].token_ids == want
    stream = [t for d in gen.stream(PROMPT, GREEDY, lora="a") for t in d.token_ids]
    assert stream == want
    assert gen.stats()["compilations_after_warmup"] == 0
    assert gen.stats()["kv_blocks_used"] == 0


def test_prefix_cache_never_shared_across_adapters(gen, llama):
    gen.reset_prefix_cache()
    names = gen.lora_adapters()
    first = gen.generate([PROMPT], GREEDY, lora=names[0])[0]
    other = gen.generate([PROMPT], GREEDY, lora=names[1])[0]
    base = gen.generate([PROMPT], GREEDY)[0]
    again = gen.generate([PROMPT], GREEDY, lora=names[0])[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens == 16 and again.token_ids == first.token_ids


def _edit_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_bad_adapters_refused_by_name(gen, llama, tmp_path):
    _, adapters = llama
    src = adapters["b"][0]
    big = _peft("llama-gqa-llama3", dict(r=16, lora_alpha=16, target_modules=["q_proj"]), seed=3)
    big.save_pretrained(tmp_path / "big")
    emb = _peft("llama-gqa-llama3", dict(r=4, target_modules=["embed_tokens"]), seed=3)
    emb.save_pretrained(tmp_path / "emb")
    qwen = _peft("qwen3-gqa", dict(r=4, target_modules=["q_proj"]), seed=3)
    qwen.save_pretrained(tmp_path / "qwen")
    pickled = tmp_path / "bin"
    adapters["b"][1].save_pretrained(pickled, safe_serialization=False)
    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    (missing / "adapter_model.safetensors").unlink()
    cases = {
        str(tmp_path / "big"): "rank 16 exceeds max_lora_rank=8",
        str(tmp_path / "emb"): "embed_tokens",
        str(tmp_path / "qwen"): "disagree with the model",
        str(pickled): "adapter_model.bin",
        str(missing): "no adapter_model.safetensors",
        str(tmp_path / "nowhere"): "does not exist",
        _edit_config(src, tmp_path / "bias", bias="all"): "bias='all'",
        _edit_config(src, tmp_path / "save", modules_to_save=["lm_head"]): "modules_to_save",
        _edit_config(src, tmp_path / "target", target_modules=["q_proj", "c_attn"]): "'c_attn' is not in the model",
        _edit_config(src, tmp_path / "rank", r=3): "disagree",
    }
    before = gen.lora_adapters()
    for path, message in cases.items():
        with pytest.raises(LoraError, match=message):
            gen.load_lora("bad", path)
        assert gen.lora_adapters() == before
    with pytest.raises(LoraError, match="already loaded"):
        gen.load_lora(before[0], src)
    assert gen.generate([PROMPT], GREEDY, lora=before[0])[0].finish_reason == "length"


def test_second_family_and_int8_base(tmp_path):
    """Qwen3 (q/k norms, head_dim != d / heads) with an all-linear adapter; then the same adapter over
    an int8 base (QLoRA-style: weights int8, adapters float): its logits move from the int8 base's
    as PEFT's move from the float base's, within int8's rounding."""
    name = "qwen3-gqa"
    base = save_hf_model(name, tmp_path / "base")
    model = _peft(name, dict(r=8, lora_alpha=8, target_modules="all-linear"), seed=7)
    model.save_pretrained(tmp_path / "q")
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
        with model.disable_adapter():
            ref_base = model(torch.tensor([PROMPT])).logits[0].numpy()
    # 6 usable blocks of 8 tokens: two rows of 29 tokens (4 blocks each) preempt each other
    kw = dict(lora_modules={"q": str(tmp_path / "q")}, max_loras=1, max_lora_rank=8, max_model_len=48,
              max_num_batched_tokens=8, max_num_seqs=2, block_size=8, num_blocks=7)
    gen = Generator.from_pretrained(base, **kw)
    cfg = CONFIGS[name][1]
    assert_rel_close(gen.logits(PROMPT, lora="q"), ref, _rtol(cfg, 8, len(PROMPT)), name)
    want = _peft_greedy(model, PROMPT, 10)
    assert gen.generate([PROMPT], GREEDY, lora="q")[0].token_ids == want
    base_alone = gen.generate([PROMPT[2:]], GREEDY)[0].token_ids
    mixed = gen.generate([PROMPT, PROMPT[2:], PROMPT], GREEDY, lora=["q", None, "q"])
    assert [o.token_ids for o in mixed] == [want, base_alone, want]
    assert gen.stats()["num_preemptions"] > 0
    q8 = Generator.from_pretrained(base, quantize="int8", **kw)
    delta, ref_delta = q8.logits(PROMPT, lora="q") - q8.logits(PROMPT), ref - ref_base
    # int8 per-channel weights carry 2^-8 relative rounding per weight; over 2 layers and the
    # adapters' inputs (which pass through them) the delta moves by a few percent of its size
    assert_rel_close(delta, ref_delta, 5e-2, "int8 base")
    mixed = q8.generate([PROMPT, PROMPT[3:]], GREEDY, lora=["q", None])
    assert mixed[0].token_ids == q8.generate([PROMPT], GREEDY, lora="q")[0].token_ids
    assert mixed[1].token_ids == q8.generate([PROMPT[3:]], GREEDY)[0].token_ids


@pytest.mark.parametrize("name", ["smollm3-window", "granite", "olmo2", "olmo3", "exaone4", "seed_oss", "cohere",
                                  "cohere2", "ernie4_5", "stablelm-parallel-qk-norm", "granitemoe", "olmoe", "hunyuan",
                                  "phi", "starcoder2-window", "gpt-neox", "bloom", "gpt2", "phi3-longrope", "glm4",
                                  "ministral3", "gemma", "arcee", "helium", "gpt-bigcode-mqa", "gpt-bigcode-mha",
                                  "falcon-7b", "falcon-40b", "falcon-sequential", "ministral",
                                  "granite-swa", "jais2", "nemotron", "exaone", "internlm3", "apertus", "gptj", "olmo", "minicpm", "phimoe", "afmoe", "gpt-neo", "opt",
                                  "llama4-maverick"])
def test_newer_families_match_peft(name, tmp_path):
    """SmolLM3 (NoPE layers), Granite (the adapters' output times the residual multiplier), OLMo 2
    (adapters before the whole-width q / k norms and the post-norms), OLMo 3, EXAONE 4.0, Seed-OSS
    (biased projections), Command R+ / R7B (parallel blocks, per-head q / k norms) and ERNIE 4.5 (their
    q / k adapters' output features in the de-interleaved RoPE order; Helium too), StableLM 2 12B (per-head q / k
    LayerNorms, parallel blocks), Granite MoE and OLMoE (their attention), HunYuan (q / k norms after
    RoPE), Ministral 3 (its queries scaled by log position); and the families PEFT adapts under their
    own module names: Phi (dense, fc1 / fc2), StarCoder2 (c_fc / c_proj), Arcee, Jais 2 and Apertus (ungated
    up_proj; Apertus's xIELU between), GPT-J (out_proj, fc_in / fc_out; q / k rotated in pairs), GPT-Neo
    (attn.attention.q_proj ..., c_fc / c_proj), OPT (model.decoder.layers.i: self_attn.out_proj, and fc1 / fc2
    directly under the layer), GPT-NeoX and BLOOM (q, k, v fused per head in query_key_value: one A,
    B split into the three), GPT-2 (c_attn: [q | k | v] rows; Conv1D modules), GPTBigCode (c_attn: [q | k | v] rows with one KV head, per
    head without), Falcon (query_key_value in KV groups, each its query heads, key and value), Phi-3 (qkv_proj's
    [q | k | v] and gate_up_proj's [gate | up] rows), GLM-4-0414 (gate_up_proj; q / k in RoPE pairs),
    the ungated MLPs' up projection adapted, EXAONE 3.5 (also the adapter under its modeling code's
    module names: transformer.h.i.attn.attention.out_proj, mlp.c_fc_0, ...), InternLM3 (biases), OLMo 1
    (adapters before the clamp of q / k / v), MiniCPM (muP's scales; PEFT on the Granite it is written from),
    Phi-3.5-MoE and Arcee Trinity (their attention; Trinity's o_proj adapter reads the gated heads),
    Llama 4 (its attention, q / k in RoPE pairs, and the dense layers' feed_forward MLP): an all-linear
    adapter's logits and greedy tokens as PEFT's."""
    base = save_hf_model(name, tmp_path / "base")
    # PEFT's all-linear on OLMoE also adapts its experts' and router's parameters (target_parameters,
    # refused): its attention here
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if name in ("olmoe", "phimoe", "afmoe") else "all-linear"
    if name == "llama4-maverick":   # (all-linear would adapt the MoE layers' router and shared expert: refused)
        targets = r".*\.(self_attn\.[qkvo]_proj|feed_forward\.(gate|up|down)_proj)"
    model = _peft(name, dict(r=4, lora_alpha=8, target_modules=targets), seed=11)
    model.save_pretrained(tmp_path / "a")
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    adapters = {"a": str(tmp_path / "a")}
    if name == "exaone":
        adapters["b"] = _exaone_names(tmp_path / "a", tmp_path / "b")
    gen = Generator.from_pretrained(base, lora_modules=adapters, max_loras=1, max_lora_rank=4,
                                    max_model_len=48, max_num_batched_tokens=16, token_buckets=[16], max_num_seqs=2,
                                    block_size=8, num_blocks=13, warmup=False)
    c = gen.model_cfg   # the served model's sizes (GPT-2's config names them otherwise)
    rtol = _chain_rtol(c.d_model, c.ffn_dim, c.head_dim, c.n_layers, 4, len(PROMPT))
    assert_rel_close(gen.logits(PROMPT, lora="a"), ref, rtol, name)
    assert gen.generate([PROMPT], GREEDY, lora="a")[0].token_ids == _peft_greedy(model, PROMPT, 10)
    if name == "exaone":
        assert_rel_close(gen.logits(PROMPT, lora="b"), ref, rtol, "EXAONE's module names")


_EXAONE_MODULES = ((".model.layers.", ".transformer.h."), (".self_attn.o_proj.", ".attn.attention.out_proj."),
                   (".self_attn.", ".attn.attention."), (".gate_proj.", ".c_fc_0."), (".up_proj.", ".c_fc_1."),
                   (".down_proj.", ".c_proj."))


def _exaone_names(src, dst) -> str:
    """A PEFT adapter of transformers' EXAONE (Llama's module names) under those of EXAONE's modeling
    code, as adapters trained on it name them (tensors and target_modules)."""
    from safetensors.numpy import load_file, save_file

    def rename(key: str) -> str:
        for a, b in _EXAONE_MODULES:
            key = key.replace(a, b)
        return key
    shutil.copytree(src, dst)
    tensors = load_file(dst / "adapter_model.safetensors")
    save_file({rename(k): v for k, v in tensors.items()}, dst / "adapter_model.safetensors")
    cfg = json.loads((dst / "adapter_config.json").read_text())
    names = {"o_proj": "out_proj", "gate_proj": "c_fc_0", "up_proj": "c_fc_1", "down_proj": "c_proj"}
    cfg["target_modules"] = sorted(names.get(t, t) for t in cfg["target_modules"])
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_speculative_decoding_with_lora_refused(llama):
    base, adapters = llama
    with pytest.raises(LoraError, match="speculative decoding"):
        Generator.from_pretrained(base, speculative_method="ngram", lora_modules={"a": adapters["a"][0]},
                                  max_model_len=64, max_num_seqs=2, num_blocks=20, warmup=False)


def test_lru_slots_without_a_model():
    slots = LoraSlots(2)
    assert [slots.acquire(1), slots.acquire(2)] == [0, 1]
    assert slots.acquire(3) is None                      # both held: the request waits
    slots.release(1)
    assert slots.acquire(3) == 0                         # 1 was the least recently used free one
    assert slots.take_pending() == [(0, 3), (1, 2)]
    slots.release(2)
    slots.release(3)
    assert slots.acquire(2) == 1 and slots.take_pending() == []   # still in its slot: no write
    assert slots.acquire(1) == 0                         # evicts 3 (least recently used)
    slots.release(2)
    slots.drop(2)
    assert slots.free == [1]


def test_cli_flags_reach_the_engine_settings(llama):
    from jaxinfer.cli import build_parser
    from jaxinfer.config.engine import EngineConfig
    from jaxinfer.config.flags import engine_kwargs
    base, adapters = llama
    args = build_parser().parse_args(["serve", "--model", base, "--lora-modules", f"a={adapters['a'][0]}",
                                      f"b={adapters['b'][0]}", "--max-lora-rank", "8"])
    cfg = EngineConfig(**{k: v for k, v in engine_kwargs(args).items() if k != "speculative_model"})
    assert cfg.lora_modules == (("a", adapters["a"][0]), ("b", adapters["b"][0]))
    assert (cfg.max_loras, cfg.max_lora_rank) == (4, 8)
    with pytest.raises(ValueError, match="not NAME=PATH"):
        EngineConfig(lora_modules=["a"])


def test_http_adapters_models_load_unload(gen, llama, tmp_path):
    """vLLM's interface over the same engine: `model` picks the adapter (token-id prompts: the base
    folder has no tokenizer), logprobs as PEFT computes them, /v1/models with parents, run-time load
    and unload with no flag, 404 / 400 as vLLM answers them."""
    from fastapi.testclient import TestClient

    from serve.app import build_app
    _, adapters = llama
    for name in ("b", "c"):
        if name not in gen.lora_adapters():
            gen.load_lora(name, adapters[name][0])
    with TestClient(build_app(gen, "tiny")) as http:
        models = http.get("/v1/models").json()["data"]
        assert models[0]["id"] == "tiny" and models[0]["parent"] is None
        assert {m["id"]: m["parent"] for m in models[1:]} == {n: "tiny" for n in gen.lora_adapters()}
        # OpenAI's retrieve: one card; an unknown model a 404 in OpenAI's shape
        assert http.get("/v1/models/c").json() == {**models[[m["id"] for m in models].index("c")],
                                                   "created": http.get("/v1/models/c").json()["created"]}
        missing = http.get("/v1/models/nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        from importlib.metadata import version
        assert http.get("/version").json() == {"version": version("jaxinfer")}
        body = dict(model="c", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
        out = http.post("/v1/completions", json=body).json()
        assert out["model"] == "c"
        tokens = [int(t.split(":")[1]) for t in out["choices"][0]["logprobs"]["tokens"]]
        assert tokens == gen.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0), lora="c")[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(adapters["c"][1](torch.tensor([PROMPT])).logits[0, -1].double(), -1)
        assert abs(out["choices"][0]["logprobs"]["token_logprobs"][0] - float(ref[tokens[0]])) < 1e-4
        assert http.post("/v1/completions", json={**body, "model": "nope"}).status_code == 404

        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
        # a partial copy (truncated tensors) and a config of the wrong shape: 400s naming them (500s before)
        cut, odd, huge, dir_ = tmp_path / "cut", tmp_path / "odd", tmp_path / "huge", tmp_path / "dir"
        for folder in (cut, odd, huge, dir_):
            shutil.copytree(adapters["b"][0], folder)
        data = (cut / "adapter_model.safetensors").read_bytes()
        (cut / "adapter_model.safetensors").write_bytes(data[:200])
        (odd / "adapter_config.json").write_text(json.dumps({**json.loads((odd / "adapter_config.json").read_text()),
                                                             "r": "four"}))
        # "r": Infinity (OverflowError) and a folder named adapter_config.json (OSError) were 500s
        (huge / "adapter_config.json").write_text(json.dumps({**json.loads((huge / "adapter_config.json").read_text()),
                                                              "r": float("inf")}))
        (dir_ / "adapter_config.json").unlink()
        (dir_ / "adapter_config.json").mkdir()
        for folder, needle in ((cut, "adapter_model.safetensors"), (odd, "adapter_config.json"),
                               (huge, "adapter_config.json"), (dir_, "adapter_config.json")):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(folder)})
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "lora_path"
        assert "x" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
        ok = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["b"][0]})
        assert ok.status_code == 200, ok.text
        assert "x" in [m["id"] for m in http.get("/v1/models").json()["data"]]
        same = http.post("/v1/completions", json={**body, "model": "x"}).json()["choices"][0]["logprobs"]["tokens"]
        assert same == http.post("/v1/completions", json={**body, "model": "b"}).json()["choices"][0]["logprobs"]["tokens"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
        assert "x" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404
        assert http.post("/v1/completions", json={**body, "model": "x"}).status_code == 404


def test_tensor_parallel_with_kv_replicas(llama, tmp_path):
    """Four fake devices over 4 query / 2 KV heads (each KV head repeated twice, fuse_decoder): A and
    B sharded like their base weights, logits as PEFT's, mixed batch == alone."""
    from tests.fake_devices import run_worker
    base, adapters = llama
    shutil.copytree(base, tmp_path / "base")
    for name in ("a", "b"):
        shutil.copytree(adapters[name][0], tmp_path / name)
    (tmp_path / "run.json").write_text(json.dumps({"adapters": ["a", "b"], "prompt": PROMPT, "tp": 4}))
    result = run_worker("tests.lora_tp_worker", tmp_path, devices=4)
    cfg = CONFIGS["llama-gqa-llama3"][1]
    for name in ("a", "b"):
        with torch.no_grad():
            ref = adapters[name][1](torch.tensor([PROMPT])).logits[0].numpy()
        assert_rel_close(np.array(result["logits"][name]), ref, _rtol(cfg, 8, len(PROMPT)), name)
    assert result["mixed"] == result["alone"]
    assert result["alone"][0] == _peft_greedy(adapters["a"][1], PROMPT, 6)
    assert result["compilations"] == 0


def test_chat_and_responses_run_the_adapter_named_in_model(tmp_path):
    """`model` naming a loaded adapter runs it on /v1/chat/completions and /v1/responses alike (the
    Responses route once dropped it and ran the base model), and each answers with that name: the
    greedy text is PEFT's greedy continuation of the rendered chat, decoded by SentencePiece."""
    import sentencepiece as spm
    from fastapi.testclient import TestClient
    from transformers import LlamaForCausalLM

    from serve.app import build_app
    from serve.protocol import ChatCompletionRequest
    from tests.hf_models import save_text_model

    base = save_text_model(tmp_path / "base")
    model = seeded_peft(LlamaForCausalLM.from_pretrained(base), ADAPTERS["a"], 7, 0.5)
    model.save_pretrained(tmp_path / "ad")
    gen = Generator.from_pretrained(base, lora_modules={"ad": str(tmp_path / "ad")}, max_lora_rank=8,
                                    max_model_len=128, max_num_seqs=2, block_size=8, num_blocks=40)
    sp = spm.SentencePieceProcessor(model_file=str(base / "tokenizer.model"))
    messages = [{"role": "user", "content": "the quick brown fox"}]
    with TestClient(build_app(gen, "tiny")) as http:
        prompt = http.app.state.server.chat_inputs(ChatCompletionRequest(model="ad", messages=messages))[0]
        with torch.no_grad():
            ids = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                 eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
            with model.disable_adapter():
                base_ids = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                          eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
        assert ids != base_ids                      # the adapter changes the greedy continuation
        want = sp.decode([i for i in ids if i != 2])
        chat = http.post("/v1/chat/completions", json=dict(model="ad", messages=messages, max_tokens=6,
                                                           temperature=0)).json()
        resp = http.post("/v1/responses", json=dict(model="ad", input=messages, max_output_tokens=6,
                                                    temperature=0)).json()
        assert chat["model"] == resp["model"] == "ad"
        assert chat["choices"][0]["message"]["content"].strip() == want.strip()
        assert resp["output_text"].strip() == want.strip()
        plain = http.post("/v1/responses", json=dict(input=messages, max_output_tokens=6, temperature=0)).json()
        assert plain["model"] == "tiny" and plain["output_text"].strip() == sp.decode(
            [i for i in base_ids if i != 2]).strip()
        # vLLM's lora_requests_info and kv_cache_usage_perc on /metrics (prometheus_client's parser):
        # a request of the adapter ran, so a series whose running_lora_adapters is "ad" (max_lora the
        # device slots, 4) was set since it began (its value: the time it was last set; read once a
        # step's tokens arrived: the server observes each step before sending them)
        import time

        from prometheus_client.parser import text_string_to_metric_families
        t0 = time.time()
        body = dict(model="ad", messages=messages, max_tokens=40, temperature=0, stream=True, ignore_eos=True)
        def text_of(line: str) -> str:   # a data line's delta text ("" for the role chunk and the rest)
            if not line.startswith("data: {"):
                return ""
            choices = json.loads(line[6:])["choices"]
            return (choices[0]["delta"].get("content") or "") if choices else ""

        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if text_of(line))
            families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
            for _ in lines:
                pass
        seen = {(x.labels["running_lora_adapters"], x.labels["waiting_lora_adapters"], x.labels["max_lora"])
                for x in families["jaxinfer_lora_requests_info"].samples if x.value >= t0}
        assert ("ad", "", "4") in seen, seen
        stats = gen.stats()
        usage = families["jaxinfer_kv_cache_usage_perc"].samples[0].value
        assert 0 < usage <= 1 and stats["kv_blocks_total"] == 39
        assert usage * 39 == pytest.approx(round(usage * 39))     # a whole number of the 39 usable blocks
