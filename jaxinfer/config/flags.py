"""The CLI's engine flags, derived from EngineConfig's fields (as vLLM's arg_utils does): each
flag's name, type, choices, default and help come from its field (jaxinfer/config/engine.py), so
a new setting needs no edit here. jaxinfer/cli.py and bench/ add them to their parsers and read
them back with engine_kwargs; parsing stays theirs. Imports neither jax nor bench.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterable

from jaxinfer.config.engine import settings

# the settings `jaxinfer bench` shares with the engine it runs or launches
SPECULATIVE_SETTINGS = ("speculative_method", "num_speculative_tokens", "speculative_max_batch")
_TYPES = {"int": int, "float": float, "str": str}


def flag_names(f: dataclasses.Field) -> tuple[str, ...]:
    """The field's option strings: its metadata's "flags", else --field-name, or --no-field-name for
    a boolean setting on by default (the flag turns it off)."""
    if "flags" in f.metadata:
        return f.metadata["flags"]
    name = (f.metadata["alias"][0] if "alias" in f.metadata else f.name).replace("_", "-")
    return (f"--no-{name}",) if f.default is True else (f"--{name}",)


def add_engine_args(p: argparse.ArgumentParser | Any, only: Iterable[str] | None = None, exclude: Iterable[str] = (),
                    defaults: dict[str, Any] | None = None) -> None:
    """Add the flags of EngineConfig's settings (`only` these, in EngineConfig's order, else every one
    but `exclude`) to p, a parser or argument group. defaults: a command whose own default differs
    from EngineConfig's (the value goes to the field's dest). With speculative_method comes
    --speculative-model, the folder of what the method loads (a path for from_pretrained, not an
    engine setting)."""
    wanted = set(only) if only is not None else None
    exclude, defaults = set(exclude), defaults or {}
    fields = [f for f in settings() if (wanted is None or f.name in wanted) and f.name not in exclude]
    unknown = (wanted or set()) - {f.name for f in settings()}
    assert not unknown, f"not EngineConfig settings: {sorted(unknown)}"
    for f in fields:
        default = defaults.get(f.name, f.default)
        kind = f.type.replace(" | None", "")
        if kind.startswith("dict["):   # name=value pairs (lora_modules: NAME=PATH ...)
            p.add_argument(*flag_names(f), dest=f.name, nargs="+", metavar="NAME=PATH", default=default,
                           help=f.metadata["help"])
        elif kind.startswith("tuple[int"):   # a list of integers (token_buckets: T ...)
            p.add_argument(*flag_names(f), dest=f.name, nargs="+", type=int, metavar="T", default=default,
                           help=f.metadata["help"])
        elif kind == "bool":
            p.add_argument(*flag_names(f), dest=f.name, action="store_true" if f.default is False else "store_false",
                           default=default, help=f.metadata["help"])
        elif "alias" in f.metadata:     # given in the alias's unit, kept as the field's
            p.add_argument(*flag_names(f), dest=f.name, type=_scaled(f.metadata["alias"][1]), default=default,
                           metavar="N", help=f.metadata["help"])
        else:
            p.add_argument(*flag_names(f), dest=f.name, type=_TYPES[kind], default=default,
                           choices=f.metadata.get("choices"), help=f.metadata["help"])
        if f.name == "speculative_method":
            p.add_argument("--speculative-model", default=None,
                           help="the draft model's or Medusa heads' folder (default for the bundled model: the "
                                "bundled ones)")


def _scaled(scale: int):
    """An argparse type: a number >= 0 in a setting's alias unit -> the field's integer value."""
    def parse(text: str) -> int:
        value = float(text)
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
        return int(round(value * scale))
    parse.__name__ = "number"
    return parse


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings (and --speculative-model) among the parsed flags, as from_pretrained's
    keywords."""
    names = [f.name for f in settings()] + ["speculative_model"]
    return {name: getattr(args, name) for name in names if hasattr(args, name)}
