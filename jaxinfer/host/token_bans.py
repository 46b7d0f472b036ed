"""vLLM's allowed_token_ids and bad_words turned into what the device reads (sampling.SamplingBatch):
a request's static packed token mask and its multi-token bad-word sequences. Built once per
request by the engine; never imports jax.

bad_words follow vLLM's SamplingParams.update_from_tokenizer: each word, its leading whitespace
stripped, is encoded without special tokens as it stands and with one leading space; the spaced
form is kept too when its first token differs and it has as many tokens (a tokenizer whose
word-initial pieces carry the space gives two sequences, one that does not gives one). A one-token
sequence is banned everywhere (here: a cleared bit of the static mask); a longer one bans its last
token where the output's last tokens are the rest of it (on device, sampling.apply_bad_words).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxinfer.config.sampling import MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS

__all__ = ["bad_word_sequences", "static_mask", "TokenBanError"]


class TokenBanError(ValueError):
    """allowed_token_ids or bad_words that cannot be served; `field` names which."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def bad_word_sequences(words: Sequence[str], encode, vocab_size: int) -> list[list[int]]:
    """vLLM's token sequences of `words`; encode(text) -> ids without special tokens."""
    out: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        if not plain:
            continue
        out.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    bad = sorted({t for seq in out for t in seq if not 0 <= t < vocab_size})
    if bad:
        raise TokenBanError(f"bad_words encode to token ids {bad[:5]} outside the model's vocabulary [0, {vocab_size})",
                            "bad_words")
    return out


def static_mask(allowed: Sequence[int] | None, banned: Sequence[int], vocab_size: int, words: int) -> np.ndarray | None:
    """The packed mask ([words] int32, bit t % 32 of word t // 32 allows token t) of the tokens in
    `allowed` (None: every token) less `banned`; None when it allows every token."""
    if allowed is None and not banned:
        return None
    bits = np.zeros(words * 32, np.bool_)
    if allowed is None:
        bits[:vocab_size] = True
    else:
        bits[np.asarray(allowed, np.int64)] = True
    bits[np.asarray(banned, np.int64)] = False
    if not bits.any():
        raise TokenBanError("bad_words ban every token allowed_token_ids allows", "bad_words")
    return np.packbits(bits, bitorder="little").view(np.int32).copy()


def multi_token_array(seqs: list[list[int]]) -> np.ndarray | None:
    """The multi-token sequences of `seqs` as [B, MAX_BAD_WORD_TOKENS] int32, left-padded with -1
    (the last token in the last column); None when there are none. Too many or too long: TokenBanError."""
    multi = [s for s in seqs if len(s) > 1]
    if not multi:
        return None
    if len(multi) > MAX_BAD_WORD_SEQUENCES:
        raise TokenBanError(f"bad_words give {len(multi)} token sequences of more than one token; at most "
                            f"{MAX_BAD_WORD_SEQUENCES} are served (a word may give two: with and without a "
                            "leading space)", "bad_words")
    long = [s for s in multi if len(s) > MAX_BAD_WORD_TOKENS]
    if long:
        raise TokenBanError(f"a bad word of {len(long[0])} tokens; at most {MAX_BAD_WORD_TOKENS} tokens each are served",
                            "bad_words")
    out = np.full((len(multi), MAX_BAD_WORD_TOKENS), -1, np.int32)
    for i, s in enumerate(multi):
        out[i, MAX_BAD_WORD_TOKENS - len(s):] = s
    return out
