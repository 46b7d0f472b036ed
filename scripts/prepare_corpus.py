"""Build a small, reproducible, offline training corpus + SentencePiece BPE tokenizer.

Sources (public domain, fetched from the Debian archive with `apt-get download` and
unpacked with `dpkg-deb -x`, never installed system-wide):
  * King James Bible: `bible-kjv` (the `bible` program) + `bible-kjv-text` (compressed
    data). Plain text comes from running the unpacked binary in the folder holding
    `bible.data` (it searches the current directory first). One document per chapter:
    a "Genesis 1" heading line, then one verse per line without the verse numbers.
  * Jargon File 4.4.7: `jargon-text` (usr/share/doc/jargon-text/jargon.txt.gz). One
    document per lexicon entry: "headword: pron, pos." line, then one line per paragraph
    (hard-wrapped prose is re-flowed and {cross-ref} braces dropped; ASCII art, code and
    tables are kept verbatim).
Documents contain no blank lines; in train.txt / heldout.txt they are separated by one.
Every `holdout_every`-th document (1-based) goes to heldout.txt and is never trained on.
The tokenizer is trained on train.txt only; train.bin / heldout.bin are np.uint16 arrays
of [BOS doc EOS]* token ids. Stats, package versions and licence lines go to corpus.json.

Usage: python scripts/prepare_corpus.py --out DIR [--texts FILE ...] [--cache DIR] [--vocab-size 4096]
Downloads are cached in --cache (default OUT/debian/: *.deb plus the dpkg-deb tree root/).
`--texts` files replace the download: `bible` output and jargon.txt[.gz] are recognised,
any other file is split into documents at blank lines.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm

PACKAGES = ["bible-kjv", "bible-kjv-text", "jargon-text"]
LIB_PACKAGES = ["libreadline8", "libtinfo6"]  # only fetched if `bible` cannot start
BOX = re.compile("[\u2500-\u257f]")
WRAP = 73  # jargon.txt prose is wrapped at 73 columns after its 3-space indent


def fetch_debs(cache: Path, names: list[str]) -> dict[str, Path]:
    """apt-get download (once, cached) + dpkg-deb -x into cache/root; returns name -> .deb."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [n for n in names if not list(cache.glob(f"{n}_*.deb"))]
    if missing:
        cmd = ["apt-get", "download", *missing]
        if subprocess.run(cmd, cwd=cache, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], check=True, capture_output=True)
            subprocess.run(cmd, cwd=cache, check=True, capture_output=True)
    debs = {n: sorted(cache.glob(f"{n}_*.deb"))[-1] for n in names}
    for deb in debs.values():
        stamp = cache / "root" / f".{deb.name}.done"
        if not stamp.exists():
            subprocess.run(["dpkg-deb", "-x", str(deb), str(cache / "root")], check=True)
            stamp.touch()
    return debs


def dump_kjv(cache: Path, root: Path) -> str:
    """Whole Bible in `bible` pretty format (-l 100000: one line per verse)."""
    cmd = [str(root / "usr/bin/bible"), "-l", "100000", "Gen1:1-Rev22:21"]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    run = lambda: subprocess.run(cmd, cwd=root / "usr/lib", env=env, stdin=subprocess.DEVNULL,
                                 capture_output=True, text=True)
    res = run()
    if res.returncode != 0 or "Revelation 22" not in res.stdout:  # e.g. missing libreadline
        fetch_debs(cache, LIB_PACKAGES)
        libs = [root / "lib/x86_64-linux-gnu", root / "usr/lib/x86_64-linux-gnu"]
        env["LD_LIBRARY_PATH"] = ":".join([*map(str, libs), *filter(None, [env.get("LD_LIBRARY_PATH")])])
        res = run()
        if res.returncode != 0:
            raise RuntimeError(f"bible failed: {res.stderr[:500]}")
    return res.stdout


def parse_kjv(text: str) -> list[str]:
    docs: list[list[str]] = []
    for line in text.splitlines():
        if m := re.match(r"^  \d+ (.*)$", line):
            docs[-1].append(" ".join(m.group(1).split()))
        elif line.strip():
            docs.append([line.strip()])  # chapter heading, e.g. "Song of Solomon 2"
    return ["\n".join(d) for d in docs]


def _jargon_para(lines: list[str]) -> str:
    """Re-flow a naturally wrapped prose paragraph; keep anything else verbatim."""
    prose = all(re.match(r"^   \S", l) for l in lines) and not BOX.search("".join(lines)) and all(
        len(a.strip()) + 1 + len(b.split()[0]) > WRAP for a, b in zip(lines, lines[1:]))
    if prose:
        return re.sub(r"\{([^{}]+)\}", r"\1", " ".join(" ".join(l.split()) for l in lines))
    k = min(3, *(len(l) - len(l.lstrip(" ")) for l in lines))
    return "\n".join(l[k:] for l in lines)


def parse_jargon(text: str) -> list[str]:
    lines = text.replace("\u00a0", " ").split("\n")
    entries: list[list[str]] = []
    cur: list[str] | None = None
    for line in lines[lines.index("Glossary") + 1:]:
        if re.match(r"^\s+Part III\.", line):
            break
        if re.match(r"^  [0A-Z]$", line):  # letter section; its table of contents follows
            cur = None
        elif m := re.match(r"^   :([^:]+):(.*)$", line):
            cur = [f"{m.group(1)}:{m.group(2)}".rstrip()]
            entries.append(cur)
        elif cur is not None:
            cur.append(line.rstrip())
    docs = []
    for head, *body in entries:
        paras = [p.split("\n") for p in re.split(r"\n[ \t]*\n", "\n".join(body).strip("\n")) if p.strip()]
        docs.append("\n".join([head] + [_jargon_para(p) for p in paras]))
    return docs


def parse_text(path: Path) -> tuple[str, list[str]]:
    raw = (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")).read()
    if re.search(r"^Genesis 1\n\n  1 In the beginning", raw, re.M):
        return "kjv", parse_kjv(raw)
    if "\nGlossary\n" in raw and "\n   :" in raw:
        return "jargon", parse_jargon(raw)
    blocks = re.split(r"\n[ \t]*\n", raw.replace("\r\n", "\n"))
    return path.stem, ["\n".join(l.rstrip() for l in b.strip("\n").split("\n")) for b in blocks if b.strip()]


def licence_line(copyright_file: Path) -> str:
    text = " ".join(copyright_file.read_text(encoding="utf-8", errors="replace").split())
    m = re.search(r"(?<=[.:] )[A-Z][^.]*(public domain|is expired)[^.]*\.", text)
    return m.group(0).strip() if m else "?"


def split_stats(name: str, docs: list[str], ids: np.ndarray, n_special: int) -> dict:
    text = "\n\n".join(docs)
    n_bytes, n_tok = len(text.encode("utf-8")), int(ids.size) - n_special
    return {"split": name, "documents": len(docs), "characters": len(text), "bytes": n_bytes,
            "tokens": int(ids.size), "text_tokens": n_tok, "bytes_per_token": round(n_bytes / max(n_tok, 1), 4)}


def prepare_corpus(out_dir: Path, texts: list[Path] | None = None, vocab_size: int = 4096,
                   holdout_every: int = 50, seed: int = 0, cache_dir: Path | None = None) -> dict:
    t0 = time.time()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sources: list[tuple[str, list[str]]] = []
    meta: dict = {"packages": {}, "licences": {}}
    if texts:
        sources = [parse_text(Path(p)) for p in texts]
        meta["texts"] = [str(p) for p in texts]
    else:
        cache = Path(cache_dir) if cache_dir else out_dir / "debian"
        debs, root = fetch_debs(cache, PACKAGES), cache / "root"
        for n, deb in debs.items():
            meta["packages"][n] = {"version": deb.name.split("_")[1], "deb": deb.name,
                                   "sha256": hashlib.sha256(deb.read_bytes()).hexdigest()}
            meta["licences"][n] = licence_line(root / f"usr/share/doc/{n}/copyright")
        meta["licences"]["summary"] = {"kjv": "public domain (Debian copyright: copyright expired)",
                                       "jargon": "public domain (Jargon File 4.4.7)"}
        sources = [("kjv", parse_kjv(dump_kjv(cache, root))),
                   ("jargon", parse_jargon(gzip.open(root / "usr/share/doc/jargon-text/jargon.txt.gz",
                                                     "rt", encoding="utf-8").read()))]
    docs = [d for _, ds in sources for d in ds]
    train = [d for i, d in enumerate(docs) if (i + 1) % holdout_every != 0]
    held = [d for i, d in enumerate(docs) if (i + 1) % holdout_every == 0]
    paths = {k: out_dir / f"{k}.txt" for k in ("train", "heldout")}
    for k, ds in (("train", train), ("heldout", held)):
        paths[k].write_text("\n\n".join(ds) + "\n", encoding="utf-8")

    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(
        input=str(paths["train"]), model_prefix=str(out_dir / "tokenizer"), model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, character_coverage=0.9995, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, num_threads=2,
        add_dummy_prefix=False,  # a line start looks the same in training lines and after "\n"
        input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=1 << 16,
        minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(out_dir / "tokenizer.model"))
    assert sp.get_piece_size() <= 65536 and (sp.bos_id(), sp.eos_id()) == (1, 2)

    stats = []
    for k, ds in (("train", train), ("heldout", held)):
        ids = np.fromiter((t for e in sp.encode(ds, num_threads=2) for t in (sp.bos_id(), *e, sp.eos_id())),
                          dtype=np.uint16)
        ids.tofile(out_dir / f"{k}.bin")
        stats.append(split_stats(k, ds, ids, 2 * len(ds)))

    lines = [l for l in paths["heldout"].read_text(encoding="utf-8").split("\n") if l]
    sample = random.Random(seed).sample(lines, min(1000, len(lines)))
    bad = [l for l in sample if sp.decode(sp.encode(l)) != l]
    bad_docs = sum(sp.decode(sp.encode(d)) != d for d in docs)
    by_source = {n: len(ds) for n, ds in sources}
    result = {
        "out_dir": str(out_dir), "files": {k: str(out_dir / f) for k, f in (
            ("train_txt", "train.txt"), ("heldout_txt", "heldout.txt"), ("train_bin", "train.bin"),
            ("heldout_bin", "heldout.bin"), ("tokenizer", "tokenizer.model"), ("stats", "corpus.json"))},
        "documents_by_source": by_source, "holdout_every": holdout_every, "vocab_size": sp.get_piece_size(),
        "seed": seed, "splits": {s["split"]: s for s in stats},
        "roundtrip": {"heldout_lines_checked": len(sample), "line_failures": len(bad),
                      "documents_checked": len(docs), "document_failures": bad_docs, "examples": bad[:5]},
        "train_bin_sha256": hashlib.sha256((out_dir / "train.bin").read_bytes()).hexdigest(),
        **meta, "elapsed_s": round(time.time() - t0, 2),
    }
    (out_dir / "corpus.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--texts", type=Path, nargs="+", default=None)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--holdout-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=None, help="deb download/extract cache (default OUT/debian)")
    a = ap.parse_args()
    r = prepare_corpus(a.out, a.texts, a.vocab_size, a.holdout_every, a.seed, a.cache)
    for s in r["splits"].values():
        print("{split:8s} docs={documents} chars={characters} bytes={bytes} tokens={tokens} "
              "bytes/token={bytes_per_token}".format(**s))
    rt = r["roundtrip"]
    print(f"sources={r['documents_by_source']} roundtrip line failures={rt['line_failures']}/"
          f"{rt['heldout_lines_checked']} doc failures={rt['document_failures']}/{rt['documents_checked']}")
    print(f"train.bin sha256={r['train_bin_sha256']} elapsed={r['elapsed_s']}s -> {r['out_dir']}")


if __name__ == "__main__":
    main()
