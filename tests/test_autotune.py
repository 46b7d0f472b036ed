"""The autotuner's per-process measuring budget (pallas_kernels/autotune.py), on a fake clock.

A fake `run` advances a fake time.perf_counter by a fixed cost per launch, so every median, every
second of budget spent and every decision is known exactly: with warmup=1 and iters=3 a candidate
of cost c is launched 4 times, costs 4c of budget and has median c (costs are powers of two, so
the sums are exact in floating point)."""
from __future__ import annotations

import logging

import jax
import pytest

from jaxinfer import quant
from pallas_kernels import autotune as at

GPU = "gpu:Fake H200"


@pytest.fixture(autouse=True)
def _fresh_process(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXINFER_AUTOTUNE_CACHE", str(tmp_path / "default.json"))
    monkeypatch.delenv("JAXINFER_AUTOTUNE_BUDGET_S", raising=False)
    monkeypatch.delenv("JAXINFER_AUTOTUNE", raising=False)
    at.clear_memory_cache()
    yield
    at.clear_memory_cache()


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(at.time, "perf_counter", c)
    return c


def fake_run(clock: FakeClock, costs: dict[int, float], calls: list[int]):
    def run(cfg):
        calls.append(cfg["v"])
        clock.now += costs[cfg["v"]]
        return None
    return run


def cands(n: int) -> list[dict]:
    return [{"v": i} for i in range(n)]


# per-launch costs; per candidate the budget pays 4x (1 warm-up + 3 timed launches)
COST_A = {0: 0.25, 1: 0.125, 2: 0.0625}                    # 1 + 0.5 + 0.25 = 1.75 s, best v2
COST_B = {0: 0.125, 1: 0.0625, 2: 0.25, 3: 0.03125}        # 0.5, 0.25, 1.0, 0.125; best v3
COST_C = {0: 0.0625, 1: 0.125}                             # 0.25, 0.5; best v0


def tune(name, n, costs, clock, calls, path):
    return at.autotune(name, "16x4096x4096", cands(n), fake_run(clock, costs, calls), cache_path=path,
                       device_key=GPU, warmup=1, iters=3)


def test_budget_stops_measuring_and_leaves_later_keys_at_defaults_uncached(tmp_path, monkeypatch, clock, caplog):
    path = str(tmp_path / "tune.json")
    monkeypatch.setenv("JAXINFER_AUTOTUNE_BUDGET_S", "3")
    caplog.set_level(logging.INFO, logger=at.__name__)
    calls: list[int] = []

    # A: measured to the end (1.75 s of 3), fastest cached as final
    assert tune("A", 3, COST_A, clock, calls, path) == {"v": 2}
    assert calls == [0] * 4 + [1] * 4 + [2] * 4 and clock.now == 1.75
    # B: v0 (-> 2.25 s), v1 (-> 2.5 s), v2 (-> 3.5 s >= 3): stop before v3; best so far v1
    calls.clear()
    assert tune("B", 4, COST_B, clock, calls, path) == {"v": 1}
    assert calls == [0] * 4 + [1] * 4 + [2] * 4 and clock.now == 3.5
    # C: the budget is spent: defaults, nothing measured
    calls.clear()
    assert tune("C", 2, COST_C, clock, calls, path) == {"v": 0}
    assert calls == []
    # the same keys again in this process: the same configs, nothing measured
    assert tune("B", 4, COST_B, clock, calls, path) == {"v": 1}
    assert tune("C", 2, COST_C, clock, calls, path) == {"v": 0}
    assert calls == []

    entries = at.load_cache(path)
    key = lambda name: at.cache_key(name, "16x4096x4096", device_key=GPU)   # noqa: E731
    assert set(entries) == {key("A"), key("B")}                 # C: nothing written
    a = entries[key("A")]
    assert a["config"] == {"v": 2} and a["median_s"] == 0.0625 and "partial" not in a
    assert [(m["config"]["v"], m["median_s"]) for m in a["measured"]] == [(2, 0.0625), (1, 0.125), (0, 0.25)]
    b = entries[key("B")]                                       # progress, not a winner
    assert b["partial"] is True and "config" not in b and b["candidates"] == 4
    assert [(m["config"]["v"], m["median_s"]) for m in b["measured"]] == [(0, 0.125), (1, 0.0625), (2, 0.25)]
    assert at.budget_summary() == {"budget_s": 3.0, "spent_s": 3.5, "tuned": 1, "partial": 1, "left_default": 1}

    # logged once when the budget ran out (at B), and once more by the warm-up's summary
    spent = [r for r in caplog.records if "budget" in r.getMessage()]
    assert len(spent) == 1 and "(3 of 4 candidates measured)" in spent[0].getMessage()
    caplog.clear()
    assert at.log_budget_summary()["left_default"] == 1
    assert at.log_budget_summary()["left_default"] == 1
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "1 kernel shape(s) left at their default launch configs and 1 measured partway" in warning.getMessage()


def test_next_process_resumes_partial_keys_and_tunes_the_rest(tmp_path, monkeypatch, clock):
    path = str(tmp_path / "tune.json")
    monkeypatch.setenv("JAXINFER_AUTOTUNE_BUDGET_S", "3")
    calls: list[int] = []
    tune("A", 3, COST_A, clock, calls, path)
    tune("B", 4, COST_B, clock, calls, path)
    tune("C", 2, COST_C, clock, calls, path)

    at.clear_memory_cache()               # a new process: a fresh budget, the file as it was left
    clock.now, calls = 100.0, []
    assert at.budget_summary()["spent_s"] == 0.0
    assert tune("A", 3, COST_A, clock, calls, path) == {"v": 2}   # cached: not measured
    assert calls == []
    assert tune("B", 4, COST_B, clock, calls, path) == {"v": 3}   # only the candidate still missing
    assert calls == [3] * 4
    assert tune("C", 2, COST_C, clock, calls, path) == {"v": 0}   # measured in full now
    assert calls == [3] * 4 + [0] * 4 + [1] * 4
    assert clock.now == 100.0 + 0.125 + 0.75
    assert at.budget_summary() == {"budget_s": 3.0, "spent_s": 0.875, "tuned": 2, "partial": 0, "left_default": 0}

    entries = at.load_cache(path)
    b = entries[at.cache_key("B", "16x4096x4096", device_key=GPU)]
    assert "partial" not in b and b["config"] == {"v": 3} and b["median_s"] == 0.03125
    assert [m["config"]["v"] for m in b["measured"]] == [3, 1, 0, 2]   # this process's and the last one's
    c = entries[at.cache_key("C", "16x4096x4096", device_key=GPU)]
    assert c["config"] == {"v": 0} and c["median_s"] == 0.0625

    at.clear_memory_cache()               # a third process measures nothing at all
    assert [tune(n, len(cs), cs, clock, calls, path) for n, cs in (("A", COST_A), ("B", COST_B), ("C", COST_C))] \
        == [{"v": 2}, {"v": 3}, {"v": 0}]
    assert calls == [3] * 4 + [0] * 4 + [1] * 4


def test_a_key_cut_before_its_first_candidate_takes_earlier_progress_into_account(tmp_path, monkeypatch, clock):
    """A partial entry from an earlier process counts as this process's best so far too, and a
    candidate that failed there is not compiled again."""
    path = str(tmp_path / "tune.json")
    monkeypatch.setenv("JAXINFER_AUTOTUNE_BUDGET_S", "0.75")
    calls: list[int] = []

    def run(cfg):
        if cfg["v"] == 1:
            calls.append(1)
            raise RuntimeError("out of shared memory")
        return fake_run(clock, COST_B, calls)(cfg)
    go = lambda: at.autotune("B", "16", cands(4), run, cache_path=path, device_key=GPU, iters=3)   # noqa: E731
    assert go() == {"v": 0}                   # v0 (0.5 s), v1 fails, v2 (-> 1.5 s): cut before v3
    assert calls == [0] * 4 + [1] + [2] * 4
    at.clear_memory_cache()
    monkeypatch.setenv("JAXINFER_AUTOTUNE_BUDGET_S", "0")
    calls.clear()
    assert go() == {"v": 0} and calls == []   # no budget: the best measured earlier, nothing measured
    at.clear_memory_cache()
    monkeypatch.delenv("JAXINFER_AUTOTUNE_BUDGET_S")
    assert go() == {"v": 3} and calls == [3] * 4    # v1 is not retried
    entry = at.load_cache(path)[at.cache_key("B", "16", device_key=GPU)]
    assert entry["failed"] == 1 and len(entry["measured"]) == 3


def test_budget_and_switch_from_the_environment(tmp_path, monkeypatch, clock, caplog):
    path = str(tmp_path / "tune.json")
    assert at.budget_seconds() == at.DEFAULT_BUDGET_S == 10.0
    monkeypatch.setenv("JAXINFER_AUTOTUNE_BUDGET_S", "inf")
    assert at.budget_seconds() == float("inf")
    monkeypatch.setenv("JAXINFER_AUTOTUNE_BUDGET_S", "-2")
    assert at.budget_seconds() == 0.0
    monkeypatch.setenv("JAXINFER_AUTOTUNE_BUDGET_S", "ten")
    with caplog.at_level(logging.WARNING, logger=at.__name__):
        assert at.budget_seconds() == at.DEFAULT_BUDGET_S
    assert "JAXINFER_AUTOTUNE_BUDGET_S='ten' is not a number" in caplog.text

    calls: list[int] = []
    monkeypatch.setenv("JAXINFER_AUTOTUNE_BUDGET_S", "1.25")   # A takes 1.75 s: cut before v2
    assert tune("A", 3, COST_A, clock, calls, path) == {"v": 1}
    assert calls == [0] * 4 + [1] * 4
    at.clear_memory_cache()
    monkeypatch.setenv("JAXINFER_AUTOTUNE_BUDGET_S", "0")       # cached winners only, nothing measured
    calls.clear()
    assert tune("A", 3, COST_A, clock, calls, path) == {"v": 1}   # A's best so far (not cached as final)
    assert tune("C", 2, COST_C, clock, calls, path) == {"v": 0} and calls == []
    at.clear_memory_cache()
    monkeypatch.delenv("JAXINFER_AUTOTUNE_BUDGET_S")            # the default budget finishes A
    assert tune("A", 3, COST_A, clock, calls, path) == {"v": 2} and calls == [2] * 4

    # JAXINFER_AUTOTUNE=0: no measuring and no cache (a cached winner is not used either) ...
    at.clear_memory_cache()
    monkeypatch.setenv("JAXINFER_AUTOTUNE", "0")
    calls.clear()
    assert tune("A", 3, COST_A, clock, calls, path) == {"v": 0}
    assert tune("C", 2, COST_C, clock, calls, path) == {"v": 0} and calls == []
    # ... unless forced, as on CPU
    assert at.autotune("C", "16x4096x4096", cands(2), fake_run(clock, COST_C, calls), cache_path=path,
                       force=True, device_key=GPU, iters=3) == {"v": 0}
    assert calls == [0] * 4 + [1] * 4


def test_select_blocks_goes_through_the_budget(tmp_path, monkeypatch):
    """quant.select_blocks with no budget: the defaults, no kernel compiled and no operands made,
    nothing written; JAXINFER_AUTOTUNE=0 returns them before the autotuner is asked."""
    import jax.numpy as jnp
    import numpy as np

    path = str(tmp_path / "qm.json")
    qw = quant.quantize_int4(np.random.default_rng(1).standard_normal((128, 64)).astype(np.float32), 32)
    monkeypatch.setenv("JAXINFER_AUTOTUNE_BUDGET_S", "0")
    made = []
    monkeypatch.setattr(jax, "ensure_compile_time_eval", lambda: made.append(1))   # would fail if used
    cfg = quant.select_blocks(5, 128, 64, qw, jnp.float32, cache_path=path, force=True)
    assert cfg == quant.pallas_block_candidates(5, 128, 64, 4, 32)[0]
    assert made == [] and at.load_cache(path) == {}
    assert at.budget_summary()["left_default"] == 1

    monkeypatch.setenv("JAXINFER_AUTOTUNE", "0")
    monkeypatch.setattr(at, "autotune", lambda *a, **k: pytest.fail("asked the autotuner"))
    assert quant.select_blocks(5, 128, 64, qw, jnp.float32, cache_path=path) == cfg
