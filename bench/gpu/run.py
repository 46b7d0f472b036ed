"""`python -m bench.gpu` (= `jaxinfer bench gpu`): everything GPU-specific, measured in one command.

    python -m bench.gpu [--parts ceilings,bf16,hf,kernels,int8,fp8,int4] [--deadline-s 540] [--out PATH]
                        [--autotune] [--log-dir DIR] [--no-plot]
    python -m bench.gpu --smoke [--out PATH]     every part on CPU with tiny shapes (tests/test_bench_gpu.py)
    python -m bench.gpu --table FILE.json        the README's GPU table, in markdown, from a results JSON
On a lent GPU machine, whose bench/results/ does not come back: --out $OUT/gpu.json --log-dir $OUT/logs.

Parts, in this order (bench/gpu/parts.py has what each measures and how it times kernels):
    ceilings   device-to-device copy GB/s (bytes read + written) and bf16 matmul TFLOP/s
    bf16       the Llama-3-8B-shaped random model through Generator: batch-1 decode tok/s and TPOT
               (N / (t(N+1 tokens) - t(1 token)), medians), output tok/s with 16 / 64 / 256 requests
               submitted at once (wall time includes prefill), cold-compile seconds
    hf         HF transformers (eager, sdpa, bf16) on the same shapes at batch 1 and 64, if torch imports
    kernels    flash attention vs cuDNN and XLA at 2k / 8k / 32k tokens; Pallas int8 / int4 weight-only
               matmuls vs XLA's dequantize-and-dot and the bf16 dot at M = 1 / 16 / 128 on the 8B projections
    int8 fp8 int4   the bf16 part's measurements with quantized weights (int4 last: the slowest to compile)
Each part runs in its own subprocess with its own timeout, so an 8B model and its KV pool are freed
between parts and a hang or an OOM loses one part only; a part records each number as it gets it, and
after each part this process rewrites the JSON with everything so far (derived numbers included), so a
run killed at the deadline keeps what it measured. Ratios and MBU: bench/gpu/report.py.

Every part runs with the persistent XLA compilation cache off (JAXINFER_COMPILATION_CACHE=off and
jax_enable_compilation_cache False: cold-compile numbers are cold) and, unless --autotune, Pallas
autotuning off (JAXINFER_AUTOTUNE=0: every quantized matmul runs the kernel's default launch config,
the same in every part and run; on the probe, tuning took ~22 s of the int8 variant's first request,
more than three quantized variants can spend in 8 minutes); with --autotune each part tunes into a
fresh cache file of its own (within the autotuner's measuring budget), so its cold compile includes it.

--smoke runs the same code with tiny shapes on CPU (JAX_PLATFORMS=cpu, Pallas interpreted, torch on CPU);
only cuDNN (recorded as unavailable) and nvidia-smi cannot exist there.

Output: bench/results/<date>-<device>-gpu.json (or --out) and a PNG beside it. JSON keys: benchmark, date,
time, command, smoke, device {kind, platform, count}, driver (nvidia-smi), versions, workload (every shape),
settings {parts, deadline_s, caps_s, autotune, compilation_cache, pallas_autotune, engine, log_dir},
parts {<part>: {status (ok |
failed | timeout | skipped | interrupted), wall_s, timeout_s, returncode, errors, unavailable, log,
results}}, derived (bench/gpu/report.derive: MBU, every ratio), total_wall_s.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench.common import device_slug, results_path, write_json_atomic
from bench.gpu.records import read_records
from bench.gpu.report import derive, markdown, plot
from bench.gpu.workload import REAL, SMOKE, Workload

REPO = Path(__file__).resolve().parents[2]   # the repository (this file is bench/gpu/run.py)
PARTS = ("ceilings", "bf16", "hf", "kernels", "int8", "fp8", "int4")
# Seconds each part may take in the real run: 505 of the 540 s deadline (the parent keeps its last
# 15 s: JSON, PNG; 20 s are spare). From the 2026-11-26 H200 probe (/work/shared/gpu/results), with ~1.4x for
# an H100's lower bandwidth where decode dominates:
#   ceilings  ~10 s: process + CUDA start ~5 s, three 2 GiB copies and a chain of 8192^3 matmuls
#   bf16      ~60 s: build 6 s, first request 5-13 s, batch 1 ~5 s, 16 / 64 requests 17 + 7 s
#             (compile + run), 256 requests ~15 s (its decode shapes compile, then ~3 s of work)
#   hf        ~30 s: torch import ~8 s, batch 1 (3 x 2.4 s + warm-up) ~10 s, batch 64 ~8 s
#   kernels   ~75 s: ~60 compiled matmul chains at ~0.5-1 s each (probe: 5 compiles per 2.4-4 s),
#             attention ~15 s
#   int8 / fp8 / int4  ~80 s each: build 8-9 s (quantization), compile without autotuning,
#             the bf16 part's workload (the 2026-12-04 H200 run: int8 reached 64 requests at 61 s,
#             its 71 s cap cut it before 256; bf16 took 77 s in all)
# A part also gets the time earlier parts left unused (up to twice its cap), so int4, the least
# known compile, runs last with the most slack.
PART_CAPS_S = {"ceilings": 25, "bf16": 90, "hf": 45, "kernels": 95, "int8": 85, "fp8": 80, "int4": 85}
PARENT_RESERVE_S = 15
MIN_PART_S = 5


# --------------------------------------------------------------------------- the run's facts
def nvidia_smi() -> dict[str, Any]:
    """The first GPU's name, driver and memory from nvidia-smi, or {"unavailable": why}."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"unavailable": "nvidia-smi is not on PATH"}
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        name, driver, memory = [s.strip() for s in out.splitlines()[0].split(",")]
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        return {"unavailable": f"nvidia-smi failed: {e}"}
    return {"name": name, "driver_version": driver, "memory_total": memory}


def versions() -> dict[str, str | None]:
    names = ["jax", "jaxlib", "flax", "numpy", "torch", "transformers", "matplotlib"]
    names += sorted({d.metadata["Name"] for d in importlib.metadata.distributions()
                     if (d.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax_cuda"))})
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def the_command() -> str:
    """How this process was started, as a shell line (`python -m bench.<script> ...` for the bench scripts)."""
    argv0 = Path(sys.argv[0])
    names = argv0.with_suffix("").parts
    if "bench" in names[:-1]:   # bench/<script>.py, bench/gpu/<script>.py, bench/gpu/__main__.py
        module = names[len(names) - 1 - names[::-1].index("bench"):]
        head = ["python", "-m", ".".join(module[:-1] if module[-1] == "__main__" else module)]
    else:
        head = {"cli.py": ["python", "-m", "jaxinfer.cli"]}.get(argv0.name, [argv0.name])
    return shlex.join(head + sys.argv[1:])


def initial_device(smoke: bool, driver: dict[str, Any]) -> dict[str, Any]:
    """The device before any part ran (for the file name): nvidia-smi's GPU, or jax's in a subprocess
    (this process never starts a device backend: it would hold the GPU's memory from the parts)."""
    if smoke:
        return {"kind": "cpu", "platform": "cpu"}
    if "name" in driver:
        return {"kind": driver["name"], "platform": "gpu"}
    code = "import jax, json; d = jax.devices()[0]; print(json.dumps({'kind': d.device_kind, 'platform': d.platform}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        raise RuntimeError(f"could not ask jax for the device: {out.stderr.strip()[-500:]}")
    device = json.loads(out.stdout.strip().splitlines()[-1])
    if device["platform"] == "cpu":
        raise RuntimeError("no GPU is visible (nvidia-smi missing, jax sees only a CPU): the real shapes "
                           "need a GPU; run with --smoke for the CPU check")
    return device


def part_timeouts(parts: list[str], deadline_s: float, part_caps: dict[str, float] | None = None) -> dict[str, float]:
    """Caps (default: this script's PART_CAPS_S) scaled down when the deadline (less the parent's
    reserve) is shorter than their sum."""
    caps = {p: float((part_caps or PART_CAPS_S)[p]) for p in parts}
    room = max(deadline_s - PARENT_RESERVE_S, 0.0)
    scale = min(1.0, room / sum(caps.values())) if caps else 1.0
    return {p: c * scale for p, c in caps.items()}


def part_timeout(part: str, later: list[str], caps: dict[str, float], left_s: float) -> float:
    """What part may use now: the time left less the later parts' caps, at most twice its own cap."""
    return min(left_s - sum(caps[p] for p in later), 2 * caps[part])


# --------------------------------------------------------------------------- running a part
def worker_env(smoke: bool, autotune: bool, run_dir: Path, part: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAXINFER_COMPILATION_CACHE"] = "off"
    env["JAXINFER_AUTOTUNE"] = "1" if autotune else "0"
    env["JAXINFER_AUTOTUNE_CACHE"] = str(run_dir / f"autotune-{part}.json")   # fresh: tuning is cold too
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""          # torch too
        # a code-path check, not a measurement: LLVM's backend optimisation is most of XLA:CPU's
        # compile time (as tests/conftest.py sets for the suite)
        if "--xla_backend_optimization_level" not in env.get("XLA_FLAGS", ""):
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    else:
        env["JAX_PLATFORMS"] = "cuda"             # fail at once rather than run 8B shapes on a CPU
    return env


def flags(results: Any, path: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """(errors, unavailable) recorded anywhere in a part's results, each as 'key/path: message'."""
    errors, unavailable = [], []
    if isinstance(results, dict):
        where = "/".join(path) or "part"
        if "error" in results:
            errors.append(f"{where}: {results['error']}")
        if "unavailable" in results:
            unavailable.append(f"{where}: {results['unavailable']}")
        for k, v in results.items():
            e, u = flags(v, path + (k,))
            errors += e
            unavailable += u
    return errors, unavailable


def log_tail(log: Path, lines: int = 25) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def die_with_parent() -> None:
    """In a part's process before it starts: SIGKILL when this process dies (Linux prctl
    PR_SET_PDEATHSIG), so no part outlives a run that was killed and holds the GPU."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def run_worker(part: str, timeout: float, smoke: bool, autotune: bool, run_dir: Path,
               module: str = "bench.gpu", env: dict[str, str] | None = None) -> dict[str, Any]:
    """One part in its own process group (`python -m <module> --worker <part>`), killed at its
    timeout; -> the part's JSON entry. env: the part's environment (default: worker_env's)."""
    records, log = run_dir / f"{part}.jsonl", run_dir / f"{part}.log"
    records.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", module, "--worker", part, "--records", str(records)] + (["--smoke"] if smoke else [])
    t0 = time.monotonic()
    status, rc = "ok", None
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env or worker_env(smoke, autotune, run_dir, part),
                                stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent if sys.platform == "linux" else None)
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
        except BaseException:      # SIGTERM / Ctrl-C of this process: stop the part, keep its records
            status = "interrupted"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)     # the part's own process group (start_new_session)
                proc.wait(timeout=60)
    results = read_records(records)
    errors, unavailable = flags(results)
    if status == "timeout":
        errors.insert(0, f"killed at its {timeout:.0f} s timeout (what it recorded before is kept)")
    elif status == "interrupted":
        errors.insert(0, "interrupted (the run was stopped)")
    elif rc != 0:
        errors.insert(0, f"exited with status {rc}; log tail:\n{log_tail(log)}")
    return {"status": status, "wall_s": time.monotonic() - t0, "timeout_s": timeout, "returncode": rc,
            "errors": errors, "unavailable": unavailable, "log": str(log), "results": results}


# --------------------------------------------------------------------------- the run
def new_report(args: argparse.Namespace, wl: Workload, parts: list[str], caps: dict[str, float],
               driver: dict[str, Any], device: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    return {
        "benchmark": "gpu", "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
        "command": the_command(), "smoke": bool(args.smoke), "device": device, "driver": driver,
        "versions": versions(), "workload": dataclasses.asdict(wl) | {"max_model_len": wl.max_model_len,
                                                                      "num_blocks": wl.num_blocks},
        "settings": {"parts": parts, "deadline_s": args.deadline_s, "caps_s": caps, "autotune": bool(args.autotune),
                     "compilation_cache": "off in every part (JAXINFER_COMPILATION_CACHE=off, "
                                          "jax_enable_compilation_cache=False): compile times are cold",
                     "pallas_autotune": ("on, a fresh cache file per part, budget $JAXINFER_AUTOTUNE_BUDGET_S="
                                         f"{os.environ.get('JAXINFER_AUTOTUNE_BUDGET_S', 'default')}" if args.autotune
                                         else "off (JAXINFER_AUTOTUNE=0): the kernels' default launch configs"),
                     "engine": "attention=pallas, prefix caching off, greedy, ignore_eos, random prompt ids",
                     "log_dir": str(log_dir)},
        "parts": {}, "derived": {},
    }


def refresh(report: dict[str, Any], out: Path, png: bool) -> None:
    """Take the device from a jax part, recompute the derived numbers, rewrite the JSON atomically
    (and the PNG: a run killed later keeps both)."""
    take_device(report, [p for p in PARTS if p != "hf"])      # the hf part's device is torch's
    report["derived"] = derive(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    if png:
        try:
            plot(report, out.with_suffix(".png"))
            report.pop("plot_error", None)
        except Exception as e:  # noqa: BLE001 -- the JSON is what matters
            report["plot_error"] = f"{type(e).__name__}: {e}"
    write_json_atomic(report, out)


def stop_on_sigterm() -> None:
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:      # not the main thread: nothing to install
        pass


def open_run(args: argparse.Namespace, name: str) -> tuple[float, Any, dict[str, Any], Path, Path]:
    """What every GPU bench driver opens with: (start time, the driver as nvidia-smi reports it, the
    first device, the results JSON's path: --out or bench/results/<date>-<gpu>-<name>.json, the log
    folder: --log-dir or a fresh temporary one)."""
    t_start = time.monotonic()
    driver = nvidia_smi()
    device = initial_device(args.smoke, driver)
    out = Path(args.out) if args.out else results_path(None, device_slug(device), name)
    given = getattr(args, "log_dir", None)
    log_dir = Path(given) if given else Path(tempfile.mkdtemp(prefix=f"jaxinfer-bench-{name}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return t_start, driver, device, out, log_dir


def run(args: argparse.Namespace) -> Path:
    """Every selected part in order, the JSON rewritten after each; -> the JSON's path."""
    wl = SMOKE if args.smoke else REAL
    parts = parse_parts(args.parts)
    t_start, driver, device, out, log_dir = open_run(args, "gpu")
    caps = part_timeouts(parts, args.deadline_s)
    report = new_report(args, wl, parts, caps, driver, device, log_dir)
    stop_on_sigterm()
    print(f"bench.gpu: parts {', '.join(parts)}; deadline {args.deadline_s:.0f} s; JSON {out}; logs {log_dir}",
          flush=True)
    run_parts(report, parts, caps, args.deadline_s, t_start,
              lambda part, timeout: run_worker(part, timeout, args.smoke, args.autotune, log_dir),
              lambda report: refresh(report, out, args.plot))
    return out


def run_parts(report: dict[str, Any], parts: list[str], caps: dict[str, float], deadline_s: float,
              t_start: float, launch: Callable[[str, float], dict[str, Any]],
              save: Callable[[dict[str, Any]], None]) -> None:
    """The parent's loop of every bench script whose parts run in processes of their own: each part
    in order gets the time left less the later parts' caps (part_timeout; under MIN_PART_S it is
    recorded as skipped, not run), launch(part, timeout) runs it and returns its entry, save(report)
    rewrites the results after each part; an interrupted part (SIGTERM / Ctrl-C) stops the run."""
    for i, part in enumerate(parts):
        left = deadline_s - PARENT_RESERVE_S - (time.monotonic() - t_start)
        timeout = part_timeout(part, parts[i + 1:], caps, left)
        if timeout < MIN_PART_S:
            entry = {"status": "skipped", "wall_s": 0.0, "timeout_s": timeout, "returncode": None,
                     "errors": [f"not run: {max(left, 0):.0f} s were left before the deadline"],
                     "unavailable": [], "results": {}}
        else:
            entry = launch(part, timeout)
        report["parts"][part] = entry
        report["total_wall_s"] = time.monotonic() - t_start
        save(report)
        print(f"  {part:12s} {entry['status']:11s} {entry['wall_s']:6.1f} s (limit {timeout:.0f} s)"
              + "".join(f"\n    error: {e.splitlines()[0][:300]}" for e in entry["errors"]), flush=True)
        if entry["status"] == "interrupted":
            break


def take_device(report: dict[str, Any], parts: tuple[str, ...] | list[str]) -> None:
    """The report's device from the first of `parts` whose results recorded one (jax's view of it)."""
    for part in parts:
        dev = report["parts"].get(part, {}).get("results", {}).get("device")
        if isinstance(dev, dict) and "kind" in dev:
            report["device"] = dev
            return


def parse_parts(text: str | None, choices: tuple[str, ...] = PARTS) -> list[str]:
    """A comma-separated subset of choices (None or empty: all of them), in the choices' order."""
    if not text:
        return list(choices)
    asked = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in asked if p not in choices]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; choose from {', '.join(choices)}")
    return [p for p in choices if p in asked]


# --------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `python -m bench.gpu` and `jaxinfer bench gpu`."""
    p.add_argument("--parts", default=None, help=f"comma-separated subset of {','.join(PARTS)} (default: all, "
                                                 "run in that order)")
    p.add_argument("--deadline-s", type=float, default=540.0, help="the whole run's time budget (default 540); "
                   "each part's timeout comes from it")
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/<date>-<device>-gpu.json); "
                   "the PNG goes beside it")
    p.add_argument("--smoke", action="store_true", help="every part on CPU with tiny shapes (a code-path check)")
    p.add_argument("--autotune", action="store_true", help="Pallas autotuning on, a fresh cache per part (default "
                   "off: ~25 s per matmul M class on a fresh machine, beyond the 8-minute budget)")
    p.add_argument("--log-dir", default=None, help="each part's log and records (default: a new temp folder)")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--table", default=None, metavar="FILE.json",
                   help="print the README's GPU table (markdown) from a results JSON, and exit")
    p.add_argument("--worker", default=None, choices=PARTS, help=argparse.SUPPRESS)
    p.add_argument("--records", default=None, help=argparse.SUPPRESS)


def command(args: argparse.Namespace) -> int:
    """The handler of both front doors."""
    if args.worker:
        from bench.gpu.parts import run_part
        run_part(args.worker, SMOKE if args.smoke else REAL, args.records, args.smoke)
        return 0
    if args.table:
        report = json.loads(Path(args.table).read_text())
        report["derived"] = derive(report)
        print(markdown(report), end="")
        return 0
    out = run(args)
    report = json.loads(out.read_text())
    print(markdown(report), end="")
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if args.plot else ""), flush=True)
    failed = [p for p, e in report["parts"].items() if e["errors"]]
    if failed:
        print(f"bench.gpu: errors in {', '.join(failed)} (see each part's errors in the JSON)", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return command(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"bench.gpu: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
