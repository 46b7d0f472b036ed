"""`jaxinfer generate | convert` (and, as they land, serve | batch | bench | plan | eval-ppl).

Flags are parsed here and only here; each command calls the library.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder or jaxinfer checkpoint (default: the bundled model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"--ids expects integers separated by commas or spaces, got {text!r}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxinfer import Generator, SamplingParams

    gen = Generator.from_pretrained(args.model, dtype=args.dtype, max_num_seqs=max(1, args.n),
                                    max_num_batched_tokens=args.max_num_batched_tokens)
    prompt = _parse_ids(args.ids) if args.ids is not None else args.prompt
    if prompt is None:
        raise SystemExit("give a prompt (or --ids)")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop or ()), n=args.n,
                            ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    if args.n == 1 and not args.json:
        if isinstance(prompt, str):
            print(prompt, end="", flush=True)
        n_tokens = 0
        for delta in gen.stream(prompt, params):
            print(delta.text if gen.tokenizer else " ".join(map(str, delta.token_ids)) + " ", end="", flush=True)
            n_tokens += len(delta.token_ids)
        dt = time.perf_counter() - t0
        print(f"\n[{n_tokens} tokens in {dt:.2f} s, {n_tokens / dt:.1f} tok/s]", file=sys.stderr)
        return 0
    out = gen.generate([prompt], params)[0]
    for i, s in enumerate(out.samples):
        if args.json:
            print(json.dumps({"index": i, "text": s.text, "token_ids": s.token_ids, "finish_reason": s.finish_reason}))
        else:
            print(f"--- sample {i} ({s.finish_reason})\n{s.text if gen.tokenizer else s.token_ids}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxinfer.tokenizer import load_tokenizer
    from jaxinfer.weights import load_model, save_native

    model, cfg = load_model(args.hf_dir, args.dtype)
    save_native(model, args.out_dir, args.dtype, tokenizer=load_tokenizer(args.hf_dir))
    print(f"wrote {args.out_dir}: {cfg.architecture}, {cfg.num_params():,} parameters, {args.dtype}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="JAX/XLA LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    _model_arg(g)
    g.add_argument("prompt", nargs="?", default=None)
    g.add_argument("--ids", default=None, help="the prompt as token ids, e.g. '1,2,3'")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print JSON lines")
    g.add_argument("--max-num-batched-tokens", type=int, default=256)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert an HF safetensors folder to the native format")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    c.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxinfer.config import ConfigError
    from jaxinfer.weights import CheckpointError
    try:
        return args.func(args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"jaxinfer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
