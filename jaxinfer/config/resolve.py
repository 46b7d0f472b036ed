"""The settings decided once: resolve_config turns an EngineConfig (as the user gave it) and the
model into a ResolvedConfig (every "auto" and None decided) that the engine, its scheduler and
runner configs, the step and the quantized matmuls read; and the KV pool's sizing from the memory
the engine gathered (PoolInputs). Never imports jax: the caller gathers what needs it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from jaxinfer import perf
from jaxinfer.config.engine import (ATTENTION_CHOICES, DEFAULT_SPECULATIVE_MAX_BATCH,
                                    DEFAULT_SPECULATIVE_MAX_BATCH_ACCELERATOR, MIN_TOKEN_BUDGET, EngineConfig)
from jaxinfer.config.model import ConfigError, ModelConfig


def resolve_dtype_name(dtype: str, backend: str, weight_dtype: str | None = None) -> str:
    """"auto" -> the dtype the weights are in when known, else float32 on CPU (XLA:CPU runs bfloat16
    matmuls about 2x slower than float32) and bfloat16 on accelerators; explicit names stay.
    The one rule for the model dtype: the loaders (weights.resolve_dtype) and resolve_config use it."""
    if dtype != "auto":
        return dtype
    return weight_dtype or ("float32" if backend == "cpu" else "bfloat16")


def resolve_impl_name(requested: str, backend: str) -> str:
    """"auto" -> the Pallas kernels on GPU, XLA elsewhere; "pallas" and "xla" stay."""
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"unknown implementation {requested!r}; use 'pallas', 'xla' or 'auto'")
    if requested == "auto":
        return "pallas" if backend == "gpu" else "xla"
    return requested


def pallas_unsupported(model_cfg: ModelConfig, block_size: int) -> str | None:
    """Why the Pallas (Triton) kernels cannot run this model on a GPU, or None: Triton needs every
    tile dimension a power of two and dot operands of >= 16 along the contracted head_dim
    (pallas_kernels/attention_common.check_triton_shapes; interpret mode on CPU has neither limit)."""
    d = model_cfg.head_dim
    if d < 16 or d & (d - 1):
        return f"head_dim {d} is not a power of two >= 16"
    if block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two"
    return None


@dataclass(frozen=True, kw_only=True)
class PoolInputs:
    """What the KV pool is sized from when num_blocks is None, gathered by the engine (which may
    import jax) before resolve_config: the allocator's memory stats of each process's first device
    (bytes_limit, bytes_in_use: the loaded weights are in use already, so they count once; None or
    no bytes_limit: a host CPU), and what of the model the pool's arithmetic needs besides its
    ModelConfig. resolve_config turns them into the block bytes, the step's activation reserve and
    the pool (perf.size_kv_pool); multi-host, every process takes the smallest pool any of them fits."""
    stats: tuple[dict | None, ...]      # this process's first, then the other processes'
    platform: str                       # the device's platform: cpu | gpu | tpu
    host_ram: int                       # bytes of host RAM (a host pool takes at most a share of it)
    env: dict[str, str] = field(default_factory=dict)   # the allocator's environment (XLA_CLIENT_MEM_FRACTION)
    kv_shards: int = 1                  # devices that split each block (tp when KV heads are sharded, x pp)
    draft: ModelConfig | None = None    # a draft model, whose pages use the same blocks
    activation_dtype_bytes: int = 4     # bytes of one activation element (the loaded weights' dtype)


@dataclass(frozen=True, kw_only=True)
class ResolvedConfig:
    """Every setting the engine, its scheduler and runner configs, the step and the quantized
    matmuls read, with every "auto" and None decided, built once by resolve_config(). Nothing below
    the engine reads an EngineConfig."""
    backend: str                 # jax.default_backend() it was resolved for: cpu | gpu | tpu
    dtype: str                   # float32 | bfloat16 | float16
    kv_dtype: str                # int8 | fp8 | float16 | bfloat16 | float32: the one name the pages are known by
    attention: str               # pallas | xla
    matmul: str                  # pallas | xla: quantized matmuls follow the attention choice
    num_blocks: int              # KV blocks in the pool, the null block 0 included
    block_size: int
    max_model_len: int           # capped so one sequence of it fits in the pool
    max_num_seqs: int
    max_num_batched_tokens: int  # the step's token budget (at least MIN_TOKEN_BUDGET)
    token_buckets: tuple[int, ...]   # the step sizes compiled, ascending, the last the budget
    max_decode_steps: int        # 1 where a step cannot loop on the device (pipeline stages)
    batching: str                # continuous | static | dynamic
    scheduling_policy: str       # fcfs | priority
    batch_window_s: float
    enable_prefix_caching: bool
    async_scheduling: bool       # False for pipeline stages (one step at a time)
    pipeline_microbatches: int | None   # None: one per pipeline stage
    memory_fraction: float
    speculative_method: str | None = None
    spec_tokens: int = 0         # proposals per decoding row (0: no speculative decoding)
    spec_rounds: int = 1         # draft / n-gram: speculation rounds one step may run on the device
    spec_max_batch: int = 0      # the load policy: speculate while at most this many sequences run or wait
    pool: Any = None             # perf.PoolSize: how num_blocks was sized (None: num_blocks was given)
    kv_offload_bytes: int = 0    # the prefix cache's host tier (0: none)
    logprobs_mode: str = "raw_logprobs"   # what a drawn token's logprobs report (sampling.process)

    @property
    def pool_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size


def resolve_config(cfg: EngineConfig, model_cfg: ModelConfig, *, backend: str, weight_dtype: str | None = None,
                   memory: PoolInputs | None = None, pipelined: bool = False) -> ResolvedConfig:
    """The one place settings are decided. backend: jax.default_backend(); weight_dtype: the dtype
    the loaded weights are in (what dtype="auto" means for an engine); memory: what sizes the KV
    pool when cfg.num_blocks is None (PoolInputs, gathered by the caller, which may import jax;
    this function never does). A pool that cannot hold one sequence of max_model_len is a
    ConfigError naming the numbers and the settings that fix it."""
    dtype = resolve_dtype_name(cfg.dtype, backend, weight_dtype)
    kv_dtype = cfg.kv_dtype or dtype
    attention = _resolve_attention(cfg, model_cfg, backend)
    check_state_model(cfg, model_cfg)
    chunk = model_cfg.attention_chunk
    max_model_len = cfg.max_model_len or model_cfg.exact_positions
    longest = model_context(model_cfg)
    if max_model_len > longest:
        raise ConfigError(f"max_model_len {max_model_len} is longer than the model's context ({longest} positions: "
                          f"config.json's max_position_embeddings {model_cfg.max_position_embeddings}"
                          f"{'' if longest == model_cfg.max_position_embeddings else ' times its RoPE scaling factor'})")
    if chunk is not None and max_model_len > chunk:
        raise ConfigError(f"max_model_len {max_model_len} is longer than one attention chunk ({chunk} positions: "
                          f"config.json's attention_chunk_size): jaxinfer does not implement Llama 4's chunked "
                          f"attention, which differs from causal attention past one chunk; use max_model_len <= {chunk}")
    pool = None
    if cfg.num_blocks is not None:
        num_blocks = cfg.num_blocks
    elif memory is not None:
        pool = size_pool(cfg, model_cfg, kv_dtype, max_model_len, memory)
        num_blocks = pool.num_blocks
    else:
        raise ValueError("num_blocks=None needs memory (PoolInputs) to size the KV pool from free memory")
    check_pool_fits(cfg, max_model_len, num_blocks, pool)
    spec_tokens, spec_rounds, spec_max_batch = _speculation(cfg, backend)
    budget = max(cfg.max_num_batched_tokens, MIN_TOKEN_BUDGET)
    return ResolvedConfig(
        backend=backend, dtype=dtype, kv_dtype=kv_dtype, attention=attention, matmul=attention,
        num_blocks=num_blocks, block_size=cfg.block_size, max_model_len=max_model_len, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=budget, token_buckets=resolve_token_buckets(cfg.token_buckets, budget),
        max_decode_steps=1 if pipelined else cfg.max_decode_steps, batching=cfg.batching,
        scheduling_policy=cfg.scheduling_policy, batch_window_s=cfg.batch_window_s,
        enable_prefix_caching=cfg.enable_prefix_caching and not model_cfg.has_state,
        async_scheduling=cfg.async_scheduling and not pipelined, pipeline_microbatches=cfg.pipeline_microbatches,
        memory_fraction=cfg.memory_fraction, speculative_method=cfg.speculative_method, spec_tokens=spec_tokens,
        spec_rounds=spec_rounds, spec_max_batch=spec_max_batch, pool=pool, kv_offload_bytes=cfg.kv_offload_bytes,
        logprobs_mode=cfg.logprobs_mode)


def check_state_model(cfg: EngineConfig, model_cfg: ModelConfig) -> None:
    """A model with conv layers (LFM2), Gated DeltaNet layers (Qwen3-Next, Qwen3.5) or Mamba-2 layers
    (Granite 4.0-H) keeps each
    sequence's state in a slot of its own, which nothing that shares, moves or splits sequences' KV
    carries: its prefix caching is off (resolve_config), and these settings are refused by name."""
    if not model_cfg.has_state:
        return
    kinds = set(model_cfg.layer_kinds)
    layers = "conv layers" if "conv" in kinds else "Gated DeltaNet layers" if "linear" in kinds else "Mamba-2 layers"
    refused = [(name, why) for name, on, why in (
        ("speculative_method", cfg.speculative_method is not None, "rejected proposals would stay in the state"),
        ("kv_offload_gb", bool(cfg.kv_offload_bytes), "the host tier keeps prefix-cache blocks, and prefix caching "
                                                        "is off (a block holds no such state)"),
        ("tensor_parallel", cfg.tensor_parallel > 1, f"the {layers} are not sharded"),
        ("pipeline_parallel", cfg.pipeline_parallel > 1, f"the {layers} are not split into stages"))
        if on]
    if refused:
        name, why = refused[0]
        raise ConfigError(f"{name} is not available for {model_cfg.architecture}, whose {layers} keep a state per "
                          f"sequence: {why}")


def resolve_token_buckets(given: tuple[int, ...] | None, budget: int) -> tuple[int, ...]:
    """The step sizes a runner compiles: the given ones (EngineConfig.token_buckets, sorted) with the
    budget added if missing, since a step of the whole budget must fit one; by default powers of two
    from min(8, budget), then the budget. A size over the budget could never be used: refused."""
    if given is None:
        out, b = [], min(8, budget)
        while b < budget:
            out.append(b)
            b *= 2
        return (*out, budget)
    over = [t for t in given if t > budget]
    if over:
        raise ValueError(f"token_buckets {over} exceed max_num_batched_tokens={budget}: a step never holds more "
                         f"tokens than the budget; drop them or raise max_num_batched_tokens")
    return tuple(given) if given[-1] == budget else (*given, budget)


def _resolve_attention(cfg: EngineConfig, model_cfg: ModelConfig, backend: str) -> str:
    """pallas | xla for this model on this backend: on a GPU "auto" falls back to XLA for shapes the
    Triton kernels cannot take (explicit "pallas": refused). Medusa's tree mask is in both."""
    attention = resolve_impl_name(cfg.attention, backend)
    if cfg.speculative_method == "medusa":
        # the tree mask (kv_cache.AttentionMetadata.tree, in both attentions) compares slot indexes,
        # which differ from a node's position, so ALiBi's distances and sliding windows would be off
        # by the node's place in the tree
        if model_cfg.position == "alibi" or model_cfg.sliding_window is not None:
            raise ValueError('speculative_method="medusa" is not available for models with ALiBi or a sliding window')
    unsupported = pallas_unsupported(model_cfg, cfg.block_size) if attention == "pallas" and backend == "gpu" else None
    if unsupported and cfg.attention == "pallas":
        raise ConfigError(f'attention="pallas" cannot run this model on a GPU: {unsupported}; use attention="xla" '
                          f'(or "auto", which picks it)')
    return "xla" if unsupported else attention


def _speculation(cfg: EngineConfig, backend: str) -> tuple[int, int, int]:
    """(proposals per decoding row, rounds one step may run, the load policy's batch limit); (0, 1, 0)
    without speculative decoding."""
    spec = cfg.num_speculative_tokens if cfg.speculative_method else 0
    max_batch = (cfg.speculative_max_batch if cfg.speculative_max_batch is not None else
                 DEFAULT_SPECULATIVE_MAX_BATCH.get(backend, DEFAULT_SPECULATIVE_MAX_BATCH_ACCELERATOR))
    # a speculative step verifies on the device once: multi-step decoding is for engines without it
    # while every row speculates with proposals made on the device, a step runs several rounds: as many
    # as multi-step decoding runs forwards for n-gram (one target forward a round), half as many for
    # the draft method (whose rounds also run k + 1 draft forwards); Medusa as n-gram (one tree-masked
    # target forward a round; the heads propose the next round's tree on the device).
    # bench/speculative.py, n-gram at batch 1: 4 rounds 1.51x, 8 rounds 1.81x, 16 rounds 1.90x (the
    # host's work between steps is not overlapped: a step's length depends on what it accepts)
    rounds = {"draft": -(-cfg.max_decode_steps // 2), "ngram": cfg.max_decode_steps,
              "medusa": cfg.max_decode_steps}.get(cfg.speculative_method, 1)
    return spec, rounds, max_batch if spec else 0


def model_context(model_cfg: ModelConfig) -> int:
    """The longest context the model has positions for, as vLLM derives it: max_position_embeddings,
    or more under a RoPE scaling whose config keeps the unscaled length there: linear's factor times
    it, YaRN's factor times its original_max_position_embeddings (Llama 3's and LongRoPE's configs
    give the scaled length). A learned position table has no more rows."""
    n = model_cfg.max_position_embeddings
    s = model_cfg.rope_scaling if model_cfg.position == "rope" else None
    if s is not None and s.kind == "linear":
        return max(n, int(n * s.factor))
    if s is not None and s.kind == "yarn":
        return max(n, int(s.original_max_position_embeddings * s.factor))
    return n


def size_pool(cfg: EngineConfig, model_cfg: ModelConfig, kv_dtype: str, max_model_len: int,
              memory: PoolInputs) -> perf.PoolSize:
    """The KV pool of num_blocks=None (perf.size_kv_pool) from the gathered memory: on an
    accelerator, memory_fraction of its memory less what is in use and the step's activations
    (perf.step_activation_bytes at the token budget and every row's logits); on a host CPU, what
    max_num_seqs sequences of max_model_len need, capped at a share of RAM. Multi-host: this
    process's pool with the fewest blocks any process fits (one global array)."""
    mc, bs = model_cfg, cfg.block_size
    block_bytes = bs * perf.kv_bytes_per_token(mc.n_attn_layers, mc.n_kv_heads, mc.head_dim, kv_dtype,
                                            mc.kv_value_dim) // memory.kv_shards
    if memory.draft is not None:   # a draft model's pages use the same blocks
        d = memory.draft
        block_bytes += bs * perf.kv_bytes_per_token(d.n_layers, d.n_kv_heads, d.head_dim, kv_dtype, d.kv_value_dim)
    spec_rows = 1 + (cfg.num_speculative_tokens if cfg.speculative_method else 0)
    reserve = perf.step_activation_bytes(
        tokens=max(cfg.max_num_batched_tokens, MIN_TOKEN_BUDGET), rows=cfg.max_num_seqs * spec_rows,
        d_model=mc.d_model,
        # a mixture of experts holds each token's k experts' hidden states at once
        ffn_dim=max(mc.ffn_dim, mc.num_experts_per_tok * (mc.moe_ffn_dim or mc.ffn_dim) if mc.num_experts else 0),
        n_heads=mc.n_heads, head_dim=mc.head_dim, vocab_size=mc.vocab_size, dtype_bytes=memory.activation_dtype_bytes)
    # the state layers' states (conv, Gated DeltaNet): a slot per sequence, and the unused slot 0
    reserve += (cfg.max_num_seqs + 1) * mc.state_bytes_per_slot(memory.activation_dtype_bytes)
    # and a Gated DeltaNet layer's step: its rows' float32 matrices gathered, then updated (two copies)
    reserve += 2 * (cfg.max_num_seqs + 1) * mc.linear_matrix_bytes
    pools = [perf.size_kv_pool(block_bytes=block_bytes, memory_fraction=cfg.memory_fraction, stats=stats,
                               platform=memory.platform, env=memory.env, reserve=reserve, host_ram=memory.host_ram,
                               wanted_blocks=cfg.max_num_seqs * math.ceil(max_model_len / bs) + 1)
             for stats in memory.stats]
    return dataclasses.replace(pools[0], num_blocks=min(p.num_blocks for p in pools))


def check_pool_fits(cfg: EngineConfig, max_model_len: int, num_blocks: int, pool: perf.PoolSize | None) -> None:
    """One sequence of max_model_len must fit in the pool (block 0 is the null block): otherwise an
    error naming the numbers and the settings that fix it, as vLLM refuses to start, rather than a
    context silently shortened to what the pool holds. pool: how num_blocks was sized (None: given)."""
    pool_tokens = (num_blocks - 1) * cfg.block_size
    if max_model_len <= pool_tokens:
        return
    need = -(-max_model_len // cfg.block_size) + 1
    was = "max_model_len" if cfg.max_model_len else "max_model_len (the model's max_position_embeddings)"
    if pool is None:
        raise ConfigError(
            f"the KV cache cannot hold one sequence of {was} = {max_model_len} tokens: num_blocks={num_blocks} "
            f"holds {pool_tokens} tokens ({num_blocks - 1} blocks of {cfg.block_size}; block 0 is reserved). "
            f"Set num_blocks to at least {need}, or max_model_len to at most {pool_tokens}, or leave num_blocks "
            f"unset to size the pool from memory_fraction of the device's memory")
    fixes = [f"lower max_model_len to at most {pool_tokens}"]
    if pool.on_device:
        more = pool.in_use + pool.reserve + need * pool.block_bytes
        fixes.append(f"raise memory_fraction (--gpu-memory-utilization) to at least {more / pool.device_bytes:.3f}"
                     if more <= pool.device_bytes else "use a device with more memory (or quantize the weights)")
        if pool.allocator_bound:
            fixes[-1] += " and XLA_CLIENT_MEM_FRACTION with it (JAX's allocator cap)"
    fixes.append(f"set num_blocks to at least {need}")
    raise ConfigError(
        f"the KV cache cannot hold one sequence of {was} = {max_model_len} tokens: {pool.describe()}: "
        f"{num_blocks - 1} usable blocks of {cfg.block_size} tokens = {pool_tokens} tokens. To fix it, "
        + ", or ".join(fixes))
