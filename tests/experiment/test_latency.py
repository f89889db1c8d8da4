"""Latency figures from a hand-made timeline equal the hand computation; repeats aggregate to mean
and standard deviation; requests.jsonl and the latency outputs a driver writes."""

import json
import math
from dataclasses import replace
from unittest.mock import ANY

import numpy as np
import pytest

from inferlab.experiment.latency import (
    RequestRecord,
    RunRecords,
    StepRecord,
    aggregate_repeats,
    distribution,
    jain_index,
    latency_figures,
    write_requests_jsonl,
)
from inferlab.experiment.records import write_run_records


def hand_made_records() -> list[RequestRecord]:
    """Three requests over five seconds:
    r1: arrives 0, scheduled 0.5, tokens at 1.0 1.2 1.5 2.0, 10 prompt tokens of which 4 cached
    r2: arrives 1, scheduled 1, one token at 1.5
    r3: arrives 2, scheduled 3, tokens at 4 and 5, preempted once"""
    return [
        RequestRecord(
            request_id=1,
            arrival_s=0.0,
            first_scheduled_s=0.5,
            first_token_s=1.0,
            token_times_s=[1.0, 1.2, 1.5, 2.0],
            finish_s=2.0,
            num_prompt_tokens=10,
            num_output_tokens=4,
            num_cached_tokens=4,
            metadata={"tenant": "a"},
        ),
        RequestRecord(
            request_id=2,
            arrival_s=1.0,
            first_scheduled_s=1.0,
            first_token_s=1.5,
            token_times_s=[1.5],
            finish_s=1.5,
            num_prompt_tokens=6,
            num_output_tokens=1,
            priority=1,
            metadata={"tenant": "b"},
        ),
        RequestRecord(
            request_id=3,
            arrival_s=2.0,
            first_scheduled_s=3.0,
            first_token_s=4.0,
            token_times_s=[4.0, 5.0],
            finish_s=5.0,
            num_prompt_tokens=8,
            num_output_tokens=2,
            num_preemptions=1,
            metadata={"tenant": "a"},
        ),
    ]


def summary(mean, p50, p90, p99):
    return {
        "mean": pytest.approx(mean),
        "std": ANY,  # numpy's, checked on its own below
        "p50": pytest.approx(p50),
        "p90": pytest.approx(p90),
        "p99": pytest.approx(p99),
    }


def test_figures_of_a_hand_made_timeline():
    figures = latency_figures(hand_made_records(), wall_time_s=5.0)
    # percentiles interpolate between the nearest ranks: of sorted [a, b, c], p90 is b + 0.8 (c - b)
    assert figures["ttft_s"] == summary((1.0 + 0.5 + 2.0) / 3, 1.0, 1.0 + 0.8 * 1.0, 1.0 + 0.98 * 1.0)
    # TPOT: r1 (2.0 - 1.0) / 3, r3 (5 - 4) / 1; r2 has one token and none
    tpot = [1 / 3, 1.0]
    assert figures["tpot_s"] == summary(2 / 3, 2 / 3, tpot[0] + 0.9 * (2 / 3), tpot[0] + 0.99 * (2 / 3))
    # ITL: r1's gaps 0.2, 0.3, 0.5 and r3's 1.0 -> sorted [0.2, 0.3, 0.5, 1.0]; p50 at rank 1.5
    assert figures["itl_s"] == summary(0.5, 0.4, 0.5 + 0.7 * 0.5, 0.5 + 0.97 * 0.5)
    # E2E: 2.0, 0.5, 3.0; queue: 0.5, 0.0, 1.0
    assert figures["e2e_s"] == summary(5.5 / 3, 2.0, 2.0 + 0.8 * 1.0, 2.0 + 0.98 * 1.0)
    assert figures["queue_s"] == summary(0.5, 0.5, 0.5 + 0.8 * 0.5, 0.5 + 0.98 * 0.5)
    assert figures["request_throughput"] == pytest.approx(3 / 5)
    assert figures["output_tokens_per_s"] == pytest.approx(7 / 5)
    assert figures["num_requests"] == 3 and figures["num_output_tokens"] == 7 and figures["num_prompt_tokens"] == 24
    assert figures["num_cached_tokens"] == 4 and figures["prefix_cache_hit_rate"] == pytest.approx(4 / 24)
    assert figures["num_preemptions"] == 1 and figures["wall_time_s"] == 5.0
    # normalized latency: 2/4, 0.5/1, 3/2 -> Jain's index (2.5)^2 / (3 * (0.25 + 0.25 + 2.25))
    assert figures["normalized_latency_s"]["mean"] == pytest.approx(2.5 / 3)
    assert figures["jain_fairness"] == pytest.approx(6.25 / 8.25)
    assert "slo_attainment" not in figures and "goodput" not in figures
    assert figures["per_priority"] == {
        "0": {"num_requests": 2, "ttft_s": summary(1.5, 1.5, 1.9, 1.99), "e2e_s": summary(2.5, 2.5, 2.9, 2.99)},
        "1": {"num_requests": 1, "ttft_s": summary(0.5, 0.5, 0.5, 0.5), "e2e_s": summary(0.5, 0.5, 0.5, 0.5)},
    }
    # service: a's r1 (10 + 4 tokens) and r3 (8 + 2) over 0..5 s with requests in the system,
    # b's r2 (6 + 1) over 1..1.5 s
    assert figures["per_tenant"] == {
        "a": {
            "num_requests": 2,
            "ttft_s": summary(1.5, 1.5, 1.9, 1.99),
            "e2e_s": summary(2.5, 2.5, 2.9, 2.99),
            "service_tokens": 24,
            "service_rate": pytest.approx(24 / 5),
        },
        "b": {
            "num_requests": 1,
            "ttft_s": summary(0.5, 0.5, 0.5, 0.5),
            "e2e_s": summary(0.5, 0.5, 0.5, 0.5),
            "service_tokens": 7,
            "service_rate": pytest.approx(7 / 0.5),
        },
    }
    assert figures["tenant_fairness"] == pytest.approx((4.8 + 14) ** 2 / (2 * (4.8**2 + 14**2)))
    assert "classes" not in figures  # no request has a class
    json.dumps(figures)  # result.json holds them as they are


@pytest.mark.parametrize(
    "slo_ttft_s,slo_tpot_s,num_good",
    [
        (1.0, 0.5, 2),  # r1 (TTFT 1.0, TPOT 1/3) and r2 (no TPOT); r3's TTFT is 2
        (None, 0.5, 2),  # r3's TPOT is 1.0
        (2.0, None, 3),
        (0.9, None, 1),  # only r2
        (0.1, 0.1, 0),
    ],
)
def test_slo_attainment_and_goodput(slo_ttft_s, slo_tpot_s, num_good):
    figures = latency_figures(hand_made_records(), 5.0, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
    assert figures["slo_attainment"] == pytest.approx(num_good / 3)
    assert figures["goodput"] == pytest.approx(num_good / 5.0)


def test_a_request_without_output_misses_every_slo_and_has_no_ttft():
    failed = RequestRecord(
        request_id="x",
        arrival_s=0.0,
        first_scheduled_s=None,
        first_token_s=None,
        token_times_s=[],
        finish_s=0.5,
        num_prompt_tokens=5,
        num_output_tokens=0,
        finish_reason="error",
    )
    figures = latency_figures([*hand_made_records(), failed], 5.0, slo_ttft_s=10.0)
    assert figures["num_requests"] == 4 and figures["num_requests_without_output"] == 1
    assert figures["num_failed_requests"] == 1 and figures["num_aborted_requests"] == 0
    assert figures["request_throughput"] == pytest.approx(3 / 5.0)  # the refused request did not complete
    assert figures["slo_attainment"] == pytest.approx(3 / 4)
    assert figures["ttft_s"]["mean"] == pytest.approx(3.5 / 3)
    assert figures["e2e_s"]["mean"] == pytest.approx((5.5 + 0.5) / 4)


def test_distribution_of_nothing_and_jain_extremes():
    assert distribution([]) == {"mean": None, "std": None, "p50": None, "p90": None, "p99": None}
    assert distribution([1.0, 2.0, 6.0])["std"] == pytest.approx(np.std([1.0, 2.0, 6.0]))
    assert distribution([3.0]) == {"mean": 3.0, "std": 0.0, "p50": 3.0, "p90": 3.0, "p99": 3.0}
    assert jain_index([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(1 / 4)
    assert jain_index([]) is None


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(token_times_s=[1.0, 1.2]), "2 token times for 4 output tokens"),
        (dict(first_token_s=1.1), "must equal its first token time"),
        (dict(finish_s=1.9), "times must not go back"),
        (dict(first_scheduled_s=1.5), "times must not go back"),
        (dict(first_scheduled_s=None), "was never scheduled"),
    ],
)
def test_inconsistent_records_are_refused(changes, message):
    fields = {
        "request_id": 1,
        "arrival_s": 0.0,
        "first_scheduled_s": 0.5,
        "first_token_s": 1.0,
        "token_times_s": [1.0, 1.2, 1.5, 2.0],
        "finish_s": 2.0,
        "num_prompt_tokens": 10,
        "num_output_tokens": 4,
    }
    with pytest.raises(ValueError, match=message):
        RequestRecord(**{**fields, **changes})


def test_repeats_aggregate_to_mean_and_sample_std():
    first = {"output_tokens_per_s": 10.0, "num_requests": 3, "ttft_s": {"mean": 1.0, "p50": 2.0}, "tpot_s": None}
    second = {"output_tokens_per_s": 14.0, "num_requests": 3, "ttft_s": {"mean": 3.0, "p50": 2.0}, "tpot_s": None}
    result = aggregate_repeats([first, second])
    assert result["output_tokens_per_s"] == pytest.approx(12.0)
    assert result["std"]["output_tokens_per_s"] == pytest.approx(math.sqrt(((10 - 12) ** 2 + (14 - 12) ** 2) / 1))
    # the means, each with the half-width of its 95% interval: t(1) = 12.706 times std / sqrt(2)
    assert result["ttft_s"] == {
        "mean": pytest.approx(2.0),
        "p50": 2.0,
        "ci95": {"mean": pytest.approx(12.7062 * math.sqrt(2) / math.sqrt(2)), "p50": 0.0},
    }
    assert result["ci95"] == {"output_tokens_per_s": pytest.approx(12.7062 * math.sqrt(8) / math.sqrt(2))}
    assert result["std"]["ttft_s"] == {"mean": pytest.approx(math.sqrt(2)), "p50": 0.0}
    assert result["num_requests"] == 3 and isinstance(result["num_requests"], int)
    assert result["tpot_s"] is None and "tpot_s" not in result["std"]
    assert result["num_repeats"] == 2 and result["repeats"] == [first, second]
    assert aggregate_repeats([first]) == first  # one run keeps its shape


def test_repeats_of_latency_figures():
    records = hand_made_records()
    slower = [replace(r, **shifted(r)) for r in records]
    runs = [latency_figures(records, 5.0), latency_figures(slower, 10.0)]
    result = aggregate_repeats(runs)
    assert result["request_throughput"] == pytest.approx((0.6 + 0.3) / 2)
    assert result["std"]["request_throughput"] == pytest.approx(math.sqrt(2 * 0.15**2))
    assert result["ttft_s"]["p50"] == pytest.approx((runs[0]["ttft_s"]["p50"] + runs[1]["ttft_s"]["p50"]) / 2)
    assert set(result["std"]["ttft_s"]) == {"mean", "std", "p50", "p90", "p99"}
    assert set(result["std"]["per_tenant"]["a"]["ttft_s"]) == {"mean", "std", "p50", "p90", "p99"}


def shifted(record: RequestRecord) -> dict:
    """The record's times after arrival doubled: a run twice as slow."""

    def later(t):
        return None if t is None else record.arrival_s + 2 * (t - record.arrival_s)

    return {
        "first_scheduled_s": later(record.first_scheduled_s),
        "first_token_s": later(record.first_token_s),
        "token_times_s": [later(t) for t in record.token_times_s],
        "finish_s": later(record.finish_s),
    }


def test_requests_jsonl_has_a_line_per_request_per_repeat(tmp_path):
    path = tmp_path / "requests.jsonl"
    records = hand_made_records()
    write_requests_jsonl(str(path), [records, records[:2]])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["repeat"], line["request_id"]) for line in lines] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]
    first = lines[0]
    assert first == {
        "repeat": 0,
        "request_id": 1,
        "arrival_s": 0.0,
        "first_scheduled_s": 0.5,
        "first_token_s": 1.0,
        "finish_s": 2.0,
        "num_prompt_tokens": 10,
        "num_output_tokens": 4,
        "num_cached_tokens": 4,
        "num_preemptions": 0,
        "priority": 0,
        "metadata": {"tenant": "a"},
        "finish_reason": "length",
        "error": None,
        "ttft_s": 1.0,
        "tpot_s": pytest.approx(1 / 3),
        "e2e_s": 2.0,
        "queue_s": 0.5,
    }
    assert lines[1]["priority"] == 1 and lines[1]["tpot_s"] is None


def test_run_records_are_written_beside_the_result(tmp_path):
    records = hand_made_records()
    steps = [StepRecord(0.5, 1.0, 6, 0, 1), StepRecord(1.0, 1.5, 6, 1, 2), StepRecord(3.0, 4.0, 8, 1, 2)]
    names = write_run_records(str(tmp_path), [RunRecords(records, steps, 5.0)] * 2, timeline=True)
    assert names == ["timeline-0.json", "timeline-1.json"]
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 6
    assert all((tmp_path / name).is_file() for name in names)
    assert write_run_records(str(tmp_path / "one"), [RunRecords(records, steps, 5.0)], timeline=False) == []
    assert (tmp_path / "one" / "requests.jsonl").is_file() and not (tmp_path / "one" / "timeline.json").exists()
    assert write_run_records(str(tmp_path / "two"), [RunRecords(records, steps, 5.0)], timeline=True) == [
        "timeline.json"
    ]
