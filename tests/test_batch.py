"""`jaxinfer batch`: 200 lines (some malformed) -> 200 output lines in input order; a run killed
half-way resumes without redoing the ids it finished."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.hf_models import save_text_model

# a 16-token budget and one token bucket: each `jaxinfer batch` run warms up one step shape (the default
# buckets would be 8 and 16)
FLAGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-batched-tokens", "16", "--token-buckets", "16",
         "--max-num-seqs", "8",
         "--block-size", "8", "--quiet", "--served-model-name", "tiny"]


def _lines(n: int = 200) -> list[str]:
    out = []
    for i in range(n):
        if i % 29 == 5:
            out.append("{this is not json")
        elif i % 29 == 11:
            out.append(json.dumps({"custom_id": f"r{i}", "url": "/v1/completions",
                                   "body": {"model": "tiny", "prompt": "fox", "max_tokens": -1}}))
        elif i % 29 == 17:
            out.append(json.dumps({"custom_id": f"r{i}", "url": "/v1/moderations", "body": {}}))
        elif i % 2:
            out.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": "tiny", "messages": [{"role": "user", "content": f"zebra {i}"}],
                                            "max_tokens": 6 + i % 5, "temperature": 0.7, "seed": i}}))
        else:
            out.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                   "body": {"model": "tiny", "prompt": f"the lazy dog {i}", "max_tokens": 60,
                                            "temperature": 0, "ignore_eos": True}}))
    return out


def _run(model, inp, out, wait=True):
    cmd = [sys.executable, "-m", "jaxinfer.cli", "batch", "--model", str(model), str(inp), str(out), *FLAGS]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_text_model(tmp_path_factory.mktemp("batch") / "model")


def test_batch_file_with_bad_lines_and_resume(model, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = _lines()
    inp.write_text("\n".join(lines) + "\n")
    proc = _run(model, inp, out, wait=False)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            done = sum(1 for l in out.read_text().splitlines() if '"status_code": 200' in l) if out.exists() else 0
            if done >= 60:
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    first = {}
    for l in out.read_text().splitlines():
        try:
            rec = json.loads(l)
        except json.JSONDecodeError:
            continue
        if rec["error"] is None:
            first[rec["custom_id"]] = rec["id"]
    assert 60 <= len(first) < 180, "the kill should land half-way"

    result = _run(model, inp, out)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stderr.strip().splitlines()[-1])
    records = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(records) == 200 == summary["lines"]
    # input order, keyed by custom_id (malformed JSON lines have none)
    for i, (line, rec) in enumerate(zip(lines, records)):
        if line.startswith("{this"):
            assert rec["custom_id"] is None and "not valid JSON" in rec["error"]["message"]
        else:
            assert rec["custom_id"] == f"r{i}"
    bad = [r for r in records if r["error"] is not None]
    assert len(bad) == sum(1 for i in range(200) if i % 29 in (5, 11, 17))
    assert any("max_tokens" in r["error"]["message"] for r in bad)
    assert any("/v1/moderations" in r["error"]["message"] for r in bad)
    # nothing finished in the first run was redone: same result ids, and the second run skipped them
    for cid, rid in first.items():
        assert next(r for r in records if r["custom_id"] == cid)["id"] == rid
    assert summary["ran"] == 200 - len(bad) - len(first)
    ok = [r for r in records if r["error"] is None]
    assert all(r["response"]["status_code"] == 200 for r in ok)
    done = next(r for r in ok if r["custom_id"] == "r0")["response"]["body"]
    assert done["object"] == "text_completion" and done["usage"]["completion_tokens"] == 60


def test_batch_keys_by_line_reports_bad_lines_and_goes_on(model, tmp_path):
    """Duplicate custom_ids keep both results; a line that is not UTF-8, holds a lone surrogate or is
    not an object is reported with its line number; an output file with junk lines resumes."""
    from jaxinfer import Generator
    from serve.batch import run_batch

    def req(cid, prompt):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                           "body": {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}}).encode()

    lines = [req("dup", "the lazy dog"), req("dup", "seven wizards"), b'{"custom_id": "bad", "body": "\xff\xfe"}',
             req("sur", "abc\ud800def"), b"[1, 2, 3]", req("\udc00", "fox"),
             req("last", "zebras"),
             json.dumps({"custom_id": "lb", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": "fox", "logit_bias": {"fox": 100}}}).encode(),
             json.dumps({"custom_id": "ids", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "logprobs": 0,
                                  "return_token_ids": True, "return_tokens_as_token_ids": True}}).encode()]
    assert b"\\ud800" in lines[3]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"\n".join(lines) + b"\n")
    out.write_text('[1]\n42\n{"line": "x"}\n{"cut by a ki')   # junk left in an existing output file
    gen = Generator.from_pretrained(model, dtype="float32", max_model_len=128, max_num_batched_tokens=64,
                                    token_buckets=[64], max_num_seqs=8, block_size=8, warmup=False)
    summary = run_batch(gen, inp, out, "tiny", progress=False)
    records = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(records) == summary["lines"] == 9 and summary["ran"] == 4
    assert [r["line"] for r in records] == list(range(9))
    dup = records[:2]
    assert [r["custom_id"] for r in dup] == ["dup", "dup"] and all(r["error"] is None for r in dup)
    assert dup[0]["response"]["body"]["choices"] != dup[1]["response"]["body"]["choices"]
    assert "line 3" in records[2]["error"]["message"] and "UTF-8" in records[2]["error"]["message"]
    assert "line 4" in records[3]["error"]["message"] and "body.prompt" in records[3]["error"]["message"]
    assert "Unicode" in records[3]["error"]["message"]
    assert "line 5" in records[4]["error"]["message"] and "not a JSON object" in records[4]["error"]["message"]
    assert records[5]["custom_id"] is None and "custom_id" in records[5]["error"]["message"]
    assert records[6]["custom_id"] == "last" and records[6]["error"] is None
    assert "logit_bias keys must be token ids" in records[7]["error"]["message"]
    # vLLM's return_token_ids and return_tokens_as_token_ids, as the server returns them
    choice = records[8]["response"]["body"]["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7] and len(choice["token_ids"]) == 3
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    # resuming a finished run redoes nothing and keeps both duplicates
    again = run_batch(gen, inp, out, "tiny", progress=False)
    assert again["ran"] == 0 and again["skipped"] == 9
    assert [json.loads(l)["id"] for l in out.read_text().splitlines()] == [r["id"] for r in records]
    assert gen.stats()["kv_blocks_used"] == 0


def test_batch_runs_beam_search_lines(model, tmp_path):
    """use_beam_search lines run after the others, each as Generator.beam_search runs it (tested
    against HF transformers in test_beam_search.py): the same hypotheses, best first; a field the
    search would drop is that line's 400."""
    from jaxinfer import BeamSearchParams, Generator
    from serve.batch import run_batch

    def line(cid, body):
        return json.dumps({"custom_id": cid, "url": "/v1/completions",
                           "body": {"model": "tiny", "max_tokens": 4, "ignore_eos": True, **body}})
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([line("beam", {"prompt": [5, 6, 7], "n": 3, "use_beam_search": True,
                                            "return_token_ids": True}),
                              line("plain", {"prompt": [5, 6, 7], "temperature": 0}),
                              line("stop", {"prompt": [5, 6, 7], "use_beam_search": True, "stop": ["x"]})]) + "\n")
    gen = Generator.from_pretrained(model, dtype="float32", max_model_len=128, max_num_batched_tokens=64,
                                    token_buckets=[64], max_num_seqs=8, block_size=8, warmup=False)
    summary = run_batch(gen, inp, out, "tiny", progress=False)
    records = [json.loads(l) for l in out.read_text().splitlines()]
    assert summary["errors"] == 1 and records[2]["error"]["message"] == "stop is not available with use_beam_search"
    [ref] = gen.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    choices = records[0]["response"]["body"]["choices"]
    assert [c["token_ids"] for c in choices] == [s.token_ids for s in ref.samples]
    assert [c["text"] for c in choices] == [s.text for s in ref.samples]
    assert records[1]["error"] is None and gen.stats()["kv_blocks_used"] == 0
