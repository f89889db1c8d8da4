"""Prefill/decode disaggregation on one GPU: a prefill engine and a decode engine of Qwen3-0.6B's
shapes (random bf16 weights) in one process, sharing the GPU by gpu_memory_utilization, joined by
kv_transfer=local. Checks that the disaggregated outputs equal the colocated ones and measures each
move's time against the simulated transfer's cost model. Writes disagg.json.

    python scripts/disagg_gpu.py --out $OUT            # on the GPU (about 2 to 4 minutes)
    python scripts/disagg_gpu.py --tiny --out /tmp/d   # the same steps on the CPU, the embedded model

Two passes over the same prompts, colocated first (the prefill engine alone, prefill and decode),
then disaggregated (prefilled there, decoded on the other engine):
- serial: one request at a time, so that both passes run the same step shapes and greedy outputs
  must match token for token;
- concurrent: every request at once, as a server would see them; bf16 results then depend on the
  batches a request shares, so the match is reported (tokens before the first difference), and the
  moves are timed under load.
Each move's time is the CUDA events around its copy (kv_transfer=local); beside it, what
kv_transfer=simulated predicts for its bytes over NVLink and over 400 Gb/s InfiniBand, and a least
squares fit of seconds = latency + bytes / bandwidth over the measured moves.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here)
    except OSError:
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def workload(num_requests: int, min_len: int, max_len: int, shared_prefix: int, vocab: int) -> list[list[int]]:
    """Prompts of random ids below vocab; every other one opens with the same shared_prefix tokens
    (prefix-cache hits on both engines: the decode engine receives only the blocks it lacks)."""
    rng = random.Random(0)
    prefix = [rng.randrange(1, vocab) for _ in range(shared_prefix)]
    prompts = []
    for i in range(num_requests):
        body = [rng.randrange(1, vocab) for _ in range(rng.randrange(min_len, max_len + 1))]
        prompts.append(prefix + body if i % 2 else body)
    return prompts


def disaggregated(prefill, decode, prompts, params, serial: bool):
    """Each prompt prefilled on `prefill`, handed off and decoded on `decode` (serially: one request
    at a time). Returns the outputs in order and the requests."""
    from inferlab.core.protocols import KVMove

    outputs, requests = {}, []

    def submit(prompt):
        request = prefill.make_request(prompt, params)
        request.kv_send = KVMove(request.request_id, 0, 1)
        prefill.queue(request)
        requests.append(request)

    def run_until_idle():
        while not (prefill.is_finished() and decode.is_finished()):
            for request in prefill.step().finished:
                if request.finish_reason == "handoff":
                    request.kv_send, request.kv_receive = None, KVMove(request.request_id, 0, 1)
                    decode.queue(request)
                else:
                    outputs[request.request_id] = prefill.output(request)
            for request in decode.step().finished:
                outputs[request.request_id] = decode.output(request)
            prefill.poll_kv_transfer()

    for prompt in prompts:
        submit(prompt)
        if serial:
            run_until_idle()
    run_until_idle()
    return [outputs[r.request_id] for r in requests], requests


def colocated(engine, prompts, params, serial: bool) -> list[dict]:
    if serial:
        return [engine.generate([p], params, use_tqdm=False)[0] for p in prompts]
    return engine.generate(prompts, params, use_tqdm=False)


def compare(got: list[dict], expected: list[dict]) -> dict:
    """How far each disaggregated output matches the colocated one."""
    same, first_diffs = 0, []
    for g, e in zip(got, expected):
        if g["token_ids"] == e["token_ids"]:
            same += 1
        else:
            first_diffs.append(next(i for i, (a, b) in enumerate(zip(g["token_ids"], e["token_ids"])) if a != b))
    return {"requests": len(got), "equal": same, "first_difference_at": first_diffs}


def fit(points: list[tuple[int, float]]) -> dict | None:
    """seconds = latency + bytes / bandwidth, by least squares over the moves."""
    if len(points) < 2 or len({b for b, _ in points}) < 2:
        return None
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    slope = sum((b - mean_b) * (s - mean_s) for b, s in points) / sum((b - mean_b) ** 2 for b, _ in points)
    return {"latency_s": mean_s - slope * mean_b, "bandwidth_bytes_per_s": 1 / slope if slope > 0 else None}


def transfers(requests, links: dict) -> dict:
    """Each move's bytes and measured seconds beside the cost model's, and their summary."""
    rows = [
        {
            "request_id": r.request_id,
            "num_prompt_tokens": r.num_prompt_tokens,
            "bytes": r.kv_transfer_bytes,
            "measured_s": r.kv_transfer_s,
            **{f"{name}_s": latency + r.kv_transfer_bytes / bandwidth for name, (bandwidth, latency) in links.items()},
        }
        for r in requests
        if r.kv_transfer_s is not None and r.kv_transfer_bytes
    ]
    measured = sorted(row["measured_s"] for row in rows)
    summary = {"moves": len(rows), "bytes": sum(row["bytes"] for row in rows)}
    if measured:
        summary["measured_s"] = {
            "p50": statistics.median(measured),
            "p99": measured[min(len(measured) - 1, int(0.99 * len(measured)))],
        }
        summary["measured_bytes_per_s"] = summary["bytes"] / sum(measured)
        summary["fit"] = fit([(row["bytes"], row["measured_s"]) for row in rows])
        for name in links:
            ratio = sorted(row["measured_s"] / row[f"{name}_s"] for row in rows)
            summary[f"measured_over_{name}"] = {"p50": statistics.median(ratio), "min": ratio[0], "max": ratio[-1]}
    return {"summary": summary, "moves": rows}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for disagg.json")
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny model on the CPU (a check)")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--requests", type=int, default=48, help="concurrent pass")
    parser.add_argument("--serial-requests", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=3000)
    parser.add_argument("--shared-prefix", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--prefill-memory", type=float, default=0.45, help="the prefill engine's gpu_memory_utilization"
    )
    parser.add_argument("--decode-memory", type=float, default=0.9, help="the decode engine's (both engines' use)")
    parser.add_argument("--checkpoint", default="/tmp/inferlab-disagg-0.6b")
    args = parser.parse_args(argv)

    import torch

    from inferlab import LLM, SamplingParams
    from inferlab.core.engine import EngineStats
    from inferlab.plugins.kv_transfer.local import LocalTransfer
    from inferlab.plugins.kv_transfer.simulated import LINKS

    started = time.perf_counter()
    common = dict(max_model_len=args.max_len + args.shared_prefix + args.max_tokens + 16)
    if args.tiny:
        model_path = None
        settings = [dict(common, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64)] * 2
    else:
        from bench_gpu import QWEN3_0_6B, build_checkpoint

        model_path = build_checkpoint(args.checkpoint, args.layers, QWEN3_0_6B)
        settings = [
            dict(common, gpu_memory_utilization=args.prefill_memory),
            dict(common, gpu_memory_utilization=args.decode_memory),
        ]
    built = time.perf_counter()
    prefill = LLM(model_path, **settings[0])
    decode = LLM(model_path, **settings[1])
    transfer = LocalTransfer()
    prefill.connect_kv_transfer(transfer, 0)
    decode.connect_kv_transfer(transfer, 1)
    start_up_s = time.perf_counter() - built
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    vocab = min(10000, prefill.hf_config.vocab_size)  # the bench's ids, within the tiny model's vocabulary
    prompts = workload(max(args.requests, args.serial_requests), args.min_len, args.max_len, args.shared_prefix, vocab)
    result = {
        "commit": git_commit(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu",
        "model": "tiny" if args.tiny else f"Qwen3-0.6B shapes, {args.layers} layers, random bf16",
        "kv_blocks": [prefill.kv_manager.num_blocks, decode.kv_manager.num_blocks],
        "kv_block_bytes": decode.runner.kv_block_bytes,
        "start_up_s": start_up_s,
        "links": {name: {"bandwidth_bytes_per_s": b, "latency_s": lat} for name, (b, lat) in LINKS.items()},
    }
    for name, count, serial in (("serial", args.serial_requests, True), ("concurrent", args.requests, False)):
        batch = prompts[:count]
        prefill.reset_prefix_cache()
        t0 = time.perf_counter()
        expected = colocated(prefill, batch, params, serial)
        colocated_s = time.perf_counter() - t0
        for engine in (prefill, decode):
            engine.reset_prefix_cache()
            engine.stats = EngineStats()
        t0 = time.perf_counter()
        got, requests = disaggregated(prefill, decode, batch, params, serial)
        wall = time.perf_counter() - t0
        result[name] = {
            "match": compare(got, expected),
            "colocated_s": colocated_s,
            "disaggregated_s": wall,
            "busy_fraction": {
                role: (engine.stats.prefill_seconds + engine.stats.decode_seconds) / wall
                for role, engine in (("prefill", prefill), ("decode", decode))
            },
            "kv_bytes_sent": prefill.stats.kv_bytes_sent,
            "kv_bytes_received": decode.stats.kv_bytes_received,
            "transfers": transfers(requests, LINKS),
            "all_blocks_freed": all(e.kv_manager.num_free_blocks == e.kv_manager.num_blocks for e in (prefill, decode)),
        }
    for engine in (prefill, decode):
        engine.close()
    result["total_s"] = time.perf_counter() - started
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "disagg.json"), "w") as f:
        json.dump(result, f, indent=1)
    for name in ("serial", "concurrent"):
        part = result[name]
        summary = part["transfers"]["summary"]
        print(
            f"{name:<10} equal {part['match']['equal']}/{part['match']['requests']} "
            f"(first differences at {part['match']['first_difference_at'][:8]}); "
            f"{summary['moves']} moves, {summary['bytes'] / 2**20:.1f} MiB; "
            f"measured p50 {summary.get('measured_s', {}).get('p50', float('nan')) * 1e3:.3f} ms; "
            f"measured / nvlink model p50 {summary.get('measured_over_nvlink', {}).get('p50', float('nan')):.2f}; "
            f"fit {summary.get('fit')}; blocks freed {part['all_blocks_freed']}"
        )
    print(f"start-up {start_up_s:.1f} s, total {result['total_s']:.1f} s -> {os.path.join(args.out, 'disagg.json')}")
    return result


if __name__ == "__main__":
    main()
