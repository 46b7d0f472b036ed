"""Beam search as vLLM runs it (its LLM.beam_search and its OpenAI server's `use_beam_search`): a
driver over ordinary one-token requests, so it needs nothing from the step but top logprobs, and
every beam step shares the engine's batches and the prefix cache with other traffic.

Each round scores every live beam (its prompt + tokens so far) with one request of max_tokens 1 and
its top 2 * beam_width logprobs; the candidates are each beam's top tokens with the beam's
cumulative logprob plus theirs. Unless ignore_eos, a candidate ending in EOS completes a hypothesis
(its tokens without the EOS unless include_stop_str_in_output, its text without it either way; its
score counts the EOS's logprob)
and leaves the pool; the beam_width best remaining candidates are the next beams. After max_tokens
rounds the completed hypotheses and the live beams are ranked by cumulative logprob / L **
length_penalty, L the whole sequence's length, prompt included, less a final EOS (vLLM's
get_beam_search_score), and the beam_width best are the outputs, best first. Without an EOS the
result is what HF transformers' beam search returns for the same width and length (both keep the
top beam_width of beam_width x vocabulary cumulative logprobs each step).

The beams are ranked by the model's own logprobs: the rounds draw greedily, whose logprobs are
at temperature 1 (vLLM v1 returns raw logprobs, so its `temperature` does not change the search
either). Jax-free: the engine client and the server drive it (EngineClient.beam_search,
serve/app.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxinfer.config.sampling import SamplingParams, SamplingParamsError

# the rounds ask for the top 2 * beam_width logprobs: the sampler's MAX_LOGPROBS (vLLM's
# max_logprobs default, 20, bounds its beam width the same way)
MAX_BEAM_WIDTH = 10

__all__ = ["BeamSearch", "BeamSearchParams", "MAX_BEAM_WIDTH"]


@dataclass(frozen=True, kw_only=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams (what its server makes of n, max_tokens, ignore_eos, length_penalty,
    include_stop_str_in_output); logprobs: top-N logprobs per output token in the result (the
    rounds' own, at most 20); skip_special_tokens: SamplingParams', for the results' text."""
    beam_width: int = 1
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            problems.append(("beam_width", f"beam search takes a beam width (n) in [1, {MAX_BEAM_WIDTH}], "
                                           f"got {self.beam_width!r}"))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"))
        if not isinstance(self.length_penalty, (int, float)) or not -1e3 <= self.length_penalty <= 1e3:
            problems.append(("length_penalty", f"length_penalty must be a number in [-1000, 1000], "
                                               f"got {self.length_penalty!r}"))
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            problems.append(("logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs!r}"))
        if problems:
            raise SamplingParamsError(problems)

    def round_params(self) -> SamplingParams:
        """One round's request per beam: one greedy token and the top logprobs the candidates (and
        the result's logprobs) need."""
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                              logprobs=max(2 * self.beam_width, self.logprobs or 0))


@dataclass
class Beam:
    tokens: list[int]                      # prompt + output so far
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)                    # each output token's
    # (cum_logprob also counts the logprob of an EOS that ended it and is not among its tokens)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)   # each round's top
    finish_reason: str | None = None       # "stop": ended by EOS; None: still live (or "length")


class BeamSearch:
    """One prompt's search: prompts() -> the sequences to score this round, advance(tops) with each
    one's top logprobs [(token id, logprob)], best first, until done; then best()."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_ids: tuple[int, ...]):
        self.prompt_len = len(prompt_ids)
        self.params = params
        self.eos_ids = frozenset(eos_ids)
        self.beams = [Beam(list(prompt_ids))]
        self.completed: list[Beam] = []
        self.rounds = 0

    @property
    def done(self) -> bool:
        return self.rounds >= self.params.max_tokens or not self.beams

    def prompts(self) -> list[list[int]]:
        return [b.tokens for b in self.beams]

    def advance(self, tops: list[list[tuple[int, float]]]) -> None:
        p, width = self.params, self.params.beam_width
        candidates = []   # (cumulative logprob, beam index, token, its logprob)
        for i, (beam, top) in enumerate(zip(self.beams, tops, strict=True)):
            for token, lp in top[:2 * width]:
                candidates.append((beam.cum_logprob + lp, i, token, lp))
        live = []
        for c in candidates:
            if not p.ignore_eos and c[2] in self.eos_ids:
                beam, keep = self.beams[c[1]], p.include_stop_str_in_output
                # its score counts the EOS; its per-token logprobs follow its tokens
                self.completed.append(Beam(beam.tokens + [c[2]] * keep, c[0], beam.logprobs + [c[3]] * keep,
                                           beam.top_logprobs + [tops[c[1]]] * keep, "stop"))
            elif c[0] > float("-inf"):
                live.append(c)
        # the beam_width best (a stable sort: ties keep the beams' and their tokens' order)
        live.sort(key=lambda c: -c[0])
        self.beams = [Beam(self.beams[i].tokens + [t], cum, self.beams[i].logprobs + [lp],
                           self.beams[i].top_logprobs + [tops[i]]) for cum, i, t, lp in live[:width]]
        self.rounds += 1

    def score(self, beam: Beam) -> float:
        """vLLM's get_beam_search_score: cumulative logprob / L ** length_penalty, L the sequence's
        length with its prompt, less one where it ends with an EOS id."""
        n = len(beam.tokens) - (beam.tokens[-1] in self.eos_ids)
        return beam.cum_logprob / (n ** self.params.length_penalty)

    def best(self) -> list[Beam]:
        """The beam_width best hypotheses, best first; the live ones end with "length"."""
        for b in self.beams:
            b.finish_reason = b.finish_reason or "length"
        ranked = sorted(self.completed + self.beams, key=self.score, reverse=True)
        return ranked[:self.params.beam_width]

    def output_ids(self, beam: Beam) -> list[int]:
        return beam.tokens[self.prompt_len:]

    def text_ids(self, beam: Beam) -> list[int]:
        """The output ids its text decodes: an EOS that ended it is never text."""
        ids = self.output_ids(beam)
        return ids[:-1] if beam.finish_reason == "stop" and ids and ids[-1] in self.eos_ids else ids
