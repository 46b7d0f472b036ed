"""The persistent XLA compilation cache, turned on once per process by every front door.

    enable_compilation_cache()     # Generator.__init__ calls it (so the server, the batch script
                                   # and the CLI all get it); idempotent

Compiled executables (the engine's step programs above all) are kept on disk across runs, so a
restarted process loads instead of compiling them (on CPU, most of warm-up's time).
$JAXINFER_COMPILATION_CACHE names the folder (default ~/.cache/jaxinfer/xla); "off" leaves
the cache alone. A cache folder the user chose for jax (jax.config.update("jax_compilation_cache_dir",
...) or $JAX_COMPILATION_CACHE_DIR, which jax reads into the same setting at import) always wins,
and so do the user's own thresholds.

Threshold: jax writes only executables that took at least jax_persistent_cache_min_compile_time_secs
(default 1 s) to compile. The step programs are the executables that matter: on a small CPU each
takes seconds and clears it, but a GPU compiles one step shape in well under a second (a whole
warm-up of every token and block bucket takes seconds), so with jax's default none would ever be
written there. When jaxinfer picks the folder it also sets the threshold to 0 (as jax's own quick
start does): every executable is kept, the small ones costing a few KB and a file write each. The
size threshold (jax_persistent_cache_min_entry_size_bytes, default 0: no minimum on a local disk)
already keeps everything.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["enable_compilation_cache", "ENV", "default_folder"]

ENV = "JAXINFER_COMPILATION_CACHE"
_OFF = ("", "off", "0", "none", "false")
_JAX_MIN_COMPILE_TIME_DEFAULT = 1.0    # jax's default for jax_persistent_cache_min_compile_time_secs


def default_folder() -> str:
    return str(Path.home() / ".cache" / "jaxinfer" / "xla")


def enable_compilation_cache() -> str | None:
    """Points jax's persistent compilation cache at $JAXINFER_COMPILATION_CACHE (default
    ~/.cache/jaxinfer/xla), unless that is "off" or a cache folder is already set (by the user,
    or by an earlier call). Returns the folder in use, or None when off."""
    where = os.environ.get(ENV, default_folder())
    if where.strip().lower() in _OFF:
        return None
    import jax   # here, so that importing this module (the CLI does) starts nothing

    current = jax.config.jax_compilation_cache_dir
    if current:             # the user's folder, or ours from an earlier call: leave it as it is
        return current
    jax.config.update("jax_compilation_cache_dir", where)
    if ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
            and jax.config.jax_persistent_cache_min_compile_time_secs == _JAX_MIN_COMPILE_TIME_DEFAULT):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return where
