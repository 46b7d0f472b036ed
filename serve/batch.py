"""The offline batch script: `jaxinfer batch IN.jsonl OUT.jsonl [--model PATH]`.

Input: one request per line in the OpenAI batch-file shape
    {"custom_id": "...", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body": {...}}
All valid requests go to the engine at once, so continuous batching keeps the device full.
Output: one line per input line, in input order, in the OpenAI batch-output shape
    {"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error": {...} | null}
A bad line is reported in its output line and never stops the run. Each result is appended to
OUT as soon as it finishes, so a killed run loses nothing: re-running skips the ids already
in OUT and, at the end, rewrites OUT in input order.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from jaxinfer.config import SamplingParams
from jaxinfer.generator import Generator
from serve.app import ServerState
from serve.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, chat_body, completion_body,
                            new_id, now)

ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


@dataclass
class Job:
    line: int
    custom_id: str
    url: str
    request: Any
    prompts: list[list[int]]
    params: SamplingParams
    rids: list[str] | None = None


def _key(line: int, custom_id: Any) -> str:
    return str(custom_id) if isinstance(custom_id, str) and custom_id else f"line:{line}"


def _error_line(line: int, custom_id: Any, status: int, message: str) -> dict:
    return {"id": new_id("batch_req"), "custom_id": custom_id if isinstance(custom_id, str) else None,
            "line": line, "response": {"status_code": status, "request_id": None, "body": None},
            "error": {"code": "invalid_request" if status < 500 else "server_error", "message": message}}


def parse_line(state: ServerState, line_no: int, text: str) -> Job | dict:
    """A Job, or the error output line for a bad input line."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return _error_line(line_no, None, 400, f"line {line_no + 1} is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return _error_line(line_no, None, 400, f"line {line_no + 1} is not a JSON object")
    cid = obj.get("custom_id")
    url = obj.get("url")
    if not isinstance(cid, str) or not cid:
        return _error_line(line_no, cid, 400, "custom_id must be a non-empty string")
    if url not in ROUTES:
        return _error_line(line_no, cid, 400, f"url must be one of {sorted(ROUTES)}, got {url!r}")
    try:
        req = ROUTES[url].model_validate(obj.get("body"))
        if url == "/v1/completions":
            prompts, params = state.completion_inputs(req)
        else:
            prompt, params = state.chat_inputs(req)
            prompts = [prompt]
    except ValidationError as e:
        return _error_line(line_no, cid, 400, "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                                         for x in e.errors()[:5]))
    except OpenAIError as e:
        return _error_line(line_no, cid, e.status, e.message)
    return Job(line_no, cid, url, req, prompts, params)


def _result_line(state: ServerState, job: Job, outputs: dict[str, list[list]]) -> dict:
    groups = [samples for rid in job.rids for samples in outputs[rid]]
    n_prompt = sum(map(len, job.prompts))
    build = completion_body if job.url == "/v1/completions" else chat_body
    want_lp = job.request.logprobs is not None if job.url == "/v1/completions" else job.request.logprobs
    rid = new_id("cmpl" if job.url == "/v1/completions" else "chatcmpl")
    body = build(rid, now(), state.model_name, groups, n_prompt, state.token_str, bool(want_lp))
    return {"id": new_id("batch_req"), "custom_id": job.custom_id, "line": job.line,
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}


def run_batch(gen: Generator, in_path: str | Path, out_path: str | Path, model_name: str,
              progress: bool = True) -> dict[str, int]:
    from tqdm import tqdm

    state = ServerState(gen, model_name, None, max_queue=1 << 30)
    lines = Path(in_path).read_text(encoding="utf-8").splitlines()
    out_path = Path(out_path)
    done: dict[str, dict] = {}
    if out_path.exists():
        for text in out_path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(text)
                done[_key(rec.get("line", -1), rec.get("custom_id"))] = rec
            except json.JSONDecodeError:
                continue  # a line cut by a kill: that request is simply redone
    jobs: list[Job] = []
    results: dict[str, dict] = dict(done)
    sink = open(out_path, "a", encoding="utf-8")

    def record(key: str, rec: dict) -> None:
        results[key] = rec
        sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
        sink.flush()

    for i, text in enumerate(lines):
        if not text.strip():
            continue
        parsed = parse_line(state, i, text)
        key = _key(i, parsed.custom_id if isinstance(parsed, Job) else parsed.get("custom_id"))
        if key in done:
            continue
        if isinstance(parsed, dict):
            record(key, parsed)
        else:
            jobs.append(parsed)
    eng = gen.engine
    owner: dict[str, Job] = {}
    outputs: dict[str, list[list]] = {}
    pending: dict[int, int] = {}
    for job in jobs:
        try:
            job.rids = [eng.add_request(p, job.params) for p in job.prompts]
        except ValueError as e:
            for rid in job.rids or []:
                eng.abort(rid)
            record(job.custom_id, _error_line(job.line, job.custom_id, 400, str(e)))
            continue
        pending[id(job)] = len(job.rids) * job.params.n
        for rid in job.rids:
            owner[rid] = job
            outputs[rid] = [[] for _ in range(job.params.n)]
    t0, n_tokens = time.perf_counter(), 0
    bar = tqdm(total=len(pending), disable=not progress, unit="req", desc="batch")
    while eng.has_unfinished():
        for d in eng.step():
            outputs[d.request_id][d.sample_index].append(d)
            n_tokens += len(d.token_ids)
            if d.finished:
                job = owner[d.request_id]
                pending[id(job)] -= 1
                if pending[id(job)] == 0:
                    record(job.custom_id, _result_line(state, job, outputs))
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    sink.close()
    # final file: one line per input line, in input order
    ordered = []
    for i, text in enumerate(lines):
        if not text.strip():
            continue
        try:
            cid = json.loads(text).get("custom_id")
        except (json.JSONDecodeError, AttributeError):
            cid = None
        rec = results.get(_key(i, cid)) or results.get(_key(i, None))
        ordered.append(rec or _error_line(i, cid, 500, "no result recorded"))
    tmp = out_path.with_suffix(out_path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered), encoding="utf-8")
    os.replace(tmp, out_path)
    return {"lines": len(ordered), "skipped": len(done), "ran": len(jobs),
            "errors": sum(r["error"] is not None for r in ordered)}
