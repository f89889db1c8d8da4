"""A run's timeline as a Chrome trace (the Trace Event Format's JSON), for ui.perfetto.dev or
chrome://tracing: open the file there (Perfetto: "Open trace file", or drag it onto the page).

- process "engine", track "steps": one slice per engine step, named by what its batch held
  (prefill, decode, or prefill+decode) with its token counts and batch size as arguments, and
  counters of the batch size and of the prefill and decode tokens per step;
- process "requests": one track per request (in arrival order) holding a slice from its arrival
  to its finish, and in it the slices queued (arrival to first scheduled), prefill (to the first
  token) and decode (to the finish), plus an instant mark at the first token.
Times are microseconds on the records' clock.
"""

import json
from collections.abc import Sequence

from inferlab.experiment.latency import RequestRecord, StepRecord

ENGINE_PID, REQUESTS_PID, STEPS_TID = 1, 2, 1


def _us(seconds: float) -> float:
    return seconds * 1e6


def _metadata(kind: str, pid: int, tid: int | None = None, **args) -> dict:
    """A metadata event naming or ordering a process or thread (kind: process_name, thread_name, ...)."""
    event = {"ph": "M", "name": kind, "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def _slice(name: str, start_s: float, end_s: float, pid: int, tid: int, **args) -> dict:
    return {
        "ph": "X",
        "name": name,
        "cat": "step" if pid == ENGINE_PID else "request",
        "ts": _us(start_s),
        "dur": _us(end_s - start_s),
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def step_name(step: StepRecord) -> str:
    if step.num_prefill_tokens and step.num_decode_tokens:
        return "prefill+decode"
    return "prefill" if step.num_prefill_tokens else "decode"


def timeline_events(steps: Sequence[StepRecord], records: Sequence[RequestRecord]) -> dict:
    """The trace as a JSON-ready object {"traceEvents": [...], "displayTimeUnit": "ms"}."""
    events = [
        _metadata("process_name", ENGINE_PID, name="engine"),
        _metadata("process_sort_index", ENGINE_PID, sort_index=0),
        _metadata("thread_name", ENGINE_PID, STEPS_TID, name="steps"),
        _metadata("process_name", REQUESTS_PID, name="requests"),
        _metadata("process_sort_index", REQUESTS_PID, sort_index=1),
    ]
    for number, step in enumerate(steps):
        if step.end_s < step.start_s:
            raise ValueError(f"step {number} ends ({step.end_s}) before it starts ({step.start_s})")
        events.append(
            _slice(
                step_name(step),
                step.start_s,
                step.end_s,
                ENGINE_PID,
                STEPS_TID,
                step=number,
                num_prefill_tokens=step.num_prefill_tokens,
                num_decode_tokens=step.num_decode_tokens,
                num_seqs=step.num_seqs,
            )
        )
        start = _us(step.start_s)
        events.append(
            {"ph": "C", "name": "batch size", "ts": start, "pid": ENGINE_PID, "args": {"num_seqs": step.num_seqs}}
        )
        events.append(
            {
                "ph": "C",
                "name": "tokens per step",
                "ts": start,
                "pid": ENGINE_PID,
                "args": {"prefill": step.num_prefill_tokens, "decode": step.num_decode_tokens},
            }
        )
    ordered = sorted(records, key=lambda r: (r.arrival_s, str(r.request_id)))
    for track, record in enumerate(ordered, 1):
        events.append(_metadata("thread_name", REQUESTS_PID, track, name=f"request {record.request_id}"))
        events.append(_metadata("thread_sort_index", REQUESTS_PID, track, sort_index=track))
        events.append(
            _slice(
                f"request {record.request_id}",
                record.arrival_s,
                record.finish_s,
                REQUESTS_PID,
                track,
                request_id=record.request_id,
                num_prompt_tokens=record.num_prompt_tokens,
                num_cached_tokens=record.num_cached_tokens,
                num_output_tokens=record.num_output_tokens,
                num_preemptions=record.num_preemptions,
                priority=record.priority,
                metadata=record.metadata,
                finish_reason=record.finish_reason,
                ttft_s=record.ttft_s,
                tpot_s=record.tpot_s,
            )
        )
        phases = [
            ("queued", record.arrival_s, record.first_scheduled_s),
            ("prefill", record.first_scheduled_s, record.first_token_s),
            ("decode", record.first_token_s, record.finish_s),
        ]
        for name, start_s, end_s in phases:
            if start_s is not None and end_s is not None:
                events.append(_slice(name, start_s, end_s, REQUESTS_PID, track))
        if record.first_token_s is not None:
            events.append(
                {
                    "ph": "i",
                    "name": "first token",
                    "s": "t",
                    "ts": _us(record.first_token_s),
                    "pid": REQUESTS_PID,
                    "tid": track,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_timeline(path: str, steps: Sequence[StepRecord], records: Sequence[RequestRecord]) -> None:
    """Writes timeline_events as JSON to path (e.g. timeline.json beside result.json)."""
    with open(path, "w") as f:
        json.dump(timeline_events(steps, records), f, default=str)
