"""The jax / flax pairs that work together, checked before anything imports flax.

flax 0.12.8 fails to import on jax 0.11.2 (`jax.experimental.hijax` lost `HiPrimitive`; flax
0.12.10 follows it), and pip cannot state "flax >= 0.12.10 when jax >= 0.11.1" as a dependency: the
`cuda12` / `cuda13` extras pin both, and this check turns any other broken pair (jax upgraded on its
own, an image with old flax) into one clear error instead of flax's AttributeError deep in an import.
Pure Python: never imports jax or flax.
"""
from __future__ import annotations

from importlib import metadata
from typing import Callable

# (first jax release that needs a newer flax, the first flax release that works with it)
FLAX_FOR_JAX = ((0, 11, 1), (0, 12, 10))


def release(version: str) -> tuple[int, ...]:
    """'0.11.2' -> (0, 11, 2); pre-release and local suffixes ('0.12.10rc1', '0.11.2+cuda') are cut."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
        if digits != piece:
            break
    return tuple(parts + [0] * (3 - len(parts)))


def check_jax_flax(version: Callable[[str], str] = metadata.version) -> None:
    """Raise ImportError naming the fix when the installed jax and flax are a pair that fails."""
    try:
        jax_v, flax_v = version("jax"), version("flax")
    except metadata.PackageNotFoundError:
        return   # not installed: the import that needs it says so itself
    (jax_min, flax_min) = FLAX_FOR_JAX
    if release(jax_v) >= jax_min and release(flax_v) < flax_min:
        need = ".".join(map(str, flax_min))
        raise ImportError(f"flax {flax_v} does not work with jax {jax_v} (jax >= {'.'.join(map(str, jax_min))} needs "
                          f"flax >= {need}): pip install 'flax>={need}' (or install jaxinfer with its "
                          f"cuda12 / cuda13 extra, which pins both)")
