"""Chat templates, applied as transformers' apply_chat_template applies them (vLLM renders chats the
same way), for the server and the batch script:

- the templates: every one the checkpoint names ("default", "tool_use", ...: jaxinfer.tokenizer
  finds them as transformers does), or the one `--chat-template` gives, or, for a model without a
  template, the plain DEFAULT_CHAT_TEMPLATE (documented in the README);
- which one a request renders: "tool_use" when the request has tools and the model names one,
  else "default" (transformers' get_chat_template; a model without either refuses with a 400);
- a "developer" message (OpenAI's newer name for system) is a system message for a template that
  does not know the role (gpt-oss's does; Qwen's, Llama's and Mistral's drop or refuse it);
- the variables: the special tokens' text by name (bos_token, eos_token, unk_token, pad_token,
  ...) as tokenizer_config names them, overridden by the request's chat_template_kwargs, then the
  messages, add_generation_prompt, the request's documents (vLLM's and transformers' RAG input,
  when given) and, for a template that mentions them, the tools;
- a request's own template (vLLM's `chat_template` field, or `chat_template` in
  chat_template_kwargs), only where the server trusts request templates
  (--trust-request-chat-template, vLLM's flag; else a 400): compiled in the same sandbox, the last
  REQUEST_TEMPLATES kept;
- Jinja as transformers sets it up: trim_blocks, lstrip_blocks, loop controls, a tojson that
  neither sorts keys nor escapes HTML, raise_exception, strftime_now, and `{% generation %}`
  blocks (transformers marks assistant text with them for training masks; rendered as their body);
- the rendered text is encoded without adding special tokens (the template writes BOS where the
  model wants it), except the plain template's, which the tokenizer's own rule gives a BOS.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serve.protocol import OpenAIError
from serve.tools import FAMILY_PREAMBLES, ToolPlan, template_messages

# The bundled model has no chat template of its own; this plain one is documented in the README.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")

# requests' own templates kept compiled (least recently used dropped)
REQUEST_TEMPLATES = 16
MAX_REQUEST_TEMPLATE_CHARS = 1 << 20

# continue_final_message: appended to the last message, found in the rendered text, cut there (transformers)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str):
    raise TemplateError(message)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: its body, as transformers renders it."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class ChatTemplates:
    """A model's chat templates, compiled once (module docstring)."""

    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str] | None = None,
                 plain: bool = False):
        if not templates:
            raise ValueError("no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._env = env
        self._requested: OrderedDict[str, Any] = OrderedDict()   # a request's template text -> compiled
        self._lock = threading.Lock()      # requests render on the server's worker threads
        self.texts = dict(templates)
        self.compiled = {name: env.from_string(text) for name, text in templates.items()}
        self.special_tokens = dict(special_tokens or {})
        self.plain = plain

    @classmethod
    def for_model(cls, tokenizer, override: str | None = None) -> ChatTemplates:
        """The templates the server renders for `tokenizer` (None: a model without one), or the
        one template `override` (--chat-template)."""
        special = tokenizer.special_tokens if tokenizer is not None else {}
        if override:
            return cls({"default": override}, special)
        if tokenizer is not None and tokenizer.chat_templates:
            return cls(tokenizer.chat_templates, special)
        return cls({"default": DEFAULT_CHAT_TEMPLATE}, special, plain=True)

    def _compiled_request(self, template: str) -> Any:
        """A request's own template, compiled in this sandbox (cached); one that does not compile is a
        400 naming chat_template."""
        with self._lock:
            if template in self._requested:
                self._requested.move_to_end(template)
                return self._requested[template]
        if len(template) > MAX_REQUEST_TEMPLATE_CHARS:
            raise OpenAIError(400, f"chat_template is too long ({len(template)} characters; at most "
                                   f"{MAX_REQUEST_TEMPLATE_CHARS})", param="chat_template")
        try:
            compiled = self._env.from_string(template)
        except TemplateError as e:
            raise OpenAIError(400, f"chat_template does not compile: {e}", param="chat_template") from None
        with self._lock:
            self._requested[template] = compiled
            while len(self._requested) > REQUEST_TEMPLATES:
                self._requested.popitem(last=False)
        return compiled

    @property
    def text(self) -> str:
        """The template that shows the model's formats (the reasoning and tool-call parsers'
        defaults): the default one, else tool_use, else the first."""
        return self.texts.get("default") or self.texts.get("tool_use") or next(iter(self.texts.values()))

    def name_for(self, tools: ToolPlan | None) -> str:
        if tools is not None and "tool_use" in self.texts:
            return "tool_use"
        if "default" in self.texts:
            return "default"
        raise OpenAIError(400, f"this model's chat templates ({', '.join(sorted(self.texts))}) include no "
                               "default for a request without tools; send tools, or start the server with "
                               "--chat-template", param="messages")

    def render(self, messages: list[dict], tools: ToolPlan | None = None, kwargs: dict[str, Any] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               documents: list | None = None, template: str | None = None, tool_format: str = "hermes") -> str:
        """The prompt text of `messages` (template_dict()s) with the request's tool plan,
        chat_template_kwargs and documents; a template error is a 400. continue_final_message: the
        text ends where the last message's content does (transformers' rule: a tag appended to it
        marks the spot). template: the request's own (the caller checked it may send one).
        tool_format: the server's tool-call parser, whose format a template that lists no tools is
        asked for (serve.tools.template_messages)."""
        if continue_final_message:
            if add_generation_prompt:
                raise OpenAIError(400, "continue_final_message needs add_generation_prompt false",
                                  param="continue_final_message")
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise OpenAIError(400, "continue_final_message: the last message has no text to continue",
                                  param="continue_final_message")
            messages = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
        text = self._render(messages, tools, kwargs, add_generation_prompt, documents, template, tool_format)
        if not continue_final_message:
            return text
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0:
            raise OpenAIError(400, "continue_final_message: the chat template drops part of the last message, "
                                   "so it cannot be continued", param="continue_final_message")
        # a template that keeps the message's spacing ends right there; one that trims it, trimmed
        return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()

    def _render(self, messages: list[dict], tools: ToolPlan | None, kwargs: dict[str, Any] | None,
                add_generation_prompt: bool, documents: list | None, template: str | None,
                tool_format: str = "hermes") -> str:
        text, compiled = (template, self._compiled_request(template)) if template is not None else \
            (self.texts[self.name_for(tools)], self.compiled[self.name_for(tools)])
        native = "tools" in text   # HF-style templates take tools and structured calls
        # a template that lists no tools but writes the calls in its family's format (DeepSeek's)
        family = tool_format if not native and tool_format in FAMILY_PREAMBLES and "tool_calls" in text else None
        if "developer" not in text:   # OpenAI's newer name for system, for templates that lack it
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        extra = {"tools": list(tools.tools)} if tools is not None and native else {}
        if documents is not None:
            extra["documents"] = documents
        try:
            return compiled.render(**{
                **self.special_tokens, **(kwargs or {}), "messages": template_messages(messages, tools, native, family),
                "add_generation_prompt": add_generation_prompt, **extra})
        except TemplateError as e:
            raise OpenAIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
            # the request's values where the template expects others (chat_template_kwargs {"tools": 5})
            raise OpenAIError(400, f"cannot apply the chat template to this request ({type(e).__name__}: {e})",
                              param="chat_template_kwargs" if kwargs else "messages") from None
