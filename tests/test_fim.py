"""Fill in the middle (jaxinfer/fim.py, /v1/completions' `suffix`): the prompt each family's own
encoder makes, and a served infill ended by the family's stop token as transformers ends it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

CASES = [("def area(r):\n    return", " * r\n\nprint(area(2))\n"), ("x = [", "]"), ("", " tail"),
         ("  lead", "\n\tpass"), ("x = 1\n", "")]     # (an empty suffix: the cursor at the end of a file)
QWEN = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|file_sep|>", "<|endoftext|>")
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "<｜end▁of▁sentence｜>")


def _byte_level(folder: Path, specials: tuple[str, ...], bos: str | None = None):
    """A byte-level BPE tokenizer.json (the tokenizers library) with `specials` as special tokens;
    bos: a post-processor that puts it first (DeepSeek's). -> (jaxinfer's Tokenizer, the library's)."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

    from jaxinfer.tokenizer import load_tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def area(r):\n    return 3.14 * r * r\n\nprint(area(2))\nx = [1, 2]\n"] * 4,
                            trainer=trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": specials[-1]} | ({"bos_token": bos} if bos else {})
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_tokenizer(folder), tok


@pytest.mark.parametrize("prefix,suffix", CASES)
def test_byte_level_families_encode_the_model_cards_string(tmp_path, prefix, suffix):
    """Qwen2.5-Coder's and DeepSeek-Coder's FIM prompt is one string tokenized whole (their model
    cards); DeepSeek's tokenizer adds BOS first. Token ids as a prefix are taken as they are."""
    from jaxinfer.fim import fim_prompt
    qwen, ref = _byte_level(tmp_path / "qwen", QWEN)
    assert qwen.fim.family == "qwen" and set(qwen.fim.stops) == {ref.token_to_id(t) for t in QWEN[3:5]}
    want = ref.encode(f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>").ids
    assert fim_prompt(qwen, prefix, suffix) == want
    prefix_ids = ref.encode(prefix).ids
    assert fim_prompt(qwen, prefix_ids, suffix) == want
    ds, ref = _byte_level(tmp_path / "ds", DEEPSEEK, bos=DEEPSEEK[0])
    assert ds.fim.family == "deepseek" and ds.fim.stops == ()
    want = ref.encode(f"<｜fim▁begin｜>{prefix}<｜fim▁hole｜>{suffix}<｜fim▁end｜>").ids
    assert want[0] == ref.token_to_id(DEEPSEEK[0]) and fim_prompt(ds, prefix, suffix) == want
    assert fim_prompt(ds, prefix, suffix, add_special_tokens=False) == want[1:]


def test_codellama_prompt_is_transformers_and_metas(tmp_path):
    """CodeLlama (a Metaspace tokenizer.json): transformers' CodeLlamaTokenizer(prefix, suffix=...) is
    [BOS, ▁<PRE>] + " " + prefix + [▁<SUF>] + suffix + [▁<MID>]. Meta's encoder (codellama's
    encode_infilling) writes the suffix with no word marker; transformers' puts one before a suffix
    that does not start with a space: there the two differ by exactly that "▁" piece, and the model
    was trained on Meta's (as with an empty prefix: Meta's encode("") is empty)."""
    import string

    from transformers import CodeLlamaTokenizer

    from jaxinfer.fim import fim_prompt
    from jaxinfer.tokenizer import load_tokenizer
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in "▁" + string.ascii_letters + string.digits + "():=+*[],.\n\t":
        vocab.setdefault(c, len(vocab))
    for piece in ("▁d", "▁de", "ef", "▁r", "▁re"):
        vocab[piece] = len(vocab)
    ref = CodeLlamaTokenizer(vocab=vocab, merges=[("▁", "d"), ("▁d", "e"), ("e", "f"), ("▁", "r"), ("▁r", "e")])
    ref.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.fim.family == "codellama" and tok.fim.stops == (ref.eot_id,)
    marker = vocab["▁"]
    # transformers encodes " " + "" as a lone "▁", and makes no infill of an empty suffix
    for prefix, suffix in [c for c in CASES if c[0] and c[1]]:
        want = ref(prefix, suffix=suffix)["input_ids"]
        ours = fim_prompt(tok, prefix, suffix)
        if suffix.startswith(" "):
            assert ours == want, (prefix, suffix)
        else:
            cut = want.index(ref.suffix_id) + 1
            assert want[cut] == marker and ours == want[:cut] + want[cut + 1:], (prefix, suffix)


def test_mistral_suffix_first_as_mistral_common_encodes_it(tmp_path):
    """Codestral / Mistral v3 tokenizers (SentencePiece, control tokens [PREFIX] [SUFFIX]):
    mistral_common's encode_fim is [BOS, [SUFFIX]] + encode("☺" + suffix)[2:] + [[PREFIX]] +
    encode(prefix), no middle token; computed here with sentencepiece itself."""
    import io

    import sentencepiece as spm

    from jaxinfer.fim import fim_prompt
    from jaxinfer.tokenizer import load_tokenizer
    buf = io.BytesIO()
    lines = ["def area(r): return 3.14 * r * r", "print(area(2)) x = [1, 2] lead tail pass",
             "if x >= 1 and y >> 2: <unk> > 0"] * 50
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=330, model_type="bpe",
                                   byte_fallback=True, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=3,
                                   control_symbols=["[PREFIX]", "[SUFFIX]"], user_defined_symbols=["☺", ">=", ">>"],
                                   remove_extra_whitespaces=False, normalization_rule_name="identity")
    (tmp_path / "tokenizer.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    tok = load_tokenizer(tmp_path)
    assert tok.fim.family == "mistral" and tok.fim.middle is None
    assert sp.piece_to_id(">=") != sp.unk_id()      # a piece that a "<unk>" anchor's ">" would merge into
    for prefix, suffix in CASES + [("x", ">= 1"), ("x", "> 0"), ("x", ">> 2")]:
        want = [1, sp.piece_to_id("[SUFFIX]"), *sp.encode("☺" + suffix)[2:], sp.piece_to_id("[PREFIX]"), *sp.encode(prefix)]
        assert fim_prompt(tok, prefix, suffix) == want, (prefix, suffix)


def test_a_vocabulary_without_fim_tokens_is_refused(tmp_path):
    from jaxinfer.fim import FimError, fim_prompt
    tok, _ = _byte_level(tmp_path, ("<|endoftext|>",))
    assert tok.fim is None
    with pytest.raises(FimError, match="no fill-in-the-middle tokens"):
        fim_prompt(tok, "a", "b")


# ------------------------------------------------------------------ served

def _chain_model(folder: Path):
    """A one-layer Llama whose next token is fixed by the current one (one-hot embeddings, the
    attention's and MLP's outputs zero): <|fim_middle|> -> A -> B -> <|fim_pad|>, with the Qwen-style
    tokenizer above. -> (folder, tokenizers library tokenizer, [A, B, <|fim_pad|>])."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _, ref = _byte_level(folder, QWEN)
    a, b = ref.encode(" * r").ids[:2]
    chain = [ref.token_to_id("<|fim_middle|>"), a, b, ref.token_to_id("<|fim_pad|>")]
    vocab, hidden = ref.get_vocab_size(), 32
    eos = ref.token_to_id("<|endoftext|>")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=eos,
                                         max_position_embeddings=512, tie_word_embeddings=False))
    with torch.no_grad():
        emb, head = torch.zeros(vocab, hidden), torch.zeros(vocab, hidden)
        for k, (t, nxt) in enumerate(zip(chain, chain[1:])):
            emb[t, k] = 1.0
            head[nxt, k] = 10.0
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(head)
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
    model.save_pretrained(folder)
    return model, ref, chain[1:]


def test_served_infill_stops_where_transformers_stops(tmp_path, capsys):
    """/v1/completions with `suffix`: the prompt is the model card's FIM string, and the infill ends
    at <|fim_pad|> (a stop llama.cpp counts end of generation) with the tokens transformers' greedy
    generate draws given the same stop ids; Generator.generate / stream(suffix=...) and `jaxinfer
    generate --suffix` the same. echo with suffix is refused naming echo; chat has no suffix."""
    import torch
    from starlette.testclient import TestClient

    from jaxinfer import Generator, SamplingParams
    from serve.app import build_app
    model, ref, chain = _chain_model(tmp_path / "m")
    prefix, suffix = CASES[0]
    prompt = ref.encode(f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>").ids
    stops = [ref.token_to_id(t) for t in ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>")]
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=stops, pad_token_id=0)
    drawn = hf[0, len(prompt):].tolist()
    assert drawn == chain                                  # the rigged chain, ended by <|fim_pad|>
    gen = Generator.from_pretrained(tmp_path / "m", dtype="float32", max_model_len=128, max_num_batched_tokens=32,
                                    token_buckets=[32], max_num_seqs=2, block_size=16, warmup=False)
    try:
        with TestClient(build_app(gen, "coder")) as http:
            r = http.post("/v1/completions", json={"model": "coder", "prompt": prefix, "suffix": suffix, "max_tokens": 8,
                                                   "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["prompt_token_ids"] == prompt and choice["token_ids"] == drawn
            assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
                ref.decode(drawn[:-1]), "stop", chain[-1])
            for p in (ref.encode(prefix).ids, [prefix, prefix]):     # token ids; two prompts
                r = http.post("/v1/completions", json={"model": "coder", "prompt": p, "suffix": suffix, "max_tokens": 8,
                                                       "temperature": 0})
                assert [c["text"] for c in r.json()["choices"]] == [ref.decode(drawn[:-1])] * (1 + isinstance(p[0], str))
            with http.stream("POST", "/v1/completions", json={"model": "coder", "prompt": prefix, "suffix": suffix,
                                                              "max_tokens": 8, "temperature": 0, "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == ref.decode(drawn[:-1])
            r = http.post("/v1/completions", json={"model": "coder", "prompt": prefix, "suffix": "", "max_tokens": 1,
                                                   "return_token_ids": True})     # at the end of a file: an infill too
            assert r.json()["choices"][0]["prompt_token_ids"] == ref.encode(
                f"<|fim_prefix|>{prefix}<|fim_suffix|><|fim_middle|>").ids
            for body, param in (({"echo": True}, "echo"), ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens")):
                r = http.post("/v1/completions", json={"model": "coder", "prompt": prefix, "suffix": suffix, **body})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            r = http.post("/v1/chat/completions", json={"model": "coder", "suffix": suffix,
                                                        "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
        out = gen.generate(prefix, SamplingParams(max_tokens=8, temperature=0.0), suffix=suffix)[0]
        assert out.prompt_token_ids == prompt and out.token_ids == drawn and out.stop_reason == chain[-1]
        deltas = list(gen.stream(prefix, SamplingParams(max_tokens=8, temperature=0.0), suffix=suffix))
        assert [t for d in deltas for t in d.token_ids] == drawn and deltas[-1].finish_reason == "stop"
    finally:
        gen.close()
    from jaxinfer.cli import main        # `jaxinfer generate PREFIX --suffix SUFFIX`
    assert main(["generate", "--model", str(tmp_path / "m"), "--dtype", "float32", prefix, "--suffix", suffix,
                 "--json", "--max-tokens", "8", "--max-num-batched-tokens", "32", "--max-model-len", "128"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["token_ids"] == drawn and line["text"] == ref.decode(drawn[:-1])
