"""Token mixers that keep a state per sequence instead of KV pages: the causal depthwise convolution
that LFM2's ShortConv (models/decoder.py) and the Gated DeltaNet share, and the Gated DeltaNet of
Qwen3-Next and Qwen3.5 (Yang et al., "Gated Delta Networks", arXiv 2412.06464; transformers'
Qwen3NextGatedDeltaNet).

In a paged step the tokens of several rows lie in one flat [T] axis (meta.seq_ids: each token's row,
positions ascending within a row). A row's state lives in its state slot (meta.state_slots; host/
block_manager.py hands one to each sequence and never slot 0): a row whose first token in the step
is at position 0 starts from zeros, any other from its slot, and the rows that computed a token write
their state back (padding and stopped rows, whose slot mapping is PAD_SLOT, write nothing). Without
pages (meta None): one sequence from position 0."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import PAD_SLOT, AttentionMetadata, DeltaState
from jaxinfer.layers import dense, param

# float32 products in float32 on every backend (XLA's DEFAULT rounds them to TF32 on a GPU: quant.dot_precision)
HIGHEST = jax.lax.Precision.HIGHEST


def causal_conv(u: jax.Array, w: jax.Array, positions: jax.Array, row: jax.Array, held: jax.Array | None,
                slot: jax.Array | None) -> jax.Array:
    """u [T, C] convolved along each row's positions by the taps w [L, C] (float32):
    conv[p] = sum_j w[j] u[p - (L - 1) + j], zero before position 0. A token reads the earlier inputs
    of its own row from the step, and those before its row's first token from held [slots, L - 1, C]
    at its row's slot (position p at p % (L - 1)). -> float32 [T, C]."""
    taps, t = w.shape[0], u.shape[0]
    idx = jnp.arange(t)
    acc = u.astype(jnp.float32) * w[taps - 1]
    for k in range(1, taps):   # the input k positions back
        src = jnp.maximum(idx - k, 0)
        here = (idx >= k) & (row[src] == row) & (positions[src] == positions - k)
        prev = jnp.where(here[:, None], u[src], 0).astype(jnp.float32)
        if held is not None:   # before the row's first token in this step: its state slot
            old = held[slot, (positions - k) % (taps - 1)].astype(jnp.float32)
            prev = jnp.where((~here & (positions >= k))[:, None], old, prev)
        acc = acc + prev * w[taps - 1 - k]
    return acc


def store_conv_inputs(u: jax.Array, held: jax.Array, positions: jax.Array, row: jax.Array, slot: jax.Array,
                      meta: AttentionMetadata) -> jax.Array:
    """held [slots, L - 1, C] with each row's last L - 1 inputs of u [T, C] (its tokens within L - 1
    of its cached length) written to its slot."""
    n = held.shape[1]
    last = meta.context_lens[row] - positions <= n
    keep = (meta.slot_mapping != PAD_SLOT) & last
    flat = jnp.where(keep, slot * n + positions % n, held.shape[0] * n)
    return held.reshape(-1, held.shape[-1]).at[flat].set(u.astype(held.dtype), mode="drop").reshape(held.shape)


def _l2norm(x: jax.Array) -> jax.Array:
    """x over the root of its squares' sum along the last axis (plus 1e-6, as the FLA kernels and
    transformers' l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _delta_update(h: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                  delta: bool = True) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule on a state h [..., Hv, dk, dv] (q, k [..., Hv, dk], v [..., Hv,
    dv], g, beta [..., Hv]): H = exp(g) h, H += k (beta (v - H^T k))^T -> (H, H^T q). Without delta
    (Mamba-2's selective state space, a gated linear attention): H += k (beta v)^T."""
    h = h * jnp.exp(g)[..., None, None]
    mem = jnp.einsum("...hkv,...hk->...hv", h, k, precision=HIGHEST) if delta else 0.0
    h = h + k[..., :, None] * ((v - mem) * beta[..., None])[..., None, :]
    return h, jnp.einsum("...hkv,...hk->...hv", h, q, precision=HIGHEST)


def gated_delta_rule_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                               row: jax.Array, positions: jax.Array, valid: jax.Array, h0: jax.Array,
                               delta: bool = True) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule, token by token over the whole step in float32 (transformers'
    torch_recurrent_gated_delta_rule; gated_delta_rule's reference). q, k [T, Hv, dk] (L2-normalized,
    q scaled by dk^-1/2), v [T, Hv, dv], g, beta [T, Hv]; per token t of row r: H = exp(g_t) H_r (zeros
    first where its position is 0), H += k_t (beta_t (v_t - H^T k_t))^T, o_t = H^T q_t, and H_r = H
    where valid[t]. h0 [S, Hv, dk, dv]: each row's state before the step. -> (o [T, Hv, dv], each
    row's state after the step). Without delta: H += k_t (beta_t v_t)^T (_delta_update)."""
    s = h0.shape[0]

    def step(carry, inp):
        qt, kt, vt, gt, bt, r, p, ok = inp
        h, out = _delta_update(jnp.where(p == 0, 0.0, carry[r]), qt, kt, vt, gt, bt, delta)
        return carry.at[jnp.where(ok, r, s)].set(h, mode="drop"), out

    h, o = jax.lax.scan(step, h0, (q, k, v, g, beta, row, positions, valid))
    return o, h


# the prefill tokens' chunks (gated_delta_rule): tokens per chunk, and the most sequences one chunk
# computes in closed form (more: that chunk goes token by token)
CHUNK = 64
CHUNK_SEGMENTS = 4


def _chunk_closed_form(h: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                       seg: jax.Array, delta: bool = True) -> tuple[jax.Array, jax.Array]:
    """The rule over one chunk of C tokens in closed form (the WY / UT form of Yang et al.; FLA's
    chunked kernels, transformers' torch_chunk_gated_delta_rule), the chunk holding up to R
    sequences' contiguous segments: seg [C] each token's segment (0 .. R - 1), h [R, Hv, dk, dv]
    each segment's state before the chunk; padding tokens carry g = beta = 0. With G_i the
    segment's cumulative log-decay through token i, the values u solve (I + A) u = beta (v - e^G
    H^T k), A_ij = beta_i e^(G_i - G_j) k_i.k_j for j < i in i's segment; o_i = e^(G_i) H^T q_i +
    sum_(j <= i) e^(G_i - G_j) (q_i.k_j) u_j, and a segment ends at e^(G_last) H + sum_j
    e^(G_last - G_j) k_j u_j^T. -> (o [C, Hv, dv], each segment's state after the chunk). Without
    delta: u = beta v (A = 0, and nothing read from H for it: Mamba-2's state space duality)."""
    c, r = q.shape[0], h.shape[0]
    idx = jnp.arange(c)
    first = jax.lax.cummax(jnp.where(jnp.concatenate([jnp.array([True]), seg[1:] != seg[:-1]]), idx, 0))
    cs = jnp.cumsum(g, axis=0)                                                     # (C, Hv)
    big = cs - (cs[first] - g[first])                                              # G: within each segment
    same = seg[:, None] == seg[None, :]
    strict, incl = same & (idx[:, None] > idx[None, :]), same & (idx[:, None] >= idx[None, :])
    diff = big[:, None, :] - big[None, :, :]                                       # (C, C, Hv): G_i - G_j
    decay = lambda m: jnp.exp(jnp.where(m[..., None], diff, -jnp.inf))  # noqa: E731
    onehot = (seg[:, None] == jnp.arange(r)[None, :]).astype(jnp.float32)          # (C, R)
    keys = jnp.stack([k, q], axis=2) if delta else q[:, :, None]                   # (C, Hv, 2 or 1, dk)
    per_segment = jnp.einsum("rhkv,ihck->rihcv", h, keys, precision=HIGHEST)       # (R, C, Hv, 2 or 1, dv)
    read = jnp.einsum("ir,rihcv->ihcv", onehot, per_segment, precision=HIGHEST)    # (H^T k,) H^T q per token
    eg = jnp.exp(big)[..., None]
    rhs = beta[..., None] * (v - eg * read[:, :, 0] if delta else v)               # (C, Hv, dv)
    if delta:
        a = beta[:, None, :] * jnp.einsum("ihd,jhd->ijh", k, k, precision=HIGHEST) * decay(strict)
        system = jnp.eye(c, dtype=jnp.float32) + jnp.moveaxis(a, 2, 0)             # (Hv, C, C)
        u = jnp.moveaxis(jax.scipy.linalg.solve_triangular(system, jnp.moveaxis(rhs, 1, 0), lower=True,
                                                           unit_diagonal=True), 0, 1)  # (C, Hv, dv)
    else:
        u = rhs
    qk = jnp.einsum("ihd,jhd->ijh", q, k, precision=HIGHEST) * decay(incl)
    o = eg * read[:, :, -1] + jnp.einsum("ijh,jhv->ihv", qk, u, precision=HIGHEST)
    last = jnp.max(jnp.where(onehot > 0, idx[:, None], -1), axis=0)                # (R,) -1: no token
    glast = jnp.where((last >= 0)[:, None], big[jnp.maximum(last, 0)], 0.0)        # (R, Hv)
    w = onehot.T[..., None] * jnp.exp(jnp.minimum(glast[:, None, :] - big[None], 0.0))   # (R, C, Hv)
    return o, jnp.exp(glast)[..., None, None] * h + jnp.einsum("rjhk,jhv->rhkv", w[..., None] * k[None], u,
                                                               precision=HIGHEST)


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, row: jax.Array,
                     positions: jax.Array, valid: jax.Array, h0: jax.Array, chunk: int = CHUNK,
                     closed_form: bool = True, delta: bool = True) -> tuple[jax.Array, jax.Array]:
    """gated_delta_rule_reference's numbers (to float32 rounding) without its token-by-token loop.
    A row with one token in the step (a decode row) is updated with every other such row at once
    (H^T k and H^T q read once, scaled by the decay; the state written once). The tokens of rows with
    several (prefill chunks), in order, go by chunks of `chunk` in a loop whose trip count is their
    number over the chunk (0 in a decode-only step): a chunk of at most CHUNK_SEGMENTS rows' segments
    in closed form (_chunk_closed_form), one of more token by token (every chunk, without
    closed_form). Each chunk reads its rows' states from the carry (zeros for a segment starting at
    position 0) and writes them back. Padding tokens (not valid) compute nothing that is kept. delta
    False: Mamba-2's rule instead (_delta_update)."""
    t, s = q.shape[0], h0.shape[0]
    count = jnp.zeros(s, jnp.int32).at[row].add(valid.astype(jnp.int32))
    single = valid & (count[row] == 1)
    # decode rows: their one token each, gathered per row (S of them); a row without such a token
    # gets decay 1 and delta 0 (its state unchanged, exactly), one at position 0 decay 0
    tok = jnp.full(s, t, jnp.int32).at[jnp.where(single, row, s)].set(jnp.arange(t, dtype=jnp.int32), mode="drop")
    has = tok < t
    at = jnp.minimum(tok, t - 1)
    qa, ka, va, ba = q[at], k[at], v[at], beta[at]
    decay = jnp.where(has[:, None], jnp.where((positions[at] == 0)[:, None], 0.0, jnp.exp(g[at])), 1.0)   # (S, Hv)
    keys = jnp.stack([ka, qa], axis=2) if delta else qa[:, :, None]    # H^T k only for the delta correction
    read = jnp.einsum("shkv,shck->shcv", h0, keys, precision=HIGHEST) * decay[:, :, None, None]
    add = jnp.where(has[:, None, None], ((va - read[:, :, 0]) if delta else va) * ba[..., None], 0.0)   # (S, Hv, dv)
    h = h0 * decay[..., None, None] + ka[..., :, None] * add[..., None, :]
    o1 = read[:, :, -1] + jnp.sum(ka * qa, axis=-1)[..., None] * add
    o = jnp.zeros(v.shape, jnp.float32).at[jnp.where(has, tok, t)].set(o1, mode="drop")
    # the other rows' tokens, compacted in order, by chunks
    multi = valid & ~single
    n = jnp.sum(multi)
    size = -(-t // chunk) * chunk
    order = jnp.nonzero(multi, size=size, fill_value=t)[0]
    pad = lambda a: jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])  # noqa: E731  (index t: padding)
    qp, kp, vp, gp, bp = pad(q), pad(k), pad(v), pad(g), pad(beta)
    rowp, posp = jnp.concatenate([row, jnp.array([-1], row.dtype)]), pad(positions)

    def one_chunk(i, carry):
        h, o = carry
        j = jax.lax.dynamic_slice(order, (i * chunk,), (chunk,))
        rj = rowp[j]
        seg = jnp.cumsum(jnp.concatenate([jnp.array([0]), (rj[1:] != rj[:-1]).astype(jnp.int32)]))
        start = jax.lax.cummax(jnp.where(jnp.concatenate([jnp.array([True]), rj[1:] != rj[:-1]]),
                                         jnp.arange(chunk), 0))
        # each segment's row and first position (segments past the last: none)
        seg_row = jnp.full(CHUNK_SEGMENTS, -1, rj.dtype).at[seg].set(rj, mode="drop")
        seg_pos = jnp.zeros(CHUNK_SEGMENTS, posp.dtype).at[seg].set(posp[j[start]], mode="drop")

        # up to CHUNK_SEGMENTS segments: the closed form; more: its writes dropped and the chunk's
        # tokens go one by one instead (a loop of 0 or `chunk` iterations; no conditional, which
        # would copy the carried states)
        if closed_form:
            closed = seg[-1] - (rj[-1] < 0) < CHUNK_SEGMENTS   # (the padding's segment, last, takes no place)
            hs = jnp.where(((seg_row < 0) | (seg_pos == 0))[:, None, None, None], 0.0, h[jnp.maximum(seg_row, 0)])
            oc, he = _chunk_closed_form(hs, qp[j], kp[j], vp[j], gp[j], bp[j], seg, delta)
            h = h.at[jnp.where(closed & (seg_row >= 0), seg_row, s)].set(he, mode="drop")
        else:
            closed, oc = jnp.array(False), jnp.zeros((chunk, *v.shape[1:]), jnp.float32)

        def by_token(m, carry):
            h, oc = carry
            jm, r = j[m], rj[m]
            hr, om = _delta_update(jnp.where(posp[jm] == 0, 0.0, h[jnp.maximum(r, 0)]), qp[jm], kp[jm], vp[jm],
                                   gp[jm], bp[jm], delta)
            return h.at[jnp.where(r >= 0, r, s)].set(hr, mode="drop"), oc.at[m].set(om)

        h, oc = jax.lax.fori_loop(0, jnp.where(closed, 0, chunk), by_token, (h, oc))
        return h, o.at[j].set(oc, mode="drop")

    return jax.lax.fori_loop(0, -(-n // chunk), one_chunk, (h, o))[::-1]


def recurrent_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, row: jax.Array,
                   positions: jax.Array, state: DeltaState | None, meta: AttentionMetadata | None,
                   closed_form: bool | None, delta: bool = True) -> tuple[jax.Array, jax.Array | None]:
    """gated_delta_rule over a layer's step: each row from its state slot's matrix (state None: one
    sequence from zeros), the padding tokens (slot mapping PAD_SLOT) left out. closed_form None: the
    prefill chunks' closed form where it pays, not on a CPU (a GPU's or TPU's kernel launches make a
    token loop slow; a CPU computes the closed form's extra flops, CHUNK_SEGMENTS segments each, more
    slowly than the loop: 0.64x measured here for a 512-token prompt, bench/deltanet.py, README).
    -> (o [T, Hv, dv] float32, state.h with the rows that computed a token written back, or None)."""
    if state is None:
        h0, valid = jnp.zeros((1, v.shape[1], k.shape[-1], v.shape[-1]), jnp.float32), jnp.ones(q.shape[0], bool)
    else:
        h0, valid = state.h[meta.state_slots], meta.slot_mapping != PAD_SLOT
    closed = jax.default_backend() != "cpu" if closed_form is None else closed_form
    o, h = gated_delta_rule(q, k, v, g, beta, row, positions, valid, h0, closed_form=closed, delta=delta)
    if state is None:
        return o, None
    wrote = jnp.zeros(h0.shape[0], bool).at[row].max(valid)
    return o, state.h.at[jnp.where(wrote, meta.state_slots, state.h.shape[0])].set(h, mode="drop")


class GatedDeltaNet(nnx.Module):
    """Qwen3-Next's and Qwen3.5's linear-attention layer. From x [T, D]: qkv = x W_qkv through the
    causal depthwise convolution of conv_kernel taps and SiLU, split into q, k [T, Hk, dk] and
    v [T, Hv, dv]; z = x W_z, beta = sigmoid(x W_b), g = -exp(A_log) softplus(x W_a + dt_bias) [T, Hv];
    q and k L2-normalized, q times dk^-1/2, each k head shared by Hv / Hk value heads (repeated, as
    repeat_interleave); the gated delta rule (gated_delta_rule); each head's output RMS-normed (weight
    `norm`), times SiLU(z), then W_out. Rounding as transformers': the projections, convolution,
    SiLU and beta in the model dtype; the rule, g and the norm's statistics in float32. Qwen3-Next's
    in_proj_qkvz / in_proj_ba (grouped per key head) are split into these at load (hf_maps)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None):
        d, hv, vd, c = cfg.d_model, cfg.linear_v_heads, cfg.linear_v_heads * cfg.linear_v_dim, cfg.linear_conv_dim
        self.cfg = cfg
        self.in_proj_qkv = param((d, c), ("embed", None), dtype, rngs)
        self.in_proj_z = param((d, vd), ("embed", None), dtype, rngs)
        self.in_proj_b = param((d, hv), ("embed", None), dtype, rngs)
        self.in_proj_a = param((d, hv), ("embed", None), dtype, rngs)
        self.conv = param((cfg.conv_kernel, c), (None, None), dtype, rngs)
        self.dt_bias = param((hv,), (None,), dtype, rngs, init="ones")
        self.A_log = param((hv,), (None,), dtype, rngs, init="zeros")
        self.norm = param((cfg.linear_v_dim,), (None,), dtype, rngs, init="ones")
        self.out_proj = param((vd, d), (None, "embed"), dtype, rngs)
        self.matmul = "auto"
        # the prefill chunks' closed form (gated_delta_rule): None, where it pays (not on a CPU); a
        # static attribute, so that each choice compiles its own step (tests set it)
        self.closed_form: bool | None = None

    def __call__(self, x: jax.Array, positions: jax.Array, state: DeltaState | None,
                 meta: AttentionMetadata | None, impl: str, lora: tuple | None = None
                 ) -> tuple[jax.Array, DeltaState | None]:
        assert lora is None, "LoRA adapts no Gated DeltaNet layer (lora/adapter.py refuses the family)"
        cfg, dtype, t = self.cfg, x.dtype, x.shape[0]
        hk, hv, dk, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
        f32 = jnp.float32
        mixed = dense(x, self.in_proj_qkv.get_value(), None, impl=self.matmul)                    # (T, C)
        z = dense(x, self.in_proj_z.get_value(), None, impl=self.matmul).reshape(t, hv, dv)
        b = dense(x, self.in_proj_b.get_value(), None, impl=self.matmul)                          # (T, Hv)
        a = dense(x, self.in_proj_a.get_value(), None, impl=self.matmul)
        row = jnp.zeros(t, jnp.int32) if meta is None else meta.seq_ids
        slot = None if state is None else meta.state_slots[row]
        conv = causal_conv(mixed, self.conv.get_value().astype(f32), positions, row,
                           None if state is None else state.u, slot).astype(dtype)
        conv = jax.nn.silu(conv.astype(f32)).astype(dtype)
        q = conv[:, :hk * dk].reshape(t, hk, dk).astype(f32)
        k = conv[:, hk * dk:2 * hk * dk].reshape(t, hk, dk).astype(f32)
        v = conv[:, 2 * hk * dk:].reshape(t, hv, dv).astype(f32)
        beta = jax.nn.sigmoid(b.astype(f32)).astype(dtype).astype(f32)
        g = -jnp.exp(self.A_log.get_value().astype(f32)) * jax.nn.softplus(
            a.astype(f32) + self.dt_bias.get_value().astype(f32))
        q, k = _l2norm(q) * dk ** -0.5, _l2norm(k)
        q, k = jnp.repeat(q, hv // hk, axis=1), jnp.repeat(k, hv // hk, axis=1)
        o, h = recurrent_step(q, k, v, g, beta, row, positions, state, meta, self.closed_form)
        o = o.astype(dtype).astype(f32)                                                          # (T, Hv, dv)
        normed = (o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + cfg.norm_eps)).astype(dtype)
        y = (self.norm.get_value() * normed).astype(f32) * jax.nn.silu(z.astype(f32))
        out = dense(y.astype(dtype).reshape(t, hv * dv), self.out_proj.get_value(), None, impl=self.matmul)
        if state is None:
            return out, None
        return out, DeltaState(store_conv_inputs(mixed, state.u, positions, row, slot, meta), h)
