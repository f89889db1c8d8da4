"""The triton attention backend's kernels over the paged KV cache: a causal varlen prefill that
reads the cached prefix through the block tables and a split-context decode (the K/V store they
read from is inferlab.kernels.kv_store).

Cache layout (one layer): [2, num_blocks, block_size, num_kv_heads, head_dim], K then V, in the
model's dtype or float8_e4m3fn (inferlab.core.kv_cache_dtype; read back in q's dtype). Token j of
a sequence lives in slot block_table[j // block_size] * block_size + j % block_size. The kernels
gather block ids per token, so any power-of-two block size works with any tile size.

Triton decides at import whether kernels are compiled or interpreted (TRITON_INTERPRET=1, the only
way they run on CPU), so this module is imported only when the triton backend is built.
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from inferlab.kernels import pdl
from inferlab.kernels.kv_store import cache_value
from inferlab.kernels.pdl import INTERPRETED  # noqa: F401  (the backend and tests read it here)
from inferlab.kernels.qk_norm_rope import norm_rotate

# Query heads one decode program handles are padded to this: tl.dot needs at least 16 rows.
MIN_DOT_ROWS = 16

# Integer arguments that change from step to step are not specialized on (== 1, divisible by 16):
# otherwise each new combination would compile a kernel variant in the middle of a run.
PREFILL_RUNTIME_INTS = ["block_tables_stride", "num_seqs"]
DECODE_RUNTIME_INTS = [
    "num_splits",
    "min_split_len",
    "block_tables_stride",
    "partial_stride_seq",
    "partial_stride_head",
    "partial_stride_split",
    "lse_stride_seq",
    "lse_stride_head",
]
REDUCE_RUNTIME_INTS = [
    "partial_stride_seq",
    "partial_stride_head",
    "lse_stride_seq",
    "lse_stride_head",
    "num_splits",
    "min_split_len",
]
# The split partials the reduction reads at a time
REDUCE_CHUNK = 16
# Nor is the 16-byte alignment of the step's metadata: these are slices of one buffer per step
# (ModelRunner.upload), whose offsets, and so alignments, follow the batch's size.
PREFILL_RUNTIME_POINTERS = ["query_start_ptr", "seq_lens_ptr", "block_tables_ptr"]
DECODE_RUNTIME_POINTERS = ["seq_lens_ptr", "block_tables_ptr", "seq_order_ptr", "positions_ptr", "slot_mapping_ptr"]


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    cols,
    end,
    query_pos,
    k_cache_ptr,
    v_cache_ptr,
    block_table,
    kv_head,
    cache_stride_slot,
    cache_stride_head,
    scale_log2,
    dims,
    BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """One step of online softmax, shared by prefill and decode: the keys `cols` (those < end) of one
    KV head, gathered through the block table, against the rows of q [rows, D]; returns the
    updated (acc, running max m_i, running sum l_i). CAUSAL: row r sees keys <= query_pos[r].
    MASKED=False: the caller knows every row sees every column (all < end, none past a row's
    position), so no mask is computed or applied."""
    if MASKED:
        col_mask = cols < end
        block_ids = tl.load(block_table + cols // BLOCK_SIZE, mask=col_mask, other=0)
    else:
        block_ids = tl.load(block_table + cols // BLOCK_SIZE)
    slots = block_ids.to(tl.int64) * BLOCK_SIZE + cols % BLOCK_SIZE
    kv_offsets = slots[:, None] * cache_stride_slot + kv_head * cache_stride_head + dims[None, :]
    # an fp8 cache is read back in q's dtype (a no-op for a cache of q's dtype)
    if MASKED:
        k = tl.load(k_cache_ptr + kv_offsets, mask=col_mask[:, None], other=0.0).to(q.dtype)
    else:
        k = tl.load(k_cache_ptr + kv_offsets).to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if MASKED:
        if CAUSAL:
            visible = (cols[None, :] <= query_pos[:, None]) & col_mask[None, :]
        else:
            visible = col_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_cache_ptr + kv_offsets, mask=col_mask[:, None], other=0.0).to(q.dtype)
    else:
        v = tl.load(v_cache_ptr + kv_offsets).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=PREFILL_RUNTIME_INTS, do_not_specialize_on_alignment=PREFILL_RUNTIME_POINTERS)
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    q_stride_token,
    q_stride_head,
    out_stride_token,
    out_stride_head,
    cache_stride_slot,
    cache_stride_head,
    block_tables_stride,
    num_seqs,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    FLAT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: BLOCK_M new tokens of one sequence for HEADS query heads of one KV head (1, or
    all GROUP of them, which then share each K/V tile), over all keys up to the tile's causal bound
    (cached context + new tokens), read through the block table. Its rows are head-major: the
    first BLOCK_M are the first head's tokens.

    The grid is (sequences, tiles of the longest, head groups), or with FLAT (1, slots, head
    groups), a grid that does not depend on the batch's contents (for CUDA graphs): sequence s
    owns the slots from query_start[s] // BLOCK_M + s up to the next sequence's first, at least
    as many as it has tiles, and each program finds its sequence by binary search."""
    pdl.wait_for_inputs(PDL)
    if FLAT:
        slot = tl.program_id(1)
        seq = tl.full([], 0, tl.int32)
        high = num_seqs - 1
        while seq < high:  # the last sequence whose first slot is at or before this one
            mid = (seq + high + 1) // 2
            if tl.load(query_start_ptr + mid) // BLOCK_M + mid <= slot:
                seq = mid
            else:
                high = mid - 1
        query_start = tl.load(query_start_ptr + seq)
        query_len = tl.load(query_start_ptr + seq + 1) - query_start
        # the sequence's tiles take its last slots, the latest tile first (see below)
        tile = (query_start + query_len) // BLOCK_M + seq - slot
    else:
        seq = tl.program_id(0)
        # The GPU starts programs in grid order; a sequence's later tiles attend to more keys, so
        # they go first and the short ones fill the last wave.
        tile = tl.num_programs(1) - 1 - tl.program_id(1)
        query_start = tl.load(query_start_ptr + seq)
        query_len = tl.load(query_start_ptr + seq + 1) - query_start
    first_head = tl.program_id(2) * HEADS
    if tile < 0 or tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    kv_head = first_head // GROUP

    program_rows = tl.arange(0, BLOCK_M * HEADS)
    rows = tile * BLOCK_M + program_rows % BLOCK_M  # each row's token among the sequence's new ones
    heads = first_head + program_rows // BLOCK_M
    row_mask = rows < query_len
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + (query_start + rows)[:, None] * q_stride_token + heads[:, None] * q_stride_head + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    query_pos = context_len + rows  # absolute position of each row; it sees keys 0..query_pos

    m_i = tl.full([BLOCK_M * HEADS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * HEADS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * HEADS, HEAD_DIM], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    # Keys before the tile's first token are visible to all of its rows: whole key tiles of them
    # need no mask. Key 0 is in the first tile and visible to every row, so the running max is
    # finite after it.
    unmasked_end = (context_len + tile * BLOCK_M) // BLOCK_N * BLOCK_N
    for start in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            start + tl.arange(0, BLOCK_N),
            kv_end,
            query_pos,
            k_cache_ptr,
            v_cache_ptr,
            block_table,
            kv_head,
            cache_stride_slot,
            cache_stride_head,
            scale_log2,
            dims,
            BLOCK_SIZE,
            PRECISION,
            CAUSAL=True,
            MASKED=False,
        )
    for start in range(unmasked_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            start + tl.arange(0, BLOCK_N),
            kv_end,
            query_pos,
            k_cache_ptr,
            v_cache_ptr,
            block_table,
            kv_head,
            cache_stride_slot,
            cache_stride_head,
            scale_log2,
            dims,
            BLOCK_SIZE,
            PRECISION,
            CAUSAL=True,
        )
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (query_start + rows)[:, None] * out_stride_token + heads[:, None] * out_stride_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


@triton.jit
def _attend_new_key(q, acc, m_i, l_i, k, v, scale_log2):
    """_attend_tile's step for a single key held in registers, the new token's: k and its value v
    [1, D] as the cache holds them, read back in q's dtype; rounded as a tile's step rounds (p in
    q's dtype)."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    scores = tl.sum(q.to(tl.float32) * k.to(tl.float32), 1) * scale_log2
    m_new = tl.maximum(m_i, scores)
    p = tl.exp2(scores - m_new)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)
    return acc, m_new, l_i


@triton.jit
def _split_len(seq_len, num_splits, min_split_len, BLOCK_N: tl.constexpr):
    """How many of a sequence's keys each of its num_splits parts takes: an even share in whole
    tiles, at least min_split_len. The split kernel and the reduction must agree on it."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, min_split_len)


@triton.jit(do_not_specialize=DECODE_RUNTIME_INTS, do_not_specialize_on_alignment=DECODE_RUNTIME_POINTERS)
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    seq_order_ptr,
    positions_ptr,
    slot_mapping_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    scale_log2,
    num_splits,
    min_split_len,
    q_stride_token,
    q_stride_head,
    out_stride_token,
    out_stride_head,
    cache_stride_slot,
    cache_stride_head,
    block_tables_stride,
    partial_stride_seq,
    partial_stride_head,
    partial_stride_split,
    lse_stride_seq,
    lse_stride_head,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    ORDERED: tl.constexpr,
    FROM_QKV: tl.constexpr,
    QK_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: one sequence's single new token, all GROUP query heads sharing one KV head
    (so each K/V tile is read once for them), over one of num_splits equal parts of that sequence's
    keys (at least min_split_len of them, so short sequences use fewer splits). Splitting each
    sequence by its own length keeps the programs' work even in a batch of mixed lengths. With
    SINGLE_SPLIT it writes the final output, else a normalized partial and its log2-sum-exp.

    FROM_QKV: q_ptr is the QKV projection's output, [B, (H + 2 * Hkv), D] as rows of heads. Each
    program normalizes (QK_NORM) and rotates its q heads; the program whose part holds the new
    token's position also rotates its k, stores k and v into the cache slot and attends to them
    from registers, while the cached keys before it are read from the cache. So the q/k kernel and
    the K/V store need no kernels of their own. What the step's inputs and the weights give (the
    sequence's length, position and slot, its rotary angles, the norms' weights) is read before
    the PDL wait, since the kernel before (the QKV projection) writes none of it; with ORDERED,
    after it, since seq_order may be that kernel's output.

    The grid is (KV heads x splits, sequences), so the GPU starts all of a sequence's programs
    together (they read neighbouring bytes of the same cache rows), sequence after sequence; with
    ORDERED the sequences go in seq_order's order. Longest first leaves short programs for the
    last wave, so the multiprocessors finish together instead of waiting on one long sequence."""
    kv_head = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    if ORDERED:
        pdl.wait_for_inputs(PDL)
        seq = tl.load(seq_order_ptr + tl.program_id(1))
    else:
        seq = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)  # 0 for padding rows: they attend to nothing and output 0
    split_len = _split_len(seq_len, num_splits, min_split_len, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    # A graph's plan has splits enough for max_model_len, so a short sequence leaves most programs
    # no keys: they write nothing (the reduction reads only the parts that hold keys); the first
    # still writes a padding row's zeros.
    if (split > 0) & (start >= seq_len):
        return

    head_offsets = tl.arange(0, BLOCK_H)
    head_mask = head_offsets < GROUP
    heads = kv_head * GROUP + head_offsets
    dims = tl.arange(0, HEAD_DIM)
    q_row = q_ptr + seq * q_stride_token
    if FROM_QKV:
        # Whole rows through norm_rotate's halves form: each head vector with its halves swapped
        # as the "second half" (the sine negated past the middle, the norm's squares counted
        # twice), so q stays one [heads, D] tile for tl.dot; its other result goes unused.
        half = HEAD_DIM // 2
        swapped = (dims + half) % HEAD_DIM
        angles = cos_sin_ptr + tl.load(positions_ptr + seq) * HEAD_DIM
        cos = tl.load(angles + dims % half)[None, :]
        sin = tl.load(angles + half + dims % half)
        sin = tl.where(dims < half, sin, -sin)[None, :]
        if QK_NORM:
            q_weight, q_weight_swapped = tl.load(q_norm_ptr + dims)[None, :], tl.load(q_norm_ptr + swapped)[None, :]
            k_weight, k_weight_swapped = tl.load(k_norm_ptr + dims)[None, :], tl.load(k_norm_ptr + swapped)[None, :]
        else:  # unread
            q_weight = cos
            q_weight_swapped = cos
            k_weight = cos
            k_weight_swapped = cos
        # -1 is a padding row's slot (as a vector: a scalar mask, or a scalar & a vector, trips
        # Triton's interpreter)
        slot = tl.load(slot_mapping_ptr + seq + dims * 0)[None, :]
        holds_new_token = (start < end) & (end == seq_len)
        store_kv = tl.where(holds_new_token, slot >= 0, False)
        cached_end = tl.minimum(end, seq_len - 1)  # the new token's K/V are not in the cache yet
    else:
        cached_end = end
    if not ORDERED:
        pdl.wait_for_inputs(PDL)
    q_rows = q_row + heads[:, None] * q_stride_head
    q = tl.load(q_rows + dims[None, :], mask=head_mask[:, None], other=0.0)
    if FROM_QKV:
        k_row = q_row + (GROUP * NUM_KV_HEADS + kv_head) * q_stride_head
        q_swapped = tl.load(q_rows + swapped[None, :], mask=head_mask[:, None], other=0.0)
        k_new, k_swapped = tl.load(k_row + dims)[None, :], tl.load(k_row + swapped)[None, :]
        v_new = cache_value(tl.load(k_row + NUM_KV_HEADS * q_stride_head + dims)[None, :], v_cache_ptr)
        q, _ = norm_rotate(q, q_swapped, q_weight, q_weight_swapped, cos, sin, eps, QK_NORM, 2 * HEAD_DIM)
        k_new, _ = norm_rotate(k_new, k_swapped, k_weight, k_weight_swapped, cos, sin, eps, QK_NORM, 2 * HEAD_DIM)
        k_new = cache_value(k_new, k_cache_ptr)
        kv_offsets = slot * cache_stride_slot + kv_head * cache_stride_head + dims[None, :]
        tl.store(k_cache_ptr + kv_offsets, k_new, mask=store_kv)
        tl.store(v_cache_ptr + kv_offsets, v_new, mask=store_kv)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    # The first column of each tile is < cached_end, so the running max is finite after it.
    for tile_start in range(start, cached_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            tile_start + tl.arange(0, BLOCK_N),
            cached_end,
            0,
            k_cache_ptr,
            v_cache_ptr,
            block_table,
            kv_head,
            cache_stride_slot,
            cache_stride_head,
            scale_log2,
            dims,
            BLOCK_SIZE,
            PRECISION,
            CAUSAL=False,
        )
    if FROM_QKV:
        if holds_new_token:
            acc, m_i, l_i = _attend_new_key(q, acc, m_i, l_i, k_new, v_new, scale_log2)
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SINGLE_SPLIT:
        tl.store(
            out_ptr + seq * out_stride_token + heads[:, None] * out_stride_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None],
        )
    else:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        partial = seq * partial_stride_seq + heads * partial_stride_head + split * partial_stride_split
        tl.store(partial_out_ptr + partial[:, None] + dims[None, :], out, mask=head_mask[:, None])
        tl.store(partial_lse_ptr + seq * lse_stride_seq + heads * lse_stride_head + split, lse, mask=head_mask)


@triton.jit(do_not_specialize=REDUCE_RUNTIME_INTS, do_not_specialize_on_alignment=["seq_lens_ptr"])
def _decode_reduce_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    seq_lens_ptr,
    out_stride_token,
    out_stride_head,
    partial_stride_seq,
    partial_stride_head,
    partial_stride_split,
    lse_stride_seq,
    lse_stride_head,
    num_splits,
    min_split_len,
    SPLITS_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Combines one (sequence, head)'s split partials, weighting each by its share of the softmax.
    Only the parts that hold keys are read (at least the first), as the split kernel's programs
    of the others wrote nothing: with the weights in one load where the plan has at most CHUNK
    parts, else after the weights CHUNK at a time."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)  # a step input, not the split kernel's output
    split_len = _split_len(seq_len, num_splits, min_split_len, BLOCK_N)
    used = tl.maximum(tl.cdiv(seq_len, tl.maximum(split_len, 1)), 1)  # 0 keys (padding) leave split_len 0
    pdl.wait_for_inputs(PDL)
    lse_row = partial_lse_ptr + seq * lse_stride_seq + head * lse_stride_head
    partial = partial_out_ptr + seq * partial_stride_seq + head * partial_stride_head
    dims = tl.arange(0, HEAD_DIM)
    # Each branch loads and sums the weights itself: hoisted above the branch, ahead of the parts'
    # load, they made the split decode of mid-sized batches slower (BENCHMARKS.md, tried and not taken).
    if SPLITS_POW2 <= CHUNK:  # the weights and the parts in one round trip
        splits = tl.arange(0, SPLITS_POW2)
        mask = splits < used
        lse = tl.load(lse_row + splits, mask=mask, other=float("-inf"))
        parts = tl.load(partial + splits[:, None] * partial_stride_split + dims[None, :], mask=mask[:, None], other=0.0)
        lse_max = tl.max(lse, 0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no keys at all (a padding row)
        weights = tl.exp2(lse - lse_max)
        total = tl.sum(weights, 0)
        acc = tl.sum(parts * weights[:, None], 0)
    else:  # the weights first, then the parts CHUNK at a time, which bounds the registers
        splits = tl.arange(0, SPLITS_POW2)
        lse = tl.load(lse_row + splits, mask=splits < used, other=float("-inf"))
        lse_max = tl.max(lse, 0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        total = tl.sum(tl.exp2(lse - lse_max), 0)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for first in range(0, used, CHUNK):
            chunk = first + tl.arange(0, CHUNK)
            mask = chunk < used
            weights = tl.exp2(tl.load(lse_row + chunk, mask=mask, other=float("-inf")) - lse_max)
            parts = tl.load(
                partial + chunk[:, None] * partial_stride_split + dims[None, :], mask=mask[:, None], other=0.0
            )
            acc += tl.sum(parts * weights[:, None], 0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * out_stride_token + head * out_stride_head + dims, out.to(out_ptr.dtype.element_ty))


LOG2E = 1.4426950408889634
# The most query rows (tokens x heads) one prefill program holds: its float32 accumulator is
# rows x head_dim, and beyond 128 x 128 it no longer fits four warps' registers.
MAX_PREFILL_ROWS = 128


def _precision(dtype: torch.dtype) -> str:
    # float32 caches (CPU tests, fp32 runs) get exact products; bf16/fp16 ignore the setting
    return "ieee" if dtype == torch.float32 else "tf32"


def prefill_heads_per_program(group: int, block_m: int) -> int:
    """The whole group of query heads a KV head serves where its size is a power of two and its rows
    (block_m per head) fit MAX_PREFILL_ROWS; else 1."""
    return group if group & (group - 1) == 0 and block_m * group <= MAX_PREFILL_ROWS else 1


def paged_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    block_m: int,
    block_n: int,
    num_warps: int = 4,
    num_stages: int = 2,
    heads_per_program: int | None = None,
    flat: bool = False,
) -> torch.Tensor:
    """Causal varlen attention of q [T, H, D] (each sequence's new tokens) over its cached context
    plus those tokens (already stored), into out [T, H, D]. Each program takes block_m tokens of
    heads_per_program query heads sharing a KV head: 1, or the whole group, which reads each K/V
    tile once for all of them (default: prefill_heads_per_program). flat: the grid follows q's and
    seq_lens' sizes only, never max_query_len or the contents (a CUDA graph replays it for any
    batch that fits; sequences past the batch have no new tokens)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if heads_per_program is None:
        heads_per_program = prefill_heads_per_program(group, block_m)
    if heads_per_program not in (1, group) or heads_per_program & (heads_per_program - 1):
        raise ValueError(
            f"heads_per_program must be 1 or the group size {group} (a power of two), got {heads_per_program}"
        )
    num_seqs = seq_lens.shape[0]
    if flat:  # every sequence's slots: at least its tiles, one more where its start is unaligned
        grid = (1, triton.cdiv(q.shape[0], block_m) + num_seqs, num_heads // heads_per_program)
    else:
        grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads // heads_per_program)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_seqs,
        GROUP=group,
        HEADS=heads_per_program,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=_precision(q.dtype),
        FLAT=flat,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch_options(q.device),
    )
    return out


@functools.cache
def _num_multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(
    q: torch.Tensor, num_kv_heads: int, max_seq_len: int, min_split_len: int, programs_per_sm: int
) -> int:
    """How many parts each sequence's keys are split into: enough (sequence, KV head, split)
    programs for programs_per_sm on every multiprocessor, but no more than the longest sequence
    has parts of min_split_len keys."""
    num_seqs = q.shape[0]
    if q.device.type == "cuda":
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        target_programs = programs_per_sm * _num_multiprocessors(index)
    else:
        target_programs = 4  # the interpreter: a few splits, so the tests exercise the reduction
    wanted = -(-target_programs // max(1, num_seqs * num_kv_heads))
    most = -(-max(1, max_seq_len) // min_split_len)
    return max(1, min(wanted, most))


class NewTokens(NamedTuple):
    """What paged_decode needs to start from the QKV projection's output: each sequence's new
    token's position and cache slot (int64; -1 stores nothing), the rotary's table (float32
    [positions, D], each row D / 2 cosines then the sines) and the per-head q/k RMSNorm as
    (q_weight [D], k_weight [D], eps), or None for the rotary alone."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin: torch.Tensor
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
    min_split_len: int = 0,
    num_warps: int = 4,
    num_stages: int = 2,
    seq_order: torch.Tensor | None = None,
    new_tokens: NewTokens | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence, q [B, H, D], over its seq_lens[b] cached keys
    (its own included), into out [B, H, D]. Each sequence's keys are split in num_splits parts of
    at least min_split_len (flash-decoding) when num_splits > 1, which needs scratch
    partial_out [B, H, splits, D] and partial_lse [B, H, splits] (float32). seq_order, a
    permutation of 0..B-1 (int32, e.g. longest_first(seq_lens)), is the order the GPU starts the
    sequences in; it changes only the timing. With new_tokens, q is the QKV projection's output
    viewed as [B, H + 2 * Hkv, D], and the kernel normalizes and rotates q and the new k and
    stores the new k and v into the cache itself, in place of the q/k kernel and the K/V store
    (see NewTokens)."""
    num_seqs, num_heads, head_dim = out.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    single = num_splits == 1
    if single:  # unused by the kernel; any float32 tensor serves as the pointer
        partial_out = partial_lse = out
    ordered = seq_order is not None
    if new_tokens is not None:
        expected = (num_seqs, num_heads + 2 * num_kv_heads, head_dim)
        if tuple(q.shape) != expected or q.stride(2) != 1:
            raise ValueError(f"with new_tokens q must be the QKV rows {expected}, got {tuple(q.shape)}")
        positions, slot_mapping, cos_sin, qk_norm = new_tokens
        q_weight, k_weight, eps = qk_norm or (cos_sin, cos_sin, 0.0)  # unread without the norm
    else:  # unused by the kernel: any tensors of their types serve as the pointers
        positions = slot_mapping = seq_lens
        cos_sin = q_weight = k_weight = out
        eps, qk_norm = 0.0, None
    _decode_split_kernel[(num_kv_heads * num_splits, num_seqs)](
        q,
        k_cache,
        v_cache,
        out,
        partial_out,
        partial_lse,
        seq_lens,
        block_tables,
        seq_order if ordered else seq_lens,  # unused unless ORDERED: any int tensor serves
        positions,
        slot_mapping,
        cos_sin,
        q_weight,
        k_weight,
        eps,
        scale * LOG2E,
        num_splits,
        min_split_len,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        0 if single else partial_out.stride(0),
        0 if single else partial_out.stride(1),
        0 if single else partial_out.stride(2),
        0 if single else partial_lse.stride(0),
        0 if single else partial_lse.stride(1),
        GROUP=group,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        PRECISION=_precision(q.dtype),
        SINGLE_SPLIT=single,
        ORDERED=ordered,
        FROM_QKV=new_tokens is not None,
        QK_NORM=qk_norm is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch_options(q.device),
    )
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            partial_lse,
            seq_lens,
            out.stride(0),
            out.stride(1),
            partial_out.stride(0),
            partial_out.stride(1),
            partial_out.stride(2),
            partial_lse.stride(0),
            partial_lse.stride(1),
            num_splits,
            min_split_len,
            SPLITS_POW2=triton.next_power_of_2(num_splits),
            CHUNK=min(REDUCE_CHUNK, triton.next_power_of_2(num_splits)),
            BLOCK_N=block_n,
            HEAD_DIM=head_dim,
            num_warps=4,
            **pdl.launch_options(q.device),
        )
    return out


@triton.jit(do_not_specialize=["num_seqs"], do_not_specialize_on_alignment=["seq_lens_ptr"])
def _longest_first_kernel(seq_lens_ptr, order_ptr, num_seqs, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Sequence i's place in the order: how many are longer, or as long and earlier."""
    pdl.wait_for_inputs(PDL)
    i = tl.program_id(0)
    others = tl.arange(0, BLOCK)
    lens = tl.load(seq_lens_ptr + others, mask=others < num_seqs, other=-1)
    mine = tl.load(seq_lens_ptr + i + others * 0)  # as a vector: a scalar mask trips the interpreter
    ahead = (lens > mine) | ((lens == mine) & (others < i))
    tl.store(order_ptr + tl.sum(ahead.to(tl.int32), 0), i)


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """The batch's indices, longest sequence first and ties in batch order (int32), as paged_decode's
    seq_order: one small kernel (torch.argsort takes a radix sort of several kernels at 256 rows),
    on the device and without a host sync, so a CUDA graph can replay it."""
    num_seqs = seq_lens.shape[0]
    order = torch.empty(num_seqs, dtype=torch.int32, device=seq_lens.device)
    if num_seqs:
        _longest_first_kernel[(num_seqs,)](
            seq_lens, order, num_seqs, BLOCK=triton.next_power_of_2(num_seqs), **pdl.launch_options(seq_lens.device)
        )
    return order


def is_power_of_two(value: int, least: int) -> bool:
    return isinstance(value, int) and value >= least and value & (value - 1) == 0
