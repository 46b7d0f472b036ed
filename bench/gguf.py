"""GGUF files on CPU: the bundled model's trained weights written as llama.cpp GGUFs (F32, Q8_0,
Q4_0, Q5_0 matmul weights), loaded by jaxinfer: weight bytes held, load time, perplexity on the
model's held-out text, batch-1 decode speed, each against the same model's F32 file in one run.

    python -m bench.gguf [--rounds 3] [--tokens 128] [--out bench/results/DATE-cpu-gguf.json]

The files are written as tests/gguf_files.py writes them (llama.cpp's converter's layout: the gguf
package's writer and quantizers, the model's SentencePiece vocabulary as metadata), from the bundled
model exported as an HF folder (`jaxinfer export-hf`). Q8_0 and Q5_0 stay packed as grouped int8,
Q4_0 as int4 (jaxinfer/prequant/gguf_blocks.py); the embedding (tied) is float32 in every file.
Perplexity: jaxinfer.evaluate.eval_ppl over the first 20,000 bytes of heldout.txt (windows of 256,
stride 128), tokenized by the file's own tokenizer (llama.cpp's SentencePiece rules: no whitespace
normalization, so its token count differs from the native checkpoint's by about one in 5,000).
Load: load_model of the prepared folder (tensors read, dequantized or packed; no compilation).
Decode: Generator.from_pretrained(FILE, dtype="float32"), one stream, greedy, --tokens new tokens
after a warm-up request; rounds interleaved (the order rotating), medians, ratios to F32 from the
same rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import device_info, device_slug, results_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "checkpoints" / "jaxinfer-tiny-llama"
KINDS = ("F32", "Q8_0", "Q5_0", "Q4_0")
MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build(tmp: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    from tests.gguf_files import sentencepiece_vocab, write_gguf
    hf_dir = tmp / "hf"
    subprocess.run([sys.executable, "-m", "jaxinfer.cli", "export-hf", str(hf_dir)], check=True, cwd=ROOT,
                   capture_output=True)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    vocab = sentencepiece_vocab(BUNDLED / "tokenizer.model")
    return {k: write_gguf(hf, tmp / f"bundled-{k}.gguf", vocab, {m: k for m in MATMULS}) for k in KINDS}


def quality(path: Path, text: str) -> dict:
    import jax
    from flax import nnx

    from jaxinfer.evaluate import eval_ppl
    from jaxinfer.hub import resolve_model_path
    from jaxinfer.tokenizer import load_tokenizer
    from jaxinfer.weights import load_model
    folder = resolve_model_path(path)
    t0 = time.perf_counter()
    model, _ = load_model(folder, "float32")
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    load_s = time.perf_counter() - t0
    weight_bytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    ppl = eval_ppl(model, load_tokenizer(folder), text)
    return {"load_s": load_s, "weight_bytes": weight_bytes, "ppl": ppl["ppl"], "tokens": ppl["tokens"]}


def decode(path: Path, n_tokens: int) -> float:
    from jaxinfer import Generator, SamplingParams
    gen = Generator.from_pretrained(str(path), dtype="float32", warmup=False, max_num_seqs=1,
                                    max_num_batched_tokens=64, max_model_len=512)
    prompt = gen.tokenizer.encode("the")
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    gen.generate([prompt], params)                      # warm-up: every shape compiled
    t0 = time.perf_counter()
    out = gen.generate([prompt], params)[0]
    rate = len(out.token_ids) / (time.perf_counter() - t0)
    gen.close()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    info = device_info()
    text = (BUNDLED / "heldout.txt").read_text()[:20000]
    with tempfile.TemporaryDirectory() as tmp:
        import os
        os.environ["JAXINFER_CACHE"] = str(Path(tmp) / "cache")   # the prepared folders, not the user's cache
        files = build(Path(tmp))
        rows = {k: {"kind": k, **quality(p, text), "decode_runs": [], "load_runs": []} for k, p in files.items()}
        decode(files["F32"], args.tokens)                  # discarded: the process's first compile
        for r in range(args.rounds):
            for k in KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]:
                rows[k]["decode_runs"].append(decode(files[k], args.tokens))
                rows[k]["load_runs"].append(quality(files[k], text[:2000])["load_s"])
                print(k, round(rows[k]["decode_runs"][-1], 1), flush=True)
    for row in rows.values():
        row["decode_tok_s"] = statistics.median(row["decode_runs"])
        row["load_s"] = statistics.median(row["load_runs"])
    base = rows["F32"]
    for row in rows.values():
        row.update(weight_bytes_vs_f32=row["weight_bytes"] / base["weight_bytes"],
                   decode_vs_f32=row["decode_tok_s"] / base["decode_tok_s"], ppl_vs_f32=row["ppl"] / base["ppl"])
    report = {"bench": "gguf", "device": info, "config": vars(args), "model": str(BUNDLED.name),
              "rows": list(rows.values()), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = results_path(args.out, device_slug(info), "gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    for row in rows.values():
        print(f"{row['kind']:>5}  weights {row['weight_bytes'] / 1e6:.2f} MB ({row['weight_bytes_vs_f32']:.2f}x)  "
              f"ppl {row['ppl']:.3f} ({row['ppl_vs_f32']:.4f}x)  load {row['load_s']:.2f} s  "
              f"decode {row['decode_tok_s']:.1f} tok/s ({row['decode_vs_f32']:.2f}x)")
    print("wrote", out)


if __name__ == "__main__":
    main()
