"""Errors shared by modules that must not import jax (the Hub resolver, the CLI's early checks)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint we cannot load; the message names the file and, where it applies, the tensor."""
