"""Speculative decoding (n-gram, draft model, Medusa) with a tensor-parallel target, on 8 fake CPU
devices in a subprocess (tests/speculative_tp_worker.py): the target sharded over 2 of them, the
draft model and the heads replicated."""
from __future__ import annotations

import pytest

from tests.fake_devices import run_worker



@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    from tests.sharding_worker import save_llama   # torch: written here, so the worker never imports it

    tmp = tmp_path_factory.mktemp("spec-tp")
    save_llama("vocab136", tmp / "vocab136")
    return run_worker("tests.speculative_tp_worker", tmp)


def test_tp_speculative_decoding_greedy_identical(spec):
    """n-gram, draft model and Medusa at TP 2: the one-device engine's greedy tokens without
    speculation, with proposals made, nothing compiled when the same requests run again, and the
    KV pages leaving each step as they came (the draft is the target itself, so its proposals are
    accepted; n-gram's and the random heads' mostly are not: both paths run)."""
    for method in ("ngram", "draft", "medusa"):
        run = spec[method]
        assert run["first_tokens"] == run["tokens"] == spec["ref_tokens"], method
        assert run["drafts"] > 0 and run["compiles_second_run"] == 0, (method, run)
        assert run["kv_spec_after"] == run["kv_spec_before"], (method, run)
        assert run["target_devices"] == 2
    assert spec["draft"]["accepted"] >= spec["draft"]["drafts"]       # every round accepts a token or more
    assert spec["draft"]["draft_pages_replicated"]
