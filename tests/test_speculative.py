"""Speculative decoding (jaxinfer/spec_decode/, host/speculative.py): exact verification and the
engine's draft-model, n-gram and Medusa methods (Medusa's own pieces: test_medusa.py).

References from outside the code under test: the target's distributions from HF transformers (and
numpy's softmax / top-p / repetition penalty transcribed from their definitions), chi-square tests
from scipy, the greedy outputs of the same engine without speculation, hand-worked n-gram lookups.
"""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from scipy import stats

from jaxinfer import Generator, SamplingParams
from jaxinfer.host.speculative import SpecStats, ngram_proposal

P_MIN = 0.01   # the chi-square tests' threshold (the issue's): fixed seeds make each test deterministic


# ------------------------------------------------------------------------------------ references
def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest prefix of the sorted distribution whose mass reaches top_p (the top token
    always), renormalised: HF's TopPLogitsWarper and vLLM's definition."""
    if top_p >= 1:
        return p
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, dtype=bool)
    keep[order[before < top_p]] = True
    keep[order[0]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def _chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson's test; cells expected below 5 are pooled into one."""
    n = counts.sum()
    exp = expected_probs * n
    assert counts[exp == 0].sum() == 0, "a token of probability 0 was drawn"
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


# ------------------------------------------------------------------------------------ n-gram lookup
def test_ngram_proposal_hand_worked():
    # suffix [1, 2] last occurred at 0..1; what followed: 3, 9, 1
    assert ngram_proposal([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    # the longest suffix wins: [4, 1, 2] occurred at 0 (then 7) though [1, 2] occurred later (then 8)
    assert ngram_proposal([4, 1, 2, 7, 9, 1, 2, 8, 4, 1, 2], 2) == [7, 9]
    # among equal lengths the latest occurrence: [5] at 0 (then 6) and at 2 (then 7)
    assert ngram_proposal([5, 6, 5, 7, 5], 1, max_n=1) == [7]
    # the proposal stops at the end of the tokens; nothing matches -> []
    assert ngram_proposal([1, 2, 3, 1], 5) == [2, 3, 1]
    assert ngram_proposal([1, 2, 3, 4], 3) == []
    assert ngram_proposal([7], 3) == []


def test_ngram_lookup_on_the_device_matches_the_host_rule():
    """speculative.ngram_lookup (the step's prompt lookup, every row at once over a padded history)
    against the hand-worked cases above and host ngram_proposal on random histories."""
    import jax.numpy as jnp
    from jaxinfer.spec_decode.ngram import ngram_lookup

    def look(rows, k, max_n=4, min_n=1, h=24):
        hist = np.full((len(rows), h), -1, np.int32)
        for i, r in enumerate(rows):
            hist[i, :len(r)] = r
        d, n = ngram_lookup(jnp.asarray(hist), jnp.asarray([len(r) for r in rows], jnp.int32), k, max_n, min_n)
        return [np.asarray(d[i, :int(n[i])]).tolist() for i in range(len(rows))]
    assert look([[1, 2, 3, 9, 1, 2], [4, 1, 2, 7, 9, 1, 2, 8, 4, 1, 2], [1, 2, 3, 1], [1, 2, 3, 4], [7]], 3) == [
        [3, 9, 1], [7, 9, 1], [2, 3, 1], [], []]
    assert look([[5, 6, 5, 7, 5]], 1, max_n=1) == [[7]]
    rng = np.random.RandomState(0)
    for _ in range(40):
        k, max_n = rng.randint(1, 6), rng.randint(1, 5)
        min_n = rng.randint(1, max_n + 1)
        rows = [rng.randint(0, rng.randint(2, 6), rng.randint(1, 25)).tolist() for _ in range(5)]
        assert look(rows, k, max_n, min_n) == [ngram_proposal(r, k, max_n, min_n) for r in rows]


def test_ngram_under_a_grammar_proposes_the_forced_tokens_first():
    """A constrained row's n-gram chain: the tokens its grammar forces next (they spell the JSON text
    the schema fixes, per the tokenizer's own decode), then what followed them in the prompt."""
    from types import SimpleNamespace
    from jaxinfer import StructuredOutputs
    from jaxinfer.generator import default_model_path
    from jaxinfer.host.speculative import Proposer
    from jaxinfer.host.structured import Grammars
    from jaxinfer.tokenizer import load_tokenizer
    tok = load_tokenizer(default_model_path())
    grammars = Grammars(tok, 4096, tok.eos_ids)
    schema = {"type": "object", "properties": {"quote": {"type": "string"}}, "required": ["quote"],
              "additionalProperties": False}
    guide = grammars.guide(grammars.compile(StructuredOutputs(json=json.dumps(schema))))
    prompt = tok.encode('x {"quote":"and the dog ran"} y', add_special_tokens=False)
    req = SimpleNamespace(guide=guide, all_ids=list(prompt), proposals=None)
    got = Proposer("ngram")(req, 12, 12)
    forced = guide.forced()
    assert tok.decode(forced) == '{"quote":"' and got[:len(forced)] == forced
    # the rest: a run of the prompt's tokens that followed the last forced token there: the quote
    rest = got[len(forced):]
    assert len(got) == 12 and any(prompt[i - 1] == forced[-1] and prompt[i:i + len(rest)] == rest
                                  for i in range(1, len(prompt)))
    assert tok.decode(got).startswith('{"quote":"and the dog')
    # k smaller than the forced text: only forced tokens; a free position: the plain lookup
    assert Proposer("ngram")(req, 3, 3) == forced[:3]
    req.guide = None
    assert Proposer("ngram")(req, 4, 4) == ngram_proposal(prompt, 4)


def test_spec_stats_counts():
    s = SpecStats(3)
    s.add([2, 2, 6, 2, 1, 1])   # two rounds of 3 proposals: all three accepted, then the first only
    s.add([1, 1, 2, 0, 0, 0])   # one round of 2 proposals, the first rejected
    s.add([3, 0, 0, 0, 0, 0])   # three rounds in which prompt lookup found nothing: no drafts
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 4)
    assert s.accepted_per_pos == [2, 1, 1]
    assert s.mean_acceptance_length == pytest.approx(1 + 4 / 3)


# ------------------------------------------------------------------------------------ verify() alone
def _batch(n: int, temperature: float, top_p: float = 1.0, rep: float = 1.0, history: np.ndarray | None = None):
    from jaxinfer.sampling import SamplingBatch
    f = lambda v, dt=np.float32: np.full(n, v, dt)  # noqa: E731
    h = np.full((n, 16), -1, np.int32) if history is None else history
    return SamplingBatch(f(temperature), f(0, np.int32), f(top_p), f(0.0), f(rep), f(0.0), f(0.0),
                         np.arange(n, dtype=np.uint32), f(0, np.int32), f(4, np.int32), f(0, np.int32),
                         h, np.zeros(h.shape, bool), np.full((n, 1), -1, np.int32),
                         np.full((n, 300), -1, np.int32), np.zeros((n, 300), np.float32),
                         np.full((n, 2), -1, np.int32), np.zeros(n, np.int32), np.full((n, 1, 3), -1, np.int32),
                         np.zeros(n, bool), logprobs_mode="processed_logprobs")   # the logprobs of what the target draws from


@pytest.mark.parametrize("case", ["draft", "garbage", "top_p_draft", "penalty", "grammar"])
def test_verify_is_exact(case):
    """Thousands of rows, one seed each, the same proposals' distribution: the first token follows
    the target's p_0 and the second (where the first was accepted) p_1 given the first, whatever
    the proposals (a draft distribution q, or uniform garbage with one-hot q). "grammar": garbage
    under a grammar mask per position (after t0: token_mask; after d_1, d_2: node_masks), so p_j
    is the masked distribution and a proposal its position's mask forbids is never accepted."""
    import jax
    from jaxinfer.spec_decode.verification import verify
    from tests.test_structured import _pack
    n, v, k = 12000, 24, 2
    rng = np.random.default_rng({"draft": 1, "garbage": 2, "top_p_draft": 3, "penalty": 4, "grammar": 5}[case])
    logits = (rng.normal(size=(k + 1, v)) * 1.5).astype(np.float32)
    temp, top_p, rep = {"top_p_draft": (1.5, 0.9, 1.0), "penalty": (1.0, 1.0, 1.8)}.get(case, (1.0, 1.0, 1.0))
    allowed = rng.random((k + 1, v)) < 0.5 if case == "grammar" else np.ones((k + 1, v), bool)
    if case in ("garbage", "grammar"):
        drafts, q = rng.integers(0, v, size=(n, k)).astype(np.int32), None
    else:
        qd = _softmax(rng.normal(size=(k, v)))
        drafts = np.stack([rng.choice(v, size=n, p=qd[j]) for j in range(k)], axis=1).astype(np.int32)
        q = np.broadcast_to(qd.astype(np.float32), (n, k, v))
    # the prompt (history) of every row: positions 0..3 hold tokens 0..3; the token drawn after t0 is
    # at position 4 (b.position), so proposal j sits at position 4 + j
    hist = np.full((n, 16), -1, np.int32)
    hist[:, :4] = np.arange(4)
    b = _batch(n, temp, top_p, rep, hist)
    masks = ()
    if case == "grammar":   # one slot shared by every row: its masks after d_1 and d_2
        packed = _pack(allowed)
        b.token_mask = np.broadcast_to(packed[0], (n, packed.shape[1])).copy()
        masks = (packed[None, 1:], np.zeros(n, np.int32))
    ids, lps, _, _, drawn = jax.jit(verify)(np.broadcast_to(logits, (n, k + 1, v)), drafts, np.full(n, k, np.int32),
                                           q, b, *masks)
    ids, drawn = np.asarray(ids), np.asarray(drawn)

    def target(j: int, seen: list[int]) -> np.ndarray:
        x = logits[j].astype(np.float64)
        for t in set(seen):   # CTRL repetition penalty over the history
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        return _top_p(_softmax(np.where(allowed[j], x / temp, -np.inf)), top_p)

    assert (target(0, [0, 1, 2, 3]) > 0).sum() >= 3    # a test with choices left
    assert _chi_square_p(np.bincount(ids[0], minlength=v), target(0, [0, 1, 2, 3])) > P_MIN
    if rep == 1:   # p_1 does not depend on the first token here: every row that went on
        rows, seen = drawn >= 2, [0, 1, 2, 3]
    else:          # the penalty sees the first token: rows that accepted the most frequent one
        first = int(np.bincount(ids[0][drawn >= 2], minlength=v).argmax())
        rows, seen = (drawn >= 2) & (ids[0] == first), [0, 1, 2, 3, first]
    assert rows.sum() > 300
    assert _chi_square_p(np.bincount(ids[1][rows], minlength=v), target(1, seen)) > P_MIN
    # the logprobs returned are the target's (processed: after the mask, penalty, temperature, top-p)
    with np.errstate(divide="ignore"):   # log 0 at the masked and cut tokens (never emitted)
        ref = np.log(target(0, [0, 1, 2, 3]))
    np.testing.assert_allclose(np.asarray(lps)[0], ref[ids[0]], rtol=0, atol=2e-5)
    # every emitted token is allowed at its position (accepted proposals and the drawn ones alike)
    for j in range(k + 1):
        assert allowed[j, ids[j][drawn > j]].all(), j


# ------------------------------------------------------------------------------------ the engine
# float32: the assertions compare greedy tokens and logprobs (atol 1e-4) between engines. num_blocks:
# 4 sequences of 256 tokens (+ the null block; what CPU sizes by itself), so that on a GPU the engines
# alive at once (the module's fixtures and a test's own) do not each size a pool from the device's memory
BUNDLED = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, token_buckets=[16], max_model_len=256,
               num_blocks=4 * 256 // 16 + 1)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
# penalties see each accepted proposal (and, across rounds on the device, each round's tokens)
PENALISED = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2, repetition_penalty=1.3,
                           frequency_penalty=0.3)


def _prompts(tokenizer) -> list[list[int]]:
    from jaxinfer.generator import default_model_path
    text = (default_model_path() / "heldout.txt").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    copy = ids[500:530]
    # a copy-heavy prompt (a passage, then its start again) and plain held-out text of several lengths
    return [copy + ids[900:905] + copy[:6], ids[2000:2011], ids[3000:3037], ids[4000:4003]]


def _assert_same_greedy(ref, out, same_length: bool = True) -> None:
    """Token for token, up to a near-tie: where they first differ the reference's top two logprobs
    must lie within 1e-3 (a 5-token verification chunk and a 1-token decode sum the same products
    in a different order: float32 differences of ~1e-5 can flip only such a tie); the rest of that
    sequence is then skipped. same_length False: outputs that may stop early (EOS) have the same
    length unless they differ somewhere."""
    for r, o in zip(ref, out):
        a, b = r.token_ids, o.token_ids
        assert len(a) == len(b) or not same_length and a[:len(b)] != b[:len(a)], (a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                top = r.samples[0].top_logprobs[i]
                assert abs(top[0][1] - top[1][1]) < 1e-3, (i, x, y, top)
                break
        else:   # the logprobs are the target's, whichever way the token was decided
            np.testing.assert_allclose(o.logprobs, r.logprobs, rtol=0, atol=1e-4)


def _banning(tokenizer, ref) -> SamplingParams:
    """vLLM's bans that verification and the device's rounds must honour like a plain step: bad
    words made of reference outputs' own tokens (two and three tokens, in the middle of two outputs)
    and min_tokens 12 against EOS at +8 (it ends outputs once allowed)."""
    words = [tokenizer.decode(ref[0].token_ids[6:8]), tokenizer.decode(ref[2].token_ids[10:13])]
    [eos] = tokenizer.eos_ids
    return SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, bad_words=[w.strip() for w in words],
                          min_tokens=12, logit_bias={eos: 8.0})


@pytest.fixture(scope="module")
def bundled_reference():
    g = Generator.from_pretrained(**BUNDLED)
    prompts = _prompts(g.tokenizer)
    ref = g.generate(prompts, GREEDY)
    banning = _banning(g.tokenizer, ref)
    banned = g.generate(prompts, banning)
    # the bans bite: the bad words' outputs change, and EOS ends some output after 12 tokens
    assert banned[0].token_ids != ref[0].token_ids and banned[2].token_ids != ref[2].token_ids
    assert any(o.samples[0].finish_reason == "stop" for o in banned) and min(len(o.token_ids) for o in banned) >= 12
    return prompts, ref, g.generate(prompts, PENALISED), g, (banning, banned)


@pytest.mark.parametrize("method", ["draft", "ngram", "medusa"])
def test_greedy_identical_bundled_mixed_and_preempted(method, bundled_reference):
    """Speculation on vs off, the bundled model (medusa: its bundled heads and their tree): all
    prompts at once (prefill chunks beside speculating rows) in a pool so small (4 sequences of up to
    81 tokens, 252 in all, in 11 blocks of 16) that running requests are preempted and recomputed."""
    prompts, ref, ref_penalised, _, _ = bundled_reference
    # a Medusa row's tree takes 8 of the 16-token budget, so fewer rows grow at once: a smaller pool.
    # The context is what the pool holds (a pool must hold one sequence of max_model_len): 144 or 176
    # tokens, over the 81 of the longest sequence and its proposals
    blocks = 10 if method == "medusa" else 12
    g = Generator.from_pretrained(**{**BUNDLED, "num_blocks": blocks, "max_model_len": (blocks - 1) * 16},
                                  speculative_method=method, num_speculative_tokens=3, speculative_max_batch=4)
    steps, drawn = [], []
    g.engine.add_step_observer(lambda t: steps.append(t.spans))
    update = g.engine.scheduler.update

    def spy(plan, samples, **kw):   # the most tokens one row drew in each step
        drawn.append(max(map(len, samples.values()), default=0))
        return update(plan, samples, **kw)
    g.engine.scheduler.update = spy
    _assert_same_greedy(ref, g.generate(prompts, GREEDY))
    st = g.engine.stats()
    assert st["num_preemptions"] > 0 and st["compilations_after_warmup"] == 0
    # some step held a prefill chunk (several tokens from a non-final position) beside a speculating row
    assert any(any(n > 1 for _, n in s) and len(s) > 1 for s in steps)
    # the bundled Medusa heads are weaker proposers (MODEL_CARD: head 0 is right 1 time in 6)
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_mean_acceptance_length"] > (
        1.05 if method == "medusa" else 1.2)
    assert st["spec_decode_num_accepted_tokens"] == sum(st["spec_decode_num_accepted_tokens_per_pos"])
    # steps that ran several rounds on the device: a row drew more than 1 + k tokens (Medusa: 1 + depth)
    assert max(drawn) > 4
    _assert_same_greedy(ref_penalised, g.generate(prompts, PENALISED))
    banning, ref_banned = bundled_reference[4]
    _assert_same_greedy(ref_banned, g.generate(prompts, banning), same_length=False)
    # min_tokens across the device's rounds, rows with proposals and without: EOS at +30 (above any
    # spread of this model's logits) is each output's first token once allowed, so every output is
    # exactly min_tokens tokens and EOS (a later round without proposals read round 0's position)
    [eos] = g.tokenizer.eos_ids
    repeats = [g.tokenizer.encode(t) for t in ("the the the the the the the the the the the the the the the",
                                               "Once upon a time there was a", "the hacker the hacker the hacker")]
    for min_tokens in (9, 14, 20):
        outs = g.generate(repeats, SamplingParams(max_tokens=40, temperature=0.0, logit_bias={eos: 30},
                                                  min_tokens=min_tokens))
        assert [o.token_ids for o in outs] == [o.token_ids[:min_tokens] + [eos] for o in outs], min_tokens
        assert all(eos not in o.token_ids[:min_tokens] for o in outs)


def _draft_pages_of(g, token_ids: list[int]) -> list[np.ndarray]:
    """The draft model's K and V pages ([layers] of [positions, kv heads, head dim]) at the cached
    full blocks of a finished request's tokens (prefix caching keeps them after it ends; the block a
    request completes in its last step is not cached), the first three of them."""
    from jaxinfer.host.block_manager import block_hash
    bs, hashes = g.engine.blocks.block_size, []
    for i in range((len(token_ids) - 1) // bs):
        hashes.append(block_hash(hashes[-1] if hashes else None, token_ids[i * bs: (i + 1) * bs]))
    blocks = g.engine.blocks.lookup(hashes)[:3]
    assert len(blocks) == 3
    pages = g.engine.runner.kv_pages[1]
    return [_gather_blocks(np.asarray(x), blocks) for layer in pages for x in (layer.k, layer.v)]


def _gather_blocks(pages: np.ndarray, blocks: list[int]) -> np.ndarray:
    """[kv heads, blocks, block size, head dim] pages -> [positions, kv heads, head dim] of these blocks."""
    return np.concatenate([pages[:, b] for b in blocks], axis=1).swapaxes(0, 1)


def test_draft_skipped_while_speculation_is_off_then_caught_up(bundled_reference):
    """The load policy off (two sequences, speculative_max_batch=1): steps skip the draft model,
    prefill included; when one sequence is left, a step runs the draft alone over what it missed,
    then the sequence speculates. Greedy tokens are the engine's without speculation, and afterwards
    the draft's pages hold, at every cached position, what they hold when the same request
    speculated throughout (the draft's pages are overwritten with 7.0 in between, so a missed
    write shows)."""
    import jax
    _, _, _, plain, _ = bundled_reference
    long, short = _prompts(plain.tokenizer)[1:3]
    params = [SamplingParams(max_tokens=56, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
    ref = plain.generate([long, short], params)
    g = Generator.from_pretrained(**BUNDLED, speculative_method="draft", num_speculative_tokens=3,
                                  speculative_max_batch=1)
    alone = g.generate([long], params[:1])[0]
    assert alone.token_ids == ref[0].token_ids
    tokens = long + alone.token_ids
    expected = _draft_pages_of(g, tokens)
    g.reset_prefix_cache()
    target, draft = g.engine.runner.kv_pages
    g.engine.runner.kv_pages = (target, jax.tree.map(lambda x: x * 0 + 7, draft))
    st0 = g.engine.stats()
    out = g.generate([long, short], params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    st = g.engine.stats()
    assert st["compilations_after_warmup"] == 0
    assert st["spec_decode_draft_catchup_tokens"] > st0["spec_decode_draft_catchup_tokens"]
    assert st["spec_decode_num_accepted_tokens"] > st0["spec_decode_num_accepted_tokens"]
    # float32 K/V of a 3-layer model, computed in chunks of different lengths (the catch-up chunk vs
    # one token per round): the sums are the same products in another order, ~1e-6 relative apart
    for got, want in zip(_draft_pages_of(g, tokens), expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["ngram", "medusa"])
def test_load_policy_off_then_on_greedy_identical(method, bundled_reference):
    """Three sequences with speculative_max_batch=1 and multi-step decoding on (8 iterations): steps
    with speculation off run the plain engine's program; once one sequence is left it speculates
    (Medusa: its first step proposes the trees). Greedy tokens are the engine's without speculation.
    (Medusa's policy-off steps used to decode several iterations through the tree-masked attention
    without advancing its positions: tokens changed from the second iteration on, and a sequence
    that decoded that way was never given a tree again.)"""
    _, _, _, plain, _ = bundled_reference
    prompts = _prompts(plain.tokenizer)[1:4]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in (48, 12, 20)]
    ref = plain.generate(prompts, params)
    g = Generator.from_pretrained(**BUNDLED, speculative_method=method, num_speculative_tokens=3,
                                  speculative_max_batch=1)
    _assert_same_greedy(ref, g.generate(prompts, params))
    st = g.engine.stats()
    assert st["compilations_after_warmup"] == 0 and st["spec_decode_num_drafts"] > 0


GUIDED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                                 "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                          "maxItems": 3}},
                 "required": ["name", "age", "tags"], "additionalProperties": False}
GUIDED_REGEX = r"(Joseph|Judah) (said|went) [a-z ]{5,20}\."


def _guided_requests():
    from jaxinfer import StructuredOutputs
    p = dict(max_tokens=48, temperature=0.0, logprobs=2)
    json_prompt = 'Give me JSON: {"name": "Joseph", "age": 30, "tags": ["a", "b"]} and again: '
    return ([json_prompt, "And Joseph said unto his brethren, Joseph said", json_prompt, "Pick one: yes or no? yes"],
            [SamplingParams(**p, structured_outputs=StructuredOutputs(json=json.dumps(GUIDED_SCHEMA))),
             SamplingParams(**p, structured_outputs=StructuredOutputs(regex=GUIDED_REGEX)),
             SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
             SamplingParams(**p, structured_outputs=StructuredOutputs(choice=["yes", "no", "yes and no"]))])


@pytest.fixture(scope="module")
def guided_reference():
    g = Generator.from_pretrained(**BUNDLED)
    prompts, params = _guided_requests()
    return g.generate(prompts, params)


@pytest.mark.parametrize("method", ["ngram", "medusa", "draft"])
def test_greedy_identical_under_a_grammar(method, guided_reference):
    """Structured outputs with speculation: the host walks each constrained row's grammar along its
    proposals (n-gram chain, Medusa tree) so the step verifies every position under its own mask;
    greedy output (JSON schema, regex and choice rows beside a free row) is the same as without
    speculation, and valid. The draft model proposes on the device, where no grammar runs: its
    constrained rows decode without proposals."""
    prompts, params = _guided_requests()
    g = Generator.from_pretrained(**BUNDLED, speculative_method=method, num_speculative_tokens=3,
                                  speculative_max_batch=4)
    outs = g.generate(prompts, params)
    _assert_same_greedy(guided_reference, outs)
    jsonschema.validate(json.loads(outs[0].text), GUIDED_SCHEMA)
    assert re.fullmatch(GUIDED_REGEX, outs[1].text) and outs[3].text in ("yes", "no", "yes and no")
    # the constrained rows alone: what they proposed and had accepted
    before = g.engine.stats()
    alone = g.generate(prompts[:2], params[:2])
    _assert_same_greedy(guided_reference[:2], alone)
    st = g.engine.stats()
    drafts = st["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = st["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    if method == "draft":
        assert drafts == 0
    else:
        assert drafts > 5 and accepted > 5, (drafts, accepted)
    assert st["compilations_after_warmup"] == 0


@pytest.fixture(scope="module")
def gpt2_reference(hf_model_dir):
    # float32 and an explicit pool, as BUNDLED
    kw = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, token_buckets=[16], max_model_len=128,
              num_blocks=4 * 128 // 16 + 1)
    rng = np.random.RandomState(0)
    base = rng.randint(3, 80, 12).tolist()
    prompts = [base + base[:5], rng.randint(3, 80, 7).tolist(), base * 2]
    return kw, prompts, Generator.from_pretrained(hf_model_dir("gpt2"), **kw).generate(prompts, GREEDY)


# learned positions, LayerNorm, GELU: unlike the bundled Llama (medusa: random heads, a node's
# position is its root's + its depth)
@pytest.mark.parametrize("method", ["ngram", "medusa"])
def test_greedy_identical_gpt2(method, gpt2_reference, hf_model_dir, tmp_path):
    from tests.hf_models import random_medusa_heads
    kw, prompts, ref = gpt2_reference
    kw = dict(kw, speculative_max_batch=4)
    if method == "medusa":   # and the load policy: no speculation while more than 2 sequences run
        kw = dict(kw, speculative_model=random_medusa_heads(hf_model_dir("gpt2"), tmp_path / "heads"),
                  num_speculative_tokens=3, max_decode_steps=1, speculative_max_batch=2)
    g = Generator.from_pretrained(hf_model_dir("gpt2"), **kw, speculative_method=method)
    if method == "medusa":   # two sequences speculate (greedy output is batch-invariant: ref[:2])
        _assert_same_greedy(ref[:2], g.generate(prompts[:2], GREEDY))
        drafts = g.engine.stats()["spec_decode_num_drafts"]
        steps = []
        g.engine.add_step_observer(lambda t: steps.append(t.spans))
    _assert_same_greedy(ref, g.generate(prompts, GREEDY))
    assert g.engine.stats()["spec_decode_num_drafts"] > 0
    if method == "medusa":   # three at once: the policy turns speculation off, no new drafts
        assert g.engine.stats()["spec_decode_num_drafts"] == drafts
        assert any(len(s) == 3 and all(n == 1 for _, n in s) for s in steps)


def test_draft_model_refused_clearly(hf_model_dir, tmp_path):
    target = hf_model_dir("llama-gqa-llama3")
    with pytest.raises(ValueError, match="needs speculative_model"):
        Generator.from_pretrained(target, speculative_method="draft", warmup=False)
    with pytest.raises(ValueError, match="vocabulary"):   # 97 tokens vs the target's 131
        Generator.from_pretrained(target, speculative_method="draft", speculative_model=hf_model_dir("llama-mqa-tied-linear"),
                                  warmup=False)
    with pytest.raises(ValueError, match="only used with"):
        Generator.from_pretrained(target, speculative_model=target, warmup=False)
    with pytest.raises(ValueError, match=r"draft model with state layers \(GraniteMoeHybridForCausalLM"):
        Generator.from_pretrained(target, speculative_method="draft", warmup=False,
                                  speculative_model=hf_model_dir("granitemoehybrid"))
    with pytest.raises(ValueError, match="speculative_method"):
        Generator.from_pretrained(target, speculative_method="medusa2", warmup=False)


# ------------------------------------------------------------------------------------ exactness, end to end
EXACT_MODEL = "llama-mqa-tied-linear"   # vocab 97
EXACT_PROMPT = [5, 9, 14, 20, 27, 5, 9, 14, 20, 27, 5, 9]   # repeats: prompt lookup finds matches


@pytest.fixture(scope="module")
def exact_reference(hf_model_dir):
    """HF transformers' exact marginals of the 1st, 2nd and 3rd generated token after EXACT_PROMPT
    (every continuation of two tokens enumerated), at temperature 1 with top_p 1 and 0.9."""
    import torch
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(hf_model_dir(EXACT_MODEL)).eval()
    v = model.config.vocab_size
    with torch.no_grad():
        def dist(seqs: np.ndarray) -> np.ndarray:
            return model(torch.as_tensor(seqs)).logits[:, -1].double().numpy()
        prompt = np.asarray([EXACT_PROMPT])
        l1 = dist(prompt)[0]
        l2 = dist(np.concatenate([np.repeat(prompt, v, 0), np.arange(v)[:, None]], 1))            # [x1, V]
        pairs = np.stack(np.meshgrid(np.arange(v), np.arange(v), indexing="ij"), -1).reshape(-1, 2)
        l3 = np.concatenate([dist(np.concatenate([np.repeat(prompt, len(c), 0), c], 1))
                             for c in np.array_split(pairs, 8)]).reshape(v, v, v)                  # [x1, x2, V]
    out = {}
    for top_p in (1.0, 0.9):
        f = lambda lg: np.apply_along_axis(lambda r: _top_p(_softmax(r), top_p), -1, lg)  # noqa: E731
        p1, p2, p3 = f(l1), f(l2), f(l3)
        out[top_p] = (p1, p1 @ p2, np.einsum("a,ab,abc->c", p1, p2, p3))
    return out


def _sample_tokens(g, top_p: float, requests: int = 16, n: int = 64) -> np.ndarray:
    """[requests * n, 3]: the first three tokens of n samples per request, one seed per request."""
    # max_tokens 4: after the first token a row may propose both of its k = 2 tokens
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_p=top_p, n=n, seed=1000 + i, ignore_eos=True)
              for i in range(requests)]
    outs = g.generate([EXACT_PROMPT] * requests, params)
    return np.asarray([c.token_ids[:3] for o in outs for c in o.samples])


def _assert_matches(tokens: np.ndarray, marginals) -> None:
    v = len(marginals[0])
    for j in range(3):
        assert _chi_square_p(np.bincount(tokens[:, j], minlength=v), marginals[j]) > P_MIN, j


# speculation forced on: the load policy counts waiting sequences, and 1,024 samples wait here.
# float32: the samples are tested against HF's float32 marginals; num_blocks: as BUNDLED
EXACT_ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, token_buckets=[32], max_model_len=64,
                    num_blocks=8 * 64 // 16 + 1, num_speculative_tokens=2, speculative_max_batch=16 * 64)


def test_sampling_exact_ngram_and_garbage(hf_model_dir, exact_reference):
    g = Generator.from_pretrained(hf_model_dir(EXACT_MODEL), speculative_method="ngram", **EXACT_ENGINE,
                                  max_decode_steps=1)   # n-gram runs one round per step: no loop to compile
    _assert_matches(_sample_tokens(g, 1.0), exact_reference[1.0])
    assert g.engine.stats()["spec_decode_num_drafts"] > 100
    # a proposer of uniformly random tokens: acceptance drops, the distribution does not move
    rng = np.random.RandomState(0)
    g.engine.scheduler.propose = lambda req, k, depth: rng.randint(0, 97, min(k, depth)).tolist()
    before = g.engine.stats()["spec_decode_num_drafts"]
    _assert_matches(_sample_tokens(g, 1.0), exact_reference[1.0])
    assert g.engine.stats()["spec_decode_num_drafts"] - before > 600


def test_sampling_exact_draft_top_p(hf_model_dir, exact_reference, tmp_path_factory):
    from tests.hf_models import build_hf_model
    draft = tmp_path_factory.mktemp("draft")
    build_hf_model(EXACT_MODEL, seed=1).save_pretrained(draft)   # same shapes, other weights: a poor draft
    g = Generator.from_pretrained(hf_model_dir(EXACT_MODEL), speculative_method="draft", speculative_model=draft,
                                  **EXACT_ENGINE)
    _assert_matches(_sample_tokens(g, 0.9), exact_reference[0.9])
    st = g.engine.stats()
    assert st["spec_decode_num_drafts"] > 600 and st["spec_decode_num_accepted_tokens"] > 0


def test_sampling_exact_medusa_top_p(hf_model_dir, exact_reference, tmp_path):
    """Medusa with random heads and a 7-node tree (tests/hf_models.py): SpecInfer's recursive
    rejection over siblings keeps the tokens on HF's marginals."""
    from tests.hf_models import random_medusa_heads
    heads = random_medusa_heads(hf_model_dir(EXACT_MODEL), tmp_path / "heads")
    g = Generator.from_pretrained(hf_model_dir(EXACT_MODEL), speculative_method="medusa", speculative_model=heads,
                                  **EXACT_ENGINE, max_decode_steps=1)
    _assert_matches(_sample_tokens(g, 0.9), exact_reference[0.9])
    st = g.engine.stats()
    assert st["spec_decode_num_drafts"] > 600 and st["spec_decode_num_accepted_tokens"] > 0


def test_speculation_with_tensor_parallel_is_accepted_not_with_pipeline():
    """TP runs speculation (tests/test_speculative_tp.py checks its outputs); PP is refused."""
    from jaxinfer.config import EngineConfig
    for method in ("ngram", "draft", "medusa"):
        EngineConfig(speculative_method=method, tensor_parallel=2)
        with pytest.raises(ValueError, match="pipeline_parallel > 1"):
            EngineConfig(speculative_method=method, pipeline_parallel=2)


@pytest.mark.parametrize("method", ["ngram"])
def test_request_arriving_while_a_speculative_step_runs(method, bundled_reference):
    """With async scheduling a request that arrives while a speculating step is on the device
    turns the load policy off (speculative_max_batch=1) before that step's tokens are on the host;
    the next step must still wait for them (how many a speculating row drew is known only then),
    not read the row's last token at the slot of an all-accepted draw. Greedy tokens of both
    requests: the engine's without speculation."""
    from collections import defaultdict
    _, _, _, plain, _ = bundled_reference
    prompts = _prompts(plain.tokenizer)[1:3]
    prompts[1] = prompts[1][:5]   # its prefill leaves budget for the first request's next token
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = plain.generate(prompts, params)
    g = Generator.from_pretrained(**BUNDLED, speculative_method=method, num_speculative_tokens=3,
                                  speculative_max_batch=1)
    assert g.engine.async_scheduling
    got = defaultdict(list)
    route = lambda d: got[d.request_id].extend(d.token_ids)  # noqa: E731
    c = g.client
    [first] = c.submit([prompts[0]], params, route=route)
    for _ in range(6):       # prefill, then steps that speculate
        c.step()
    assert any(seq.spec for seq in g.engine._inflight.scheduled.seqs)   # a speculating step is on the device
    assert g.engine.stats()["spec_decode_num_drafts"] > 0
    [second] = c.submit([prompts[1]], params, route=route)
    c.run_until_done()
    assert got[first] == list(ref[0].token_ids) and got[second] == list(ref[1].token_ids)
