"""Rebuild tests/file_seconds.json, the seconds each test file takes, from a pytest run's durations.
tests/conftest.py orders the files by it, heaviest first, so that `make test`'s two workers end
together (pytest-xdist's --dist loadfile hands a worker its next file when it runs low; the light
files at the end fill the gap, where a heavy file with few tests, handed out last by xdist's own
order of most tests first, left one worker idle for a minute or more).

    .venv/bin/pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=0 --durations-min=0 > run.log
    .venv/bin/python scripts/test_file_seconds.py run.log --machine "2-core, slow"

A file's seconds are the sum of its tests' setup, call and teardown durations as pytest reports
them (a module fixture's setup counts in its first test's setup). Only the order of the files uses
them: a stale table costs balance, never a test.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+?\.py)::")
TABLE = Path(__file__).resolve().parents[1] / "tests" / "file_seconds.json"


def file_seconds(lines) -> dict[str, float]:
    """{test file: seconds} from the lines of pytest's --durations report."""
    seconds: collections.Counter[str] = collections.Counter()
    for line in lines:
        m = LINE.match(line)
        if m:
            seconds[m.group(3)] += float(m.group(1))
    return dict(seconds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="the output of a pytest run with --durations=0 --durations-min=0")
    ap.add_argument("--machine", default="", help="what ran it, for the table's note")
    ap.add_argument("--out", default=str(TABLE))
    args = ap.parse_args(argv)
    seconds = file_seconds(Path(args.log).read_text().splitlines())
    if not seconds:
        raise SystemExit(f"{args.log}: no durations found; run pytest with --durations=0 --durations-min=0")
    table = {"measured": f"{datetime.date.today()}, make test with --durations=0 --durations-min=0"
                         + (f" ({args.machine})" if args.machine else ""),
             "seconds": {f: round(s, 1) for f, s in sorted(seconds.items(), key=lambda kv: -kv[1])}}
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.out}: {len(seconds)} files, {sum(seconds.values()):.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
