"""Agents (issue #56): reasoning parsers, per-family tool-call parsers, chat_template_kwargs and the
Responses API, driven end to end by the official `openai` client.

The model is a tiny Llama whose weights make it write a known text (a "bigram" model): every layer's
output projections are zero, so the residual stream is the current token's embedding; the chain's
tokens have one-hot embeddings and lm_head row b holds 10x the embedding of the token before b, so
the next token after a is b with a logit of 80 against 0. Its SentencePiece vocabulary has each piece
of the texts below as one user-defined symbol, among them the last token of each family's generation
prompt (the published templates in tests/data/chat_templates): so a Qwen3 prompt makes it write a
Qwen3 reply, a Llama 3.1 prompt a Llama JSON call, and so on. The expected outputs are the texts
here (what the model is built to write), split and parsed by hand (the field values below); token
counts come from SentencePiece. A prompt's rendering is compared with transformers'
apply_chat_template on the same template.

One engine (one compilation) serves every app: each test builds the app for its family (template and
parsers) in process and talks to it through starlette's TestClient, which the openai client takes as
its http client.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from tests.hf_models import TEXT_WORDS

openai = pytest.importorskip("openai")

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "the city"}},
                                               "required": ["city"]}}}]
USER = [{"role": "user", "content": "weather in Paris?"}]
QWEN_CALL = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
# start token (the last token of a generation prompt) -> what the model writes after it
CHAINS = {
    # Qwen3, thinking; the closing tag split over two tokens
    "<|im_start|>assistant\n": ["<think>", "\nThe user wants the weather.\n", "</thi", "nk>\n\n", "<tool_call>",
                                QWEN_CALL, "</tool_call>"],
    # Qwen3 with enable_thinking false: its generation prompt ends with the closed block
    "<think>\n\n</think>\n\n": ["It is sunny in Paris."],
    # DeepSeek-R1: the template opens <think> itself
    "<｜Assistant｜><think>\n": ["Two and two make four.", "</think>", "\n\nThe answer is 4."],
    "<|start_header_id|>assistant<|end_header_id|>\n\n": ['{"name": "get_weather", "parameters": {"city": "Paris"}}'],
    "[/INST]": ["[TOOL_CALLS]", ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]'],
    "<|start|>assistant": ["<|channel|>analysis<|message|>", "The user asks for the weather.",
                           "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
                           "<|constrain|>json<|message|>", '{"city":"Paris"}', "<|call|>"],
    # Kimi K2 Thinking: reasoning with no opening tag, ended by the tool-call section
    "<|im_assistant|>assistant<|im_middle|>": ["Kimi looks up the weather.", "<|tool_calls_section_begin|>",
                                               "<|tool_call_begin|>", "functions.get_weather:0",
                                               "<|tool_call_argument_begin|>", '{"city": "Paris"}', "<|tool_call_end|>",
                                               "<|tool_calls_section_end|>"],
    # DeepSeek-V3.1, thinking off (its generation prompt closes the block)
    "<｜Assistant｜></think>": ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "get_weather", "<｜tool▁sep｜>",
                               '{"city": "Rome"}', "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"],
    # a tool call whose JSON does not parse (the test template below ends with this token)
    "<|bad_turn|>": ['<tool_call>{"name": "get_weather", "arguments": {"city": ', "Paris}}</tool_call>"],
}
# special (control) tokens, as in the real vocabularies: dropped from text unless a parser asks for them
CONTROL = ("[TOOL_CALLS]", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
           "<|tool_call_end|>", "<|tool_calls_section_end|>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
           "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
BAD_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}<|bad_turn|>"


def _written(start: str) -> str:
    return "".join(CHAINS[start])


def save_chain_model(folder: Path) -> Path:
    import sentencepiece as spm
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(0)
    lines = [" ".join(rng.choice(TEXT_WORDS, rng.randint(4, 14))) for _ in range(400)]
    symbols = list(dict.fromkeys([s for start, chain in CHAINS.items() for s in [start, *chain]]))
    control = [s for s in symbols if s in CONTROL]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=400, model_type="bpe",
                                   byte_fallback=True, character_coverage=0.99, bos_id=1, eos_id=2, unk_id=0, pad_id=3,
                                   user_defined_symbols=[s for s in symbols if s not in control],
                                   control_symbols=control, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, add_dummy_prefix=False, minloglevel=3)
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    ids = {s: sp.piece_to_id(s) for s in symbols}
    assert len(set(ids.values())) == len(symbols) and min(ids.values()) > 3
    vocab, hidden = 400, 64
    assert len(symbols) <= hidden
    dim = {s: k for k, s in enumerate(symbols)}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                                         max_position_embeddings=4096, tie_word_embeddings=False))
    with torch.no_grad():
        emb, head = torch.zeros(vocab, hidden), torch.zeros(vocab, hidden)
        for s, k in dim.items():
            emb[ids[s], k] = 1.0
        for start, chain in CHAINS.items():
            seq = [start, *chain]
            for a, b in zip(seq, seq[1:]):
                head[ids[b], dim[a]] = 10.0
            head[2, dim[seq[-1]]] = 10.0                   # then end of sequence
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_chain_model(tmp_path_factory.mktemp("agents") / "model")


@pytest.fixture(scope="module")
def gen(model_dir):
    from jaxinfer import Generator
    g = Generator.from_pretrained(model_dir, dtype="float32", max_model_len=2048, max_num_batched_tokens=16,
                                  token_buckets=[16], max_num_seqs=4, block_size=16, warmup=False)
    yield g
    g.close()


@pytest.fixture(scope="module")
def sp(model_dir):
    import sentencepiece as spm
    return spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))


@contextmanager
def serving(gen, template: str, **parsers):
    """The app for one family, in process; yields (openai client, TestClient)."""
    from starlette.testclient import TestClient

    from serve.app import build_app
    text = (TEMPLATES / template).read_text() if template.endswith(".jinja") else template
    app = build_app(gen, "tiny", chat_template=text, **parsers)
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), http


def _stream_chat(client, **kw):
    reasoning, content, calls, finish, usage = "", "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                d = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                d["name"] += tc.function.name or ""
                d["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish, usage


def _n_tokens(sp, pieces: list[str]) -> int:
    """How many tokens the model wrote for these pieces: one each (SentencePiece's vocabulary has each
    as one piece, and the model writes pieces, not text)."""
    assert all(sp.id_to_piece(sp.piece_to_id(p)) == p for p in pieces)
    return len(pieces)


# ============================================================== templates render as transformers does
@pytest.mark.parametrize("template,kwargs", [("qwen3.jinja", {}), ("qwen3.jinja", {"enable_thinking": False}),
                                             ("llama3.1-json.jinja", {"date_string": "26 Jul 2024"}),
                                             ("mistral-7b-instruct-v0.3.jinja", {}),
                                             ("gpt-oss.jinja", {"reasoning_effort": "low"})])
def test_prompts_render_as_transformers_renders_them(gen, template, kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    from serve.protocol import ChatMessage
    from serve.tools import plan_tools
    text = (TEMPLATES / template).read_text()
    history = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "abcdefghi", "content": "sunny"}]
    with serving(gen, template) as (client, http):
        state = http.app.state.server
        ours = state.render_chat_text([ChatMessage.model_validate(m) for m in history], plan_tools(TOOLS, None, None),
                                      kwargs)
    hf_history = [dict(m) for m in history]
    hf_history[1] = {**hf_history[1], "tool_calls": [{**hf_history[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    rendered, _ = render_jinja_template([hf_history], tools=TOOLS, chat_template=text, add_generation_prompt=True,
                                        bos_token="<s>", eos_token="</s>", **kwargs)
    if "gpt-oss" in template:        # its system message carries today's date
        import datetime
        assert datetime.date.today().strftime("%Y-%m-%d") in ours
    assert ours == rendered[0]


# ============================================================== reasoning parsers
def test_qwen3_reasoning_and_hermes_tool_call(gen, sp):
    chain = CHAINS["<|im_start|>assistant\n"]
    with serving(gen, "qwen3.jinja") as (client, _):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=40)
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] == "\nThe user wants the weather.\n"
        assert m.content is None and r.choices[0].finish_reason == "tool_calls"
        (call,) = m.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        # <think>, the reasoning, and both halves of the split </think>
        assert r.usage.completion_tokens_details.reasoning_tokens == _n_tokens(sp, chain[:4])
        assert r.usage.completion_tokens == _n_tokens(sp, chain) + 1     # and the end-of-sequence token
        reasoning, content, calls, finish, usage = _stream_chat(client, model="tiny", messages=USER, tools=TOOLS,
                                                                 temperature=0, max_tokens=40)
        assert reasoning == m.model_extra["reasoning_content"] and content == ""
        assert calls == [{"name": "get_weather", "arguments": call.function.arguments}] and finish == "tool_calls"
        assert usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens_details.reasoning_tokens
        # without tools the call is text: the answer after the reasoning
        r = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=40)
        assert r.choices[0].message.content == "\n\n<tool_call>" + QWEN_CALL + "</tool_call>"


def test_chat_template_kwargs_switch_thinking_off(gen):
    with serving(gen, "qwen3.jinja") as (client, _):
        r = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=20,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        m = r.choices[0].message
        assert m.content == "It is sunny in Paris." and m.model_extra["reasoning_content"] is None
        assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_deepseek_r1_reasoning_opened_by_the_prompt(gen, sp):
    chain = CHAINS["<｜Assistant｜><think>\n"]
    with serving(gen, "deepseek-r1.jinja") as (client, http):
        assert http.app.state.server.reasoning_parser == "deepseek_r1"     # shown by the template
        r = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=20)
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] == "Two and two make four." and m.content == "\n\nThe answer is 4."
        assert r.usage.completion_tokens_details.reasoning_tokens == _n_tokens(sp, chain[:2])
        reasoning, content, _, finish, _ = _stream_chat(client, model="tiny", messages=USER, temperature=0, max_tokens=20)
        assert (reasoning, content, finish) == ("Two and two make four.", "\n\nThe answer is 4.", "stop")


def test_gpt_oss_analysis_channel_and_harmony_tool_call(gen, sp):
    with serving(gen, "gpt-oss.jinja") as (client, http):
        state = http.app.state.server
        assert (state.reasoning_parser, state.tool_call_parser) == ("gpt_oss", "openai")
        from serve.protocol import ChatCompletionRequest
        _, _, parsers = state.chat_request(ChatCompletionRequest(messages=USER, reasoning_effort="low"))
        assert "Reasoning: low\n" in parsers.prompt      # the template's own effort line
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=20)
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] == "The user asks for the weather." and m.content is None
        (call,) = m.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        reasoning, content, calls, finish, _ = _stream_chat(client, model="tiny", messages=USER, tools=TOOLS,
                                                            temperature=0, max_tokens=20)
        assert reasoning == "The user asks for the weather." and content == ""
        assert [c["name"] for c in calls] == ["get_weather"] and finish == "tool_calls"


# ============================================================== tool parsers per family
def test_llama3_json_tool_call(gen):
    with serving(gen, "llama3.1-json.jinja") as (client, http):
        assert http.app.state.server.tool_call_parser == "llama3_json"
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=20)
        (call,) = r.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris"} and r.choices[0].message.content is None
        _, content, calls, finish, _ = _stream_chat(client, model="tiny", messages=USER, tools=TOOLS, temperature=0,
                                                    max_tokens=20)
        assert content == "" and finish == "tool_calls" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
        # the call goes back as the template writes it, with the tool's result
        history = USER + [r.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        ids = http.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
        assert ids    # rendered without error


def test_kimi_k2_reasoning_ended_by_its_call_section_and_the_call_ids(gen):
    """Kimi K2 Thinking's template picks the kimi_k2 parsers: the reasoning has no opening tag and ends
    where the tool-call section (special tokens, kept for the parser) begins; the call's id is the
    model's `functions.NAME:N`, and the call sent back renders as the model wrote it."""
    from serve.protocol import ChatMessage
    from serve.tools import plan_tools
    chain = CHAINS["<|im_assistant|>assistant<|im_middle|>"]
    with serving(gen, "kimi-k2-thinking.jinja") as (client, http):
        state = http.app.state.server
        assert (state.reasoning_parser, state.tool_call_parser) == ("kimi_k2", "kimi_k2")
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=20)
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] == chain[0] and m.content is None
        (call,) = m.tool_calls
        assert (call.id, call.function.name, json.loads(call.function.arguments)) == \
            ("functions.get_weather:0", "get_weather", {"city": "Paris"})
        assert r.choices[0].finish_reason == "tool_calls"
        reasoning, content, calls, finish, _ = _stream_chat(client, model="tiny", messages=USER, tools=TOOLS,
                                                            temperature=0, max_tokens=20)
        assert (reasoning, content, finish) == (chain[0], "", "tool_calls")
        assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]
        history = USER + [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        text = state.render_chat_text([ChatMessage.model_validate(h) for h in history], plan_tools(TOOLS, None, None))
        assert "".join(chain[1:]) in text and "## Return of functions.get_weather:0\nsunny" in text


def test_deepseek_v31_calls_asked_for_and_written_back_in_its_format(gen):
    """DeepSeek-V3.1's template lists no tools but writes calls in its section format: the server's
    system message lists the tools and asks for that format, the deepseek_v31 parser reads the
    model's section (special tokens), and the call sent back renders exactly as the model wrote it."""
    from serve.protocol import ChatMessage
    from serve.tools import plan_tools
    chain = CHAINS["<｜Assistant｜></think>"]
    with serving(gen, "deepseek-v3.1.jinja") as (client, http):
        state = http.app.state.server
        assert state.tool_call_parser == "deepseek_v31"
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=20)
        m = r.choices[0].message
        (call,) = m.tool_calls
        assert m.content is None and json.loads(call.function.arguments) == {"city": "Rome"}
        _, content, calls, finish, _ = _stream_chat(client, model="tiny", messages=USER, tools=TOOLS, temperature=0,
                                                    max_tokens=20)
        assert content == "" and finish == "tool_calls" and calls == [{"name": "get_weather",
                                                                        "arguments": call.function.arguments}]
        history = USER + [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "rain"}]
        text = state.render_chat_text([ChatMessage.model_validate(h) for h in history], plan_tools(TOOLS, None, None))
        assert text.startswith("<s>You can call the following functions.") and '"name": "get_weather"' in text
        assert "<｜User｜>weather in Paris?<｜Assistant｜></think>" + "".join(chain) + "<｜end▁of▁sentence｜>" \
               "<｜tool▁output▁begin｜>rain<｜tool▁output▁end｜>" in text


def test_mistral_tool_call_and_result(gen, sp):
    with serving(gen, "mistral-7b-instruct-v0.3.jinja") as (client, http):
        assert http.app.state.server.tool_call_parser == "mistral"
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=20)
        (call,) = r.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert len(call.id) == 9 and call.id.isalnum()      # what Mistral's template requires
        history = USER + [r.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        text = http.app.state.server.render_chat_text(
            [__import__("serve.protocol").protocol.ChatMessage.model_validate(m) for m in history])
        assert f'[TOOL_RESULTS] {{"content": sunny, "call_id": "{call.id}"}}[/TOOL_RESULTS]' in text
        _, content, calls, finish, _ = _stream_chat(client, model="tiny", messages=USER, tools=TOOLS, temperature=0,
                                                    max_tokens=20)
        assert content == "" and calls[0]["name"] == "get_weather" and finish == "tool_calls"
        # [TOOL_CALLS] is a special (control) token: kept in the text only for the parser; a request
        # without tools gets the text as SentencePiece decodes it
        r = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=20)
        assert r.choices[0].message.content == sp.decode([sp.piece_to_id(p) for p in CHAINS["[/INST]"]])


def test_a_call_whose_json_does_not_parse_stays_content(gen):
    with serving(gen, BAD_TEMPLATE, tool_call_parser="hermes", reasoning_parser="none") as (client, _):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=20)
        assert r.choices[0].message.content == _written("<|bad_turn|>") and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"
        _, content, calls, finish, _ = _stream_chat(client, model="tiny", messages=USER, tools=TOOLS, temperature=0,
                                                    max_tokens=20)
        assert (content, calls, finish) == (_written("<|bad_turn|>"), [], "stop")


def test_forced_tool_call_applies_after_the_reasoning(gen):
    """A named tool_choice: the grammar lets the model think first, then forces the call (the model,
    left alone, would write <tool_call> after </think>; the grammar makes it write the JSON call)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
        "additionalProperties": False}}}]
    with serving(gen, "qwen3.jinja") as (client, _):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=tools, temperature=0, max_tokens=80,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] == "\nThe user wants the weather.\n", m
        (call,) = m.tool_calls
        # a named tool_choice's call finishes "stop" (OpenAI's rule, vLLM's serving_chat)
        assert json.loads(call.function.arguments) == {"city": "Paris"} and r.choices[0].finish_reason == "stop"


# ============================================================== Responses API
def test_responses_reasoning_and_function_call(gen, sp):
    chain = CHAINS["<|im_start|>assistant\n"]
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    with serving(gen, "qwen3.jinja") as (client, _):
        r = client.responses.create(model="tiny", input="weather in Paris?", tools=tools, temperature=0,
                                    max_output_tokens=40)
        assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "function_call"]
        assert r.output[0].content[0].text == "\nThe user wants the weather.\n"
        assert r.output[1].name == "get_weather" and json.loads(r.output[1].arguments) == {"city": "Paris"}
        assert r.usage.output_tokens_details.reasoning_tokens == _n_tokens(sp, chain[:4])
        assert r.usage.output_tokens == _n_tokens(sp, chain) + 1
        # streamed: the documented events, in order, ending with the same response
        events = list(client.responses.create(model="tiny", input="weather in Paris?", tools=tools, temperature=0,
                                              max_output_tokens=40, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert kinds.index("response.reasoning_text.delta") < kinds.index("response.function_call_arguments.delta") \
            < kinds.index("response.function_call_arguments.done")
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
            "\nThe user wants the weather.\n"
        done = events[-1].response
        assert [o.type for o in done.output] == ["reasoning", "function_call"]
        assert json.loads(done.output[1].arguments) == {"city": "Paris"}
        # the call's result goes back under previous_response_id (the template renders it as a
        # <tool_response>); the model (a fixed text) answers the same way again
        r2 = client.responses.create(model="tiny", previous_response_id=r.id, tools=tools, temperature=0,
                                     max_output_tokens=40,
                                     input=[{"type": "function_call_output", "call_id": r.output[1].call_id,
                                             "output": "sunny"}])
        assert r2.previous_response_id == r.id and r2.output[-1].type == "function_call"


def test_responses_message_output_text_and_errors(gen):
    with serving(gen, "deepseek-r1.jinja") as (client, http):
        r = client.responses.create(model="tiny", input=[{"role": "user", "content": "2+2?"}], temperature=0,
                                    instructions="be brief", max_output_tokens=20)
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output_text == "\n\nThe answer is 4."
        text = ""
        kinds = []
        for e in client.responses.create(model="tiny", input="2+2?", temperature=0, max_output_tokens=20, stream=True):
            kinds.append(e.type)
            text += e.delta if e.type == "response.output_text.delta" else ""
        assert text == r.output_text
        assert kinds.index("response.content_part.added") < kinds.index("response.output_text.delta") \
            < kinds.index("response.output_text.done") < kinds.index("response.content_part.done")
        # cut by max_output_tokens
        cut = client.responses.create(model="tiny", input="2+2?", temperature=0, max_output_tokens=2)
        assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
        # unknown previous_response_id, unimplemented fields
        bad = http.post("/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": "resp_nope"})
        assert bad.status_code == 404 and "resp_nope" in bad.json()["error"]["message"]
        bad = http.post("/v1/responses", json={"model": "tiny", "input": "x", "background": True, "store": False})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "background"
        stored = http.get(f"/v1/responses/{r.id}").json()
        assert stored["id"] == r.id and stored["output_text"] == "\n\nThe answer is 4."
    with serving(gen, "llama3.1-json.jinja") as (client, http):    # no reasoning parser
        bad = http.post("/v1/responses", json={"model": "tiny", "input": "x", "reasoning": {"effort": "low"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning"


def test_responses_items_are_the_chat_turns_they_stand_for(gen):
    """One model turn's items (reasoning, message, function call) echoed back are one assistant
    message with its reasoning and calls, as chat and previous_response_id render it (they were two
    turns, and the reasoning was dropped); an input system message survives previous_response_id
    while instructions do not (it was dropped); a developer message is a system message for a
    template without the role (Qwen3's dropped it); the stream announces a message with no content
    until content_part.added (the SDK's accumulator got two parts); store / stream null are the
    defaults; usage carries cache_write_tokens, which the SDK's type requires."""
    from serve.protocol import ChatMessage
    from serve.responses import input_messages
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    items = [{"role": "user", "content": "weather in Paris?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "The user wants the weather."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    chat = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "Let me check.", "reasoning_content": "The user wants the weather.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert input_messages(items) == chat
    with serving(gen, "qwen3.jinja") as (client, http):
        state = http.app.state.server
        text = state.render_chat_text([ChatMessage.model_validate(m) for m in chat])
        assert "<think>\nThe user wants the weather.\n</think>" in text and text.count("<|im_start|>assistant") == 2
        dev = state.render_chat_text([ChatMessage(role="developer", content="be brief"), ChatMessage(role="user", content="hi")])
        assert dev.startswith("<|im_start|>system\nbe brief<|im_end|>")
        r1 = client.responses.create(model="tiny", instructions="INSTR-Y", max_output_tokens=4, temperature=0,
                                     input=[{"role": "system", "content": "SYS-X"}, {"role": "user", "content": "2+2?"}])
        convo = client.responses.input_items.list(r1.id, order="asc").data
        assert (convo[0].role, convo[0].content[0].text) == ("system", "SYS-X") and "INSTR-Y" not in str(convo)
        details = r1.usage.input_tokens_details
        assert details.cache_write_tokens == r1.usage.input_tokens // 16 * 16 - details.cached_tokens   # 16: block_size
        events = list(client.responses.create(model="tiny", input="2+2?", temperature=0, max_output_tokens=20,
                                              stream=True))
        added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "message"]
        assert added and added[0].item.content == []
        assert len([p for o in events[-1].response.output if o.type == "message" for p in o.content]) == 1
        r = http.post("/v1/responses", json={"model": "tiny", "input": "2+2?", "max_output_tokens": 2, "store": None,
                                             "stream": None})
        assert r.status_code == 200 and r.json()["store"] is True and http.get(f"/v1/responses/{r.json()['id']}").status_code == 200


def test_responses_input_items_item_references_and_delete(gen):
    """A stored response's input items (its conversation before its output, with ids) paged as the
    SDK's cursor pager reads them; item_reference inputs stand for the stored items they name (the
    same prompt as the items sent whole); an item already in previous_response_id's conversation is
    a 400; DELETE drops a response, whose items stay referable while another stored response holds
    them; a reasoning item that ended its turn is that turn (input_messages)."""
    from serve.responses import ResponseStore, input_messages
    assert input_messages([{"role": "user", "content": "a"}, {"type": "reasoning", "summary": [{"text": "t"}]},
                           {"role": "user", "content": "b"}]) == \
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "reasoning_content": "t"},
         {"role": "user", "content": "b"}]
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    kw = dict(model="tiny", tools=tools, temperature=0, max_output_tokens=40)
    with serving(gen, "qwen3.jinja") as (client, http):
        r1 = client.responses.create(input=[{"role": "system", "content": "SYS"},
                                            {"role": "user", "content": "weather in Paris?"}], **kw)
        reasoning, call = r1.output
        answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        r2 = client.responses.create(previous_response_id=r1.id, input=[answer], **kw)
        # the SDK's pager asks for the next page with after=<last id> while has_more
        items = list(client.responses.input_items.list(r2.id, limit=2, order="asc"))
        assert [i.type for i in items] == ["message", "message", "reasoning", "function_call", "function_call_output"]
        assert [i.id for i in items[2:4]] == [reasoning.id, call.id] and items[4].output == "sunny"
        assert items[0].content[0].text == "SYS" and items[0].content[0].type == "input_text"
        assert len({i.id for i in items}) == 5
        page = client.responses.input_items.list(r2.id, limit=2)         # desc, the default
        assert [i.id for i in page.data] == [items[4].id, items[3].id] and page.has_more
        assert (page.first_id, page.last_id) == (items[4].id, items[3].id)
        assert [i.id for i in client.responses.input_items.list(r2.id, after=items[1].id).data] == [items[0].id]
        # references: the same prompt (input tokens) and greedy output as the items sent whole
        user = {"role": "user", "content": "weather in Paris?"}
        whole = client.responses.create(input=[user, reasoning.model_dump(exclude_none=True),
                                               call.model_dump(exclude_none=True), answer], **kw)
        by_ref = client.responses.create(input=[user, {"type": "item_reference", "id": reasoning.id},
                                                {"id": call.id}, answer], **kw)     # the type is optional
        bare = client.responses.create(input=[user, answer], **kw)
        assert by_ref.usage.input_tokens == whole.usage.input_tokens != bare.usage.input_tokens
        assert [(o.type, getattr(o, "arguments", None)) for o in by_ref.output] == \
            [(o.type, getattr(o, "arguments", None)) for o in whole.output]
        for body, param, says in (
                ({"previous_response_id": r1.id, "input": [{"type": "item_reference", "id": call.id}]}, "input",
                 "duplicate"),
                ({"input": [{"type": "item_reference", "id": "fc_nope"}]}, "input", "fc_nope"),
                ({"input": [{"id": 7, "role": "user", "content": "x"}]}, "input", "id")):
            bad = http.post("/v1/responses", json={"model": "tiny", **body})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.json()
            assert says in bad.json()["error"]["message"]
        for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"),
                             ("after=msg_nope", "after"), ("include[]=message.output_text.logprobs", "include[]")):
            bad = http.get(f"/v1/responses/{r2.id}/input_items?{query}")
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (query, bad.json())
        assert http.get(f"/v1/responses/{r2.id}?stream=true").status_code == 400
        # DELETE: OpenAI's deleted object; then the response is gone, its items held by r2 remain
        assert http.delete(f"/v1/responses/{r1.id}").json() == {"id": r1.id, "object": "response", "deleted": True}
        assert client.responses.delete(whole.id) is None          # the SDK's delete reads no body
        for rid in (r1.id, whole.id):
            assert http.get(f"/v1/responses/{rid}").status_code == 404
            assert http.delete(f"/v1/responses/{rid}").status_code == 404
            assert http.get(f"/v1/responses/{rid}/input_items").status_code == 404
        again = http.post("/v1/responses", json={"model": "tiny", "max_output_tokens": 1,
                                                 "input": [user, {"type": "item_reference", "id": call.id}]})
        assert again.status_code == 200
    # an item is found by its id while any stored response holds it (the bounded store drops the
    # least recently used response, and with it the items only it held)
    store = ResponseStore(size=2)
    a, b, shared = {"id": "a", "type": "message"}, {"id": "b", "type": "message"}, {"id": "s", "type": "message"}
    store.put("r1", {"output": [a]}, [shared])
    store.put("r2", {"output": [b]}, [shared])
    store.put("r3", {"output": []}, [b])
    assert store.get("r1") is None and store.item("a") is None and store.item("s") == shared
    assert store.delete("r2") and store.item("s") is None and store.item("b") == b
    assert not store.delete("r2") and store.delete("r3") and store.item("b") is None


# ============================================================== Anthropic's Messages API
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather in a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


def _anthropic(http):
    anthropic = pytest.importorskip("anthropic")
    return anthropic, anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http, max_retries=0)


def test_messages_thinking_tool_use_and_the_next_turn(gen, sp):
    """/v1/messages through Anthropic's SDK: the same reasoning, call and token counts as chat
    completions on the same request; the SDK's stream accumulator (its own partial-JSON reading of
    input_json_delta) rebuilds the same message; the call's result sent back as a tool_result renders
    the prompt chat renders for the same turns (count_tokens against /tokenize); thinking disabled
    reaches the template (Qwen3's closed think block)."""
    chain = CHAINS["<|im_start|>assistant\n"]
    with serving(gen, "qwen3.jinja") as (client, http):
        anthropic, ac = _anthropic(http)
        kw = dict(model="tiny", max_tokens=40, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": "weather in Paris?"}])
        m = ac.messages.create(**kw)
        chat = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=40)
        assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
        assert m.content[0].thinking == chat.choices[0].message.model_extra["reasoning_content"] \
            == "\nThe user wants the weather.\n"
        call = chat.choices[0].message.tool_calls[0]
        assert (m.content[1].name, m.content[1].input) == ("get_weather", json.loads(call.function.arguments)) \
            == ("get_weather", {"city": "Paris"})
        assert m.usage.output_tokens == chat.usage.completion_tokens == _n_tokens(sp, chain) + 1
        u = m.usage
        assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == chat.usage.prompt_tokens
        assert u.cache_creation_input_tokens == (chat.usage.prompt_tokens // 16 * 16) - u.cache_read_input_tokens
        with ac.messages.stream(**kw) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content[:1]] + \
            [{**m.content[1].model_dump(), "id": final.content[1].id}]
        assert (final.stop_reason, final.usage.output_tokens) == ("tool_use", m.usage.output_tokens)
        # the next turn: tool_result after the assistant's thinking and tool_use
        turns = kw["messages"] + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[1].id,
                                          "content": [{"type": "text", "text": "sunny"}]}]}]
        as_chat = USER + [{"role": "assistant", "content": "", "reasoning_content": m.content[0].thinking,
                           "tool_calls": [{"id": m.content[1].id, "type": "function", "function": {
                               "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                          {"role": "tool", "tool_call_id": m.content[1].id, "content": "sunny"}]
        counted = ac.messages.count_tokens(model="tiny", messages=turns, tools=ANTHROPIC_TOOLS)
        want = http.post("/tokenize", json={"messages": as_chat, "tools": TOOLS}).json()["count"]
        assert counted.input_tokens == want
        r2 = ac.messages.create(**{**kw, "messages": turns})
        assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens + r2.usage.cache_creation_input_tokens == want
        # thinking disabled: Qwen3's template closes the think block, the model answers
        off = ac.messages.create(**{k: v for k, v in kw.items() if k != "tools"}, thinking={"type": "disabled"})
        assert [(b.type, b.text) for b in off.content] == [("text", "It is sunny in Paris.")]
        assert off.stop_reason == "end_turn"


def test_messages_stop_sequences_limits_and_errors(gen):
    """stop_reason stop_sequence names the string that ended the text (cut before it, reasoning
    first as chat splits it); max_tokens; Anthropic's error shape on its routes (blocks, server tools
    and fields not implemented are a 400 naming them); x-api-key authenticates."""
    from starlette.testclient import TestClient

    from serve.app import build_app
    with serving(gen, "deepseek-r1.jinja") as (_, http):
        anthropic, ac = _anthropic(http)
        raw = dict(model="tiny", max_tokens=40, temperature=0, messages=[{"role": "user", "content": "2+2?"}])
        kw = {**{k: v for k, v in raw.items() if k != "temperature"}, "extra_body": {"temperature": 0}}
        m = ac.messages.create(**kw, stop_sequences=["nope", "answer"])
        assert [(b.type, getattr(b, "thinking", None) or b.text) for b in m.content] == \
            [("thinking", "Two and two make four."), ("text", "\n\nThe ")]
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "answer")
        with ac.messages.stream(**kw, stop_sequences=["answer"]) as stream:
            final = stream.get_final_message()
        assert (final.stop_reason, final.stop_sequence, final.content[-1].text) == ("stop_sequence", "answer",
                                                                                    "\n\nThe ")
        m = ac.messages.create(**kw)
        assert (m.stop_reason, m.stop_sequence, m.content[-1].text) == ("end_turn", None, "\n\nThe answer is 4.")
        cut = ac.messages.create(**{**kw, "max_tokens": 2})
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
        # Anthropic's service_tier values (OpenAI's list, auto / default, refused standard_only)
        assert ac.messages.create(**kw, service_tier="standard_only").stop_reason == "end_turn"
        for body, says in (
                ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
                ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
                ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
                ({"thinking": {"type": "enabled", "budget_tokens": 9}, "messages": [{"role": "tool", "content": "x"}]},
                 "role"),
                ({"max_tokens": "many"}, "max_tokens")):
            r = http.post("/v1/messages", json={**raw, **body})
            assert r.status_code == 400, r.text
            err = r.json()
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
            assert says in err["error"]["message"], err
        with pytest.raises(anthropic.BadRequestError):
            ac.messages.create(**{**kw, "max_tokens": 0})
    with serving(gen, "llama3.1-json.jinja") as (_, http):    # no reasoning parser
        r = http.post("/v1/messages", json={**raw, "thinking": {"type": "enabled", "budget_tokens": 1024}})
        assert r.status_code == 400 and "reasoning parser" in r.json()["error"]["message"]
    with TestClient(build_app(gen, "tiny", api_key="sekret", chat_template=(TEMPLATES / "deepseek-r1.jinja").read_text())) \
            as http:
        assert http.post("/v1/messages", json=raw, headers={"x-api-key": "sekret"}).status_code == 200
        r = http.post("/v1/messages", json=raw, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert http.post("/v1/chat/completions", json={**raw, "max_tokens": 2},
                         headers={"Authorization": "Bearer sekret"}).status_code == 200


def _settled(client, rid: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while (r := client.responses.retrieve(rid)).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
    return r


def test_responses_in_the_background_polled_replayed_and_cancelled(gen):
    """background: true (OpenAI's, vLLM's): answered "queued" at once and polled until completed with
    the foreground's output; its events, streamed again (the SDK's retrieve(stream=True)), are the
    foreground stream's, and from starting_after the ones after it; background with stream streams
    them at once. cancel stops one still running (its engine request aborted, its blocks freed;
    "cancelled" again when asked twice); a foreground or finished response cannot be cancelled."""
    with serving(gen, "deepseek-r1.jinja") as (client, http):
        kw = dict(model="tiny", input="2+2?", temperature=0, max_output_tokens=20)
        fg = client.responses.create(**kw)
        streamed = [e.type for e in client.responses.create(**kw, stream=True,
                                                            stream_options={"include_obfuscation": False})]
        r = http.post("/v1/responses", json={**kw, "stream": True, "stream_options": {"include_obfuscation": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
        bg = client.responses.create(**kw, background=True)
        assert bg.status == "queued" and bg.output == []
        done = _settled(client, bg.id)
        assert done.status == "completed" and done.output_text == fg.output_text == "\n\nThe answer is 4."
        assert [o.type for o in done.output] == [o.type for o in fg.output]
        events = list(client.responses.retrieve(bg.id, stream=True))
        assert [e.type for e in events] == streamed and [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].response.status == "queued" and events[-1].response.output_text == fg.output_text
        later = list(client.responses.retrieve(bg.id, stream=True, starting_after=3))
        assert [e.sequence_number for e in later] == list(range(4, len(events)))
        assert [e.type for e in client.responses.create(**kw, background=True, stream=True)] == streamed
        # a long one (a string of at least 3000 characters, cut at 1500 tokens), cancelled while it runs
        schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 3000}}, "required": ["a"]}
        long = client.responses.create(model="tiny", input="2+2?", temperature=0, max_output_tokens=1500, background=True,
                                       text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
        deadline = time.monotonic() + 60
        while gen.stats()["num_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        cancelled = client.responses.cancel(long.id)
        assert cancelled.status == "cancelled" and client.responses.cancel(long.id).status == "cancelled"
        assert client.responses.retrieve(long.id).status == "cancelled"
        assert "response.completed" not in [e.type for e in client.responses.retrieve(long.id, stream=True)]
        deadline = time.monotonic() + 30
        while gen.stats()["kv_blocks_used"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gen.stats()["kv_blocks_used"] == 0 and gen.stats()["num_running"] == 0
        for path, status, param in ((f"/v1/responses/{fg.id}/cancel", 400, "response_id"),     # foreground
                                    (f"/v1/responses/{bg.id}/cancel", 400, "response_id"),     # completed
                                    ("/v1/responses/resp_nope/cancel", 404, "response_id")):
            r = http.post(path)
            assert r.status_code == status and r.json()["error"]["param"] == param, r.text
        for query in ("starting_after=2", "stream=true&starting_after=-3", "stream=true&starting_after=x"):
            r = http.get(f"/v1/responses/{bg.id}?{query}")
            assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after", (query, r.text)


def test_a_delta_of_several_tokens_ending_the_reasoning_gives_its_answer_tokens_logprobs():
    """Speculative decoding hands out several tokens a step: where one delta ends the reasoning and
    begins the answer, its last tokens (those whose strings write the answer's text) are the
    answer's, for Responses' output_text logprobs; usage still counts the delta as reasoning
    (serve.reasoning.reasoning_tokens' rule, the same streamed or not)."""
    from jaxinfer.output_processor import RequestOutput
    from serve.reasoning import OutputParsers
    from serve.stream import ChatChoices
    pieces = {1: "hm", 2: "</think>", 3: "\n\n", 4: "Four", 5: "."}
    choices = ChatChoices(1, None, pieces.__getitem__, True, OutputParsers("deepseek_r1", "<think>\n"))
    delta = lambda ids: RequestOutput("r", 0, "".join(pieces[i] for i in ids), ids, [-0.5] * len(ids),  # noqa: E731
                                      [[] for _ in ids])
    choices(delta([1]))
    assert choices.answer_logprobs == []
    chunks = choices(delta([2, 3, 4]))
    assert [c["delta"] for c in chunks] == [{"content": "\n\nFour"}]
    assert [x["token"] for x in choices.answer_logprobs] == ["\n\n", "Four"]
    choices(delta([5]))
    assert [x["token"] for x in choices.answer_logprobs] == ["."] and choices.reasoning_tokens == 4


def test_a_background_response_whose_run_fails_is_stored_failed(gen, monkeypatch):
    """A run that raises (here its usage) ends as a failed response with the error, not one left in
    progress for its pollers; cancelling it is then a 400."""
    import serve.responses as responses

    def broken(*args, **kwargs):
        raise RuntimeError("usage broke")
    with serving(gen, "deepseek-r1.jinja") as (client, http):
        monkeypatch.setattr(responses, "_usage", broken)
        bg = client.responses.create(model="tiny", input="2+2?", temperature=0, max_output_tokens=20, background=True)
        r = _settled(client, bg.id)
        assert r.status == "failed" and "usage broke" in r.error.message
        r = http.post(f"/v1/responses/{bg.id}/cancel")
        assert r.status_code == 400 and "failed" in r.json()["error"]["message"]


def test_responses_output_text_logprobs_are_its_own_tokens(gen):
    """include message.output_text.logprobs with top_logprobs (what the AI SDK sends for logprobs):
    the output_text part carries its own tokens, their strings joining into its text (the
    reasoning's tokens, its end tag and the EOS are not its), each with the logprob and alternatives
    the chat completion reports for the same token; streamed, the deltas carry the same list; without
    the include, none (vLLM's rule)."""
    with serving(gen, "deepseek-r1.jinja") as (client, http):
        kw = dict(model="tiny", input="2+2?", temperature=0, max_output_tokens=20)
        r = client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=2)
        part = r.output[-1].content[0]
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert "".join(x.token for x in part.logprobs) == part.text == "\n\nThe answer is 4."
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2+2?"}],
                                              temperature=0, max_tokens=20, logprobs=True, top_logprobs=2)
        listed = lambda xs: [(x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs]) for x in xs]  # noqa: E731
        n = len(part.logprobs)
        assert listed(part.logprobs) == listed(chat.choices[0].logprobs.content[-1 - n:-1])
        assert all(len(x.top_logprobs) == 2 for x in part.logprobs)
        streamed, final = [], None
        for e in client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=2, stream=True):
            streamed += e.logprobs if e.type == "response.output_text.delta" else []
            final = e.response if e.type == "response.completed" else final
        assert listed(streamed) == listed(part.logprobs) == listed(final.output[-1].content[0].logprobs)
        assert not client.responses.create(**kw, top_logprobs=2).output[-1].content[0].logprobs


def test_batch_runs_responses_lines_as_the_server_answers_them(gen, tmp_path):
    """/v1/responses lines in a batch file (OpenAI's batch API takes them) get the body the server
    answers for the same request (output text, items, usage but for the prefix cache's share); stream or background on a line, or a
    field this server refuses, is that line's 400 naming it."""
    from starlette.testclient import TestClient

    from serve.app import build_app
    from serve.batch import run_batch
    body = {"model": "tiny", "input": "2+2?", "temperature": 0, "max_output_tokens": 12, "instructions": "be brief"}
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/responses", "body": body},
             {"custom_id": "b", "method": "POST", "url": "/v1/responses", "body": {**body, "stream": True}},
             {"custom_id": "c", "method": "POST", "url": "/v1/responses", "body": {**body, "background": True}},
             {"custom_id": "d", "method": "POST", "url": "/v1/responses", "body": {**body, "conversation": "c1"}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_batch(gen, tmp_path / "in.jsonl", tmp_path / "out.jsonl", "tiny", progress=False)
    rows = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    with TestClient(build_app(gen, "tiny")) as http:
        served = http.post("/v1/responses", json=body).json()
    got = rows["a"]["response"]["body"]
    drop_cache = lambda u: {k: v for k, v in u.items() if k != "input_tokens_details"}  # noqa: E731  (ran second)
    assert got["output_text"] == served["output_text"] and drop_cache(got["usage"]) == drop_cache(served["usage"])
    assert [o["type"] for o in got["output"]] == [o["type"] for o in served["output"]]
    assert got["status"] == served["status"] == "incomplete"        # (12 tokens of a random model)
    for cid, name in (("b", "stream"), ("c", "background"), ("d", "conversation")):
        assert rows[cid]["response"]["status_code"] == 400 and name in rows[cid]["error"]["message"], rows[cid]


def test_responses_truncation_auto_leaves_out_the_earliest_turns(gen):
    """truncation "auto" (OpenAI's): a conversation that overflows the context (2048 tokens here)
    with max_output_tokens loses whole turns from its start, the instructions kept: the prompt is the
    one the same request makes without those turns; "disabled" (the default) is a 400. The stored
    input items stay whole. max_tool_calls (built-in tools, none here) is accepted."""
    long = " ".join(["the cat sat on a mat"] * 100)     # about 1600 tokens
    early = [{"role": "user", "content": long}, {"role": "assistant", "content": "ok"}]
    late = [{"role": "user", "content": "2+2?"}]
    kw = dict(model="tiny", temperature=0, instructions="be brief", max_output_tokens=1200)
    with serving(gen, "deepseek-r1.jinja") as (client, http):
        bad = http.post("/v1/responses", json={**kw, "input": early + late})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_output_tokens", bad.text
        bad = http.post("/v1/responses", json={**kw, "input": early * 2 + late, "max_output_tokens": None})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input", bad.text
        cut = client.responses.create(**kw, input=early + late, truncation="auto", max_tool_calls=3)
        alone = client.responses.create(**kw, input=late)
        assert cut.truncation == "auto" and cut.usage.input_tokens == alone.usage.input_tokens
        assert cut.output_text == alone.output_text
        assert len(list(client.responses.input_items.list(cut.id))) == 3
        fits = client.responses.create(**{**kw, "max_output_tokens": 20}, input=early + late, truncation="auto")
        assert fits.usage.input_tokens > 1000           # nothing to leave out
        system = {"role": "system", "content": "answer in numbers"}     # system messages stay
        cut = client.responses.create(**kw, input=[system] + early + late, truncation="auto")
        assert cut.usage.input_tokens == client.responses.create(**kw, input=[system] + late).usage.input_tokens


def test_responses_store_false_clients_send_reasoning_back_sealed(gen):
    """include reasoning.encrypted_content (what Codex sends with store false): the reasoning item
    carries an opaque encrypted_content, streamed and not, which sent back alone stands for the
    reasoning text (the same prompt as the text sent whole, longer than without it); one this server
    did not write is a 400; prompt_cache_key is accepted (this server's cache is automatic)."""
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    kw = dict(model="tiny", tools=tools, temperature=0, max_output_tokens=40, store=False,
              include=["reasoning.encrypted_content"], extra_body={"prompt_cache_key": "user-7"})
    user = {"role": "user", "content": "weather in Paris?"}
    with serving(gen, "qwen3.jinja") as (client, http):
        r = client.responses.create(input=[user], **kw)
        reasoning, call = r.output
        assert isinstance(reasoning.encrypted_content, str) and reasoning.content[0].text not in reasoning.encrypted_content
        assert http.get(f"/v1/responses/{r.id}").status_code == 404            # store false
        done = [e.item for e in client.responses.create(input=[user], stream=True, **kw)
                if e.type == "response.output_item.done" and e.item.type == "reasoning"]
        assert done and done[0].encrypted_content == reasoning.encrypted_content
        answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        fc = call.model_dump(exclude_none=True)
        sealed = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
        whole = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": reasoning.content[0].text}]}
        n = {name: client.responses.create(input=[user, *item, fc, answer], **kw).usage.input_tokens
             for name, item in (("sealed", [sealed]), ("whole", [whole]), ("none", []))}
        assert n["sealed"] == n["whole"] > n["none"], n
        bad = http.post("/v1/responses", json={"model": "tiny", "input": [user, {**sealed, "encrypted_content": "gAAAA"}, fc,
                                                                         answer]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
        bad = http.post("/v1/responses", json={"model": "tiny", "input": "x", "include": ["file_search_call.results"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "include"


def test_malformed_bodies_are_400s_in_each_apis_shape(gen):
    """Bodies that came back as 500s: NaN / Infinity / 1e999 (Python's json reads them; JSON has no
    such numbers, and a stored NaN broke the stored response), nesting past Python's recursion limit,
    a chat_template_kwargs value of the wrong type for the template (a TypeError inside Jinja)."""
    with serving(gen, "qwen3.jinja") as (_, http):
        post = lambda route, text: http.post(route, content=text, headers={"content-type": "application/json"})  # noqa: E731
        for route in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
            for text in ('{"input": "hi", "max_tokens": 4, "messages": [], "tools": [{"type": "function", '
                         '"name": "f", "parameters": {"type": "object", "properties": NaN}}]}',
                         '{"input": "hi", "max_tokens": 4, "messages": [], "temperature": 1e999}',
                         '{"input": "hi", "x": ' + "[" * 5000 + "]" * 5000 + "}"):
                r = post(route, text)
                assert r.status_code == 400, (route, r.text[:200])
                assert "not valid JSON" in json.dumps(r.json()), r.text[:300]
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2,
                                                    "chat_template_kwargs": {"tools": 5}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_unknown_parser_names_fail_at_start_listing_the_choices():
    for flag, choices in (("--reasoning-parser", "qwen3, deepseek_r1, gpt_oss"),
                          ("--tool-call-parser", "hermes, qwen3_coder, llama3_json, mistral, openai")):
        p = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "serve", flag, "bogus"], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2 and "invalid choice: 'bogus'" in p.stderr
        assert all(f"'{c}'" in p.stderr for c in choices.split(", ")), p.stderr


def test_jaxinfer_serve_flags_reach_the_server(gen, model_dir, monkeypatch):
    """`jaxinfer serve --chat-template F --reasoning-parser P --tool-call-parser T`: cmd_serve builds the
    app with them (uvicorn.run and the Generator replaced, the engine already compiled)."""
    import uvicorn
    from starlette.testclient import TestClient

    from jaxinfer import cli
    apps = []
    monkeypatch.setattr(cli, "_generator", lambda args: gen)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    monkeypatch.setattr(gen, "close", lambda: None)
    args = cli.build_parser().parse_args(["serve", "--model", str(model_dir), "--served-model-name", "tiny",
                                          "--chat-template", str(TEMPLATES / "qwen3.jinja"),
                                          "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "mistral"])
    assert args.func(args) == 0
    state = apps[0].state.server
    assert (state.reasoning_parser, state.tool_call_parser) == ("deepseek_r1", "mistral")
    assert state.chat.text == (TEMPLATES / "qwen3.jinja").read_text()
    with TestClient(apps[0]) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=40)
        # deepseek_r1 on Qwen3's output: reasoning up to </think> (the opening tag stripped)
        assert r.choices[0].message.model_extra["reasoning_content"] == "\nThe user wants the weather.\n"


@pytest.mark.parametrize("name,prompt,text,reasoning,content", [
    ("qwen3", "<|im_start|>assistant\n", "<think>\na < b\n</think>\n\nHi <b>", "\na < b\n", "\n\nHi <b>"),
    ("qwen3", "<think>\n\n</think>\n\n", "Hi</think>", None, "Hi</think>"),
    ("qwen3", "x", "<thi", None, "<thi"),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "a</thi</think>b", "a</thi", "b"),
    ("deepseek_r1", "x", "cut before the end", "cut before the end", ""),
    ("gpt_oss", "", "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>Yes.<|return|>",
     "hm", "Yes."),
    # Seed-OSS: qwen3's rules with its own tags, as llama.cpp's try_parse_reasoning reads them (vLLM's
    # seed_oss parser reads an output with no closing tag as reasoning, even without the opening one)
    ("seed_oss", "<seed:bos>assistant\n", "<seed:think>a <think> b</seed:think>Hi", "a <think> b", "Hi"),
    ("seed_oss", "x", "no block</think>", None, "no block</think>"),
    ("seed_oss", "<seed:think>\n", "cut before the end", "cut before the end", ""),
    # vLLM's names for the same <think> rules: DeepSeek-V3.1's prompt opens the block (thinking) or
    # closes it; GLM-4.5's model opens it, its prompt closes it with enable_thinking false
    ("deepseek_v3", "<｜Assistant｜><think>", "a</think>b", "a", "b"),
    ("deepseek_v3", "<｜Assistant｜></think>", "a</think>b", None, "a</think>b"),
    ("glm45", "<|assistant|>", "<think>a</think>\nb", "a", "\nb"),
    ("glm45", "<|assistant|>\n<think></think>", "a</think>b", None, "a</think>b"),
    ("glm47", "<|assistant|>", "<think>a</think>b", "a", "b"),
    # Magistral (vLLM's mistral): [THINK]...[/THINK] written by the model, text before it answer too; a
    # [/THINK] with no [THINK] before it is dropped; without tags all answer
    ("mistral", "[/INST]", "[THINK]a [b] c[/THINK]The answer.", "a [b] c", "The answer."),
    ("mistral", "[/INST]", "So[THINK]r[/THINK]d[THINK]", "r", "Sod[THINK]"),
    ("mistral", "[/INST]", "No thinking [/THINK] here", None, "No thinking  here"),
    ("mistral", "[/INST]", "[THINK]cut before the end", "cut before the end", ""),
    ("mistral", "[/INST]", "plain [THIN", None, "plain [THIN"),
    # Kimi K2 (vLLM's kimi_k2): reasoning without the opening tag too, and a tool-call section ends it
    # (the section stays in the content, for the kimi_k2 tool-call parser)
    ("kimi_k2", "<|im_assistant|>assistant<|im_middle|>", "<think>a</think>b", "a", "b"),
    ("kimi_k2", "<|im_assistant|>assistant<|im_middle|>", "plan<|tool_calls_section_begin|><|tool_call_begin|>",
     "plan", "<|tool_calls_section_begin|><|tool_call_begin|>"),
    ("kimi_k2", "x", "a <|tool_calls_section", "a <|tool_calls_section", ""),
])
def test_every_split_of_the_text_gives_the_same_reasoning_and_content(name, prompt, text, reasoning, content):
    """Streamed in pieces of every size (each tag split at every point), the parser answers as on the
    whole text; the expected split is written out by hand."""
    from serve.reasoning import make_reasoning_parser, split_reasoning
    assert split_reasoning(name, prompt, text) == (reasoning, content)
    for size in range(1, 9):
        p, got_r, got_c = make_reasoning_parser(name, prompt), "", ""
        for i in range(0, len(text), size):
            r, c = p.feed(text[i:i + size])
            got_r, got_c = got_r + r, got_c + c
        r, c = p.finish()
        assert ((got_r + r) if p.saw_reasoning else None, got_c + c) == (reasoning, content), size


@pytest.mark.parametrize("parser,text,content,args", [
    ("hermes", 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', "Sure.",
     [{"city": "Paris"}]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [{"city": "Paris"}, {"city": "Rome"}]),
    ("llama3_json", 'It is {"name": "x"}', 'It is {"name": "x"}', []),
    # Llama 3.1 may write text first, then the tag and the call (the text stays content)
    ("llama3_json", 'Let me look. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "Let me look. ", [{"city": "Paris"}]),
    ("llama3_json", 'Let me look. <|python_tag|>{"name": "get_weather", "parameters": {"city": Paris}}',
     'Let me look. <|python_tag|>{"name": "get_weather", "parameters": {"city": Paris}}', []),
    # Llama 4: the objects bare, after <|python_start|>TEXT<|python_end|> (the text content), or in the tags
    ("llama4_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [{"city": "Paris"}]),
    ("llama4_json", '<|python_start|>Looking.<|python_end|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
                    '{"name": "get_weather", "parameters": {"city": "Rome"}}', "Looking.", [{"city": "Paris"}, {"city": "Rome"}]),
    ("llama4_json", '<|python_start|>{"name": "get_weather", "parameters": {"city": "Oslo"}}<|python_end|>', None,
     [{"city": "Oslo"}]),
    ("llama4_json", 'It is {"name": "x"}', 'It is {"name": "x"}', []),
    ("llama4_json", '<|python_start|>{"name": "get_weather", "parameters": {"city": Oslo}}<|python_end|>',
     '<|python_start|>{"name": "get_weather", "parameters": {"city": Oslo}}<|python_end|>', []),
    ("llama4_pythonic", "<|python_start|>[get_weather(city='Paris'), get_weather(city='Rome')]<|python_end|>", None,
     [{"city": "Paris"}, {"city": "Rome"}]),
    ("llama4_pythonic", "[get_weather(city='Oslo')]", None, [{"city": "Oslo"}]),
    # LFM2: pythonic lists in <|tool_call_start|> ... <|tool_call_end|> blocks, text around them content
    ("lfm2", "Checking.<|tool_call_start|>[get_weather(city='Paris'), get_weather(city=\"Rome\")]<|tool_call_end|>",
     "Checking.", [{"city": "Paris"}, {"city": "Rome"}]),
    ("lfm2", "<|tool_call_start|>get_weather(city='Oslo')<|tool_call_end|>Done.", "Done.", [{"city": "Oslo"}]),
    ("lfm2", '<|tool_call_start|>[{"name": "get_weather", "arguments": {"city": "Bern"}}]<|tool_call_end|>', None,
     [{"city": "Bern"}]),
    ("lfm2", "<|tool_call_start|>[get_weather(city='Paris')]", "<|tool_call_start|>[get_weather(city='Paris')]", []),
    ("lfm2", "<|tool_call_start|>[get_weather('Paris')]<|tool_call_end|>",
     "<|tool_call_start|>[get_weather('Paris')]<|tool_call_end|>", []),
    ("llama4_pythonic", "It is [get_weather(city='Paris')]", "It is [get_weather(city='Paris')]", []),
    ("mistral", 'Ok [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Ok ", [{"city": "Paris"}]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [{"city": "Paris"}]),
    # v11+ with call ids (mistral-common's decode_tool_calls: name[CALL_ID]id[ARGS]args), two calls
    ("mistral", 'Ok[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}'
                '[TOOL_CALLS]get_weather[CALL_ID]Zz9Yy8Xx7[ARGS]{"city": "Rome"}', "Ok", [{"city": "Paris"}, {"city": "Rome"}]),
    # text after the array is dropped, as vLLM's parser drops it (it once made the whole call content)
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]\nDone.', None,
     [{"city": "Paris"}]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": Paris}}]',
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": Paris}}]', []),
    ("openai", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
     None, [{"city": "Paris"}]),
    # Seed-OSS: qwen3_coder's XML inside <seed:tool_call> blocks (llama.cpp's and vLLM's seed_oss format)
    ("seed_oss", "Checking.<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "</function>\n</seed:tool_call>", "Checking.", [{"city": "Paris"}]),
    ("seed_oss", "<tool_call>\n<function=get_weather>\n<parameter=city>Rome</parameter>\n</function>\n</tool_call>",
     "<tool_call>\n<function=get_weather>\n<parameter=city>Rome</parameter>\n</function>\n</tool_call>", []),
    # Qwen3-Coder's XML: values on their own lines (the template's form) or inline, two calls
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>Rome</parameter>\n"
                    "</function>\n</tool_call>", "Let me check.", [{"city": "Paris"}, {"city": "Rome"}]),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
     "<tool_call>\n<function=get_time>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", []),
    ("openai", '<|channel|>commentary to=functions.get_weather json<|message|>{"city":<|call|>',
     '<|channel|>commentary to=functions.get_weather json<|message|>{"city":<|call|>', []),
    # DeepSeek-V3 / R1: a section of calls, each `function<sep>NAME` and its JSON in a fenced block
    ("deepseek_v3", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                    '```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Sure.",
     [{"city": "Paris"}, {"city": "Rome"}]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", []),
    # DeepSeek-V3.1: NAME<sep>JSON; an output cut inside the section keeps it as written
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, [{"city": "Paris"}]),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Pa',
     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Pa', []),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                     "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>", [{"city": "Paris"}]),
    # whitespace before the section is dropped with calls; NaN is no JSON (the call stays content)
    ("deepseek_v31", '\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}'
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n", None, [{"city": "Rome"}]),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": NaN}"
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": NaN}<｜tool▁call▁end｜>"
     "<｜tool▁calls▁end｜>", []),
    # Kimi K2: functions.NAME:N then the JSON arguments
    ("kimi_k2", 'Ok.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1'
                '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>', "Ok.",
     [{"city": "Paris"}, {"city": "Rome"}]),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": Paris}<|tool_call_end|><|tool_calls_section_end|>',
     '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
     '{"city": Paris}<|tool_call_end|><|tool_calls_section_end|>', []),
    # GLM-4.5: <tool_call>NAME and <arg_key> / <arg_value> pairs (GLM-4.7 writes no newline after the name)
    ("glm45", "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
              "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>", "Checking.",
     [{"city": "Paris"}, {"city": "Rome"}]),
    ("glm47", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>", None,
     [{"city": "Oslo"}]),
    # Llama 3.2 / 4 pythonic: a list of keyword calls (Python's and JSON's literals), else all content
    ("pythonic", "[get_weather(city='Paris'), get_weather(city=\"Rome\", days=-3, hourly=true, unit=None)]", None,
     [{"city": "Paris"}, {"city": "Rome", "days": -3, "hourly": True, "unit": None}]),
    ("pythonic", "It is [get_weather(city='Paris')]", "It is [get_weather(city='Paris')]", []),
    ("pythonic", "[get_weather('Paris')]", "[get_weather('Paris')]", []),
    # Granite 3.0's <|tool_call|> token, 3.1+'s <tool_call> text, then a JSON array (vLLM's granite parser)
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_weather", "arguments": {"city": "Rome"}}]', None, [{"city": "Paris"}, {"city": "Rome"}]),
    ("granite", ' <tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None, [{"city": "Oslo"}]),
    ("granite", "<tool_ca", "<tool_ca", []),
    ("granite", '[{"name": "get_time", "arguments": {}}]', '[{"name": "get_time", "arguments": {}}]', []),
    ("granite", "Sunny. <|tool_call|>[]", "Sunny. <|tool_call|>[]", []),
    # Phi-4-mini: functools then a JSON array (text before it is content, after the array dropped)
    ("phi4_mini_json", 'Checking. functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                       '{"name": "get_weather", "parameters": {"city": "Rome"}}]', "Checking. ",
     [{"city": "Paris"}, {"city": "Rome"}]),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2]}}] ok', None,
     [{"city": "Oslo", "days": [1, 2]}]),
    ("phi4_mini_json", "functools is a Python module", "functools is a Python module", []),
    # OLMo 3: text, then the calls one a line in <function_calls>
    ("olmo3", "Sure.\n<function_calls>\nget_weather(city='Paris')\nget_weather(city='Rome')\n</function_calls>",
     "Sure.\n", [{"city": "Paris"}, {"city": "Rome"}]),
    ("olmo3", "<function_calls>\nget_weather(city=Paris)\n</function_calls>",
     "<function_calls>\nget_weather(city=Paris)\n</function_calls>", []),
    # an undeclared argument is JSON where it parses as JSON (NaN does not: it stays text)
    ("glm45", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
              "<arg_value>[1, 2]</arg_value><arg_key>mean</arg_key><arg_value>NaN</arg_value></tool_call>", None,
     [{"city": "Oslo", "days": [1, 2], "mean": "NaN"}]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>",
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>", []),
])
def test_tool_parsers_streamed_in_any_pieces(parser, text, content, args):
    """Each family's format, whole and in pieces of every size: the calls (arguments compared as
    JSON) and the content written out by hand; a call that does not parse stays content."""
    from serve.tools import ToolStream, parse_auto, plan_tools
    plan = plan_tools(TOOLS, None, None)
    got_content, calls = parse_auto(text, plan, parser)
    assert got_content == content and [json.loads(c["function"]["arguments"]) for c in calls] == args
    for size in (1, 2, 3, 5, 8, 13):
        ts, streamed, got = ToolStream(plan, parser), "", []
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for k, piece in enumerate(pieces):
            for d in ts.feed(piece, k == len(pieces) - 1, "stop"):
                streamed += d.get("content") or ""
                got += [tc["function"]["arguments"] for tc in d.get("tool_calls", []) if "id" not in tc]
        assert streamed == (content or "") and [json.loads(a) for a in got] == args, size


@pytest.mark.parametrize("template,kwargs,text,expected", [
    # Qwen3-2507-style output that never opens a block: all answer, though the user quoted <think>
    ("qwen3.jinja", {}, "It opens the reasoning.", (None, "It opens the reasoning.")),
    ("qwen3.jinja", {}, "<think>hm</think>It opens it.", ("hm", "It opens it.")),
    # the generation prompt still settles it: closed by enable_thinking false, opened by R1's template
    ("qwen3.jinja", {"enable_thinking": False}, "a</think>b", (None, "a</think>b")),
    ("deepseek-r1.jinja", {}, "a</think>b", ("a", "b")),
])
def test_a_tag_quoted_in_a_message_does_not_decide_the_reasoning(gen, template, kwargs, text, expected):
    """Where the output starts (reasoning or answer) is read from the generation prompt the template
    adds, not from the whole prompt: a user who asks about the `<think>` tag does not turn the answer
    into reasoning (before, the quoted tag counted as an open block)."""
    from serve.protocol import ChatCompletionRequest
    from serve.reasoning import split_reasoning
    quoted = [{"role": "user", "content": "What does <think> do?"}]
    with serving(gen, template) as (_, http):
        state = http.app.state.server
        _, _, parsers = state.chat_request(ChatCompletionRequest(messages=quoted, chat_template_kwargs=kwargs))
        assert split_reasoning(parsers.reasoning, parsers.prompt, text) == expected


@pytest.mark.parametrize("continued,text,expected", [
    ("Sure,", " it opens a block.", (None, " it opens a block.")),
    ("<think>let me", " see</think>It opens one.", (" see", "It opens one.")),
])
def test_a_continued_message_decides_the_reasoning_not_a_tag_quoted_before_it(gen, continued, text, expected):
    """continue_final_message: the continued assistant message (its header and text) settles where
    the output starts, not a `<think>` an earlier message quotes (before, the whole prompt was read,
    and the quoted tag opened a block the reply never had)."""
    from serve.protocol import ChatCompletionRequest
    from serve.reasoning import split_reasoning
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    messages = [{"role": "user", "content": "What does <think> do?"}, {"role": "assistant", "content": continued}]
    with serving(gen, template, reasoning_parser="qwen3") as (_, http):
        state = http.app.state.server
        _, _, parsers = state.chat_request(ChatCompletionRequest(messages=messages, continue_final_message=True,
                                                                 add_generation_prompt=False))
        assert split_reasoning(parsers.reasoning, parsers.prompt, text) == expected


def test_section_calls_keep_the_model_text_and_one_call_without_parallel_tool_calls():
    """A DeepSeek / Kimi call's arguments are the model's own JSON text (its spacing kept, so the call
    sent back renders as the model wrote it); with parallel_tool_calls false only the first call is
    kept and the others are dropped, not shown as markup (AutoToolParser's rule); DeepSeek's format is
    the default only where the tokenizer has its markers (R1's distilled models keep hermes)."""
    from serve.tool_parsers import default_tool_parser
    from serve.tools import parse_auto, plan_tools
    text = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris"}<｜tool▁call▁end｜>'
            '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    content, calls = parse_auto(text, plan_tools(TOOLS, None, None), "deepseek_v31")
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"city":"Paris"}', '{"city":"Rome"}']
    content, calls = parse_auto(text, plan_tools(TOOLS, None, False), "deepseek_v31")
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"city":"Paris"}']
    r1 = (TEMPLATES / "deepseek-r1.jinja").read_text()
    assert default_tool_parser(r1, lambda t: None) == "hermes" and default_tool_parser(r1, lambda t: 9) == "deepseek_v3"


def _tagged_tokenizer(tmp_path, tags, special: bool):
    """A small byte-level BPE tokenizer (the tokenizers library) with `tags` added as tokens, loaded
    as jaxinfer loads a model's tokenizer.json, and how to spell text with it avoiding the tags."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    from jaxinfer.tokenizer import load_tokenizer
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the cat sat on a mat think final analysis {} <> / : |"] * 4, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if tags:
        tok.add_special_tokens([AddedToken(t, special=True) for t in tags]) if special else \
            tok.add_tokens([AddedToken(t, special=False) for t in tags])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                "eos_token": "</s>"}))
    spell = lambda text: [i for ch in text for i in tok.encode(ch, add_special_tokens=False).ids]  # noqa: E731
    return load_tokenizer(tmp_path), tok, spell


@pytest.mark.parametrize("name,tags,special", [
    ("qwen3", ("<think>", "</think>"), False), ("seed_oss", ("<seed:think>", "</seed:think>"), True),
    ("gpt_oss", ("<|start|>", "<|end|>", "<|channel|>", "<|message|>"), True), ("qwen3", (), False),
    ("mistral", ("[THINK]", "[/THINK]"), True)])
def test_reasoning_grammar_takes_the_tags_as_the_model_writes_them(name, tags, special, tmp_path):
    """Under a reasoning parser a structured output's grammar starts after the reasoning section. Where
    the tags are added tokens of the tokenizer (Qwen3's <think>, Seed-OSS's, harmony's markers),
    llguidance matches them only as those tokens: the grammar names them so (<[id]>), and the model's
    own tokens pass (before, a tag had to be spelled out in characters); plain text tags stay text."""
    pytest.importorskip("llguidance")
    from jaxinfer.config.sampling import StructuredOutputs
    from jaxinfer.host.structured import Grammars
    from serve.reasoning import REASONING_TAGS, reasoning_prefix
    jt, tok, spell = _tagged_tokenizer(tmp_path, tags, special)
    ids = {t: i for t in REASONING_TAGS if (i := jt.added_token_id(t)) is not None}
    assert ids == {t: tok.token_to_id(t) for t in tags}
    tag = lambda t: [ids[t]] if t in ids else spell(t)  # noqa: E731   (as the model writes it)
    grammars = Grammars(jt, tok.get_vocab_size(), [2])
    if name == "gpt_oss":
        runs = {"open": tag("<|channel|>") + spell("analysis") + tag("<|message|>") + spell("hm") + tag("<|end|>")
                + tag("<|start|>") + spell("assistant") + tag("<|channel|>") + spell("final") + tag("<|message|>")}
    else:
        runs = {"open": tag(tags[0] if tags else "<think>") + spell("hm") + tag(tags[1] if tags else "</think>") + spell("\n"),
                "reasoning": spell("hm") + tag(tags[1] if tags else "</think>") + spell("\n")}
    for state, seq in runs.items():
        grammar = grammars.compile(StructuredOutputs(json_object=True, prefix=reasoning_prefix(name, state, ids)))
        guide = grammars.guide(grammar)
        for t in seq + spell('{"a":1}'):
            guide.consume(t)
            assert not guide.failed, (state, tok.id_to_token(t))
        assert guide.done[-1], state                 # the object closed: the output is complete


def test_seed_oss_template_picks_its_parsers():
    """A chat template that writes Seed-OSS's blocks (its reasoning and tool-call tags) selects the
    seed_oss parsers by default, as --reasoning-parser / --tool-call-parser seed_oss would."""
    from serve.reasoning import default_reasoning_parser
    from serve.tool_parsers import default_tool_parser
    template = ("{%- if message.reasoning_content %}<seed:think>{{ message.reasoning_content }}</seed:think>{% endif %}"
                "{%- for call in message.tool_calls %}<seed:tool_call>\n<function={{ call.function.name }}>"
                "{% for k, v in call.function.arguments.items() %}\n<parameter={{ k }}>{{ v }}</parameter>"
                "{% endfor %}\n</function>\n</seed:tool_call>{% endfor %}")
    assert (default_reasoning_parser(template), default_tool_parser(template)) == ("seed_oss", "seed_oss")


def test_mistral_call_ids_the_model_wrote_are_the_calls_ids():
    """mistral-common decodes `[CALL_ID]id` (v11+) and an array item's "id" (v2-v7) as the tool
    call's id, which the next turn's tool message must echo: they are kept; a call without one gets
    a new id of 9 letters and digits (the form Mistral's templates require)."""
    import re

    from serve.tools import parse_auto, plan_tools
    plan = plan_tools(TOOLS, None, None)
    _, calls = parse_auto('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', plan, "mistral")
    assert [c["id"] for c in calls] == ["a1B2c3D4e"]
    _, calls = parse_auto('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "Q1w2E3r4T"}, '
                          '{"name": "get_weather", "arguments": {"city": "Rome"}}]', plan, "mistral")
    assert calls[0]["id"] == "Q1w2E3r4T" and re.fullmatch(r"[A-Za-z0-9]{9}", calls[1]["id"])


def test_gpt_oss_answer_without_a_call_is_the_same_streamed_or_not():
    """Tools offered, no call made: the answer after an analysis message and a commentary preamble
    comes back without harmony's headers, whole or streamed a character at a time (the whole one
    once kept the preamble's header: the text before tool parsing)."""
    from jaxinfer.client import RequestOutput
    from serve.protocol import chat_message
    from serve.reasoning import OutputParsers
    from serve.stream import ChatChoices
    from serve.tools import plan_tools
    plan, parsers = plan_tools(TOOLS, None, None), OutputParsers("gpt_oss", "", "openai")
    text = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Let me answer.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.")
    message, finish = chat_message(text, "stop", plan, parsers)
    choices, streamed = ChatChoices(1, plan, str, False, parsers), ""
    for k, ch in enumerate(text):
        last = k == len(text) - 1
        for c in choices(RequestOutput("r", 0, ch, [1], [0.0], [None], last, "stop" if last else None)):
            streamed += c["delta"].get("content") or ""
    assert message["content"] == streamed and "<|" not in streamed and streamed.endswith("It is sunny.")
    assert message["reasoning_content"] == "think" and finish == "stop" and "tool_calls" not in message


# MiniMax-M2.5's tool-calling guide (docs/tool_calling_guide.md): its tools, a model output with two
# calls, and what the guide's own parse_tool_calls makes of them
MINIMAX_TOOLS = [{"type": "function", "function": {"name": "search_web", "description": "Search function.",
                                                   "parameters": {"type": "object", "properties": {
                                                       "query_list": {"type": "array", "items": {"type": "string"}},
                                                       "query_tag": {"type": "array", "items": {"type": "string"}}},
                                                       "required": ["query_list", "query_tag"]}}},
                 {"type": "function", "function": {"name": "get_weather", "parameters": {
                     "type": "object", "properties": {"location": {"type": "string"}, "unit": {"type": "string"},
                                                      "days": {"type": "integer"}}}}}]
MINIMAX_OUTPUT = ('<think>\nTwo searches.\n</think>\n\n<minimax:tool_call>\n<invoke name="search_web">\n'
                  '<parameter name="query_tag">["technology", "events"]</parameter>\n'
                  '<parameter name="query_list">["\\"OpenAI\\" \\"latest\\" \\"release\\""]</parameter>\n</invoke>\n'
                  '<invoke name="search_web">\n<parameter name="query_tag">["technology", "events"]</parameter>\n'
                  '<parameter name="query_list">["\\"Gemini\\" \\"latest\\" \\"release\\""]</parameter>\n</invoke>\n'
                  '</minimax:tool_call>')
MINIMAX_CALLS = [("search_web", {"query_tag": ["technology", "events"], "query_list": ['"OpenAI" "latest" "release"']}),
                 ("search_web", {"query_tag": ["technology", "events"], "query_list": ['"Gemini" "latest" "release"']})]


def test_minimax_m2_calls_as_minimax_parses_them():
    """minimax_m2: the guide's two-call output gives the calls its parse_tool_calls gives (arrays typed
    by their schema), whole and streamed a few characters at a time; the text before the section is
    content; an integer parameter by its schema; names in single quotes or bare (as MiniMax's parser
    takes them); an unknown tool stays content; without
    parallel_tool_calls one call; the guide's system prompt shows the format (default parser)."""
    from serve.tool_parsers import default_tool_parser
    from serve.tools import auto_parser, parse_auto, plan_tools
    plan = plan_tools(MINIMAX_TOOLS, None, None)
    body = MINIMAX_OUTPUT.split("</think>\n\n")[1]
    content, calls = parse_auto(body, plan, "minimax_m2")
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(n, a) for n, a in MINIMAX_CALLS]
    p, streamed, text = auto_parser("minimax_m2", plan), [], ""
    for i in range(0, len(body), 5):
        piece, got = p.feed(body[i:i + 5])
        text, streamed = text + piece, streamed + got
    piece, got = p.finish()
    assert (text + piece, [c["function"]["arguments"] for c in streamed + got]) == (
        "", [c["function"]["arguments"] for c in calls])
    weather = ('Let me help you query the weather.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
               '<parameter name="location">San Francisco</parameter>\n<parameter name="unit">celsius</parameter>\n'
               '<parameter name="days">\n3\n</parameter>\n</invoke>\n</minimax:tool_call>')
    content, calls = parse_auto(weather, plan, "minimax_m2")
    assert content == "Let me help you query the weather."   # (the whitespace before calls dropped, as for every parser)
    assert json.loads(calls[0]["function"]["arguments"]) == {"location": "San Francisco", "unit": "celsius", "days": 3}
    quoted = weather.replace('"get_weather"', "'get_weather'").replace('name="days"', "name=days")
    assert parse_auto(quoted, plan, "minimax_m2")[1][0]["function"]["arguments"] == calls[0]["function"]["arguments"]
    unknown = weather.replace("get_weather", "get_time")
    assert parse_auto(unknown, plan, "minimax_m2") == (unknown, [])
    _, calls = parse_auto(body, plan_tools(MINIMAX_TOOLS, None, False), "minimax_m2")
    assert len(calls) == 1
    system = ("When making tool calls, use XML format to invoke tools and pass parameters:\n\n<minimax:tool_call>\n"
              '<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>\n')
    assert default_tool_parser("{{ '" + system.replace("\n", "\\n") + "' }}") == "minimax_m2"


def test_minimax_m2_reasoning_opened_by_its_prompt():
    """minimax_m2 reasoning: MiniMax's generation prompt ends with `<think>` (the guide's rendering), so
    the output's text before `</think>` is reasoning; the calls after it are the tool parser's."""
    from serve.reasoning import split_reasoning
    prompt = "]~b]user\nWhen were the latest announcements from OpenAI and Gemini?[e~[\n]~b]ai\n<think>\n"
    reasoning, content = split_reasoning("minimax_m2", prompt, MINIMAX_OUTPUT[len("<think>\n"):])
    assert reasoning.strip() == "Two searches." and content.startswith("\n\n<minimax:tool_call>")
