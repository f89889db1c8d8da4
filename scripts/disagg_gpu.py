"""Prefill/decode disaggregation on one GPU: a prefill and a decode engine of Qwen3-0.6B's shapes
(random bf16 weights) in one process, joined by kv_transfer=local; the disaggregated outputs against
the colocated ones, serially and all at once, and each move's time against kv_transfer=simulated's
cost model. Writes disagg.json; docs/disaggregation.md ("Measured on the device") tells what it does.

    python scripts/disagg_gpu.py --out $OUT            # on the GPU (about 2 to 4 minutes)
    python scripts/disagg_gpu.py --tiny --out /tmp/d   # the same steps on the CPU, a tiny workload
"""

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np
import torch

from inferlab import LLM, SamplingParams
from inferlab.core.engine import EngineStats
from inferlab.core.protocols import KVMove
from inferlab.experiment.records import git_state
from inferlab.plugins.kv_transfer.local import LocalTransfer
from inferlab.plugins.kv_transfer.simulated import LINKS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import QWEN3_0_6B, build_checkpoint  # noqa: E402

# The workload on the card, and the tiny one whose prompts fit the embedded model's small cache.
DEVICE = dict(requests=48, serial_requests=8, min_len=100, max_len=3000, shared_prefix=1024, max_tokens=32)
TINY = dict(requests=6, serial_requests=3, min_len=5, max_len=60, shared_prefix=32, max_tokens=5)


def workload(num_requests: int, min_len: int, max_len: int, shared_prefix: int, vocab: int) -> list[list[int]]:
    """Prompts of random ids below vocab; every other one opens with the same shared_prefix tokens
    (prefix-cache hits on both engines: the decode engine receives only the blocks it lacks)."""
    rng = random.Random(0)
    prefix = [rng.randrange(1, vocab) for _ in range(shared_prefix)]
    bodies = [
        [rng.randrange(1, vocab) for _ in range(rng.randrange(min_len, max_len + 1))] for _ in range(num_requests)
    ]
    return [prefix + body if i % 2 else body for i, body in enumerate(bodies)]


def disaggregated(prefill, decode, prompts, params, serial: bool):
    """Each prompt prefilled on `prefill`, handed off and decoded on `decode` (serially: one request
    at a time). Returns the outputs in order and the requests."""
    outputs, requests = {}, []

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
        requests.append(prefill.make_request(prompt, params))
        requests[-1].kv_send = KVMove(requests[-1].request_id, 0, 1)
        prefill.queue(requests[-1])
        if serial:
            run_until_idle()
    run_until_idle()
    return [outputs[r.request_id] for r in requests], requests


def compare(got: list[dict], expected: list[dict]) -> dict:
    """How far each disaggregated output matches the colocated one."""
    pairs = [(g["token_ids"], e["token_ids"]) for g, e in zip(got, expected)]
    first_diffs = [next(i for i, (a, b) in enumerate(zip(g, e)) if a != b) for g, e in pairs if g != e]
    return {"requests": len(got), "equal": len(pairs) - len(first_diffs), "first_difference_at": first_diffs}


def fit(points: list[tuple[int, float]]) -> dict | None:
    """seconds = latency + bytes / bandwidth, by least squares over the moves."""
    if len({b for b, _ in points}) < 2:
        return None
    slope, latency = np.polyfit(*zip(*points), 1)
    return {"latency_s": float(latency), "bandwidth_bytes_per_s": 1 / float(slope) if slope > 0 else None}


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
        p99 = measured[min(len(measured) - 1, int(0.99 * len(measured)))]
        summary["measured_s"] = {"p50": statistics.median(measured), "p99": p99}
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
    args = parser.parse_args(argv)
    s = TINY if args.tiny else DEVICE
    started = time.perf_counter()
    common = dict(max_model_len=s["max_len"] + s["shared_prefix"] + s["max_tokens"] + 16)
    model_path = None if args.tiny else build_checkpoint("/tmp/inferlab-disagg-0.6b", 28, QWEN3_0_6B)
    # on the GPU the prefill engine takes 0.45 of its memory, the decode engine the rest up to 0.9
    settings = [dict(common, gpu_memory_utilization=0.45), dict(common, gpu_memory_utilization=0.9)]
    if args.tiny:
        settings = [dict(common, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64)] * 2
    built = time.perf_counter()
    prefill, decode = engines = [LLM(model_path, **kwargs) for kwargs in settings]
    transfer = LocalTransfer()
    for rank, engine in enumerate(engines):
        engine.connect_kv_transfer(transfer, rank)
    start_up_s = time.perf_counter() - built
    params = SamplingParams(temperature=0, max_tokens=s["max_tokens"], ignore_eos=True)
    vocab = min(10000, prefill.hf_config.vocab_size)  # the bench's ids, within the tiny model's vocabulary
    count = max(s["requests"], s["serial_requests"])
    prompts = workload(count, s["min_len"], s["max_len"], s["shared_prefix"], vocab)
    result = {
        "commit": (git_state()["git_commit"] or "unknown")[:7],
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu",
        "model": "tiny" if args.tiny else "Qwen3-0.6B shapes, 28 layers, random bf16",
        "kv_blocks": [prefill.kv_manager.num_blocks, decode.kv_manager.num_blocks],
        "kv_block_bytes": decode.runner.kv_block_bytes,
        "start_up_s": start_up_s,
        "links": {name: {"bandwidth_bytes_per_s": b, "latency_s": lat} for name, (b, lat) in LINKS.items()},
    }
    for name, count, serial in (("serial", s["serial_requests"], True), ("concurrent", s["requests"], False)):
        batch = prompts[:count]
        prefill.reset_prefix_cache()
        t0 = time.perf_counter()
        groups = [[p] for p in batch] if serial else [batch]  # colocated: the prefill engine alone
        expected = [out for group in groups for out in prefill.generate(group, params, use_tqdm=False)]
        colocated_s = time.perf_counter() - t0
        for engine in engines:
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
            "all_blocks_freed": all(e.kv_manager.num_free_blocks == e.kv_manager.num_blocks for e in engines),
        }
        part, summary = result[name], result[name]["transfers"]["summary"]
        print(
            f"{name:<10} equal {part['match']['equal']}/{part['match']['requests']} "
            f"(first differences at {part['match']['first_difference_at'][:8]}); "
            f"{summary['moves']} moves, {summary['bytes'] / 2**20:.1f} MiB; "
            f"measured p50 {summary.get('measured_s', {}).get('p50', float('nan')) * 1e3:.3f} ms; "
            f"measured / nvlink model p50 {summary.get('measured_over_nvlink', {}).get('p50', float('nan')):.2f}; "
            f"fit {summary.get('fit')}; blocks freed {part['all_blocks_freed']}"
        )
    for engine in engines:
        engine.close()
    result["total_s"] = time.perf_counter() - started
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "disagg.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"start-up {start_up_s:.1f} s, total {result['total_s']:.1f} s -> {os.path.join(args.out, 'disagg.json')}")
    return result


if __name__ == "__main__":
    main()
