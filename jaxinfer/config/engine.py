"""The serving engine's settings as the user gives them: EngineConfig, one field per setting, its
default and help written beside it once. Generator.from_pretrained's keywords and the CLI's engine
flags (jaxinfer/config/flags.py) are derived from these fields, so a new setting is one field here
plus its use. The values each setting takes are listed once (the *_CHOICES constants), for
EngineConfig's checks and the flags' choices. Never imports jax.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

# None, where a setting's default is None, is allowed too (the flag left out).
DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")
ATTENTION_CHOICES = ("pallas", "xla", "auto")
QUANTIZE_CHOICES = ("int8", "int4", "fp8")
KV_DTYPE_CHOICES = ("int8", "fp8", "float16", "bfloat16", "float32")
BATCHING_CHOICES = ("continuous", "static", "dynamic")
SCHEDULING_POLICIES = ("fcfs", "priority")
SPECULATIVE_METHODS = ("draft", "ngram", "medusa")
POOLING_CHOICES = ("last", "mean", "cls")   # jaxinfer/host/pooling.py
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")   # sampling.py
# The smallest per-step token budget: the runner's first token bucket holds up to 8 tokens.
MIN_TOKEN_BUDGET = 8
MAX_SPECULATIVE_TOKENS = 16
# The load policy's default per backend (resolve_config): speculate while at most this many sequences
# run or wait. CPU: 1: with speculation forced on, bench/speculative.py on the bundled model runs
# 2 or more sequences slower than without it (README's table): XLA:CPU's matmuls are compute-bound
# once a step holds a few rows, so verifying 1 + k tokens a row costs nearly 1 + k tokens.
# Accelerators: 8, not yet measured on a GPU: a decode step stays bound by reading the weights until
# it holds about as many tokens as the chip does FLOPs per byte read (~300 on an H100 in bfloat16),
# so 8 rows x 5 verified tokens should cost little more than 8.
DEFAULT_SPECULATIVE_MAX_BATCH = {"cpu": 1}
DEFAULT_SPECULATIVE_MAX_BATCH_ACCELERATOR = 8


def setting(default: Any, help: str, *, choices: tuple | None = None, flags: tuple[str, ...] | None = None,
            alias: tuple[str, int] | None = None) -> Any:
    """An EngineConfig field that is a user-facing setting: its default, its help (the CLI flag's and
    from_pretrained's), the values it takes (None added where the default is None) and, where they
    are not `--field-name` (or `--no-field-name` for a setting on by default), its flags' names.
    alias: (name, scale): users give the setting in a larger unit under that name (a from_pretrained
    keyword and, unless flags says otherwise, the flag --name): the field holds value * scale."""
    metadata = {"help": help}
    if alias is not None:
        metadata["alias"] = alias
    if choices is not None:
        metadata["choices"] = choices
    if flags is not None:
        metadata["flags"] = flags
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The serving engine's settings (see DESIGN.md), as the user gave them; resolve_config decides
    every "auto" and None once (ResolvedConfig), and the engine reads that."""
    dtype: str = setting("auto", "auto: float32 on CPU (XLA:CPU runs bfloat16 matmuls about 2x slower), "
                                 "else bfloat16", choices=DTYPE_CHOICES)
    attention: str = setting("auto", "the attention (and quantized matmul) implementation: auto is the Pallas "
                                     "kernels on GPU, XLA elsewhere", choices=ATTENTION_CHOICES)
    quantize: str | None = setting(None, "weight quantization at load time: weight-only (fp8 on GPU also scales "
                                         "activations to e4m3 per token)", choices=QUANTIZE_CHOICES)
    kv_dtype: str | None = setting(None, "KV cache dtype (default: the model's dtype; fp8 is e4m3)",
                                   choices=KV_DTYPE_CHOICES)
    tensor_parallel: int = setting(1, "devices to shard over (multi-host: all devices of all processes)")
    pipeline_parallel: int = setting(1, "pipeline stages the layers are split over (one process)")
    pipeline_microbatches: int | None = setting(None, "micro-batches per step with pipeline_parallel > 1 "
                                                      "(default: one per stage)")
    max_num_seqs: int = setting(64, "sequences running at once at most")
    max_num_batched_tokens: int = setting(512, f"tokens one step computes at most (at least {MIN_TOKEN_BUDGET})")
    token_buckets: tuple[int, ...] | None = setting(
        None, "the step sizes in tokens compiled at warm-up, each step padded to the smallest that holds it "
              "(default: powers of two from 8 to max_num_batched_tokens, which is always one): fewer compile "
              "sooner, more pad less (vLLM's cudagraph_capture_sizes)")
    block_size: int = setting(16, "tokens per KV cache block")
    num_blocks: int | None = setting(None, "KV blocks in the pool (default: sized from --gpu-memory-utilization "
                                           "of the device's memory)")
    memory_fraction: float = setting(
        0.9, "the fraction of the accelerator's memory the engine may hold: weights, KV pool and activations "
             "(default 0.9; vLLM's gpu_memory_utilization); also JAX's allocator cap unless "
             "XLA_CLIENT_MEM_FRACTION is set", flags=("--gpu-memory-utilization", "--memory-fraction"))
    batching: str = setting("continuous", "continuous: every step admits waiting requests; static: a batch runs "
                                          "to completion before the next; dynamic: static batches of what "
                                          "arrived within batch_window_s", choices=BATCHING_CHOICES)
    scheduling_policy: str = setting("fcfs", "the order requests are admitted in (and preempted in reverse): fcfs: "
                                             "arrival order; priority: a request's lower priority value first, "
                                             "then arrival (vLLM's)", choices=SCHEDULING_POLICIES)
    batch_window_s: float = setting(0.05, "dynamic batching: how long the oldest waiting request may wait (s)")
    max_model_len: int | None = setting(None, "the longest sequence, prompt and output (default: the model's "
                                              "max_position_embeddings)")
    max_decode_steps: int = setting(8, "decode iterations one step may run on device when every sequence "
                                       "decodes (1 while requests wait or prefill runs)")
    async_scheduling: bool = setting(True, "plan and dispatch each step before the previous one's tokens reach "
                                           "the host (off: wait for each step's tokens before planning the next)")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of cached prompt prefixes (off: recompute "
                                                "every prompt)", flags=("--no-prefix-caching",))
    speculative_method: str | None = setting(
        None, "speculative decoding: a draft model, n-gram prompt lookup, or Medusa heads with a candidate tree "
              "(exact: the output distribution is the model's)", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = setting(4, "proposals per sequence and step (medusa: the tree's depth, at most "
                                             "the heads)")
    speculative_max_batch: int | None = setting(None, "speculate while at most this many sequences run or wait "
                                                      "(default: the measured crossover)")
    lora_modules: dict[str, str] | None = setting(
        None, "LoRA adapters (PEFT folders) to serve by name: {name: path} (CLI: NAME=PATH ...); a request "
              "picks one by name (lora= / the request's model), more may be loaded and unloaded while serving")
    max_loras: int = setting(4, "LoRA adapters one step may mix (device slots; more may be registered: "
                                "least recently used slots are reused)")
    max_lora_rank: int = setting(16, "the largest LoRA rank an adapter may have (smaller ranks are zero-padded)")
    kv_offload_bytes: int = setting(
        0, "host memory for the prefix cache's second tier, in GiB (2**30 bytes): cached KV blocks evicted "
           "from the device pool are kept there and copied back on a hit (0: no host tier)",
        alias=("kv_offload_gb", 2**30), flags=("--kv-offload-gb", "--kv-offloading-size"))   # and vLLM's name
    pooling: str | None = setting(None, "embeddings: pool the final hidden states by the last token, their mean or "
                                        "the first token (default: a sentence-transformers folder's "
                                        "1_Pooling; a plain causal-LM folder embeds only with this set)",
                                  choices=POOLING_CHOICES)
    normalize: bool = setting(False, "embeddings: L2-normalize them (default: as a sentence-transformers folder "
                                     "says, by a listed Normalize module)")
    logprobs_mode: str = setting(
        "raw_logprobs", "what logprobs report (vLLM's --logprobs-mode): raw_logprobs, the model's own distribution "
                        "(before logit_bias, bans, penalties, temperature and truncation); processed_logprobs, "
                        "the one drawn from (after all of them, truncated tokens -inf); *_logits: the logits "
                        "instead", choices=LOGPROBS_MODES)
    generation_config: str = setting(
        "auto", "where requests' default sampling parameters come from (vLLM's --generation-config): auto, the "
                "model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                "max_new_tokens as max_tokens, where set); vllm, the neutral defaults; or a folder holding one")
    override_generation_config: str | None = setting(
        None, "a JSON object merged over those defaults (vLLM's --override-generation-config), e.g. "
              "{\"temperature\": 0.5}; from_pretrained also takes a dict")
    hf_overrides: str | None = setting(
        None, "a JSON object merged into the checkpoint's config.json before anything reads it (vLLM's "
              "--hf-overrides; from_pretrained also takes a dict), e.g. a causal-LM reranker as a "
              "classifier: {\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
              "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}", flags=("--hf-overrides", "--hf_overrides"))
    tokenizer: str | None = setting(
        None, "the tokenizer to use instead of the model's own (vLLM's --tokenizer): a folder, a .gguf file, or "
              "a Hugging Face id ORG/NAME[@REVISION], of which only the tokenizer's files and chat template are "
              "fetched; e.g. a GGUF file's base model")
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for f in settings():
            allowed = f.metadata.get("choices")
            allowed = allowed if allowed is None or f.default is not None else (None, *allowed)
            if allowed is not None and getattr(self, f.name) not in allowed:
                raise ValueError(f"{f.name}={getattr(self, f.name)!r} is not one of {allowed}")
        if not (isinstance(self.memory_fraction, (int, float)) and 0 < self.memory_fraction <= 1):
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if self.pipeline_microbatches is not None and self.pipeline_microbatches < 1:
            raise ValueError(f"pipeline_microbatches must be >= 1, got {self.pipeline_microbatches}")
        object.__setattr__(self, "lora_modules", lora_modules(self.lora_modules))
        object.__setattr__(self, "hf_overrides", json_object("hf_overrides", self.hf_overrides))
        object.__setattr__(self, "override_generation_config",
                           json_object("override_generation_config", self.override_generation_config))
        if self.token_buckets is not None:
            object.__setattr__(self, "token_buckets", token_buckets(self.token_buckets))
        for name in ("tensor_parallel", "pipeline_parallel", "max_num_seqs", "block_size", "max_decode_steps",
                     "num_speculative_tokens", "max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.speculative_max_batch is not None and self.speculative_max_batch < 0:
            raise ValueError(f"speculative_max_batch must be >= 0, got {self.speculative_max_batch}")
        if not (isinstance(self.kv_offload_bytes, int) and self.kv_offload_bytes >= 0):
            raise ValueError(f"kv_offload_bytes must be an integer >= 0, got {self.kv_offload_bytes!r}")
        if self.kv_offload_bytes and not self.enable_prefix_caching:
            raise ValueError("kv_offload_gb keeps evicted prefix-cache blocks: it needs enable_prefix_caching")
        if self.kv_offload_bytes and self.pipeline_parallel > 1:
            raise ValueError("kv_offload_gb (the host tier) is not available with pipeline_parallel > 1")
        if self.speculative_method is not None and self.pipeline_parallel > 1:
            # (tensor_parallel works: the draft model and Medusa heads are replicated on the mesh)
            raise ValueError("speculative decoding is not available with pipeline_parallel > 1")


def token_buckets(given) -> tuple[int, ...]:
    """token_buckets as a sorted tuple of distinct integers >= 1 (from any iterable of them; the CLI's
    are already ints). Whether they fit the token budget is resolve_config's question."""
    if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__"):
        raise ValueError(f"token_buckets must be a list of integers >= 1, got {given!r}")
    values = list(given)
    bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1), None)
    if bad is not None or not values:
        raise ValueError(f"token_buckets must be a non-empty list of integers >= 1, got {given!r}"
                         + (f" ({bad!r})" if bad is not None else ""))
    return tuple(sorted(set(values)))


def json_object(name: str, given) -> str | None:
    """A setting that is a JSON object (hf_overrides, override_generation_config) as canonical JSON
    text (sorted keys, so that the settings stay hashable and compare equal), from a dict or JSON
    text; anything but a JSON object is a ValueError naming the setting."""
    if given is None:
        return None
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(given, dict):
        raise ValueError(f"{name} must be a JSON object, got {given!r}")
    return json.dumps(given, sort_keys=True) if given else None


def lora_modules(given) -> tuple[tuple[str, str], ...] | None:
    """lora_modules as (name, path) pairs, from a {name: path} mapping or "NAME=PATH" strings (the CLI's);
    kept as a tuple so that the settings stay hashable."""
    if given is None:
        return None
    if isinstance(given, dict):
        pairs = [(str(k), str(v)) for k, v in given.items()]
    else:
        pairs = []
        for item in given:
            if isinstance(item, str):
                name, sep, path = item.partition("=")
                if not sep or not name or not path:
                    raise ValueError(f"lora_modules: {item!r} is not NAME=PATH")
                pairs.append((name, path))
            elif isinstance(item, (tuple, list)) and len(item) == 2:
                pairs.append((str(item[0]), str(item[1])))
            else:
                raise ValueError(f"lora_modules: {item!r} is not NAME=PATH")
    names = [n for n, _ in pairs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"lora_modules: the name {dup!r} is given twice")
    return tuple(pairs)


def settings() -> tuple:
    """EngineConfig's settings (dataclasses.Field each, in declaration order): the fields with help."""
    return tuple(f for f in fields(EngineConfig) if "help" in f.metadata)


def engine_config(caller: str, given: dict[str, Any]) -> EngineConfig:
    """An EngineConfig of the settings a caller took as keywords (Generator.from_pretrained's
    **settings): a name that is not a setting is a TypeError naming it, as Python's own would."""
    given = dict(given)
    for f in settings():
        if "alias" in f.metadata and f.metadata["alias"][0] in given:
            alias, scale = f.metadata["alias"]
            if f.name in given and given[alias] is not None:
                raise TypeError(f"{caller}() got both {alias!r} and {f.name!r}: give one")
            value = given.pop(alias)
            if value is None:           # the keyword's default: the field's
                continue
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{alias} must be a number >= 0, got {value!r}")
            given[f.name] = int(round(value * scale))
    names = {f.name for f in settings()} | {f.metadata["alias"][0] for f in settings() if "alias" in f.metadata}
    unknown = [k for k in given if k not in names]
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r} (the engine's settings: "
                        f"{', '.join(sorted(names))})")
    return EngineConfig(**given)
