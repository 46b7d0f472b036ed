"""Where a pytest run's XLA compile time goes: a pytest plugin that records every backend compile of
the test processes (jax's "/jax/core/compile/backend_compile_duration" event: a compile, or a load
from the run's shared compilation cache, ~0.2 s), and a report of the records.

    PYTHONPATH=scripts .venv/bin/pytest -p compile_profile -n 2 --dist loadfile --no-loadscope-reorder
    .venv/bin/python scripts/compile_profile.py [DIR] [--top 25]

Each test process (xdist worker) appends one JSON line per compile to DIR/<pid>.jsonl (DIR:
$JAXINFER_COMPILE_PROFILE_DIR, default /tmp/jaxinfer-compile-profile; empty it before a run): the
seconds, the jitted function's name, the test that ran, and the innermost and outermost frames of
this repository on the stack (the call that compiled, and the test line that led to it). The report
sums them per test file and per innermost frame, apart for programs over --big seconds (the engine's
step programs, jitted forwards) and the rest (mostly one-operation programs of eager jnp calls).
Subprocesses that tests start (fake-device workers, servers, benchmark smokes) are not recorded:
their time is the rest of the run. Recording costs a stack walk per compile (~6,000 in a run), within
the run's noise.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import traceback
from pathlib import Path

DIR_ENV = "JAXINFER_COMPILE_PROFILE_DIR"
DEFAULT_DIR = "/tmp/jaxinfer-compile-profile"
EVENT = "/jax/core/compile/backend_compile_duration"
REPO = str(Path(__file__).resolve().parents[1]) + os.sep

_out = None
_test = ["(collection)"]


def _frames() -> tuple[str | None, str | None]:
    """(innermost, outermost) frame of this repository's own code on the stack, 'path:line:function'."""
    inner = outer = None
    for fr in reversed(traceback.extract_stack()[:-3]):
        if fr.filename.startswith(REPO) and f"{os.sep}.venv{os.sep}" not in fr.filename:
            where = f"{fr.filename[len(REPO):]}:{fr.lineno}:{fr.name}"
            inner = inner or where
            outer = where
    return inner, outer


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event != EVENT or _out is None:
        return
    inner, outer = _frames()
    _out.write(json.dumps({"s": duration, "fn": kwargs.get("fun_name"), "test": _test[0],
                           "inner": inner, "outer": outer}) + "\n")


def pytest_configure(config):
    global _out
    folder = Path(os.environ.get(DIR_ENV, DEFAULT_DIR))
    folder.mkdir(parents=True, exist_ok=True)
    _out = open(folder / f"{os.getpid()}.jsonl", "a", buffering=1)
    import jax.monitoring
    jax.monitoring.register_event_duration_secs_listener(_on_event)


def pytest_runtest_logstart(nodeid, location):
    _test[0] = nodeid


def load(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines() if line]


def table(records: list[dict], key, top: int) -> list[str]:
    sums: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for r in records:
        k = key(r)
        sums[k][0] += 1
        sums[k][1] += r["s"]
    rows = sorted(sums.items(), key=lambda kv: -kv[1][1])[:top]
    return [f"{s:9.1f} s {n:6d}  {k}" for k, (n, s) in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", nargs="?", default=os.environ.get(DIR_ENV, DEFAULT_DIR))
    p.add_argument("--big", type=float, default=0.5, help="seconds from which a compile counts as a big program")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    records = load(Path(args.dir))
    big = [r for r in records if r["s"] > args.big]
    rest = [r for r in records if r["s"] <= args.big]
    total = lambda rs: sum(r["s"] for r in rs)  # noqa: E731
    print(f"{len(records)} compiles, {total(records):.1f} s: {len(big)} over {args.big} s ({total(big):.1f} s), "
          f"{len(rest)} others ({total(rest):.1f} s)")
    by_file = lambda r: r["test"].split("::")[0]  # noqa: E731
    for label, rs in ((f"over {args.big} s", big), (f"at most {args.big} s", rest)):
        print(f"\n== programs {label}, per test file")
        print("\n".join(table(rs, by_file, args.top)))
        print(f"\n== programs {label}, per innermost frame")
        print("\n".join(table(rs, lambda r: r["inner"] or "(outside the repository)", args.top)))


if __name__ == "__main__":
    main()
