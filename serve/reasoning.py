"""Reasoning parsers (vLLM's `--reasoning-parser` names): a thinking model's reasoning kept apart from
its answer, streamed and not. Pure Python, no jax.

  qwen3        `<think>...</think>` written by the model (Qwen3, QwQ); an output that does not open with
               `<think>` is all answer (Qwen3 with enable_thinking false, whose prompt closes the block);
  deepseek_r1  the same tags, but the opening `<think>` may be in the prompt (DeepSeek-R1's template
               ends with it): everything before `</think>` is reasoning, with or without the opening tag;
  seed_oss     qwen3's rules with Seed-OSS's tags, `<seed:think>...</seed:think>`;
  deepseek_v3  qwen3's rules under vLLM's name for DeepSeek-V3.1 / V3.2, whose generation prompt opens the
               block (`<think>`, thinking on) or closes it (`</think>`, thinking off);
  glm45, glm47 qwen3's rules under vLLM's names for GLM-4.5 / 4.6 / 4.7 (whose prompt closes the block,
               `<think></think>`, with enable_thinking false);
  mistral      Mistral's control tokens `[THINK]...[/THINK]` (Magistral; kept in the text for the parser, as
               Seed-OSS's tags are), read as vLLM's mistral parser reads them: text before `[THINK]` is
               answer too, and a `[/THINK]` with no `[THINK]` before it is dropped;
  minimax_m2   deepseek_r1's rules under vLLM's name for MiniMax-M2 (whose generation prompt ends with
               `<think>`);
  kimi_k2      deepseek_r1's rules (Kimi K2 Thinking), and a tool-call section
               (`<|tool_calls_section_begin|>`) also ends the reasoning: it is the answer's, for the
               kimi_k2 tool-call parser;
  cohere_command3, cohere_command4  Command R7B / A and Command A Reasoning (vLLM's tool-parser names,
               whose parsers split the thinking off too): qwen3's rules with Cohere's tags,
               `<|START_THINKING|>...<|END_THINKING|>`; the answer's `<|START_RESPONSE|>` /
               `<|END_RESPONSE|>` markers are dropped from the content (as cohere_melody drops them);
  gpt_oss      OpenAI harmony channels (gpt-oss): the `analysis` channel is reasoning, the `final`
               channel is the answer; any other message (a `commentary` preamble or a function call)
               is passed on whole, headers and all, to the tool-call parser (serve.tool_parsers).

Where the prompt already settles it, the prompt wins (vLLM reads the prompt's tokens the same way):
a prompt that ends inside an open `<think>` block starts the output in reasoning; one whose
generation prompt closes the block (`<think>\\n\\n</think>\\n\\n`) starts it in the answer.

The same rules apply to a whole output and to one streamed piece by piece: a tag split across tokens
or chunks is held back until it is known (never shown as text). An output cut before `</think>` is
all reasoning (no answer). As in vLLM, the text after `</think>` is the content as written.

reasoning_prefix(): the regular language of the reasoning section, so that a structured-output
constraint (response_format, a forced tool call) applies to the answer after it, never inside it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

REASONING_PARSERS = ("qwen3", "deepseek_r1", "gpt_oss", "seed_oss", "deepseek_v3", "glm45", "glm47", "kimi_k2", "minimax_m2",
                     "mistral", "cohere_command3", "cohere_command4")
# the parsers under which an output with no opening tag is reasoning (the prompt may have opened it)
_OPEN_BY_DEFAULT = ("deepseek_r1", "kimi_k2", "minimax_m2")
KIMI_SECTION = "<|tool_calls_section_begin|>"

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SEED_THINK_OPEN, SEED_THINK_CLOSE = "<seed:think>", "</seed:think>"
MISTRAL_THINK_OPEN, MISTRAL_THINK_CLOSE = "[THINK]", "[/THINK]"
COHERE_THINK_OPEN, COHERE_THINK_CLOSE = "<|START_THINKING|>", "<|END_THINKING|>"
# Cohere's answer markers (special tokens): not part of the answer's text
COHERE_RESPONSE = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
COHERE_PARSERS = ("cohere_command3", "cohere_command4")
_TAGS = {"seed_oss": (SEED_THINK_OPEN, SEED_THINK_CLOSE), "mistral": (MISTRAL_THINK_OPEN, MISTRAL_THINK_CLOSE),
         **dict.fromkeys(COHERE_PARSERS, (COHERE_THINK_OPEN, COHERE_THINK_CLOSE))}
# the parsers whose tags are special tokens in their models' vocabularies (the output keeps them)
SPECIAL_TAG_PARSERS = ("gpt_oss", "seed_oss", "mistral", *COHERE_PARSERS)


def think_tags(name: str) -> tuple[str, str]:
    """The reasoning block's opening and closing tags under a `<think>`-style parser."""
    return _TAGS.get(name, (THINK_OPEN, THINK_CLOSE))
H_START, H_END, H_CALL, H_RETURN = "<|start|>", "<|end|>", "<|call|>", "<|return|>"
H_CHANNEL, H_MESSAGE = "<|channel|>", "<|message|>"


def default_reasoning_parser(template: str | None) -> str | None:
    """The parser a chat template shows: harmony channels -> gpt_oss; a template that opens the
    block itself -> deepseek_r1; `<think>` written by the model -> qwen3; else none."""
    if not template:
        return None
    if H_CHANNEL in template and "analysis" in template:
        return "gpt_oss"
    if SEED_THINK_CLOSE in template:
        return "seed_oss"
    if MISTRAL_THINK_CLOSE in template:
        return "mistral"
    if COHERE_THINK_CLOSE in template:
        return "cohere_command3"
    if "<|im_assistant|>" in template and THINK_CLOSE in template:
        return "kimi_k2"
    if re.search(r"add_generation_prompt[\s\S]{0,200}<think>\\n['\"]", template) and "enable_thinking" not in template:
        return "deepseek_r1"
    if THINK_CLOSE in template:
        return "qwen3"
    return None


class DropMarkers:
    """Text streamed with some markers taken out; a marker split across pieces is held back until it
    is known (Cohere's answer markers)."""

    def __init__(self, markers: tuple[str, ...]):
        self.markers, self.pending = markers, ""

    def feed(self, text: str) -> str:
        self.pending += text
        for m in self.markers:
            self.pending = self.pending.replace(m, "")
        keep = max(partial_suffix(self.pending, m) for m in self.markers)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out

    def finish(self) -> str:
        rest, self.pending = self.pending, ""
        return rest


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def prompt_state(name: str, prompt: str) -> str:
    """Where the prompt leaves the output: "reasoning" (inside an open block), "answer" (the
    generation prompt closed the block) or "open" (the model decides)."""
    if name == "gpt_oss":
        return "open"
    open_, close = think_tags(name)
    opened, closed = prompt.rfind(open_), prompt.rfind(close)
    if opened > closed:
        return "reasoning"
    if closed >= 0 and prompt.rstrip().endswith(close):
        return "answer"
    return "reasoning" if name in _OPEN_BY_DEFAULT else "open"


class ThinkParser:
    """The `<think>`-style parsers (all but gpt_oss): feed() text as it is generated -> (reasoning,
    content) safe to show now."""

    def __init__(self, name: str, state: str):
        self.name = name
        self.open, self.close = think_tags(name)
        # "open": may start with <think> (stripped, as vLLM does, even where the prompt opened the
        # block); "reasoning"; "answer". Without the tag: reasoning where the prompt opened the block
        # or under deepseek_r1, else the answer.
        self.fallback = "reasoning" if state == "reasoning" or name in _OPEN_BY_DEFAULT else "answer"
        # the markers that end the reasoning and stay in the answer (Kimi's tool-call section)
        self.section = KIMI_SECTION if name == "kimi_k2" else None
        self.state = "answer" if state == "answer" else "open"
        self.pending = ""
        self.saw_reasoning = False
        # Cohere: the answer's markers dropped
        self.answer = DropMarkers(COHERE_RESPONSE) if name in COHERE_PARSERS else None

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        while self.pending:
            if self.state == "open":
                stripped = self.pending.lstrip()
                if stripped.startswith(self.open):
                    self.pending = stripped[len(self.open):]
                    self.state, self.saw_reasoning = "reasoning", True
                    continue
                if self.open.startswith(stripped):      # maybe the tag, not yet whole
                    break
                self.state = self.fallback
                self.saw_reasoning = self.state == "reasoning"
                continue
            if self.state == "reasoning":
                end = self.pending.find(self.close)
                cut = self.pending.find(self.section) if self.section else -1
                if cut >= 0 and (end < 0 or cut < end):     # the section is the answer's, kept in it
                    reasoning += self.pending[:cut]
                    self.pending, self.state = self.pending[cut:], "answer"
                    continue
                if end >= 0:
                    reasoning += self.pending[:end]
                    self.pending = self.pending[end + len(self.close):]
                    self.state = "answer"
                    continue
                keep = max(partial_suffix(self.pending, self.close),
                           partial_suffix(self.pending, self.section) if self.section else 0)
                reasoning += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                break
            content += self.pending if self.answer is None else self.answer.feed(self.pending)
            self.pending = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        if self.state == "open" and rest:    # only whitespace or a partial "<think>": the fallback's
            self.state = self.fallback
            self.saw_reasoning = self.state == "reasoning"
        if self.state == "reasoning":
            return rest, ""
        if self.answer is not None:
            rest = self.answer.feed(rest) + self.answer.finish()
        return "", rest


def _strip_role(header: str) -> str:
    """A message header without its `<|start|>assistant` (the next message's start, or none)."""
    header = header.strip()
    if header.startswith(H_START):
        header = header[len(H_START):]
    return header[len("assistant"):] if header.startswith("assistant") else header


class HarmonyParser:
    """gpt_oss: harmony messages -> reasoning (analysis), content (final), and every other message
    passed on whole as content for the tool-call parser. The prompt ends with `<|start|>assistant`,
    so the output begins with the first message's header."""

    def __init__(self):
        self.pending = ""
        self.header = ""          # the current message's header text (channel, recipient)
        self.in_body = False
        self.saw_reasoning = False

    def _channel(self) -> str:
        m = re.search(r"<\|channel\|>\s*(\w+)", self.header)
        return m.group(1) if m else ""

    def _passthrough(self) -> bool:
        return self._channel() not in ("analysis", "final") or "to=" in self.header

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        while self.pending:
            if not self.in_body:
                i = self.pending.find(H_MESSAGE)
                if i < 0:
                    break
                self.header = _strip_role(self.header + self.pending[:i])
                self.pending = self.pending[i + len(H_MESSAGE):]
                self.in_body = True
                if self._passthrough():
                    content += self.header + H_MESSAGE
                elif self._channel() == "analysis":
                    self.saw_reasoning = True
                continue
            ends = [(self.pending.find(m), m) for m in (H_END, H_CALL, H_RETURN)]
            ends = [(i, m) for i, m in ends if i >= 0]
            if ends:
                i, marker = min(ends)
                body, self.pending = self.pending[:i], self.pending[i + len(marker):]
            else:
                keep = max(partial_suffix(self.pending, m) for m in (H_END, H_CALL, H_RETURN))
                body, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
                marker = None
            if self._passthrough():
                content += body + (marker or "")
            elif self._channel() == "analysis":
                reasoning += body
            else:
                content += body
            if marker is None:
                break
            self.in_body, self.header = False, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        if not self.in_body:        # a header that never reached <|message|>: show it as text
            return "", self.header + rest
        if self._channel() == "analysis" and not self._passthrough():
            return rest, ""
        return "", rest


class MistralThinkParser(ThinkParser):
    """mistral: the answer until `[THINK]` (a `[/THINK]` there is dropped), then reasoning until
    `[/THINK]`, then the answer as written (vLLM's MistralReasoningParser's split)."""

    def __init__(self, state: str):
        super().__init__("mistral", state)
        self.state = "reasoning" if state == "reasoning" else "before"

    def feed(self, text: str) -> tuple[str, str]:
        if self.state != "before":
            return super().feed(text)
        self.pending += text
        content = ""
        while True:
            hits = [(i, t) for i, t in ((self.pending.find(t), t) for t in (self.open, self.close)) if i >= 0]
            if not hits:
                keep = max(partial_suffix(self.pending, self.open), partial_suffix(self.pending, self.close))
                content += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                return "", content
            i, tag = min(hits)
            content, self.pending = content + self.pending[:i], self.pending[i + len(tag):]
            if tag == self.open:
                self.state, self.saw_reasoning = "reasoning", True
                rest, self.pending = self.pending, ""
                reasoning, more = super().feed(rest)
                return reasoning, content + more

    def finish(self) -> tuple[str, str]:
        if self.state == "before":
            rest, self.pending = self.pending, ""
            return "", rest
        return super().finish()


def make_reasoning_parser(name: str, prompt: str):
    if name == "gpt_oss":
        return HarmonyParser()
    if name == "mistral":
        return MistralThinkParser(prompt_state(name, prompt))
    return ThinkParser(name, prompt_state(name, prompt))


def split_reasoning(name: str | None, prompt: str, text: str) -> tuple[str | None, str]:
    """A whole output -> (reasoning or None, content)."""
    if name is None:
        return None, text
    p = make_reasoning_parser(name, prompt)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    reasoning = r1 + r2
    return (reasoning if p.saw_reasoning else None), c1 + c2


def _section(open_: str, close: str) -> str:
    """A Lark terminal for `open_`, any text without `close`, then `close` (one lexeme, so that the
    lexer cannot stop inside the closing tag)."""
    o, c = re.escape(open_).replace("/", r"\/"), re.escape(close).replace("/", r"\/")
    return rf"/{o}(?s:.*){c}/ & ~/{o}(?s:.*){c}(?s:.+)/"


REASONING_TAGS = (THINK_OPEN, THINK_CLOSE, SEED_THINK_OPEN, SEED_THINK_CLOSE, MISTRAL_THINK_OPEN, MISTRAL_THINK_CLOSE,
                  COHERE_THINK_OPEN, COHERE_THINK_CLOSE, H_START, H_END, H_CHANNEL, H_MESSAGE)


def _body(close: str) -> str:
    """A Lark terminal for any text (one character or more) that does not hold `close`."""
    c = re.escape(close).replace("/", r"\/")
    return rf"/(?s:.+)/ & ~/(?s:.*){c}(?s:.*)/"


def reasoning_prefix(name: str | None, state: str, tag_ids: dict[str, int] | None = None) -> str | None:
    """The Lark grammar (llguidance's) of an output under this parser: the reasoning section, then
    `@answer`, the constraint's own grammar; None where the answer starts at once (the prompt closed
    the block). A structured output then constrains only the answer. tag_ids: the tags that are
    added tokens of the model's tokenizer (Tokenizer.added_token_id): llguidance matches those only
    as their token (`<[id]>`), never as text, so the grammar names them so."""
    if name is None or state == "answer":
        return None
    ids = tag_ids or {}
    if name == "gpt_oss":
        if all(t in ids for t in (H_START, H_END, H_CHANNEL, H_MESSAGE)):
            ch, msg, end, start = (f"<[{ids[t]}]>" for t in (H_CHANNEL, H_MESSAGE, H_END, H_START))
            return (f"start: ({ch} \"analysis\" {msg} BODY? {end} {start} \"assistant\")? {ch} \"final\" {msg} "
                    f"@answer\nBODY: {_body(H_END)}\n")
        return ("start: (THINK \"<|start|>assistant\")? \"<|channel|>final<|message|>\" @answer\n"
                f"THINK: {_section(H_CHANNEL + 'analysis' + H_MESSAGE, H_END)}\n")
    ws = "WS: /\\n{1,2}/\n"      # the line breaks thinking models write after </think>
    open_, close = think_tags(name)
    if open_ in ids and close in ids:
        o, c = f"<[{ids[open_]}]>", f"<[{ids[close]}]>"
        if state == "reasoning":
            return f"start: BODY? {c} WS? @answer\nBODY: {_body(close)}\n{ws}"
        return f"start: ({o} BODY? {c} WS?)? @answer\nBODY: {_body(close)}\n{ws}"
    if state == "reasoning":
        return f"start: THINK WS? @answer\nTHINK: {_section('', close)}\n{ws}"
    return f"start: (THINK WS?)? @answer\nTHINK: {_section(open_, close)}\n{ws}"


@dataclass(frozen=True)
class OutputParsers:
    """How one chat request's output is read: the reasoning parser (None: none), the rendered prompt
    it starts from, and the tool-call format (serve.tool_parsers)."""
    reasoning: str | None = None
    prompt: str = ""
    tools: str = "hermes"

    def reasoning_parser(self):
        return make_reasoning_parser(self.reasoning, self.prompt) if self.reasoning is not None else None


def in_reasoning(p) -> bool:
    if isinstance(p, ThinkParser):
        return p.state == "reasoning"
    return "analysis" in p.header and "to=" not in p.header


def reasoning_tokens(parsers: OutputParsers, deltas) -> int:
    """completion_tokens_details.reasoning_tokens of one choice: the tokens of the deltas that begin
    or end inside the reasoning section (the tags included), 0 when there was none."""
    p, n = parsers.reasoning_parser(), 0
    if p is None:
        return 0
    for d in deltas:
        before = in_reasoning(p)
        p.feed(d.text)
        if before or in_reasoning(p):
            n += len(d.token_ids)
    return n if p.saw_reasoning else 0
