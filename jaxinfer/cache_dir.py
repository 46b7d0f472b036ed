"""jaxinfer's cache folders on disk: $JAXINFER_CACHE, else ~/.cache/jaxinfer. Never imports jax."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(name: str) -> Path:
    """Cache folder `name`: the prepared GGUF folders ("gguf"), rebuilt tokenizers ("tiktoken"),
    --hf-overrides configs ("hf-overrides")."""
    return Path(os.environ.get("JAXINFER_CACHE") or Path.home() / ".cache" / "jaxinfer") / name
