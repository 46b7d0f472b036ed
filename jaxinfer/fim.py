"""Fill in the middle: a code model's prompt for the text between a prefix and a suffix.

Code models trained on infilling read the prefix and the suffix between special tokens and write
the middle: OpenAI's `suffix` on /v1/completions (and DeepSeek's FIM completion API) send the prefix
as the prompt. The tokens are found by their text in the vocabulary, the families llama.cpp knows
(src/llama-vocab.cpp) plus DeepSeek's, CodeLlama's and Mistral's:

  - prefix first (PSM): [BOS] PRE prefix SUF suffix MID: Qwen2.5-Coder / Qwen3-Coder / CodeGemma
    (<|fim_prefix|>), StarCoder 1 / 2, SantaCoder, Granite Code (<fim_prefix>), DeepSeek-Coder and
    DeepSeek-V2 / V3 (<｜fim▁begin｜> <｜fim▁hole｜> <｜fim▁end｜>), CodeLlama (▁<PRE> ▁<SUF> ▁<MID>),
    GLM-4.5 (<|code_prefix|>), Falcon-H1 coders (<|prefix|>);
  - suffix first, no middle token: [BOS] [SUFFIX] suffix [PREFIX] prefix: Codestral and the Mistral
    tokenizers of version 3 (mistral_common's InstructTokenizerV2.encode_fim).

Each text is encoded as it stands in those prompts: the prefix as a text of its own (a SentencePiece
or Metaspace tokenizer puts its word marker before it: transformers' CodeLlama tokenizer encodes
" " + prefix, mistral_common the prefix with its dummy prefix), the suffix as text that follows a
special token (no marker: CodeLlama's and mistral_common's encode_infilling). For byte-level
tokenizers (Qwen, DeepSeek, StarCoder) both are what the tokenizer makes of the model card's one
string, f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>". BOS goes first where the
tokenizer adds one.

The tokens that end an infill besides EOS (llama.cpp counts them end of generation: a padding, repo
or file separator token; CodeLlama's <EOT>) are FimTokens.stops, added to the request's stop ids.
Imports no jax (the server's front door uses it).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

# (family, prefix token, suffix token, middle token or None: suffix first)
FAMILIES: tuple[tuple[str, str, str, str | None], ...] = (
    ("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("fim-dash", "<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    ("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    ("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>"),
    ("codellama", "<PRE>", "<SUF>", "<MID>"),          # as llama.cpp's GGUF files name them
    ("glm", "<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>"),
    ("falcon-h1", "<|prefix|>", "<|suffix|>", "<|middle|>"),
    ("mistral", "[PREFIX]", "[SUFFIX]", None),
)
STOP_TEXTS = ("<|fim_pad|>", "<fim_pad>", "<fim-pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
              "<reponame>", "<repo_name>", "<|file_sep|>", "<file_sep>", "<|file_separator|>", "<EOT>", "▁<EOT>")


class FimError(ValueError):
    """The model cannot fill in the middle (no such tokens in its vocabulary)."""


@dataclasses.dataclass(frozen=True)
class FimTokens:
    family: str
    prefix: tuple[str, int]
    suffix: tuple[str, int]
    middle: tuple[str, int] | None     # None: the suffix goes first (Mistral)
    stops: tuple[int, ...]


def find_fim_tokens(tok: Any) -> FimTokens | None:
    """The first family whose tokens are all in the vocabulary of `tok` (a jaxinfer.tokenizer.Tokenizer,
    whose `fim` property calls this), or None."""
    for family, *texts in FAMILIES:
        ids = [tok.token_to_id(t) if t is not None else None for t in texts]
        if ids[0] is None or ids[1] is None or (texts[2] is not None and ids[2] is None):
            continue
        stops = tuple(dict.fromkeys(i for t in STOP_TEXTS if (i := tok.token_to_id(t)) is not None))
        pre, suf = (texts[0], ids[0]), (texts[1], ids[1])
        return FimTokens(family, pre, suf, (texts[2], ids[2]) if texts[2] is not None else None, stops)
    return None


def fills_in(tok: Any, suffix: str | None) -> bool:
    """Whether a request with this `suffix` fills in the middle: any suffix given, an empty one too
    (the cursor at the end of a file: mistral_common and llama.cpp keep the layout), except an empty
    one for a model with no such tokens (OpenAI's no-op value: a plain completion)."""
    return suffix is not None and (suffix != "" or (tok is not None and tok.fim is not None))


def with_fim_stops(tok: Any, params: Any) -> Any:
    """SamplingParams that also end at the family's infill stop tokens (FimTokens.stops)."""
    return dataclasses.replace(params, stop_token_ids=tuple(dict.fromkeys(params.stop_token_ids + tok.fim.stops)))


def fim_prompt(tok: Any, prefix: str | Sequence[int], suffix: str, add_special_tokens: bool = True) -> list[int]:
    """The prompt ids that ask the model for the text between `prefix` (text, or its token ids
    taken as they are) and `suffix`; FimError if the vocabulary has no fill-in-the-middle tokens."""
    fim = tok.fim
    if fim is None:
        raise FimError("this model's vocabulary has no fill-in-the-middle tokens (e.g. <|fim_prefix|>, "
                       "<fim_prefix>, <｜fim▁begin｜>, ▁<PRE>, [SUFFIX]): it was not trained to fill in the middle")
    pre = list(prefix) if not isinstance(prefix, str) else tok.encode_piece(prefix)
    suf = tok.encode_piece(suffix, first=False)
    bos = [tok.bos_id] if add_special_tokens and tok.adds_bos_token else []
    if fim.middle is None:
        return [*bos, fim.suffix[1], *suf, fim.prefix[1], *pre]
    return [*bos, fim.prefix[1], *pre, fim.suffix[1], *suf, fim.middle[1]]
