"""Multi-host serving through jax.distributed: process 0 schedules, every process runs every step.

    group = initialize("10.0.0.1:1234", num_processes=2, process_id=i)   # or the JAXINFER_* env vars
    # Generator.from_pretrained(..., coordinator_address=, num_processes=, process_id=) calls it

Process 0 (the leader) owns the scheduler, the block manager, detokenization and the API. The one
jitted step (runner.ModelRunner._step_impl) is a multi-process SPMD program over a mesh holding
devices of every process, so every process must run it, in the same order, on the same host
inputs. Before the leader runs a program it publishes that program's host inputs (the numpy arrays
of the runner's host-to-device contract: tokens, positions, AttentionMetadata, logits_indices,
SamplingBatch) as message k in the jax.distributed coordination service's key-value store; the
other processes (followers) wait for message k, decode it and call the same executable. They never
read the results: the sampled ids (and gen.logits rows) are constrained to be replicated, and only
the leader fetches them. Message "stop" ends a follower's loop (Generator.close, also run at exit
on the leader). Weights need no messages: every process builds the same global arrays with
jax.make_array_from_callback (weights.load_hf) or orbax (load_native), reading only the shards of
its own devices.

Before anything is loaded, every process states its settings (EngineConfig, token budget, a hash
of the model's config.json) and all refuse to start if any differs from process 0's: mismatched
programs would hang in their collectives instead of failing. If a process dies, jax's
coordination service terminates the others (its heartbeat), so no follower waits forever.

Why the key-value store and not multihost_utils.broadcast_one_to_all: the store lives on the host
(gRPC to the coordinator on process 0), so sending a step compiles nothing (after warm-up, zero
compilations on every process) and costs no device collective; broadcast_one_to_all compiles one
psum per input shape and all-reduces the payload across all devices.

Why deleting message k when publishing k + 1 is safe: every message except "stop" starts a program
with collectives over all processes' devices, and the leader publishes k + 1 only after it has
read program k's results, which needed every follower to launch program k, hence to have read
message k.

Warm-up needs no messages: every process compiles the same buckets in the same order.
This module imports jax only; it must run before any other jax call of the process (jax's rule).
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import weakref
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np

__all__ = ["ENV_VARS", "ProcessGroup", "initialize", "check_mesh_spans_processes", "StepChannel", "encode",
           "decode", "step_arrays", "step_inputs"]

ENV_VARS = {"coordinator_address": "JAXINFER_COORDINATOR_ADDRESS", "num_processes": "JAXINFER_NUM_PROCESSES",
            "process_id": "JAXINFER_PROCESS_ID"}
FLAGS = {"coordinator_address": "--coordinator-address", "num_processes": "--num-processes",
         "process_id": "--process-id"}
_POLL_MS = 5000            # a follower's wait is a loop of long polls: an idle server is fine
_COMPRESS_ABOVE = 1 << 16  # bytes; penalty histories ([S, max_model_len], mostly -1) shrink ~100x
_sessions = itertools.count()   # one channel per Generator; processes create them in the same order


@dataclass(frozen=True)
class ProcessGroup:
    coordinator_address: str
    num_processes: int
    process_id: int

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


def _resolve(coordinator_address: str | None, num_processes: int | None,
             process_id: int | None) -> ProcessGroup | None:
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    for name, env in ENV_VARS.items():
        if given[name] is None and os.environ.get(env):
            given[name] = os.environ[env]
    if all(v is None for v in given.values()):
        return None
    missing = [f"{name} ({FLAGS[name]} or ${ENV_VARS[name]})" for name, v in given.items() if v is None]
    if missing:
        raise ValueError(f"multi-host serving needs all of coordinator_address, num_processes and process_id; "
                         f"missing: {', '.join(missing)}")
    ints = {}
    for name in ("num_processes", "process_id"):
        try:
            ints[name] = int(given[name])
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer, got {given[name]!r}") from None
    n, pid = ints["num_processes"], ints["process_id"]
    if n < 1 or not 0 <= pid < n:
        raise ValueError(f"process_id must be in [0, num_processes), got process_id={pid}, num_processes={n}")
    addr = str(given["coordinator_address"])
    if ":" not in addr:
        raise ValueError(f"coordinator_address must be host:port (process 0's address), got {addr!r}")
    return ProcessGroup(addr, n, pid)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout_s: int = 300) -> ProcessGroup | None:
    """Join the process group through jax.distributed.initialize. Arguments left None are read from
    $JAXINFER_COORDINATOR_ADDRESS, $JAXINFER_NUM_PROCESSES, $JAXINFER_PROCESS_ID; none of the three
    anywhere -> None (one process). A one-process group is a plain single process (None).
    Already initialized by the caller with the same group: accepted as is."""
    group = _resolve(coordinator_address, num_processes, process_id)
    if group is None or group.num_processes == 1:
        return None
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (group.num_processes, group.process_id):
            raise ValueError(f"jax.distributed is already initialized as process {jax.process_index()} of "
                             f"{jax.process_count()}, not {group.process_id} of {group.num_processes}")
        return group
    # cross-process collectives on CPU hosts (the default in jax 0.10; None would mean "no collectives")
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(group.coordinator_address, group.num_processes, group.process_id,
                                   initialization_timeout=timeout_s)
    except RuntimeError as e:
        if "must be called before" in str(e):
            raise RuntimeError("multi-host serving: jax.distributed must start before any other jax call in "
                               "this process (create the Generator first, or call "
                               "jaxinfer.distributed.initialize first)") from e
        raise
    return group


def check_mesh_spans_processes(mesh) -> None:
    """Every process must hold devices of the mesh: a process without any would have no share of
    the model and nothing to run."""
    owners = set() if mesh is None else {d.process_index for d in mesh.devices.flat}
    if owners != set(range(jax.process_count())):
        raise ValueError(f"multi-host serving shards the model over the devices of every process: set "
                         f"tensor_parallel to {jax.device_count()} ({jax.process_count()} processes x "
                         f"{jax.local_device_count()} devices), got a mesh over "
                         f"{'1 device' if mesh is None else f'{mesh.size} devices'} of process(es) {sorted(owners)}")


def _client():
    # The coordination service's key-value store has no public accessor in jax 0.10
    # (multihost_utils reaches it the same way).
    from jax._src import distributed as jax_distributed
    client = jax_distributed.global_state.client
    assert client is not None, "jax.distributed is not initialized"
    return client


# ------------------------------------------------------------------------------- messages

def encode(kind: str, arrays: Sequence[np.ndarray | None]) -> bytes:
    """One message: a JSON header (kind; dtype and shape of each array, or null) + raw bytes."""
    specs, chunks = [], []
    for a in arrays:
        if a is None:
            specs.append(None)
            continue
        a = np.asarray(a)      # (np.ascontiguousarray would make a 0-d array 1-d)
        assert a.dtype.kind in "biuf", f"cannot send dtype {a.dtype}"
        specs.append([a.dtype.str, list(a.shape)])
        chunks.append(a.tobytes())   # C order whatever the layout
    body = b"".join(chunks)
    packed = len(body) > _COMPRESS_ABOVE
    header = json.dumps({"kind": kind, "arrays": specs, "zlib": packed}).encode()
    return len(header).to_bytes(4, "little") + header + (zlib.compress(body, 1) if packed else body)


def decode(message: bytes) -> tuple[str, list[np.ndarray | None]]:
    n = int.from_bytes(message[:4], "little")
    header = json.loads(message[4: 4 + n])
    body = message[4 + n:]
    if header["zlib"]:
        body = zlib.decompress(body)
    arrays, offset = [], 0
    for spec in header["arrays"]:
        if spec is None:
            arrays.append(None)
            continue
        dtype, shape = np.dtype(spec[0]), tuple(spec[1])
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        arrays.append(np.frombuffer(body, dtype, count=size // dtype.itemsize, offset=offset).reshape(shape))
        offset += size
    assert offset == len(body), "message length does not match its header"
    return header["kind"], arrays


def step_arrays(inputs) -> list[np.ndarray | None]:
    """A step's StepInputs as a flat list of host arrays (its pytree leaves, in order). A device
    array (the runner's cached empty penalty history, all-allowed mask, no-bias arrays) is sent as None:
    the follower uses its own."""
    return [None if isinstance(x, jax.Array) else np.asarray(x) for x in jax.tree.leaves(inputs)]


def step_inputs(arrays: list, treedef):
    """Inverse of step_arrays, given the StepInputs treedef (ModelRunner.empty_inputs has it)."""
    return jax.tree.unflatten(treedef, arrays)


# ------------------------------------------------------------------------------- the channel

class StepChannel:
    """Numbered messages from process 0 to all others through the coordination service.

    Leader: publish(kind, arrays) before running each multi-process program; close() once.
    Follower: follow({kind: handler}) runs handler(*arrays) per message until "stop"."""

    def __init__(self, group: ProcessGroup, timeout_s: int = 300):
        self.group = group
        self.timeout_s = timeout_s
        self._prefix = f"jaxinfer/{next(_sessions)}"
        self._seq = 0
        self._closed = False
        self._client = _client()
        if group.is_leader:   # followers must not wait forever if the caller never closes
            atexit.register(_close_at_exit, weakref.ref(self))

    def check_same(self, name: str, settings: dict) -> None:
        """Every process states its settings (whatever decides which programs it compiles and runs);
        raise ValueError on every process if any differs from process 0's. Runs before the first
        multi-process program, which would otherwise hang or fail on a mismatch."""
        key = f"{self._prefix}/{name}"
        self._client.key_value_set(f"{key}/{self.group.process_id}", json.dumps(settings, sort_keys=True, default=str))
        stated = [json.loads(self._client.blocking_key_value_get(f"{key}/{p}", self.timeout_s * 1000))
                  for p in range(self.group.num_processes)]
        differ = {f"process {p}": {k: v for k, v in s.items() if stated[0].get(k) != v}
                  for p, s in enumerate(stated) if s != stated[0]}
        if differ:
            raise ValueError(f"multi-host: {name} differ from process 0's {stated[0]}: {differ}; start every "
                             "process with the same model and engine settings")

    @property
    def closed(self) -> bool:
        return self._closed

    # ---------------------------------------------------------------- leader
    def publish(self, kind: str, arrays: Sequence[np.ndarray | None] = ()) -> None:
        assert self.group.is_leader and not self._closed
        self._client.key_value_set_bytes(f"{self._prefix}/msg/{self._seq}", encode(kind, arrays))
        if self._seq:   # read by every follower already (module docstring)
            self._client.key_value_delete(f"{self._prefix}/msg/{self._seq - 1}")
        self._seq += 1

    def close(self) -> None:
        """Send "stop" (once): every follower's follow() returns."""
        if self.group.is_leader and not self._closed:
            self.publish("stop")
            self._closed = True

    # ---------------------------------------------------------------- followers
    def receive(self) -> tuple[str, list[np.ndarray | None]]:
        assert not self.group.is_leader
        key = f"{self._prefix}/msg/{self._seq}"
        while True:
            try:
                message = self._client.blocking_key_value_get_bytes(key, _POLL_MS)
                break
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise   # the coordinator (process 0) is gone
        self._seq += 1
        return decode(message)

    def follow(self, handlers: dict[str, Callable[..., object]]) -> int:
        """Run each message's handler until "stop"; returns the number of messages run."""
        done = 0
        while True:
            kind, arrays = self.receive()
            if kind == "stop":
                self._closed = True
                return done
            handlers[kind](*arrays)
            done += 1


def _close_at_exit(ref: "weakref.ref[StepChannel]") -> None:
    channel = ref()
    if channel is not None:
        try:
            channel.close()
        except Exception:   # the coordination service may already be down; nothing left to tell
            pass
