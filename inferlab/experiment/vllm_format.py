"""A run's figures under the field names of vLLM's serving benchmark (`vllm bench serve
--save-result`), so that plotting scripts written for its JSON read inferlab's runs: the request,
goodput, output and total token throughputs, the duration and token counts, and for TTFT, TPOT,
ITL and end-to-end latency (`e2el`) the mean, median, standard deviation and percentiles in
milliseconds (`mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p99_ttft_ms`, ...). With repeats,
each is the mean over them, as in result.json.
"""

METRICS = (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("itl", "itl_s"), ("e2el", "e2e_s"))
PERCENTILES = (50, 90, 99)


def _ms(value):
    return None if value is None else 1000 * value


def vllm_result(result: dict) -> dict:
    """The vLLM bench serve fields of one inferlab result.json."""
    bench = result.get("bench") or {}
    workload = result.get("workload") or {}
    arrival = bench.get("arrival") or workload.get("arrival")
    if arrival in ("poisson", "gamma"):
        rate = bench.get("request_rate")
    elif arrival == "burst":
        rate = "inf"  # vLLM's request rate of a burst: every request at once
    else:
        rate = workload.get("offered_request_rate")
    simulated = result.get("simulated")
    model = result.get("model_path") or (simulated or {}).get("profile")
    num_requests = result.get("num_requests") or 0
    unserved = (result.get("num_failed_requests") or 0) + (result.get("num_aborted_requests") or 0)
    prompt, output, wall = result.get("num_prompt_tokens"), result.get("num_output_tokens"), result.get("wall_time_s")
    fields = {
        "date": result.get("finished_at"),
        "backend": "inferlab" + (" (simulated)" if simulated else ""),
        "model_id": model,
        "tokenizer_id": model,
        "num_prompts": num_requests,
        "request_rate": rate,
        "burstiness": bench.get("burstiness", 1.0),
        "max_concurrency": None,
        "duration": wall,
        "completed": num_requests - unserved,
        "failed": unserved,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": result.get("request_throughput"),
        "request_goodput": result.get("goodput"),
        "output_throughput": result.get("output_tokens_per_s"),
        "total_token_throughput": (prompt + output) / wall
        if prompt is not None and output is not None and wall
        else None,
    }
    for name, key in METRICS:
        figures = result.get(key) or {}
        fields[f"mean_{name}_ms"] = _ms(figures.get("mean"))
        fields[f"median_{name}_ms"] = _ms(figures.get("p50"))
        fields[f"std_{name}_ms"] = _ms(figures.get("std"))
        for p in PERCENTILES:
            fields[f"p{p}_{name}_ms"] = _ms(figures.get(f"p{p}"))
    return fields
