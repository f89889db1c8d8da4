"""Would a persistent decode kernel beat one kernel per projection at batch 1? A probe, not the model.

One token's four projections a layer (qkv, o, gate_up, down; Qwen3-0.6B or 8B shapes, distinct
weights for every layer so none is read from L2) run two ways, each captured in a CUDA graph:
- as the model runs them now: one GEMV kernel each (kernels/gemv.py, PDL, the plan's splits);
- as ONE persistent kernel (by default a program per multiprocessor), the projections separated by
  grid-wide barriers (an arrival count in global memory), each program reading its next weight rows
  before it waits at the barrier, so that the weights stream while the slowest program finishes.
It prints the time a layer each way, and what a barrier alone costs. Norms, rotary and attention
are left out of both (their kernels would add to the first, phases to the second). Variants are
separated by '/', each of ';'-separated programs=N, warps=N, poll=volatile|atomic, chunk=BYTES (the
weight a program reads at a time).

    python scripts/persistent_probe_gpu.py 0.6B "programs=132;warps=8/programs=264;warps=4;poll=atomic"

On an H200 (2026-12-03) the persistent kernel was the slower in every variant: 17.3-22.4 us a layer
against 13.5-13.9 with Qwen3-0.6B's shapes, 122.8-124.0 against 92.5 with Qwen3-8B's, a barrier
alone 0.95-2.67 us (BENCHMARKS.md, "One sequence").
"""

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_bandwidth_gpu import graph_us  # noqa: E402
from microbench_gpu import back_to_back_us  # noqa: E402

from inferlab.kernels import gemv  # noqa: E402

# hidden, intermediate, attention heads, KV heads, head_dim, layers
SHAPES = {"0.6B": (1024, 3072, 16, 8, 128, 28), "8B": (4096, 12288, 32, 8, 128, 36)}


@triton.jit
def _grid_sync(counter_ptr, target, POLL_ATOMIC: tl.constexpr):
    """Every program arrives (after all its threads' stores), then waits until target have."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    if POLL_ATOMIC:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    else:
        seen = tl.load(counter_ptr, volatile=True)
        while seen < target:
            seen = tl.load(counter_ptr, volatile=True)
        tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _rows_of(pid, nprog, chunk, N, CR: tl.constexpr):
    """Row indices of a program's chunk: the program takes rows pid, pid + nprog, ... (strided)."""
    j = chunk * CR + tl.arange(0, CR)
    rows = pid + j * nprog
    return rows, rows < N


@triton.jit
def _load_chunk(w_ptr, pid, nprog, chunk, N, K: tl.constexpr, KP: tl.constexpr, CR: tl.constexpr):
    rows, row_mask = _rows_of(pid, nprog, chunk, N, CR)
    cols = tl.arange(0, KP)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    return tl.load(ptrs, mask=row_mask[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def _input_row(x_ptr, K: tl.constexpr, KP: tl.constexpr, SILU: tl.constexpr):
    cols = tl.arange(0, KP)
    mask = cols < K
    if SILU:
        gate = tl.load(x_ptr + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        up = tl.load(x_ptr + K + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        return gate / (1.0 + tl.exp(-gate)) * up
    return tl.load(x_ptr + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _phase(
    x_ptr,
    w_ptr,
    out_ptr,
    w_first,
    pid,
    nprog,
    N,
    K: tl.constexpr,
    KP: tl.constexpr,
    CR: tl.constexpr,
    NCH: tl.constexpr,
    SILU: tl.constexpr,
):
    """out = row @ w.T for this program's rows; w_first (its first chunk) was read before the barrier.
    Each later chunk is requested before the one in hand is multiplied."""
    row = _input_row(x_ptr, K, KP, SILU)
    w = w_first
    for chunk in range(1, NCH):
        w_next = _load_chunk(w_ptr, pid, nprog, chunk, N, K, KP, CR)
        rows, row_mask = _rows_of(pid, nprog, chunk - 1, N, CR)
        tl.store(out_ptr + rows, tl.sum(w.to(tl.float32) * row[None, :], 1).to(out_ptr.dtype.element_ty), mask=row_mask)
        w = w_next
    rows, row_mask = _rows_of(pid, nprog, NCH - 1, N, CR)
    tl.store(out_ptr + rows, tl.sum(w.to(tl.float32) * row[None, :], 1).to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _projection(
    x_ptr,
    w_ptr,
    out_ptr,
    counter_ptr,
    arrived,
    wait,
    pid,
    nprog,
    N,
    K: tl.constexpr,
    KP: tl.constexpr,
    CR: tl.constexpr,
    NCH: tl.constexpr,
    SILU: tl.constexpr,
    POLL_ATOMIC: tl.constexpr,
):
    """One projection of the chain: its first weight chunk read, then (if wait) the barrier after the
    projection before, then _phase. Returns the arrival count the next barrier waits past."""
    w = _load_chunk(w_ptr, pid, nprog, 0, N, K, KP, CR)
    if wait:
        arrived += nprog
        _grid_sync(counter_ptr, arrived, POLL_ATOMIC)
    _phase(x_ptr, w_ptr, out_ptr, w, pid, nprog, N, K, KP, CR, NCH, SILU)
    return arrived


@triton.jit
def _chain_kernel(
    x_ptr,
    qkv_w,
    o_w,
    gu_w,
    down_w,
    qkv_buf,
    o_buf,
    gu_buf,
    counter_ptr,
    layers,
    H: tl.constexpr,
    HP: tl.constexpr,
    QKV_N: tl.constexpr,
    ATT: tl.constexpr,
    ATTP: tl.constexpr,
    INTER: tl.constexpr,
    INTERP: tl.constexpr,
    CR_QKV: tl.constexpr,
    NCH_QKV: tl.constexpr,
    CR_O: tl.constexpr,
    NCH_O: tl.constexpr,
    CR_GU: tl.constexpr,
    NCH_GU: tl.constexpr,
    CR_D: tl.constexpr,
    NCH_D: tl.constexpr,
    POLL_ATOMIC: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    arrived = 0
    for layer in range(layers):
        lq = qkv_w + layer.to(tl.int64) * (QKV_N * H)
        lo = o_w + layer.to(tl.int64) * (H * ATT)
        lg = gu_w + layer.to(tl.int64) * (2 * INTER * H)
        ld = down_w + layer.to(tl.int64) * (H * INTER)
        # the layer's input is the last layer's down_proj output: no barrier before the first
        arrived = _projection(
            x_ptr,
            lq,
            qkv_buf,
            counter_ptr,
            arrived,
            layer > 0,
            pid,
            nprog,
            QKV_N,
            H,
            HP,
            CR_QKV,
            NCH_QKV,
            False,
            POLL_ATOMIC,
        )
        arrived = _projection(
            qkv_buf, lo, o_buf, counter_ptr, arrived, True, pid, nprog, H, ATT, ATTP, CR_O, NCH_O, False, POLL_ATOMIC
        )
        arrived = _projection(
            o_buf,
            lg,
            gu_buf,
            counter_ptr,
            arrived,
            True,
            pid,
            nprog,
            2 * INTER,
            H,
            HP,
            CR_GU,
            NCH_GU,
            False,
            POLL_ATOMIC,
        )
        arrived = _projection(
            gu_buf, ld, x_ptr, counter_ptr, arrived, True, pid, nprog, H, INTER, INTERP, CR_D, NCH_D, True, POLL_ATOMIC
        )


@triton.jit
def _barriers_kernel(counter_ptr, rounds, POLL_ATOMIC: tl.constexpr):
    nprog = tl.num_programs(0)
    for r in range(rounds):
        _grid_sync(counter_ptr, (r + 1) * nprog, POLL_ATOMIC)


def chunking(n: int, k: int, programs: int, chunk_bytes: int) -> tuple[int, int]:
    """(rows a chunk, chunks) of a program's share of an [n, k] weight, a chunk near chunk_bytes."""
    share = -(-n // programs)
    cr = max(1, chunk_bytes // (2 * triton.next_power_of_2(k)))
    cr = min(triton.next_power_of_2(cr), triton.next_power_of_2(share))
    return cr, -(-share // cr)


def parse(variant: str) -> dict:
    settings = {"programs": None, "warps": 8, "poll": "volatile", "chunk": 32768}
    for item in filter(None, variant.split(";")):
        key, value = item.split("=")
        settings[key] = value if key == "poll" else int(value)
    return settings


def main(model: str, variants: list[str]) -> None:
    hidden, inter, heads, kv_heads, head_dim, layers = SHAPES[model]
    att, qkv_n = heads * head_dim, (heads + 2 * kv_heads) * head_dim
    dtype, device = torch.bfloat16, torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def weights(n, k):
        return torch.randn(layers, n, k, device=device, dtype=dtype) * (1 / k**0.5)

    qkv_w, o_w, gu_w, down_w = (
        weights(qkv_n, hidden),
        weights(hidden, att),
        weights(2 * inter, hidden),
        weights(hidden, inter),
    )
    total = sum(w.numel() * 2 for w in (qkv_w, o_w, gu_w, down_w))
    x0 = torch.randn(1, hidden, device=device, dtype=dtype)
    print(
        f"{model}: {layers} layers, {total / layers / 1e6:.1f} MB of weights a layer "
        f"({total / layers / 4.3e6:.2f} us at 4.3 TB/s); {sms} multiprocessors"
    )

    # The reference: the same chain in torch, rounding each projection's output as both forms do.
    def reference(x, n_layers):
        for layer in range(n_layers):
            qkv = (x.float() @ qkv_w[layer].float().T).to(dtype)
            o = (qkv[:, :att].float() @ o_w[layer].float().T).to(dtype)
            gu = (o.float() @ gu_w[layer].float().T).to(dtype)
            gate, up = gu[:, :inter].float(), gu[:, inter:].float()
            x = ((torch.nn.functional.silu(gate) * up) @ down_w[layer].float().T).to(dtype)
        return x

    # two layers: this random chain's activations vanish within a few more (SiLU(gate) * up squares them)
    want = reference(x0, 2).float()

    def error(got):
        return ((got.float() - want).norm() / want.norm()).item()

    # As the model runs them: one GEMV kernel a projection, the plan's splits.
    r_o, r_d = gemv.unsplit_rows(hidden, att), gemv.unsplit_rows(hidden, inter)
    s_o, s_d = gemv.splits_for(hidden, att, rows=r_o), gemv.splits_for(hidden, inter, rows=r_d)

    def kernels_chain(n_layers=layers):
        x = x0
        for layer in range(n_layers):
            qkv, _ = gemv.gemv(x, qkv_w[layer])
            o, _ = gemv.gemv(qkv[:, :att], o_w[layer], split=s_o, rows=r_o)
            gu, _ = gemv.gemv(o, gu_w[layer])
            x, _ = gemv.gemv(gu, down_w[layer], split=s_d, rows=r_d, silu_mul=True)
        return x.sum(0) if x.dim() == 3 else x

    err2 = error(kernels_chain(2))
    us = graph_us([kernels_chain])
    print(
        f"kernels (o split {s_o} rows {r_o}, down split {s_d} rows {r_d}): {us / layers:.2f} us a layer, "
        f"{total / us / 1e3:.0f} GB/s; error against torch {err2:.2e} (2 layers)"
    )

    def probe(variant):
        cfg = parse(variant)
        programs = cfg["programs"] or sms
        poll_atomic = cfg["poll"] == "atomic"
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        # barriers alone
        rounds = 1000

        def barriers():
            counter.zero_()
            _barriers_kernel[(programs,)](counter, rounds, POLL_ATOMIC=poll_atomic, num_warps=cfg["warps"])

        barrier_us = back_to_back_us(barriers, 5, warmup=2) / rounds
        x = torch.empty_like(x0)
        qkv_buf = torch.empty(1, qkv_n, device=device, dtype=dtype)
        o_buf = torch.empty(1, hidden, device=device, dtype=dtype)
        gu_buf = torch.empty(1, 2 * inter, device=device, dtype=dtype)
        cq, nq = chunking(qkv_n, hidden, programs, cfg["chunk"])
        co, no = chunking(hidden, att, programs, cfg["chunk"])
        cg, ng = chunking(2 * inter, hidden, programs, cfg["chunk"])
        cd, nd = chunking(hidden, inter, programs, cfg["chunk"])

        def persistent(n_layers=layers):
            x.copy_(x0)
            counter.zero_()
            _chain_kernel[(programs,)](
                x,
                qkv_w,
                o_w,
                gu_w,
                down_w,
                qkv_buf,
                o_buf,
                gu_buf,
                counter,
                n_layers,
                H=hidden,
                HP=triton.next_power_of_2(hidden),
                QKV_N=qkv_n,
                ATT=att,
                ATTP=triton.next_power_of_2(att),
                INTER=inter,
                INTERP=triton.next_power_of_2(inter),
                CR_QKV=cq,
                NCH_QKV=nq,
                CR_O=co,
                NCH_O=no,
                CR_GU=cg,
                NCH_GU=ng,
                CR_D=cd,
                NCH_D=nd,
                POLL_ATOMIC=poll_atomic,
                num_warps=cfg["warps"],
            )

        persistent(2)
        err2 = error(x)
        us = graph_us([persistent])
        print(
            f"persistent {variant or 'default'} ({programs} programs; chunks qkv {cq}x{nq}, o {co}x{no}, "
            f"gate_up {cg}x{ng}, down {cd}x{nd}): {us / layers:.2f} us a layer, {total / us / 1e3:.0f} GB/s; "
            f"a barrier alone {barrier_us:.2f} us; error against torch {err2:.2e} (2 layers)"
        )

    for variant in variants:
        probe(variant)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split("/") if len(sys.argv) > 2 else [""])
