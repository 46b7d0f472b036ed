"""Chat templates (serve.chat_template) against transformers' apply_chat_template on the same local
folders: the rendered text and the token ids, for the ways checkpoints ship and write templates.

The tokenizer is a byte-level BPE trained here whose post-processor adds BOS, as Llama's and
Mistral's tokenizer.json do: a rendered chat must not get a second BOS from it.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

from jaxinfer.tokenizer import load_tokenizer

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
USER = [{"role": "user", "content": "Hi there"}]
DIALOG = USER + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "the cat?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = "the cat sat on a mat Hi there Hello assistant user system weather tool".split()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<|eot|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d = tmp_path_factory.mktemp("chat-base")
    tok.save(str(d / "tokenizer.json"))
    # generation_config lists <|eot|> first: the template's eos_token is still tokenizer_config's
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 2]}))
    return d


def folder(base: Path, tmp_path: Path, template=None, files: dict[str, str] | None = None) -> Path:
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "pad_token": "<pad>"}
    if template is not None:
        cfg["chat_template"] = template
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((base / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    for rel, text in (files or {}).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def ours(d: Path, messages, tools=None, override=None, parser=None, **flags) -> tuple[str, list[int]]:
    """flags: add_generation_prompt, continue_final_message (the request's fields); parser: the
    server's --tool-call-parser."""
    from serve.app import ServerState
    from serve.protocol import ChatCompletionRequest
    gen = SimpleNamespace(tokenizer=load_tokenizer(d), client=SimpleNamespace(max_model_len=4096))
    state = ServerState(gen, "m", None, 16, chat_template=override, tool_call_parser=parser)
    req = ChatCompletionRequest(model="m", messages=messages, tools=tools, **flags)
    text = state.render_chat_text(req.messages, req.tool_plan(), None, req.add_generation_prompt,
                                  req.continue_final_message)
    return text, state.encode_chat(text)


def theirs(d: Path, messages, tools=None, add_generation_prompt=True, **flags) -> tuple[str, list[int]]:
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(str(d))
    kw = dict(tools=tools, add_generation_prompt=add_generation_prompt, **flags)
    text = t.apply_chat_template(messages, tokenize=False, **kw)
    ids = t.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
    return text, list(ids)


@pytest.mark.parametrize("template", [
    CHATML,                                   # writes no BOS: none is added (it once got the tokenizer's)
    "{{ bos_token }}" + CHATML,               # the variable: one BOS
    "<s>" + CHATML,                           # written out: one BOS (it once had two)
    # eos_token, unk_token and pad_token by name (eos_token was generation_config's first id's)
    "{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}[{{ unk_token }}|{{ pad_token }}]",
    # transformers' {% generation %} block (the server once failed to start on it)
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}",
])
def test_rendered_and_encoded_as_transformers_does(base, tmp_path, template):
    d = folder(base, tmp_path, template)
    assert ours(d, DIALOG) == theirs(d, DIALOG)


def test_named_templates_pick_tool_use_for_tools(base, tmp_path):
    """tokenizer_config's list of named templates (Hermes-2-Pro, Command-R): a request with tools
    renders "tool_use", one without "default" (the default was rendered for both)."""
    d = folder(base, tmp_path, [
        {"name": "default", "template": "D:{% for m in messages %}{{ m['content'] }}{% endfor %}"},
        {"name": "tool_use", "template": "T:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
                                         "{% for m in messages %}{{ m['content'] }}{% endfor %}"}])
    assert ours(d, USER, TOOLS) == theirs(d, USER, TOOLS) and ours(d, USER, TOOLS)[0].startswith("T:get_weather;")
    assert ours(d, USER) == theirs(d, USER) and ours(d, USER)[0] == "D:Hi there"


def test_template_files_beat_tokenizer_config(base, tmp_path):
    """chat_template.jinja is the default over tokenizer_config's, and additional_chat_templates/
    holds the named ones (transformers' layout since 4.5x)."""
    d = folder(base, tmp_path, "CONFIG{{ messages[0]['content'] }}",
               {"chat_template.jinja": "JINJA{{ messages[0]['content'] }}",
                "additional_chat_templates/tool_use.jinja": "TOOLS{{ tools | length }}{{ messages[0]['content'] }}"})
    assert ours(d, USER) == theirs(d, USER) and ours(d, USER)[0] == "JINJAHi there"
    assert ours(d, USER, TOOLS) == theirs(d, USER, TOOLS) and ours(d, USER, TOOLS)[0] == "TOOLS1Hi there"
    saved = tmp_path / "saved"
    load_tokenizer(d).save(saved)
    assert (saved / "additional_chat_templates" / "tool_use.jinja").read_text().startswith("TOOLS")


def test_a_processors_template_when_the_tokenizer_has_none(base, tmp_path):
    """A vision-language checkpoint's template in its processor's chat_template.json (older
    transformers), none in tokenizer_config: rendered as transformers renders that template (vLLM
    takes the processor's); tokenizer_config's, where it has one, stays the default."""
    processor = "PROC{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    d = folder(base, tmp_path, None, {"chat_template.json": json.dumps({"chat_template": processor})})
    assert ours(d, DIALOG) == theirs(d, DIALOG, chat_template=processor) and ours(d, DIALOG)[0].startswith("PROC<user>")
    d = folder(base, tmp_path, "CONFIG{{ messages[0]['content'] }}")
    assert ours(d, USER)[0] == "CONFIGHi there"


def test_named_templates_without_a_default_refuse_a_request_without_tools(base, tmp_path):
    from serve.protocol import OpenAIError
    d = folder(base, tmp_path, [{"name": "tool_use", "template": "T{{ messages[0]['content'] }}"}])
    assert ours(d, USER, TOOLS)[0].startswith("T")   # (no `tools` in it: the plain tool preamble, README)
    with pytest.raises(OpenAIError) as e:
        ours(d, USER)
    assert e.value.status == 400 and "tool_use" in str(e.value)


def test_plain_template_gets_the_tokenizers_bos(base, tmp_path):
    """A model without a template renders the plain one (README), encoded by the tokenizer's own
    rule: its BOS, as transformers' tokenizer(text) adds it."""
    from transformers import AutoTokenizer
    d = folder(base, tmp_path)
    text, ids = ours(d, USER)
    assert text == "User: Hi there\nAssistant:" and ids == AutoTokenizer.from_pretrained(str(d))(text)["input_ids"]
    assert ids[0] == 1


@pytest.mark.parametrize("dummy_prefix", [True, False])
def test_sentencepiece_only_checkpoint_reads_the_templates_special_tokens(tmp_path, dummy_prefix):
    """A checkpoint with tokenizer.model and no tokenizer.json, its template writing bos_token and
    eos_token (Llama 2's layout): the rendered "<s>" and "</s>" are the BOS and EOS ids, and the text
    after them has no word marker, as transformers' Llama tokenizer (legacy=False) encodes it. They
    were read as the characters '<', 's', '>' and the prompt had no BOS at all."""
    import io
    import sentencepiece as spm
    words = "the cat sat on a mat Hi there Hello INST what is it yes no more".split()
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 8), model_writer=buf,
        vocab_size=320, model_type="bpe", byte_fallback=True, character_coverage=1.0, add_dummy_prefix=dummy_prefix,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(buf.getvalue())
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "legacy": False, "add_prefix_space": dummy_prefix, "chat_template": template}))
    text, ids = ours(tmp_path, DIALOG)
    assert (text, ids) == theirs(tmp_path, DIALOG)
    assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 1


def test_qwen3_coder_calls_round_trip_through_the_published_template(base, tmp_path):
    """Qwen3-Coder's published template (tests/data/chat_templates) renders an assistant's calls as
    XML, writing each argument by its Python type (strings as they are, numbers and booleans by str(),
    objects and arrays as JSON): our rendering equals transformers', and the qwen3_coder parser reads
    the calls transformers rendered back to the same typed arguments, by their schemas."""
    from serve.tool_parsers import default_tool_parser
    from serve.tools import parse_auto, plan_tools
    template = (Path(__file__).parent / "data" / "chat_templates" / "qwen3-coder.jinja").read_text()
    assert default_tool_parser(template) == "qwen3_coder"
    props = {"path": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
             "force": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
             "mode": {"enum": ["a", "b"]}, "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
             "note": {"type": ["string", "null"]}}
    tools = [{"type": "function", "function": {"name": "edit", "description": "edit a file",
                                               "parameters": {"type": "object", "properties": props}}}]
    args = [{"path": "a.py", "count": 3, "ratio": 0.5, "force": True, "opts": {"k": [1, 2]}, "tags": ["x", "y"],
             "mode": "b", "limit": None, "note": "two\nlines\n"},
            {"path": "  spaced  ", "count": -7, "ratio": 2, "force": False, "opts": {}, "tags": [], "mode": "a",
             "limit": 4, "note": "null"}]
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "edit", "arguments": a}}
             for i, a in enumerate(args)]
    theirs_msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "", "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "call_0", "content": "ok"}]
    ours_msgs = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                                      for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in theirs_msgs]
    d = folder(base, tmp_path, template)
    text, ids = theirs(d, theirs_msgs, tools)
    assert ours(d, ours_msgs, tools) == (text, ids)
    written = text.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    content, parsed = parse_auto(written, plan_tools(tools, None, None), "qwen3_coder")
    # (None is written "None": null again where the schema allows it; a string's "null" stays text)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in parsed] == args


def _edit_tools():
    props = {"path": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
             "force": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
             "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "note": {"type": ["string", "null"]}}
    return [{"type": "function", "function": {"name": "edit", "description": "edit a file",
                                              "parameters": {"type": "object", "properties": props}}}]


EDIT_ARGS = [{"path": "a.py", "count": 3, "ratio": 0.5, "force": True, "opts": {"k": [1, 2]}, "tags": ["x", "y"],
              "limit": None, "note": "two\nlines\n"},
             {"path": "  spaced  ", "count": -7, "ratio": 2, "force": False, "opts": {}, "tags": [], "limit": 4,
              "note": "null"}]


# OLMo 3's template quotes strings with '...' and escapes nothing; Llama 3.2's pythonic one writes each
# value with Python's "%s" (a string unquoted, a list or dict as its repr): arguments they can write back
OLMO_ARGS = [{k: v for k, v in a.items() if k != "note"} | {"note": n} for a, n in zip(EDIT_ARGS, ["it is", None])]
OLMO_ARGS[1]["path"] = "b.py"
PY_ARGS = [{k: v for k, v in a.items() if k not in ("path", "note")} for a in EDIT_ARGS]


@pytest.mark.parametrize("file,parser,section,as_text,args", [
    # DeepSeek-R1's (and V3-0324's) published template: `'...' + arguments`, so it takes the JSON text
    ("deepseek-r1.jinja", "deepseek_v3", ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"), True, EDIT_ARGS),
    ("deepseek-v3.1.jinja", "deepseek_v31", ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"), True, EDIT_ARGS),
    # Kimi K2 Thinking's: the JSON text as it is, or an object through tojson
    ("kimi-k2-thinking.jinja", "kimi_k2", ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"), True,
     EDIT_ARGS),
    ("kimi-k2-thinking.jinja", "kimi_k2", ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"), False,
     EDIT_ARGS),
    # GLM-4.5's: each argument from the object, strings as they are and other values with tojson
    ("glm-4.5.jinja", "glm45", ("<tool_call>", "</tool_call>"), False, EDIT_ARGS),
    # OLMo 3's (vLLM's copy): Python calls, one a line, JSON's true / false / null
    ("olmo3.jinja", "olmo3", ("<function_calls>", "</function_calls>"), False, OLMO_ARGS),
    # Llama 3.2's pythonic one (vLLM's): a Python list of calls
    ("llama3.2-pythonic.jinja", "pythonic", ("[", "]"), False, PY_ARGS),
])
def test_family_calls_round_trip_through_the_published_templates(base, tmp_path, file, parser, section, as_text, args):
    """DeepSeek-V3 / R1, DeepSeek-V3.1, Kimi K2, GLM-4.5, OLMo 3 and Llama 3.2 (pythonic) templates
    (tests/data/chat_templates) render an assistant's two calls as transformers renders them
    (arguments as the JSON text or as the object, whichever form the template takes): the server's
    rendering of the same request, whose client sends the arguments as JSON text, equals it; the
    template picks the family's parser, which reads the calls transformers rendered back to the same
    arguments (and, for Kimi, the same ids)."""
    from serve.tool_parsers import default_tool_parser
    from serve.tools import FAMILY_PREAMBLES, parse_auto, plan_tools
    template = (Path(__file__).parent / "data" / "chat_templates" / file).read_text()
    # (DeepSeek's format is the default where the tokenizer has its markers, which this one lacks)
    assert default_tool_parser(template, lambda t: 7) == parser
    tools = _edit_tools()
    ids = [f"functions.edit:{i}" for i in range(len(args))]
    calls = [{"id": i, "type": "function", "function": {"name": "edit", "arguments": json.dumps(a) if as_text else a}}
             for i, a in zip(ids, args)]
    theirs_msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "", "tool_calls": calls},
                   {"role": "tool", "tool_call_id": ids[0], "content": "ok"}]
    ours_msgs = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(a)}}
                                      for c, a in zip(calls, args)]} if m.get("tool_calls") else m
                 for m in theirs_msgs]
    if "tools" not in template:    # DeepSeek's list no tools: the server's system message asks for their format
        theirs_msgs = [{"role": "system", "content": FAMILY_PREAMBLES[parser].format(
            tools="\n".join(json.dumps(t) for t in tools))}] + theirs_msgs
    d = folder(base, tmp_path, template)
    text, ids_ = theirs(d, theirs_msgs, tools)
    assert ours(d, ours_msgs, tools, parser=parser) == (text, ids_)
    written = text[text.index(section[0], text.index("Hi there")):text.rindex(section[1]) + len(section[1])]
    content, parsed = parse_auto(written, plan_tools(tools, None, None), parser)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in parsed] == args
    if parser == "kimi_k2":
        assert [c["id"] for c in parsed] == ids


@pytest.mark.parametrize("template", [CHATML, CHATML.replace("m['content']", "m['content'] | trim")])
@pytest.mark.parametrize("last", ["The cat sat", "The cat sat "])
def test_no_generation_prompt_and_continue_final_message_as_transformers(base, tmp_path, template, last):
    """vLLM's add_generation_prompt false and continue_final_message (a prefilled reply the model
    continues): the text and ids transformers' apply_chat_template makes, for a template that keeps
    the message's trailing space and one that trims it."""
    from serve.protocol import OpenAIError
    d = folder(base, tmp_path, template)
    assert ours(d, DIALOG, add_generation_prompt=False) == theirs(d, DIALOG, add_generation_prompt=False)
    prefilled = USER + [{"role": "assistant", "content": last}]
    want = theirs(d, prefilled, add_generation_prompt=False, continue_final_message=True)
    assert ours(d, prefilled, add_generation_prompt=False, continue_final_message=True) == want
    assert want[0].rstrip().endswith("The cat sat") and "<|im_end|>" not in want[0][-12:]
    with pytest.raises(OpenAIError) as e:       # vLLM's rule: not both
        ours(d, prefilled, continue_final_message=True)
    assert e.value.param == "continue_final_message"


RAG = ("{% if documents %}{% for d in documents %}{{ '[' + d['title'] + '] ' + d['text'] + '\\n' }}{% endfor %}"
       "{% endif %}") + CHATML
DOCS = [{"title": "cats", "text": "the cat sat on a mat"}, {"title": "weather", "text": "Hi there"}]


def ours_request(d: Path, trust: bool, **body) -> tuple[str, list[int]]:
    """A chat body through ServerState's template choice (request_template), rendering and encoding."""
    from serve.app import ServerState
    from serve.protocol import ChatCompletionRequest
    gen = SimpleNamespace(tokenizer=load_tokenizer(d), client=SimpleNamespace(max_model_len=4096))
    state = ServerState(gen, "m", None, 16, trust_request_chat_template=trust)
    req = ChatCompletionRequest(model="m", **body)
    template, kwargs = state.request_template(req)
    text = state.render_chat_text(req.messages, None, kwargs, documents=req.documents, template=template)
    return text, state.encode_chat(text, own_template=template is not None)


@pytest.mark.parametrize("own", ["field", "kwargs"])
def test_documents_and_a_request_template_as_transformers(base, tmp_path, own):
    """vLLM's documents (a RAG template's input) and a request's own chat_template, under
    --trust-request-chat-template: the text and ids of transformers' apply_chat_template(documents=,
    chat_template=); untrusted, a request template is vLLM's 400 naming the field it came in."""
    from serve.protocol import OpenAIError
    d = folder(base, tmp_path, CHATML)
    body = ({"chat_template": RAG} if own == "field" else {"chat_template_kwargs": {"chat_template": RAG}})
    want = theirs(d, USER, documents=DOCS, chat_template=RAG)
    assert want[0].startswith("[cats] the cat sat on a mat\n[weather] Hi there\n<|im_start|>user")
    assert ours_request(d, True, messages=USER, documents=DOCS, **body) == want
    # the model's own template does not read documents: as transformers renders it
    assert ours_request(d, True, messages=USER, documents=DOCS) == theirs(d, USER, documents=DOCS)
    with pytest.raises(OpenAIError) as e:
        ours_request(d, False, messages=USER, **body)
    assert e.value.param == ("chat_template" if own == "field" else "chat_template_kwargs")
    assert "--trust-request-chat-template" in e.value.message
    with pytest.raises(OpenAIError) as e:
        ours_request(d, True, messages=USER, chat_template="{% for %}")
    assert e.value.param == "chat_template"



def test_tokenize_messages_with_vllm_options_as_transformers(base, tmp_path):
    """vLLM's /tokenize with messages (ServerState.tokenize_chat): add_generation_prompt false,
    continue_final_message, documents and chat_template_kwargs give the ids transformers'
    apply_chat_template gives (the ids a chat request would send); template options on a prompt,
    or both flags, are a 400 naming the field."""
    import pydantic

    from serve.app import ServerState
    from serve.protocol import TokenizeRequest
    template = "{% if greeting %}{{ greeting }}\n{% endif %}" + RAG
    d = folder(base, tmp_path, template)
    gen = SimpleNamespace(tokenizer=load_tokenizer(d), client=SimpleNamespace(max_model_len=4096))
    state = ServerState(gen, "m", None, 16)
    prefilled = USER + [{"role": "assistant", "content": "The cat"}]
    for body, kw in (({"messages": DIALOG}, {}),
                     ({"messages": DIALOG, "add_generation_prompt": False}, {"add_generation_prompt": False}),
                     ({"messages": prefilled, "add_generation_prompt": False, "continue_final_message": True},
                      {"add_generation_prompt": False, "continue_final_message": True}),
                     ({"messages": USER, "documents": DOCS, "chat_template_kwargs": {"greeting": "Hello"}},
                      {"documents": DOCS, "greeting": "Hello"})):
        kw = {"add_generation_prompt": True, **kw}
        assert state.tokenize_chat(TokenizeRequest(**body)) == theirs(d, body["messages"], **kw)[1], body
    for body, param in (({"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
                        ({"messages": prefilled, "continue_final_message": True}, "continue_final_message")):
        with pytest.raises(pydantic.ValidationError, match=param):
            TokenizeRequest(**body)


@pytest.mark.parametrize("text", ["Editing both.", ""])
def test_llama4_published_template_calls_read_back(text):
    """transformers' Llama 4 chat template (the uploads' own, processing_llama4.chat_template) picks
    llama4_json; an assistant turn with text and two calls as transformers renders it (the text between
    `<|python_start|>` and `<|python_end|>`, then the objects one after another) reads back as that
    text and the same two calls."""
    from transformers.models.llama4.processing_llama4 import chat_template
    from transformers.utils.chat_template_utils import render_jinja_template

    from serve.tool_parsers import default_tool_parser
    from serve.tools import parse_auto, plan_tools
    assert default_tool_parser(chat_template) == "llama4_json"
    tools = _edit_tools()
    calls = [{"type": "function", "function": {"name": "edit", "arguments": a}} for a in EDIT_ARGS]
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": text, "tool_calls": calls}]
    (rendered,), _ = render_jinja_template([msgs], tools=tools, chat_template=chat_template, bos_token="<s>")
    header = "<|header_start|>assistant<|header_end|>\n\n"
    written = rendered[rendered.rindex(header) + len(header):rendered.rindex("<|eot|>")]
    assert written.startswith("<|python_start|>")
    content, parsed = parse_auto(written, plan_tools(tools, None, None), "llama4_json")
    assert content == (text or None) and [json.loads(c["function"]["arguments"]) for c in parsed] == EDIT_ARGS
