"""What the kernel boundaries of a decode step cost on the GPU, and what programmatic dependent
launch (PDL), L2 weight prefetch and micro-batches on streams would win back, each replayed from a
CUDA graph.

    python scripts/microbench_launch.py [--only gaps,chain,prefetch,gemm,split_k,microbatch,triton_gemm,ablation,attention_chain,split_k_plans,barrier,side_prefetch,persistent_chain,stream_chain] [--out results.json]

- gaps: microbench_gpu.decoder_stack's 28 layers over workload decode batches: the graph's time
  against the sum of its kernels' durations (torch.profiler), so the time between kernels shows.
- chain: 280 RMSNorm kernels in a row (a layer's worth of small kernels, 28 times), launched
  plainly and with PDL (each waits on griddepcontrol and lets its successor launch at once).
- prefetch: each projection's weight ring (28 copies, one a layer, as in the model) behind an
  RMSNorm kernel, through cuBLAS; the norm kernel optionally asks L2 for the next GEMM's weight
  (cp.async.bulk.prefetch) before it works, so the GEMM finds its weight on chip.
- gemm: the same chain with a Triton GEMM launched with PDL, which asks L2 for its weight slab
  before it waits on its predecessor, against the cuBLAS chain.
- split_k: the decoder stack with o_proj and down_proj as split-K GEMMs whose partials the next
  RMSNorm kernel sums (qwen3's split_k_tokens) up to 0 (cuBLAS), 64 and 256 tokens.
- microbatch: the decoder stack over a batch cut into 2-4 micro-batches (every n-th sequence),
  each on its own stream of one graph, so one part's GEMMs could run beside another's attention.
- triton_gemm: the decoder stack with qkv and gate_up through split_k_kernel.linear (qwen3's
  triton_gemm_tokens) up to 0 (cuBLAS), 64 and 128 tokens.
- ablation: the decoder stack with one operation of every layer frozen (it returns the output of
  its first call, so the graph holds none of its kernels): what the stack saves is what that
  operation costs in the chain, its drain and ramp included, which per-kernel durations under PDL
  do not show.
- attention_chain: the decoder stack under several attention decode plans (tile, programs a
  multiprocessor, shortest split, order): attention between the other kernels, not back to back.
- split_k_plans: the decoder stack with o_proj's and down_proj's split-K plan above 64 tokens
  replaced (32- or 64-column blocks, K in 2 or 4 parts).
- side_prefetch: the decoder stack with a side stream that asks L2 for the layer's gate_up and down
  weights (and the next layer's qkv) once its attention is done, a few kernels before they are read.
- barrier: a grid-wide barrier inside one persistent kernel (what a layer's kernel boundary would
  cost in a single decode-layer kernel) against a boundary between tiny kernels, plain and PDL.
- persistent_chain: a layer's four GEMMs and two partial sums, 28 layers, as kernels with PDL
  against one persistent kernel with grid-wide barriers, the next GEMM's weight asked of L2 ahead
  or not, and (up to 64 rows) one that holds the start of its next weight slab in registers
  across the barrier.
- stream_chain: the same GEMMs (no split, so no partial sums) in one persistent CUDA kernel
  (scripts/stream_chain.cu, built with nvcc) whose producer warp streams the weights into shared
  memory ahead of the grid barriers, up to 64 rows; and, for attribution, the kernel without its
  barriers, without its activation loads, without both, and with each block reading its own copy
  of the activations."""

import argparse
import ctypes
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from microbench_gpu import (
    HEAD_DIM,
    HIDDEN,
    INTER,
    NUM_HEADS,
    NUM_KV_HEADS,
    decoder_stack,
    graph_time_us,
    replay_time_us,
    stack_floor_us,
    weight_ring,
    workload_decode_batches,
)  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from inferlab.floor import device_rates  # noqa: E402
from inferlab.plugins.pdl import wait_for_inputs  # noqa: E402

LAYERS = 28
SHAPES = {
    "qkv": ((NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, NUM_HEADS * HEAD_DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}


@triton.jit
def bulk_prefetch_l2(byte_ptrs, sizes):
    """Ask L2 for sizes[i] bytes (a multiple of 16; none where 0) from each int8 pointer byte_ptrs[i],
    without waiting for them: one cp.async.bulk.prefetch an element."""
    tl.inline_asm_elementwise(
        "{ .reg .pred pf_p; setp.ne.u32 pf_p, $2, 0; @pf_p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [byte_ptrs, sizes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def l2_prefetch(base_ptr, first_byte, end_byte, CHUNK: tl.constexpr, N: tl.constexpr):
    """Ask L2 for N chunks of CHUNK bytes from base + first_byte, stopping at end_byte, without
    waiting for them (one cp.async.bulk.prefetch per chunk; N at least the program's threads, so
    no chunk is asked for twice)."""
    offsets = first_byte + tl.arange(0, N).to(tl.int64) * CHUNK
    sizes = tl.minimum(tl.maximum(end_byte - offsets, 0), CHUNK).to(tl.int32)
    bulk_prefetch_l2(base_ptr.to(tl.pointer_type(tl.int8)) + offsets, sizes)


@triton.jit
def l2_prefetch_share(ptr, total_bytes, CHUNK: tl.constexpr, THREADS: tl.constexpr):
    """Ask L2 for this program's share of total_bytes from ptr: the grid's programs split it in
    whole CHUNK * THREADS pieces."""
    share = tl.cdiv(total_bytes, tl.num_programs(0) * CHUNK * THREADS) * CHUNK * THREADS
    pid = tl.program_id(0)
    for start in range(pid * share, tl.minimum((pid + 1) * share, total_bytes), CHUNK * THREADS):
        l2_prefetch(ptr, start, total_bytes, CHUNK, THREADS)


@triton.jit
def _norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    next_ptr,
    next_bytes,
    width,
    eps,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    CHUNK: tl.constexpr,
    THREADS: tl.constexpr,
):
    row = tl.program_id(0)
    if PREFETCH:  # this program's share of the next GEMM's weight
        l2_prefetch_share(next_ptr, next_bytes, CHUNK, THREADS)
    wait_for_inputs(PDL)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / width + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def norm(x, weight, out, pdl=False, next_weight=None, chunk=4096):
    m, width = x.shape
    prefetch = next_weight is not None
    _norm_kernel[(m,)](
        x,
        weight,
        out,
        next_weight if prefetch else x,
        next_weight.numel() * next_weight.element_size() if prefetch else 0,
        width,
        1e-6,
        BLOCK=triton.next_power_of_2(width),
        PDL=pdl,
        PREFETCH=prefetch,
        CHUNK=chunk,
        THREADS=128,
        num_warps=4,
        launch_pdl=pdl,
    )


@triton.jit
def _gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    CHUNK: tl.constexpr,
    THREADS: tl.constexpr,
):
    """y = x @ w.T, one BLOCK_M x BLOCK_N tile a program."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    if PREFETCH:
        if pid_m == 0:  # the weight slab depends on no earlier kernel: ask for it before waiting
            slab = BLOCK_N * K * 2
            for start in range(pid_n * slab, (pid_n + 1) * slab, CHUNK * THREADS):
                l2_prefetch(w_ptr, start, (pid_n + 1) * slab, CHUNK, THREADS)
    wait_for_inputs(PDL)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)


def gemm(x, w, y, block_n, block_k, stages, pdl, prefetch):
    m, k = x.shape
    n = w.shape[0]
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    _gemm_kernel[(n // block_n, triton.cdiv(m, block_m))](
        x,
        w,
        y,
        m,
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=pdl,
        PREFETCH=prefetch,
        CHUNK=1024,
        THREADS=128,
        num_warps=4,
        num_stages=stages,
        launch_pdl=pdl,
    )


def picked_batches(sizes=(256, 128, 64, 32, 8)):
    picked = {}
    for t, lens in workload_decode_batches(20):
        for size in sizes:
            if size not in picked and size * 0.9 <= len(lens) <= size:
                picked[size] = (t, lens)
    return [picked[s] for s in sizes if s in picked]


def gaps_bench(rates, results):
    print("\n== decoder stack: graph time against the sum of kernel durations (µs) ==")
    _, chain = decoder_stack(LAYERS)
    for t, lens in picked_batches():
        run = chain(lens)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph_us = replay_time_us(graph, replays=21)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        kernels = [
            e
            for e in prof.key_averages()
            if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA")
        ]

        def total(e):
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

        kernel_us = sum(total(e) for e in kernels) / 5
        launches = sum(e.count for e in kernels) / 5
        floor_us = stack_floor_us(lens, LAYERS, rates.bandwidth)
        print(
            f"  batch {len(lens):>3}: graph {graph_us:7.0f}, kernels {kernel_us:7.0f} in {launches:.0f} launches, "
            f"between kernels {graph_us - kernel_us:6.0f} ({(graph_us - kernel_us) / launches:.2f} a launch); "
            f"floor {floor_us:.0f}"
        )
        top = sorted(kernels, key=total, reverse=True)[:12]
        for e in top:
            print(f"      {total(e) / e.count:7.2f} µs x {e.count / 5:4.0f}  {e.key[:90]}")
        results["gaps"].append(
            {
                "batch": len(lens),
                "graph_us": graph_us,
                "kernel_us": kernel_us,
                "launches": launches,
                "floor_us": floor_us,
                "kernels": [{"name": e.key, "count": e.count / 5, "us": total(e) / e.count} for e in top],
            }
        )


def threshold_sweep(rates, lens, option: str, thresholds, replays: int) -> dict:
    """The decoder stack with a qwen3 token-threshold option at each of thresholds (the first, 0,
    the base), one stack at a time (each holds 28 layers' weights); prints the batch's line."""
    line = {}
    for tokens in thresholds:
        chain = decoder_stack(LAYERS, **{option: tokens})[1]
        line[f"{option}={tokens}"] = graph_time_us(chain(lens), reps=2, replays=replays)
        del chain
    floor_us = stack_floor_us(lens, LAYERS, rates.bandwidth)
    base = line[f"{option}={thresholds[0]}"]
    print(
        f"  batch {len(lens):>3}: "
        + "; ".join(f"{k} {v:6.0f} ({100 * (v - base) / base:+.1f}%)" for k, v in line.items())
        + f"; floor {floor_us:.0f}",
        flush=True,
    )
    return {"batch": len(lens), "floor_us": floor_us, **line}


def split_k_bench(rates, results):
    print("\n== decoder stack, o_proj and down_proj split-K up to N tokens (µs; % against N = 0) ==")
    for t, lens in picked_batches():
        results["split_k"].append(threshold_sweep(rates, lens, "split_k_tokens", (0, 64, 256), replays=7))


def triton_gemm_bench(rates, results):
    print("\n== decoder stack, qkv and gate_up through the Triton GEMM up to N tokens (µs; % against N = 0) ==")
    for t, lens in picked_batches():
        results["triton_gemm"].append(threshold_sweep(rates, lens, "triton_gemm_tokens", (0, 64, 128), replays=9))


def microbatch_bench(rates, results):
    print("\n== decoder stack, the batch in micro-batches, each on its own stream (µs; % against one) ==")
    _, chain = decoder_stack(LAYERS)
    streams = {
        "equal": [torch.cuda.Stream() for _ in range(4)],
        "prio": [torch.cuda.Stream(priority=-1 if i == 0 else 0) for i in range(4)],
    }
    for t, lens in picked_batches((256, 128, 64, 32, 8)):
        line = {"batch": len(lens), "floor_us": stack_floor_us(lens, LAYERS, rates.bandwidth)}
        line["one"] = graph_time_us(chain(lens), reps=2, replays=9)
        for parts, kind in ((2, "equal"), (2, "prio"), (3, "equal"), (4, "equal")):
            if len(lens) < 2 * parts:
                continue
            runs, first = [], 0
            for i in range(parts):
                part_lens = lens[i::parts]  # every parts-th sequence: the parts get alike lengths
                runs.append(chain(part_lens, first))
                first += len(part_lens)

            def run(runs=runs, kind=kind):
                main = torch.cuda.current_stream()
                for part_run, stream in zip(runs, streams[kind]):
                    stream.wait_stream(main)
                    with torch.cuda.stream(stream):
                        part_run()
                for stream in streams[kind][: len(runs)]:
                    main.wait_stream(stream)

            line[f"{parts}x{kind}"] = graph_time_us(run, reps=2, replays=9)
        base = line["one"]
        print(
            f"  batch {len(lens):>3}: "
            + "; ".join(
                f"{k} {v:6.0f} ({100 * (v - base) / base:+.1f}%)"
                for k, v in line.items()
                if k not in ("batch", "floor_us")
            )
            + f"; floor {line['floor_us']:.0f}",
            flush=True,
        )
        results["microbatch"].append(line)


# operation -> the (path from a decoder layer, attribute) callables that freezing it replaces
ABLATIONS = {
    "input_norm": [("input_layernorm", "norm"), ("input_layernorm", "add_norm")],
    "qkv_proj": [("self_attn.qkv_proj", "forward")],
    "qk_norm_rope": [("self_attn", "qk_norm_rope")],
    "attention": [("self_attn.backend", "forward")],
    "o_proj": [("self_attn.o_proj", "forward")],
    "post_norm": [("post_attention_layernorm", "add_norm")],
    "gate_up_proj": [("mlp.gate_up_proj", "forward")],
    "silu_mul": [("mlp", "act")],
    "down_proj": [("mlp.down_proj", "forward")],
}


def _frozen(fn):
    """fn, computed once per batch size and then returned as it was (the same tensors)."""
    outputs = {}

    def call(*args, **kwargs):
        key = args[0].shape[0]
        if key not in outputs:
            outputs[key] = fn(*args, **kwargs)
        return outputs[key]

    return call


def freeze(stack, parts) -> list:
    """Freezes parts (ABLATIONS keys) in every layer of stack; returns what unfreeze needs."""
    undo, seen = [], set()
    for layer in stack:
        for part in parts:
            for path, attr in ABLATIONS[part]:
                obj = layer.get_submodule(path) if "backend" not in path else layer.self_attn.backend
                if (id(obj), attr) in seen:  # the backend is one object for all layers
                    continue
                seen.add((id(obj), attr))
                own = attr in vars(obj)
                undo.append((obj, attr, getattr(obj, attr) if own else None))
                setattr(obj, attr, _frozen(getattr(obj, attr)))
    return undo


def unfreeze(undo):
    for obj, attr, original in reversed(undo):
        if original is None:
            delattr(obj, attr)  # a method: the class's again
        else:
            setattr(obj, attr, original)


def ablation_bench(rates, results):
    print("\n== decoder stack with one operation frozen in every layer: its cost in the chain (µs a layer) ==")
    stack, chain = decoder_stack(LAYERS)
    weight_bytes = {f"{name}_proj": n * k * 2 for name, (n, k) in SHAPES.items()}  # bf16 weights
    variants = [(p, [p]) for p in ABLATIONS] + [
        ("all but attention", [p for p in ABLATIONS if p != "attention"]),
        ("the four GEMMs", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        ("the four small kernels", ["input_norm", "qk_norm_rope", "post_norm", "silu_mul"]),
    ]
    for t, lens in picked_batches():
        base = graph_time_us(chain(lens), reps=2, replays=9)
        line = {"batch": len(lens), "stack_us": base, "floor_us": stack_floor_us(lens, LAYERS, rates.bandwidth)}
        for name, parts in variants:
            undo = freeze(stack, parts)
            try:
                line[name] = (base - graph_time_us(chain(lens), reps=2, replays=9)) / LAYERS
            finally:
                unfreeze(undo)
        kv_floor = int(lens.sum()) * NUM_KV_HEADS * HEAD_DIM * 4 / rates.bandwidth * 1e6
        print(
            f"  batch {len(lens):>3}: stack {base:6.0f} (floor {line['floor_us']:.0f}); a layer: "
            + ", ".join(
                f"{k} {v:5.1f}"
                + (
                    f" (floor {weight_bytes[k] / rates.bandwidth * 1e6:.1f})"
                    if k in weight_bytes
                    else f" (floor {kv_floor:.1f})"
                    if k == "attention"
                    else ""
                )
                for k, v in line.items()
                if k not in ("batch", "stack_us", "floor_us")
            ),
            flush=True,
        )
        results["ablation"].append(line)


def attention_chain_bench(rates, results):
    """The decoder stack (so attention between the layer's other kernels, not back to back as in
    microbench_gpu's attention sweep) under decode plans: tile, programs a multiprocessor, the
    shortest split."""
    print("\n== decoder stack under attention decode plans (µs; % against the defaults) ==")
    plans = [
        {},
        {"decode_programs_per_sm": 2},
        {"decode_programs_per_sm": 3},
        {"decode_programs_per_sm": 4},
        {"decode_programs_per_sm": 6},
        {"decode_block_n": 64, "decode_programs_per_sm": 4},
        {"decode_programs_per_sm": 4, "min_split_len": 512},
    ]
    chains = [(plan, decoder_stack(LAYERS, attention_options=plan)[1]) for plan in plans]
    for t, lens in picked_batches():
        line = {"batch": len(lens), "floor_us": stack_floor_us(lens, LAYERS, rates.bandwidth)}
        for plan, chain in chains:
            line[",".join(f"{k}={v}" for k, v in plan.items()) or "defaults"] = graph_time_us(
                chain(lens), reps=2, replays=9
            )
        base = line["defaults"]
        print(
            f"  batch {len(lens):>3}: "
            + "; ".join(
                f"{k} {v:6.0f} ({100 * (v - base) / base:+.1f}%)"
                for k, v in line.items()
                if k not in ("batch", "floor_us")
            )
            + f"; floor {line['floor_us']:.0f}",
            flush=True,
        )
        results["attention_chain"].append(line)


def split_k_plans_bench(rates, results):
    """The decoder stack with o_proj's and down_proj's split-K plan above 64 tokens replaced: 32- or
    64-column blocks, K in 2 or 4 parts, against split_k_kernel.plan's own (item 53: 32 columns in
    2 parts at 65-128 rows, 64 columns in 2 parts above)."""
    from inferlab.plugins.models import split_k_kernel

    print("\n== decoder stack, o_proj and down_proj split-K plans above 64 tokens (µs; % against the default) ==")
    original = split_k_kernel.plan
    variants = [(64, 2), (64, 4), (32, 2), (32, 4)]

    def plan_with(block_n, split):
        def plan(n, k, num_tokens=1):
            if num_tokens <= 64:
                return original(n, k, num_tokens)
            return split_k_kernel.fit(n, k, block_n, (split,))

        return plan

    _, chain = decoder_stack(LAYERS)
    try:
        for t, lens in picked_batches((256, 192, 128, 96, 72)):
            line = {"batch": len(lens), "floor_us": stack_floor_us(lens, LAYERS, rates.bandwidth)}
            for block_n, split in variants:
                split_k_kernel.plan = plan_with(block_n, split)
                line[f"n{block_n} split {split}"] = graph_time_us(chain(lens), reps=2, replays=9)
            default = original(*SHAPES["o"], len(lens))
            base = line[f"n{default.block_n} split {default.split}"]
            print(
                f"  batch {len(lens):>3}: "
                + "; ".join(
                    f"{k} {v:6.0f} ({100 * (v - base) / base:+.1f}%)"
                    for k, v in line.items()
                    if k not in ("batch", "floor_us")
                )
                + f"; floor {line['floor_us']:.0f}",
                flush=True,
            )
            results["split_k_plans"].append(line)
    finally:
        split_k_kernel.plan = original


@triton.jit
def grid_barrier(counter_ptr, rounds, programs):
    """Barrier number rounds + 1 of a grid of programs; returns rounds + 1. The program's threads
    meet, one arrives (release, so their writes go with it) and polls (acquire) until every
    program has arrived. All programs must be resident at once; it gives up after 2^22 polls (a
    grid larger than what is resident would otherwise hang; the caller's count check then fails)."""
    target = (rounds + 1) * programs
    tl.debug_barrier()
    seen = tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu") + 1
    polls = 0
    while (seen < target) & (polls < 4194304):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    tl.debug_barrier()
    return rounds + 1


@triton.jit
def _grid_barrier_kernel(counter_ptr, out_ptr, rounds):
    """Every program passes `rounds` grid-wide barriers, then stores the count it sees."""
    programs = tl.num_programs(0)
    for r in range(rounds):
        grid_barrier(counter_ptr, r, programs)
    tl.store(out_ptr + tl.program_id(0), tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu"))


@triton.jit
def _tiny_kernel(out_ptr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    tl.store(out_ptr + tl.program_id(0), tl.program_id(0))


def barrier_bench(rates, results):
    """What a layer boundary would cost inside one persistent kernel (a grid-wide barrier) against
    between kernels (a chain of tiny kernels in a graph, plain and with PDL), per boundary."""
    print("\n== a grid-wide barrier against a kernel boundary (µs each, 280 in a row) ==")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.zeros(4 * sms, dtype=torch.int32, device="cuda")
    for per_sm in (1, 2):
        programs = per_sm * sms

        def barriers():
            counter.zero_()
            _grid_barrier_kernel[(programs,)](counter, out, 280, num_warps=4)

        line = {"programs": programs, "barrier_us": graph_time_us(barriers, reps=1, replays=11) / 280}
        assert int(out[0]) == 280 * programs, (int(out[0]), 280 * programs)
        for use_pdl in (False, True):

            def kernels():
                for _ in range(280):
                    _tiny_kernel[(programs,)](out, PDL=use_pdl, num_warps=4, launch_pdl=use_pdl)

            line["pdl_kernel_us" if use_pdl else "kernel_us"] = graph_time_us(kernels, reps=1, replays=11) / 280
        print(
            f"  {programs} programs: barrier {line['barrier_us']:.2f}, kernel boundary {line['kernel_us']:.2f}, "
            f"with PDL {line['pdl_kernel_us']:.2f}",
            flush=True,
        )
        results["barrier"].append(line)


@triton.jit
def _prefetch_kernel(ptr, total_bytes, CHUNK: tl.constexpr, THREADS: tl.constexpr):
    """Each program asks L2 for its share of total_bytes from ptr, then exits."""
    l2_prefetch_share(ptr, total_bytes, CHUNK, THREADS)


@triton.jit
def _chain_items(M, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """How many items (column block, split, row block) a GEMM of the persistent_chain part has."""
    return N // BLOCK_N * SPLIT * tl.cdiv(M, BLOCK_M)


@triton.jit
def _chain_slab(item, N: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """Which split of K and which weight rows (output columns) item reads."""
    n_blocks = N // BLOCK_N
    return (item // n_blocks) % SPLIT, item % n_blocks * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _chain_item(
    x_ptr,
    x_stride,
    w_ptr,
    out_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    item,
    PRE_K: tl.constexpr,
    w_pre,
):
    """One item (column block, split, row block) of a GEMM of the persistent_chain part, split_k_kernel's
    tiles: out[split] = x @ w.T over K's split-th part. With PRE_K, the weight's first PRE_K columns
    are already in registers (w_pre): one dot over them, then the rest of K in BLOCK_K steps.
    Activations are read from L2 (.cg): in the persistent kernel another program wrote them, before
    a barrier."""
    split, cols = _chain_slab(item, N, BLOCK_N, SPLIT)
    rows = item // (N // BLOCK_N * SPLIT) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows[:, None] < M
    k_first = split * (K // SPLIT)
    if PRE_K > 0:
        pre = k_first + tl.arange(0, PRE_K)
        a_pre = tl.load(x_ptr + rows[:, None] * x_stride + pre[None, :], mask=row_mask, other=0.0, cache_modifier=".cg")
        acc = tl.dot(a_pre, tl.trans(w_pre))
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_first + PRE_K, k_first + K // SPLIT, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :], mask=row_mask, other=0.0, cache_modifier=".cg")
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :])
        acc += tl.dot(a, tl.trans(w))
    out = out_ptr + (split * M + rows)[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _chain_phase(
    x_ptr,
    x_stride,
    w_ptr,
    out_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    first_item,
    item_step,
):
    """A GEMM's items first_item, first_item + item_step, ... (_chain_item)."""
    for item in range(first_item, _chain_items(M, N, BLOCK_M, BLOCK_N, SPLIT), item_step):
        _chain_item(x_ptr, x_stride, w_ptr, out_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, item, 0, 0)


@triton.jit
def _chain_sum(parts_ptr, out_ptr, M, N: tl.constexpr, SPLIT: tl.constexpr, first_row, row_step):
    """The rows first_row, first_row + row_step, ... of a split GEMM's partials summed into out, as
    the model's add + RMSNorm kernel sums them (without the norm)."""
    cols = tl.arange(0, N)
    for row in range(first_row, M, row_step):
        total = tl.zeros([N], tl.float32)
        for part in tl.static_range(SPLIT):
            total += tl.load(parts_ptr + (part * M + row) * N + cols, cache_modifier=".cg")
        tl.store(out_ptr + row * N + cols, total.to(out_ptr.dtype.element_ty))


@triton.jit
def _chain_prefetch(
    w_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    first_item,
    item_step,
):
    """Ask L2 for the weight rows this program's items of a later _chain_phase will read: one
    cp.async.bulk.prefetch a row segment, without waiting for it."""
    k_per_split = K // SPLIT
    for item in range(first_item, _chain_items(M, N, BLOCK_M, BLOCK_N, SPLIT), item_step):
        split, cols = _chain_slab(item, N, BLOCK_N, SPLIT)
        bulk_prefetch_l2(
            (w_ptr + cols.to(tl.int64) * K + split * k_per_split).to(tl.pointer_type(tl.int8)),
            tl.full([BLOCK_N], k_per_split * 2, tl.int32),
        )


@triton.jit
def _chain_phase_kernel(
    x_ptr,
    x_stride,
    w_ptr,
    out_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One GEMM of the chain as its own kernel, one item a program."""
    wait_for_inputs(PDL)
    _chain_phase(
        x_ptr, x_stride, w_ptr, out_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, tl.program_id(0), tl.num_programs(0)
    )


@triton.jit
def _chain_sum_kernel(parts_ptr, out_ptr, M, N: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    """One partial sum of the chain as its own kernel, one row a program."""
    wait_for_inputs(PDL)
    _chain_sum(parts_ptr, out_ptr, M, N, SPLIT, tl.program_id(0), tl.num_programs(0))


@triton.jit
def _persistent_chain_kernel(
    qkv_ptr,
    o_ptr,
    h_ptr,
    gu_ptr,
    d_ptr,
    w_o,
    w_gu,
    w_d,
    w_qkv,
    counter_ptr,
    M,
    layers,
    N_QKV: tl.constexpr,
    N_O: tl.constexpr,
    K_O: tl.constexpr,
    N_GU: tl.constexpr,
    K_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BN_O: tl.constexpr,
    S_O: tl.constexpr,
    BN_GU: tl.constexpr,
    BN_D: tl.constexpr,
    S_D: tl.constexpr,
    BN_QKV: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The whole chain (o, its sum, gate_up, down, its sum, qkv; layers times) in one kernel, a
    grid-wide barrier where the chain of kernels has a kernel boundary. With PREFETCH each program
    first asks L2 for its share of the next GEMM's weight, so those bytes stream while this GEMM
    and the barrier run."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    size_o, size_gu, size_d, size_qkv = N_O * K_O, N_GU * N_O, N_O * K_D, N_QKV * N_O
    rounds = 0
    for layer in range(layers):
        wo = w_o + layer * size_o
        wgu = w_gu + layer * size_gu
        wd = w_d + layer * size_d
        wqkv = w_qkv + layer * size_qkv
        if PREFETCH:
            _chain_prefetch(wgu, M, N_GU, N_O, BLOCK_M, BN_GU, 1, pid, programs)
        _chain_phase(qkv_ptr, N_QKV, wo, o_ptr, M, N_O, K_O, BLOCK_M, BN_O, BLOCK_K, S_O, pid, programs)
        rounds = grid_barrier(counter_ptr, rounds, programs)
        _chain_sum(o_ptr, h_ptr, M, N_O, S_O, pid, programs)
        rounds = grid_barrier(counter_ptr, rounds, programs)
        if PREFETCH:
            _chain_prefetch(wd, M, N_O, K_D, BLOCK_M, BN_D, S_D, pid, programs)
        _chain_phase(h_ptr, N_O, wgu, gu_ptr, M, N_GU, N_O, BLOCK_M, BN_GU, BLOCK_K, 1, pid, programs)
        rounds = grid_barrier(counter_ptr, rounds, programs)
        if PREFETCH:
            _chain_prefetch(wqkv, M, N_QKV, N_O, BLOCK_M, BN_QKV, 1, pid, programs)
        _chain_phase(gu_ptr, N_GU, wd, d_ptr, M, N_O, K_D, BLOCK_M, BN_D, BLOCK_K, S_D, pid, programs)
        rounds = grid_barrier(counter_ptr, rounds, programs)
        _chain_sum(d_ptr, h_ptr, M, N_O, S_D, pid, programs)
        rounds = grid_barrier(counter_ptr, rounds, programs)
        if PREFETCH:
            if layer + 1 < layers:
                _chain_prefetch(wo + size_o, M, N_O, K_O, BLOCK_M, BN_O, S_O, pid, programs)
        _chain_phase(h_ptr, N_O, wqkv, qkv_ptr, M, N_QKV, N_O, BLOCK_M, BN_QKV, BLOCK_K, 1, pid, programs)
        rounds = grid_barrier(counter_ptr, rounds, programs)


@triton.jit
def _chain_preload(
    w_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRE_K: tl.constexpr,
    item,
    valid,
):
    """The first PRE_K columns of item's weight slab, into registers (zeros where not valid)."""
    split, cols = _chain_slab(item, N, BLOCK_N, SPLIT)
    ks = split * (K // SPLIT) + tl.arange(0, PRE_K)
    mask = (cols[:, None] < N) & valid
    return tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=mask, other=0.0)


@triton.jit
def _chain_phase_preloaded(
    x_ptr,
    x_stride,
    w_ptr,
    out_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    PRE_K: tl.constexpr,
    w_pre,
    item,
):
    """A GEMM's one item for this program, if it has one, its weight's first PRE_K columns
    preloaded (w_pre)."""
    if item < _chain_items(M, N, BLOCK_M, BLOCK_N, SPLIT):
        _chain_item(x_ptr, x_stride, w_ptr, out_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, item, PRE_K, w_pre)


@triton.jit
def _preloading_chain_kernel(
    qkv_ptr,
    o_ptr,
    h_ptr,
    gu_ptr,
    d_ptr,
    w_o,
    w_gu,
    w_d,
    w_qkv,
    counter_ptr,
    M,
    layers,
    N_QKV: tl.constexpr,
    N_O: tl.constexpr,
    K_O: tl.constexpr,
    N_GU: tl.constexpr,
    K_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BN_O: tl.constexpr,
    S_O: tl.constexpr,
    BN_GU: tl.constexpr,
    BN_D: tl.constexpr,
    S_D: tl.constexpr,
    BN_QKV: tl.constexpr,
    PK_O: tl.constexpr,
    PK_GU: tl.constexpr,
    PK_D: tl.constexpr,
    PK_QKV: tl.constexpr,
):
    """_persistent_chain_kernel where every GEMM has at most one item a program (batches of up to
    64 rows): each program loads the first columns of its next GEMM's weight slab into registers as
    soon as it has stored its part of the current GEMM, so that read streams during the partial
    sum and the barriers, which a kernel boundary does not allow (item 61: programs that become
    resident early to load hold the multiprocessors the previous kernel's last programs need)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    size_o, size_gu, size_d, size_qkv = N_O * K_O, N_GU * N_O, N_O * K_D, N_QKV * N_O
    rounds = 0
    pre_o = _chain_preload(w_o, M, N_O, K_O, BLOCK_M, BN_O, S_O, PK_O, pid, True)
    for layer in range(layers):
        wo = w_o + layer * size_o
        wgu = w_gu + layer * size_gu
        wd = w_d + layer * size_d
        wqkv = w_qkv + layer * size_qkv
        _chain_phase_preloaded(qkv_ptr, N_QKV, wo, o_ptr, M, N_O, K_O, BLOCK_M, BN_O, BLOCK_K, S_O, PK_O, pre_o, pid)
        pre_gu = _chain_preload(wgu, M, N_GU, N_O, BLOCK_M, BN_GU, 1, PK_GU, pid, True)
        rounds = grid_barrier(counter_ptr, rounds, programs)
        _chain_sum(o_ptr, h_ptr, M, N_O, S_O, pid, programs)
        rounds = grid_barrier(counter_ptr, rounds, programs)
        _chain_phase_preloaded(h_ptr, N_O, wgu, gu_ptr, M, N_GU, N_O, BLOCK_M, BN_GU, BLOCK_K, 1, PK_GU, pre_gu, pid)
        pre_d = _chain_preload(wd, M, N_O, K_D, BLOCK_M, BN_D, S_D, PK_D, pid, True)
        rounds = grid_barrier(counter_ptr, rounds, programs)
        _chain_phase_preloaded(gu_ptr, N_GU, wd, d_ptr, M, N_O, K_D, BLOCK_M, BN_D, BLOCK_K, S_D, PK_D, pre_d, pid)
        pre_qkv = _chain_preload(wqkv, M, N_QKV, N_O, BLOCK_M, BN_QKV, 1, PK_QKV, pid, True)
        rounds = grid_barrier(counter_ptr, rounds, programs)
        _chain_sum(d_ptr, h_ptr, M, N_O, S_D, pid, programs)
        rounds = grid_barrier(counter_ptr, rounds, programs)
        _chain_phase_preloaded(
            h_ptr, N_O, wqkv, qkv_ptr, M, N_QKV, N_O, BLOCK_M, BN_QKV, BLOCK_K, 1, PK_QKV, pre_qkv, pid
        )
        pre_o = _chain_preload(wo + size_o, M, N_O, K_O, BLOCK_M, BN_O, S_O, PK_O, pid, layer + 1 < layers)
        rounds = grid_barrier(counter_ptr, rounds, programs)


def chain_weights():
    """The GEMM chain parts' shapes (n_qkv, k_o, n_o, n_gu, k_d) and weights: o, gate_up, down and qkv,
    each a ring of LAYERS distinct bf16 matrices [n, k], so every layer's weight comes from memory."""
    n_qkv, k_o = SHAPES["qkv"][0], SHAPES["o"][1]
    n_o, n_gu, k_d = HIDDEN, 2 * INTER, INTER

    def ring(n, k):
        return torch.randn(LAYERS, n, k, dtype=torch.bfloat16, device="cuda") * k**-0.5

    return (n_qkv, k_o, n_o, n_gu, k_d), (ring(n_o, k_o), ring(n_gu, n_o), ring(n_o, k_d), ring(n_qkv, n_o))


def persistent_chain_bench(rates, results, stages: int = 4, preload_bytes: int = 32768):
    """A decode layer's four GEMMs and the sums of the two split ones' partials (o, sum, gate_up,
    down, sum, qkv; each one's input the previous one's output, split_k_kernel's tiles and plans),
    28 layers of distinct weights: as a chain of kernels launched with PDL, one item a program,
    against one persistent kernel whose programs take the same items in turn with a grid-wide
    barrier between steps, without and with the next GEMM's weight asked of L2 ahead. Same tiles,
    same arithmetic (the outputs must agree bit for bit), so the difference is kernel boundaries
    against barriers and weights streamed ahead: whether a persistent decode-layer kernel could win
    back the GEMMs' fixed costs (item 70 measured the barrier alone). Up to 64 rows, also the
    persistent kernel that loads the first preload_bytes of each program's next weight slab into
    registers before the barrier (its single dot over them may round differently from the loop's
    steps, so its outputs are compared, not asserted equal)."""
    from inferlab.plugins.models import split_k_kernel

    print("\n== a layer's GEMMs and partial sums: kernels with PDL against one persistent kernel (µs a layer) ==")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    (n_qkv, k_o, n_o, n_gu, k_d), (w_o, w_gu, w_d, w_qkv) = chain_weights()
    weight_bytes = sum(w[0].numel() * 2 for w in (w_o, w_gu, w_d, w_qkv))
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for m in (256, 128, 64, 32, 8):
        block_m, block_k = min(64, max(16, triton.next_power_of_2(m))), 128
        plan_o, plan_d = split_k_kernel.plan(n_o, k_o, m), split_k_kernel.plan(n_o, k_d, m)
        bn_gu, bn_qkv = split_k_kernel.wide_plan(n_gu, n_o).block_n, split_k_kernel.wide_plan(n_qkv, n_o).block_n
        qkv0 = torch.randn(m, n_qkv, dtype=torch.bfloat16, device="cuda")
        bufs = {}

        def fresh():
            bufs["qkv"] = qkv0.clone()
            bufs["o"] = torch.empty(plan_o.split, m, n_o, dtype=torch.float32, device="cuda")
            bufs["h"] = torch.empty(m, n_o, dtype=torch.bfloat16, device="cuda")
            bufs["gu"] = torch.empty(m, n_gu, dtype=torch.bfloat16, device="cuda")
            bufs["d"] = torch.empty(plan_d.split, m, n_o, dtype=torch.float32, device="cuda")

        def gemm(x, x_stride, w, out, n, k, bn, split, pdl):
            items = n // bn * split * triton.cdiv(m, block_m)
            _chain_phase_kernel[(items,)](
                x,
                x_stride,
                w,
                out,
                m,
                N=n,
                K=k,
                BLOCK_M=block_m,
                BLOCK_N=bn,
                BLOCK_K=block_k,
                SPLIT=split,
                PDL=pdl,
                num_warps=4,
                num_stages=stages,
                launch_pdl=pdl,
            )

        def partial_sum(parts, split, pdl):
            _chain_sum_kernel[(m,)](parts, bufs["h"], m, N=n_o, SPLIT=split, PDL=pdl, num_warps=4, launch_pdl=pdl)

        def kernels(pdl=True, layers=LAYERS):
            b = bufs
            for layer in range(layers):
                gemm(b["qkv"], n_qkv, w_o[layer], b["o"], n_o, k_o, plan_o.block_n, plan_o.split, pdl)
                partial_sum(b["o"], plan_o.split, pdl)
                gemm(b["h"], n_o, w_gu[layer], b["gu"], n_gu, n_o, bn_gu, 1, pdl)
                gemm(b["gu"], n_gu, w_d[layer], b["d"], n_o, k_d, plan_d.block_n, plan_d.split, pdl)
                partial_sum(b["d"], plan_d.split, pdl)
                gemm(b["h"], n_o, w_qkv[layer], b["qkv"], n_qkv, n_o, bn_qkv, 1, pdl)

        def persistent(programs, prefetch, layers=LAYERS):
            b = bufs
            counter.zero_()
            return _persistent_chain_kernel[(programs,)](
                b["qkv"],
                b["o"],
                b["h"],
                b["gu"],
                b["d"],
                w_o,
                w_gu,
                w_d,
                w_qkv,
                counter,
                m,
                layers,
                N_QKV=n_qkv,
                N_O=n_o,
                K_O=k_o,
                N_GU=n_gu,
                K_D=k_d,
                BLOCK_M=block_m,
                BLOCK_K=block_k,
                BN_O=plan_o.block_n,
                S_O=plan_o.split,
                BN_GU=bn_gu,
                BN_D=plan_d.block_n,
                S_D=plan_d.split,
                BN_QKV=bn_qkv,
                PREFETCH=prefetch,
                num_warps=4,
                num_stages=stages,
            )

        # Results first: the persistent kernel must reproduce the chain of kernels bit for bit.
        fresh()
        kernels(layers=2)
        expected = {k: v.clone() for k, v in bufs.items()}
        compiled = None
        for prefetch in (False, True):
            fresh()
            compiled = persistent(sms, prefetch, layers=2)
            torch.cuda.synchronize()
            for name, value in expected.items():
                assert torch.equal(bufs[name], value), (m, prefetch, name, (bufs[name] - value).abs().max())
        assert int(counter) == 12 * sms, int(counter)
        # At up to 64 rows every GEMM has at most one item a program: the preloading kernel applies.
        items = max(
            n // bn * split * triton.cdiv(m, block_m)
            for n, bn, split in (
                (n_o, plan_o.block_n, plan_o.split),
                (n_gu, bn_gu, 1),
                (n_o, plan_d.block_n, plan_d.split),
                (n_qkv, bn_qkv, 1),
            )
        )
        preload_k = {
            name: min(k // split, preload_bytes // (bn * 2))
            for name, k, bn, split in (
                ("PK_O", k_o, plan_o.block_n, plan_o.split),
                ("PK_GU", n_o, bn_gu, 1),
                ("PK_D", k_d, plan_d.block_n, plan_d.split),
                ("PK_QKV", n_o, bn_qkv, 1),
            )
        }

        def preloading(layers=LAYERS):
            b = bufs
            counter.zero_()
            _preloading_chain_kernel[(sms,)](
                b["qkv"],
                b["o"],
                b["h"],
                b["gu"],
                b["d"],
                w_o,
                w_gu,
                w_d,
                w_qkv,
                counter,
                m,
                layers,
                N_QKV=n_qkv,
                N_O=n_o,
                K_O=k_o,
                N_GU=n_gu,
                K_D=k_d,
                BLOCK_M=block_m,
                BLOCK_K=block_k,
                BN_O=plan_o.block_n,
                S_O=plan_o.split,
                BN_GU=bn_gu,
                BN_D=plan_d.block_n,
                S_D=plan_d.split,
                BN_QKV=bn_qkv,
                **preload_k,
                num_warps=4,
                num_stages=stages,
            )

        if items <= sms:
            fresh()
            preloading(layers=2)
            torch.cuda.synchronize()
            differences = {
                name: (bufs[name].float() - value.float()).abs().max().item() for name, value in expected.items()
            }
            print(
                f"  M={m:<4} preloading kernel against the chain of kernels, largest difference: {differences} "
                f"(preloaded columns {preload_k})",
                flush=True,
            )
            assert int(counter) == 12 * sms, int(counter)
        resident = min(228 * 1024 // max(compiled.metadata.shared, 1), 65536 // (compiled.n_regs * 128), 3)
        floor = max(weight_bytes / rates.bandwidth, 2 * m * weight_bytes / 2 / rates.matmul_rate) * 1e6
        fresh()
        line = {
            "m": m,
            "floor_us": floor,
            "shared": compiled.metadata.shared,
            "regs": compiled.n_regs,
            "kernels_pdl_us": graph_time_us(kernels, reps=1, replays=11) / LAYERS,
            "kernels_plain_us": graph_time_us(lambda: kernels(False), reps=1, replays=11) / LAYERS,
        }
        for per_sm in range(1, resident + 1):
            for prefetch in (False, True):
                line[f"persistent_{per_sm}_sm{'_prefetch' if prefetch else ''}_us"] = (
                    graph_time_us(lambda: persistent(per_sm * sms, prefetch), reps=1, replays=11) / LAYERS
                )
                assert int(counter) == 6 * LAYERS * per_sm * sms, int(counter)  # no barrier gave up
        if items <= sms:
            line["preloading_us"] = graph_time_us(preloading, reps=1, replays=11) / LAYERS
            assert int(counter) == 6 * LAYERS * sms, int(counter)
        print(
            f"  M={m:<4} "
            + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in line.items() if k.endswith("_us"))
            + f" (shared {line['shared']} B, {line['regs']} registers)",
            flush=True,
        )
        results["persistent_chain"].append(line)


def build_stream_chain():
    """scripts/stream_chain.cu compiled with nvcc into a temporary shared library, loaded by ctypes."""
    import shutil
    import subprocess
    import tempfile

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_chain.cu")
    library = os.path.join(tempfile.mkdtemp(), "libstream_chain.so")
    subprocess.run([nvcc, "-O3", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-o", library, source], check=True)
    lib = ctypes.CDLL(library)
    lib.stream_chain_launch.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int] * 10 + [ctypes.c_void_p] * 2
    lib.stream_chain_launch.restype = ctypes.c_int
    lib.stream_chain_shared_bytes.argtypes = [ctypes.c_int]
    lib.stream_chain_shared_bytes.restype = ctypes.c_int
    return lib


def stream_chain_bench(rates, results):
    """A layer's four GEMMs (o, gate_up, down, qkv; each one's input the previous one's output), 28
    layers of distinct weights, in one persistent CUDA kernel (scripts/stream_chain.cu) whose producer
    warp streams each block's weight slabs into a ring of shared-memory stages without ever waiting
    for a grid barrier, so weights flow across GEMM and layer boundaries while the consumers wait
    for their activations. Item 80's persistent Triton kernel and chain of kernels (the
    persistent_chain part; run it in the same call to compare) keep every weight load behind the
    barrier that publishes its activations. Whole K an item, so no split partials to sum: 4
    barriers a layer. Results are checked against torch in float32 with bf16 intermediates
    (another summation order, so not bit for bit); the runs of a plan that differ from its first, of
    50 repeats, and whether two ring depths agree bit for bit, are reported."""
    print("\n== a layer's GEMMs in one CUDA kernel, weights streamed ahead of the barriers (µs a layer) ==")
    lib = build_stream_chain()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    (n_qkv, k_o, n_o, n_gu, k_d), (w_o, w_gu, w_d, w_qkv) = chain_weights()
    weight_bytes = sum(w[0].numel() * 2 for w in (w_o, w_gu, w_d, w_qkv))
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    scratch = torch.randn(sms, 64, 6144, dtype=torch.bfloat16, device="cuda")  # each block's own x (diagnostic)
    for m in (64, 32, 16, 8):
        qkv0 = torch.randn(m, n_qkv, dtype=torch.bfloat16, device="cuda")
        bufs = {
            "qkv": qkv0.clone(),
            "h1": torch.empty(m, n_o, dtype=torch.bfloat16, device="cuda"),
            "gu": torch.empty(m, n_gu, dtype=torch.bfloat16, device="cuda"),
            "h2": torch.empty(m, n_o, dtype=torch.bfloat16, device="cuda"),
        }

        def launch(stages, layers=LAYERS, mode=0):  # one block a multiprocessor, all resident
            counter.zero_()
            err = lib.stream_chain_launch(
                w_o.data_ptr(),
                w_gu.data_ptr(),
                w_d.data_ptr(),
                w_qkv.data_ptr(),
                bufs["qkv"].data_ptr(),
                bufs["h1"].data_ptr(),
                bufs["gu"].data_ptr(),
                bufs["h2"].data_ptr(),
                counter.data_ptr(),
                m,
                layers,
                n_qkv,
                k_o,
                n_o,
                n_gu,
                k_d,
                sms,
                stages,
                mode,
                scratch.data_ptr(),
                torch.cuda.current_stream().cuda_stream,
            )
            assert err == 0, f"stream_chain_launch returned {err}"

        # Two layers against torch: float32 products of the bf16 operands, rounded to bf16 between GEMMs.
        ref = {"qkv": qkv0.clone()}
        for layer in range(2):
            ref["h1"] = (ref["qkv"][:, :k_o].float() @ w_o[layer].float().T).bfloat16()
            ref["gu"] = (ref["h1"].float() @ w_gu[layer].float().T).bfloat16()
            ref["h2"] = (ref["gu"][:, :k_d].float() @ w_d[layer].float().T).bfloat16()
            ref["qkv"] = (ref["h2"].float() @ w_qkv[layer].float().T).bfloat16()

        def two_layers(stages):
            bufs["qkv"].copy_(qkv0)
            launch(stages, layers=2)
            torch.cuda.synchronize()
            assert int(counter) == 8 * sms, int(counter)
            return {k: v.clone() for k, v in bufs.items()}

        # Each plan against torch, then run again 50 times: a race between the stages' refill and
        # their reads showed as a few runs in a hundred with wrong weight columns (item 81).
        first = {stages: two_layers(stages) for stages in (4, 12)}
        errors = {
            k: max(((out[k].float() - v.float()).abs().max() / v.float().abs().max()).item() for out in first.values())
            for k, v in ref.items()
        }
        differing_runs = {
            stages: sum(
                any(not torch.equal(out[k], first[stages][k]) for k in bufs)
                for out in (two_layers(stages) for _ in range(50))
            )
            for stages in first
        }
        plans_agree = all(torch.equal(first[4][k], first[12][k]) for k in bufs)
        print(
            f"  M={m:<3} against torch (largest difference / largest value, any plan): "
            + ", ".join(f"{k} {e:.1e}" for k, e in errors.items())
            + f"; of 50 repeats, differing from the first: {differing_runs}; 4 and 12 stages agree: {plans_agree}",
            flush=True,
        )
        assert max(errors.values()) < 2e-2, errors
        floor = weight_bytes / rates.bandwidth * 1e6
        line = {
            "m": m,
            "floor_us": floor,
            "max_rel_err": max(errors.values()),
            "differing_repeats": differing_runs,
            "plans_agree": plans_agree,
        }
        for stages in (4, 8, 12):
            bufs["qkv"].copy_(qkv0)
            line[f"stages_{stages}_us"] = graph_time_us(lambda: launch(stages), reps=1, replays=11) / LAYERS
            assert int(counter) == 4 * LAYERS * sms, int(counter)  # every barrier was met
            line[f"shared_{stages}"] = lib.stream_chain_shared_bytes(stages)
        # Where the time goes (wrong results): without the grid barriers, without x's loads, without both;
        # each block reading x from its own copy, not all blocks the same lines at once.
        for name, mode in (("no_barriers", 1), ("no_x_loads", 2), ("neither", 3), ("private_x", 4)):
            line[f"{name}_us"] = graph_time_us(lambda: launch(8, mode=mode), reps=1, replays=11) / LAYERS
        print(
            f"  M={m:<3} floor {floor:.2f}, "
            + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in line.items() if k.endswith("_us") and k != "floor_us"),
            flush=True,
        )
        results["stream_chain"].append(line)


def side_prefetch_bench(rates, results):
    """The decoder stack with a side stream that, once a layer's attention is done (just before its
    o_proj), asks L2 for weights the layer's later GEMMs read: the GEMMs after attention are
    latency-bound at decode batches (their weights stream at about a third of the bandwidth), so a
    prefetch issued a few kernels ahead could use the idle bandwidth. The side stream's kernel is
    one warp a multiprocessor and returns at once; the stream joins the main one at the end."""
    print("\n== decoder stack, weights asked of L2 from a side stream after attention (µs; % against none) ==")
    stack, chain = decoder_stack(LAYERS)
    side = torch.cuda.Stream()
    programs = torch.cuda.get_device_properties(0).multi_processor_count

    def prefetch(weight):
        _prefetch_kernel[(programs,)](
            weight, weight.numel() * weight.element_size(), CHUNK=4096, THREADS=32, num_warps=1
        )

    def targets(i, plan):
        layer, after = stack[i], stack[i + 1] if i + 1 < len(stack) else None
        weights = [layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
        if plan == "gate_up, down, next qkv" and after is not None:
            weights.append(after.self_attn.qkv_proj.weight)
        return weights

    forked = [False]

    def hook(plan):
        """Each layer's o_proj first forks the side stream and prefetches there; what unfreeze
        undoes."""
        undo = []
        for i, layer in enumerate(stack):
            o_proj = layer.self_attn.o_proj
            weights = targets(i, plan)

            def forward(x, _original=o_proj.forward, _weights=weights):
                side.wait_stream(torch.cuda.current_stream())  # after the layer's attention
                forked[0] = True
                with torch.cuda.stream(side):
                    for w in _weights:
                        prefetch(w)
                return _original(x)

            o_proj.forward = forward
            undo.append((o_proj, "forward", None))  # a method: the class's again
        return undo

    def joined(run):
        def call():
            out = run()
            if forked[0]:  # join only a stream this run forked (a capture may not wait on outside work)
                torch.cuda.current_stream().wait_stream(side)
                forked[0] = False
            return out

        return call

    plans = ["none", "gate_up, down", "gate_up, down, next qkv"]
    for t, lens in picked_batches():
        line = {"batch": len(lens), "floor_us": stack_floor_us(lens, LAYERS, rates.bandwidth)}
        for round_ in range(2):
            for plan in plans:
                undo = hook(plan) if plan != "none" else []
                try:
                    us = graph_time_us(joined(chain(lens)), reps=2, replays=9)
                finally:
                    unfreeze(undo)
                line.setdefault(plan, []).append(us)
        base = min(line["none"])
        print(
            f"  batch {len(lens):>3}: "
            + "; ".join(
                f"{plan} "
                + "/".join(f"{v:6.0f}" for v in line[plan])
                + f" ({100 * (min(line[plan]) - base) / base:+.1f}%)"
                for plan in plans
            )
            + f"; floor {line['floor_us']:.0f}",
            flush=True,
        )
        results["side_prefetch"].append(line)


def chain_bench(rates, results):
    print("\n== 280 RMSNorm kernels in a row (µs a kernel) ==")
    w = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
    for m in (8, 64, 256):
        x = torch.randn(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
        bufs = [x, torch.empty_like(x)]
        line = {}
        for pdl in (False, True):

            def run():
                for i in range(280):
                    norm(bufs[i % 2], w, bufs[(i + 1) % 2], pdl=pdl)

            line[pdl] = graph_time_us(run, reps=1, replays=11) / 280
        print(f"  M={m:<4} plain {line[False]:.2f}  PDL {line[True]:.2f}")
        results["chain"].append({"m": m, "plain_us": line[False], "pdl_us": line[True]})


def norm_gemm_cases():
    """Each projection at 8, 64 and 256 tokens: (name, n, k, m, the norm's weight, the ring of
    LAYERS weights, the norm's input x and output xn)."""
    for name, (n, k) in SHAPES.items():
        norm_weight = torch.ones(k, dtype=torch.bfloat16, device="cuda")
        weights = weight_ring(n, k, LAYERS)
        for m in (8, 64, 256):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            yield name, n, k, m, norm_weight, weights, x, torch.empty_like(x)


def prefetch_bench(rates, results):
    print("\n== RMSNorm then cuBLAS GEMM a layer, weights cold (µs a layer; floor: weight bytes) ==")
    for name, n, k, m, nw, weights, x, xn in norm_gemm_cases():
        line = {}
        for mode in ("none", "prefetch", "prefetch+pdl"):

            def run():
                for w in weights:
                    norm(x, nw, xn, pdl=mode == "prefetch+pdl", next_weight=None if mode == "none" else w)
                    F.linear(xn, w)

            line[mode] = graph_time_us(run, reps=1, replays=11) / LAYERS
        floor = n * k * 2 / rates.bandwidth * 1e6
        print(f"  {name:<8} M={m:<4} " + "  ".join(f"{k_} {v:5.2f}" for k_, v in line.items()) + f"  floor {floor:.2f}")
        results["prefetch"].append({"layer": name, "m": m, "floor_us": floor, **line})


def gemm_bench(rates, results):
    print("\n== RMSNorm then a Triton GEMM with PDL + weight prefetch, against cuBLAS (µs a layer) ==")
    for name, n, k, m, nw, weights, x, xn in norm_gemm_cases():
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

        def cublas():
            for w in weights:
                norm(x, nw, xn)
                F.linear(xn, w)

        base = graph_time_us(cublas, reps=1, replays=11) / LAYERS
        best = None
        for block_n, block_k, stages in itertools.product((32, 64, 128), (64, 128), (3, 4)):

            def run(pdl=True, prefetch=True):
                for w in weights:
                    norm(x, nw, xn, pdl=pdl)
                    gemm(xn, w, y, block_n, block_k, stages, pdl, prefetch)

            try:
                us = graph_time_us(run, reps=1, replays=11) / LAYERS
            except Exception as e:
                print(f"    skip n{block_n} k{block_k} s{stages}: {type(e).__name__}: {str(e)[:100]}")
                continue
            if best is None or us < best[0]:
                best = (us, block_n, block_k, stages, run)
        us, block_n, block_k, stages, run = best
        plain = graph_time_us(lambda: run(False, False), reps=1, replays=11) / LAYERS
        pdl_only = graph_time_us(lambda: run(True, False), reps=1, replays=11) / LAYERS
        check = torch.empty_like(y)
        gemm(xn, weights[0], check, block_n, block_k, stages, False, False)
        err = (check.float() - F.linear(xn, weights[0]).float()).abs().max().item()
        floor = n * k * 2 / rates.bandwidth * 1e6
        print(
            f"  {name:<8} M={m:<4} cuBLAS {base:5.2f}  triton plain {plain:5.2f}  +PDL {pdl_only:5.2f}  "
            f"+PDL+prefetch {us:5.2f} (n{block_n} k{block_k} s{stages}; max err {err:.3f})  floor {floor:.2f}"
        )
        results["gemm"].append(
            {
                "layer": name,
                "m": m,
                "cublas_us": base,
                "plain_us": plain,
                "pdl_us": pdl_only,
                "pdl_prefetch_us": us,
                "block_n": block_n,
                "block_k": block_k,
                "stages": stages,
                "floor_us": floor,
                "max_err": err,
            }
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="gaps,chain,prefetch,gemm,split_k")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rates = device_rates(torch.device("cuda"), torch.bfloat16)
    print(f"{rates.name}: bandwidth {rates.bandwidth / 1e9:.0f} GB/s, matmul {rates.matmul_rate / 1e12:.0f} TFLOP/s")
    parts = {
        "gaps": gaps_bench,
        "chain": chain_bench,
        "prefetch": prefetch_bench,
        "gemm": gemm_bench,
        "split_k": split_k_bench,
        "microbatch": microbatch_bench,
        "triton_gemm": triton_gemm_bench,
        "ablation": ablation_bench,
        "attention_chain": attention_chain_bench,
        "split_k_plans": split_k_plans_bench,
        "barrier": barrier_bench,
        "side_prefetch": side_prefetch_bench,
        "persistent_chain": persistent_chain_bench,
        "stream_chain": stream_chain_bench,
    }
    results = {part: [] for part in parts}
    with torch.inference_mode():
        for part in args.only.split(","):
            try:
                parts[part](rates, results)
            except Exception as e:  # one part's failure should not cost the others' figures
                import traceback

                traceback.print_exc()
                print(f"part {part} failed: {type(e).__name__}: {e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
