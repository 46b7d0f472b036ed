"""Which accelerator we run on, for the live MBU: jax's device_kind -> the datasheet peaks that
the capacity planner (jaxinfer/plan.py) keeps. Never imports jax: callers pass the kind string.

CPUs have no datasheet figure: set JAXINFER_PEAK_BANDWIDTH (bytes/s) and JAXINFER_PEAK_FLOPS to
get an MBU on a CPU, otherwise it is reported as unknown.
"""
from __future__ import annotations

import os

from jaxinfer.plan import DEVICES, Device


def spec_for_kind(device_kind: str) -> Device | None:
    """Match 'NVIDIA H100 80GB HBM3', 'NVIDIA H200', 'NVIDIA A100-SXM4-40GB', ... to a Device."""
    kind = device_kind.lower().replace("-", " ")
    for key, dev in DEVICES.items():
        family, _, size = key.partition("-")
        if family in kind and (not size or size[:2] in kind):
            return dev
    bw = os.environ.get("JAXINFER_PEAK_BANDWIDTH")
    if bw:
        flops = float(os.environ.get("JAXINFER_PEAK_FLOPS", 0))
        return Device(device_kind, device_kind, 0, float(bw), flops, flops, 0.0, ("from environment",))
    return None
