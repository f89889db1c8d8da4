"""Why the fp8 KV cache does not make decode faster (BENCHMARKS.md item 82): decode attention over
bf16 and fp8 caches on batches like the bench's (256, 128 and 64 sequences, Qwen3-0.6B's heads,
blocks of 256), each timed from a CUDA graph against the K/V bytes' floor.

    python scripts/microbench_fp8_decode.py [--only engine,operands,swap_ab,v_transposed]

- engine: the triton backend's split decode kernel, as the engine runs it, over either cache.
- operands: a one-split copy of it whose K and V caches may differ in dtype, with the products in
  f16 instead of bf16, and with the fp8 tiles converted three ways: a cast after the load (0), a
  cast whose result passes through a where (1), or integer arithmetic on the bytes (2). Which
  operand's fp8 load costs, and whether Triton can be steered off it.
- swap_ab: the transposed products (scores^T = K q^T, out^T = V^T p^T), so the keys and dims are
  the dots' M side and Hopper's wgmma takes them.
- v_transposed: V stored transposed in each block ([block, Hkv, D, block_size]) so the P.V
  product's reduction (keys) runs along contiguous bytes, as FlashAttention 3 lays out fp8 V.
The variants are measurements, not engine code; each prints its error against the first run of
its batch (fp8 rounding is about 0.04)."""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from microbench_gpu import graph_time_us  # noqa: E402

from inferlab.floor import device_rates  # noqa: E402
from inferlab.plugins.attention import triton_kernels as tk  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 256
GROUP = NUM_HEADS // NUM_KV_HEADS
FP8 = torch.float8_e4m3fn
LOG2E = 1.4426950408889634


@triton.jit
def _e4m3_bits_to(b, dtype):
    """float8_e4m3fn bits -> dtype with integer arithmetic: the magnitude's 7 bits placed at
    float32's exponent and mantissa are the value times 2^-120 (subnormals too), so rescale."""
    b = b.to(tl.int32)
    magnitude = ((b & 0x7F) << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36
    return tl.where((b & 0x80) != 0, -magnitude, magnitude).to(dtype)


@triton.jit
def _load_tile(ptr, offsets, mask, dtype, MODE: tl.constexpr):
    if MODE == 0:
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(dtype)
    elif MODE == 1:
        return tl.where(mask, tl.load(ptr + offsets, mask=mask, other=0.0).to(dtype), 0.0)
    else:
        return _e4m3_bits_to(tl.load(ptr.to(tl.pointer_type(tl.uint8)) + offsets, mask=mask, other=0), dtype)


@triton.jit
def _program(
    seq_lens_ptr, tables_ptr, tables_stride, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """What a program serves: one KV head (its GROUP query heads, padded to BLOCK_H rows) of one
    sequence, with that sequence's length and block table."""
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    rows = tl.arange(0, BLOCK_H)
    table = tables_ptr + seq.to(tl.int64) * tables_stride
    return kv_head, seq, tl.load(seq_lens_ptr + seq), rows, kv_head * GROUP + rows, tl.arange(0, HEAD_DIM), table


@triton.jit
def _gathered_offsets(
    table,
    start,
    seq_len,
    kv_head,
    dims,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """The cache offsets of keys start..start+BLOCK_N of one KV head, each key's block looked up, as
    the engine's kernel does; and which of them the sequence has."""
    cols = start + tl.arange(0, BLOCK_N)
    col_mask = cols < seq_len
    blocks = tl.load(table + cols // BLOCK_SIZE, mask=col_mask, other=0).to(tl.int64)
    offsets = (
        (blocks * BLOCK_SIZE + cols % BLOCK_SIZE)[:, None] * (NUM_KV_HEADS * HEAD_DIM)
        + kv_head * HEAD_DIM
        + dims[None, :]
    )
    return offsets, col_mask


@triton.jit
def _softmax_step(scores, m_i, l_i, KEYS_AXIS: tl.constexpr):
    """One online-softmax step over a tile of scores whose keys run along KEYS_AXIS: the tile's
    probabilities, the factor that rescales what came before, and the new running max and sum."""
    m_new = tl.maximum(m_i, tl.max(scores, KEYS_AXIS))
    if KEYS_AXIS == 1:
        p = tl.exp2(scores - m_new[:, None])
    else:
        p = tl.exp2(scores - m_new[None, :])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, KEYS_AXIS)


@triton.jit
def operands_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    seq_lens_ptr,
    tables_ptr,
    scale_log2,
    tables_stride,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    F16: tl.constexpr,
    K_MODE: tl.constexpr,
    V_MODE: tl.constexpr,
):
    """One split of the engine's decode: one sequence, one KV head, all its keys."""
    kv_head, seq, seq_len, rows, heads, dims, table = _program(
        seq_lens_ptr, tables_ptr, tables_stride, GROUP, BLOCK_H, HEAD_DIM
    )
    q_offsets = seq * (NUM_KV_HEADS * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=(rows < GROUP)[:, None], other=0.0)
    dtype = tl.float16 if F16 else q.dtype
    q = q.to(dtype)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        offsets, col_mask = _gathered_offsets(
            table, start, seq_len, kv_head, dims, BLOCK_N, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM
        )
        k = _load_tile(k_ptr, offsets, col_mask[:, None], dtype, K_MODE)
        scores = tl.where(col_mask[None, :], tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i, 1)
        v = _load_tile(v_ptr, offsets, col_mask[:, None], dtype, V_MODE)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=(rows < GROUP)[:, None])


@triton.jit
def swap_ab_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    seq_lens_ptr,
    tables_ptr,
    scale_log2,
    tables_stride,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    F16: tl.constexpr,
):
    """operands_kernel with both products transposed: [keys, heads] scores, a [dims, heads] output."""
    kv_head, seq, seq_len, rows, heads, dims, table = _program(
        seq_lens_ptr, tables_ptr, tables_stride, GROUP, BLOCK_H, HEAD_DIM
    )
    q_offsets = seq * (NUM_KV_HEADS * GROUP * HEAD_DIM) + heads[None, :] * HEAD_DIM + dims[:, None]
    q_t = tl.load(q_ptr + q_offsets, mask=(rows < GROUP)[None, :], other=0.0)
    dtype = tl.float16 if F16 else q_t.dtype
    q_t = q_t.to(dtype)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_t = tl.zeros([HEAD_DIM, BLOCK_H], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        offsets, col_mask = _gathered_offsets(
            table, start, seq_len, kv_head, dims, BLOCK_N, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM
        )
        k = tl.load(k_ptr + offsets, mask=col_mask[:, None], other=0.0).to(dtype)
        scores_t = tl.where(col_mask[:, None], tl.dot(k, q_t) * scale_log2, float("-inf"))
        p_t, alpha, m_i, l_i = _softmax_step(scores_t, m_i, l_i, 0)
        v = tl.load(v_ptr + offsets, mask=col_mask[:, None], other=0.0).to(dtype)
        acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), p_t.to(dtype))
    out_t = acc_t / tl.where(l_i > 0, l_i, 1.0)[None, :]
    tl.store(out_ptr + q_offsets, out_t.to(out_ptr.dtype.element_ty), mask=(rows < GROUP)[None, :])


@triton.jit
def v_transposed_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    seq_lens_ptr,
    tables_ptr,
    scale_log2,
    tables_stride,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    V_T: tl.constexpr,
):
    """operands_kernel with each tile inside one cache block (BLOCK_SIZE % BLOCK_N == 0: one block
    id a tile, so the addresses are plainly contiguous). V_T: V is [block, Hkv, D, BLOCK_SIZE]."""
    kv_head, seq, seq_len, rows, heads, dims, table = _program(
        seq_lens_ptr, tables_ptr, tables_stride, GROUP, BLOCK_H, HEAD_DIM
    )
    keys = tl.arange(0, BLOCK_N)
    q_offsets = seq * (NUM_KV_HEADS * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=(rows < GROUP)[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        base = tl.load(table + start // BLOCK_SIZE).to(tl.int64) * (BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM)
        within = start % BLOCK_SIZE + keys
        col_mask = start + keys < seq_len
        row_offsets = base + within[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]
        k = tl.load(k_ptr + row_offsets, mask=col_mask[:, None], other=0.0).to(q.dtype)
        scores = tl.where(col_mask[None, :], tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i, 1)
        if V_T:
            v_t = tl.load(
                v_ptr + base + kv_head * (HEAD_DIM * BLOCK_SIZE) + dims[:, None] * BLOCK_SIZE + within[None, :],
                mask=col_mask[None, :],
                other=0.0,
            ).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), tl.trans(v_t))
        else:
            v = tl.load(v_ptr + row_offsets, mask=col_mask[:, None], other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=(rows < GROUP)[:, None])


# (K dtype, V dtype, f16 products, K conversion, V conversion)
OPERAND_CASES = [
    ("bf16", "bf16", False, 0, 0),
    ("fp8", "fp8", False, 0, 0),
    ("fp8", "bf16", False, 0, 0),
    ("bf16", "fp8", False, 0, 0),
    ("fp8", "fp8", True, 0, 0),
    ("fp8", "fp8", False, 1, 1),
    ("fp8", "fp8", True, 1, 1),
    ("fp8", "fp8", False, 2, 2),
    ("fp8", "fp8", False, 0, 1),
    ("fp8", "fp8", False, 2, 1),
    ("fp8", "bf16", False, 1, 0),
]
TILINGS = [(128, 4, 3), (64, 4, 3), (128, 8, 3), (64, 4, 4)]  # (block_n, warps, stages)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="engine,operands,swap_ab,v_transposed")
    parts = set(parser.parse_args().only.split(","))
    rates = device_rates(torch.device("cuda"))
    torch.manual_seed(0)
    for batch, context in ((256, 900), (128, 1400), (64, 1600)):
        max_blocks = 4096 // BLOCK_SIZE
        num_blocks = batch * max_blocks
        caches = {
            "bf16": torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        }
        caches["fp8"] = caches["bf16"].to(FP8)
        lens = torch.randint(context - 300, context + 300, (batch,), dtype=torch.int32, device="cuda")
        tables = (torch.arange(batch)[:, None] * max_blocks + torch.arange(max_blocks)[None, :]).to(torch.int32).cuda()
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(q)
        keys = int(lens.sum())

        def floor_us(k_dtype, v_dtype):
            return (
                keys
                * NUM_KV_HEADS
                * HEAD_DIM
                * sum(1 if d == "fp8" else 2 for d in (k_dtype, v_dtype))
                / rates.bandwidth
                * 1e6
            )

        reference = []

        def report(label, fn, k_dtype, v_dtype):
            try:
                us = graph_time_us(fn, reps=10, replays=7)
            except Exception as e:  # a variant Triton cannot compile
                print(f"  {label}: {type(e).__name__} {str(e)[:200]}")
                return
            fn()
            torch.cuda.synchronize()
            if not reference:
                reference.append(out.float().clone())
            error = ((out.float() - reference[0]).norm() / reference[0].norm()).item()
            print(
                f"  {label}: {us:7.1f} µs ({100 * floor_us(k_dtype, v_dtype) / us:3.0f}% of its floor), error {error:.4f}"
            )

        print(
            f"\n== batch {batch}, {keys} keys: K/V floor bf16 {floor_us('bf16', 'bf16'):.1f} µs, "
            f"fp8 {floor_us('fp8', 'fp8'):.1f} µs =="
        )
        scale = HEAD_DIM**-0.5
        common = dict(
            GROUP=GROUP, BLOCK_H=tk.MIN_DOT_ROWS, HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, NUM_KV_HEADS=NUM_KV_HEADS
        )
        args = lambda k, v: (q, k, v, out, lens, tables, scale * LOG2E, tables.stride(0))  # noqa: E731
        grid = (NUM_KV_HEADS, batch)
        if "engine" in parts:
            order = tk.longest_first(lens)
            for name in ("bf16", "fp8"):
                for block_n, warps, stages in TILINGS[:2]:
                    splits = tk.decode_splits(q, NUM_KV_HEADS, 4096, 256, 8)
                    partial_out = torch.empty(batch, NUM_HEADS, splits, HEAD_DIM, dtype=torch.float32, device="cuda")
                    partial_lse = torch.empty(batch, NUM_HEADS, splits, dtype=torch.float32, device="cuda")
                    fn = lambda: tk.paged_decode(
                        q,
                        caches[name],
                        out,
                        lens,
                        tables,
                        scale,
                        splits,
                        block_n,  # noqa: E731
                        partial_out,
                        partial_lse,
                        256,
                        warps,
                        stages,
                        order,
                    )
                    report(
                        f"engine {name:<4} block_n {block_n:>3} warps {warps} stages {stages} splits {splits}",
                        fn,
                        name,
                        name,
                    )
        if "operands" in parts:
            for k_dtype, v_dtype, f16, k_mode, v_mode in OPERAND_CASES:
                k, v = caches[k_dtype][0], caches[v_dtype][1]
                for block_n, warps, stages in TILINGS:
                    fn = lambda: operands_kernel[grid](
                        *args(k, v),
                        **common,
                        BLOCK_N=block_n,
                        F16=f16,
                        K_MODE=k_mode,  # noqa: E731
                        V_MODE=v_mode,
                        num_warps=warps,
                        num_stages=stages,
                    )
                    report(
                        f"operands K {k_dtype:<4} V {v_dtype:<4}{' f16' if f16 else '    '} conversions K{k_mode} "
                        f"V{v_mode} block_n {block_n:>3} warps {warps} stages {stages}",
                        fn,
                        k_dtype,
                        v_dtype,
                    )
        if "swap_ab" in parts:
            for k_dtype, v_dtype, f16 in (
                ("bf16", "bf16", False),
                ("fp8", "fp8", False),
                ("fp8", "fp8", True),
                ("bf16", "fp8", False),
            ):
                k, v = caches[k_dtype][0], caches[v_dtype][1]
                for block_n, warps, stages in TILINGS:
                    fn = lambda: swap_ab_kernel[grid](
                        *args(k, v),
                        **common,
                        BLOCK_N=block_n,
                        F16=f16,  # noqa: E731
                        num_warps=warps,
                        num_stages=stages,
                    )
                    report(
                        f"swap_ab  K {k_dtype:<4} V {v_dtype:<4}{' f16' if f16 else '    '} block_n {block_n:>3} "
                        f"warps {warps} stages {stages}",
                        fn,
                        k_dtype,
                        v_dtype,
                    )
        if "v_transposed" in parts:
            for name, v_t in (("bf16", False), ("bf16", True), ("fp8", False), ("fp8", True)):
                k, v = caches[name][0], caches[name][1]
                if v_t:  # the same values, transposed in each block and head
                    v = v.view(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).permute(0, 2, 3, 1).contiguous()
                for block_n, warps, stages in TILINGS:
                    fn = lambda: v_transposed_kernel[grid](
                        *args(k, v),
                        **common,
                        BLOCK_N=block_n,
                        V_T=v_t,  # noqa: E731
                        num_warps=warps,
                        num_stages=stages,
                    )
                    report(
                        f"v_transposed {name:<4}{' V^T' if v_t else '    '} block_n {block_n:>3} warps {warps} "
                        f"stages {stages}",
                        fn,
                        name,
                        name,
                    )


if __name__ == "__main__":
    main()
