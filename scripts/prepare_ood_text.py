"""Rebuild the out-of-domain evaluation text for bench/quantize_ppl.py: the fortunes of Debian's
`fortunes-min` (fortune-mod 1.99.1: the files fortunes, literature and riddles; BSD-licensed
package), a text in no part of the bundled model's training, calibration or tuning data (its
corpus is the King James Bible and the Jargon File, checkpoints/jaxinfer-tiny-llama/MODEL_CARD.md).

Fetched with `apt-get download` (scripts/prepare_corpus.fetch_debs, never installed), unpacked
with dpkg-deb. The three files are concatenated in that order with each fortune's "%" separator
line replaced by an empty line, so the text reads as paragraphs. Only an evaluation text: nothing
may be trained, calibrated or tuned on it.

    python scripts/prepare_ood_text.py [--out /work/cache/ood/fortunes-min.txt] [--cache DIR]

Both the .deb and the written text are checked against the sha256 below (a mismatch is an error).
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prepare_corpus import fetch_debs  # noqa: E402

PACKAGE, VERSION = "fortunes-min", "1:1.99.1-7.3"
DEB_SHA256 = "9eed5b45064e41133dae0967cf3a17588ad77c014fcc7bf1527fa3ea48e44d07"
TEXT_SHA256 = "6bb42c2d5e98bc5f088e9178646185ad39b1f1828115fafd22adf97f1273f8c0"
FILES = ("fortunes", "literature", "riddles")
DEFAULT_OUT = Path("/work/cache/ood/fortunes-min.txt")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build(cache: Path) -> str:
    deb = fetch_debs(cache, [PACKAGE])[PACKAGE]
    if sha256(deb.read_bytes()) != DEB_SHA256:
        raise SystemExit(f"{deb}: sha256 {sha256(deb.read_bytes())} is not {PACKAGE} {VERSION}'s {DEB_SHA256}")
    folder = cache / "root" / "usr/share/games/fortunes"
    raw = "".join((folder / name).read_text(encoding="utf-8") for name in FILES)
    return re.sub(r"(?m)^%\n", "\n", raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--cache", default=None, help="where the .deb is kept (default: OUT's folder/debian)")
    args = ap.parse_args()
    out = Path(args.out)
    text = build(Path(args.cache) if args.cache else out.parent / "debian")
    digest = sha256(text.encode("utf-8"))
    if digest != TEXT_SHA256:
        raise SystemExit(f"the rebuilt text's sha256 {digest} is not the recorded {TEXT_SHA256}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}: {len(text.encode('utf-8')):,} bytes, sha256 {digest}")


if __name__ == "__main__":
    main()
