"""One safetensors file: its header parsed (bfloat16 and float8 mapped to numpy through ml_dtypes, a
damaged file reported by file and tensor name) over a memory map. jax-free: the config readers
(models/hf_configs) read tensor names through it too."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxinfer.errors import CheckpointError

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn}


class SafetensorsFile:
    """A parsed safetensors header over a memory-mapped file; get() returns zero-copy views."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors header "
                                      f"({header_len} header bytes declared, file has {size})")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
        header.pop("__metadata__", None)
        self.data_start = 8 + header_len
        data_size = size - self.data_start
        self.tensors: dict[str, tuple[Any, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = _ST_DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                start, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({e!r})") from None
            if end - start != math.prod(shape) * np.dtype(dtype).itemsize:
                raise CheckpointError(f"{path}: tensor {name!r} of shape {shape} {info['dtype']} "
                                      f"declares {end - start} bytes")
            if end > data_size:
                raise CheckpointError(f"{path}: file is truncated: tensor {name!r} needs bytes "
                                      f"[{start}, {end}) of the data section but it has only {data_size}")
            self.tensors[name] = (dtype, shape, start, end)
        self._mmap: np.memmap | None = None

    def get(self, name: str) -> np.ndarray:
        dtype, shape, start, end = self.tensors[name]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap[self.data_start + start: self.data_start + end].view(dtype).reshape(shape)
