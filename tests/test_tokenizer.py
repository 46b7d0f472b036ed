"""Tests for jaxinfer.tokenizer against the sentencepiece / tokenizers libraries' own decode and
hand-written expectations. Both tokenizers are trained locally on generated text (no hub)."""

from __future__ import annotations

import io
import json
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxinfer.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
    find_stop,
    hold_back,
    load_tokenizer,
)

WORDS = ("the cat sat on a mat and dog ran fast over big red hill while birds sing loudly in "
         "morning light people walk talk eat drink code python token model stream text byte "
         "Hello world This is a test of streaming").split()

# Leading/multiple spaces, newlines and chars outside the training alphabet (byte fallback /
# multi-byte byte-level tokens).
TEXTS = [
    "Hello world",
    " leading space and  two   spaces",
    "line one\nline two\n\n  indented",
    "naïve café — 日本語 🙂",
    "🙂🙂 emoji then text: the cat 🐈‍⬛ sat",
    "mixed 123 digits, punctuation! and ünïcödé\tTabs",
]


def _corpus() -> list[str]:
    rng = random.Random(0)
    lines = []
    for i in range(400):
        s = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15)))
        if i % 7 == 0:
            s = s.capitalize() + "."
        if i % 11 == 0:
            s += "  " + str(rng.randint(0, 9999))
        if i % 13 == 0:
            s += ", then: " + rng.choice(WORDS) + "!"
        lines.append(s)
    return lines


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    buf = io.BytesIO()
    # Llama-style settings: identity normalization and no whitespace collapsing so that decode is
    # an exact inverse of encode; chars outside the corpus go through byte fallback.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=0.995, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, split_digits=True,
        pad_id=3, minloglevel=2)
    d = tmp_path_factory.mktemp("sp")
    (d / "tokenizer.model").write_bytes(buf.getvalue())
    return d


@pytest.fixture(scope="module")
def sp_tok(sp_dir: Path) -> Tokenizer:
    tok = load_tokenizer(sp_dir)
    assert tok is not None
    return tok


@pytest.fixture(scope="module")
def ref_sp(sp_dir: Path) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<s>", "</s>", "<pad>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    d = tmp_path_factory.mktemp("hf")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "lstrip": False, "rstrip": False, "special": True},
        "pad_token": "<pad>",
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return d


@pytest.fixture(scope="module")
def hf_tok(hf_dir: Path) -> Tokenizer:
    tok = load_tokenizer(hf_dir)
    assert tok is not None
    return tok


@pytest.fixture(scope="module")
def ref_hf(hf_dir: Path) -> HFTokenizer:
    return HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))


def stream(tok: Tokenizer, ids: Sequence[int], prompt: Sequence[int] = (), skip: bool = True
           ) -> tuple[list[str], str]:
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [det.add(i) for i in ids]
    tail = det.flush()
    assert det.text == "".join(deltas) + tail
    return deltas, tail


# ---------------------------------------------------------------- SentencePiece


def test_sp_metadata(sp_tok: Tokenizer, ref_sp: spm.SentencePieceProcessor, sp_dir: Path) -> None:
    assert sp_tok.kind == "sentencepiece"
    assert sp_tok.vocab_size == ref_sp.get_piece_size() == 400
    assert (sp_tok.bos_id, sp_tok.eos_ids, sp_tok.pad_id) == (1, (2,), 3)
    assert sp_tok.add_bos and sp_tok.chat_template is None
    assert sp_tok.files == [sp_dir / "tokenizer.model"]
    assert sp_tok.id_to_piece(1) == "<s>" and sp_tok.id_to_piece(10**6) == ""


@pytest.mark.parametrize("text", TEXTS)
def test_sp_roundtrip(sp_tok: Tokenizer, ref_sp: spm.SentencePieceProcessor, text: str) -> None:
    ids = sp_tok.encode(text)
    assert ids[0] == 1 and ids[1:] == ref_sp.encode(text)
    assert sp_tok.encode(text, add_special_tokens=False) == ids[1:]
    assert sp_tok.decode(ids) == ref_sp.decode(ids) == text
    assert sp_tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_sp_byte_fallback_used(sp_tok: Tokenizer) -> None:
    pieces = [sp_tok.id_to_piece(i) for i in sp_tok.encode("日本語 🙂", False)]
    assert "<0xF0>" in pieces and "<0xE6>" in pieces


def test_sp_decode_specials_inline(sp_tok: Tokenizer) -> None:
    a, b = sp_tok.encode("the cat", False), sp_tok.encode("the dog", False)
    ids = [1] + a + [2] + b + [2]
    assert sp_tok.decode(ids) == "the cat the dog"
    assert sp_tok.decode(ids, skip_special_tokens=False) == "<s>the cat</s> the dog</s>"
    assert sp_tok.decode(a + [10**6]) == "the cat"  # padded-vocab ids are dropped


def test_sp_stream_keeps_the_space_after_a_control_token(sp_tok: Tokenizer) -> None:
    """skip_special_tokens=False with the word marker (add_dummy_prefix, Llama's default): a word
    after a control token streams with its space, as the whole decode and the hand-written text
    have it (the window once began at the control token, and SentencePiece drops a window's first
    word marker)."""
    a, b = sp_tok.encode("the cat", False), sp_tok.encode("the dog ran", False)
    for special in (1, 3):                   # <s>, <pad>
        ids = a + [special] + b
        want = f"the cat{sp_tok.id_to_piece(special)} the dog ran"
        assert sp_tok.decode(ids, skip_special_tokens=False) == want
        for k in range(len(ids)):            # any prompt split
            deltas, tail = stream(sp_tok, ids[k:], ids[:k], skip=False)
            assert sp_tok.decode(ids[:k], skip_special_tokens=False) + "".join(deltas) + tail == want, k


@pytest.mark.parametrize("text", TEXTS)
def test_sp_stream_equals_decode(sp_tok: Tokenizer, ref_sp: spm.SentencePieceProcessor,
                                 text: str) -> None:
    ids = sp_tok.encode(text, add_special_tokens=False)
    deltas, tail = stream(sp_tok, ids)
    assert "".join(deltas) + tail == ref_sp.decode(ids) == text
    assert tail == ""
    assert not any("\ufffd" in d for d in deltas)
    # With BOS and trailing EOS the specials are skipped the same way as in decode().
    deltas, tail = stream(sp_tok, [1] + ids + [2])
    assert "".join(deltas) + tail == text


def test_sp_stream_leading_space_kept(sp_tok: Tokenizer) -> None:
    ids = sp_tok.encode("the cat sat", add_special_tokens=False)
    deltas, _ = stream(sp_tok, ids)
    assert deltas[0] == "the"  # first piece "▁the": dummy-prefix space is dropped, as decode does
    assert "".join(deltas[1:]).startswith(" ")


def _check_prompt_splits(tok: Tokenizer, ref_decode: Callable[[list[int]], str],
                         ids: list[int]) -> int:
    """Stream ids[k:] after prompt ids[:k] for every k, against the library's full decode."""
    checked = 0
    full = ref_decode(ids)
    for k in range(1, len(ids)):
        head = ref_decode(ids[:k])
        # Only well-defined where the prompt ends on a char boundary.
        if head.endswith("\ufffd") or not full.startswith(head):
            continue
        deltas, tail = stream(tok, ids[k:], prompt=ids[:k])
        assert "".join(deltas) + tail == full[len(head):], (k, deltas)
        assert not any("\ufffd" in d for d in deltas)
        checked += 1
    return checked


def test_sp_stream_with_prompt(sp_tok: Tokenizer, ref_sp: spm.SentencePieceProcessor) -> None:
    ids = sp_tok.encode("The cat sat.\n  naïve café — 日本語 🙂 the end")
    assert _check_prompt_splits(sp_tok, ref_sp.decode, ids) > 10
    # The first generated token's leading space survives relative to the prompt.
    ids = sp_tok.encode("the cat sat")
    j = next(j for j in range(2, len(ids)) if sp_tok.id_to_piece(ids[j]).startswith("\u2581"))
    deltas, _ = stream(sp_tok, ids[j:], prompt=ids[:j])
    assert deltas[0].startswith(" ") and sp_tok.decode(ids[:j]) + "".join(deltas) == "the cat sat"


# ---------------------------------------------------------------- HF tokenizer.json


def test_hf_metadata(hf_tok: Tokenizer, ref_hf: HFTokenizer, hf_dir: Path) -> None:
    assert hf_tok.kind == "hf"
    assert hf_tok.vocab_size == ref_hf.get_vocab_size()
    assert hf_tok.bos_id == 0 and hf_tok.pad_id == 2
    assert hf_tok.eos_ids == (1, 3)  # generation_config list first, then tokenizer_config's </s>
    assert hf_tok.chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert hf_tok.add_bos
    assert [f.name for f in hf_tok.files] == [
        "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    assert hf_tok.id_to_piece(1) == "</s>"


@pytest.mark.parametrize("text", TEXTS)
def test_hf_roundtrip_and_stream(hf_tok: Tokenizer, ref_hf: HFTokenizer, text: str) -> None:
    ids = hf_tok.encode(text)
    assert ids == ref_hf.encode(text).ids and ids[0] == 0
    assert hf_tok.encode(text, add_special_tokens=False) == ids[1:]
    assert hf_tok.decode(ids) == ref_hf.decode(ids) == text
    deltas, tail = stream(hf_tok, ids)
    assert "".join(deltas) + tail == text and tail == ""
    assert not any("\ufffd" in d for d in deltas)


def test_hf_multibyte_held_back(hf_tok: Tokenizer) -> None:
    ids = hf_tok.encode("🙂", add_special_tokens=False)
    assert len(ids) == 4  # one byte-level token per UTF-8 byte: never trained on emoji
    det = IncrementalDetokenizer(hf_tok)
    assert [det.add(i) for i in ids] == ["", "", "", "🙂"]
    # A stream cut mid-character emits the replacement char only at flush().
    det = IncrementalDetokenizer(hf_tok)
    assert [det.add(i) for i in ids[:2]] == ["", ""]
    assert det.flush() == hf_tok.decode(ids[:2]) == "\ufffd"


def test_hf_stream_with_prompt(hf_tok: Tokenizer, ref_hf: HFTokenizer) -> None:
    ids = hf_tok.encode("the cat 日本語 🙂 sat on\n the mat 🐈")
    assert _check_prompt_splits(hf_tok, ref_hf.decode, ids) > 10


@pytest.fixture(scope="module")
def fallback_dir(tmp_path_factory: pytest.TempPathFactory, sp_dir: Path) -> Path:
    """A Llama-2 / Mistral style tokenizer.json: the SentencePiece model above as BPE with byte
    fallback, Metaspace, and the ByteFallback decoder (which turns a whole run of byte pieces into
    U+FFFD per byte when the run is not UTF-8)."""
    from transformers.convert_slow_tokenizer import SentencePieceExtractor
    kw = SentencePieceExtractor(str(sp_dir / "tokenizer.model")).extract(models.BPE)
    tok = HFTokenizer(models.BPE(vocab=kw["vocab"], merges=kw["merges"], unk_token="<unk>", fuse_unk=True,
                                 byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    d = tmp_path_factory.mktemp("fallback")
    tok.save(str(d / "tokenizer.json"))
    return d


def test_byte_fallback_stream_after_a_prompt_of_byte_pieces(fallback_dir: Path) -> None:
    """A prompt that ends in characters spelled as byte pieces, and an output that goes on in such
    characters, streams exactly the tokenizers library's decode (the window of context once began
    mid-character, and every generated byte piece came out as U+FFFD)."""
    tok, ref = load_tokenizer(fallback_dir), HFTokenizer.from_file(str(fallback_dir / "tokenizer.json"))
    assert tok is not None
    for head, tail_text in (("Reply in emoji: 😀😀", "🎉🎉 done"), ("日本語", "のテキスト")):
        prompt, ids = tok.encode(head), tok.encode(head + tail_text)
        assert ids[:len(prompt)] == prompt and any(tok.id_to_piece(i).startswith("<0x") for i in prompt[-5:])
        deltas, tail = stream(tok, ids[len(prompt):], prompt)
        assert "".join(deltas) + tail == ref.decode(ids)[len(ref.decode(prompt)):] == tail_text
    assert _check_prompt_splits(tok, ref.decode, tok.encode("naïve 😀😀 café — 日本語 🙂🎉 the end")) > 10


def test_hf_special_tokens(hf_tok: Tokenizer, ref_hf: HFTokenizer) -> None:
    ids = [0] + hf_tok.encode("the cat", False) + [3, 1] + hf_tok.encode(" 日本", False) + [1]
    assert hf_tok.decode(ids) == "the cat 日本"
    assert hf_tok.decode(ids, skip_special_tokens=False) == "<s>the cat<|eot|></s> 日本</s>"
    for skip in (True, False):
        deltas, tail = stream(hf_tok, ids, skip=skip)
        assert "".join(deltas) + tail == ref_hf.decode(ids, skip_special_tokens=skip)


# ---------------------------------------------------------------- loading / saving


def test_no_tokenizer_returns_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def test_corrupt_files_raise(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(b"\x00garbage, not a ModelProto\xff" * 10)
    with pytest.raises(TokenizerError, match="tokenizer.model"):
        load_tokenizer(tmp_path)
    assert issubclass(TokenizerError, ValueError)
    (tmp_path / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_corrupt_side_file_raises(tmp_path: Path, sp_dir: Path) -> None:
    shutil.copy(sp_dir / "tokenizer.model", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)


def test_prefers_tokenizer_json(tmp_path: Path, sp_dir: Path, hf_dir: Path) -> None:
    shutil.copy(sp_dir / "tokenizer.model", tmp_path)
    shutil.copy(hf_dir / "tokenizer.json", tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok is not None and tok.kind == "hf"


def test_sp_with_side_files(tmp_path: Path, sp_dir: Path) -> None:
    shutil.copy(sp_dir / "tokenizer.model", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False,
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    }))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<pad>"}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    tok = load_tokenizer(tmp_path)
    assert tok is not None
    assert tok.chat_template == "D" and not tok.add_bos
    assert tok.eos_ids == (3, 2) and tok.bos_id == 1
    assert tok.encode("the cat")[0] != 1

    out = tmp_path / "out" / "nested"
    tok.save(out)
    assert sorted(p.name for p in out.iterdir()) == [
        "generation_config.json", "special_tokens_map.json", "tokenizer.model",
        "tokenizer_config.json"]
    tok2 = load_tokenizer(out)
    assert tok2 is not None and tok2.encode("naïve 🙂") == tok.encode("naïve 🙂")
    assert tok2.eos_ids == (3, 2)  # the SentencePiece model's own </s> is still an eos
    assert not (out / "config.json").exists()  # the model's config is not the tokenizer's to copy
    tok.save(tmp_path)  # saving onto its own files is harmless


def test_hf_save_roundtrip(tmp_path: Path, hf_tok: Tokenizer) -> None:
    hf_tok.save(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok is not None
    assert (tok.eos_ids, tok.chat_template) == (hf_tok.eos_ids, hf_tok.chat_template)
    assert tok.encode("日本 🙂") == hf_tok.encode("日本 🙂")


def test_module_does_not_import_jax() -> None:
    import jaxinfer.tokenizer as mod

    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('tok', {mod.__file__!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "assert 'jax' not in sys.modules and 'sentencepiece' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- stop strings


def test_find_stop_basic() -> None:
    assert find_stop("hello world", ["xyz"]) is None
    assert find_stop("hello world", []) is None
    assert find_stop("hello world", ["world", "lo"]) == 3  # earliest start wins
    assert find_stop("hello world", ["", "o"]) == 4  # empty stops are ignored


def test_find_stop_spanning_deltas() -> None:
    text = ""
    found = None
    for delta in ["The answer", " is 4", "2.\n\nUs", "er: next"]:
        start = len(text)
        text += delta
        found = find_stop(text, ["\n\nUser:", "###"], start)
        if found is not None:
            break
    assert found == text.index("\n\nUser:") and text[found:].startswith("\n\nUser:")


def test_find_stop_start_window() -> None:
    # "ab" ends at index 2 < start=4 in text "abxxab": already checked, so the new one is found.
    assert find_stop("abxxab", ["ab"], start=4) == 4
    assert find_stop("abxxab", ["ab"], start=5) == 4  # spans the boundary
    assert find_stop("abxxab", ["ab"], start=6) is None
    assert find_stop("xxxab", ["xab", "b"], start=4) == 2  # several stops: earliest start wins


def test_hold_back() -> None:
    assert hold_back("hello", ["STOP"]) == 0
    assert hold_back("hello S", ["STOP"]) == 1
    assert hold_back("hello ST", ["STOP"]) == 2
    assert hold_back("hello STO", ["STOP"]) == 3
    assert hold_back("hello STOP", ["STOP"]) == 0  # a complete stop is find_stop's business
    assert hold_back("ab", ["abc", "b!"]) == 2  # overlapping prefixes: the longest wins
    assert hold_back("xab", ["abab"]) == 2
    assert hold_back("aa", ["aab"]) == 2
    assert hold_back("a", ["aaa"]) == 1
    assert hold_back("", ["x"]) == 0 and hold_back("abc", []) == 0 and hold_back("a", [""]) == 0


def test_stream_with_stops_end_to_end() -> None:
    # The engine's pattern: emit text minus what hold_back reserves, stop at find_stop.
    stops = ["</answer>", "\n\n"]
    out, text, emitted = [], "", 0
    for delta in ["Forty", " two</", "ans", "wer> trailing"]:
        start = len(text)
        text += delta
        idx = find_stop(text, stops, start)
        end = idx if idx is not None else len(text) - hold_back(text, stops)
        out.append(text[emitted:end])
        emitted = end
        if idx is not None:
            break
    assert out == ["Forty", " two", "", ""] and "".join(out) == "Forty two"


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_into_the_texts_utf8(sp_tok: Tokenizer, hf_tok: Tokenizer, text: str) -> None:
    """Each token's bytes (OpenAI's logprobs `bytes`), joined, are the text's own UTF-8: byte-level
    pieces and byte-fallback pieces of split multi-byte characters included; SentencePiece adds its
    dummy-prefix space in front."""
    hf = b"".join(hf_tok.token_bytes(i) for i in hf_tok.encode(text, add_special_tokens=False))
    assert hf == text.encode()
    sp = b"".join(sp_tok.token_bytes(i) for i in sp_tok.encode(text, add_special_tokens=False))
    assert sp == (" " + text).encode() if text else sp == b""
    assert sp_tok.token_bytes(1) == b"<s>" and hf_tok.token_bytes(0) == hf_tok.id_to_piece(0).encode()


# ---------------------------------------------------------------- truncation (vLLM's truncate_prompt_tokens)


def test_hf_truncation_equals_transformers(hf_dir: Path, hf_tok: Tokenizer) -> None:
    """encode(truncate=N) and encode_pair(truncate=N) equal transformers' tokenizer(text[, pair],
    truncation=True, max_length=N) on either truncation side: the special tokens stay, a pair's
    longer text loses tokens first (longest_first)."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    texts = [TEXTS[0], TEXTS[3], " ".join(_corpus()[:3])]
    for side in ("right", "left"):
        ref.truncation_side = side
        for a in texts:
            full = ref(a)["input_ids"]
            for n in sorted({2, 3, max(2, len(full) // 2), max(2, len(full) - 1), len(full), len(full) + 5}):
                assert hf_tok.encode(a, truncate=n, side=side) == ref(a, truncation=True, max_length=n)["input_ids"]
            for b in texts:
                for n in (4, 7, 12, 30):
                    want = ref(a, b, truncation=True, max_length=n)["input_ids"]
                    assert hf_tok.encode_pair(a, b, truncate=n, side=side) == want, (side, n)
    # as many tokens as the specials: the specials alone (transformers' too); fewer: refused
    ref.truncation_side = "right"
    assert hf_tok.encode_pair(texts[0], texts[1], truncate=2) == ref(texts[0], texts[1], truncation=True,
                                                                     max_length=2)["input_ids"]
    with pytest.raises(ValueError, match="special token"):
        hf_tok.encode_pair(texts[0], texts[1], truncate=1)


def test_longest_first_is_the_tokenizers_librarys_rule() -> None:
    """longest_first (the SentencePiece path's pair truncation) keeps what the tokenizers library's
    own longest_first truncation keeps, over every pair of lengths and budget up to 12."""
    from jaxinfer.tokenizer import longest_first
    lib = HFTokenizer(models.WordLevel({f"w{i}": i for i in range(30)}, unk_token="w0"))
    lib.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    for n1 in range(1, 10):
        for n2 in range(1, 10):
            a, b = " ".join(f"w{i}" for i in range(n1)), " ".join(f"w{10 + i}" for i in range(n2))
            for budget in range(2, 13):
                lib.enable_truncation(budget, strategy="longest_first")
                seq = lib.encode(a, b).sequence_ids
                assert longest_first([n1, n2], budget) == [seq.count(0), seq.count(1)], (n1, n2, budget)


def test_sp_truncation_keeps_bos(sp_tok: Tokenizer, ref_sp: spm.SentencePieceProcessor) -> None:
    """A SentencePiece model that adds BOS: BOS, then the text's first (right) or last (left) N - 1
    pieces, as transformers' Llama tokenizer truncates; a pair: BOS a BOS b, each text cut to what
    longest_first keeps."""
    from jaxinfer.tokenizer import longest_first
    a, b = TEXTS[0], TEXTS[2]
    pa, pb = ref_sp.encode(a), ref_sp.encode(b)
    bos = sp_tok.bos_id
    assert sp_tok.add_bos and bos is not None
    assert sp_tok.encode(a, truncate=2) == [bos, pa[0]]
    assert sp_tok.encode(a, truncate=2, side="left") == [bos, pa[-1]]
    assert sp_tok.encode(a, truncate=100) == [bos, *pa]
    ka, kb = longest_first([len(pa), len(pb)], 6 - 2)
    assert sp_tok.encode_pair(a, b, truncate=6) == [bos, *pa[:ka], bos, *pb[:kb]]
    assert sp_tok.encode_pair(a, b, truncate=6, side="left") == [bos, *pa[len(pa) - ka:], bos, *pb[len(pb) - kb:]]


def test_truncation_and_padding_saved_in_tokenizer_json_are_not_applied(tmp_path: Path, hf_dir: Path) -> None:
    """tokenizer.json may carry a truncation (BERT exports: 512) or a fixed padding; transformers'
    tokenizer(text) applies neither unless asked, and neither does encode."""
    transformers = pytest.importorskip("transformers")
    lib = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    lib.enable_truncation(3)
    lib.enable_padding(length=40, pad_id=2, pad_token="<pad>")
    (tmp_path / "tokenizer.json").write_text(lib.to_str())
    text = " ".join(_corpus()[:2])
    want = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))(text)["input_ids"]
    assert load_tokenizer(tmp_path).encode(text) == want and len(want) > 3 and 2 not in want


# ---------------------------------------------------------------- Kimi's tiktoken vocabulary

# tokenization_kimi.py's TikTokenTokenizer.pat_str, as Moonshot's repositories ship it
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_TEXTS = ["Hello WORLD, it's I'M fine", "价格是1234567元，東京タワーに行きました", "[BOS]hi<|im_end|><|im_user|>x",
              "  \n\n\tcode(x) = y;\r\n  ", "naïve café ÜBER 😀 emojis", "<|reserved_token_300|>z", ""]


def test_kimi_tiktoken_vocabulary_matches_tiktoken(tmp_path, monkeypatch) -> None:
    """A folder with Kimi's tiktoken.model (no tokenizer.json; auto_map names
    tokenization_kimi.TikTokenTokenizer) encodes and decodes as tiktoken does with Kimi's pattern and
    specials (added_tokens_decoder's at ids from the vocabulary's size on, <|reserved_token_ID|> for
    the unnamed, all matched in text: TikTokenTokenizer.encode's allowed_special="all"); no BOS is
    added (its encode adds none). The rebuilt tokenizer is cached and read back the same."""
    import base64

    import tiktoken
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "cache"))
    lines = [" ".join(random.Random(i).choices(["the", "The", "QUICK", "fox's", "价格", "東京", "12345", "café",
                                                 "naïve", "(x)", "=", "\n", "  ", "😀", "don't"], k=12))
             for i in range(300)]
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    chars = {v: k for k, v in _gpt2_bytes().items()}
    ranks = {bytes(chars[c] for c in bpe.id_to_token(i)): i for i in range(bpe.get_vocab_size())}
    folder = tmp_path / "kimi"
    folder.mkdir()
    (folder / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    n = len(ranks)
    # one id past Moonshot's 256 reserved ones named too (copies of the code that reserve 2 more), and a
    # token marked not special (kept by decode's skip_special_tokens)
    named = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>", n + 3: "<|im_user|>", n + 5: "[EOT]", n + 6: "<think>",
             n + 256: "<|extra|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}, "bos_token": "[BOS]",
        "eos_token": "[EOS]", "added_tokens_decoder": {str(i): {"content": c, "special": c != "<think>"}
                                                       for i, c in named.items()}}))
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 257)}
    ref = tiktoken.Encoding(name="kimi", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=specials)
    for attempt in ("built", "cached"):
        tok = load_tokenizer(folder)
        assert (tok.bos_id, tok.eos_ids, tok.add_bos, tok.vocab_size) == (n, (n + 1,), False, n + 257), attempt
        for text in KIMI_TEXTS + ["<think>a</think>[EOS]<|extra|>"]:
            ids = ref.encode(text, allowed_special="all")
            assert tok.encode(text) == ids, (attempt, text)
            assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)
            kept = [i for i in ids if i < n or i == n + 6]   # the vocabulary's tokens and <think>
            assert tok.decode(ids) == ref.decode(kept), (attempt, text)
    assert len(list((tmp_path / "cache" / "tiktoken").glob("*.json"))) == 1
    (folder / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tok.Other", None]}}))
    with pytest.raises(TokenizerError, match="is not 'tokenization_kimi.TikTokenTokenizer'"):
        load_tokenizer(folder)


def _gpt2_bytes() -> dict[int, str]:
    """GPT-2's byte -> character table, from the tokenizers library's ByteLevel alphabet: the printable
    bytes stand for themselves, the others for 256 + their order among the unprintable ones."""
    printable = {ord(c) for c in pre_tokenizers.ByteLevel.alphabet() if ord(c) < 256}
    out, extra = {}, 0
    for b in range(256):
        out[b] = chr(b) if b in printable else chr(256 + extra)
        extra += b not in printable
    return out
