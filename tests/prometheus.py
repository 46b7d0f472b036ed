"""Read a counter or gauge from a server's /metrics (Prometheus text format), for the tests that
check what the server itself recorded."""
from __future__ import annotations

import httpx


def metric_sum(url: str, name: str, headers: dict | None = None, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0.0 if none: prometheus_client
    writes a labelled counter's sample only once that label set was used)."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, value = line.rsplit(" ", 1)
            if all(w in series for w in want):
                total += float(value)
    return total
