"""The Perfetto / chrome://tracing timeline: a slice per engine step on one track, a span per request
on its own track with its phases nested inside, all in the Trace Event Format."""

import json

import pytest

from inferlab.experiment.latency import RequestRecord, StepRecord
from inferlab.experiment.timeline import ENGINE_PID, REQUESTS_PID, STEPS_TID, timeline_events, write_timeline

STEPS = [
    StepRecord(start_s=0.5, end_s=1.0, num_prefill_tokens=10, num_decode_tokens=0, num_seqs=1),
    StepRecord(start_s=1.0, end_s=1.25, num_prefill_tokens=6, num_decode_tokens=1, num_seqs=2),
    StepRecord(start_s=1.25, end_s=1.5, num_prefill_tokens=0, num_decode_tokens=1, num_seqs=1),
]
RECORDS = [
    RequestRecord(
        request_id=7,
        arrival_s=0.25,
        first_scheduled_s=0.5,
        first_token_s=1.0,
        token_times_s=[1.0, 1.25, 1.5],
        finish_s=1.5,
        num_prompt_tokens=10,
        num_output_tokens=3,
        num_cached_tokens=0,
        priority=2,
        metadata={"tenant": "a"},
    ),
    RequestRecord(
        request_id=3,
        arrival_s=0.0,
        first_scheduled_s=1.0,
        first_token_s=1.25,
        token_times_s=[1.25],
        finish_s=1.25,
        num_prompt_tokens=6,
        num_output_tokens=1,
    ),
]


def by_phase(events, ph):
    return [e for e in events if e["ph"] == ph]


def test_events_follow_the_trace_event_format(tmp_path):
    path = tmp_path / "timeline.json"
    write_timeline(str(path), STEPS, RECORDS)
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms" and isinstance(trace["traceEvents"], list)
    for event in trace["traceEvents"]:
        assert event["ph"] in ("M", "X", "C", "i") and isinstance(event["name"], str) and isinstance(event["pid"], int)
        if event["ph"] in ("X", "i", "C"):
            assert isinstance(event["ts"], float) and event["ts"] >= 0
        if event["ph"] == "X":
            assert isinstance(event["tid"], int) and event["dur"] >= 0 and isinstance(event["args"], dict)


def test_one_slice_per_step_on_the_steps_track():
    events = timeline_events(STEPS, RECORDS)["traceEvents"]
    steps = [e for e in by_phase(events, "X") if e["pid"] == ENGINE_PID]
    assert [e["name"] for e in steps] == ["prefill", "prefill+decode", "decode"]
    assert all(e["tid"] == STEPS_TID for e in steps)
    assert [(e["ts"], e["dur"]) for e in steps] == [(5e5, 5e5), (1e6, 2.5e5), (1.25e6, 2.5e5)]
    assert steps[1]["args"] == {"step": 1, "num_prefill_tokens": 6, "num_decode_tokens": 1, "num_seqs": 2}
    counters = by_phase(events, "C")
    assert [c["args"] for c in counters if c["name"] == "batch size"] == [{"num_seqs": n} for n in (1, 2, 1)]
    names = {(e["name"], e["pid"], e.get("tid")): e["args"] for e in by_phase(events, "M")}
    assert names[("process_name", ENGINE_PID, None)] == {"name": "engine"}
    assert names[("thread_name", ENGINE_PID, STEPS_TID)] == {"name": "steps"}
    assert names[("process_name", REQUESTS_PID, None)] == {"name": "requests"}


def test_one_track_per_request_with_its_phases_nested():
    events = timeline_events(STEPS, RECORDS)["traceEvents"]
    tracks = {
        e["args"]["name"]: e["tid"]
        for e in by_phase(events, "M")
        if e["name"] == "thread_name" and e["pid"] == REQUESTS_PID
    }
    assert tracks == {"request 3": 1, "request 7": 2}  # in arrival order
    spans = [e for e in by_phase(events, "X") if e["pid"] == REQUESTS_PID]
    seven = [e for e in spans if e["tid"] == tracks["request 7"]]
    assert [(e["name"], e["ts"], e["dur"]) for e in seven] == [
        ("request 7", 2.5e5, 1.25e6),
        ("queued", 2.5e5, 2.5e5),
        ("prefill", 5e5, 5e5),
        ("decode", 1e6, 5e5),
    ]
    outer = seven[0]
    assert outer["args"]["priority"] == 2 and outer["args"]["metadata"] == {"tenant": "a"}
    assert outer["args"]["ttft_s"] == pytest.approx(0.75) and outer["args"]["num_output_tokens"] == 3
    for inner in seven[1:]:  # nested: inside the request's span
        assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    marks = [(e["tid"], e["ts"]) for e in by_phase(events, "i")]
    assert sorted(marks) == [(1, 1.25e6), (2, 1e6)]
    assert all(e["s"] == "t" for e in by_phase(events, "i"))


def test_a_step_that_ends_before_it_starts_is_refused():
    with pytest.raises(ValueError, match="step 0 ends"):
        timeline_events([StepRecord(2.0, 1.0, 1, 0, 1)], [])
