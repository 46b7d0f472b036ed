"""Pipeline parallelism: the decoder's layers split into stages over the mesh's "pipeline" axis.

    mesh = make_mesh(tensor_parallel=2, pipeline_parallel=2)
    model = load_pipelined(path, "bfloat16", mesh)     # or pipeline_decoder(decoder, mesh)
    gen = Generator(model, tokenizer, EngineConfig(pipeline_parallel=2, pipeline_microbatches=4))

Layout. Every per-layer parameter is stacked to a leading layer axis, [n_layers, ...], placed
with NamedSharding(P("pipeline", *its tensor-parallel spec)): pipeline rank p holds layers
p*Lp .. p*Lp + Lp - 1 (Lp = n_layers / pp; n_layers % pp != 0 is a ValueError) and, within its
stage, tensor parallelism shards them as sharding.py says. Embeddings, the final norm and the LM
head are not stacked: they stay replicated over "pipeline" (sharded over "tensor"). The KV pages
are Lp LayerKV whose arrays are [pp, Hkv, NB, bs, D] sharded P("pipeline", "tensor" or None):
entry j of rank p is global layer p*Lp + j, so each device holds its own layers' pages only and
each local layer's pages are a buffer of their own (scattered in place when donated).

The forward (PipelinedDecoder.__call__) embeds all tokens, then runs the stages under
jax.shard_map manual over "pipeline" only; "tensor" (and "data") stay automatic, so GSPMD
keeps partitioning each stage's matmuls exactly as in plain tensor parallelism. A step's
sequences are split by the runner into M micro-batches [M, T] (balanced by tokens, one padded
bucket shape). Inside, a loop of n + pp - 1 iterations (n <= M non-empty micro-batches, a traced
trip count, so a small step does not pay for M): at iteration i, stage p runs its Lp blocks
(the ordinary Block module and the one attention entry point, each micro-batch with its own
AttentionMetadata) on micro-batch i - p, then jax.lax.ppermute passes the [T, D] activation to
stage p + 1. Stage 0 reads the embeddings instead; the last stage keeps the hidden states of
the rows that sample. Iterations where i - p is outside [0, n) are the bubble: the stage computes
on a clipped micro-batch with every KV write dropped (slot PAD_SLOT) and its result discarded.
After the loop one psum over "pipeline" (zeros everywhere but the last stage: exact) hands the
[M, S, D] states to the final norm, LM head and sampler, which run as in tensor parallelism.

The bubble. With n micro-batches and pp stages each stage is busy n of the n + pp - 1
iterations, so the idle fraction is

    bubble = (pp - 1) / (n + pp - 1)        pp = 4: n = 1 -> 75 %, n = 4 -> 43 %, n = 8 -> 27 %

and a step takes (n + pp - 1) iterations of one stage's work on a T/n-token micro-batch, against
pp such stage-times per micro-batch without micro-batching. The step is synchronous (sampling
needs every micro-batch), so the bubble recurs every step, in prefill and decode alike; more
micro-batches shrink it but each is padded to at least the smallest token bucket (8), so decode
of few sequences gains nothing from splitting. Sequences are the unit: one long prefill chunk is
one micro-batch (it is not split across micro-batches).

Measured (`python -m tests.pipeline_worker --bubble DIR`: an 8-layer Llama, d_model 256, pp 4, 8
sequences of 16 prompt tokens; median engine step on 8 fake CPU devices of a 2-core host shared
with other work, so the stages do not really run in parallel and the collectives are thread
rendezvous: the trend means something, the absolute times do not):
    prefill step (128 tokens): M=1 792 ms, M=4 404 ms, M=8 306 ms   (one device: 194 ms)
    decode step (8 tokens):    M=1 112 ms, M=4 200 ms, M=8 212 ms   (one device: 8 ms)
Prefill follows the model: (n + pp - 1) iterations of 1/n of the tokens predicts M=4 and M=8 at
7/16 and 11/32 of M=1 (346 and 272 ms). Decode micro-batches are padded to 8 tokens each, so
splitting 8 tokens only adds iterations.

Communication per iteration: one [T/n, d_model] activation point-to-point per stage boundary
(ppermute), and once per step the [M, S, d_model] psum of the sampled rows.

Loading (load_pipelined): an HF folder is read straight into the stacked layout, each device's
callback reading only its layers' slices from the safetensors memmaps (sharding.load_sharded).
A native checkpoint, or an in-memory Decoder (pipeline_decoder), is restacked through host
memory one parameter at a time (each device's slice copied from the host to that device).

Quantized weights (quantize="int8" | "int4" | "fp8" at load, or any `jaxinfer quantize` checkpoint:
GPTQ, AWQ, W8A8 with static activation scales) are stacked leaf by leaf: codes, scales, zero points
and activation scales each get the leading layer axis, sharded over "pipeline", and within a stage
over "tensor" as sharding.quantized_sharding lays out one layer. They go through host memory (the
model is loaded, and quantized if asked, on the host CPU first).

Limits. Not supported with pipeline_parallel > 1: several processes (multi-host). A layer whose
sliding window differs between stages passes it as a traced int32: the Pallas ragged kernel reads it
as an input of the step (tests/families_worker.py runs Gemma 3 at PP 2 on both attentions); a
forward without a KV cache (Generator.logits) of such a stage takes the dense XLA attention, since
flash_attention's window is part of its program. Micro-batches
overlap within one engine step only; steps themselves are not pipelined (vLLM's virtual engines
keep pp steps in flight instead), so for memory-bound decode, where a stage's time is reading
its weights whatever the micro-batch size, M = 1 gives the lowest step latency.

Projections stay unfused here (separate q, k, v, gate, up; models.decoder.fuse_decoder is not
applied): a stage's step is dominated by the stage loop, the ppermutes and the bubble (above: a
decode step of 112 ms against 8 ms on one device), not by the 3 extra matmuls per layer that
fusion removes, and the unfused stacking keeps each stage's KV pages and its GQA layout exactly as
in plain tensor parallelism.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.models.hf_configs import model_config_from_hf
from jaxinfer.host.scheduler import ScheduledSeq, SchedulerOutput
from jaxinfer.kv_cache import PAD_SLOT, AttentionMetadata, LayerKV, attention_buckets, init_kv_pages
from jaxinfer.models.decoder import Block, Decoder, abstract_decoder, quantize_decoder, unfuse_decoder
from jaxinfer.quant import QuantizedWeight
from jaxinfer.runner import Launched, ModelRunner, RunnerConfig
from jaxinfer.sampling import sample
from jaxinfer.step import StepInputs, StepOutputs, StepSettings
from jaxinfer.sharding import load_sharded, param_sharding, quantized_sharding, rules_for

__all__ = ["PipelinedDecoder", "pipeline_decoder", "load_pipelined", "PipelineRunner", "split_microbatches",
           "bubble_fraction", "layers_per_stage"]

# a sliding window wider than any context: a layer without a window, in a stage whose other ranks
# have one at the same local index (the mask rel > -window then never cuts)
_NO_WINDOW = 2**30


def bubble_fraction(num_microbatches: int, pp: int) -> float:
    """The idle fraction of each stage in one step: (pp - 1) / (n + pp - 1)."""
    return (pp - 1) / (num_microbatches + pp - 1)


def _stages(mesh: Mesh) -> int:
    """The mesh's pipeline stages; a pipelined model needs two or more (one is load_model's)."""
    pp = int(dict(mesh.shape).get("pipeline", 1))
    if pp < 2:
        raise ValueError(f"a pipelined model needs a mesh with pipeline_parallel >= 2, got {pp} "
                         "(one stage: load the model with weights.load_model)")
    return pp


def layers_per_stage(cfg: ModelConfig, pp: int) -> int:
    if pp < 1 or cfg.n_layers % pp:
        raise ValueError(f"pipeline_parallel={pp} must divide the model's {cfg.n_layers} layers "
                         f"(each stage holds n_layers / pipeline_parallel of them)")
    return cfg.n_layers // pp


# ------------------------------------------------------------------------------------ the model

class PipelinedDecoder(nnx.Module):
    """Decoder's contract over micro-batches: tokens [M, T] -> logits [M * S, vocab] (or [T] -> [T, vocab]).

    `outer` is a Decoder without layers (embeddings, final norm, LM head); `layers` one Block whose
    every Param is stacked [n_layers, ...] with logical axes ("layers", ...), sharded over "pipeline".
    """

    def __init__(self, outer: Decoder, layers: Block, mesh: Mesh):
        self.cfg = outer.cfg
        self.outer = outer
        self.layers = layers
        self.mesh = mesh
        self.pp = int(mesh.shape["pipeline"])
        self.lp = layers_per_stage(self.cfg, self.pp)

    def _window(self, j: int, p: jax.Array):
        """The sliding window of local layer j on stage p: static when every stage agrees."""
        ws = [self.cfg.layer_window(q * self.lp + j) for q in range(self.pp)]
        if len(set(ws)) == 1:
            return ws[0]
        return jnp.asarray([_NO_WINDOW if w is None else w for w in ws], jnp.int32)[p]

    def _local_rope(self, j: int, p: jax.Array):
        """Whether local layer j on stage p uses the sliding layers' RoPE (Gemma 3): static when every
        stage agrees (decoder.Attention.rope)."""
        cfg = self.cfg
        flags = [cfg.rope_local_theta is not None and cfg.is_sliding(q * self.lp + j) for q in range(self.pp)]
        return flags[0] if len(set(flags)) == 1 else jnp.asarray(flags)[p]

    def _use_rope(self, j: int, p: jax.Array):
        """Whether local layer j on stage p rotates q and k (SmolLM3's NoPE layers do not): static when
        every stage agrees (decoder.Attention.attend)."""
        flags = [self.cfg.uses_rope(q * self.lp + j) for q in range(self.pp)]
        return flags[0] if len(set(flags)) == 1 else jnp.asarray(flags)[p]

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_pages: list[LayerKV] | None = None,
                 meta: AttentionMetadata | None = None, logits_indices: jax.Array | None = None,
                 impl: str = "xla", num_microbatches: jax.Array | None = None):
        """tokens/positions [M, T], meta fields [M, ...], logits_indices [M, S] (rows that sample;
        None: all T), num_microbatches: how many of the M are non-empty (they come first).
        1-D tokens [T]: one micro-batch, logits [T or S, vocab]. Returns (float32 logits, pages)."""
        if tokens.ndim == 1:
            tokens, positions = tokens[None], positions[None]
            meta = None if meta is None else jax.tree.map(lambda a: a[None], meta)
            logits_indices = None if logits_indices is None else logits_indices[None]
        m, t = tokens.shape
        if logits_indices is None:
            logits_indices = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (m, t))
        n = jnp.asarray(m if num_microbatches is None else num_microbatches, jnp.int32)
        x = self.outer.embed_tokens(tokens.reshape(-1), positions.reshape(-1)).reshape(m, t, -1)   # (M, T, D)
        h, kv_pages = self._run_stages(x, positions, kv_pages, meta, logits_indices, impl, n)
        h = self.outer.final_norm(h.reshape(-1, h.shape[-1]))                                       # (M*S, D)
        return self.outer.logits(h), kv_pages

    def _run_stages(self, x0, positions, kv_pages, meta, logits_indices, impl, n):
        """x0 [M, T, D] -> the last layer's output at logits_indices [M, S, D], updated pages."""
        pp, lp, m = self.pp, self.lp, x0.shape[0]
        s = logits_indices.shape[1]
        block_gd, block_state = nnx.split(self.layers)
        paged = kv_pages is not None

        def body(block_state, x0, positions, logits_indices, n, kv_pages, meta):
            p = jax.lax.axis_index("pipeline")
            blocks = []
            for j in range(lp):   # this rank's layers, unrolled: each local layer's pages stay separate
                blk = nnx.merge(block_gd, jax.tree.map(lambda a, j=j: a[j], block_state))
                blk.attn.window = self._window(j, p)
                blk.attn.local_rope = self._local_rope(j, p)
                blk.attn.use_rope = self._use_rope(j, p)
                blocks.append(blk)
            pages = [jax.tree.map(lambda a: a[0], kv) for kv in kv_pages] if paged else None

            def iteration(i, carry):
                x_recv, pages, out = carry
                k = i - p                                           # this stage's micro-batch
                valid = (k >= 0) & (k < n)
                k = jnp.clip(k, 0, m - 1)
                x = jnp.where(p == 0, x0[jnp.minimum(i, m - 1)], x_recv)
                pos = positions[k]
                meta_k = None
                if paged:
                    meta_k = jax.tree.map(lambda a: a[k], meta)
                    meta_k.slot_mapping = jnp.where(valid, meta_k.slot_mapping, PAD_SLOT)   # bubble: no writes
                new_pages = []
                for j, blk in enumerate(blocks):
                    x, kv = blk(x, pos, pages[j] if paged else None, meta_k, impl)
                    new_pages.append(kv)
                rows = x[logits_indices[k]]                                                 # (S, D)
                keep = valid & (p == pp - 1)
                out = jax.lax.dynamic_update_index_in_dim(out, jnp.where(keep, rows, out[k]), k, 0)
                x_next = jax.lax.ppermute(x, "pipeline", [(q, q + 1) for q in range(pp - 1)])
                return x_next, (new_pages if paged else None), out

            carry = (jnp.zeros_like(x0[0]), pages, jnp.zeros((m, s, x0.shape[-1]), x0.dtype))
            _, pages, out = jax.lax.fori_loop(0, n + pp - 1, iteration, carry)
            out = jax.lax.psum(out, "pipeline")     # zeros except on the last stage: exact
            return out, ([jax.tree.map(lambda a: a[None], kv) for kv in pages] if paged else None)

        in_specs = (P("pipeline"), P(), P(), P(), P(), P("pipeline") if paged else None, P() if paged else None)
        staged = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                               out_specs=(P(), P("pipeline") if paged else None),
                               axis_names=frozenset({"pipeline"}), check_vma=False)
        return staged(block_state, x0, positions, logits_indices, n, kv_pages, meta)


def _stacked_sharding(mesh: Mesh, rules, axes, shape: tuple[int, ...]) -> NamedSharding:
    """A stacked [n_layers, *shape] parameter: layers over "pipeline", the rest as tensor parallelism says."""
    return NamedSharding(mesh, P("pipeline", *param_sharding(axes, rules, mesh, shape).spec))


def _assemble(cfg: ModelConfig, dtype, mesh: Mesh, outer_values: dict, layer_values: dict) -> PipelinedDecoder:
    """A PipelinedDecoder from placed arrays: outer 'embed' -> array, stacked 'attn/q' -> [L, ...]."""
    outer = abstract_decoder(cfg, dtype)
    outer.layers = nnx.List([])
    block = nnx.eval_shape(lambda: Block(cfg, 0, dtype, None))
    for module, values, stacked in ((outer, outer_values, False), (block, layer_values, True)):
        for path, node in nnx.iter_graph(module):
            if isinstance(node, nnx.Param):
                node.set_value(values["/".join(map(str, path))])
                if stacked:
                    node.set_metadata("logical_axes", ("layers", *node.get_metadata()["logical_axes"]))
    return PipelinedDecoder(outer, block, mesh)


def _param_specs(cfg: ModelConfig, dtype):
    """name -> (logical axes, shape, dtype) of the Decoder's parameters; layer i's as 'layers/i/...'
    (the dtype: `dtype`, or float32 where the model keeps a parameter in float32 whatever the weights'
    dtype: a sigmoid router and its correction)."""
    flat = nnx.state(abstract_decoder(cfg, dtype), nnx.Param).flat_state()
    return {"/".join(map(str, p)): (v.get_metadata().get("logical_axes"), tuple(v.get_value().shape),
                                    v.get_value().dtype) for p, v in flat}


def _stack_quantized(name: str, per_layer: list[QuantizedWeight], axes, rules, mesh: Mesh) -> QuantizedWeight:
    """The layers' QuantizedWeights of one parameter -> one whose every leaf is stacked [n_layers, ...]:
    layers over "pipeline", the rest as sharding.quantized_sharding lays out one layer (the codes and
    grouped scales split over "tensor" like a float weight of the same place)."""
    first = per_layer[0]

    def fmt(w):
        return (w.bits, w.group_size, w.shape, w.contract, w.act_bits, w.symmetric, w.act_scale is None,
                w.act_zero is None, str(w.q.dtype)) if isinstance(w, QuantizedWeight) else "float"
    for i, w in enumerate(per_layer):
        if fmt(w) != fmt(first):
            raise ValueError(f"layers/{i}/{name} is stored as {fmt(w)} but layers/0/{name} as {fmt(first)}: "
                             "a pipeline stacks each weight of every layer in one format")
    if any(w.perm is not None for w in per_layer):
        raise ValueError(f"layers/*/{name}: activation-ordered (GPTQ desc_act) weights are not stacked for "
                         "pipeline parallelism")
    one = quantized_sharding(first, axes, rules, mesh)

    def stack(field):
        if getattr(first, field) is None:
            return None
        spec = getattr(one, field).spec
        return jax.device_put(np.stack([np.asarray(getattr(w, field)) for w in per_layer]),
                              NamedSharding(mesh, P("pipeline", *spec)))
    return dataclasses.replace(first, q=stack("q"), scales=stack("scales"), zeros=stack("zeros"),
                               act_scale=stack("act_scale"), act_zero=stack("act_zero"))


def _place(cfg: ModelConfig, dtype, mesh: Mesh, read) -> PipelinedDecoder:
    """read(name) -> numpy value (or QuantizedWeight of numpy leaves) of a Decoder parameter (name as
    in _param_specs). Each device's shard of a float weight is built from the layers it holds only;
    quantized weights are stacked in host memory first."""
    layers_per_stage(cfg, int(mesh.shape["pipeline"]))
    rules = rules_for(cfg, mesh)
    specs = _param_specs(cfg, dtype)
    outer, stacked = {}, {}
    for name, (axes, shape, pdtype) in specs.items():
        if not name.startswith("layers/"):
            value = read(name)
            if isinstance(value, QuantizedWeight):
                outer[name] = jax.device_put(value, quantized_sharding(value, axes, rules, mesh))
            else:
                outer[name] = load_sharded(lambda idx, v=value: v[idx], shape,
                                           param_sharding(axes, rules, mesh, shape), dtype=pdtype)
        elif name.startswith("layers/0/"):
            rel = name[len("layers/0/"):]
            first = read(name)
            if isinstance(first, QuantizedWeight):
                layers = [first] + [read(f"layers/{i}/{rel}") for i in range(1, cfg.n_layers)]
                stacked[rel] = _stack_quantized(rel, layers, axes, rules, mesh)
                continue
            del first                          # float: each device reads its own layers' slices below

            def stage_slice(index, rel=rel):   # index[0]: this device's layers
                return np.stack([np.asarray(read(f"layers/{i}/{rel}"))[index[1:]]
                                 for i in range(*index[0].indices(cfg.n_layers))])
            stacked[rel] = load_sharded(stage_slice, (cfg.n_layers, *shape), _stacked_sharding(mesh, rules, axes, shape),
                                        dtype=pdtype)
    return _assemble(cfg, dtype, mesh, outer, stacked)


def pipeline_decoder(model: Decoder, mesh: Mesh) -> PipelinedDecoder:
    """Restack an in-memory Decoder onto `mesh` (through host memory, one parameter at a time).
    Stages run unfused projections (a fused Decoder is unfused first; see the module docstring).
    Quantized weights (QuantizedWeight) are stacked like float ones, one format per weight."""
    _stages(mesh)
    model = unfuse_decoder(model)
    values = {"/".join(map(str, p)): v.get_value() for p, v in nnx.state(model, nnx.Param).flat_state()}
    dtype = values["embed"].dtype
    cache: dict = {}

    def read(name):   # a QuantizedWeight keeps its format and metadata, its leaves as numpy
        if name not in cache:
            cache[name] = jax.tree.map(np.asarray, values[name])
        return cache[name]
    return _place(model.cfg, dtype, mesh, read)


def load_pipelined(path: str | Path, dtype: str, mesh: Mesh, quantize: str | None = None) -> PipelinedDecoder:
    """An HF folder (read straight into each device's layers) or a native checkpoint (restored to
    host memory, then restacked) -> a PipelinedDecoder on `mesh`. quantize ("int8" | "int4" | "fp8",
    models.decoder.quantize_decoder): the model is loaded and quantized in host memory, then restacked."""
    from jaxinfer.weights import DTYPES, CheckpointError, hf_value, is_native, load_model, tensor_source
    from jaxinfer.models.hf_configs import quantization_config
    from jaxinfer.models.hf_maps import hf_weight_map

    path = Path(path)
    _stages(mesh)
    # jaxinfer/prequant: packed weights, restacked like native ones
    prequantized = (path / "config.json").exists() and quantization_config(json.loads(
        (path / "config.json").read_text())) is not None
    if is_native(path) or quantize is not None or prequantized:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            model, _ = load_model(path, dtype, gguf_blocks=quantize is None)
            if quantize is not None:
                quantize_decoder(model, quantize)
        return pipeline_decoder(model, mesh)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path}: no config.json (expected an HF model folder or a jaxinfer checkpoint)")
    cfg = model_config_from_hf(path)
    layers_per_stage(cfg, int(mesh.shape["pipeline"]))
    st, jdtype = tensor_source(path), DTYPES[dtype]
    wmap = hf_weight_map(cfg, st.has)
    specs = _param_specs(cfg, jdtype)
    read = lambda name: hf_value(st, name, *wmap[name], specs[name][1]).astype(np.float32)  # noqa: E731
    return _place(cfg, jdtype, mesh, read)


# ------------------------------------------------------------------------------------ the runner

def split_microbatches(seqs: list[ScheduledSeq], m: int) -> list[list[ScheduledSeq]]:
    """m groups balanced by tokens (longest first into the lightest group), non-empty groups first,
    each in the scheduler's order."""
    groups: list[list[int]] = [[] for _ in range(m)]
    load = [0] * m
    for i in sorted(range(len(seqs)), key=lambda i: -seqs[i].num_tokens):
        g = min(range(m), key=lambda g: (load[g], len(groups[g])))
        groups[g].append(i)
        load[g] += seqs[i].num_tokens
    groups.sort(key=lambda g: (not g, g[0] if g else 0))
    return [[seqs[i] for i in sorted(g)] for g in groups]


class PipelineRunner(ModelRunner):
    """ModelRunner for a PipelinedDecoder: each step's sequences in `microbatches` micro-batches of
    one shared (T, S, B) bucket, stacked [M, ...]. Warm-up compiles every (T, B) bucket; the number
    of non-empty micro-batches is a traced scalar, so nothing compiles afterwards."""

    def __init__(self, model: PipelinedDecoder, cfg: RunnerConfig, microbatches: int, grammars=None):
        if microbatches < 1:
            raise ValueError(f"pipeline_microbatches must be >= 1, got {microbatches}")
        self.pp, self.lp, self.microbatches = model.pp, model.lp, microbatches
        super().__init__(model, cfg, grammars=grammars)
        # owned by the runner, like ModelRunner.step (step.jit_step says why)
        self.pipeline_step = jax.jit(functools.partial(_pipeline_step, settings=self.settings),
                                     donate_argnames="kv_pages")

    def _init_kv_pages(self, kv_dtype):
        """Lp LayerKV of [pp, Hkv, NB, bs, D]: entry j of pipeline rank p is global layer p * Lp + j."""
        mc, cfg, pp = self.model_cfg, self.cfg, self.pp
        tp = int(self.mesh.shape["tensor"])
        kv_heads_split = tp > 1 and mc.n_kv_heads % tp == 0
        sharding = NamedSharding(self.mesh, P("pipeline", "tensor") if kv_heads_split else P("pipeline"))
        make = lambda: jax.tree.map(lambda a: jnp.broadcast_to(a, (pp, *a.shape)),  # noqa: E731
                                    init_kv_pages(self.lp, mc.n_kv_heads, mc.head_dim, cfg.num_blocks,
                                                  cfg.block_size, kv_dtype, mc.kv_value_dim))
        return sharding, jax.jit(make, out_shardings=sharding)()

    def prepare_microbatches(self, out: SchedulerOutput, tables: dict[str, list[int]]):
        """(StepInputs stacked [M, ...] with every micro-batch padded to the same bucket and the
        sampling rows flattened [M*S], the number of non-empty micro-batches, the rows)."""
        groups = split_microbatches(out.seqs, self.microbatches)
        t = max(self._bucket(max(sum(q.num_tokens for q in g), 1), self.token_buckets) for g in groups)
        b = self._bucket(self.blocks_needed(out.seqs), self.block_buckets)
        parts = [self.prepare(SchedulerOutput(g), tables, buckets=(t, b)) for g in groups]
        return self._stack(parts, sum(1 for g in groups if g))

    def _stack(self, parts: list[tuple[StepInputs, list]], n: int) -> tuple[StepInputs, np.int32, list]:
        xs, rows = [x for x, _ in parts], [r for _, part_rows in parts for r in part_rows]
        tokens, positions, logits_indices = (np.stack([getattr(x, f) for x in xs])
                                             for f in ("tokens", "positions", "logits_indices"))
        meta = jax.tree.map(lambda *a: np.stack(a), *[x.meta for x in xs])
        sb = self._sampling_batch(rows, np.take_along_axis(positions, logits_indices, 1).reshape(-1) + 1)
        inputs = StepInputs(tokens, positions, meta, logits_indices, sb, np.concatenate([x.stop_ids for x in xs]),
                            np.concatenate([x.max_new for x in xs]), np.int32(1), np.stack([x.from_prev for x in xs]))
        return inputs, np.int32(n), rows

    def launch(self, out: SchedulerOutput, tables: dict[str, list[int]], prev: Launched | None = None,
               before_dispatch=None) -> Launched:
        assert prev is None and before_dispatch is None, "the pipeline runs steps one at a time (no async scheduling)"
        self._unfilled = None
        inputs, n, rows = self.prepare_microbatches(out, tables)
        self.fill_masks()
        outputs, self.kv_pages = self.pipeline_step(self.params, self.kv_pages, inputs, n)
        return Launched(out, rows, outputs)

    def warmup(self) -> int:
        buckets = attention_buckets(self.token_buckets, self.block_buckets)
        for t, b in buckets:
            inputs, n, _ = self._stack([self.prepare(SchedulerOutput(), {}, buckets=(t, b))] * self.microbatches, 1)
            outputs, self.kv_pages = self.pipeline_step(self.params, self.kv_pages, inputs, n)
            outputs.ids.block_until_ready()
        return len(buckets)


def _pipeline_step(params, kv_pages, inputs: StepInputs, num_microbatches: jax.Array, settings: StepSettings
                   ) -> tuple[StepOutputs, list[LayerKV]]:
    """The step (jaxinfer/step.py) for a PipelinedDecoder: one iteration over M micro-batches (the stages
    do not loop); PipelineRunner jits it per runner, as step.jit_step does."""
    model = nnx.merge(settings.graphdef, params)
    logits, kv_pages = model(inputs.tokens, inputs.positions, kv_pages, inputs.meta, inputs.logits_indices,
                             impl=settings.attention, num_microbatches=num_microbatches)
    kv_pages = jax.lax.with_sharding_constraint(kv_pages, settings.kv_sharding)
    ids, lps, top_ids, top_lps = sample(logits, inputs.sampling)
    drawn = (inputs.max_new > 0).astype(jnp.int32)
    return StepOutputs(ids[None], lps[None], top_ids[None], top_lps[None], drawn, ids), kv_pages


