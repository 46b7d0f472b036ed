"""Where a decode call's device time goes, read from a `jax.profiler` trace: device time per kernel,
busy time against the call's wall time, the gaps between kernels, kernels per decoded token, and the
share of the attention kernel, the matmuls, the LM head, the sampler and everything else.

    trace = read_trace(find_trace(log_dir))          # the Chrome-trace JSON jax's profiler writes
    summary = summarize(trace, "decode_call", tokens_per_window=8, hlo_text=client.debug.step_hlo(inputs))

Input: the trace events of `jax.profiler.trace(log_dir)` (its `*.trace.json.gz`, a gzip'd Chrome
trace, or the `*.xplane.pb` turned into the same events by xspace_to_trace), in which the caller
marked each timed call with a host annotation (`jax.profiler.TraceAnnotation(f"{prefix}_{i}")`).

Kernels: on a GPU (a process named "/device:GPU:0"), every event of the device's stream lines, its
memory copies and sets included (not the lines the profiler derives from them, such as "XLA Ops",
which repeat the same time); on
XLA:CPU, which runs its thunks on host threads, the innermost events that name an HLO instruction
(`args.hlo_op`; a while loop's own event spans the thunks inside it). A kernel belongs to the
annotated window its start falls in; kernels outside every window (warm-up) are not counted.

Per window (all times in microseconds):
    wall    = the annotation's duration (launch, device work and the wait for it)
    kernel  = sum of the kernels' durations (more than busy where kernels overlap)
    busy    = length of the union of the kernels' intervals
    gaps    = sum over consecutive kernels (by start) of the idle time between them
    lead    = first kernel's start - window start;  tail = window end - last kernel's end
    so wall = lead + busy + gaps + tail.
Categories, from the HLO instruction a kernel ran (InstructionOf: by the kernel's name or its
recorded `hlo_op`) and the Python stack jax recorded for it in the compiled HLO text
(`client.debug.step_hlo`), first match wins: sampler (jaxinfer/sampling.py), lm_head (Decoder.logits),
attention (jaxinfer/attention.py or a pallas_kernels/*attention* kernel), matmul (a dot, a GEMM
custom call or fusion, or layers.dense), other. A kernel with no instruction (a cuBLAS kernel inside
a GPU command buffer, whose kernels record only the command buffer) is classified by its name alone
(GEMM and attention kernels' names say what they are; an LM head run by cuBLAS then counts as a
matmul); `hlo_mapped_share` says how much of the time had an instruction.

Never imports jax or numpy: the parent process of bench.gpu.decode and the tests read traces here.
"""
from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

CATEGORIES = ("attention", "matmul", "lm_head", "sampler", "other")
# lines the profiler derives from a device's streams: each event repeats time the streams show
DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "TensorFlow Ops", "TensorFlow Name Scope",
                 "Framework Ops", "Framework Name Scope", "Source code", "Steps", "Launch Stats")
_GEMM = re.compile(r"gemm|cublas|matmul|xmma|nvjet|cutlass|\bdot\b|dot_general|^dot", re.I)
_ATTENTION = re.compile(r"attention|attn|flash|ragged", re.I)


@dataclass(frozen=True)
class Kernel:
    name: str
    ts: float            # start, microseconds
    dur: float           # microseconds
    hlo_op: str | None   # the HLO instruction it ran, when the profiler recorded it


@dataclass(frozen=True)
class HloOp:
    """One instruction of the compiled HLO: its opcode, what it calls (a fusion's computation, a
    custom call's target), jax's op_name, and the files and functions of its Python stack."""
    opcode: str
    target: str
    op_name: str
    files: tuple[str, ...]
    functions: tuple[str, ...]


# --------------------------------------------------------------------------- reading a trace
def find_trace(log_dir: str | Path) -> Path | None:
    """The newest Chrome-trace JSON under a jax.profiler log folder, or None."""
    found = [p for pattern in ("*.trace.json.gz", "*perfetto_trace.json.gz", "*.trace.json")
             for p in Path(log_dir).rglob(pattern)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def read_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace as {"traceEvents": [...]} (a bare event list is wrapped)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {"traceEvents": data}


def xspace_to_trace(profile_data: Any) -> dict[str, Any]:
    """jax.profiler.ProfileData (an xplane.pb) as the same Chrome-trace events: a process per
    plane, a thread per line, microseconds, each event's stats as its args."""
    events: list[dict[str, Any]] = []
    for pid, plane in enumerate(profile_data.planes):
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": plane.name}})
        for tid, line in enumerate(plane.lines):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": line.name}})
            for ev in line.events:
                events.append({"ph": "X", "pid": pid, "tid": tid, "name": ev.name, "ts": ev.start_ns / 1e3,
                               "dur": ev.duration_ns / 1e3, "args": {str(k): v for k, v in ev.stats}})
    return {"traceEvents": events}


def _names(events: list[dict]) -> tuple[dict[Any, str], dict[tuple, str]]:
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    return procs, threads


def _is_device(process_name: str) -> bool:
    return "/device:" in process_name or re.search(r"\b(gpu|tpu)\b", process_name.lower()) is not None


def _complete(events: list[dict]) -> Iterable[dict]:
    return (e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e)


def _kernel(e: dict) -> Kernel:
    op = (e.get("args") or {}).get("hlo_op")
    return Kernel(str(e["name"]), float(e["ts"]), float(e["dur"]), str(op) if op else None)


def device_kernels(trace: dict[str, Any]) -> tuple[list[Kernel], str]:
    """(the kernels of the trace by start, which events they are): the module docstring's rules."""
    events = trace.get("traceEvents", [])
    procs, threads = _names(events)
    device_pids = {pid for pid, name in procs.items() if _is_device(name)}
    if not device_pids:
        return _innermost_thunks(events), "host thunks (XLA:CPU): innermost events naming an HLO instruction"
    lines = {k: n for k, n in threads.items() if k[0] in device_pids}
    streams = {k for k, n in lines.items() if n.lower().startswith("stream")}
    chosen = streams or {k for k, n in lines.items() if n not in DERIVED_LINES}
    if not lines:        # no thread names at all: every event of the device's processes
        return (sorted((_kernel(e) for e in _complete(events) if e["pid"] in device_pids), key=lambda k: k.ts),
                "device: every event of the device's processes")
    kernels = sorted((_kernel(e) for e in _complete(events) if (e["pid"], e.get("tid")) in chosen), key=lambda k: k.ts)
    which = "device: stream lines " if streams else "device: lines "
    return kernels, which + ", ".join(sorted(lines[k] for k in chosen))


def _innermost_thunks(events: list[dict]) -> list[Kernel]:
    """XLA:CPU: the events naming an HLO instruction that contain no other such event on their thread."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in _complete(events):
        if (e.get("args") or {}).get("hlo_op") and not str(e["name"]).startswith("end:"):
            by_thread[(e["pid"], e.get("tid"))].append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        for i, e in enumerate(evs):
            nxt = evs[i + 1] if i + 1 < len(evs) else None
            if nxt is None or nxt["ts"] >= e["ts"] + e["dur"]:     # nothing starts inside it
                out.append(_kernel(e))
    return sorted(out, key=lambda k: k.ts)


def annotations(trace: dict[str, Any], prefix: str) -> list[tuple[str, float, float]]:
    """(name, start, end) of the host annotations named prefix or prefix_<i>, by start."""
    pattern = re.compile(rf"{re.escape(prefix)}(_\d+)?$")
    found = [(str(e["name"]), float(e["ts"]), float(e["ts"]) + float(e["dur"]))
             for e in _complete(trace.get("traceEvents", [])) if pattern.match(str(e["name"]))]
    return sorted(found, key=lambda w: w[1])


# --------------------------------------------------------------------------- the compiled HLO
def _section(text: str, name: str) -> list[str]:
    m = re.search(rf"^{name}\n((?:\d+ .*\n?)+)", text, re.M)
    return m.group(1).splitlines() if m else []


def _stack_table(text: str) -> dict[int, tuple[str, str, int]]:
    """stack_frame_id -> (file, function, parent frame id or 0): the tables that end XLA's HLO text.
    Parent ids are printed one higher than the frame ids they name where any frame names itself
    (XLA prints parent_frame_id 1-based, 0 = none); both forms are read."""
    files = {int(l.split(" ", 1)[0]): l.split(" ", 1)[1].strip('"') for l in _section(text, "FileNames")}
    funcs = {int(l.split(" ", 1)[0]): l.split(" ", 1)[1].strip('"') for l in _section(text, "FunctionNames")}
    locs = {}
    for line in _section(text, "FileLocations"):
        m = re.match(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+)", line)
        if m:
            locs[int(m[1])] = (files.get(int(m[2]), ""), funcs.get(int(m[3]), ""))
    raw = {}
    for line in _section(text, "StackFrames"):
        m = re.match(r"(\d+) \{file_location_id=(\d+)(?: parent_frame_id=(\d+))?", line)
        if m:
            raw[int(m[1])] = (int(m[2]), int(m[3] or 0))
    shift = 1 if any(parent == fid for fid, (_, parent) in raw.items()) else 0
    return {fid: (*locs.get(loc, ("", "")), max(parent - shift, 0)) for fid, (loc, parent) in raw.items()}


def _stack(frames: dict[int, tuple[str, str, int]], fid: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    files, funcs, seen = [], [], set()
    while fid in frames and fid not in seen:
        seen.add(fid)
        file, func, fid = frames[fid]
        files.append(file)
        funcs.append(func)
    return tuple(files), tuple(funcs)


_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+) = (.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+) \(.*\{\s*$")


def _instruction(rest: str) -> tuple[str, str, str, int | None, str | None]:
    """(opcode, called computation or custom-call target, op_name, stack frame id, source file) of an
    instruction's text after its `name = `."""
    opcode = re.search(r"(?<![\w\-.$])([a-z][a-z0-9\-]*)\(", rest)
    target = re.search(r'custom_call_target="([^"]*)"|calls=%?([\w.\-]+)', rest)
    op_name = re.search(r'op_name="([^"]*)"', rest)
    frame = re.search(r"stack_frame_id=(\d+)", rest)
    source = re.search(r'source_file="([^"]*)"', rest)
    return (opcode[1] if opcode else "", (target[1] or target[2]) if target else "", op_name[1] if op_name else "",
            int(frame[1]) if frame else None, source[1] if source else None)


def parse_hlo(text: str) -> dict[str, HloOp]:
    """HLO instruction name -> HloOp, from a compiled module's text (Compiled.as_text()). An
    instruction without metadata of its own (many fusions) takes that of the computation it calls:
    its root's, else its first instruction's that has a Python stack."""
    frames = _stack_table(text)
    raw: dict[str, tuple] = {}
    called: dict[str, tuple] = {}       # computation -> (op_name, frame, source) standing for it
    computation = ""
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and " = " not in line:
            computation = head[1]
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        is_root, name, rest = m.groups()
        fields = _instruction(rest)
        raw[name] = fields
        meta = fields[2:]
        if meta[0] or meta[1] is not None:
            if is_root or computation not in called:
                called[computation] = meta
    ops = {}
    for name, (opcode, target, op_name, frame, source) in raw.items():
        if not op_name and frame is None and target in called:
            op_name, frame, source = called[target]
        files, funcs = _stack(frames, frame) if frame is not None else ((source,) if source else (), ())
        ops[name] = HloOp(opcode, target, op_name, files, funcs)
    return ops


WRAPPERS = ("call", "while", "conditional")     # instructions that run others' kernels, not their own


class InstructionOf:
    """Which HLO instruction a kernel ran: the instruction of its own name (XLA:CPU names each thunk
    after it; XLA:GPU names a fusion's kernel after it with "." and "-" as "_"), else its recorded
    `hlo_op` unless that is a wrapper (a GPU command buffer's kernels record the command buffer's
    call, which holds many), else none (a library kernel in a command buffer: cuBLAS, cuDNN)."""

    def __init__(self, ops: dict[str, HloOp]):
        self.ops = ops
        sanitized: dict[str, list[str]] = defaultdict(list)
        for name in ops:
            sanitized[re.sub(r"[.\-]", "_", name)].append(name)
        self.by_kernel_name = {k: names[0] for k, names in sanitized.items() if len(names) == 1}

    def __call__(self, kernel: Kernel) -> str | None:
        if kernel.name in self.ops:
            return kernel.name
        if kernel.name in self.by_kernel_name:
            return self.by_kernel_name[kernel.name]
        op = self.ops.get(kernel.hlo_op) if kernel.hlo_op else None
        if op is None or op.opcode in WRAPPERS or "command_buffer" in kernel.hlo_op:
            return None
        return kernel.hlo_op


def category(kernel_name: str, op: HloOp | None) -> str:
    """One of CATEGORIES for a kernel (the module docstring's rules)."""
    if op is None:
        if _ATTENTION.search(kernel_name):
            return "attention"
        return "matmul" if _GEMM.search(kernel_name) else "other"
    if any(f.endswith("sampling.py") for f in op.files):
        return "sampler"
    if any(f == "Decoder.logits" or f.endswith(".logits") for f in op.functions):
        return "lm_head"
    if any(f.endswith("jaxinfer/attention.py") or ("pallas_kernels" in f and "attention" in Path(f).name)
           for f in op.files):
        return "attention"
    if (op.opcode in ("dot", "convolution") or "dense" in op.functions
            or _GEMM.search(f"{op.target} {kernel_name}") or op.op_name.endswith("dot_general")):
        return "matmul"
    return "other"


# --------------------------------------------------------------------------- the summary
def window_stats(kernels: list[Kernel], start: float, end: float) -> dict[str, float]:
    """One window's wall, kernel, busy, gaps, lead and tail microseconds and its kernel count
    (kernels sorted by start)."""
    busy = gaps = 0.0
    run_start = run_end = None
    for k in kernels:
        s, e = k.ts, k.ts + k.dur
        if run_end is None:
            run_start, run_end = s, e
        elif s > run_end:
            busy += run_end - run_start
            gaps += s - run_end
            run_start, run_end = s, e
        else:
            run_end = max(run_end, e)
    if run_end is not None:
        busy += run_end - run_start
    first = kernels[0].ts if kernels else end
    last = max((k.ts + k.dur for k in kernels), default=end)
    return {"wall_us": end - start, "kernel_us": sum(k.dur for k in kernels), "busy_us": busy, "gaps_us": gaps,
            "lead_us": first - start, "tail_us": end - last, "kernels": len(kernels)}


def group_name(kernel_name: str) -> str:
    """A kernel's name with its copy numbers dropped (fusion.12, loop_add_fusion_3 -> one group)."""
    return re.sub(r"([._]\d+)+$", "", kernel_name) or kernel_name


def _ranking(totals: dict[str, list], windows: int, grand: float, top: int) -> list[dict[str, Any]]:
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": name, "us": us, "us_per_window": us / windows, "count": count,
             "share": us / grand if grand else None, "category": max(cats, key=cats.get),
             "category_us": dict(cats), "hlo_op": instruction} for name, (us, count, cats, instruction) in ranked]


def summarize(trace: dict[str, Any], prefix: str, tokens_per_window: float, hlo_text: str | None = None,
              top: int = 30) -> dict[str, Any]:
    """The per-op summary of the windows annotated `prefix`[_i] (the module docstring's numbers);
    per-window figures are means over the windows, `windows` lists each one."""
    spans = annotations(trace, prefix)
    if not spans:
        raise ValueError(f"the trace has no host annotation named {prefix!r} or {prefix}_<i>")
    ops = parse_hlo(hlo_text) if hlo_text else {}
    kernels, source = device_kernels(trace)
    starts = [w[1] for w in spans]
    inside: list[list[Kernel]] = [[] for _ in spans]
    for k in kernels:
        i = bisect.bisect_right(starts, k.ts) - 1
        if i >= 0 and k.ts <= spans[i][2]:
            inside[i].append(k)
    per_window = [{"name": name} | window_stats(ks, s, e) for (name, s, e), ks in zip(spans, inside)]
    by_name: dict[str, list] = {}
    by_group: dict[str, list] = {}
    by_cat = {c: 0.0 for c in CATEGORIES}
    mapped = 0.0
    instruction_of = InstructionOf(ops)
    for k in (k for ks in inside for k in ks):
        instruction = instruction_of(k)
        mapped += k.dur if instruction is not None else 0.0
        cat = category(k.name, ops.get(instruction) if instruction else None)
        by_cat[cat] += k.dur
        for table, key in ((by_name, k.name), (by_group, group_name(k.name))):
            entry = table.setdefault(key, [0.0, 0, defaultdict(float), instruction or k.hlo_op])
            entry[0] += k.dur
            entry[1] += 1
            entry[2][cat] += k.dur
    return {"kernel_events": source} | _summary(per_window, by_name, by_group, by_cat, mapped, tokens_per_window, top)


def _summary(per_window: list[dict], by_name: dict, by_group: dict, by_cat: dict, mapped: float,
             tokens_per_window: float, top: int) -> dict[str, Any]:
    n = len(per_window)
    total = {k: sum(w[k] for w in per_window) for k in ("wall_us", "kernel_us", "busy_us", "gaps_us",
                                                         "lead_us", "tail_us", "kernels")}
    grand = total["kernel_us"]
    return {
        "num_windows": n, "tokens_per_window": tokens_per_window,
        **{k: v / n for k, v in total.items() if k != "kernels"},
        "kernels_per_window": total["kernels"] / n,
        "kernels_per_token": total["kernels"] / (n * tokens_per_window) if tokens_per_window else None,
        "busy_fraction": total["busy_us"] / total["wall_us"] if total["wall_us"] else None,
        "num_kernel_names": len(by_name),
        "kernels": _ranking(by_name, n, grand, top),
        "kernel_groups": _ranking(by_group, n, grand, top),
        "categories": {c: {"us_per_window": us / n, "share": us / grand if grand else None}
                       for c, us in by_cat.items()},
        "hlo_mapped_share": mapped / grand if grand else None,
        "windows": per_window,
    }
