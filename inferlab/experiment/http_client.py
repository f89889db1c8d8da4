"""The latency bench over HTTP (`inferlab job=bench bench.url=http://127.0.0.1:8000`).

The workload is the one an in-process bench builds (inferlab.experiment.workload, from the vocabulary size
and max_model_len the server's model card reports): each request is sent at its arrival time as
a streamed completion of its prompt token ids, with max_tokens = its output length, ignore_eos,
its priority and metadata, and timed on the client: its first token and every token when the
chunk carrying it arrives (the server reports each chunk's token ids). The server's queue time,
cached prompt tokens and preemptions come with each request's last chunk. The records make the
same requests.jsonl and latency figures as an in-process run (inferlab.experiment.latency, bench.write_run_records).

A request answered with an error counts in num_errors and as a request without output. Repeats
run one after the other against the same server (its prefix cache is not reset between them),
repeat i's workload drawn from bench.seed + i as in process.
"""

import asyncio
import json
import os
from time import perf_counter

import httpx

from inferlab.conf import flat_choices
from inferlab.conf.bench import BenchConfigError, validate_bench
from inferlab.experiment.latency import RequestRecord, RunRecords, aggregate_repeats, latency_figures
from inferlab.experiment.records import record_result, start_run_record, write_run_records
from inferlab.experiment.sse_client import HTTPProtocolError, SSEClient
from inferlab.experiment.workload import Workload, WorkloadRequest, build_workload

API_KEY_ENV = "INFERLAB_API_KEY"  # sent as the bearer token when set
MAX_ERRORS_KEPT = 10  # error messages result.json keeps, of however many requests failed


def check_http_bench(bench) -> None:
    """Raises BenchConfigError for settings an HTTP run cannot honour."""
    validate_bench(bench)
    if not str(bench.url).startswith(("http://", "https://")):
        raise BenchConfigError(f"bench.url must be an http:// or https:// address, got {bench.url!r}")
    if bench.timeline:
        raise BenchConfigError("bench.timeline needs the engine's steps, which a run over bench.url cannot see")


def model_card(client: httpx.Client, url: str) -> dict:
    """The served model's card from GET /v1/models: id, max_model_len, vocab_size, plugins."""
    try:
        response = client.get(f"{url}/v1/models")
    except httpx.HTTPError as e:
        raise BenchConfigError(f"no inferlab server answers at bench.url={url}: {e}") from None
    if response.status_code != 200:
        raise BenchConfigError(f"GET {url}/v1/models answered {response.status_code}: {response.text[:300]}")
    card = response.json()["data"][0]
    missing = [key for key in ("max_model_len", "vocab_size") if key not in card]
    if missing:
        raise BenchConfigError(f"the server at {url} does not report {missing} in its model card: is it inferlab?")
    return card


def request_body(model: str, request: WorkloadRequest, temperature: float, ignore_eos: bool) -> dict:
    return {
        "model": model,
        "prompt": list(request.prompt_token_ids),  # a trace's prompt is given by its blocks
        "max_tokens": request.output_len,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "priority": request.priority,
        "metadata": request.metadata,
        "stream": True,
        "return_token_ids": True,
    }


async def send_request(
    client: SSEClient, body: dict, request: WorkloadRequest, start: float
) -> tuple[RequestRecord, str | None]:
    """Sends one request at its arrival time (start + arrival_s on perf_counter) and records
    it; returns the record and the error, if the request failed."""
    delay = start + request.arrival_s - perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    token_times: list[float] = []
    finish_reason, stats, error = "error", {}, None
    response = None
    try:
        response = await client.post("/v1/completions", json.dumps(body).encode())
        if response.status != 200:
            error = f"HTTP {response.status}: {(await response.text())[:300]}"
        else:
            async for arrived, data in response.events():
                if data == b"[DONE]":  # the body ends after it: reading on frees the connection for reuse
                    continue
                now = arrived - start
                event = json.loads(data)
                if "error" in event:
                    error = str(event["error"].get("message"))
                    continue
                for choice in event["choices"]:
                    token_times += [now] * len(choice.get("token_ids") or ())
                    if choice.get("finish_reason"):
                        finish_reason, stats = choice["finish_reason"], choice.get("stats") or {}
    except (OSError, EOFError, ValueError, HTTPProtocolError, asyncio.LimitOverrunError) as e:  # EOFError: cut short
        error = f"{type(e).__name__}: {e}"
    finally:
        if response is not None:
            response.close()
    finish_s = perf_counter() - start
    if error is not None:
        finish_reason = "error"
    first_token_s = token_times[0] if token_times else None
    # The server's queue time, placed after the client's arrival time and before the first token.
    first_scheduled_s = None
    if stats.get("queue_s") is not None or first_token_s is not None:
        first_scheduled_s = min(request.arrival_s + (stats.get("queue_s") or 0.0), first_token_s or finish_s)
    record = RequestRecord(
        request_id=request.index,
        arrival_s=request.arrival_s,
        first_scheduled_s=first_scheduled_s,
        first_token_s=first_token_s,
        token_times_s=token_times,
        finish_s=finish_s,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_output_tokens=len(token_times),
        num_cached_tokens=stats.get("num_cached_tokens", 0),
        num_preemptions=stats.get("num_preemptions", 0),
        priority=request.priority,
        metadata=dict(request.metadata),
        finish_reason=finish_reason,
    )
    return record, error


def auth_headers() -> dict:
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


async def run_workload(
    url: str, model: str, workloads: list[Workload], temperature: float, ignore_eos: bool, warmup: bool
) -> tuple[list[RunRecords], list[str]]:
    """Runs each workload in turn, one repeat each (after one short warm-up request when warmup);
    returns each run's records and the errors of every failed request."""
    runs, errors = [], []
    # No connection limit (a burst opens one connection per request) and no timeout.
    client = SSEClient(url, auth_headers())
    try:
        if warmup:
            first = workloads[0].requests[0]
            warm = WorkloadRequest(-1, 0.0, first.prompt_token_ids[:8], 4)
            _, error = await send_request(client, request_body(model, warm, temperature, True), warm, perf_counter())
            if error is not None:
                errors.append(f"warm-up: {error}")
        for workload in workloads:
            bodies = [request_body(model, r, temperature, ignore_eos) for r in workload.requests]
            start = perf_counter()
            sent = await asyncio.gather(
                *(send_request(client, body, r, start) for body, r in zip(bodies, workload.requests))
            )
            records = [record for record, _ in sent]
            errors += [f"request {r.request_id}: {e}" for r, e in sent if e is not None]
            runs.append(RunRecords(records, [], max(r.finish_s for r in records)))
    finally:
        await client.aclose()
    return runs, errors


def run_http_bench(cfg, output_dir: str | None = None) -> dict:
    """`inferlab job=bench bench.url=...`: the bench workload sent to the server at bench.url;
    writes result.json (latency figures, num_errors, the workload, the server's model card and
    plugins, the settings) and requests.jsonl into output_dir (default: the Hydra run's)."""
    bench = cfg.bench
    choices = {k: v for k, v in flat_choices(cfg).items() if k.startswith("bench.")}
    path, context = start_run_record(cfg, output_dir, choices)
    url = str(bench.url).rstrip("/")

    def figures() -> dict:
        check_http_bench(bench)
        with httpx.Client(headers=auth_headers(), timeout=30) as client:
            card = model_card(client, url)
        context["choices"].update(card.get("plugins", {}))  # what served: the server's plugins
        workloads = [
            build_workload(bench, card["vocab_size"], card["max_model_len"], repeat) for repeat in range(bench.repeats)
        ]
        runs, errors = asyncio.run(
            run_workload(url, card["id"], workloads, bench.temperature, bench.ignore_eos, bench.warmup)
        )
        workload = workloads[0]
        write_run_records(os.path.dirname(path), runs, timeline=False)
        return {
            **aggregate_repeats(
                [latency_figures(run.requests, run.wall_time_s, bench.slo_ttft_s, bench.slo_tpot_s) for run in runs]
            ),
            "requests_file": "requests.jsonl",
            "num_errors": len(errors),
            "errors": errors[:MAX_ERRORS_KEPT],
            "workload": workload.summary(),
            "server": {"url": url, **card},
        }

    result = record_result(path, context, figures)
    ttft = result["ttft_s"]["p50"]
    print(
        f"{result['num_requests']} requests to {url} in {result['wall_time_s']:.2f} s: "
        f"{result['request_throughput']:.2f} req/s, {result['output_tokens_per_s']:.0f} output tok/s, "
        f"TTFT p50 {'-' if ttft is None else f'{ttft * 1000:.1f} ms'}, {result['num_errors']} errors -> {path}"
    )
    return result
