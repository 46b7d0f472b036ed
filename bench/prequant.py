"""Pre-quantized checkpoints on CPU: load time and decode speed of each format jaxinfer reads
(jaxinfer/prequant) against the same model in float32, in one run.

    python -m bench.prequant [--rounds 3] [--tokens 64] [--out bench/results/DATE-cpu-prequant.json]

The model: a random Llama of the bundled model's shape (checkpoints/jaxinfer-tiny-llama: d 96,
3 layers, 3 heads x 32, 1 KV head, ffn 256, vocab 4096, tied embeddings), saved by transformers in
float32, then quantized into each format by the producers' own code as tests/prequant_models.py
runs it (compressed_tensors' ModelCompressor; GPTQModel's and AutoAWQ's packing written after their
published functions; transformers' Fp8Quantize), groups of 32 (the model's K = 96 fits no 128).
Load: Generator.from_pretrained(FOLDER, warmup=False) wall time (config, tensors, packing, fusion;
no compilation). Decode: one stream, greedy, --tokens new tokens after a warm-up request, tokens /
wall second. A first, discarded measurement takes the process's one-time costs (imports, the
first trace); then rounds are interleaved (every format once per round, the order rotating) so that load
from other processes on the shared host hits each alike; each figure is the median over rounds,
with its ratio to float32 from the same rounds.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import device_info, device_slug, results_path  # noqa: E402

BUNDLED = dict(vocab_size=4096, hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=3,
               num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, max_position_embeddings=1024)
FORMATS = ("float32", "ct-w4a16-g32", "ct-w8a8", "ct-fp8-dynamic", "gptq-4b-g32", "gptq-4b-g32-desc",
           "gptq-8b-channel", "awq-g32", "fp8-block-32")


def build(name: str, folder: Path) -> Path:
    import tests.prequant_models as pm
    pm.LLAMA = BUNDLED          # the producers build tiny_llama() from this shape
    if name == "float32":
        pm.tiny_llama(0).save_pretrained(folder)
    elif name.startswith("ct-"):
        preset = {"ct-w4a16-g32": "W4A16", "ct-w8a8": "W8A8", "ct-fp8-dynamic": "FP8_DYNAMIC"}[name]
        pm.save_compressed_tensors(folder, pm.ct_scheme(preset, 32))
    elif name.startswith("gptq"):
        bits = 4 if "4b" in name else 8
        pm.save_gptq(folder, bits, 32 if "g32" in name else -1, True, desc_act=name.endswith("desc"))
    elif name.startswith("awq"):
        pm.save_awq(folder, 32)
    else:
        pm.save_fp8_block(folder, (32, 32))
    return folder


def measure(folder: Path, n_tokens: int) -> dict:
    from jaxinfer import Generator, SamplingParams
    t0 = time.perf_counter()
    gen = Generator.from_pretrained(str(folder), dtype="float32", warmup=False, max_num_seqs=1,
                                    max_num_batched_tokens=64, max_model_len=256)
    load_s = time.perf_counter() - t0
    prompt = list(range(5, 29))
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    gen.generate([prompt], params)                       # warm-up: every shape compiled
    t0 = time.perf_counter()
    out = gen.generate([prompt], params)[0]
    dt = time.perf_counter() - t0
    gen.close()
    del gen
    gc.collect()
    return {"load_s": load_s, "decode_tok_s": len(out.token_ids) / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = args.formats.split(",")
    info = device_info()
    with tempfile.TemporaryDirectory() as tmp:
        folders = {n: build(n, Path(tmp) / n) for n in names}
        measure(folders[names[0]], args.tokens)     # discarded: the process's first load and compile
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                runs[n].append(measure(folders[n], args.tokens))
                print(n, runs[n][-1], flush=True)
    med = {n: {k: statistics.median(x[k] for x in runs[n]) for k in ("load_s", "decode_tok_s")} for n in names}
    rows = []
    for n in names:
        row = {"format": n, **med[n], "runs": runs[n]}
        if "float32" in med:
            row["load_vs_float32"] = med[n]["load_s"] / med["float32"]["load_s"]
            row["decode_vs_float32"] = med[n]["decode_tok_s"] / med["float32"]["decode_tok_s"]
        rows.append(row)
    report = {"bench": "prequant", "device": info, "config": vars(args), "model": BUNDLED, "rows": rows,
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = results_path(args.out, device_slug(info), "prequant")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    for row in rows:
        print(f"{row['format']:>18}  load {row['load_s']:.2f} s ({row.get('load_vs_float32', 1):.2f}x)  "
              f"decode {row['decode_tok_s']:.1f} tok/s ({row.get('decode_vs_float32', 1):.2f}x)")
    print("wrote", out)


if __name__ == "__main__":
    main()
