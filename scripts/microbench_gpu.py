"""Kernel-level timings of a decode step's parts on the GPU, each replayed from a CUDA graph (so
launch costs do not count, as in the engine's decode graphs), against its own floor.

    python scripts/microbench_gpu.py [--only attention,linear,linear_candidates,prefill,...]

- attention: the triton backend's split decode kernel over a paged bf16 cache (Qwen3-0.6B's 8 KV
  heads, 16 query heads, head_dim 128, blocks of 256) on the bench workload's own decode batches,
  over tile sizes, pipeline stages, split plans and start orders; flash-attn's paged decode beside it
  when it imports. Floor: the batch's K/V bytes over the measured bandwidth.
- linear: the four projections of a Qwen3-0.6B layer and the LM head at decode batch sizes, through
  cuBLAS and cuBLASLt. Floor: the larger of weight bytes over bandwidth and FLOPs over the matmul rate.
- cublaslt: every algorithm cuBLASLt's heuristic offers for the projections and LM head cuBLAS runs at
  decode batches, against F.linear (which runs the heuristic's first).
- linear_candidates: split-K Triton GEMMs (pointer loads, TMA descriptors) against cuBLAS, each
  weight one of a ring of 28 as in the model.
- wide_tiles: qkv and gate_up at 128 and 256 tokens, cuBLAS against the engine's Triton GEMM over
  larger tiles (BLOCK_M 64/128, BLOCK_N 64/128, warps, stages), cold weights, PDL chain.
- prefill: the triton backend's paged prefill over query heads a program (1 or the GQA group),
  tiles, warps and stages, and flash-attn's varlen.
- elementwise: q/k norm + rotary, SiLU*mul and the residual add + RMSNorm, each as our Triton
  kernel and through torch.compile.
- sampling: the sampler's kernels against an argmax over the same logits, and their block sizes, warps, chunks.
- read_bandwidth: how fast the GPU reads memory without writing it back, against the floor's
  device-to-device copy: contiguous spans, and the decode kernel's pattern (one KV head's 256-byte
  rows, 2 KB apart in the paged cache), over tile sizes, warps and stages. Attention's headroom.
- overlap: a stack of decoder layers over a workload batch, whole, as two halves in turn, and as
  two halves on two streams (could two micro-batches hide each other's small kernels?).
Prints tables; --out writes them as JSON."""

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from inferlab.core.cuda_graphs import MAX_GRAPH_BATCH, graph_batch_sizes  # noqa: E402
from inferlab.floor import device_rates  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, HIDDEN, INTER, VOCAB = 16, 8, 128, 256, 1024, 3072, 151936


def graph_time_us(fn, reps: int = 20, replays: int = 20) -> float:
    """Microseconds per fn() call: reps calls captured in one CUDA graph, replayed; median of replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return replay_time_us(graph, replays) / reps


def median_event_us(fn, repeats: int) -> float:
    """Microseconds of fn() between two CUDA events, median of repeats."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def event_time_us(fn, calls: int = 10, repeats: int = 3) -> float:
    """Microseconds per fn() call, eagerly, between two events around `calls` calls; median of repeats.
    For kernels a graph cannot capture; launch gaps count where the host is slower than the kernels."""
    for _ in range(3):
        fn()
    return median_event_us(lambda: [fn() for _ in range(calls)], repeats) / calls


def replay_time_us(graph, replays: int = 20) -> float:
    """Microseconds per replay of a captured CUDA graph, median of replays (after one untimed)."""
    graph.replay()
    torch.cuda.synchronize()
    return median_event_us(graph.replay, replays)


def workload_decode_batches(every: int):
    """The bench workload's decode batches, every `every` steps: at step t the running sequences
    are those with more than t output tokens, each holding its prompt plus t tokens."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_gpu import workload

    prompts, params = workload(256, 1024, 1024)
    prompt_lens = torch.tensor([len(p) for p in prompts])
    outputs = torch.tensor([p.max_tokens for p in params])
    for t in range(1, int(outputs.max()), every):
        active = outputs > t
        yield t, prompt_lens[active] + t


def attention_bench(
    rates,
    results,
    every: int = 40,
    quick: bool = False,
    warps: tuple[int, ...] = (4, 8),
    stages: tuple[int, ...] = (2, 3, 4),
    tiles: tuple[int, ...] = (64, 128),
):
    """The split decode kernel over the bench workload's own decode batches (every `every` steps),
    for each kernel configuration and split plan; flash-attn's paged decode beside it. The total
    over the sampled steps says which configuration serves the whole run best."""
    from inferlab.plugins.attention import triton_kernels as tk

    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None
    scale = HEAD_DIM**-0.5
    max_blocks = 4096 // BLOCK_SIZE
    num_blocks = 256 * max_blocks
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    if quick:  # the default tile: the split plan and the order
        configs = list(itertools.product((128,), (4,), (3,), (4, 8, 12, 16, 24), ("batch", "longest_first")))
    else:  # tiles, warps and stages (2 or 3 programs a multiprocessor fit at 64 keys and 2-3 stages)
        configs = list(itertools.product(tiles, warps, stages, (4, 8, 16), ("longest_first",)))
    totals = {c: 0.0 for c in configs}
    flash_total = floor_total = 0.0
    print(f"\n== decode attention over the workload's decode batches, every {every} steps (µs) ==")
    for t, lens in workload_decode_batches(every):
        batch = len(lens)
        padded = next(b for b in graph_batch_sizes(MAX_GRAPH_BATCH) if b >= batch)  # as the decode graphs pad
        seq_lens = torch.zeros(padded, dtype=torch.int32)
        seq_lens[:batch] = lens.to(torch.int32)
        # each sequence its own run of blocks, as a fresh cache hands them out
        tables = (torch.arange(padded)[:, None] * max_blocks + torch.arange(max_blocks)[None, :]).to(torch.int32)
        tables, seq_lens = tables.cuda(), seq_lens.cuda()
        q = torch.randn(padded, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(q)
        kv_bytes = int(lens.sum()) * NUM_KV_HEADS * HEAD_DIM * 2 * 2
        floor_us = kv_bytes / rates.bandwidth * 1e6
        floor_total += floor_us
        line = {}
        for config in configs:
            block_n, warps, stages, per_sm, order = config
            splits = tk.decode_splits(q, NUM_KV_HEADS, 4096, 256, per_sm)
            seq_order = tk.longest_first(seq_lens) if order == "longest_first" else None
            partial_out = torch.empty(padded, NUM_HEADS, splits, HEAD_DIM, dtype=torch.float32, device="cuda")
            partial_lse = torch.empty(padded, NUM_HEADS, splits, dtype=torch.float32, device="cuda")
            fn = lambda: tk.paged_decode(
                q,
                cache,
                out,
                seq_lens,
                tables,
                scale,
                splits,
                block_n,  # noqa: E731
                partial_out,
                partial_lse,
                256,
                warps,
                stages,
                seq_order,
            )
            try:
                us = graph_time_us(fn, reps=10, replays=7)
            except Exception as e:  # a config that does not compile (shared memory) counts as never best
                us = float("inf")
                print(f"  skip {config}: {type(e).__name__}")
            totals[config] += us
            line[config] = us
            results["attention"].append(
                {
                    "step": t,
                    "batch": batch,
                    "block_n": block_n,
                    "warps": warps,
                    "stages": stages,
                    "programs_per_sm": per_sm,
                    "order": order,
                    "splits": splits,
                    "us": us,
                    "floor_us": floor_us,
                }
            )
        if flash_attn_with_kvcache is not None:
            us = graph_time_us(
                lambda: flash_attn_with_kvcache(
                    q.unsqueeze(1),
                    cache[0],
                    cache[1],
                    cache_seqlens=seq_lens,
                    block_table=tables,
                    softmax_scale=scale,
                    causal=True,
                ),
                reps=10,
                replays=7,
            )
            flash_total += us
            results["attention"].append(
                {"step": t, "batch": batch, "kernel": "flash_attn", "us": us, "floor_us": floor_us}
            )
        best = min(line, key=line.get)
        print(
            f"  step {t:>4}: batch {batch:>3}, {int(lens.sum()):>6} keys, floor {floor_us:6.1f}; best {best} "
            f"{line[best]:6.1f} ({100 * floor_us / line[best]:.0f}%)"
        )
    ranked = sorted(totals, key=totals.get)
    print(
        f"sum over the sampled steps: floor {floor_total:.0f} µs"
        + (f", flash_attn {flash_total:.0f} µs ({100 * floor_total / flash_total:.1f}%)" if flash_total else "")
    )
    for config in ranked[:8]:
        print(
            f"  block_n {config[0]:>3} warps {config[1]} stages {config[2]} programs/SM {config[3]:>2} "
            f"order {config[4]}: "
            f"{totals[config]:.0f} µs ({100 * floor_total / totals[config]:.1f}% of floor)"
        )


def weight_ring(n: int, k: int, copies: int = 28) -> list[torch.Tensor]:
    """copies of a [n, k] bf16 weight, one a layer as in the model: together larger than L2, so
    each GEMM over the ring reads its weight from memory."""
    return [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]


def cublas_ring_us(x: torch.Tensor, weights: list[torch.Tensor], reps: int = 1, replays: int = 11) -> float:
    """Microseconds a cuBLAS GEMM x @ w.T over the ring, one after another in one graph."""
    return graph_time_us(lambda: [F.linear(x, w) for w in weights], reps=reps, replays=replays) / len(weights)


def gemm_floor_us(rates, m: int, n: int, k: int) -> float:
    """The larger of a [m, k] x [k, n] GEMM's weight bytes over the bandwidth and its FLOPs over
    the matmul rate."""
    return max(n * k * 2 / rates.bandwidth, 2 * m * n * k / rates.matmul_rate) * 1e6


def linear_bench(rates, results):
    """Each projection through cuBLAS and through cuBLASLt (torch's preferred_blas_library), with its
    weight read from memory as in the model (a ring of 28 copies, one a layer, larger than L2)."""
    print("\n== linear layers (µs; floor = max(weight bytes / bandwidth, FLOPs / matmul rate)) ==")
    shapes = {
        "qkv": (4096, HIDDEN),
        "o": (HIDDEN, 2048),
        "gate_up": (2 * INTER, HIDDEN),
        "down": (HIDDEN, INTER),
        "lm_head": (VOCAB, HIDDEN),
    }
    default = torch.backends.cuda.preferred_blas_library()
    for name, (n, k) in shapes.items():
        weights = weight_ring(n, k, 1 if name == "lm_head" else 28)
        for library in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            line = []
            for m in (1, 8, 32, 64, 128, 256):
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                us = cublas_ring_us(x, weights, reps=2, replays=9)
                floor = gemm_floor_us(rates, m, n, k)
                line.append(f"M={m}: {us:.1f} ({100 * floor / us:.0f}%)")
                results["linear"].append({"layer": name, "library": library, "m": m, "us": us, "floor_us": floor})
            print(f"  {name:<8} {library:<8} " + "  ".join(line))
    torch.backends.cuda.preferred_blas_library(default)


class CublasLt:
    """Just enough of cuBLASLt through ctypes to list the algorithms its heuristic offers for a bf16
    y[m, n] = x[m, k] @ w[n, k].T and to run any one of them (torch runs only the first)."""

    class Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t; algo is the opaque cublasLtMatmulAlgo_t
        _fields_ = [
            ("algo", ctypes.c_uint64 * 8),
            ("workspace_size", ctypes.c_size_t),
            ("state", ctypes.c_int),
            ("waves", ctypes.c_float),
            ("reserved", ctypes.c_int * 4),
        ]

    BF16, F32, COMPUTE_32F, DESC_TRANSA, DESC_TRANSB, PREF_MAX_WORKSPACE = 14, 0, 68, 3, 4, 1
    WORKSPACE = 32 << 20

    def __init__(self):
        import glob

        site = os.path.dirname(os.path.dirname(torch.__file__))
        names = ["libcublasLt.so.13", "libcublasLt.so.12"] + sorted(
            glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcublasLt.so*"))
        )
        for name in names:
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise OSError(f"libcublasLt not found (tried {names})")
        v = ctypes.c_void_p
        self.lib.cublasLtMatrixLayoutCreate.argtypes = [
            ctypes.POINTER(v),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_int64,
        ]
        self.lib.cublasLtMatmulDescSetAttribute.argtypes = [v, ctypes.c_int, v, ctypes.c_size_t]
        self.lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [v, ctypes.c_int, v, ctypes.c_size_t]
        self.lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [
            v,
            v,
            v,
            v,
            v,
            v,
            v,
            ctypes.c_int,
            v,
            ctypes.POINTER(ctypes.c_int),
        ]
        self.lib.cublasLtMatmul.argtypes = [v, v, v, v, v, v, v, v, v, v, v, v, v, v, ctypes.c_size_t, v]
        self.lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [
            v,
            ctypes.c_int,
            v,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_size_t),
        ]
        self.handle = v()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(self.WORKSPACE, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._shapes = {}

    @staticmethod
    def _check(status, what):
        if status != 0:
            raise RuntimeError(f"{what} failed with cublasStatus {status}")

    def _layout(self, rows, cols, ld):
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), self.BF16, rows, cols, ld), "layout")
        return layout

    def _descriptors(self, m, n, k):
        """Column-major view of the row-major product: y.T [n, m] = w [n, k] (stored as k x n, transposed)
        times x.T [k, m]."""
        if (m, n, k) not in self._shapes:
            desc = ctypes.c_void_p()
            self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), self.COMPUTE_32F, self.F32), "desc")
            for attr, op in ((self.DESC_TRANSA, 1), (self.DESC_TRANSB, 0)):
                value = ctypes.c_int32(op)
                self._check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), 4), "trans")
            self._shapes[m, n, k] = (desc, self._layout(k, n, k), self._layout(k, m, k), self._layout(n, m, n))
        return self._shapes[m, n, k]

    def algorithms(self, m, n, k, count=64):
        """The heuristic's algorithms for this shape, best guess first (the first is torch's)."""
        desc, a, b, c = self._descriptors(m, n, k)
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        size = ctypes.c_uint64(self.WORKSPACE)
        self._check(
            self.lib.cublasLtMatmulPreferenceSetAttribute(pref, self.PREF_MAX_WORKSPACE, ctypes.byref(size), 8),
            "workspace",
        )
        results = (self.Heuristic * count)()
        found = ctypes.c_int(0)
        self._check(
            self.lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, desc, a, b, c, c, pref, count, results, ctypes.byref(found)
            ),
            "heuristic",
        )
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i] for i in range(found.value) if results[i].state == 0]

    def describe(self, heuristic):
        """The algorithm's id, tile, split-K, stages and cluster shape ids, and the heuristic's waves."""
        fields = []
        for name, attr in (("id", 0), ("tile", 1), ("splitk", 2), ("stages", 6), ("cluster", 8)):
            value, written = ctypes.c_int32(0), ctypes.c_size_t(0)
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(heuristic.algo), attr, ctypes.byref(value), 4, ctypes.byref(written)
            )
            fields.append(f"{name}{value.value if status == 0 else '?'}")
        return " ".join(fields) + f" waves{heuristic.waves:.2f}"

    def matmul(self, x, w, y, heuristic):
        m, k = x.shape
        n = w.shape[0]
        desc, a, b, c = self._descriptors(m, n, k)
        self._check(
            self.lib.cublasLtMatmul(
                self.handle,
                desc,
                ctypes.byref(self.alpha),
                w.data_ptr(),
                a,
                x.data_ptr(),
                b,
                ctypes.byref(self.beta),
                y.data_ptr(),
                c,
                y.data_ptr(),
                c,
                ctypes.byref(heuristic.algo),
                self.workspace.data_ptr(),
                min(heuristic.workspace_size, self.WORKSPACE),
                torch.cuda.current_stream().cuda_stream,
            ),
            "matmul",
        )
        return y


def cublaslt_bench(rates, results):
    """Every algorithm cuBLASLt's heuristic offers for the decode projections cuBLAS runs in the model
    (qkv and gate_up above 64 tokens, the LM head at every batch), timed over the ring of 28 cold
    weights in one graph, against torch's F.linear (the heuristic's first). Is a better algorithm
    than the one torch runs there to be had?"""
    print("\n== cuBLASLt's heuristic algorithms against F.linear, cold weights (µs a GEMM) ==")
    lt = CublasLt()
    shapes = {
        "qkv": (4096, HIDDEN, (64, 96, 128, 160, 192, 224, 256)),
        "gate_up": (2 * INTER, HIDDEN, (64, 96, 128, 160, 192, 224, 256)),
        "o": (HIDDEN, 2048, (64, 128, 256)),
        "down": (HIDDEN, INTER, (64, 128, 256)),
        "lm_head": (VOCAB, HIDDEN, (1, 16, 32, 64, 128, 192, 256)),
    }
    for name, (n, k, batches) in shapes.items():
        weights = weight_ring(n, k, 2 if name == "lm_head" else 28)
        for m in batches:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            reference = F.linear(x, weights[0])
            torch_us = cublas_ring_us(x, weights)
            floor = gemm_floor_us(rates, m, n, k)
            timed = []
            for rank, heuristic in enumerate(lt.algorithms(m, n, k)):
                try:
                    lt.matmul(x, weights[0], y, heuristic)
                    err = (y.float() - reference.float()).abs().max().item()
                    us = graph_time_us(
                        lambda: [lt.matmul(x, w, y, heuristic) for w in weights], reps=1, replays=11
                    ) / len(weights)
                except RuntimeError as e:
                    print(f"    skip {name} M={m} algorithm {rank}: {e}")
                    continue
                timed.append((us, rank, lt.describe(heuristic), err))
            timed.sort()
            first = next((t for t in timed if t[1] == 0), None)
            results.setdefault("cublaslt", []).append(
                {
                    "layer": name,
                    "m": m,
                    "torch_us": torch_us,
                    "floor_us": floor,
                    "algorithms": [
                        {"us": us, "rank": rank, "config": config, "max_err": err} for us, rank, config, err in timed
                    ],
                }
            )
            best = "  ".join(f"#{rank} {us:.2f} ({config}, err {err:.3f})" for us, rank, config, err in timed[:3])
            print(
                f"  {name:<8} M={m:<4} F.linear {torch_us:6.2f}  heuristic #0 "
                f"{first[0] if first else float('nan'):6.2f}  of {len(timed)}, best: {best}  floor {floor:.2f}",
                flush=True,
            )


@triton.jit
def _splitk_tma_kernel(
    x_desc,
    w_desc,
    y_ptr,
    M,
    N,
    K,
    stride_ym,
    stride_ys,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """split_k_kernel's tiles (y = x @ w.T over one BLOCK_N slab of w and one of SPLIT_K parts of K
    a program; fp32 partials when split), loaded by the Hopper tensor-memory accelerator (TMA)
    through tensor descriptors: one bulk copy a tile instead of per-thread addresses, rows past M
    filled with 0."""
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_per_split = K // SPLIT_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_s * k_per_split, (pid_s + 1) * k_per_split, BLOCK_K):
        x = x_desc.load([pid_m * BLOCK_M, k0])
        w = w_desc.load([pid_n * BLOCK_N, k0])
        acc += tl.dot(x, tl.trans(w))
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dst = y_ptr + pid_s * stride_ys + rm[:, None] * stride_ym + rn[None, :]
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)


def splitk_linear(x, weights, ys, block_n, block_k, split_k, stages, tma):
    """One launch a weight of weights (the ring): ys[i] = x @ weights[i].T, as SPLIT_K partials
    (contiguous [split, m, n]; float32 when split, else the model dtype)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from inferlab.plugins.models import split_k_kernel

    m, k = x.shape
    n = weights[0].shape[0]
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    grid = (n // block_n, split_k, triton.cdiv(m, block_m))
    if tma:
        x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
        w_descs = [TensorDescriptor.from_tensor(w, [block_n, block_k]) for w in weights]
    for i, (w, y) in enumerate(zip(weights, ys)):
        if tma:
            _splitk_tma_kernel[grid](
                x_desc,
                w_descs[i],
                y,
                m,
                n,
                k,
                y.stride(1),
                y.stride(0),
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                BLOCK_K=block_k,
                SPLIT_K=split_k,
                num_warps=4,
                num_stages=stages,
            )
        else:  # the engine's kernel (pointer loads, cp.async), launched plainly here
            split_k_kernel._split_k_kernel[grid](
                x,
                w,
                y,
                m,
                n,
                k,
                x.stride(0),
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                BLOCK_K=block_k,
                SPLIT=split_k,
                PDL=False,
                num_warps=4,
                num_stages=stages,
            )


def linear_candidates_bench(rates, results):
    """Skinny decode GEMMs with each weight read from memory as in the model (a ring of 28 copies,
    one a layer, larger than L2): cuBLAS against split-K Triton kernels loading through pointers and
    through TMA descriptors. 'partials' leaves the SPLIT_K fp32 partials unsummed (the GEMM alone);
    'summed' adds the sum a split needs."""
    print("\n== skinny GEMMs, cold weights: cuBLAS against split-K Triton, pointer loads and TMA (µs a GEMM) ==")
    shapes = {"qkv": (4096, HIDDEN), "o": (HIDDEN, 2048), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
    ring = 28
    for name, (n, k) in shapes.items():
        weights = weight_ring(n, k, ring)
        for m in (8, 64, 256):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            cublas = cublas_ring_us(x, weights)
            floor = gemm_floor_us(rates, m, n, k)
            line = {"layer": name, "m": m, "cublas_us": cublas, "floor_us": floor}
            for tma in (False, True):
                best = None
                for block_n, block_k, split_k, stages in itertools.product((32, 64), (128, 256), (1, 2, 4), (4,)):
                    if k % (block_k * split_k):
                        continue
                    dtype = torch.float32 if split_k > 1 else torch.bfloat16
                    ys = [torch.empty(split_k, m, n, dtype=dtype, device="cuda") for _ in range(ring)]
                    config = (block_n, block_k, split_k, stages)
                    try:
                        us = (
                            graph_time_us(lambda: splitk_linear(x, weights, ys, *config, tma), reps=1, replays=11)
                            / ring
                        )
                    except Exception as e:
                        print(f"    skip {name} M={m} tma={tma} {config}: {type(e).__name__}: {str(e)[:80]}")
                        continue
                    if best is None or us < best[0]:
                        best = (us, config, ys)
                if best is None:
                    continue
                us, config, ys = best
                summed = us
                if config[2] > 1:
                    summed = (
                        graph_time_us(
                            lambda: [
                                (splitk_linear(x, weights[i : i + 1], ys[i : i + 1], *config, tma), ys[i].sum(0))
                                for i in range(ring)
                            ],
                            reps=1,
                            replays=11,
                        )
                        / ring
                    )
                splitk_linear(x, weights[:1], ys[:1], *config, tma)
                err = (ys[0].float().sum(0) - F.linear(x, weights[0]).float()).abs().max().item()
                key = "tma" if tma else "pointers"
                line.update(
                    {
                        f"{key}_partials_us": us,
                        f"{key}_summed_us": summed,
                        f"{key}_config": config,
                        f"{key}_max_err": err,
                    }
                )
            results["linear_candidates"].append(line)
            print(
                f"  {name:<8} M={m:<4} cuBLAS {cublas:5.2f}  "
                + "  ".join(
                    f"{key} {line[key + '_partials_us']:5.2f}/{line[key + '_summed_us']:5.2f} "
                    f"(n{line[key + '_config'][0]} k{line[key + '_config'][1]} split{line[key + '_config'][2]}, "
                    f"err {line[key + '_max_err']:.3f})"
                    for key in ("pointers", "tma")
                    if key + "_config" in line
                )
                + f"  floor {floor:.2f}",
                flush=True,
            )


def wide_tiles_bench(rates, results):
    """qkv_proj and gate_up_proj at 128 and 256 tokens: cuBLAS against the engine's Triton GEMM
    (split_k_kernel, unsplit, launched with PDL as in the model) over larger tiles than its
    64-row default: BLOCK_M 64/128, BLOCK_N 64/128, 4 or 8 warps, 3 or 4 stages. Each weight one
    of a ring of 28, so every GEMM reads it from memory, one after another as in a layer chain."""
    from inferlab.plugins import pdl
    from inferlab.plugins.models import split_k_kernel

    print("\n== wide GEMMs at 128-256 tokens, cold weights: cuBLAS against Triton tiles (µs a GEMM) ==")
    ring = 28
    for name, (n, k) in {"qkv": (4096, HIDDEN), "gate_up": (2 * INTER, HIDDEN)}.items():
        weights = weight_ring(n, k, ring)
        for m in (128, 256):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            cublas = cublas_ring_us(x, weights)
            floor = gemm_floor_us(rates, m, n, k)
            line = {"layer": name, "m": m, "cublas_us": cublas, "floor_us": floor, "configs": {}}
            for block_m, block_n, warps, stages in itertools.product((64, 128), (64, 128), (4, 8), (3, 4)):

                def run(block_m=block_m, block_n=block_n, warps=warps, stages=stages):
                    for w in weights:
                        split_k_kernel._split_k_kernel[(n // block_n, 1, triton.cdiv(m, block_m))](
                            x,
                            w,
                            y,
                            m,
                            n,
                            k,
                            x.stride(0),
                            BLOCK_M=block_m,
                            BLOCK_N=block_n,
                            BLOCK_K=64,
                            SPLIT=1,
                            num_warps=warps,
                            num_stages=stages,
                            **pdl.launch_options(x.device),
                        )

                key = f"m{block_m}_n{block_n}_w{warps}_s{stages}"
                try:
                    line["configs"][key] = graph_time_us(run, reps=1, replays=11) / ring
                except Exception as e:
                    print(f"    skip {name} M={m} {key}: {type(e).__name__}: {str(e)[:80]}")
            best = min(line["configs"], key=line["configs"].get) if line["configs"] else None
            results.setdefault("wide_tiles", []).append(line)
            top = sorted(line["configs"].items(), key=lambda kv: kv[1])[:4]
            print(
                f"  {name:<8} M={m:<4} cuBLAS {cublas:5.2f}  best "
                + "  ".join(f"{k_} {v:5.2f}" for k_, v in top)
                + f"  floor {floor:.2f}"
                + ("" if best else "  (no config ran)"),
                flush=True,
            )


def prefill_bench(rates, results, quick: bool = False, warps: tuple[int, ...] = (4, 8)):
    """The triton backend's paged prefill on a chunk like the bench's first steps (29 prompts of
    100..1024 tokens, no cached prefix), over tiles, warps and stages (quick: programs over the
    whole group, 2 stages); flash-attn's varlen and torch's own kernels beside it."""
    from inferlab.plugins.attention import triton_kernels as tk

    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(100, 1024, (29,), generator=gen)
    total = int(lens.sum())
    blocks_per_seq = (lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = int(blocks_per_seq.sum())
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    tables = torch.zeros(len(lens), int(blocks_per_seq.max()), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq.tolist()):
        tables[i, :nb] = torch.arange(used, used + nb)
        used += nb
    tables = tables.cuda()
    seq_lens = lens.to(torch.int32).cuda()
    query_start = torch.zeros(len(lens) + 1, dtype=torch.int32)
    query_start[1:] = torch.cumsum(lens, 0)
    query_start = query_start.cuda()
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    flops = 4 * HEAD_DIM * NUM_HEADS * float((lens * (lens + 1) / 2).sum())
    floor_us = flops / rates.matmul_rate * 1e6
    max_len, scale = int(lens.max()), HEAD_DIM**-0.5
    print(
        f"\n== prefill attention, {len(lens)} prompts, {total} tokens, floor {floor_us:.1f} µs (FLOPs / matmul rate) =="
    )
    rows = []
    group = NUM_HEADS // NUM_KV_HEADS
    sweep = (
        ((group,), (16, 32, 64), (16, 32, 64), warps, (2,))
        if quick
        else ((1, group), (32, 64, 128), (32, 64), warps, (2, 3))
    )
    for heads, block_m, block_n, num_warps, stages in itertools.product(*sweep):
        if heads * block_m > 128:  # the accumulator would spill
            continue
        fn = lambda: tk.paged_prefill(
            q,
            cache,
            out,
            query_start,
            seq_lens,
            tables,
            max_len,
            scale,  # noqa: E731
            block_m,
            block_n,
            num_warps,
            stages,
            heads,
        )
        try:
            us = graph_time_us(fn, reps=5, replays=10)
        except Exception as e:
            print(f"  skip h{heads} m{block_m} n{block_n} w{num_warps} s{stages}: {type(e).__name__}")
            continue
        rows.append(
            {
                "kernel": "triton",
                "heads": heads,
                "block_m": block_m,
                "block_n": block_n,
                "warps": num_warps,
                "stages": stages,
                "us": us,
            }
        )
    if flash_attn_varlen_func is not None:
        cu_k = query_start
        us = graph_time_us(
            lambda: flash_attn_varlen_func(
                q,
                cache[0],
                cache[1],
                cu_seqlens_q=query_start,
                cu_seqlens_k=cu_k,
                max_seqlen_q=max_len,
                max_seqlen_k=max_len,
                softmax_scale=scale,
                causal=True,
                block_table=tables,
            ),
            reps=5,
            replays=10,
        )
        rows.append({"kernel": "flash_attn", "us": us})
    rows += torch_prefill_rows(q, query_start, max_len, scale)
    rows.sort(key=lambda r: r["us"])
    for r in rows[:8] + [
        r
        for r in rows[8:]
        if r["kernel"] != "triton"
        or (r.get("block_m"), r.get("block_n"), r.get("warps"), r.get("stages")) in ((64, 64, 4, 2), (32, 32, 4, 2))
    ]:  # the default before item 55 and after
        name = (
            f"triton h{r['heads']} m{r['block_m']} n{r['block_n']} w{r['warps']} s{r['stages']}"
            if r["kernel"] == "triton"
            else r["kernel"]
        )
        print(f"  {name:<28} {r['us']:>8.1f} µs  {flops / r['us'] / 1e6:>6.0f} TFLOP/s")
    results["prefill"] = rows


def torch_prefill_rows(q, query_start, max_len, scale) -> list[dict]:
    """torch's own varlen attention kernels on the same chunk, with K/V contiguous as a fresh prompt's
    projection leaves them (no paged cache): its FlashAttention (GQA native) and cuDNN's. torch's
    varlen_attn refuses GQA with cuDNN, so cuDNN also gets K/V expanded to every query head (the
    expansion's copy timed in one row and not in the other)."""
    rows = []
    total = q.shape[0]
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, dtype=q.dtype, device=q.device)
    v = torch.randn_like(k)
    group = NUM_HEADS // NUM_KV_HEADS
    k_all, v_all = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def cudnn(keys, values):
        return torch.ops.aten._cudnn_attention_forward(
            q, keys, values, None, query_start, query_start, max_len, max_len, False, 0.0, True, False, scale=scale
        )

    candidates = {
        "cudnn (kv heads)": lambda: cudnn(k, v),
        "cudnn (expanded kv)": lambda: cudnn(k_all, v_all),
        "cudnn + expansion": lambda: cudnn(k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)),
        "torch flash varlen (gqa)": lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, query_start, query_start, max_len, max_len, 0.0, True, False, scale=scale
        ),
    }
    reference = candidates["torch flash varlen (gqa)"]()[0].float()
    for name, fn in candidates.items():
        try:
            err = (fn()[0].float() - reference).abs().max().item()
            # cuDNN's ragged path failed to capture in a graph (session 21), and a failed capture spoils the
            # ones after it: cuDNN runs first, timed eagerly between events
            us = event_time_us(fn) if name.startswith("cudnn") else graph_time_us(fn, reps=5, replays=10)
        except Exception as e:  # not every torch build or GPU has each kernel
            print(f"  skip {name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        print(f"  {name:<28} {us:>8.1f} µs (largest difference from torch's FlashAttention: {err:.3g})")
        rows.append({"kernel": name, "us": us, "err": err})
    return rows


def elementwise_bench(rates, results):
    from inferlab.plugins.models.layers import RotaryEmbedding, add_rms_norm, compiled, rms_norm_heads, silu_and_mul
    from inferlab.plugins.models.qk_norm_rope_kernel import qk_norm_rope
    from inferlab.plugins.models.rms_norm_kernel import add_rms_norm as add_norm_kernel
    from inferlab.plugins.models.silu_mul_kernel import silu_and_mul as silu_mul_kernel

    print("\n== elementwise (µs) ==")
    rotary = RotaryEmbedding(HEAD_DIM, 40960, 1e6, fused=True).cuda()
    norm_heads, add_norm, act = compiled(rms_norm_heads), compiled(add_rms_norm), compiled(silu_and_mul)
    qw = torch.ones(HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    hw = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    for m in (8, 64, 256, 16384):
        qkv = torch.randn(m, q_size + 2 * kv_size, dtype=torch.bfloat16, device="cuda")
        positions = torch.randint(0, 4000, (m,), device="cuda")

        def unfused():
            q = norm_heads(qkv[:, :q_size].view(-1, NUM_HEADS, HEAD_DIM), qw, 1e-6)
            k = norm_heads(qkv[:, q_size : q_size + kv_size].view(-1, NUM_KV_HEADS, HEAD_DIM), qw, 1e-6)
            return rotary(positions, q, k)

        timings = {
            "qk norm+rotary, torch.compile": graph_time_us(unfused),
            "qk norm+rotary, Triton kernel": graph_time_us(
                lambda: qk_norm_rope(qkv, positions, qw, qw, rotary.cos_sin, 1e-6, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
            ),
        }
        gate_up = torch.randn(m, 2 * INTER, dtype=torch.bfloat16, device="cuda")
        timings["silu*mul, torch.compile"] = graph_time_us(lambda: act(gate_up))
        timings["silu*mul, Triton kernel"] = graph_time_us(lambda: silu_mul_kernel(gate_up))
        x, residual = (
            torch.randn(m, HIDDEN, dtype=torch.bfloat16, device="cuda"),
            torch.randn(m, HIDDEN, dtype=torch.bfloat16, device="cuda"),
        )
        timings["add+rmsnorm, torch.compile"] = graph_time_us(lambda: add_norm(x, residual, hw, 1e-6))
        timings["add+rmsnorm, Triton kernel"] = graph_time_us(lambda: add_norm_kernel(x, residual, hw, 1e-6))
        print(f"  M={m}: " + "; ".join(f"{k} {v:.2f}" for k, v in timings.items()))
        results["elementwise"] += [{"m": m, "op": k, "us": v} for k, v in timings.items()]


def sampling_bench(rates, results):
    """The sampler's kernels over bf16 logits at decode batch sizes: as used, and over chunk and
    block sizes and warps; against torch's argmax over the same logits (a read of them and little
    else) and the logits' bytes over the bandwidth. (The Gumbel-max kernel they replaced is timed
    beside them in BENCHMARKS.md item 91.)"""
    from inferlab.plugins.samplers import sampling_kernel as sk

    print("\n== sampling over [batch, vocab] bf16 logits (µs) ==")
    for m in (256, 128, 32, 8):
        logits = torch.randn(m, VOCAB, dtype=torch.bfloat16, device="cuda")
        temperatures = torch.full((m,), 0.6, device="cuda")
        seeds = torch.randint(0, 2**31, (m,), device="cuda")
        steps = torch.randint(0, 1000, (m,), device="cuda")
        timings = {
            "as used": graph_time_us(lambda: sk.sample_tokens(logits, temperatures, seeds, steps)),
            "torch argmax": graph_time_us(lambda: logits.argmax(dim=-1)),
        }
        reference = sk.sample_tokens(logits, temperatures, seeds, steps)
        for chunk, block, chunk_warps, pick_warps in itertools.product(
            (2048, 4096, 8192), (1024, 2048), (4, 8), (4, 8)
        ):
            if block > chunk:
                continue
            num_chunks = triton.cdiv(VOCAB, chunk)
            chunk_max = torch.empty(m, num_chunks, dtype=torch.float32, device="cuda")
            chunk_mass = torch.empty_like(chunk_max)
            chunk_arg = torch.empty(m, num_chunks, dtype=torch.int32, device="cuda")
            tokens = torch.empty(m, dtype=torch.int64, device="cuda")

            def masses():
                sk._chunk_mass_kernel[(m, num_chunks)](
                    logits,
                    logits.stride(0),
                    temperatures,
                    chunk_max,
                    chunk_mass,
                    chunk_arg,
                    VOCAB,
                    CHUNK=chunk,
                    BLOCK=block,
                    PDL=False,
                    num_warps=chunk_warps,
                )

            def pick():
                sk._pick_token_kernel[(m,)](
                    logits,
                    logits.stride(0),
                    temperatures,
                    seeds,
                    steps,
                    chunk_max,
                    chunk_mass,
                    chunk_arg,
                    tokens,
                    VOCAB,
                    num_chunks,
                    CHUNKS_POW2=triton.next_power_of_2(num_chunks),
                    CHUNK=chunk,
                    PDL=False,
                    num_warps=pick_warps,
                )

            name = f"chunk {chunk} block {block} warps {chunk_warps}/{pick_warps}"
            timings[name] = graph_time_us(lambda: (masses(), pick()))
            timings[name + ": masses"] = graph_time_us(masses)
            timings[name + ": pick"] = graph_time_us(pick)
            timings[name + ": rows as used"] = float((tokens == reference).sum())
        floor = m * VOCAB * 2 / rates.bandwidth * 1e6
        ranked = sorted((k for k in timings if k.startswith("chunk") and ":" not in k), key=timings.get)
        print(
            f"  batch {m}: floor {floor:.1f}; as used {timings['as used']:.1f}; "
            f"torch argmax {timings['torch argmax']:.1f}; best: "
            + "; ".join(
                f"{k} {timings[k]:.1f} (masses {timings[k + ': masses']:.1f}, pick {timings[k + ': pick']:.1f}, "
                f"{timings[k + ': rows as used']:.0f} rows as used)"
                for k in ranked[:4]
            )
        )
        results["sampling"].append({"m": m, "floor_us": floor, **timings})


def decoder_stack(
    layers: int = 28,
    split_k_tokens: int | None = None,
    triton_gemm_tokens: int | None = None,
    attention_options: dict | None = None,
):
    """A stack of Qwen3-0.6B decoder layers (the qwen3 plugin's own modules, Triton kernels, triton
    backend with attention_options, distinct random weights per layer; split_k_tokens,
    triton_gemm_tokens None: the model's defaults) and
    chain(lens, first_seq): a function that runs the stack over one decode batch of those sequence
    lengths, whose K/V are blocks first_seq... of a shared paged cache."""
    from transformers import Qwen3Config

    from inferlab.core.batch import AttentionInputs
    from inferlab.core.parallel import SINGLE
    from inferlab.plugins.attention.triton_attention import TritonAttention
    from inferlab.plugins.models import rms_norm_kernel
    from inferlab.plugins.models.layers import RotaryEmbedding
    from inferlab.plugins.models.qk_norm_rope_kernel import qk_norm_rope
    from inferlab.plugins.models.qwen3 import ModelKernels, Qwen3DecoderLayer, Qwen3Options
    from inferlab.plugins.models.silu_mul_kernel import silu_and_mul

    if split_k_tokens is None:
        split_k_tokens = Qwen3Options.split_k_tokens
    if triton_gemm_tokens is None:
        triton_gemm_tokens = Qwen3Options.triton_gemm_tokens
    config = Qwen3Config(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
    )
    backend = TritonAttention(**(attention_options or {}))
    kernels = ModelKernels(qk_norm_rope, silu_and_mul, rms_norm_kernel.rms_norm, rms_norm_kernel.add_rms_norm)
    stack = torch.nn.ModuleList(
        Qwen3DecoderLayer(config, backend, SINGLE, True, kernels, split_k_tokens, triton_gemm_tokens)
        for _ in range(layers)
    ).to("cuda", torch.bfloat16)
    for param in stack.parameters():
        param.data.normal_(0, 0.02)
    rotary = RotaryEmbedding(HEAD_DIM, 8192, 1e6).cuda()
    max_blocks = 4096 // BLOCK_SIZE
    cache = torch.randn(2, 256 * max_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    caches = [cache] * layers  # one cache for all layers: each layer's K/V read is far larger than L2 anyway

    def inputs_for(lens, first_seq):
        batch = len(lens)
        tables = (
            (torch.arange(first_seq, first_seq + batch)[:, None] * max_blocks + torch.arange(max_blocks)[None, :])
            .to(torch.int32)
            .cuda()
        )
        seq_lens = lens.to(torch.int32).cuda()
        slots = tables[:, 0].long() * BLOCK_SIZE + seq_lens.long() - 1
        return AttentionInputs(
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
            seq_lens=seq_lens,
            context_lens=seq_lens - 1,
            block_tables=tables,
            slot_mapping=slots,
            max_query_len=1,
            max_seq_len=4096,
            is_decode=True,
            block_size=BLOCK_SIZE,
        )

    def chain(lens, first_seq=0):
        inputs = inputs_for(lens, first_seq)
        hidden = torch.randn(len(lens), HIDDEN, dtype=torch.bfloat16, device="cuda")
        positions = (inputs.seq_lens - 1).long()

        def run():
            metadata = backend.build_metadata(inputs)
            h, residual = hidden, None
            for layer, kv in zip(stack, caches):
                h, residual = layer(positions, h, residual, kv, rotary, metadata)
            return h

        return run

    return stack, chain


def stack_floor_us(lens, layers: int, bandwidth: float) -> float:
    """The decoder stack's floor over one decode batch: its K/V and its weights read once."""
    return (
        (
            int(lens.sum()) * NUM_KV_HEADS * HEAD_DIM * 4 * layers
            + layers
            * (HIDDEN * (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM + NUM_HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * INTER)
            * 2
        )
        / bandwidth
        * 1e6
    )


@triton.jit
def _read_span_kernel(x_ptr, out_ptr, span, BLOCK: tl.constexpr):
    """One program: the sum of one contiguous span of x (so nothing is written but one float)."""
    start = tl.program_id(0).to(tl.int64) * span
    acc = tl.zeros([BLOCK], tl.float32)
    for offset in range(0, span, BLOCK):
        acc += tl.load(x_ptr + start + offset + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _read_head_rows_kernel(cache_ptr, out_ptr, tokens, row_stride, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One program: one KV head's rows (HEAD_DIM values, row_stride apart) of `tokens` consecutive
    tokens, BLOCK_N at a time, as the decode kernel reads a sequence's K or V."""
    seq, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    base = cache_ptr + seq * tokens * row_stride + head * HEAD_DIM
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start in range(0, tokens, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        acc += tl.load(base + rows[:, None] * row_stride + tl.arange(0, HEAD_DIM)[None, :]).to(tl.float32)
    tl.store(out_ptr + seq * tl.num_programs(1) + head, tl.sum(tl.sum(acc, 1), 0))


def read_bandwidth_bench(rates, results):
    """GB/s of reads alone, against the copy the floor is measured with (bytes read + written)."""
    total = 4 << 30
    x = torch.randn(total // 2, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(total // 2 // 1024, dtype=torch.float32, device="cuda")
    rows = []

    def record(name, us, **config):
        gbps = total / us / 1e3
        rows.append({"pattern": name, "us": us, "GBps": gbps, **config})
        print(f"  {name:<42} {gbps:7.0f} GB/s ({100 * gbps * 1e9 / rates.bandwidth:5.1f}% of the floor's)", flush=True)

    print(f"\n== reading 4 GiB (the floor's copy: {rates.bandwidth / 1e9:.0f} GB/s) ==")
    y = torch.empty_like(x)
    record("torch copy (read + write, counted both)", graph_time_us(lambda: y.copy_(x), reps=3, replays=10) / 2)
    del y
    record("torch sum", graph_time_us(lambda: x.sum(dtype=torch.float32), reps=3, replays=10))
    for span_kib, block, warps, stages in itertools.product((64, 256, 1024), (2048, 8192), (4, 8), (1, 3)):
        span = span_kib * 1024 // 2
        fn = lambda: _read_span_kernel[(x.numel() // span,)](
            x,
            out,
            span,
            BLOCK=block,
            num_warps=warps,  # noqa: E731
            num_stages=stages,
        )
        record(
            f"spans of {span_kib} KiB, block {block}, w{warps} s{stages}",
            graph_time_us(fn, reps=3, replays=10),
            span_kib=span_kib,
            block=block,
            warps=warps,
            stages=stages,
        )
    row_stride = NUM_KV_HEADS * HEAD_DIM  # a paged cache's token row: every KV head's HEAD_DIM values
    for tokens, block_n, warps, stages in itertools.product((512, 2048), (64, 128), (4, 8), (2, 3, 4)):
        seqs = x.numel() // (tokens * row_stride)
        fn = lambda: _read_head_rows_kernel[(seqs, NUM_KV_HEADS)](
            x,
            out,
            tokens,
            row_stride,
            BLOCK_N=block_n,  # noqa: E731
            HEAD_DIM=HEAD_DIM,
            num_warps=warps,
            num_stages=stages,
        )
        record(
            f"head rows, {tokens} tokens, n{block_n} w{warps} s{stages}",
            graph_time_us(fn, reps=3, replays=10),
            tokens=tokens,
            block_n=block_n,
            warps=warps,
            stages=stages,
        )
    best = max(rows, key=lambda r: r["GBps"])
    print(f"best: {best['pattern']} at {best['GBps']:.0f} GB/s")
    results["read_bandwidth"] = rows


def overlap_bench(rates, results, layers: int = 28):
    """Would two micro-batches on two streams hide the small kernels behind each other's attention?
    decoder_stack's layers over one of the workload's decode batches, captured in a CUDA graph three
    ways: the whole batch on one stream (as now); its two halves one after the other on one stream;
    the two halves on two streams, joined at the end, so the GPU may run one half's GEMMs and norms
    while the other half's attention streams K/V."""
    _, chain = decoder_stack(layers)
    print(f"\n== two micro-batches on two streams, {layers} decoder layers (µs) ==")
    picked = {}
    for t, lens in workload_decode_batches(40):
        for size in (256, 192, 128, 64, 32):
            if size not in picked and len(lens) <= size and len(lens) >= size * 0.9:
                picked[size] = (t, lens)
    for size, (t, lens) in sorted(picked.items(), reverse=True):
        half = len(lens) // 2
        whole = chain(lens, 0)
        first, second = chain(lens[:half], 0), chain(lens[half:], half)
        side = torch.cuda.Stream()

        def two_streams():
            side.wait_stream(torch.cuda.current_stream())
            first()
            with torch.cuda.stream(side):
                second()
            torch.cuda.current_stream().wait_stream(side)

        timings = {
            "whole batch": graph_time_us(whole, reps=2, replays=7),
            "halves in turn": graph_time_us(lambda: (first(), second()), reps=2, replays=7),
            "halves on two streams": graph_time_us(two_streams, reps=2, replays=7),
        }
        floor_us = stack_floor_us(lens, layers, rates.bandwidth)
        print(
            f"  step {t:>4}, batch {len(lens):>3}: floor {floor_us:7.0f}; "
            + "; ".join(f"{k} {v:7.0f}" for k, v in timings.items())
        )
        results["overlap"].append({"step": t, "batch": len(lens), "floor_us": floor_us, **timings})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="attention,linear,linear_candidates,prefill,elementwise,overlap")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="attention: sweep only the split plan and order; prefill: whole-group programs, 2 stages",
    )
    parser.add_argument(
        "--warps",
        default="4,8",
        help="warps a program to sweep in attention (without --quick) and prefill, comma-separated",
    )
    parser.add_argument("--stages", default="2,3,4", help="attention (without --quick): pipeline stages to sweep")
    parser.add_argument("--tiles", default="64,128", help="attention (without --quick): keys a tile to sweep")
    args = parser.parse_args()
    ints = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
    rates = device_rates(torch.device("cuda"), torch.bfloat16)
    print(f"{rates.name}: bandwidth {rates.bandwidth / 1e9:.0f} GB/s, matmul {rates.matmul_rate / 1e12:.0f} TFLOP/s")
    results = {
        "attention": [],
        "linear": [],
        "linear_candidates": [],
        "prefill": [],
        "elementwise": [],
        "overlap": [],
        "sampling": [],
    }
    parts = {
        "attention": attention_bench,
        "linear": linear_bench,
        "linear_candidates": linear_candidates_bench,
        "wide_tiles": wide_tiles_bench,
        "prefill": prefill_bench,
        "elementwise": elementwise_bench,
        "overlap": overlap_bench,
        "sampling": sampling_bench,
        "read_bandwidth": read_bandwidth_bench,
        "cublaslt": cublaslt_bench,
    }
    with torch.inference_mode():
        for part in args.only.split(","):
            if part == "attention":
                attention_bench(
                    rates,
                    results,
                    quick=args.quick,
                    warps=ints(args.warps),
                    stages=ints(args.stages),
                    tiles=ints(args.tiles),
                )
            elif part == "prefill":
                prefill_bench(rates, results, quick=args.quick, warps=ints(args.warps))
            else:
                parts[part](rates, results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
