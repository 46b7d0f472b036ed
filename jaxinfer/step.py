"""One engine step on the device: the typed host-to-device contract and the jitted step function.

The contract (SGLang states its ScheduleBatch -> ForwardBatch the same way):
  host, numpy (runner.ModelRunner.prepare builds it from the SchedulerOutput)  device
  StepInputs.tokens, positions [T]     this step's tokens, flattened rows   -> embeddings, RoPE / ALiBi
  StepInputs.meta                      AttentionMetadata (kv_cache.py)      -> K/V writes, paged reads
  StepInputs.logits_indices [S]        last token of each row               -> LM head on S rows only
  StepInputs.sampling                  SamplingBatch [S]                    -> token ids, logprobs
  StepInputs.stop_ids [S, M]           ids that end a row on device (EOS unless ignore_eos, the row's
                                       stop_token_ids; -1 padded)
  StepInputs.max_new [S]               tokens each row may draw this call (0: the row does not sample)
  StepInputs.num_iters []              decode iterations to run (1 unless every row decodes)
  StepInputs.from_prev [T]             async scheduling: where a token still on the device lies in the
                                       previous step's next_tokens (-1: the host's token)
  StepInputs.prompt_targets [T]        prompt logprobs: the prompt token following each token (-1: none;
                                       jaxinfer/prompt_logprobs.py; None: a program without them)
  StepInputs.lora                      multi-LoRA (None without): each token's adapter slot [T] and the
                                       slots' device stacks (jaxinfer/lora/execute.py) -> low-rank updates
  StepInputs.pool_weights [T]          embeddings (optional, keyword): each token's weight in its row's
                                       pooled sum (host/pooling.py; all 0 when no row embeds: skipped)
and back, one device-to-host copy of StepOutputs: ids/logprobs [K, S] (+ top-N [K, S, 20]) and
num_drawn [S] (+ prompt_logprobs / prompt_ranks [T], prompt_top_* [T, 20] when some row asked; + pooled
[S, D] float32, where pool_weights was given: each row's weighted sum of its final-norm hidden states,
read by the host only when some row embeds). next_tokens [K * max_rows] stays on the device as the next step's `prev_tokens`
(async scheduling, runner.py). The KV pages are donated, so they are updated in place.

The step is one module-level function of (params, kv_pages, inputs, prev_tokens) with everything it
is compiled for in `StepSettings`, so the compiled program depends on nothing hidden; `jit_step`
jits it for one engine (which owns the executables).

Multi-step decoding: when every row of a step decodes (one token each), the scheduler asks for
up to K iterations. Iteration i feeds the tokens sampled by iteration i - 1 straight back in:
positions and context lengths grow by one, each row's next KV slot comes from its block table
(the scheduler allocated blocks for all K tokens up front), and the sampler's position (hence
its key, from (seed, sample index, position)) advances, so every draw is the one a one-token step
would make. A row stops on device at a stop id or when it has drawn max_new tokens; the loop ends
when every row has stopped or after num_iters iterations. A stopped row writes no more KV. The
host applies stop strings afterwards and discards what follows a stop (engine.py). A mixed step
(prefill chunks) runs the same program with num_iters = 1, so multi-step adds no compilation.

Speculative engines (jaxinfer/spec_decode/) run step programs of their own that extend this
contract (more inputs and outputs, more settings) and share its helpers (`run_loop`, `pin_pages`,
`tokens_with_prev`); their steps with nothing speculative in them run this plain program. Nothing
here branches on a speculative method.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.kv_cache import PAD_SLOT, AttentionMetadata, LayerKV
from jaxinfer.prompt_logprobs import step_prompt_logprobs
from jaxinfer.sampling import MAX_LOGPROBS, SamplingBatch, reads_history, sample

MAX_STOP_IDS = 8   # stop ids checked on device per row; a row with more is checked by the host only


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    tokens: jax.Array           # [T] int32
    positions: jax.Array        # [T] int32
    meta: AttentionMetadata
    logits_indices: jax.Array   # [S] int32
    sampling: SamplingBatch     # [S] rows
    stop_ids: jax.Array         # [S, MAX_STOP_IDS] int32, -1 padded
    max_new: jax.Array          # [S] int32
    num_iters: jax.Array        # [] int32, 1 <= num_iters <= StepSettings.max_iters
    from_prev: jax.Array        # [T] int32: index into the previous step's next_tokens, or -1
    # [T] int32: the prompt token after each token whose logprob is asked for, or -1 (None: the
    # program has no prompt logprobs; keyword-only, so subclasses keep their positional fields)
    prompt_targets: jax.Array | None = field(default=None, kw_only=True)
    # multi-LoRA: jaxinfer.lora.execute.LoraInputs (token slots [T] + device stacks), None without
    lora: object = field(default=None, kw_only=True)
    # embeddings: [T] float32 pooling weights (None: the program has no pooling; keyword-only, so the
    # subclasses' positional fields keep their order)
    pool_weights: jax.Array | None = field(default=None, kw_only=True)


@jax.tree_util.register_dataclass
@dataclass
class StepOutputs:
    ids: jax.Array              # [K, S] int32: token drawn by row s at iteration k
    logprobs: jax.Array         # [K, S] float32
    top_ids: jax.Array          # [K, S, MAX_LOGPROBS] int32 (zeros unless some row asked for logprobs)
    top_logprobs: jax.Array     # [K, S, MAX_LOGPROBS] float32
    num_drawn: jax.Array        # [S] int32: how many of ids[:, s] are real
    next_tokens: jax.Array      # [K * max_rows] int32: ids[k, s] at k * max_rows + s (stays on device)
    # prompt logprobs (with StepInputs.prompt_targets; zeros unless some token has a target)
    prompt_logprobs: jax.Array | None = field(default=None, kw_only=True)      # [T] float32
    prompt_ranks: jax.Array | None = field(default=None, kw_only=True)        # [T] int32
    prompt_top_ids: jax.Array | None = field(default=None, kw_only=True)      # [T, MAX_LOGPROBS] int32
    prompt_top_logprobs: jax.Array | None = field(default=None, kw_only=True)  # [T, MAX_LOGPROBS] float32
    pooled: jax.Array | None = field(default=None, kw_only=True)   # [S, D] float32 (with pool_weights)


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """What `step` is compiled for (static: hashable)."""
    graphdef: nnx.GraphDef
    attention: str                      # "xla" | "pallas"
    max_iters: int = 1                  # K: output rows of StepOutputs
    max_rows: int = 1                   # the largest S of any bucket (next_tokens' row stride)
    kv_sharding: NamedSharding | None = None   # pages leave as they came (TP): in-place donation
    replicate_samples: NamedSharding | None = None   # multi-host: process 0 reads every row
    # rows of next_tokens when another program of the same engine (one that draws more tokens per
    # row, jaxinfer/spec_decode/) reads this one's as its prev_tokens, and this one reads its
    next_rows: int = 0

    @property
    def out_rows(self) -> int:
        """Rows of next_tokens (out_rows * max_rows) and, but for next_rows, of StepOutputs.ids."""
        return max(self.max_iters, self.next_rows)


def with_history(b: SamplingBatch, ids: jax.Array, drew: jax.Array) -> SamplingBatch:
    """b with ids [N] recorded at b.position where drew [N] (penalties and bad words see the tokens
    drawn, or proposed, before the one being drawn)."""
    def record(b):
        rows = jnp.arange(ids.shape[0])
        col = jnp.where(drew, b.position, b.history.shape[1])              # out of range: dropped
        return SamplingBatch(**{**vars(b), "history": b.history.at[rows, col].set(ids, mode="drop"),
                                "history_is_output": b.history_is_output.at[rows, col].set(True, mode="drop")})
    return jax.lax.cond(reads_history(b), record, lambda b: b, b)


def tokens_with_prev(inputs: StepInputs, prev_tokens: jax.Array) -> jax.Array:
    """The step's tokens [T], those still on the device (async scheduling: from_prev >= 0) read from
    the previous step's next_tokens."""
    return jnp.where(inputs.from_prev >= 0, prev_tokens[jnp.maximum(inputs.from_prev, 0)], inputs.tokens)


def run_loop(body, carry: tuple, done_at: int, num_iters: jax.Array, max_iters: int) -> tuple:
    """body over carry (its first item the iteration index, carry[done_at] the rows that stopped):
    once where the step is compiled for one iteration (no loop; the model is traced once either
    way), else on the device while some row goes on, up to num_iters iterations. The first always
    runs: a step whose rows draw nothing still writes its K/V."""
    if max_iters == 1:
        return body(carry)
    return jax.lax.while_loop(lambda c: (c[0] == 0) | ((c[0] < num_iters) & jnp.any(~c[done_at])), body, carry)


def pin_pages(pages, settings: StepSettings, replicated: bool = False):
    """Under tensor parallelism: the model's pages keep their head sharding (or, replicated, stay on
    every device: a small model's beside it), so that they leave the step as they came (in-place
    donation, no recompilation)."""
    if settings.kv_sharding is None:
        return pages
    sharding = NamedSharding(settings.kv_sharding.mesh, PartitionSpec()) if replicated else settings.kv_sharding
    return jax.lax.with_sharding_constraint(pages, sharding)


def _advance(inputs: StepInputs, ids: jax.Array, drew: jax.Array, going: jax.Array, block_size: int
             ) -> StepInputs:
    """The next decode iteration's inputs: row s's token becomes ids[s] one position later, for the
    rows still going; the others write nothing (PAD_SLOT). Penalties see what was drawn (drew).
    Valid only when every row of the step holds one token (the scheduler's condition for
    num_iters > 1)."""
    meta, li = inputs.meta, inputs.logits_indices
    t = inputs.tokens.shape[0]
    row_of_tok = meta.seq_ids
    real = meta.slot_mapping != PAD_SLOT
    tok_going = going[row_of_tok] & real & (jnp.arange(t) == li[row_of_tok])
    tokens = jnp.where(tok_going, ids[row_of_tok], inputs.tokens)
    positions = jnp.where(tok_going, inputs.positions + 1, inputs.positions)
    block = jnp.take_along_axis(meta.block_tables[row_of_tok], (positions // block_size)[:, None], axis=1)[:, 0]
    slots = jnp.where(tok_going, block * block_size + positions % block_size, PAD_SLOT)
    meta = AttentionMetadata(**{**vars(meta), "slot_mapping": slots,
                                "context_lens": meta.context_lens + going.astype(jnp.int32)})
    sb = with_history(inputs.sampling, ids, drew)   # penalties see the tokens drawn by earlier iterations
    sb = SamplingBatch(**{**vars(sb), "position": sb.position + going.astype(jnp.int32)})
    # prompt positions are scored by the first iteration only (later ones run when every row decodes)
    targets = None if inputs.prompt_targets is None else jnp.full_like(inputs.prompt_targets, -1)
    # a row's positions are pooled once: in the iteration that computes its chunk
    weights = None if inputs.pool_weights is None else jnp.zeros_like(inputs.pool_weights)
    return StepInputs(tokens, positions, meta, li, sb, inputs.stop_ids, inputs.max_new, inputs.num_iters,
                      inputs.from_prev, prompt_targets=targets, lora=inputs.lora, pool_weights=weights)


def pool_rows(h: jax.Array, weights: jax.Array, seq_ids: jax.Array, num_rows: int) -> jax.Array:
    """h [T, D] final-norm hidden states, weights [T] -> [S, D] float32: each row's weighted sum of its
    tokens' states (embeddings' pooling, host/pooling.py). Skipped (zeros) when every weight is 0, so
    a step with no embedding row pays one reduction over T."""
    def pooled(_):
        x = h.astype(jnp.float32) * weights[:, None]                                 # (T, D)
        return jax.ops.segment_sum(x, seq_ids, num_segments=num_rows)               # (S, D)
    zeros = lambda _: jnp.zeros((num_rows, h.shape[-1]), jnp.float32)  # noqa: E731
    return jax.lax.cond(jnp.any(weights != 0), pooled, zeros, None)


def step(params, kv_pages: list[LayerKV], inputs: StepInputs, prev_tokens: jax.Array, settings: StepSettings
         ) -> tuple[StepOutputs, list[LayerKV]]:
    """The plain step: up to num_iters iterations of one forward and one draw per row.
    prev_tokens [K * max_rows]: the previous step's next_tokens (zeros when every token is known)."""
    model = nnx.merge(settings.graphdef, params)
    inputs = dataclasses.replace(inputs, tokens=tokens_with_prev(inputs, prev_tokens))
    s, k = inputs.logits_indices.shape[0], settings.max_iters
    block_size = next(p for p in kv_pages if isinstance(p, LayerKV)).block_size   # (conv layers: ConvState)

    def iteration(i, kv, x: StepInputs, out: StepOutputs, done):
        """One forward + sample; returns the drawn ids and the updated kv, outputs and done."""
        # the model's __call__, keeping h for prompt logprobs and pooling
        h, kv = model.hidden_states(x.tokens, x.positions, kv, x.meta, impl=settings.attention, lora=x.lora)
        logits = model.logits(h[x.logits_indices])
        prompt = {}
        if x.prompt_targets is not None:   # the prompt's rows also go through the LM head when some row asks
            scored = step_prompt_logprobs(model, h, x.prompt_targets, (out.prompt_logprobs, out.prompt_ranks,
                                                                        out.prompt_top_ids, out.prompt_top_logprobs))
            prompt = dict(zip(("prompt_logprobs", "prompt_ranks", "prompt_top_ids", "prompt_top_logprobs"), scored))
        kv = pin_pages(kv, settings)
        ids, lps, top_ids, top_lps = sample(logits, x.sampling)
        drew = ~done
        drawn = out.num_drawn + drew.astype(jnp.int32)
        pooled = None if x.pool_weights is None else out.pooled + pool_rows(h, x.pool_weights, x.meta.seq_ids, s)
        out = StepOutputs(out.ids.at[i].set(jnp.where(drew, ids, 0)), out.logprobs.at[i].set(lps),
                          out.top_ids.at[i].set(top_ids), out.top_logprobs.at[i].set(top_lps), drawn,
                          out.next_tokens, pooled=pooled, **prompt)
        stopped = jnp.any(ids[:, None] == x.stop_ids, axis=1)
        return ids, drew, kv, out, done | (drew & stopped) | (drawn >= x.max_new)

    def body(carry):
        i, kv, x, out, done = carry
        ids, drew, kv, out, done = iteration(i, kv, x, out, done)
        # the next iteration's inputs (unused after the last one; cheap next to the forward)
        return i + 1, kv, _advance(x, ids, drew, ~done, block_size), out, done

    prompt = {}
    if inputs.prompt_targets is not None:
        t = inputs.prompt_targets.shape[0]
        prompt = dict(prompt_logprobs=jnp.zeros((t,), jnp.float32), prompt_ranks=jnp.zeros((t,), jnp.int32),
                      prompt_top_ids=jnp.zeros((t, MAX_LOGPROBS), jnp.int32),
                      prompt_top_logprobs=jnp.zeros((t, MAX_LOGPROBS), jnp.float32))
    out = StepOutputs(jnp.zeros((k, s), jnp.int32), jnp.zeros((k, s), jnp.float32),
                      jnp.zeros((k, s, MAX_LOGPROBS), jnp.int32), jnp.zeros((k, s, MAX_LOGPROBS), jnp.float32),
                      jnp.zeros((s,), jnp.int32), jnp.zeros((k * settings.max_rows,), jnp.int32),
                      pooled=None if inputs.pool_weights is None else jnp.zeros((s, model.cfg.d_model), jnp.float32),
                      **prompt)
    carry = (jnp.int32(0), kv_pages, inputs, out, inputs.max_new <= 0)
    _, kv_pages, _, out, _ = run_loop(body, carry, 4, inputs.num_iters, k)
    next_tokens = jnp.zeros((settings.out_rows, settings.max_rows), jnp.int32).at[:k, :s].set(out.ids).reshape(-1)
    out = dataclasses.replace(out, next_tokens=next_tokens)
    if settings.replicate_samples is not None:
        out = jax.lax.with_sharding_constraint(out, settings.replicate_samples)
    return out, kv_pages


def jit_step(settings: StepSettings, step_fn=step):
    """The jitted step_fn(params, kv_pages, inputs, prev_tokens) for these settings (`step`, or a step
    function of jaxinfer/spec_decode/ whose settings and inputs extend these), pages donated. Each
    runner owns its own: its executables then live and die with the engine. (A process-wide jit cache
    keeps every engine's programs forever, and XLA:CPU maps ~1,100 memory regions per program: a
    process that builds engines one after another, the test suite, hit the kernel's 65,530-mapping
    limit after ~60 programs and aborted.)"""
    return jax.jit(functools.partial(step_fn, settings=settings), donate_argnames="kv_pages")

