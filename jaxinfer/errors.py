"""Errors shared by modules that must not import jax (the Hub resolver, the CLI's early checks)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint we cannot load; the message names the file and, where it applies, the tensor."""


class FieldError(ValueError):
    """A value of a request refused; `field` names the request field it is about (the server's 400
    names it as its param)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
