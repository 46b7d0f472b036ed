"""Peak figures of accelerators (vendor datasheets), for MBU / MFU and the capacity planner.
Never imports jax: callers pass the device kind string (jax.devices()[0].device_kind).

H100 SXM5: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense bf16 (NVIDIA H100 datasheet).
H200 SXM: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense bf16 (NVIDIA H200 datasheet).
A100 SXM: 40 GB at 1.555 TB/s / 80 GB at 2.039 TB/s, 312 TFLOP/s dense bf16 (NVIDIA A100 datasheet).
CPUs have no datasheet figure here: set JAXINFER_PEAK_BANDWIDTH (bytes/s) and JAXINFER_PEAK_FLOPS,
or the live MBU is reported as unknown.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: float
    bandwidth: float        # bytes / s
    flops_bf16: float       # dense FLOP / s


DEVICES = {
    "h100": DeviceSpec("NVIDIA H100 SXM 80GB", 80e9, 3.35e12, 989e12),
    "h200": DeviceSpec("NVIDIA H200 141GB", 141e9, 4.8e12, 989e12),
    "a100-40gb": DeviceSpec("NVIDIA A100 40GB", 40e9, 1.555e12, 312e12),
    "a100-80gb": DeviceSpec("NVIDIA A100 80GB", 80e9, 2.039e12, 312e12),
}


def spec_for_kind(device_kind: str) -> DeviceSpec | None:
    """Match a jax device_kind ('NVIDIA H100 80GB HBM3', 'NVIDIA H200', 'cpu', ...) to a spec."""
    kind = device_kind.lower()
    for key, spec in DEVICES.items():
        family = key.split("-")[0]
        if family in kind and (not key.endswith("gb") or key.split("-")[1][:2] in kind):
            return spec
    bw, flops = os.environ.get("JAXINFER_PEAK_BANDWIDTH"), os.environ.get("JAXINFER_PEAK_FLOPS")
    if bw:
        return DeviceSpec(device_kind, 0.0, float(bw), float(flops or 0))
    return None
