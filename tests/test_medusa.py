"""Medusa heads and tree verification (jaxinfer/spec_decode/medusa.py, the tree mask in jaxinfer/attention.py; in the
Pallas kernel: tests/test_tree_attention_pallas.py).

References from outside the code under test: the target run on each candidate path alone (dense
causal attention, no cache, no tree), numpy copies of KV slots, hand-worked trees, the target's
distributions transcribed in numpy (softmax / top-p / repetition penalty) with scipy's chi-square,
and the held-out accuracy the heads' card quotes. The engine with Medusa (greedy identity on the
bundled model and GPT-2, sampled tokens against HF's exact marginals): tests/test_speculative.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import Generator
from jaxinfer.config import EngineConfig, resolve_config
from jaxinfer.kv_cache import TREE_NONE, LayerKV, StepRow, build_attention_metadata, init_kv_pages, move_kv
from jaxinfer.spec_decode.medusa import Tree, choose_tree, expected_acceptance_length, load_heads, tree_arrays, verify_tree
from jaxinfer.weights import load_model
from tests.hf_models import random_medusa_heads as random_heads
from tests.test_speculative import P_MIN, _batch, _chi_square_p, _softmax, _top_p
from tests.test_structured import _pack

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "checkpoints" / "jaxinfer-tiny-llama"
HEADS = ROOT / "checkpoints" / "jaxinfer-tiny-llama-medusa"
SMALL_TREE = Tree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))


# ------------------------------------------------------------------------------------ the tree
def test_tree_tables_and_choice_hand_worked():
    a = tree_arrays(SMALL_TREE)
    #            root (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0)
    assert a["depth"].tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert a["parent"].tolist() == [-1, 0, 0, 0, 1, 1, 2, 4]
    # bit j: node j + 1; (0,0,0) = node 7 sees nodes 1, 4 and itself
    assert a["ancestors"].tolist() == [0, 0b1, 0b10, 0b100, 0b1001, 0b10001, 0b100010, 0b1001001]
    assert a["children"].tolist() == [[1, 2, 3], [4, 5, -1], [6, -1, -1], [-1] * 3, [7, -1, -1], [-1] * 3,
                                      [-1] * 3, [-1] * 3]
    assert a["path_nodes"][7].tolist() == [0, 1, 4, 7] and a["path_nodes"][6].tolist() == [0, 2, 6, -1]
    # greedy by path probability: (0,) 0.6, (0,0) 0.6*0.5 = 0.3, (1,) 0.25, (0,0,0) 0.3*0.45 = 0.135,
    # (1,0) 0.25*0.5 = 0.125; then (0,1) 0.6*0.2 = 0.12 is left out
    acc = np.array([[0.6, 0.25, 0.05], [0.5, 0.2, 0.1], [0.45, 0.1, 0.1]])
    t = choose_tree(acc, 5)
    assert t.paths == ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
    assert expected_acceptance_length(t, acc) == pytest.approx(1 + 0.6 + 0.3 + 0.25 + 0.135 + 0.125)
    assert choose_tree(acc[:, :1], 3).paths == ((0,), (0, 0), (0, 0, 0))
    with pytest.raises(ValueError, match="parent"):
        Tree(((0,), (1, 0)))
    with pytest.raises(ValueError, match="sorted"):
        Tree(((0, 0), (0,)))


@pytest.mark.parametrize("shared_values", [False, True])
def test_move_kv_matches_numpy(shared_values):
    """Overlapping moves of every leaf, numpy's indexing the reference; latent attention's pages
    (shared values: V and its scales empty, init_kv_pages' value_dim 0) move their K leaves alone."""
    rng = np.random.default_rng(0)
    v_shape, vs_shape = ((2, 4, 8, 0), (2, 4, 0)) if shared_values else ((2, 4, 8, 3), (2, 4, 8))
    pages = [LayerKV(jnp.asarray(rng.normal(size=(2, 4, 8, 3)), jnp.float32),
                     jnp.asarray(rng.normal(size=v_shape), jnp.float32),
                     jnp.asarray(rng.random((2, 4, 8)), jnp.float32), jnp.asarray(rng.random(vs_shape), jnp.float32))]
    src, dst = np.array([9, 13, 20, 5]), np.array([8, 9, 10, 2**30])   # overlapping: 9 is read, then written
    out = move_kv(pages, jnp.asarray(src), jnp.asarray(dst))[0]
    for name in ("k", "v", "k_scale", "v_scale"):
        before = np.asarray(getattr(pages[0], name))
        if before.size == 0:
            assert getattr(out, name).shape == before.shape
            continue
        ref = before.reshape(2, 32, *before.shape[3:]).copy()
        ref[:, dst[:3]] = ref[:, src[:3]].copy()
        np.testing.assert_array_equal(np.asarray(getattr(out, name)).reshape(ref.shape), ref)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("which", ["bundled", "gpt2"])
def test_tree_attention_equals_each_path_alone(which, impl, hf_model_dir):
    """A context in the cache, then the root and a 20-node tree in one step under the tree mask (the
    XLA paged attention, or the Pallas ragged kernel, interpreted on CPU): the logits at every node
    equal the target's on context + that node's path, run alone (dense causal XLA attention, no
    cache). The chunk crosses a block and a query tile."""
    model, cfg = load_model(BUNDLED if which == "bundled" else hf_model_dir("gpt2"))
    rng = np.random.default_rng(1)
    tree = choose_tree(np.sort(rng.random((4, 4)), axis=1)[:, ::-1], 20)
    a = tree_arrays(tree)
    n, ctx_len = len(tree.paths), 11
    ctx = rng.integers(3, cfg.vocab_size, ctx_len)
    nodes = rng.integers(3, cfg.vocab_size, n + 1)             # the root, then each node's token
    bs, blocks = 16, [3, 1, 4]
    pages = init_kv_pages(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 6, bs, jnp.float32)
    fwd = jax.jit(lambda t, p, kv, m: model(t, p, kv, m, impl=impl))
    t = 32   # both steps in one shape: one compilation
    meta = build_attention_metadata([StepRow(0, ctx_len, blocks)], bs, t, 1, 3)
    meta.tree = np.stack([np.arange(t), np.full(t, TREE_NONE), np.zeros(t)], 1).astype(np.int32)
    _, pages = fwd(jnp.asarray(np.pad(ctx, (0, t - ctx_len)), jnp.int32), jnp.arange(t, dtype=jnp.int32), pages, meta)
    meta = build_attention_metadata([StepRow(ctx_len, n + 1, blocks)], bs, t, 1, 3)
    positions = np.zeros(t, np.int32)
    positions[: n + 1] = ctx_len + a["depth"]
    tmask = np.zeros((t, 3), np.int32)
    tmask[:, 0], tmask[:, 1] = np.arange(t) + ctx_len, TREE_NONE
    tmask[: n + 1, 1] = ctx_len + 1
    tmask[: n + 1, 2] = a["ancestors"]
    meta.tree = tmask
    logits, _ = fwd(jnp.asarray(np.pad(nodes, (0, t - n - 1)), jnp.int32), jnp.asarray(positions), pages, meta)
    logits = np.asarray(logits)
    # every path alone, dense causal attention without a cache: context + path, padded at the end to
    # one length (later tokens never reach earlier ones), all paths in one call
    paths = [[int(x) for x in a["path_nodes"][j] if x >= 0] for j in range(n + 1)]
    width = ctx_len + max(map(len, paths))
    seqs = np.stack([np.pad(np.concatenate([ctx, nodes[p]]), (0, width - ctx_len - len(p))) for p in paths])
    dense = jax.jit(jax.vmap(lambda tk: model(tk, jnp.arange(width, dtype=jnp.int32), impl="xla")[0]))
    ref = np.asarray(dense(jnp.asarray(seqs, jnp.int32)))
    ref = ref[np.arange(n + 1), [ctx_len + len(p) - 1 for p in paths]]
    # float32 sums of the same products in another order (paged tiles vs one dense pass): the
    # logits (|x| <~ 20) agree to ~1e-5
    np.testing.assert_allclose(logits[: n + 1], ref, rtol=0, atol=2e-4 * max(1.0, np.abs(ref).max() / 10))


# ------------------------------------------------------------------------------------ verify_tree alone
@pytest.mark.parametrize("case", ["plain", "top_p", "penalty", "grammar"])
def test_verify_tree_is_exact(case):
    """Thousands of rows with the same tree of fixed candidates (node j's target distribution: its
    own logits row): the first token follows the root's p, and the second, given that the first was
    a child c's token, follows c's p; greedy rows walk the argmax chain. "grammar": each node has
    its own grammar mask (the root's in token_mask, the others' in node_masks): p is the masked
    distribution, and a candidate its parent's mask forbids is never accepted."""
    n_rows, v = 12000, 24   # v >= 20: the top-20 logprobs
    tree = Tree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0)))
    a = tree_arrays(tree)
    rng = np.random.default_rng({"plain": 1, "top_p": 2, "penalty": 3, "grammar": 4}[case])
    logits = (rng.normal(size=(len(tree.paths) + 1, v)) * 1.5).astype(np.float32)
    temp, top_p, rep = {"top_p": (1.3, 0.8, 1.0), "penalty": (1.0, 1.0, 1.8)}.get(case, (1.0, 1.0, 1.0))
    # candidates as heads would rank them: the root's children its 1st, 2nd and 6th most likely
    # tokens, (0,0) and (0,1) node 1's 1st and 8th, (1,0) node 2's 1st
    r = np.argsort(-logits, axis=1)
    node_tokens = np.broadcast_to(np.array([r[0, 0], r[0, 1], r[0, 5], r[1, 0], r[1, 7], r[2, 0]], np.int32),
                                  (n_rows, 6))
    hist = np.full((n_rows, 16), -1, np.int32)
    hist[:, :3] = [0, 1, 2]   # the prompt; the token after the root is at position 3
    b = _batch(n_rows, temp, top_p, rep, hist)
    b.position = np.full(n_rows, 3, np.int32)
    allowed = np.ones((len(tree.paths) + 1, v), bool)
    masks = ()
    if case == "grammar":   # ~60% of the tokens per node; the root allows children 1, 2, not 3
        allowed = rng.random(allowed.shape) < 0.6
        allowed[0, [r[0, 0], r[0, 1]]], allowed[0, r[0, 5]] = True, False
        allowed[1, r[1, 0]] = allowed[2, r[2, 0]] = True
        packed = _pack(allowed)
        b.token_mask = np.broadcast_to(packed[0], (n_rows, packed.shape[1])).copy()
        masks = (packed[None, 1:], np.zeros(n_rows, np.int32))
    run = jax.jit(lambda lg, nt, ns, bb, *m: verify_tree(lg, nt, ns, bb, a, *m))
    ids, lps, _, _, drawn, path = run(np.broadcast_to(logits, (n_rows,) + logits.shape), node_tokens,
                                      np.full(n_rows, 6, np.int32), b, *masks)
    ids, drawn, path = np.asarray(ids), np.asarray(drawn), np.asarray(path)

    def target(node: int, seen: list[int]) -> np.ndarray:
        x = logits[node].astype(np.float64)
        for t in set(seen):
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        return _top_p(_softmax(np.where(allowed[node], x / temp, -np.inf)), top_p)

    assert _chi_square_p(np.bincount(ids[0], minlength=v), target(0, [0, 1, 2])) > P_MIN
    for tok, node in ((r[0, 0], 1), (r[0, 1], 2)):   # the first token was child (0,)'s / (1,)'s: its node decides
        rows = (drawn >= 2) & (ids[0] == tok)
        assert rows.sum() > 300 and (path[rows, 1] == node).all()
        assert _chi_square_p(np.bincount(ids[1][rows], minlength=v), target(node, [0, 1, 2, tok])) > P_MIN
    # an emitted token that is not a child's ends the round: nothing follows it
    assert (drawn[~np.isin(ids[0], node_tokens[0, :3])] == 1).all()
    # the logprobs are the target's at the node that drew each token
    with np.errstate(divide="ignore"):   # log 0 at the masked and cut tokens (never emitted)
        ref = np.log(target(0, [0, 1, 2]))        # processed: after the mask, penalty, temperature, top-p
    np.testing.assert_allclose(np.asarray(lps)[0], ref[ids[0]], rtol=0, atol=2e-5)
    if case == "grammar":   # every emitted token is allowed by the mask of the node that drew it
        assert allowed[0, ids[0]].all() and not (path[:, 1] == 3).any()
        went = drawn >= 2
        assert allowed[path[went, 1], ids[1][went]].all()
    # greedy: the argmax chain as far as the tree holds it, then the argmax (the bonus); a tree
    # whose first level misses the argmax emits the argmax alone
    am = logits.argmax(1)
    if case != "plain":
        return
    others = [t for t in range(v) if t != am[0]]
    hit = [am[0], others[0], others[1], am[1], next(t for t in range(v) if t != am[1]), 0]
    miss = [others[0], others[1], others[2], 0, 0, 0]
    g = _batch(2, 0.0, history=np.full((2, 16), -1, np.int32))
    g.position = np.full(2, 3, np.int32)
    gids, _, _, _, gdrawn, gpath = run(np.broadcast_to(logits, (2,) + logits.shape), np.array([hit, miss], np.int32),
                                       np.full(2, 6, np.int32), g)
    assert np.asarray(gdrawn).tolist() == [3, 1]
    assert np.asarray(gids)[:, 0].tolist() == [am[0], am[1], am[4]] and np.asarray(gids)[0, 1] == am[0]
    assert np.asarray(gpath)[0].tolist() == [0, 1, 4]


# ------------------------------------------------------------------------------------ the engine
def test_heads_card_accuracy_and_refusals(tmp_path, hf_model_dir):
    """The bundled heads' card: its held-out accuracy recomputed here from the shipped heldout.txt
    (re-tokenized as scripts/prepare_corpus.py builds heldout.bin: [BOS doc EOS] per document), every
    window the card scored; heads refuse another target, and the engine refuses what it cannot do."""
    info = json.loads((HEADS / "medusa.json").read_text())
    card = (HEADS / "MODEL_CARD.md").read_text()
    for i, (t1, t5) in enumerate(zip(info["heldout"]["top1"], info["heldout"]["top5"])):
        assert f"| {i} | t + {i + 2} | {100 * t1:.1f}% | {100 * t5:.1f}% |" in card
    model, cfg = load_model(BUNDLED)
    heads, tree = load_heads(HEADS, model)
    assert [list(p) for p in tree.paths] == info["tree"]
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(BUNDLED / "tokenizer.model"))
    docs = (BUNDLED / "heldout.txt").read_text().split("\n\n")
    ids = np.asarray([t for d in docs for t in (1, *sp.encode(d.strip("\n")), 2)], np.int32)
    w = 256
    windows = ids[: (len(ids) - 1) // w * w].reshape(-1, w)

    @jax.jit
    def top5(x):
        h = jax.vmap(lambda t: model.hidden_states(t, jnp.arange(w, dtype=jnp.int32))[0])(x)     # [B, W, D]
        lg = model.logits(heads(h.reshape(-1, cfg.d_model)).reshape(-1, cfg.d_model))
        return jax.lax.top_k(lg.reshape(heads.num_heads, x.shape[0], w, -1), 5)[1]
    hits, totals = np.zeros((heads.num_heads, 2)), np.zeros(heads.num_heads)
    for s in range(0, len(windows), 10):
        x = windows[s:s + 10]
        r = np.asarray(top5(jnp.asarray(np.pad(x, ((0, 10 - len(x)), (0, 0))))))[:, : len(x)]
        for i in range(heads.num_heads):
            ok = r[i, :, : w - i - 2] == x[:, i + 2:, None]
            hits[i] += ok[..., 0].sum(), ok.any(-1).sum()
            totals[i] += ok.shape[0] * ok.shape[1]
    assert totals.tolist() == info["heldout"]["positions"]
    # the same windows and weights: only a near-tie in the top-5 order could move a count
    np.testing.assert_allclose(hits[:, 0] / totals, info["heldout"]["top1"], rtol=0, atol=2e-4)
    np.testing.assert_allclose(hits[:, 1] / totals, info["heldout"]["top5"], rtol=0, atol=2e-4)
    assert info["heldout"]["top1"][0] > 0.05   # far above chance (1 / 4096)

    other = hf_model_dir("llama-gqa-llama3")
    with pytest.raises(ValueError, match="d_model"):
        Generator.from_pretrained(other, speculative_method="medusa", speculative_model=HEADS, warmup=False)
    mine = random_heads(other, tmp_path / "heads")
    (mine / "medusa.json").write_text((mine / "medusa.json").read_text().replace('"embed_sha256": "', '"embed_sha256": "0'))
    with pytest.raises(ValueError, match="another model"):
        Generator.from_pretrained(other, speculative_method="medusa", speculative_model=mine, warmup=False)
    random_heads(other, mine)
    (mine / "heads.safetensors").write_bytes((mine / "heads.safetensors").read_bytes()[:100])
    with pytest.raises(ValueError, match="heads.safetensors"):
        Generator.from_pretrained(other, speculative_method="medusa", speculative_model=mine, warmup=False)
    random_heads(other, mine)
    with pytest.raises(ValueError, match="more than the 3 Medusa heads"):
        Generator.from_pretrained(other, speculative_method="medusa", speculative_model=mine, num_speculative_tokens=4,
                                  warmup=False)
    # the tree mask is in the Pallas ragged kernel too (its tokens: tests/test_pallas_engine.py)
    g = Generator.from_pretrained(other, speculative_method="medusa", speculative_model=mine, attention="pallas",
                                  num_speculative_tokens=3, warmup=False)
    assert g.engine.runner.settings.attention == "pallas"
    # and a GPU's default ("auto") keeps the Pallas kernels for Medusa (issue #40: no XLA fallback)
    medusa_gpu = resolve_config(EngineConfig(speculative_method="medusa", num_blocks=9, max_model_len=128), cfg,
                                backend="gpu")
    assert (medusa_gpu.attention, medusa_gpu.matmul) == ("pallas", "pallas")
    with pytest.raises(ValueError, match="ALiBi"):
        Generator.from_pretrained(hf_model_dir("bloom"), speculative_method="medusa",
                                  speculative_model=random_heads(hf_model_dir("bloom"), tmp_path / "b"),
                                  num_speculative_tokens=3, warmup=False)
    with pytest.raises(ValueError, match="bundled only"):
        Generator.from_pretrained(other, speculative_method="medusa", warmup=False)
    with pytest.raises(ValueError, match="not a Medusa heads folder"):
        Generator.from_pretrained(other, speculative_method="medusa", speculative_model=other, warmup=False)


def test_rounds_on_the_device_draw_what_one_round_per_step_draws():
    """Several Medusa rounds in one step (the heads' proposals become the next round's tree on the
    device, the tree mask and positions moved past what each round drew) against one round per step
    (max_decode_steps=1: the host lays out every tree): the same tokens, greedy and seeded sampling
    with penalties (each round's processors see the earlier rounds' tokens), since every draw's key
    is (seed, position) and both engines verify the same trees. Both run on the bundled model and
    heads, one request at a time, so the multi-round engine does loop (a step draws more than 1 +
    the tree's depth tokens)."""
    from jaxinfer import SamplingParams
    # float32: the logprobs below are compared at float32's precision; num_blocks: one sequence of 256
    # (+ the null block; what CPU sizes by itself), so that on a GPU the second engine finds memory
    common = dict(dtype="float32", max_num_seqs=1, max_num_batched_tokens=16, token_buckets=[16], max_model_len=256,
                  num_blocks=256 // 16 + 1, speculative_method="medusa")
    multi = Generator.from_pretrained(str(BUNDLED), **common)
    single = Generator.from_pretrained(str(BUNDLED), **common, max_decode_steps=1)
    drawn = []
    update = multi.engine.scheduler.update

    def spy(plan, samples, **kw):
        drawn.append(max(map(len, samples.values()), default=0))
        return update(plan, samples, **kw)
    multi.engine.scheduler.update = spy
    ids = multi.tokenizer.encode((BUNDLED / "heldout.txt").read_text(), add_special_tokens=False)
    prompts = [ids[s:s + 24] for s in (100, 2000, 9000)]
    params = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=60, temperature=0.8, seed=5, ignore_eos=True, logprobs=1,
                             repetition_penalty=1.2, frequency_penalty=0.2),
              SamplingParams(max_tokens=60, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)]
    for sp in params:
        for p in prompts:
            a, b = multi.generate([p], sp)[0], single.generate([p], sp)[0]
            assert a.token_ids == b.token_ids
            if sp.logprobs:
                # the same float32 arithmetic but for XLA's fusion inside the loop: a log-softmax
                # over logits of magnitude < 30 moves by a few ulp of 30 (2e-6 each)
                np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
    depth = max(len(path) for path in load_heads(HEADS, load_model(BUNDLED)[0])[1].paths)
    assert max(drawn) > 1 + depth
    assert multi.engine.stats()["compilations_after_warmup"] == 0
    # to the last position of the context, with the default budgets: the tree is cut to the KV slots
    # left (4 heads' nodes with 2 positions left overran the block table: "17 exceeds the largest
    # bucket 16", and the engine died), greedy as a plain forward picks
    prompt = multi.tokenizer.encode((BUNDLED / "heldout.txt").read_text()[:40000])[100:100 + 232]
    want = list(prompt)
    for _ in range(24):
        want.append(int(np.argmax(multi.logits(want)[-1])))
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    edge = Generator.from_pretrained(str(BUNDLED), dtype="float32", max_model_len=256, block_size=16,
                                     speculative_method="medusa", warmup=False)
    for g in (edge, multi, single):
        out = g.generate([prompt], sp)[0]
        assert (out.token_ids, out.finish_reason) == (want[232:], "length")
    edge.close()
