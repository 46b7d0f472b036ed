"""Tensor parallelism: a device mesh, logical-axis rules, and placing weights and KV pages on it.

    mesh = make_mesh(tensor_parallel=4)                 # axes ("data", "pipeline", "tensor")
    rules = rules_for(model.cfg, mesh)                  # Megatron-style, minus axes that do not divide
    shard_decoder(model, mesh, rules)                   # every nnx.Param -> its NamedSharding, in place
    gen = Generator(model, tok, cfg)                    # the runner's nnx.split keeps the shardings
    gen.engine.runner.kv_pages = shard_kv_pages(gen.engine.runner.kv_pages, mesh, model.cfg.n_kv_heads)
    bytes_per_device(model)                             # {device: parameter bytes it holds}
    model_mesh(model)                                   # the mesh a sharded model lives on, or None

The model never mentions meshes: every parameter carries `logical_axes` metadata (layers.py), and
ShardingRules maps each logical axis to a mesh axis (or None = replicated):

    heads, kv_heads, mlp, vocab -> "tensor"     (Megatron: column-parallel q/k/v, up/gate, LM head;
                                                 row-parallel o and down; vocab-parallel embedding)
    qkv, gate_up               -> "tensor"      (the fused projections' output columns; see below)
    expert_mlp, expert_gate_up -> "tensor"      (mixture of experts: every expert's FFN split like a
                                                 dense MLP's, each device holding 1/tp of every expert)
    experts                    -> None          (the expert axis [E, ...] of expert weights, replicated
                                                 by default; see "Mixtures of experts" below)
    embed, head_dim, position  -> None          (replicated)
    layers                     -> "pipeline"    (the Decoder's layers are a Python list with no layer
                                                 axis; pipeline.py stacks them to [n_layers, ...] and
                                                 places that axis on "pipeline" itself)

rules_for(cfg, mesh) drops an axis whose size the tensor degree does not divide: kv_heads when
n_kv_heads % tp (GQA/MQA with fewer KV heads than devices: k, v, their biases and the KV pages are
replicated and every device computes all KV heads, as vLLM does), heads when n_heads % tp, mlp
when ffn_dim % tp, vocab when vocab_size % tp (embedding and LM head replicated). This fallback is
silent by design (no warning): it is always correct, it only costs memory, and bytes_per_device
shows what it costs. param_sharding additionally replicates any dimension that its mesh axis does
not divide when given the shape, so a hand-written rule set can never produce an invalid layout.

Why this is correct. A sharding annotation never changes what a jitted function computes: jit
traces the same program (runner.ModelRunner._step_impl, Generator._forward) and XLA's SPMD
partitioner (GSPMD) splits each op by its operands' shardings and inserts the collectives needed
for every device to hold its tile of the *same* global result. For the Megatron layout:
  * q/k/v [d, H, hd] sharded on H: each device projects and attends with its own heads; attention
    is independent per head (and per KV group: the [T, H] -> [T, Hkv, G] reshape keeps a device's
    query heads next to the KV head they share, or reads a replicated KV), so no communication.
  * o [H, hd, d] sharded on H: out[t, :] = sum over heads h of attn[t, h, :] @ o[h] is a sum of
    per-device partial sums -> XLA inserts one all-reduce of the [T, d_model] output.
  * up/gate [d, F] sharded on F (elementwise activation stays local), down [F, d] sharded on F:
    again a sum over F split across devices -> one all-reduce of [T, d_model].
  * embedding [V, d] sharded on V: the row gather becomes a masked local gather + all-reduce (or an
    all-gather of the table; XLA chooses); LM head [d, V] sharded on V gives [N, V/tp] logits per
    device, all-gathered (N x V x 4 bytes) before sampling, which needs whole rows.
  * norms, residual adds and RoPE act on replicated [T, d_model] activations: no communication.
  * MoE experts gate/up [E, d, F] sharded on F, down [E, F, d] on F (the router [d, E] replicated):
    each device runs every routed row through its 1/tp of the row's expert, and the down
    projection's partial sums are all-reduced like a dense MLP's ([rows, d_model] per tile of the
    tile loop, jaxinfer/moe.py). Routing, the sort and the combine run replicated.
The only numerical difference is the order of the float additions inside the all-reduces, so
logits agree with one device to float rounding (~1e-7 relative in float32), not bitwise.

Communication per decode/prefill step, per layer, with T tokens in the step (b = activation
dtype bytes): TP does 2 all-reduces of a T x d_model activation (after o and after down). A ring
all-reduce moves 2 (tp - 1) / tp of the message per device, so each device sends (and receives)
    2 x T x d_model x b x 2 (tp - 1) / tp   bytes per layer
(e.g. Llama-3-8B, d_model 4096, bf16, T = 64, tp = 8: 2 x 512 KiB x 1.75 = 1.75 MiB per layer,
56 MiB per step over 32 layers; latency-bound at small T, so TP wants NVLink-class links).
Pipeline parallelism instead sends one T x d_model x b activation point-to-point per stage
boundary (pp - 1 sends per step, 512 KiB each in the example), independent of the layer count, but
it does not cut per-token latency and idles stages without micro-batching.

Fused projections (models.decoder.fuse_decoder(model, tp)): `qkv` [d, N] and `gate_up` [d, 2F]
have their columns grouped per device, device i's slice being [its q heads | its k heads | its v
heads] and [its gate columns | its up columns], so the plain split of the column axis over "tensor"
that the rules give is exactly Megatron's layout above, and the forward splits the fused output
with no communication. With fewer KV heads than devices (n_kv_heads % tp), fusion repeats each KV
head until every device holds whole KV heads for its own query heads (Hkv=2, tp=4: each head twice,
one per device): the fused model's cfg.n_kv_heads counts the copies, so its k/v columns and its KV
pages split over "tensor" (1 head per device) where the unfused model replicates them all. A fused
model is built for one tp; on a mesh of another size it is still correct (shardings never change
results) but XLA then moves columns between devices. rules_for drops qkv with heads and gate_up
with mlp (the fused layout then keeps one group: replicated).

Quantized weights: a Param whose value is a quant.QuantizedWeight pytree (models.decoder.
quantize_decoder, jaxinfer.quantize) is sharded like its float weight where the packed layout
allows (quantized_sharding): every leaf (codes [K * bits / 8, N], scales and zero points [K / g, N]
or [N]) ends in the N output columns and groups run along K (fp8 codes are stored [N, K], layout
"nk": their split is the one below with the two axes swapped), so
  * a column-parallel weight (q, k, v, gate, up, fused qkv / gate_up: an output dim over
    "tensor") splits every leaf's last axis: each device holds whole columns with their scales;
  * a row-parallel weight (o, down: the contracted dim over "tensor") splits the codes' first
    axis when each device's K / tp rows are whole packing units (int4: 2 rows a byte, int3: 8 rows
    in 3 bytes) and whole groups; grouped scales and zero points split with them, per-column
    scales ([N], or [1, N] for one group over K) stay whole; otherwise the weight is replicated.
The static activation scale of a W8A8 weight is replicated. The forward is the same program:
XLA partitions the dequantize-and-dot like any other, all-reducing the row-parallel partial sums.

Mixtures of experts. The default shards each expert's FFN dimension (tensor parallelism inside every
expert, as vLLM's TP MoE does): every device reads 1/tp of each routed expert's weights, whatever the
routing, and no token moves between devices. Mapping "experts" to "tensor" instead (rules.replace(
experts="tensor")) places whole experts per device (expert_mlp then stays unsplit: a mesh axis is used
once); that is correct too, since shardings never change results, but the expert loop reads one
expert at a time, so GSPMD gathers each expert's weights to every device: expert parallelism that
saves memory, not time (an all-to-all dispatch under shard_map is what would make it pay). Stacked
quantized experts (QuantizedWeight.batch = 1: every leaf [E, ...]) shard like their float weights,
the leading E axis as "experts" says, the rest as for one matrix below.

Loading: load_sharded(value_fn, shape, sharding) builds a global array with
jax.make_array_from_callback, asking the callback only for each device's slice, so a loader can
read a numpy memmap slice per shard without first materialising the full tensor on one device.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.quant import QuantizedWeight

__all__ = ["MESH_AXES", "ShardingRules", "DEFAULT_RULES", "make_mesh", "rules_for", "param_sharding",
           "shard_decoder", "model_mesh", "kv_sharding", "shard_kv_pages", "bytes_per_device", "load_sharded"]

MESH_AXES = ("data", "pipeline", "tensor")


# ------------------------------------------------------------------------------------ mesh

def make_mesh(tensor_parallel: int = 1, pipeline_parallel: int = 1, data_parallel: int = 1,
              devices: list | None = None) -> Mesh:
    """A (data, pipeline, tensor) mesh of data_parallel x pipeline_parallel x tensor_parallel devices.

    `devices` given: there must be exactly that many. `devices` None: the first
    dp * pp * tp of jax.devices() (tensor innermost, so a TP group is consecutive devices, which on
    a GPU host are the NVLink neighbours); fewer available devices is an error. Mesh axes are
    Auto (GSPMD propagation), not Explicit.
    """
    degrees = {"data_parallel": data_parallel, "pipeline_parallel": pipeline_parallel,
               "tensor_parallel": tensor_parallel}
    bad = [f"{k}={v!r}" for k, v in degrees.items() if not (isinstance(v, (int, np.integer)) and v >= 1)]
    if bad:
        raise ValueError(f"parallel degrees must be integers >= 1, got {', '.join(bad)}")
    n = data_parallel * pipeline_parallel * tensor_parallel
    layout = f"data_parallel={data_parallel} x pipeline_parallel={pipeline_parallel} x tensor_parallel={tensor_parallel}"
    if devices is None:
        available = jax.devices()
        if len(available) < n:
            raise ValueError(f"{layout} needs {n} devices but only {len(available)} "
                             f"{available[0].platform} device(s) are visible (on CPU, set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax)")
        devices = available[:n]
    elif len(devices) != n:
        raise ValueError(f"{layout} needs {n} devices, but {len(devices)} were given")
    grid = np.asarray(devices, dtype=object).reshape(data_parallel, pipeline_parallel, tensor_parallel)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


# ------------------------------------------------------------------------------------ rules

class ShardingRules(Mapping):
    """A frozen mapping: logical axis name -> mesh axis name, or None (replicated).

    Axes it does not list are replicated. Hashable and immutable; `replace(**kw)` and
    `without(*axes)` return new rule sets.
    """

    __slots__ = ("_rules",)

    def __init__(self, rules: Mapping[str, str | None] | None = None, **kw: str | None):
        merged = dict(rules or {}, **kw)
        for logical, mesh_axis in merged.items():
            if mesh_axis is not None and mesh_axis not in MESH_AXES:
                raise ValueError(f"rule {logical!r} -> {mesh_axis!r}: mesh axis must be one of {MESH_AXES} or None")
        object.__setattr__(self, "_rules", merged)

    def __setattr__(self, name, value):
        raise AttributeError("ShardingRules is immutable; use replace() or without()")

    def __getitem__(self, logical: str) -> str | None:
        return self._rules[logical]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __hash__(self) -> int:
        return hash(frozenset(self._rules.items()))

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self._rules) == dict(other)

    def __repr__(self) -> str:
        return f"ShardingRules({self._rules!r})"

    def mesh_axis(self, logical: str) -> str | None:
        return self._rules.get(logical)

    def replace(self, **kw: str | None) -> "ShardingRules":
        return ShardingRules(self._rules, **kw)

    def without(self, *logical: str) -> "ShardingRules":
        """These logical axes replicated (mapped to None)."""
        return ShardingRules(self._rules, **{a: None for a in logical})


DEFAULT_RULES = ShardingRules(heads="tensor", kv_heads="tensor", mlp="tensor", vocab="tensor",
                              qkv="tensor", gate_up="tensor", expert_mlp="tensor", expert_gate_up="tensor",
                              experts=None, embed=None, head_dim=None, position=None, layers="pipeline")


def _axis_size(mesh, name: str) -> int:
    return int(dict(mesh.shape).get(name, 1))


def rules_for(cfg, mesh, base: ShardingRules = DEFAULT_RULES) -> ShardingRules:
    """DEFAULT_RULES (or `base`) for this model on this mesh: every logical axis whose size the
    tensor degree does not divide falls back to replication (kv_heads, heads, mlp, vocab, the expert
    axes), silently and correctly (see the module docstring). `mesh` may be a Mesh or an AbstractMesh.
    A ValueError for a pipeline axis over a model whose layers differ in kind (Qwen3-MoE's dense
    layers among its MoE layers): pipeline.py stacks every layer to one shape."""
    tp = _axis_size(mesh, "tensor")
    if _axis_size(mesh, "pipeline") > 1 and cfg.moe_layers is not None and len(set(cfg.moe_layers)) > 1:
        kinds = "".join("E" if m else "D" for m in cfg.moe_layers)
        raise ValueError(f"pipeline parallelism stacks the layers' parameters, but {cfg.architecture} mixes mixture-"
                         f"of-experts (E) and dense (D) MLP layers ({kinds}); use tensor_parallel instead")
    sizes = {"heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "mlp": cfg.ffn_dim, "vocab": cfg.vocab_size,
             "qkv": cfg.n_heads, "gate_up": cfg.ffn_dim,   # fused: whole q heads / mlp columns per device
             "expert_mlp": cfg.expert_ffn_dim, "expert_gate_up": cfg.expert_ffn_dim,
             "experts": max(cfg.num_experts, 1)}
    drop = [axis for axis, size in sizes.items() if base.mesh_axis(axis) == "tensor" and size % tp]
    return base.without(*drop) if drop else base


def param_sharding(logical_axes: tuple[str | None, ...] | None, rules: Mapping[str, str | None], mesh: Mesh,
                   shape: tuple[int, ...] | None = None) -> NamedSharding:
    """The NamedSharding of a parameter with these logical axes. A mesh axis is used at most once
    (later dims replicated); with `shape`, a dim its mesh axis does not divide is replicated."""
    if logical_axes is None:
        return NamedSharding(mesh, PartitionSpec())
    spec, used = [], set()
    for i, logical in enumerate(logical_axes):
        axis = rules.get(logical) if logical is not None else None
        if axis is not None and (axis in used or (shape is not None and shape[i] % _axis_size(mesh, axis))):
            axis = None
        if axis is not None:
            used.add(axis)
        spec.append(axis)
    while spec and spec[-1] is None:
        spec.pop()
    return NamedSharding(mesh, PartitionSpec(*spec))


def _replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def quantized_sharding(qw: QuantizedWeight, logical_axes, rules: Mapping[str, str | None], mesh: Mesh):
    """A QuantizedWeight-shaped pytree of NamedShardings for qw (module docstring: column-parallel
    splits every leaf's last axis, row-parallel the codes' and grouped scales' first axis)."""
    spec = list(param_sharding(logical_axes, rules, mesh, qw.shape).spec) if logical_axes else []
    spec += [None] * (len(qw.shape) - len(spec))
    lead, spec = spec[:qw.batch], spec[qw.batch:]     # stacked experts: the E axis leads every leaf
    k_spec, n_spec = spec[:qw.contract], spec[qw.contract:]
    at = lambda *axes: NamedSharding(mesh, PartitionSpec(*lead, *axes))  # noqa: E731
    rep = at()
    leaves = {"q": rep, "scales": rep, "zeros": rep}
    if n_spec[0] is not None and not any(k_spec) and not any(n_spec[1:]):       # column-parallel
        leaves = {name: at(*([None] * (getattr(qw, name).ndim - qw.batch - 1)), n_spec[0])
                  for name in leaves if getattr(qw, name) is not None}
    elif k_spec[0] is not None and not any(k_spec[1:]) and not any(n_spec):     # row-parallel
        tp = _axis_size(mesh, k_spec[0])
        rows = qw.k // tp
        unit = {4: 2, 3: 8}.get(qw.bits, 1)
        g = qw.group_size or qw.k
        if qw.k % tp == 0 and rows % unit == 0 and (g == qw.k or rows % g == 0):
            split = at(k_spec[0])
            grouped = qw.scales.ndim == qw.batch + 2 and g < qw.k
            leaves = {"q": split, "scales": split if grouped else rep, "zeros": split if grouped else rep}
    if qw.layout == "nk":      # fp8 codes stored [N, K]: the same split with the two axes swapped
        assert qw.batch == 0 and qw.q.ndim == 2, "only unstacked fp8 codes are stored [N, K]"
        k_axis, n_axis = (tuple(leaves["q"].spec) + (None, None))[:2]
        if k_axis is not None or n_axis is not None:
            leaves["q"] = NamedSharding(mesh, PartitionSpec(n_axis, k_axis))
    full = _replicated(mesh)
    return QuantizedWeight(leaves["q"], leaves["scales"], None if qw.zeros is None else leaves["zeros"],
                           bits=qw.bits, group_size=qw.group_size, shape=qw.shape, contract=qw.contract,
                           act_bits=qw.act_bits, act_scale=None if qw.act_scale is None else full,
                           act_zero=None if qw.act_zero is None else full, batch=qw.batch, layout=qw.layout,
                           perm=None if qw.perm is None else full)


def shard_decoder(model, mesh: Mesh, rules: Mapping[str, str | None] | None = None):
    """Place every nnx.Param of `model` on `mesh` by its logical_axes, in place; returns the model.

    rules None: rules_for(model.cfg, mesh). QuantizedWeight values are sharded by
    quantized_sharding. Other array-valued nnx Variables, if any, are replicated, so that every
    committed array of the model lives on the same devices."""
    if rules is None:
        rules = rules_for(model.cfg, mesh)
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Variable):
            continue
        value = node.get_value()
        if isinstance(node, nnx.Param) and isinstance(value, jax.Array):
            axes = node.get_metadata().get("logical_axes")
            sharding = param_sharding(axes, rules, mesh, tuple(value.shape))
        elif isinstance(node, nnx.Param) and isinstance(value, QuantizedWeight):
            node.set_value(jax.device_put(value, quantized_sharding(
                value, node.get_metadata().get("logical_axes"), rules, mesh)))
            continue
        elif isinstance(value, (jax.Array, QuantizedWeight)):
            sharding = _replicated(mesh)
        else:
            continue
        node.set_value(jax.device_put(value, sharding))
    return model


def model_mesh(model_or_state) -> Mesh | None:
    """The mesh a sharded model (or its nnx State) lives on: that of the first parameter placed
    with a NamedSharding over more than one device; None for a single-device model. Lets the
    runner place its KV pages to match without the mesh being passed down to it."""
    state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state
    for leaf in jax.tree.leaves(state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None


# ------------------------------------------------------------------------------------ KV pages

def kv_sharding(mesh: Mesh, n_kv_heads: int) -> NamedSharding:
    """KV pages [n_kv_heads, num_blocks, block_size, head_dim] (and int8 scales [n_kv_heads, ...]):
    kv heads over "tensor" when it divides n_kv_heads, else replicated (GQA with tp > n_kv_heads)."""
    if n_kv_heads % _axis_size(mesh, "tensor"):
        return _replicated(mesh)
    return NamedSharding(mesh, PartitionSpec("tensor"))   # leading dim; the rest replicated


def shard_kv_pages(pages, mesh: Mesh, n_kv_heads: int):
    """Every array of the pages pytree (list of LayerKV) placed with kv_sharding."""
    sharding = kv_sharding(mesh, n_kv_heads)
    return jax.tree.map(lambda x: jax.device_put(x, sharding), pages)


# ------------------------------------------------------------------------------------ accounting

def bytes_per_device(tree) -> dict[Any, int]:
    """Bytes each device holds of a model's parameters (an nnx Module) or of any pytree of arrays,
    summed over each array's addressable shards: a replicated array counts fully on every device,
    a sharded one by its shard."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, nnx.Param)
    out: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


# ------------------------------------------------------------------------------------ loading

def load_sharded(value_fn: Callable[[tuple[slice, ...]], Any] | Any, shape: tuple[int, ...],
                 sharding: jax.sharding.Sharding, dtype=None) -> jax.Array:
    """A global array of `shape` placed with `sharding`, each device's shard read by
    value_fn(index) (index: a tuple of slices, one per dim) and copied straight to that device.

    value_fn may also be an array-like (a numpy memmap, or a lazy view of one such as w.T.reshape(..)),
    sliced as value_fn[index]: only the shard's bytes are read from disk. dtype: cast each shard
    on the host (e.g. bfloat16 via ml_dtypes)."""
    shape = tuple(int(s) for s in shape)
    if not callable(value_fn):
        src = value_fn
        if tuple(src.shape) != shape:
            raise ValueError(f"load_sharded: source has shape {tuple(src.shape)}, expected {shape}")
        value_fn = lambda index: src[index]  # noqa: E731

    def shard(index):
        block = np.asarray(value_fn(index))
        return block.astype(dtype) if dtype is not None and block.dtype != np.dtype(dtype) else block

    return jax.make_array_from_callback(shape, sharding, shard)
