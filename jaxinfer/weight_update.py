"""New weights for a running engine, and its sleep mode (vLLM's `LLM.sleep` / `wake_up`, SGLang's
`update_weights_from_disk` / `update_weights_from_tensor`): what reinforcement-learning loops need
between rollouts, and what lets two engines share one accelerator.

- **New weights** come from a checkpoint folder of the same architecture and shapes, or from named
  tensors (the HF names of every tensor the checkpoint would hold: a trainer's state dict). They are
  read, fused, quantized (the engine's `quantize=`) and checked on the host (the CPU backend, where
  the accelerator has one beside it), then copied leaf by leaf onto each old leaf's sharding, the
  old leaf freed before the next is copied: the device holds the weights once plus one leaf. Every
  leaf must keep its path, shape and dtype, so nothing recompiles; a checkpoint that differs is
  refused naming the first leaf at fault, before anything is replaced.
- **Sleep** level 1 copies the weights to host memory and frees them and the KV pages on the device;
  level 2 frees both and keeps nothing (the next weights come from update_weights, or are read
  again from the checkpoint the engine started from). wake_up puts back either or both (tags
  "weights", "kv_cache"); the KV pages come back zeroed with the prefix cache empty.

The engine's half is jaxinfer/engine.py (its state, and refusing requests while asleep); this module
only moves arrays.
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import CheckpointError

SLEEP_TAGS = ("weights", "kv_cache")     # vLLM's wake_up tags


class DictTensors:
    """Named tensors (numpy, jax or torch arrays) behind SafetensorsFolder's interface, so that
    weights.load_hf reads them as it reads a checkpoint's files."""

    ORIGIN = "update_weights' named tensors"

    def __init__(self, tensors: Mapping[str, Any]):
        if not isinstance(tensors, Mapping) or not tensors:
            raise CheckpointError(f"{self.ORIGIN}: expected a non-empty mapping of tensor names to arrays")
        self.tensors = dict(tensors)
        for name in self.tensors:
            if not isinstance(name, str):
                raise CheckpointError(f"{self.ORIGIN}: tensor names must be strings, got {name!r}")

    def stored(self, name: str) -> str | None:
        """As SafetensorsFolder.stored (a bare model's state dict lacks the "model." prefix)."""
        from jaxinfer.weights import stored_name
        return stored_name(name, self.tensors)

    def has(self, name: str) -> bool:
        return self.stored(name) is not None

    def dtype(self, name: str) -> np.dtype:
        return self.get(name).dtype

    def get(self, name: str) -> np.ndarray:
        stored = self.stored(name)
        if stored is None:
            raise CheckpointError(f"tensor {name!r} not found in {self.ORIGIN} ({len(self.tensors)} given): every "
                                  "tensor of the checkpoint is needed (a partial update is not available)")
        return host_array(self.tensors[stored], name)

    def source(self, name: str) -> str:
        return self.ORIGIN


def host_array(x, name: str) -> np.ndarray:
    """A numpy view or copy of a numpy, jax or torch array (torch's bfloat16 goes through float32)."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, jax.Array):
        return np.asarray(jax.device_get(x))
    if hasattr(x, "detach") and hasattr(x, "cpu"):   # a torch tensor; numpy has no bfloat16 of torch's
        t = x.detach().cpu()
        return (t.float() if str(t.dtype) == "torch.bfloat16" else t).numpy()
    try:
        return np.asarray(x)
    except Exception as e:   # noqa: BLE001
        raise CheckpointError(f"{DictTensors.ORIGIN}: tensor {name!r} is a {type(x).__name__}, not an array ({e})") from None


@contextlib.contextmanager
def on_host():
    """Arrays made inside land on the CPU backend when the default backend is an accelerator that
    has one beside it (the weights are staged there); on CPU, or without one, nothing changes."""
    if jax.default_backend() == "cpu":
        yield
        return
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:    # JAX_PLATFORMS without cpu: staged on the accelerator itself
        yield
        return
    with jax.default_device(cpu):
        yield


def _named_leaves(tree) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


# ModelConfig fields no compiled program reads (the tokenizer's ids, the family's name)
_NOT_COMPILED = ("bos_token_id", "eos_token_ids", "architecture")


def check_same_config(served, new, what: str) -> None:
    """The new checkpoint's ModelConfig is the served one's (the compiled programs hold the served
    config: its RoPE, norms, activations): CheckpointError naming the fields that differ."""
    differ = [f.name for f in dataclasses.fields(served)
              if f.name not in _NOT_COMPILED and getattr(served, f.name) != getattr(new, f.name)]
    if differ:
        shown = ", ".join(f"{n}: {getattr(new, n)!r} (served: {getattr(served, n)!r})" for n in differ[:4])
        raise CheckpointError(f"{what}: its config.json is not the served model's ({shown})")


def check_same_layout(old, new, what: str) -> None:
    """Every leaf of `new` at the path, shape and dtype of `old`'s (CheckpointError naming the first
    that differs): the compiled step programs then take the new leaves as they are."""
    a, b = _named_leaves(old), _named_leaves(new)
    names_a, names_b = [n for n, _ in a], [n for n, _ in b]
    if names_a != names_b:
        missing = sorted(set(names_a) - set(names_b))[:3]
        extra = sorted(set(names_b) - set(names_a))[:3]
        raise CheckpointError(f"{what}: its parameters are not the served model's (missing {missing}, "
                              f"not served {extra}): the same architecture, quantization and shapes are needed")
    for (name, x), (_, y) in zip(a, b):
        if tuple(x.shape) != tuple(y.shape) or jnp.dtype(x.dtype) != jnp.dtype(y.dtype):
            raise CheckpointError(f"{what}: parameter {name} is {tuple(y.shape)} {jnp.dtype(y.dtype).name}; the "
                                  f"served model's is {tuple(x.shape)} {jnp.dtype(x.dtype).name}")


def replace_leaves(old, new) -> Any:
    """`old`'s tree (device arrays, or jax.ShapeDtypeStruct with a sharding) with `new`'s leaves
    placed on `old`'s shardings, one leaf at a time: each old array is freed as soon as its
    replacement is on the device (old must not be used afterwards)."""
    leaves, treedef = jax.tree.flatten(old)
    fresh = jax.tree.leaves(new)
    out = []
    for i, x in enumerate(leaves):
        z = _put(fresh[i], x)
        z.block_until_ready()
        if isinstance(x, jax.Array) and x is not z and not x.is_deleted():
            x.delete()
        out.append(z)
        leaves[i] = fresh[i] = None   # drop the staged copy too
    return jax.tree.unflatten(treedef, out)


def _put(y, x):
    """y on x's sharding, committed as x was (an uncommitted argument keys another jit cache entry:
    a step compiled for uncommitted weights would compile again for committed ones)."""
    if getattr(x, "committed", True):
        return jax.device_put(y, x.sharding)
    return jax.device_put(np.asarray(jax.device_get(y)) if isinstance(y, jax.Array) else y)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A device array's shape, dtype, sharding and commitment (a stand-in for it while freed; a
    pytree leaf)."""
    shape: tuple
    dtype: Any
    sharding: Any
    committed: bool


def layout(tree):
    """A tree of device arrays as _Layout leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [_Layout(tuple(x.shape), x.dtype, x.sharding, x.committed) for x in leaves])


class HostCopy:
    """A tree of device arrays kept in host memory (numpy) with each leaf's sharding, to put back
    exactly where it was (sleep level 1's weights)."""

    def __init__(self, tree):
        leaves, self.treedef = jax.tree.flatten(tree)
        self.layout = jax.tree.leaves(layout(leaves))
        self.leaves = [np.asarray(jax.device_get(x)) for x in leaves]

    def restore(self):
        out = []
        for i, x in enumerate(self.layout):
            out.append(_put(self.leaves[i], x))
            self.leaves[i] = None
        return jax.tree.unflatten(self.treedef, out)


def free(tree) -> None:
    """Free every device array of a tree now (its Python references become unusable)."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


class BlankPages:
    """The KV pages' layout (every leaf's shape, dtype and sharding), to allocate them again zeroed
    (int8 / fp8 pages' scales at 1, as kv_cache.init_kv_pages makes them) by one jitted program
    that places each leaf on its own sharding: no host copy of the pool, and the same avals and
    shardings as before, so no step recompiles."""

    def __init__(self, pages):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(pages)
        self.specs = [(tuple(x.shape), x.dtype, _is_scale(path)) for path, x in flat]
        shardings = tuple(x.sharding for _, x in flat)
        specs = self.specs
        self._make = jax.jit(lambda: [jnp.ones(s, d) if scale else jnp.zeros(s, d) for s, d, scale in specs],
                             out_shardings=list(shardings))

    def make(self):
        return jax.tree.unflatten(self.treedef, self._make())


def _is_scale(path) -> bool:
    last = path[-1]
    return getattr(last, "name", None) in ("k_scale", "v_scale")


class WeightsAsleep(RuntimeError):
    """wake_up(tags=["weights"]) after sleep(level=2): the weights must be read again."""


class Residency:
    """Where a runner's weights and KV pages are: on the device, in host memory (sleep level 1) or
    nowhere (level 2); the runner's params are None while its weights are not on the device, its
    kv_pages None while its pages are freed. A speculative engine's draft model or Medusa heads stay
    in host memory at either level (only the target's weights are replaced by update_weights)."""

    def __init__(self, runner):
        self.runner = runner
        self._template = None       # the target's params as ShapeDtypeStructs with shardings, once asleep
        self._host_target: HostCopy | None = None
        self._host_rest: HostCopy | None = None   # the draft's or heads' params (target None)

    @property
    def weights_on_device(self) -> bool:
        return self.runner.params is not None

    @property
    def sleeping(self) -> bool:
        return not self.weights_on_device or self.runner.kv_pages is None

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights kept in host memory) or 2 (discarded), got {level!r}")
        r = self.runner
        r.release_pages()
        if self.weights_on_device:
            target = r.target_params
            self._template = layout(target)
            self._host_target = HostCopy(target) if level == 1 else None
            spec = target is not r.params
            self._host_rest = HostCopy(r.params._replace(target=None)) if spec else None
            free(r.params)
            r.params = None
        elif level == 2:
            self._host_target = None

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Raises WeightsAsleep if the weights are asked for and were discarded (level 2)."""
        if "weights" in tags and not self.weights_on_device:
            if self._host_target is None:
                raise WeightsAsleep("the weights were discarded (sleep level 2)")
            self._put_target(self._host_target.restore())
        if "kv_cache" in tags:
            self.runner.restore_pages()

    def update(self, params, what: str) -> None:
        """The target's params from `params` (its layout checked first: nothing changes otherwise). A
        copy that fails midway (the device out of memory) leaves the weights discarded, as sleep
        level 2 does, never half replaced: requests are refused until update_weights or wake_up."""
        r = self.runner
        rest = None    # the draft's or heads' params, on the device
        if self.weights_on_device:
            check_same_layout(r.target_params, params, what)
            target = r.target_params
            rest = r.params._replace(target=None) if target is not r.params else None
            self._template = layout(target)
            r.params = None   # from here on the old leaves go one by one
        else:
            check_same_layout(self._template, params, what)
            target = self._template
        self._host_target = None
        try:
            new = replace_leaves(target, params)
        except BaseException:
            free(target)
            if rest is not None:
                self._host_rest = HostCopy(rest)
                free(rest)
            raise
        self._put_target(new, rest)

    def _put_target(self, target, rest=None) -> None:
        if rest is None and self._host_rest is not None:
            rest = self._host_rest.restore()
        self.runner.params = target if rest is None else rest._replace(target=target)
        self._host_target = self._host_rest = None


def checkpoint_name(source) -> str:
    return str(Path(source)) if isinstance(source, (str, Path)) else DictTensors.ORIGIN
