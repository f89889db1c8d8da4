"""The server's Prometheus metrics: vLLM's names with the inferlab: prefix and its model_name and
engine labels on every series; counters and histograms that add up to what was served; TTFT and
e2e from the request's arrival at the HTTP server; buckets fine enough for sub-millisecond TPOTs;
and, against a simulated engine in real time, TTFT and ITL means equal to what a client measures."""

import json
import re
import time

import httpx
import numpy as np
import pytest

from inferlab import LLM
from inferlab.conf import ServeConfig, compose
from inferlab.experiment.bench import run_bench
from inferlab.server import InferenceServer
from inferlab.server.metrics import TOKEN_INTERVAL_BUCKETS, TTFT_BUCKETS, Histogram

NAME = "tiny-served"
# vLLM v1's Prometheus names (vllm/v1/metrics/loggers.py), the vllm: prefix replaced; counters
# with their _total suffix, histograms by their family name.
VLLM_NAMES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "cache_config_info",
    "num_preemptions_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "time_per_output_token_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_inference_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_prefill_kv_computed_tokens",
    "request_params_max_tokens",
    "iteration_tokens_total",
)
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\} ([0-9.e+-]+|[+-]Inf|NaN)$")


def series(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics by (name, its labels)."""
    samples = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("#") or not line:
            continue
        match = SAMPLE.match(line)
        assert match, f"a sample without labels (model_name is missing): {line}"
        labels = frozenset(tuple(pair.split("=", 1)) for pair in re.findall(r'[a-z_]+="[^"]*"', match[2]))
        samples[match[1], labels] = float(match[3])
    return samples


def value(samples: dict, name: str, **labels) -> float:
    """The sample of `name` whose labels include these (besides model_name and engine)."""
    wanted = {(k, f'"{v}"') for k, v in labels.items()}
    found = [v for (n, got), v in samples.items() if n == f"inferlab:{name}" and wanted <= got]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def mean(samples: dict, name: str) -> float:
    return value(samples, f"{name}_sum") / value(samples, f"{name}_count")


@pytest.fixture(scope="module")
def server(one_torch_thread):
    engine = LLM(device="cpu", kvcache_block_size=16, num_kvcache_blocks=256)
    with engine, InferenceServer(engine, ServeConfig(port=0, model_name=NAME, log_level="warning")) as server:
        yield server


def complete(server, **body) -> dict:
    answer = httpx.post(f"{server.url}/v1/completions", json={"ignore_eos": True, **body}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_every_series_has_vllms_name_with_our_prefix_and_the_model_name_label(server):
    complete(server, prompt="Hello", max_tokens=3)
    samples = series(server.url)
    names = {name for name, _ in samples}
    assert all(name.startswith("inferlab:") for name in names)
    families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}
    missing = [n for n in VLLM_NAMES if f"inferlab:{n}" not in families and f"inferlab:{n}" not in names]
    assert missing == []
    for _, labels in samples:
        assert ("model_name", f'"{NAME}"') in labels and ("engine", '"0"') in labels
    reasons = {dict(labels)["finished_reason"] for name, labels in samples if name.endswith("request_success_total")}
    assert reasons == {'"stop"', '"length"', '"abort"', '"error"'}


def test_counters_and_histograms_add_up_to_what_was_served(server):
    before = series(server.url)
    tokenizer = server.model.tokenizer
    prompts = [tokenizer.encode(f"Request {i}: the quick brown fox") for i in range(3)]
    lengths = [4, 7, 11]
    for prompt, max_tokens in zip(prompts, lengths):
        complete(server, prompt=prompt, max_tokens=max_tokens)
    after = series(server.url)

    def grown(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    num_prompt = sum(map(len, prompts))
    assert grown("prompt_tokens_total") == num_prompt
    assert grown("generation_tokens_total") == sum(lengths)
    assert grown("request_success_total", finished_reason="length") == 3
    assert grown("request_prompt_tokens_sum") == num_prompt
    assert grown("request_generation_tokens_sum") == sum(lengths)
    assert grown("request_params_max_tokens_sum") == sum(lengths)
    assert 0 < grown("request_prefill_kv_computed_tokens_sum") <= num_prompt  # cached tokens are not computed
    assert grown("iteration_tokens_total_sum") >= num_prompt + sum(lengths) - 3  # each last token is never computed
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):  # fmt: skip
        assert grown(f"{name}_count") == 3, name
    # one interval between each two consecutive tokens of a request, under both of vLLM's names
    assert grown("inter_token_latency_seconds_count") == sum(n - 1 for n in lengths)
    assert grown("time_per_output_token_seconds_sum") == grown("inter_token_latency_seconds_sum")
    # vLLM's split of a request's time on the engine: inference = prefill + decode
    inference = grown("request_inference_time_seconds_sum")
    parts = grown("request_prefill_time_seconds_sum") + grown("request_decode_time_seconds_sum")
    assert inference == pytest.approx(parts, rel=1e-9)
    assert grown("inter_token_latency_seconds_sum") == pytest.approx(grown("request_decode_time_seconds_sum"))
    # TTFT and e2e start earlier (the HTTP arrival) and end later (the response) than the engine's spans
    assert grown("e2e_request_latency_seconds_sum") > inference + grown("request_queue_time_seconds_sum")
    assert grown("time_to_first_token_seconds_sum") > grown("request_prefill_time_seconds_sum")
    buckets = [
        (float(dict(k)["le"].strip('"')), v)
        for (n, k), v in after.items()
        if n.endswith("e2e_request_latency_seconds_bucket")
    ]
    counts = [v for _, v in sorted(buckets)]
    assert counts == sorted(counts) and counts[-1] == value(after, "e2e_request_latency_seconds_count")


def test_a_stop_string_counts_as_stop_and_a_disconnect_as_abort(server):
    before = series(server.url)
    tokenizer = server.model.tokenizer
    prompt = tokenizer.encode("Once upon a time")
    text = complete(server, prompt=prompt, max_tokens=12, temperature=0)["choices"][0]["text"]
    stop = text[len(text) // 2 :][:3]
    assert (
        complete(server, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])["choices"][0]["finish_reason"]
        == "stop"
    )
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 2000, "ignore_eos": True, "stream": True},
    ) as stream:
        next(stream.iter_lines())
    deadline = time.monotonic() + 10
    while value(series(server.url), "num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.02)
    after = series(server.url)
    for reason, count in (("stop", 1), ("length", 1), ("abort", 1)):
        assert (
            value(after, "request_success_total", finished_reason=reason)
            - value(before, "request_success_total", finished_reason=reason)
            == count
        ), reason


def test_ttft_and_e2e_start_at_the_http_arrival_before_tokenization(server, monkeypatch):
    """A prompt that takes 0.3 s to tokenize: TTFT and e2e include it, the engine's queue time not."""
    tokenizer = server.model.tokenizer
    encode = tokenizer.encode

    def slow_encode(text, *args, **kwargs):
        if text.startswith("slow"):
            time.sleep(0.3)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    before = series(server.url)
    complete(server, prompt="slow to tokenize", max_tokens=2)
    after = series(server.url)

    def grown(name: str) -> float:
        return value(after, name) - value(before, name)

    assert grown("time_to_first_token_seconds_sum") >= 0.3
    assert grown("e2e_request_latency_seconds_sum") >= 0.3
    assert grown("request_queue_time_seconds_sum") < 0.3


def test_histograms_count_a_value_at_a_bound_in_that_bucket_and_arrays_at_once():
    histogram = Histogram("x_seconds", "x", (0.001, 0.002))
    histogram.observe(0.001)
    histogram.observe_many(np.array([0.0005, 0.0015, 0.002, 0.5]))
    assert histogram.counts.tolist() == [2, 2, 1] and histogram.sum == pytest.approx(0.505)
    family = histogram.family(["m", "0"])
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    assert buckets == {"0.001": 2, "0.002": 4, "+Inf": 5}


def test_buckets_resolve_sub_millisecond_tpots_and_keep_vllms_own():
    vllm_tpot = (
        0.01,
        0.025,
        0.05,
        0.075,
        0.1,
        0.15,
        0.2,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
    )
    vllm_ttft = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
    assert set(vllm_tpot) <= set(TOKEN_INTERVAL_BUCKETS) and set(vllm_ttft) <= set(TTFT_BUCKETS)
    fine = [b for b in TOKEN_INTERVAL_BUCKETS if b <= 0.002]
    assert fine[0] <= 0.0001 and max(np.diff(fine)) <= 0.00025  # a 1.4 ms TPOT lies in a 0.1 ms bucket
    assert list(TOKEN_INTERVAL_BUCKETS) == sorted(TOKEN_INTERVAL_BUCKETS)


# -- a simulated engine in real time, as load testers see it -------------------------------------


def test_a_simulated_server_streams_visible_text_under_the_profiles_model_name(one_torch_thread):
    engine = LLM(executor="simulated", executor_options={"profile": "h200-qwen3-0.6b-triton", "real_time": True})
    with engine, InferenceServer(engine, ServeConfig(port=0, log_level="warning")) as server:
        assert server.model.name == "Qwen3-0.6B"
        body = {"prompt": "Hello", "max_tokens": 16, "stream": True, "return_token_ids": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as stream:
            chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks]
    text = "".join(c["text"] for c in choices)
    ids = [t for c in choices for t in c["token_ids"]]
    assert len(ids) == 16 and choices[-1]["finish_reason"] == "length"
    assert text.strip() and text == server.model.tokenizer.decode(ids, skip_special_tokens=True)
    assert all(c["text"] for c in choices if c["token_ids"])  # each chunk's tokens carry text
    named = LLM(executor="simulated", executor_options={"profile": "h200-qwen3-0.6b-triton", "real_time": True})
    with named, InferenceServer(named, ServeConfig(port=0, model_name="mine", log_level="warning")) as server:
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "mine"


def test_the_servers_ttft_and_itl_equal_what_a_client_measures(one_torch_thread, tmp_path):
    """The bench's own HTTP client against a simulated H200 with Qwen3-8B's step times, in real
    time: the means of the server's TTFT and inter-token histograms are within 10% of the
    client's (a load tester's figures, documented for guidellm in docs/serving.md)."""
    engine = LLM(executor="simulated", executor_options={"profile": "h200-qwen3-8b-triton", "real_time": True})
    with engine, InferenceServer(engine, ServeConfig(port=0, log_level="warning")) as server:
        overrides = [
            "job=bench",
            f"bench.url={server.url}",
            "bench.warmup=false",
            "bench.num_seqs=8",
            "bench.min_len=2048",
            "bench.max_len=2048",
            "bench.min_output_len=32",
            "bench.max_output_len=32",
            "bench.arrival=gamma",  # nearly regular: requests seldom wait on each other's HTTP work
            "bench.burstiness=50",
            "bench.request_rate=5",
        ]
        result = run_bench(compose(overrides), str(tmp_path))
        samples = series(server.url)
    assert result["num_errors"] == 0 and value(samples, "time_to_first_token_seconds_count") == 8
    server_ttft, client_ttft = mean(samples, "time_to_first_token_seconds"), result["ttft_s"]["mean"]
    server_itl, client_itl = mean(samples, "inter_token_latency_seconds"), result["itl_s"]["mean"]
    print(f"\nTTFT server {server_ttft * 1e3:.2f} ms, client {client_ttft * 1e3:.2f} ms; "
          f"ITL server {server_itl * 1e3:.3f} ms, client {client_itl * 1e3:.3f} ms")  # fmt: skip
    assert server_ttft > 0.01 and server_itl > 0.001
    assert client_ttft == pytest.approx(server_ttft, rel=0.1)
    assert client_itl == pytest.approx(server_itl, rel=0.1)
