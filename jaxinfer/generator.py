"""Generator: the public Python API (DESIGN.md, "The public surface").

    gen = Generator.from_pretrained(path)          # HF folder or native checkpoint; None = bundled model
    gen.generate(["prompt", [1, 2, 3]], SamplingParams(max_tokens=32))
    for delta in gen.stream("prompt", params): ...
    gen.logits([1, 2, 3])                           # float32 [T, vocab], one full forward, no cache

It owns one Engine and the one EngineClient (jaxinfer.client) that drives it. Calls from several
threads are safe: each engine step runs under the client's lock and its results are dispatched to
per-request queues, so all callers' requests share every step.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import inspect
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import EngineConfig, SamplingParams
from jaxinfer.config.engine import engine_config, settings as engine_settings
from jaxinfer.host.beam_search import BeamSearchParams
from jaxinfer.hub import ModelSpecError, apply_hf_overrides, resolve_model_path, resolve_tokenizer_path
from jaxinfer.errors import FieldError
from jaxinfer.fim import fills_in, fim_prompt, with_fim_stops
from jaxinfer.tokenizer import cut_ids
from jaxinfer.classify import Classifier, read_classifier
from jaxinfer.client import Completion, EngineClient, SubmitError
from jaxinfer.embedding import EmbeddingSpec, pair_cosines, read_embedding_spec, score_pairs
from jaxinfer.generation_defaults import max_tokens_cap, sampling_defaults
from jaxinfer.engine import Engine
from jaxinfer.lora.execute import LoraInputs
from jaxinfer.spec_decode.medusa import is_medusa, load_heads
from jaxinfer.tokenizer import Tokenizer, load_tokenizer
from jaxinfer.models.decoder import fuse_decoder, quantize_decoder
from jaxinfer.weights import is_native, resolve_dtype, load_model, tensor_source
from jaxinfer.weight_update import checkpoint_name

DEFAULT_MODEL = "jaxinfer-tiny-llama"
DEFAULT_DRAFT = "jaxinfer-tiny-llama-draft"   # the bundled model's draft (speculative_method="draft")
DEFAULT_MEDUSA = "jaxinfer-tiny-llama-medusa"  # ... and its Medusa heads (speculative_method="medusa")
CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"


def default_model_path() -> Path:
    """The bundled target model (override with $JAXINFER_MODEL)."""
    return Path(os.environ.get("JAXINFER_MODEL", CHECKPOINTS / DEFAULT_MODEL))


@dataclass
class GenerationOutput:
    """One prompt's result; `samples` has n completions, the attributes mirror the first."""
    request_id: str
    prompt_token_ids: list[int]
    samples: list[Completion]
    num_cached_tokens: int = 0      # prompt tokens whose KV came from the prefix cache

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.samples[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        """The stop string or stop token id that ended it (vLLM's; None: EOS, max_tokens)."""
        return self.samples[0].stop_reason

    @property
    def logprobs(self) -> list[float]:
        return self.samples[0].logprobs

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]]:
        return self.samples[0].top_logprobs

    @property
    def prompt_logprobs(self) -> list | None:
        """SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
        (its logprob, its rank, [(token id, logprob)] top-N); None when not asked for."""
        return self.samples[0].prompt_logprobs


@dataclass
class StreamDelta:
    text: str
    token_ids: list[int]
    sample_index: int = 0
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def load_draft(path: Path, dtype: str):
    """A draft model for speculative decoding (fused like every unsharded engine model). A tied
    LM head gets its own [d, vocab] copy of the embedding: the draft's head runs k times per round
    and XLA:CPU re-lays out the transposed embedding on every call (bench/speculative.py)."""
    model = fuse_decoder(load_model(path, dtype)[0], 1, consume=True)
    if model.lm_head is None:
        model.lm_head = nnx.data(nnx.Param(jnp.asarray(model.embed.get_value().T), logical_axes=("embed", "vocab")))
    return model


def draft_model_path(target: Path, method: str | None, draft: str | Path | None) -> Path | None:
    """The draft model's (method "draft") or Medusa heads' (method "medusa") folder: speculative_model,
    or the bundled one for the bundled model. A draft's tokenizer must be the target's (same files)."""
    if method not in ("draft", "medusa"):
        if draft is not None:
            raise ValueError(f'speculative_model is only used with speculative_method="draft" or "medusa", not {method!r}')
        return None
    what = "a draft" if method == "draft" else "Medusa heads"
    if draft is None:
        if target.resolve() != (CHECKPOINTS / DEFAULT_MODEL).resolve():
            raise ValueError(f'speculative_method="{method}" needs speculative_model=PATH ({what} are bundled only '
                             f"for {DEFAULT_MODEL})".replace("a draft are", "a draft is"))
        draft = CHECKPOINTS / (DEFAULT_DRAFT if method == "draft" else DEFAULT_MEDUSA)
    draft = Path(draft)
    if method == "medusa":
        if not is_medusa(draft):
            raise ValueError(f"speculative_model {str(draft)!r} is not a Medusa heads folder (no medusa.json)")
        return draft
    if not (draft / "config.json").exists():
        raise ValueError(f"speculative_model {str(draft)!r} is not a model folder (no config.json)")
    for name in ("tokenizer.json", "tokenizer.model"):
        mine, theirs = target / name, draft / name
        if mine.exists() != theirs.exists() or (mine.exists() and mine.read_bytes() != theirs.read_bytes()):
            raise ValueError(f"the draft model {str(draft)!r} does not share the target's tokenizer ({name} differs)")
    return draft


def _with_settings(func):
    """func's signature and docstring with every EngineConfig setting as a keyword-only parameter
    after path, at EngineConfig's default (help() and inspect.signature list them; func takes them
    as **settings)."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    own = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
           for f in engine_settings()]
    # a setting given in a larger unit (kv_offload_gb for kv_offload_bytes): None, the field's default
    own += [inspect.Parameter(f.metadata["alias"][0], inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation="float | None") for f in engine_settings() if "alias" in f.metadata]
    func.__signature__ = sig.replace(parameters=[*params[:2], *own, *params[2:]])   # after (cls, path)
    func.__doc__ += "\n\n        The engine's settings (EngineConfig):\n" + "".join(
        (f"          {f.metadata['alias'][0]} (EngineConfig.{f.name}): {f.metadata['help']}\n" if "alias" in f.metadata
         else f"          {f.name}={f.default!r}: {f.metadata['help']}\n") for f in engine_settings())
    return func


class Generator:
    def __init__(self, model, tokenizer: Tokenizer | None, cfg: EngineConfig, max_num_batched_tokens: int | None = None,
                 warmup: bool = True, draft_model=None, medusa_heads=None, channel=None,
                 embedding: EmbeddingSpec | None = None, classifier: Classifier | None = None,
                 sampling_defaults: dict | None = None, recipe: _Recipe | None = None):
        """max_num_batched_tokens: when given, replaces cfg's (EngineConfig.max_num_batched_tokens).
        channel: multi-host, the jaxinfer.distributed.StepChannel of this process's group
        (from_pretrained makes it): process 0 publishes every step and gen.logits call on it, the
        others follow() them; async scheduling is then off (followers need every input token).
        embedding: how the model embeds (gen.embed; jaxinfer.embedding), None: it does not.
        classifier: a sequence-classification checkpoint's head (gen.classify; jaxinfer.classify),
        its decoder embedding by the last token.
        sampling_defaults: the model's default sampling parameters (jaxinfer.generation_defaults;
        from_pretrained reads them): gen.default_sampling_params(), and the server's for every
        field a request leaves out. recipe: how from_pretrained read the weights (update_weights and
        sleep(level=2) read new ones the same way; None: a Generator built around a model object)."""
        from jaxinfer.compilation_cache import enable_compilation_cache
        from pallas_kernels.autotune import log_budget_summary

        enable_compilation_cache()   # every front door: the step programs load from disk next time
        if max_num_batched_tokens is not None:
            cfg = dataclasses.replace(cfg, max_num_batched_tokens=max_num_batched_tokens)
        if channel is not None:
            cfg = dataclasses.replace(cfg, async_scheduling=False)
        self.model_cfg = model.cfg
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.embedding = embedding
        self.classifier = classifier
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_tokens_cap = max_tokens_cap(cfg.generation_config, _override(cfg), self.sampling_defaults)
        self._channel = channel
        self._recipe = recipe
        publish = None
        if channel is not None and channel.group.is_leader:   # every step's host inputs go to the others first
            from jaxinfer.distributed import step_arrays
            publish = lambda inputs: channel.publish("step", step_arrays(inputs))  # noqa: E731
        self.engine = Engine(model, tokenizer, cfg, draft_model=draft_model, medusa_heads=medusa_heads,
                             publish_step=publish, generates=embedding is None or embedding.generates)
        self.client = EngineClient(self.engine)
        # _params: what multi-host processes run gen.logits on (one process reads the served params
        # through the client instead: update_weights and sleep replace them)
        self._forward, self._params = _full_forward(model, self.client.resolved.attention, channel is not None)
        if warmup:
            self.client.warmup()
            log_budget_summary()     # warm-up traced every step shape: kernels left untuned are known

    @classmethod
    @_with_settings
    def from_pretrained(cls, path: str | Path | None = None, *, revision: str | None = None,
                        speculative_model: str | Path | None = None,
                        warmup: bool = True, coordinator_address: str | None = None, num_processes: int | None = None,
                        process_id: int | None = None, **settings) -> Generator:
        """A Generator over the model at path (an HF folder, a native checkpoint or a .gguf file; None:
        the bundled model; a Hugging Face id "ORG/NAME" or "ORG/NAME@REVISION", or revision=: its
        snapshot in the Hugging Face cache, downloaded unless HF_HUB_OFFLINE=1; "ORG/NAME:QUANT": that
        quantization's .gguf in a GGUF repository; a local path of that name wins, see jaxinfer/hub.py;
        tokenizer=: another folder's, file's or id's tokenizer and chat template). Every other keyword but these is an EngineConfig setting, with EngineConfig's default
        (listed below and in inspect.signature; an unknown name is a TypeError).
        speculative_model: the draft model (speculative_method="draft", same tokenizer) or Medusa heads
        (scripts/train_medusa.py) to load; the bundled model's are the default for it.
        warmup: compile every step shape now (serving then compiles nothing).
        Multi-host: coordinator_address ("host:port" of process 0), num_processes and process_id
        (or $JAXINFER_COORDINATOR_ADDRESS, $JAXINFER_NUM_PROCESSES, $JAXINFER_PROCESS_ID), the same
        settings in every process, tensor_parallel over the devices of all processes. Process 0
        takes the requests; every other process calls follow() (jaxinfer.distributed).
        A KV pool that cannot hold one sequence of max_model_len is a ConfigError naming what to change;
        reset_prefix_cache() forgets the cached prefix blocks of enable_prefix_caching."""
        cfg = engine_config("from_pretrained", settings)
        if path is None and revision is not None:
            raise ModelSpecError(f"revision={revision!r} applies to Hugging Face ids; no model was given "
                                 "(the bundled model has no revisions)")
        path = resolve_model_path(path, revision) if path is not None else default_model_path()
        if cfg.hf_overrides is not None:
            path = apply_hf_overrides(path, json.loads(cfg.hf_overrides))
        tok_path = resolve_tokenizer_path(cfg.tokenizer) if cfg.tokenizer is not None else None
        _check_state_settings(path, cfg)
        draft_path = draft_model_path(path, cfg.speculative_method, speculative_model)
        from jaxinfer import distributed   # joins before any other jax call (jax's rule)
        group = distributed.initialize(coordinator_address, num_processes, process_id)
        # the model's dtype, decided once by config.resolve_dtype_name's rule (after initialize: it asks
        # jax for the backend); the loaders and the engine all read this explicit name
        cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype))
        if cfg.pipeline_parallel > 1:
            if group is not None:
                raise ValueError("pipeline_parallel > 1 is not available across several processes (multi-host)")
            spec = read_embedding_spec(path, cfg.pooling, cfg.normalize)
            if spec is not None and (cfg.pooling is not None or Path(spec.model_path) != Path(path)):
                raise ValueError("embeddings (pooling=, a sentence-transformers folder) are not available with "
                                 "pipeline_parallel > 1")
            model = _load_pipelined(path, cfg)
            return cls(model, _tokenizer(tok_path or path, cfg, model.cfg.vocab_size), cfg, None, warmup,
                       sampling_defaults=_sampling_defaults(path, cfg), recipe=_Recipe(path, cfg, None, pipelined=True))
        mesh = None
        if cfg.tensor_parallel > 1:
            from jaxinfer.sharding import make_mesh
            mesh = make_mesh(tensor_parallel=cfg.tensor_parallel)   # clear error if too few devices
        channel = None if group is None else _join_group(group, mesh, path, cfg, warmup)
        classifier = None if is_native(path) else read_classifier(path, lambda name: tensor_source(path).get(name),
                                                                  load_tokenizer(tok_path or path))
        if classifier is not None:   # transformers' head reads the last token's final-norm state
            if cfg.pooling not in (None, "last") or cfg.normalize:
                raise ValueError(f"{path} is a sequence-classification model: it pools the last token, "
                                 "not normalized (pooling= and normalize= cannot change that)")
            cfg = dataclasses.replace(cfg, pooling="last")
        embedding, model_cfg = _embedding_spec(path, cfg)
        if embedding is not None:   # a sentence-transformers folder's Transformer may lie in a subfolder
            path = embedding.model_path
        model = _load_decoder(path, cfg, mesh, fuse=group is None, model_cfg=model_cfg)
        if draft_path is not None and group is not None:
            raise ValueError("speculative decoding is not available across several processes (multi-host)")
        draft, heads = _load_speculative(draft_path, cfg.speculative_method, model, cfg.dtype)
        return cls(model, _tokenizer(tok_path or path, cfg, model.cfg.vocab_size), cfg, None, warmup,
                   draft_model=draft, medusa_heads=heads,
                   channel=channel, embedding=embedding, classifier=classifier,
                   sampling_defaults=_sampling_defaults(path, cfg), recipe=_Recipe(path, cfg, model_cfg, pipelined=False))

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's LLM.get_default_sampling_params: SamplingParams with the model's recommended
        values (generation_config.json, as generation_config / override_generation_config say),
        what generate() and stream() use when given no params."""
        return SamplingParams(**self.sampling_defaults)

    # ---------------------------------------------------------------- inputs
    def _encode(self, prompt: str | Sequence[int], truncate: int | None = None, side: str = "right",
                add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (no tokenizer.json or tokenizer.model in its "
                                 "folder): pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt, add_special_tokens, truncate=truncate, side=side)
        ids = list(prompt)
        if not all(isinstance(t, (int, np.integer)) for t in ids):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        return [int(t) for t in ids]

    def _fim(self, prefix: str | Sequence[int], suffix: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("suffix needs the model's tokenizer, which this model lacks")
        ids = prefix if isinstance(prefix, str) else self._encode(prefix)
        return fim_prompt(self.tokenizer, ids, suffix)

    # ---------------------------------------------------------------- public API
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None, priority: int | Sequence[int] = 0,
                 lora: str | None | Sequence[str | None] = None, suffix: str | None = None) -> list[GenerationOutput]:
        """cache_salt: these prompts share cached prefix blocks only with requests of the same salt.
        priority: lower runs first (one for all prompts or one per prompt); a priority other than 0
        needs scheduling_policy="priority" (vLLM's rule).
        lora: a loaded LoRA adapter's name for every prompt, or a list with one per prompt (None: the
        base model); rows with different adapters share every step.
        suffix: fill in the middle (OpenAI's `suffix`; jaxinfer.fim): each prompt is the prefix and
        the model writes the text between it and `suffix`, ended also by its infill stop tokens."""
        if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
            prompts = [prompts.tolist()]     # one prompt's token ids
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        params = params or self.default_sampling_params()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        fim = fills_in(self.tokenizer, suffix)
        encoded = [self._fim(p, suffix) for p in prompts] if fim else [self._encode(p) for p in prompts]
        if fim:
            plist = [with_fim_stops(self.tokenizer, p) for p in plist]
        self._check_leader()
        try:
            rids, results = self.client.generate(encoded, plist, cache_salt=cache_salt, priority=priority,
                                                 lora=lora)
        except SubmitError as e:
            raise ValueError(f"prompt {e.index}: {e.message}") from None
        return [GenerationOutput(rid, ids, samples, max(c.num_cached_tokens for c in samples))
                for rid, ids, samples in zip(rids, encoded, results)]

    def beam_search(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]], params: BeamSearchParams,
                    cache_salt: str | None = None, lora: str | None = None) -> list[GenerationOutput]:
        """vLLM's LLM.beam_search (jaxinfer/host/beam_search.py): per prompt, `samples` holds the
        beam_width best hypotheses, best first (finish_reason "stop": ended by EOS; "length")."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        encoded = [self._encode(p) for p in prompts]
        self._check_leader()
        try:
            results = self.client.beam_search(encoded, params, cache_salt=cache_salt, lora=lora)
        except SubmitError as e:
            raise ValueError(f"prompt {e.index}: {e.message}") from None
        outputs = []
        for i, (ids, deltas) in enumerate(zip(encoded, results)):
            samples = [Completion() for _ in range(1 + max(d.sample_index for d in deltas))]
            for d in deltas:
                samples[d.sample_index].add(d)
            outputs.append(GenerationOutput(f"beam-{i}", ids, samples))
        return outputs

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               priority: int = 0, lora: str | None = None, suffix: str | None = None) -> Iterator[StreamDelta]:
        """suffix: fill in the middle, as generate's."""
        params = params or self.default_sampling_params()
        fim = fills_in(self.tokenizer, suffix)
        ids = self._fim(prompt, suffix) if fim else self._encode(prompt)
        if fim:
            params = with_fim_stops(self.tokenizer, params)
        self._check_leader()
        queue: deque = deque()
        try:
            [rid] = self.client.submit([ids], params, route=queue.append, priority=priority, lora=lora)
        except SubmitError as e:
            raise ValueError(e.message) from None
        for d in self.client.stream_deltas(rid, params.n, queue):
            if d.text or d.token_ids or d.finished:
                yield StreamDelta(d.text, d.token_ids, d.sample_index, d.logprobs,
                                  d.finish_reason if d.finished else None)

    def abort(self, request_id: str) -> None:
        self.client.abort(request_id)

    def logits(self, token_ids: Sequence[int], lora: str | None = None) -> np.ndarray:
        """float32 [T, vocab]: one full causal forward of the tokens, no cache. lora: a loaded LoRA
        adapter's name (None: the base model)."""
        ids = self._encode(token_ids)
        t = len(ids)
        if not 0 < t <= self.model_cfg.exact_positions:
            raise ValueError(f"logits needs 1..{self.model_cfg.exact_positions} tokens, got {t}")
        padded = max(16, 1 << (t - 1).bit_length())   # bucketed: a few compilations, not one per length
        tokens = np.zeros(padded, np.int32)
        tokens[:t] = ids
        positions = np.arange(padded, dtype=np.int32)
        if self.model_cfg.position == "learned":
            positions = np.minimum(positions, self.model_cfg.max_position_embeddings - 1)
        if lora is not None:
            try:
                stacks = self.client.lora_single(lora)
            except KeyError:
                raise ValueError(f"the LoRA adapter {lora!r} does not exist (loaded: {self.client.lora_names()})") from None
            lora_inputs = LoraInputs(np.zeros(padded, np.int32), stacks)   # every token: slot 0
            return self.client.locked(lambda: self._run_forward(tokens, positions, lora_inputs))[:t]
        if self._channel is None:   # under the engine lock: update_weights and sleep swap the weights
            return self.client.locked(lambda: self._run_forward(tokens, positions))[:t]
        self._check_leader()

        def publish_and_run() -> np.ndarray:   # multi-host: programs run in message order, each read first
            self._channel.publish("logits", [tokens, positions])
            out = self._forward(self._params, jnp.asarray(tokens), jnp.asarray(positions))
            return np.asarray(out, np.float32)[:t]
        return self.client.locked(publish_and_run)

    def _run_forward(self, tokens: np.ndarray, positions: np.ndarray, *lora) -> np.ndarray:
        if not self.client.weights_on_device():
            from jaxinfer.engine import EngineSleepingError
            raise EngineSleepingError("the engine's weights are asleep (sleep mode): wake_up() first")
        out = self._forward(self.client.served_params(), jnp.asarray(tokens), jnp.asarray(positions), *lora)
        return np.asarray(out, np.float32)   # sliced on the host: no extra XLA op

    def embed(self, inputs: str | Sequence[int] | Sequence[str | Sequence[int]], *, prompt_name: str | None = None,
              prompt: str | None = None, dimensions: int | None = None, truncate_prompt_tokens: int | None = None,
              truncation_side: str | None = None, normalize: bool | None = None,
              add_special_tokens: bool = True) -> np.ndarray:
        """np.float32 [n, hidden] (or [n, dimensions]): one embedding per input (a string or a list of
        token ids), the final-norm hidden states pooled as the model says (jaxinfer.embedding), then
        L2-normalized where it lists a Normalize module. Text is tokenized with special tokens (the
        tokenizer's post-processor) after the prompt (`prompt`, else the model's prompts[prompt_name],
        else its default prompt), as sentence-transformers' encode does; token ids are used as given.
        Each input runs through the engine as a prefill-only request (batched with everything else,
        chunked past the token budget). An input longer than max_model_len is a ValueError, unless
        truncate_prompt_tokens (vLLM's; -1: max_model_len) keeps at most that many of each input's
        tokens, special tokens included: text as transformers' tokenizer(..., truncation=True,
        max_length=N) cuts it, token ids their first N; truncation_side "left" keeps the end instead
        ("right", vLLM's default for pooling models, the start). normalize (vLLM's): L2-normalize the
        vectors or not, None as the model says; add_special_tokens False: text without the tokenizer's
        special tokens."""
        spec = self._embedding_spec()
        spec.check_dimensions(dimensions, self.model_cfg.d_model)
        encoded = self.embedding_inputs(inputs, prompt_name, prompt, truncate_prompt_tokens, truncation_side,
                                        add_special_tokens)
        self._check_leader()
        try:
            vectors = self.client.embed([ids for ids, _ in encoded],
                                        [spec.pooling_state(len(ids), n, dimensions, normalize) for ids, n in encoded])
        except SubmitError as e:
            raise ValueError(f"input {e.index}: {e.message}") from None
        return np.stack(vectors).astype(np.float32)

    def classify(self, inputs: str | Sequence[int] | Sequence[str | Sequence[int]], *,
                 use_activation: bool = True, truncate_prompt_tokens: int | None = None,
                 truncation_side: str | None = None) -> np.ndarray:
        """np.float32 [n, num_labels]: each input's label probabilities (vLLM's LLM.classify; the
        activation and labels: gen.classifier, jaxinfer/classify.py), or with use_activation=False
        the logits. Inputs and truncation as gen.embed takes them."""
        if self.classifier is None:
            raise ValueError("this model does not classify: load a ...ForSequenceClassification checkpoint")
        return self.classifier.probabilities(self.embed(inputs, truncate_prompt_tokens=truncate_prompt_tokens,
                                                        truncation_side=truncation_side), use_activation)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *,
              use_activation: bool = True, truncate_prompt_tokens: int | None = None,
              truncation_side: str | None = None) -> np.ndarray:
        """np.float32 [n]: vLLM's LLM.score, text_1 against text_2 (1:1, 1:N or N:N). A one-label
        sequence-classification model (a cross-encoder reranker) scores each pair together, its
        probability (jaxinfer/classify.py); an embedding model scores the cosine similarity of the
        two texts' embeddings. A classifier of several labels is a ValueError; use_activation=False:
        a cross-encoder's logits. truncate_prompt_tokens: each input (a pair, for a cross-encoder:
        transformers' longest_first) cut to at most that many tokens, as gen.embed cuts them."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        pairs = score_pairs(first, second)
        cut = dict(truncate_prompt_tokens=truncate_prompt_tokens, truncation_side=truncation_side)
        if self.classifier is not None:
            # the pairs are cut as pairs here; their ids then go through embed whole
            return self.classifier.relevance(self.embed(self.cross_encoder_inputs(pairs, **cut)), use_activation)
        return np.asarray(pair_cosines(self.embed(first + second, **cut), len(first)), np.float32)

    def cross_encoder_inputs(self, pairs: Sequence[tuple[str, str]], truncate_prompt_tokens: int | None = None,
                             truncation_side: str | None = None) -> list[list[int]]:
        """Each (query, document) pair's token ids for this one-label classifier (Classifier.pair_ids),
        cut as gen.score says; a classifier of several labels, or no tokenizer, is a ValueError."""
        self.classifier.check_cross_encoder()
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer to pair the texts with")
        keep, side = self.pooling_truncation(truncate_prompt_tokens, truncation_side)
        return [self.classifier.pair_ids(self.tokenizer, a, b, keep, side) for a, b in pairs]

    def pooling_truncation(self, truncate_prompt_tokens: int | None, truncation_side: str | None
                           ) -> tuple[int | None, str]:
        """vLLM's truncate_prompt_tokens for pooling requests -> (tokens kept, or None for no cut;
        side): -1 is max_model_len, more than max_model_len or less than 1 a ValueError; the side
        "right" (keep the start: vLLM's pooling tokenizers) unless truncation_side says "left"."""
        side = truncation_side or "right"
        if side not in ("left", "right"):
            raise FieldError("truncation_side", f"truncation_side must be 'left' or 'right', got {truncation_side!r}")
        keep = truncate_prompt_tokens
        if keep is None:
            return None, side
        limit = self.client.max_model_len
        if keep == -1:
            return limit, side
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise FieldError("truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or >= 1, got {keep!r}")
        if keep > limit:
            raise FieldError("truncate_prompt_tokens", f"truncate_prompt_tokens={keep} cannot be greater than "
                             f"max_model_len={limit}: request a smaller truncation size")
        return keep, side

    def _embedding_spec(self) -> EmbeddingSpec:
        if self.embedding is None:
            raise ValueError("this model does not embed: load a sentence-transformers folder, or set pooling= "
                             "(last, mean or cls) for a causal-LM folder")
        return self.embedding

    def embedding_inputs(self, inputs, prompt_name: str | None = None, prompt: str | None = None,
                         truncate_prompt_tokens: int | None = None, truncation_side: str | None = None,
                         add_special_tokens: bool = True) -> list[tuple[list[int], int]]:
        """Each input of gen.embed as (token ids, how many of them are the prompt's): text after the
        prompt text, tokenized with special tokens (add_special_tokens); token-id lists as given (no
        prompt); each cut as gen.embed says (pooling_truncation)."""
        spec = self._embedding_spec()
        if isinstance(inputs, str) or (len(inputs) and isinstance(inputs[0], (int, np.integer))):
            inputs = [inputs]
        if not len(inputs):
            raise ValueError("no inputs to embed")
        keep, side = self.pooling_truncation(truncate_prompt_tokens, truncation_side)
        prefix = spec.prompt_text(prompt_name, prompt)
        prefix_len = self._prompt_length(prefix, add_special_tokens) if prefix and not spec.include_prompt else 0
        out = []
        for i, x in enumerate(inputs):
            if not isinstance(x, str):
                out.append((cut_ids(self._encode(x), keep, side), 0))
                continue
            ids = self._encode(prefix + x, keep, side, add_special_tokens)
            if prefix and side == "left" and keep is not None and len(self._encode(prefix + x)) > keep:
                raise FieldError("truncation_side", f"input {i}: truncation_side 'left' would cut the model's prompt "
                                 "off the start of the text: truncate from the right, or pass prompt=''")
            if prefix_len and len(ids) <= prefix_len:
                raise FieldError("truncate_prompt_tokens", f"input {i}: truncate_prompt_tokens={keep} leaves none "
                                 f"of it after the model's prompt ({prefix_len} tokens)")
            out.append((ids, prefix_len))
        return out

    def _prompt_length(self, prompt: str, add_special_tokens: bool = True) -> int:
        """The prompt's tokens but a trailing special one (sentence-transformers' _get_prompt_length)."""
        ids = self._encode(prompt, add_special_tokens=add_special_tokens)
        special = set(self.tokenizer.eos_ids) | {self.tokenizer.bos_id, self.tokenizer.pad_id}
        return len(ids) - (1 if ids and ids[-1] in special else 0)

    def stats(self) -> dict:
        return self.client.stats()

    def load_lora(self, name: str, path: str | Path) -> None:
        """Register the PEFT adapter folder at path as `name` while serving (no restart, no flag).
        A bad adapter raises jaxinfer.lora.adapter.LoraError (a ValueError naming the problem) and
        registers nothing."""
        self.client.load_lora(name, str(path))

    def unload_lora(self, name: str) -> None:
        """Forget an adapter (ValueError if no adapter has that name); its requests already queued finish."""
        try:
            self.client.unload_lora(name)
        except KeyError:
            raise ValueError(f"the LoRA adapter {name!r} does not exist (loaded: {self.client.lora_names()})") from None

    def lora_adapters(self) -> list[str]:
        """The names of the loaded LoRA adapters."""
        return self.client.lora_names()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many were dropped."""
        return self.client.reset_prefix_cache()

    # ---------------------------------------------------------------- new weights, sleep mode (weight_update.py)
    def update_weights(self, weights: str | Path | Mapping[str, object]) -> None:
        """Serve other weights of the same model from now on (a reinforcement-learning loop's new
        policy), with nothing compiled again: `weights` is a checkpoint folder (or Hub id) of the same
        architecture, or the HF-named tensors of every weight (numpy, jax or torch arrays: a trainer's
        state dict). They are read as from_pretrained read the served ones (fused, quantized as
        quantize= says) in host memory, checked, then replace the served ones leaf by leaf on their
        devices. Runs between requests (RuntimeError while some are unfinished); empties the prefix
        cache. A checkpoint of another shape or config is a CheckpointError naming the difference,
        and nothing changes. Works asleep too: the weights are then put on the device (wake_up puts
        back the KV pages). The draft model or Medusa heads of speculative decoding are kept."""
        self._check_weights_api("update_weights")
        params = self._read_weights(weights)
        self.client.update_weights(params, checkpoint_name(weights))

    def sleep(self, level: int = 1) -> None:
        """vLLM's LLM.sleep: free the accelerator memory the engine holds (the KV pages, and the
        weights: level 1 keeps them in host memory, level 2 discards them) until wake_up. Runs
        between requests; requests sent meanwhile are refused (EngineSleepingError)."""
        self._check_weights_api("sleep")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights kept in host memory) or 2 (discarded), got {level!r}")
        if level == 2 and (self._recipe is None or self._recipe.model_cfg is not None):
            raise RuntimeError("sleep(level=2) discards the weights, which wake_up reads again from the checkpoint "
                               "from_pretrained read as a folder: not this Generator's (use level 1)")
        self.client.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """vLLM's LLM.wake_up: put back the weights ("weights") and the KV pages ("kv_cache"; they come
        back zeroed, the prefix cache empty); None: both. Weights discarded by sleep(level=2) and not
        given since by update_weights are read again from the checkpoint the engine started from."""
        from jaxinfer.weight_update import SLEEP_TAGS, WeightsAsleep
        tags = SLEEP_TAGS if tags is None else tuple(tags)
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"wake_up tags {unknown} are not {list(SLEEP_TAGS)}")
        try:
            self.client.wake_up(tags)
        except WeightsAsleep:
            self.update_weights(self._recipe.path)
            self.client.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True from sleep() until wake_up() has put back both the weights and the KV pages."""
        return self.client.is_sleeping()

    def _check_weights_api(self, what: str) -> None:
        if self._channel is not None:
            raise RuntimeError(f"{what} is not available across several processes (multi-host)")
        if self.classifier is not None:
            raise RuntimeError(f"{what} is not available for a sequence-classification model (its head is "
                               "read apart from the decoder)")

    def _read_weights(self, weights):
        """The served model's params from `weights`, laid out as the served ones (in host memory where
        the accelerator has a CPU backend beside it; a pipelined model's on its mesh)."""
        from jaxinfer.weight_update import DictTensors, check_same_config, on_host
        r = self._recipe
        if r is None:
            raise RuntimeError("update_weights reads weights as from_pretrained did: this Generator was not "
                               "made by Generator.from_pretrained")
        tensors = None
        if isinstance(weights, Mapping):
            path, tensors = r.path, DictTensors(weights)
        elif isinstance(weights, (str, Path)):
            if r.model_cfg is not None:
                raise ValueError("update_weights from a folder is not available for this embedding model (its "
                                 "decoder's config is not its folder's config.json): pass its named tensors")
            path = resolve_model_path(weights, None)
            if r.cfg.hf_overrides is not None:   # the served config is the overridden one
                path = apply_hf_overrides(path, json.loads(r.cfg.hf_overrides))
        else:
            raise TypeError(f"update_weights takes a checkpoint folder or a mapping of tensor names to arrays, "
                            f"not {type(weights).__name__}")
        if r.pipelined:
            if tensors is not None:
                raise ValueError("update_weights with named tensors is not available with pipeline_parallel > 1: "
                                 "pass a checkpoint folder")
            model = _load_pipelined(path, r.cfg)
        else:
            with on_host():
                model = _load_decoder(path, r.cfg, None, fuse=True, model_cfg=r.model_cfg, tensors=tensors)
        check_same_config(self.model_cfg, model.cfg, checkpoint_name(weights))
        return nnx.split(model)[1]

    # ---------------------------------------------------------------- multi-host (jaxinfer.distributed)
    @property
    def process_group(self):
        """The jaxinfer.distributed.ProcessGroup of a multi-host generator, else None."""
        return None if self._channel is None else self._channel.group

    @property
    def is_leader(self) -> bool:
        """True on a single process and on process 0 of a multi-host group (which takes requests)."""
        return self._channel is None or self._channel.group.is_leader

    def _check_leader(self) -> None:
        if not self.is_leader:
            g = self._channel.group
            raise RuntimeError(f"process {g.process_id} of {g.num_processes} takes no requests: process 0 "
                               "schedules every step; call follow() on this process")
        if self._channel is not None and self._channel.closed:
            raise RuntimeError("this multi-host generator is closed: its followers have stopped")

    def follow(self) -> int:
        """Multi-host, every process but 0: run each step (and gen.logits call) of process 0, in
        order, until process 0 calls close() or exits. Returns how many programs it ran."""
        if self._channel is None or self._channel.group.is_leader:
            raise RuntimeError("follow() is for multi-host processes other than 0 "
                               "(Generator.from_pretrained(..., process_id=1, ...))")
        return self._channel.follow({
            "step": lambda *arrays: self.client.debug.run_published_step(list(arrays)),
            "logits": lambda tokens, positions: self._forward(self._params, jnp.asarray(tokens),
                                                              jnp.asarray(positions)),
        })

    def close(self) -> None:
        """Multi-host, process 0: release the followers (their follow() returns). Idempotent; runs at
        exit if not called. No-op on a single process and on followers."""
        if self._channel is not None:
            self.client.locked(self._channel.close)


# ------------------------------------------------------------------------------ from_pretrained's steps
def _full_forward(model, impl: str, replicated: bool):
    """(jitted forward(params, tokens, positions) -> logits [T, vocab], the model's params): what
    gen.logits runs, outside the engine. replicated (multi-host): process 0 reads whole logits
    rows, so they come back replicated, not left vocab-sharded across processes."""
    graphdef, params = nnx.split(model)
    # the pipelined model takes no lora (LoRA refuses pipelines)
    forward = lambda p, t, pos, lora=None: nnx.merge(graphdef, p)(  # noqa: E731
        t, pos, impl=impl, **({} if lora is None else {"lora": lora}))[0]
    if not replicated:
        return jax.jit(forward), params
    from jax.sharding import NamedSharding, PartitionSpec
    from jaxinfer.sharding import model_mesh
    return jax.jit(forward, out_shardings=NamedSharding(model_mesh(params), PartitionSpec())), params


def _check_state_settings(path: Path, cfg: EngineConfig) -> None:
    """Before any loading: a model with state layers (LFM2's conv, Qwen3.5's Gated DeltaNet) refuses the settings its per-sequence state
    cannot take (config.resolve.check_state_model) by name, not by whichever part of loading fails
    first (pipeline stages stack the layers, tensor parallelism fuses and shards them)."""
    from jaxinfer.config import ConfigError
    from jaxinfer.config.resolve import check_state_model
    from jaxinfer.errors import CheckpointError
    from jaxinfer.gguf_file import GGUFFile, hf_config, is_gguf
    from jaxinfer.models.hf_configs import model_config_from_hf
    from jaxinfer.weights import read_native_config
    try:
        mc = (read_native_config(path)[0] if is_native(path) else
              model_config_from_hf(hf_config(GGUFFile(path)) if is_gguf(path) else path))
    except (ConfigError, CheckpointError, OSError, ValueError):   # the loader names what is wrong
        return
    check_state_model(cfg, mc)


def _load_pipelined(path: Path, cfg: EngineConfig):
    """A PipelinedDecoder over a tensor x pipeline mesh (float HF: each device reads only its layers)."""
    from jaxinfer.pipeline import load_pipelined
    from jaxinfer.sharding import make_mesh
    mesh = make_mesh(tensor_parallel=cfg.tensor_parallel, pipeline_parallel=cfg.pipeline_parallel)
    return load_pipelined(path, cfg.dtype, mesh, cfg.quantize)


def _join_group(group, mesh, path: Path, cfg: EngineConfig, warmup: bool):
    """Multi-host: the StepChannel of this process's group, once every process has checked that it
    runs the same settings and model config (paths may differ per host)."""
    from jaxinfer import distributed
    distributed.check_mesh_spans_processes(mesh)
    channel = distributed.StepChannel(group)
    config_json = path / "config.json"
    model_sha = hashlib.sha256(config_json.read_bytes()).hexdigest()[:16] if config_json.exists() else None
    channel.check_same("settings", dict(dataclasses.asdict(cfg), warmup=warmup, model_config_sha256=model_sha))
    return channel


def _embedding_spec(path: Path, cfg: EngineConfig):
    """(EmbeddingSpec or None, the ModelConfig to load with or None): a sentence-transformers folder's
    or the pooling setting's embedding. A checkpoint with no LM head (the bare base model, e.g.
    Qwen3Model keys, and no lm_head tensor) loads with the embedding as its head, untrained for
    generation: it only embeds (a generation request is refused)."""
    spec = read_embedding_spec(path, cfg.pooling, cfg.normalize)
    if spec is None or is_native(spec.model_path):
        return spec, None
    from jaxinfer.models.hf_configs import is_bare_model, model_config_from_hf
    model_path = spec.model_path
    mc = model_config_from_hf(model_path)
    archs = json.loads((model_path / "config.json").read_text()).get("architectures") or []
    bare = bool(archs) and is_bare_model(archs[0])   # (GPT2LMHeadModel, a ...ForConditionalGeneration: not bare)
    from jaxinfer.models.hf_maps import hf_weight_map
    head = hf_weight_map(dataclasses.replace(mc, tie_embeddings=False))["lm_head"][0][0]   # (GPT-NeoX's embed_out)
    has_head = tensor_source(model_path).has(head)
    generates = not bare and (has_head or mc.tie_embeddings)
    if not (has_head or mc.tie_embeddings):
        mc = dataclasses.replace(mc, tie_embeddings=True)
    return dataclasses.replace(spec, generates=generates), mc


@dataclass(frozen=True)
class _Recipe:
    """How from_pretrained read the served weights (update_weights reads new ones the same way)."""
    path: Path
    cfg: EngineConfig
    model_cfg: object | None     # an embedding model's config when not config.json's own
    pipelined: bool


def _load_decoder(path: Path, cfg: EngineConfig, mesh, fuse: bool, model_cfg=None, tensors=None):
    """The target model: each weight read straight into its shards, fused (qkv / gate_up, columns
    grouped per device: models/decoder.py) unless multi-host (fuse False: it keeps the unfused
    names for now; tests/multihost_worker.py reads layers/0/mlp/up), quantized, then laid out on
    the mesh (the fused weights' tensor-parallel layout, QuantizedWeights included)."""
    # quantize= requantizes a GGUF file's weights all alike: its packed blocks are read as floats
    model, _ = load_model(path, cfg.dtype, mesh=mesh, cfg=model_cfg, gguf_blocks=cfg.quantize is None, tensors=tensors)
    if fuse:
        model = fuse_decoder(model, cfg.tensor_parallel, consume=True)
    if cfg.quantize is not None:
        quantize_decoder(model, cfg.quantize)
    if mesh is not None:
        from jaxinfer.sharding import shard_decoder
        shard_decoder(model, mesh)
    return model


def _load_speculative(draft_path: Path | None, method: str | None, model, dtype: str) -> tuple:
    """(draft model, Medusa heads): the one speculative_method needs, the other None."""
    if draft_path is None:
        return None, None
    if method == "medusa":
        return None, load_heads(draft_path, model, model.embed.get_value().dtype)
    return load_draft(draft_path, dtype), None


def _override(cfg: EngineConfig) -> dict | None:
    return json.loads(cfg.override_generation_config) if cfg.override_generation_config else None


def _tokenizer(path: Path, cfg: EngineConfig, vocab_size: int):
    """The tokenizer of `path` (the model's folder, or cfg.tokenizer's), checked to fit the model."""
    tokenizer = load_tokenizer(path)
    if cfg.tokenizer is None:
        return tokenizer
    if tokenizer is None:
        raise ValueError(f"tokenizer={cfg.tokenizer!r}: {path} has no tokenizer.json or tokenizer.model")
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"tokenizer={cfg.tokenizer!r} has {tokenizer.vocab_size} tokens, more than the model's "
                         f"{vocab_size} embeddings: not this model's tokenizer")
    return tokenizer


def _sampling_defaults(path: Path, cfg: EngineConfig) -> dict:
    """The model's default sampling parameters (jaxinfer.generation_defaults) for these settings."""
    return sampling_defaults(path, cfg.generation_config, _override(cfg))
