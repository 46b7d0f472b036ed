"""`jaxinfer generate | serve | batch | bench | plan | convert | quantize | export-hf | eval-ppl`.

Flags are parsed here and only here; each command calls the library. The engine's flags are
EngineConfig's fields (jaxinfer.config.flags): a new setting appears here with no edit. Never
imports bench at import time (`jaxinfer bench` brings its parser in when the parser is built).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxinfer.config import DTYPE_CHOICES, KV_DTYPE_CHOICES, QUANTIZE_CHOICES
from jaxinfer.config.flags import add_engine_args, engine_kwargs


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder, jaxinfer checkpoint, .gguf file, or Hugging Face "
                                                 "id ORG/NAME[@REVISION] or GGUF repository ORG/NAME:QUANT (from "
                                                 "its cache, downloaded unless HF_HUB_OFFLINE=1; default: the "
                                                 "bundled model)")


def _model_path(model: str | None, default: Path) -> Path:
    """--model as a local folder (a Hugging Face id resolved through its cache: jaxinfer/hub.py)."""
    from jaxinfer.hub import resolve_model_path
    return resolve_model_path(model) if model else default


def _multihost_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-host (jax.distributed; every process runs the same command)")
    g.add_argument("--coordinator-address", default=None,
                   help="host:port of process 0 (default: $JAXINFER_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=int, default=None, help="default: $JAXINFER_NUM_PROCESSES")
    g.add_argument("--process-id", type=int, default=None,
                   help="0 serves; the others follow its steps (default: $JAXINFER_PROCESS_ID)")


def _multihost_kwargs(args: argparse.Namespace) -> dict:
    return dict(coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                process_id=args.process_id)


def _follow(gen) -> int:
    """Multi-host processes other than 0: run process 0's steps until it shuts down."""
    g = gen.process_group
    print(f"process {g.process_id} of {g.num_processes}: following process 0 ({g.coordinator_address})",
          file=sys.stderr, flush=True)
    n = gen.follow()
    print(f"process {g.process_id}: process 0 closed after {n} steps", file=sys.stderr, flush=True)
    return 0


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"--ids expects integers separated by commas or spaces, got {text!r}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxinfer import Generator, SamplingParams

    if args.ids is not None and args.prompt is not None:
        raise SystemExit("give a prompt or --ids, not both")
    gen = Generator.from_pretrained(args.model, max_num_seqs=max(1, args.n), **engine_kwargs(args),
                                    **_multihost_kwargs(args))
    if not gen.is_leader:
        return _follow(gen)
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
        for delta in gen.stream(prompt, params, suffix=args.suffix):
            print(delta.text if gen.tokenizer else " ".join(map(str, delta.token_ids)) + " ", end="", flush=True)
            n_tokens += len(delta.token_ids)
        dt = time.perf_counter() - t0
        print(f"\n[{n_tokens} tokens in {dt:.2f} s, {n_tokens / dt:.1f} tok/s]", file=sys.stderr)
        return 0
    out = gen.generate([prompt], params, suffix=args.suffix)[0]
    for i, s in enumerate(out.samples):
        if args.json:
            print(json.dumps({"index": i, "text": s.text, "token_ids": s.token_ids, "finish_reason": s.finish_reason}))
        else:
            print(f"--- sample {i} ({s.finish_reason})\n{s.text if gen.tokenizer else s.token_ids}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxinfer.tokenizer import load_tokenizer
    from jaxinfer.weights import load_model, save_native

    hf_dir = _model_path(args.hf_dir, None)   # a .gguf file: the folder describing it, its weights as floats
    model, cfg = load_model(hf_dir, args.dtype, gguf_blocks=False)
    save_native(model, args.out_dir, args.dtype, tokenizer=load_tokenizer(hf_dir))
    print(f"wrote {args.out_dir}: {cfg.architecture}, {cfg.num_params():,} parameters, {args.dtype}")
    return 0


def _heldout_text(path: Path) -> Path:
    """The model's heldout.txt, or for a `jaxinfer quantize` output the source model's."""
    if (path / "heldout.txt").exists():
        return path / "heldout.txt"
    try:
        source = json.loads((path / "config.json").read_text())["quantization"]["source"]
    except (OSError, ValueError, KeyError, TypeError):
        source = None
    if source and (Path(source) / "heldout.txt").exists():
        return Path(source) / "heldout.txt"
    raise FileNotFoundError(f"{path / 'heldout.txt'}: no held-out text beside the model; give --text FILE")


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from jaxinfer.evaluate import eval_ppl
    from jaxinfer.generator import default_model_path
    from jaxinfer.tokenizer import load_tokenizer
    from jaxinfer.weights import load_model

    path = _model_path(args.model, default_model_path())
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"{path}: the model has no tokenizer; eval-ppl scores text")
    text_path = Path(args.text) if args.text else _heldout_text(path)
    model, _ = load_model(path, args.dtype, gguf_blocks=not args.quantize)
    if args.quantize:
        from jaxinfer.models.decoder import quantize_decoder
        quantize_decoder(model, args.quantize)
    result = eval_ppl(model, tokenizer, text_path.read_text(encoding="utf-8"), args.window, args.stride,
                      kv_dtype=args.kv_dtype)
    result = {"model": str(path), "text": str(text_path), "dtype": args.dtype, "quantize": args.quantize, **result}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{text_path}: {result['tokens']} tokens, {result['bytes']} bytes; "
              f"perplexity {result['ppl']:.3f}, bits per byte {result['bits_per_byte']:.4f}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from jaxinfer.generator import default_model_path
    import numpy as np

    from jaxinfer.quantize import QuantizeSettings, default_bits_group, quantize_model
    from jaxinfer.quantize.calibrate import calibration_windows
    from jaxinfer.tokenizer import load_tokenizer
    from jaxinfer.weights import load_model, save_native

    bits, group = default_bits_group(args.method)
    bits = bits if args.bits is None else args.bits
    group = -1 if bits == 8 else group          # 8-bit weights are per output channel
    path = _model_path(args.model, default_model_path())
    model, cfg = load_model(path, "float32", gguf_blocks=False)   # a GGUF's blocks re-quantized as floats
    # calibration and QAT windows run from position 0: no longer than the model's context
    window = min(256, cfg.exact_positions) if args.calib_window is None else args.calib_window
    if window > cfg.exact_positions:
        raise ValueError(f"--calib-window {window} is longer than the model's context "
                         f"({cfg.exact_positions} positions)")
    settings = QuantizeSettings(method=args.method, bits=bits,
                                group_size=group if args.group_size is None else args.group_size,
                                symmetric=not args.asym, act_order=args.act_order, clip_search=args.clip_search,
                                calib_tokens=args.calib_tokens, calib_window=window,
                                act_scales=args.act_scales, act_calib=args.act_calib,
                                act_symmetric=not args.act_asym,
                                act_percentile=args.act_percentile, qat_steps=args.qat_steps, qat_lr=args.qat_lr,
                                qat_batch=args.qat_batch, qat_trainable=args.qat_trainable,
                                qat_nll_weight=args.qat_nll_weight, qat_temperature=args.qat_temperature,
                                qat_heldout=args.qat_heldout)
    tokenizer = load_tokenizer(path)
    windows, calib, train_tokens, train = None, None, None, None
    if settings.method == "qat":
        train = args.train_bin or args.train_text
        if train is None:
            raise ValueError("--method qat needs training text: --train-text FILE (UTF-8) or --train-bin FILE "
                             "(uint16 token ids, as scripts/prepare_corpus.py writes train.bin); never the "
                             "evaluation text")
        if args.train_bin:
            train_tokens = np.fromfile(args.train_bin, dtype=np.uint16)
        elif tokenizer is None:
            raise ValueError(f"{path}: the model has no tokenizer to encode --train-text; give --train-bin")
        else:
            train_tokens = np.asarray(tokenizer.encode(Path(args.train_text).read_text(encoding="utf-8")), np.int32)
    elif settings.method not in ("rtn", "fp8"):
        calib = Path(args.calib_text) if args.calib_text else path / "calibration.txt"
        if not calib.exists():
            raise FileNotFoundError(f"{calib}: no calibration text (give --calib-text FILE, disjoint from "
                                    f"the text you evaluate on)")
        if tokenizer is None:
            raise ValueError(f"{path}: the model has no tokenizer to encode --calib-text")
        ids = tokenizer.encode(calib.read_text(encoding="utf-8"))
        windows = calibration_windows(ids, settings.calib_tokens, settings.calib_window)
    quantize_model(model, settings, windows, progress=not args.quiet, train_tokens=train_tokens)
    extra = {"quantization": {**settings.to_json(), "source": str(path.resolve()),
                              "calib_text": None if calib is None else str(calib),
                              **({"train_data": str(train)} if train is not None else {}),
                              "calib_windows": None if windows is None else int(windows.shape[0])}}
    save_native(model, args.out_dir, "float32", tokenizer=tokenizer, extra=extra)
    act = (f" a8 {settings.act_scales}{'' if settings.act_symmetric else ' asym'}"
           if settings.method == "smoothquant" else "")
    print(f"wrote {args.out_dir}: {settings.method} w{settings.bits} "
          f"g{settings.group_size} {'sym' if settings.symmetric else 'asym'}{act}")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from jaxinfer.export import export_hf
    from jaxinfer.generator import default_model_path
    from jaxinfer.tokenizer import load_tokenizer
    from jaxinfer.weights import load_model

    path = _model_path(args.model, default_model_path())
    model, cfg = load_model(path, "float32", gguf_blocks=False)   # a GGUF file exports as float32
    export_hf(model, args.out_dir, load_tokenizer(path))
    print(f"wrote {args.out_dir}: {cfg.architecture} in the Hugging Face layout (float32 safetensors)")
    return 0


def _served_name(args: argparse.Namespace) -> str:
    from jaxinfer.generator import default_model_path
    from jaxinfer.hub import served_name
    return args.served_model_name or served_name(args.model, default_model_path())


def _engine_args(p: argparse.ArgumentParser) -> None:
    """serve and batch: every engine setting, and the name clients use."""
    add_engine_args(p.add_argument_group("engine (Generator.from_pretrained's settings)"))
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: the "
                                                                           "Hugging Face id, or the folder's name)")


def _generator(args: argparse.Namespace):
    from jaxinfer import Generator
    return Generator.from_pretrained(args.model, **engine_kwargs(args), **_multihost_kwargs(args))


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $JAXINFER_API_KEY (which, unlike a flag, does not show in `ps`)."""
    import os
    return args.api_key or os.environ.get("JAXINFER_API_KEY") or None


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from serve.app import build_app

    gen = _generator(args)
    if not gen.is_leader:   # no HTTP here: process 0 takes every request
        return _follow(gen)
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    app = build_app(gen, _served_name(args), api_key=_api_key(args), max_queue=args.max_queue,
                    max_request_bytes=args.max_request_bytes, reasoning_parser=args.reasoning_parser,
                    tool_call_parser=args.tool_call_parser, chat_template=template,
                    trust_request_chat_template=args.trust_request_chat_template,
                    enable_sleep_mode=args.enable_sleep_mode)
    print(f"serving {_served_name(args)} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    gen.close()   # multi-host: the followers return
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    from serve.batch import run_batch

    gen = _generator(args)
    if not gen.is_leader:
        return _follow(gen)
    summary = run_batch(gen, args.input, args.output, _served_name(args), progress=not args.quiet)
    gen.close()
    print(json.dumps(summary), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's flags, one function each; `plan` and `bench` bring their own (jaxinfer/plan.py,
    bench/benchmark.py), which never import this module back."""
    from bench.benchmark import add_bench_parser
    from jaxinfer.plan import add_plan_parser

    parser = argparse.ArgumentParser(prog="jaxinfer", description="JAX/XLA LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_convert, _add_quantize, _add_export_hf, _add_serve, _add_batch, _add_eval_ppl,
                add_plan_parser, add_bench_parser):
        add(sub)
    return parser


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt")
    _model_arg(g)
    g.add_argument("prompt", nargs="?", default=None)
    g.add_argument("--ids", default=None, help="the prompt as token ids, e.g. '1,2,3'")
    g.add_argument("--suffix", default=None, help="fill in the middle: the prompt is the code before the cursor, "
                                                   "this the code after it (a code model's FIM tokens)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print JSON lines")
    # every engine setting but the batch (--n sequences); one prompt warms up fewer token buckets
    # with a smaller step budget than a server's
    add_engine_args(g.add_argument_group("engine (Generator.from_pretrained's settings)"), exclude=("max_num_seqs",),
                    defaults={"max_num_batched_tokens": 256})
    _multihost_args(g)
    g.set_defaults(func=cmd_generate)


def _add_convert(sub) -> None:
    c = sub.add_parser("convert", help="convert an HF safetensors folder to the native format")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="bfloat16", choices=[d for d in DTYPE_CHOICES if d != "auto"])
    c.set_defaults(func=cmd_convert)


def _add_quantize(sub) -> None:
    qz = sub.add_parser("quantize", help="post-training quantization into a native checkpoint")
    qz.add_argument("model", help="HF model folder or jaxinfer checkpoint")
    qz.add_argument("out_dir")
    qz.add_argument("--method", default="rtn",
                    help="rtn | gptq | awq (weight-only integers) | qat (distil the float model into its "
                         "fake-quantized self, then RTN) | fp8 (e4m3 weights per channel) | smoothquant (W8A8)")
    qz.add_argument("--bits", type=int, default=None, choices=[8, 4, 3],
                    help="default: 8 for fp8 and smoothquant, else 4")
    qz.add_argument("--group-size", type=int, default=None, choices=[128, 64, 32, -1],
                    help="-1: per output channel (default: -1 for 8-bit weights: fp8, smoothquant, --bits 8; else 128)")
    sym = qz.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="asym", action="store_false", help="symmetric grid (default)")
    sym.add_argument("--asym", dest="asym", action="store_true", help="asymmetric grid with zero points")
    _calibration_args(qz)
    _qat_args(qz)
    qz.add_argument("--quiet", action="store_true", help="no progress bar")
    qz.set_defaults(func=cmd_quantize, asym=False)   # (the first of two actions on one dest gives the default)


def _calibration_args(qz: argparse.ArgumentParser) -> None:
    """`jaxinfer quantize`: the calibration text and the GPTQ / SmoothQuant options."""
    qz.add_argument("--calib-text", default=None,
                    help="UTF-8 calibration text, disjoint from evaluation text (default: MODEL/calibration.txt)")
    qz.add_argument("--calib-tokens", type=int, default=65536,
                    help="the first N tokens of the calibration text (default 65536; fewer if the text is shorter)")
    qz.add_argument("--calib-window", type=int, default=None,
                    help="tokens per calibration (and QAT) window; default 256, or the model's context if shorter")
    qz.add_argument("--act-order", action="store_true", help="GPTQ: columns by decreasing Hessian diagonal")
    qz.add_argument("--clip-search", action="store_true",
                    help="GPTQ: shrink each grid's range to the least |err|^2.4 before error propagation")
    qz.add_argument("--act-scales", default="dynamic", choices=["dynamic", "static"],
                    help="smoothquant: int8 activation scales per token at run time, or one per linear "
                         "calibrated offline")
    qz.add_argument("--act-calib", default="percentile", choices=["minmax", "percentile", "mse"],
                    help="smoothquant --act-scales static: how the clipping range is chosen")
    qz.add_argument("--act-percentile", type=float, default=99.99,
                    help="--act-calib percentile: the percentile of |x| mapped to 127")
    qz.add_argument("--act-asym", action="store_true",
                    help="smoothquant --act-scales static: asymmetric activation grid with a zero point")


def _qat_args(qz: argparse.ArgumentParser) -> None:
    """`jaxinfer quantize --method qat`: its training text and schedule (defaults: qat.py's DEFAULT_*)."""
    qz.add_argument("--train-text", default=None,
                    help="qat: UTF-8 text the model was trained on or will serve (never the evaluation text); "
                         "--qat-heldout of it is held out for early stopping")
    qz.add_argument("--train-bin", default=None, help="qat: training token ids, uint16 (prepare_corpus's train.bin)")
    qz.add_argument("--qat-steps", type=int, default=400, help="qat: at most this many steps (early stopping)")
    qz.add_argument("--qat-lr", type=float, default=3e-5)
    qz.add_argument("--qat-batch", type=int, default=8, help="qat: windows of --calib-window + 1 tokens per step")
    qz.add_argument("--qat-trainable", default="all", choices=["all", "linears"],
                    help="qat: train every float parameter (the quantized linears, norms, embeddings) or the "
                         "linears only")
    qz.add_argument("--qat-nll-weight", type=float, default=0.0,
                    help="qat: loss = (1 - w) KL(float model || quantized) + w next-token NLL (default 0: "
                         "distillation only; 1 fine-tunes on the text)")
    qz.add_argument("--qat-temperature", type=float, default=2.0, help="qat: softmax temperature of the KL")
    qz.add_argument("--qat-heldout", type=float, default=0.1,
                    help="qat: share of the training text held out to pick the epoch by its KL")


def _add_export_hf(sub) -> None:
    ex = sub.add_parser("export-hf", help="write a (Llama-family) model as an HF transformers folder")
    ex.add_argument("out_dir")
    ex.add_argument("--model", default=None)
    ex.set_defaults(func=cmd_export_hf)


def _add_serve(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _model_arg(sv)
    _engine_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on every route but /health "
                         "(default: $JAXINFER_API_KEY, which keeps the key out of `ps`)")
    sv.add_argument("--max-queue", type=int, default=1024,
                    help="sequences (prompts x n) waiting for the engine before 429; a request with more gets 400")
    sv.add_argument("--max-request-bytes", type=int, default=4 << 20,
                    help="larger request bodies get 413 (default 4 MiB)")
    sv.add_argument("--log-level", default="info", type=str.lower,
                    choices=["critical", "error", "warning", "info", "debug", "trace"])   # uvicorn's
    # agents (serve.reasoning, serve.tool_parsers): vLLM's flag names and parser names
    from serve.reasoning import REASONING_PARSERS
    from serve.tool_parsers import TOOL_PARSERS
    sv.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS + ("none",),
                    help="split the model's reasoning from its answer (message.reasoning_content); "
                         "default: the one the chat template shows, if any")
    sv.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                    help="the family's tool-call format parsed under tool_choice auto (openai: gpt-oss "
                         "harmony); default: the one the chat template shows, else hermes")
    sv.add_argument("--chat-template", default=None,
                    help="a Jinja chat template file used instead of the tokenizer's")
    sv.add_argument("--trust-request-chat-template", action="store_true",
                    help="requests may bring their own chat template (chat_template; vLLM's flag: refused "
                         "without it)")
    sv.add_argument("--enable-sleep-mode", action="store_true",
                    help="serve POST /sleep, POST /wake_up and GET /is_sleeping (vLLM's) and POST "
                         "/update_weights_from_disk (SGLang's): free the accelerator between uses, new "
                         "weights without a restart")
    _multihost_args(sv)
    sv.set_defaults(func=cmd_serve)


def _add_batch(sub) -> None:
    bt = sub.add_parser("batch", help="run an OpenAI batch file (JSONL) offline")
    _model_arg(bt)
    _engine_args(bt)
    bt.add_argument("input")
    bt.add_argument("output")
    bt.add_argument("--quiet", action="store_true")
    _multihost_args(bt)
    bt.set_defaults(func=cmd_batch)


def _add_eval_ppl(sub) -> None:
    e = sub.add_parser("eval-ppl", help="perplexity and bits per byte of a text file")
    _model_arg(e)
    add_engine_args(e, only=("dtype",), defaults={"dtype": "float32"})
    e.add_argument("--text", default=None, help="UTF-8 text file (default: the model's heldout.txt)")
    e.add_argument("--window", type=int, default=256)
    e.add_argument("--stride", type=int, default=None, help="default: window // 2")
    e.add_argument("--quantize", default=None, choices=QUANTIZE_CHOICES,
                   help="quantization at load time (weights; fp8 on GPU also scales activations to e4m3)")
    e.add_argument("--kv-dtype", default=None, choices=KV_DTYPE_CHOICES,
                   help="score through the paged KV cache in this dtype")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval_ppl)


def cap_xla_allocator(memory_fraction: float | None) -> None:
    """JAX's GPU allocator takes 75% of the device unless told otherwise, which would cap an engine
    asked for 90%: give it memory_fraction instead, before jax starts a backend (a user's own
    XLA_CLIENT_MEM_FRACTION / XLA_PYTHON_CLIENT_MEM_FRACTION wins)."""
    import os
    if memory_fraction is None or "XLA_CLIENT_MEM_FRACTION" in os.environ or "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return
    os.environ["XLA_CLIENT_MEM_FRACTION"] = f"{memory_fraction:g}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cap_xla_allocator(getattr(args, "memory_fraction", None))
    from jaxinfer.compilation_cache import enable_compilation_cache
    enable_compilation_cache()   # before anything compiles (loading, quantizing); Generator also does
    from jaxinfer.config import ConfigError
    from jaxinfer.weights import CheckpointError
    try:
        return args.func(args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"jaxinfer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
