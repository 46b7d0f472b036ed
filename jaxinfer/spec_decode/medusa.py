"""Medusa heads (Cai et al. 2024, "Medusa-1": a frozen target) and tree verification on the device.

Heads. Head i (i = 0 .. K-1) reads the target's final-norm hidden state h_t at position t and
predicts the token at position t + i + 2 (the target's own LM head predicts t + 1):
    logits_i(h) = lm_head(h + SiLU(W_i h + b_i))
one residual SiLU block per head over the target's (frozen, shared) LM head. W_i = 0, b_i = 0 at
initialisation, so every head starts as the target's next-token head (the paper's initialisation).
The heads checkpoint (scripts/train_medusa.py) holds W [K, D, D], b [K, D] and medusa.json: the
target it was trained for (d_model, vocabulary, a fingerprint of its embedding) and the tree.

Tree (the paper's "sparse tree"). A node is a path of ranks (r_1, .., r_d): the r_1-th most likely
token of head 0, then the r_2-th of head 1, ... A static tree is a list of such paths, every prefix
of a path also in the list, sorted by depth then rank (`tree_arrays`). One verifying row holds its
last drawn token t0 (the root, position p) and the N nodes in that order: node j at position
p + depth(j), its K/V at slot p + 1 + j. Each node attends to the context, the root and its own
ancestors only (AttentionMetadata.tree: its slot index, the first node slot and the ancestor
bitmask), so the target's logits at each node are those of the path it ends.

Verification (`verify_tree`), exact for any sampling settings: starting at the root, the children
of the current node (distinct tokens, one-hot proposals) are tried in rank order by SpecInfer's
recursive rejection (Miao et al. 2024): child c is accepted with probability p'(c), where p' is the
target's processed distribution at the current node with the children rejected so far removed and
renormalised (the residual norm(max(0, p - onehot)) of each rejection); an accepted child becomes
the current node. When no child is accepted (or a leaf is reached) one token is drawn from p' (the
residual, or the bonus token). This is sampling from p, one candidate at a time, so the emitted
tokens follow the target exactly; greedy rows accept the child equal to the argmax. The accepted
path's K/V then moves from slots p + 1 + j to p + d (kv_cache.move_kv), the rest is overwritten
later (num_computed_tokens rolls back as for a chain).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.quant import dot_precision
from jaxinfer.sampling import MAX_LOGPROBS, NEG_INF, SamplingBatch, gumbel_draw, process, row_keys, top_logprobs
from jaxinfer.spec_decode.verification import ACCEPT_TAG, expand_paths
MAX_TREE_NODES = 31     # the ancestor bitmask is one int32 per token


class MedusaHeads(nnx.Module):
    def __init__(self, num_heads: int, d_model: int, dtype=jnp.float32):
        self.w = nnx.Param(jnp.zeros((num_heads, d_model, d_model), dtype))
        self.b = nnx.Param(jnp.zeros((num_heads, d_model), dtype))

    @property
    def num_heads(self) -> int:
        return self.w.shape[0]

    def __call__(self, h: jax.Array) -> jax.Array:
        """h [N, D] -> each head's input to the LM head, [K, N, D]."""
        w, b = self.w.get_value(), self.b.get_value()
        z = jnp.einsum("nd,kde->kne", h.astype(w.dtype), w, precision=dot_precision(w.dtype)) + b[:, None, :]
        return h[None].astype(w.dtype) + jax.nn.silu(z)


@dataclass(frozen=True)
class Tree:
    """A static candidate tree (module docstring): paths of ranks, sorted by depth then ranks."""
    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.paths) <= MAX_TREE_NODES:
            raise ValueError(f"a Medusa tree has 1 .. {MAX_TREE_NODES} nodes, not {len(self.paths)}")
        if list(self.paths) != sorted(self.paths, key=lambda p: (len(p), p)) or len(set(self.paths)) != len(self.paths):
            raise ValueError("Medusa tree paths must be distinct and sorted by depth, then ranks")
        for p in self.paths:
            if not p or min(p) < 0 or (len(p) > 1 and p[:-1] not in self.paths):
                raise ValueError(f"Medusa tree path {list(p)} is empty, negative or misses its parent")

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    def truncated(self, depth: int) -> "Tree":
        return Tree(tuple(p for p in self.paths if len(p) <= depth))


def tree_arrays(tree: Tree) -> dict[str, np.ndarray]:
    """Numpy tables of the tree's N nodes, node 0 being the root and node j + 1 the path j:
    depth [N+1], parent [N+1] (-1: none), rank [N+1], head_rank_index [N+1] (which of the heads'
    top-R entries the node's token is: (depth - 1) * R + rank), ancestors [N+1] int32 (bit j: node
    j + 1 is the node or one of its ancestors; the root sees none of the nodes), children [N+1, C]
    (-1 padded, in rank order), path_nodes [N+1, D+1] (the nodes from the root down to it, -1 past
    its depth)."""
    paths = [()] + list(tree.paths)
    index = {p: i for i, p in enumerate(paths)}
    n1, d = len(paths), tree.depth
    r = max(max(p) for p in tree.paths) + 1
    depth = np.array([len(p) for p in paths], np.int32)
    parent = np.array([-1] + [index[p[:-1]] for p in tree.paths], np.int32)
    rank = np.array([0] + [p[-1] for p in tree.paths], np.int32)
    ancestors = np.zeros(n1, np.int64)
    path_nodes = np.full((n1, d + 1), -1, np.int32)
    for i, p in enumerate(paths):
        for j in range(len(p) + 1):
            node = index[p[:j]]
            path_nodes[i, j] = node
            if node > 0:
                ancestors[i] |= 1 << (node - 1)
    kids = [[i for i, p in enumerate(paths) if p and p[:-1] == parent] for parent in paths]
    c = max(len(k) for k in kids)
    children = np.full((n1, c), -1, np.int32)
    for i, k in enumerate(kids):
        children[i, :len(k)] = sorted(k, key=lambda j: rank[j])
    return dict(depth=depth, parent=parent, rank=rank, head_rank_index=np.maximum(depth - 1, 0) * r + rank,
                ancestors=ancestors.astype(np.int32), children=children, path_nodes=path_nodes,
                top_r=np.int32(r))


def choose_tree(rank_accuracy: np.ndarray, num_nodes: int) -> Tree:
    """The tree of num_nodes nodes with the largest expected acceptance length under independent
    heads, chosen greedily as in the Medusa paper: rank_accuracy[i, r] is the measured frequency of
    head i's r-th token being the right one; a path's acceptance probability is the product over its
    depths, and the next node added is the child of the tree (or of the root) with the largest one
    (every prefix of it is then already in the tree, its probability being at least as large)."""
    acc = np.asarray(rank_accuracy, np.float64)
    k, r = acc.shape
    chosen: dict[tuple[int, ...], float] = {}
    frontier = {(i,): acc[0, i] for i in range(r)}
    while len(chosen) < num_nodes and frontier:
        path = max(frontier, key=lambda p: (frontier[p], -len(p), tuple(-x for x in p)))
        chosen[path] = frontier.pop(path)
        if len(path) < k:
            for i in range(r):
                frontier[path + (i,)] = chosen[path] * acc[len(path), i]
    return Tree(tuple(sorted(chosen, key=lambda p: (len(p), p))))


def expected_acceptance_length(tree: Tree, rank_accuracy: np.ndarray) -> float:
    """1 + sum over nodes of the product of their ranks' accuracies (independent heads)."""
    acc = np.asarray(rank_accuracy, np.float64)
    return 1.0 + sum(float(np.prod([acc[d, r] for d, r in enumerate(p)])) for p in tree.paths)


def propose(heads: MedusaHeads, lm_logits, h: jax.Array, arrays: dict[str, np.ndarray]) -> jax.Array:
    """The tree's tokens [S, N] for rows whose last drawn token came from hidden states h [S, D]:
    node j + 1 takes the (rank)-th most likely token of head depth - 1. lm_logits: the target's
    LM head ([M, D] -> [M, V])."""
    s = h.shape[0]
    x = heads(h)                                                            # [K, S, D]
    k = x.shape[0]
    logits = lm_logits(x.reshape(k * s, -1)).reshape(k, s, -1)
    r = int(arrays["top_r"])
    _, top = jax.lax.top_k(logits, r)                                       # [K, S, R]
    flat = top.transpose(1, 0, 2).reshape(s, k * r)
    return flat[:, arrays["head_rank_index"][1:]].astype(jnp.int32)


def verify_tree(logits: jax.Array, node_tokens: jax.Array, num_spec: jax.Array, b: SamplingBatch,
                arrays: dict[str, np.ndarray], node_masks: jax.Array | None = None, mask_slot: jax.Array | None = None):
    """verify_tree_flat with the logits laid out per row: logits [S, N+1, V] at the root and each node."""
    s, n1, v = logits.shape
    return verify_tree_flat(logits.reshape(s * n1, v), jnp.arange(s * n1).reshape(s, n1), node_tokens, num_spec, b,
                            arrays, jnp.repeat(jnp.arange(s), n1), jnp.tile(jnp.arange(n1), s), node_masks, mask_slot)


def verify_tree_flat(logits: jax.Array, node_at: jax.Array, node_tokens: jax.Array, num_spec: jax.Array,
                     b: SamplingBatch, arrays: dict[str, np.ndarray], row_of: jax.Array, node_of: jax.Array,
                     node_masks: jax.Array | None = None, mask_slot: jax.Array | None = None):
    """Decide each row's tree (module docstring).

    logits [M, V]: the target's raw logits, one row per token of the step (what the processors cost
    follows M, not S * (N+1)); node_at [S, N+1]: the logits row of row s's root and of each of its
    nodes (entries past num_spec[s]: any row); row_of / node_of [M]: verification.expand_paths'. node_tokens
    [S, N]; num_spec [S]: the row verifies nodes 1 .. num_spec (a prefix of the tree; 0: none, the
    row draws as `sample` does); b: the rows' batch, its position that of the token after the root;
    node_masks / mask_slot: the grammar's mask after each node's path (verification.expand_paths; a
    node the grammar rejects has p = 0 under its parent's mask, so it is never accepted).
    Returns (ids [D+1, S], logprobs [D+1, S], top ids / logprobs [D+1, S, 20], num_drawn [S] =
    accepted + 1, path [S, D+1]: the nodes whose logits drew each emitted token).

    The walk reads single probabilities: a candidate's probability under the residual is its p over
    1 - (the mass of the candidates rejected at that node), so no [S, V] array is rebuilt per
    candidate; the final draw removes the rejected candidates once."""
    s = node_at.shape[0]
    d = int(arrays["depth"].max())
    children = jnp.asarray(arrays["children"])
    c = children.shape[1]
    bx = expand_paths(b, node_tokens, arrays["depth"], arrays["path_nodes"], num_spec, row_of, node_of,
                      node_masks, mask_slot)
    tempered, logprobs, filtered = process(logits, bx)                              # [M, V]
    greedy = b.temperature <= 0
    argmax = jnp.argmax(tempered, axis=-1).astype(jnp.int32)                        # [M]
    lse = jax.nn.logsumexp(filtered, axis=-1)                                       # [M]
    rows = jnp.arange(s)
    tok_of = jnp.concatenate([jnp.zeros((s, 1), jnp.int32), node_tokens], axis=1)    # [S, N+1]

    def try_child(rank, carry):
        """Candidate `rank` among the current node's children: accepted or rejected (the residual)."""
        cur, going, nxt, removed, rejected, keys = carry
        m = node_at[rows, cur]
        child = children[cur, rank]                                                  # [S]
        live = going & (nxt < 0) & (child > 0) & (child <= num_spec)
        tok = tok_of[rows, jnp.maximum(child, 0)]
        p_tok = jnp.exp(filtered[m, tok] - lse[m])
        u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, rank)))(keys)
        ok = live & jnp.where(greedy, tok == argmax[m], u * jnp.maximum(1.0 - removed, 0.0) < p_tok)
        rej = live & ~ok
        rejected = rejected.at[:, rank].set(jnp.where(rej, tok, rejected[:, rank]))
        return (cur, going, jnp.where(ok, child, nxt), jnp.where(rej, removed + p_tok, removed), rejected, keys)

    def descend(depth, carry):
        """One level: the children of each row's current node in rank order; the accepted one (if
        any) becomes the current node."""
        cur, going, path, accepted, removed, rejected = carry
        keys = jax.vmap(lambda key: jax.random.fold_in(key, ACCEPT_TAG))(
            row_keys(b.seed, b.sample_index, b.position + depth))
        _, _, nxt, removed, rejected, _ = jax.lax.fori_loop(
            0, c, try_child, (cur, going, jnp.full((s,), -1, jnp.int32), removed, rejected, keys))
        moved = nxt > 0
        cur = jnp.where(moved, nxt, cur)
        path = jax.lax.dynamic_update_index_in_dim(
            path, jnp.where(moved, nxt, jax.lax.dynamic_index_in_dim(path, depth, 1, keepdims=False)), depth + 1, 1)
        return (cur, going & moved, path, accepted + moved.astype(jnp.int32), jnp.where(moved, 0.0, removed),
                jnp.where(moved[:, None], -1, rejected))

    # removed: the p-mass of the candidates rejected at the current node; rejected: their tokens
    cur, _, path, accepted, _, rejected = jax.lax.fori_loop(
        0, d, descend, (jnp.zeros((s,), jnp.int32), jnp.ones((s,), bool), jnp.zeros((s, d + 1), jnp.int32),
                        jnp.zeros((s,), jnp.int32), jnp.zeros((s,), jnp.float32), jnp.full((s, c), -1, jnp.int32)))
    m = node_at[rows, cur]
    last = _residual_draw(filtered[m], rejected, b, accepted, greedy, argmax[m])
    return _emitted(path, accepted, last, tok_of, node_at, logprobs, b)


def _residual_draw(f_cur: jax.Array, rejected: jax.Array, b: SamplingBatch, accepted: jax.Array,
                   greedy: jax.Array, argmax: jax.Array) -> jax.Array:
    """The token drawn after the accepted path [S]: from the residual, p without the rejected
    candidates (never empty: if rounding left no mass, p itself), or the argmax for greedy rows.
    f_cur [S, V]: filtered logits at each row's last accepted node; rejected [S, C]: their tokens."""
    v = f_cur.shape[-1]
    f = jnp.where(jnp.any(jnp.arange(v)[None, None, :] == rejected[:, :, None], axis=1), NEG_INF, f_cur)
    f = jnp.where(jnp.any(f > NEG_INF, axis=-1, keepdims=True), f, f_cur)
    keys_a = row_keys(b.seed, b.sample_index, b.position + accepted)
    drawn = jax.lax.cond(jnp.any(~greedy), lambda f: gumbel_draw(f, keys_a),
                         lambda f: jnp.zeros(f.shape[:1], jnp.int32), f)
    return jnp.where(greedy, argmax, drawn)


def _emitted(path: jax.Array, accepted: jax.Array, last: jax.Array, tok_of: jax.Array, node_at: jax.Array,
             logprobs: jax.Array, b: SamplingBatch):
    """verify_tree_flat's outputs from the accepted path [S, D+1], its length and the last draw."""
    s, d1 = path.shape
    rows = jnp.arange(s)
    j = jnp.arange(d1)[None, :]
    # the emitted token j is node path[j + 1]'s token for j < accepted, then `last`
    path_next = jnp.concatenate([path[:, 1:], path[:, -1:]], axis=1)
    ids = jnp.where(j < accepted[:, None], tok_of[rows[:, None], path_next], 0)
    ids = jnp.where(j == accepted[:, None], last[:, None], ids).astype(jnp.int32)    # [S, D+1]
    at = node_at[rows[:, None], path]                                                # [S, D+1]
    lps = logprobs[at, ids]
    bp = SamplingBatch(**{name: jnp.repeat(x, d1, axis=0) for name, x in b.arrays().items()},
                       logprobs_mode=b.logprobs_mode)
    top_ids, top_lps = jax.lax.cond(
        jnp.any(b.num_logprobs > 0), lambda lp: top_logprobs(lp[at.reshape(-1)], bp),
        lambda lp: (jnp.zeros((s * d1, MAX_LOGPROBS), jnp.int32),
                    jnp.zeros((s * d1, MAX_LOGPROBS), jnp.float32)), logprobs)
    return (ids.T, lps.T, top_ids.reshape(s, d1, -1).transpose(1, 0, 2),
            top_lps.reshape(s, d1, -1).transpose(1, 0, 2), accepted + 1, path)


# ---------------------------------------------------------------------------- checkpoint

HEADS_FILE, INFO_FILE = "heads.safetensors", "medusa.json"


def target_fingerprint(model) -> str:
    """sha256 of the target's float32 token embedding: the heads were trained on its hidden states."""
    return hashlib.sha256(np.asarray(model.embed.get_value(), np.float32).tobytes()).hexdigest()


def save_heads(heads: MedusaHeads, tree: Tree, info: dict, out) -> None:
    from safetensors.numpy import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.asarray(heads.w.get_value(), np.float32), "b": np.asarray(heads.b.get_value(), np.float32)},
              str(out / HEADS_FILE))
    (out / INFO_FILE).write_text(json.dumps({**info, "tree": [list(p) for p in tree.paths]}, indent=1))


def is_medusa(folder) -> bool:
    return (Path(folder) / INFO_FILE).exists()


def load_heads(folder, target, dtype=jnp.float32) -> tuple[MedusaHeads, Tree]:
    """The heads in `folder` for `target` (a Decoder); a ValueError naming the folder and what differs
    when they were trained for another model, or when a file is missing or damaged."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    folder = Path(folder)
    info_path, heads_path = folder / INFO_FILE, folder / HEADS_FILE
    if not info_path.exists():
        raise ValueError(f"{folder}: not a Medusa heads folder (no {INFO_FILE})")
    try:
        info = json.loads(info_path.read_text())
        k, want = int(info["num_heads"]), info["target"]
        tree = Tree(tuple(tuple(int(r) for r in p) for p in info["tree"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{info_path}: invalid Medusa heads config ({e})") from None
    cfg = target.cfg
    for key, have in (("d_model", cfg.d_model), ("vocab_size", cfg.vocab_size)):
        if want.get(key) != have:
            raise ValueError(f"{folder}: the Medusa heads were trained for a target with {key}={want.get(key)}, "
                             f"this model has {key}={have}")
    if want.get("embed_sha256") != target_fingerprint(target):
        raise ValueError(f"{folder}: the Medusa heads were trained for another model ({want.get('path', '?')}): "
                         "the target's embedding differs (sha256)")
    if tree.depth > k:
        raise ValueError(f"{info_path}: the tree is {tree.depth} deep but there are {k} heads")
    try:
        arrays = load_file(str(heads_path))
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise ValueError(f"{heads_path}: cannot read the Medusa heads ({e})") from None
    d = cfg.d_model
    for name, shape in (("w", (k, d, d)), ("b", (k, d))):
        if name not in arrays or arrays[name].shape != shape:
            got = arrays[name].shape if name in arrays else "missing"
            raise ValueError(f"{heads_path}: tensor {name!r} should be {shape}, is {got}")
    heads = MedusaHeads(k, d, dtype)
    heads.w.set_value(jnp.asarray(arrays["w"], dtype))
    heads.b.set_value(jnp.asarray(arrays["b"], dtype))
    return heads, tree
