"""The offline batch script: `jaxinfer batch IN.jsonl OUT.jsonl [--model PATH]`.

Input: one request per line in the OpenAI batch-file shape
    {"custom_id": "...", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions" | "/v1/responses"
     | "/v1/embeddings" | "/v1/score" | "/v1/rerank", "body": {...}}
(embeddings, scores and reranking on a model that serves them, as vLLM's run-batch takes them, also
at "/score", "/rerank" and "/v2/rerank"; the bodies are the server's).
All valid requests go to the engine at once, so continuous batching keeps the device full; beam-search
requests (use_beam_search, serve/beam.py) run after them, one line at a time (each line's prompts
together), as their rounds depend on each other.
Output: one line per input line, in input order, in the OpenAI batch-output shape
    {"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error": {...} | null}
A bad line (not UTF-8, not JSON, not an object, text that is not valid Unicode, a bad request) is
reported in its output line, with its line number, and never stops the run. Results are keyed by
input line, so a custom_id used twice keeps both results. Each result is appended to OUT as soon as
it finishes, so a killed run loses nothing: re-running skips the lines already in OUT (unreadable
lines there are ignored and redone) and, at the end, rewrites OUT in input order.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from jaxinfer.client import SubmitError
from jaxinfer.config import SamplingParams
from jaxinfer.host.beam_search import BeamSearchParams
from jaxinfer.engine import EMBEDDING_PARAMS
from jaxinfer.generator import Generator
from serve.app import ServerState
from serve.beam import beam_params
from serve.echo import first_prompt_logprobs, vllm_prompt_logprobs
from serve.embeddings import (EmbeddingRequest, RerankRequest, ScorePlan, ScoreRequest, embeddings_body,
                              encode_embedding_inputs, rerank_plan, score_plan)
from serve.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, chat_body, completion_body,
                            find_invalid_text, new_id, now, response_id, with_token_ids)
from serve.responses import ResponsesRequest, final_body, prepared

ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/v1/responses": ResponsesRequest,
          "/v1/embeddings": EmbeddingRequest, "/v1/score": ScoreRequest, "/score": ScoreRequest,
          "/v1/rerank": RerankRequest, "/rerank": RerankRequest, "/v2/rerank": RerankRequest}


@dataclass
class Job:
    line: int
    custom_id: str
    url: str
    request: Any
    prompts: list[list[int]]
    params: SamplingParams
    rids: list[str] | None = None
    echo: Any = None            # completions: serve.echo.Echo (echo, prompt logprobs)
    parsers: Any = None            # chat: how the output is read (serve.reasoning.OutputParsers)
    poolings: list | None = None   # embeddings, scores: each input's PoolingState
    plan: ScorePlan | None = None  # scores and reranking: how the vectors make the body
    beam: BeamSearchParams | None = None   # use_beam_search: the search's params
    responses: tuple | None = None  # /v1/responses: (its chat request, its input items, its id, created)


def _key(line: int, custom_id: Any) -> tuple[int, str | None]:
    """Results are keyed by input line; the custom_id guards a resume against an edited input file."""
    return line, custom_id if isinstance(custom_id, str) else None


def _error_line(line: int, custom_id: Any, status: int, message: str) -> dict:
    return {"id": new_id("batch_req"), "custom_id": custom_id if isinstance(custom_id, str) else None,
            "line": line, "response": {"status_code": status, "request_id": None, "body": None},
            "error": {"code": "invalid_request" if status < 500 else "server_error", "message": message}}


def parse_line(state: ServerState, line_no: int, text: str | bytes) -> Job | dict:
    """A Job, or the error output line for a bad input line (raw bytes: not valid UTF-8)."""
    if isinstance(text, bytes):
        return _error_line(line_no, None, 400, f"line {line_no + 1} is not valid UTF-8")
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        return _error_line(line_no, None, 400, f"line {line_no + 1} is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return _error_line(line_no, None, 400, f"line {line_no + 1} is not a JSON object")
    bad = find_invalid_text(obj)
    if bad is not None:
        cid = obj.get("custom_id") if bad != "custom_id" else None
        return _error_line(line_no, cid, 400, f"line {line_no + 1}: {bad} is not valid Unicode text "
                                              "(it contains a lone UTF-16 surrogate)")
    cid = obj.get("custom_id")
    url = obj.get("url")
    if not isinstance(cid, str) or not cid:
        return _error_line(line_no, cid, 400, "custom_id must be a non-empty string")
    if url not in ROUTES:
        return _error_line(line_no, cid, 400, f"url must be one of {sorted(ROUTES)}, got {url!r}")
    parsers = poolings = plan = responses = None
    try:
        if url == "/v1/responses":
            ResponsesRequest.check_unsupported(obj.get("body"))
        req = ROUTES[url].model_validate(obj.get("body"))
        echo = None
        if isinstance(req, ResponsesRequest):
            for name in ("stream", "background"):
                if getattr(req, name):
                    raise OpenAIError(400, f"{name}: a batch line's response is written whole", param=name)
            chat, items, prompt, params, parsers = prepared(state, req)
            prompts, responses = [prompt], (chat, items, new_id("resp"), now())
        elif url == "/v1/completions":
            prompts, params, echo = state.completion_request(req)
        elif url == "/v1/embeddings":
            state.check_model(req.model)
            if req.encoding_format in ("bytes", "bytes_only"):   # a JSONL output line holds JSON, not bytes
                raise OpenAIError(400, f"encoding_format {req.encoding_format!r} makes a binary response, which "
                                       "a batch output line cannot hold; use 'float' or 'base64'",
                                  param="encoding_format")
            (prompts, poolings), params = encode_embedding_inputs(state, req), EMBEDDING_PARAMS
        elif isinstance(req, (ScoreRequest, RerankRequest)):
            state.check_model(req.model)
            plan = (score_plan if isinstance(req, ScoreRequest) else rerank_plan)(state, req)
            prompts, poolings, params = plan.ids, plan.poolings, EMBEDDING_PARAMS
        else:
            prompt, params, parsers = state.chat_request(req)
            prompts = [prompt]
        beam = beam_params(req, params) if getattr(req, "use_beam_search", False) else None
    except ValidationError as e:
        return _error_line(line_no, cid, 400, "; ".join(
            f"{'.'.join(map(str, x['loc']))}: {x['msg']}" if x["loc"] else x["msg"] for x in e.errors()[:5]))
    except OpenAIError as e:
        return _error_line(line_no, cid, e.status, e.message)
    except Exception as e:   # one line's surprise never ends the run
        return _error_line(line_no, cid, 500, f"line {line_no + 1}: {type(e).__name__}: {e}")
    return Job(line_no, cid, url, req, prompts, params, echo=echo,
               parsers=parsers if url in ("/v1/chat/completions", "/v1/responses") else None, poolings=poolings,
               beam=beam, plan=plan, responses=responses)


def _read_lines(path: Path) -> list[str | bytes]:
    """The file's lines, decoded; a line that is not valid UTF-8 stays bytes (reported, not fatal)."""
    out: list[str | bytes] = []
    for raw in path.read_bytes().split(b"\n"):
        raw = raw.removesuffix(b"\r")
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(raw)
    if out and out[-1] == "":
        out.pop()
    return out


def _read_done(out_path: Path) -> dict[tuple[int, str | None], dict]:
    """Records finished by an earlier run; anything unreadable (a line cut by a kill, a stray
    edit) is skipped and that input line is simply redone."""
    done: dict[tuple[int, str | None], dict] = {}
    if not out_path.exists():
        return done
    for text in _read_lines(out_path):
        try:
            rec = json.loads(text)
        except (json.JSONDecodeError, RecursionError, TypeError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("line"), int) and "error" in rec:
            done[_key(rec["line"], rec.get("custom_id"))] = rec
    return done


def _result_line(state: ServerState, job: Job, outputs: dict[str, list[list]]) -> dict:
    groups = [samples for rid in job.rids for samples in outputs[rid]]
    model = state.check_model(job.request.model) or state.model_name
    if job.url == "/v1/embeddings" or job.plan is not None:
        vectors = [g[-1].embedding for g in groups]
        rid = response_id("embd" if job.plan is None else job.plan.prefix, None, job.request.request_id)    # vLLM's request_id, as for chat
        body = (job.plan.body(vectors, model, sum(map(len, job.prompts)), rid) if job.plan is not None else
                embeddings_body(job.request, model, vectors, sum(map(len, job.prompts)), rid))
        return {"id": new_id("batch_req"), "custom_id": job.custom_id, "line": job.line,
                "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}
    n_prompt = sum(map(len, job.prompts))
    if job.responses is not None:
        chat, items, rid, created = job.responses
        body = final_body(state, job.request, rid, created, model, chat, items, job.parsers, groups[0], n_prompt)
        return {"id": new_id("batch_req"), "custom_id": job.custom_id, "line": job.line,
                "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}
    build = completion_body if job.url == "/v1/completions" else chat_body
    want_lp = job.request.logprobs is not None if job.url == "/v1/completions" else job.request.logprobs
    rid = response_id("cmpl" if job.url == "/v1/completions" else "chatcmpl", None, job.request.request_id)
    extra = ({"tools": job.request.tool_plan(), "parsers": job.parsers, "token_bytes": state.token_bytes,
              "role": job.request.response_role(), "echo": job.request.echo_text()}
             if job.url == "/v1/chat/completions" else {})
    token_str = state.logprob_token_str(job.request)
    body = build(rid, now(), model, groups, n_prompt, token_str, bool(want_lp), job.params.n, **extra)
    if job.echo is not None:
        body = job.echo.apply(body, groups, token_str, bool(want_lp), job.params.n)
    elif getattr(job.request, "prompt_logprobs", None) is not None:   # chat: vLLM's top-level field
        entries = first_prompt_logprobs(groups[0])
        body["prompt_logprobs"] = None if entries is None else vllm_prompt_logprobs(entries, job.prompts[0],
                                                                                    token_str)
    if job.request.return_token_ids:
        echo_only = job.echo is not None and job.echo.echo_only   # its one drawn token is no output
        body = with_token_ids(body, [[] for _ in groups] if echo_only else groups, job.prompts, job.params.n)
    return {"id": new_id("batch_req"), "custom_id": job.custom_id, "line": job.line,
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}


def _run_beam_job(state: ServerState, client, job: Job, outputs: dict[str, list[list]], record) -> None:
    """A use_beam_search line: the search over its prompts, its result (or error) line recorded."""
    try:
        results = client.beam_search(job.prompts, job.beam, cache_salt=getattr(job.request, "cache_salt", None),
                                     priority=getattr(job.request, "priority", 0),
                                     lora=state.check_model(job.request.model))
    except (SubmitError, ValueError) as e:
        record(_key(job.line, job.custom_id), _error_line(job.line, job.custom_id, 400, getattr(e, "message", str(e))))
        return
    job.rids = [f"beam-{job.line}-{i}" for i in range(len(results))]
    for rid, deltas in zip(job.rids, results):
        outputs[rid] = [[] for _ in range(job.beam.beam_width)]
        for d in deltas:
            outputs[rid][d.sample_index].append(d)
    record(_key(job.line, job.custom_id), _result_line(state, job, outputs))


def _write_in_order(out_path: Path, results: dict, keys: dict[int, tuple[int, str | None]]) -> list[dict]:
    """The final file: one line per input line, in input order (written whole, then moved in place)."""
    ordered = [results.get(key) or _error_line(i, key[1], 500, f"line {i + 1}: no result recorded")
               for i, key in keys.items()]
    tmp = out_path.with_suffix(out_path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered), encoding="utf-8")
    os.replace(tmp, out_path)
    return ordered


def run_batch(gen: Generator, in_path: str | Path, out_path: str | Path, model_name: str,
              progress: bool = True) -> dict[str, int]:
    from tqdm import tqdm

    state = ServerState(gen, model_name, None, max_queue=1 << 30)
    lines = _read_lines(Path(in_path))
    out_path = Path(out_path)
    done = _read_done(out_path)
    jobs: list[Job] = []
    results: dict[tuple[int, str | None], dict] = dict(done)
    sink = open(out_path, "a", encoding="utf-8")

    def record(key: tuple[int, str | None], rec: dict) -> None:
        results[key] = rec
        sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
        sink.flush()

    keys: dict[int, tuple[int, str | None]] = {}   # input line -> the key its result is stored under
    skipped = 0
    for i, text in enumerate(lines):
        if not text.strip():
            continue
        parsed = parse_line(state, i, text)
        key = keys[i] = _key(i, parsed.custom_id if isinstance(parsed, Job) else parsed.get("custom_id"))
        if key in done:
            skipped += 1
            continue
        if isinstance(parsed, dict):
            record(key, parsed)
        else:
            jobs.append(parsed)
    client = gen.client
    outputs: dict[str, list[list]] = {}
    pending: dict[int, int] = {}
    t0, n_tokens = time.perf_counter(), 0

    def route_of(job: Job):
        def route(d) -> None:   # called by client.step() with each delta of this job's requests
            nonlocal n_tokens
            outputs[d.request_id][d.sample_index].append(d)
            n_tokens += len(d.token_ids)
            if d.finished:
                pending[id(job)] -= 1
                if pending[id(job)] == 0:
                    record(_key(job.line, job.custom_id), _result_line(state, job, outputs))
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):.0f}")
        return route

    for job in jobs:
        if job.beam is not None:   # after the others (below)
            continue
        try:   # all of a job's prompts or none
            job.rids = client.submit(job.prompts, job.params, route=route_of(job),
                                     cache_salt=getattr(job.request, "cache_salt", None), max_tokens_must_fit=True,
                                     priority=getattr(job.request, "priority", 0),
                                     lora=state.check_model(job.request.model), poolings=job.poolings)
        except ValueError as e:
            record(_key(job.line, job.custom_id), _error_line(job.line, job.custom_id, 400, str(e)))
            continue
        pending[id(job)] = len(job.rids) * job.params.n
        for rid in job.rids:
            outputs[rid] = [[] for _ in range(job.params.n)]
    bar = tqdm(total=len(pending) + sum(j.beam is not None for j in jobs), disable=not progress, unit="req",
               desc="batch")
    t0 = time.perf_counter()
    client.run_until_done()
    for job in jobs:
        for rid in job.rids or ():
            client.release(rid)
    for job in (j for j in jobs if j.beam is not None):
        _run_beam_job(state, client, job, outputs, record)
        bar.update(1)
    bar.close()
    sink.close()
    ordered = _write_in_order(out_path, results, keys)
    return {"lines": len(ordered), "skipped": skipped, "ran": len(jobs),
            "errors": sum(r["error"] is not None for r in ordered)}
