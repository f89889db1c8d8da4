"""One token's projections as GEMVs on the CUDA cores, with the elementwise kernel before each
projection folded into its reads: the decode step of a single sequence.

At one token the Triton GEMM (split_k_gemm.py) pads the row to a 16-row tensor-core tile and
streams each K step through shared memory; a decode layer's four GEMMs then take longer than
their weights take to stream, and the RMSNorm, SiLU*mul kernels between them add launches of their
own (BENCHMARKS.md, "One sequence"). Here a program holds a [BLOCK_N, K_BLOCK] slab of
the weight in registers, multiplies it by the row in float32 and sums along K; the slab covers a
whole slice of K (K_SPLIT, the grid's second axis) or, with more rows a program, a slab-wide part
of it at a time (tiling):
- the first slab may be read before the PDL wait (PRELOAD): the weight does not depend on the
  kernel before, so it streams while that kernel still runs and only the row is read after the wait;
- the row can be the prologue's result instead of a tensor some earlier kernel wrote: RMSNorm of
  x (of x + residual, the first program storing the new residual) or SiLU(gate) * up, rounded as
  rms_norm.py's and silu_mul.py's kernels round them, so that each program forms the row itself and
  no kernel sits between the projections.
x may be float32 split-K partials [S, 1, K] (summed as read), as the o_proj and down_proj GEMVs
leave them with a split; the output is then such partials too. A whole slice of K that is no power
of two (Qwen3-4B's rows of 2,560) sits in a tile of the next power of two, masked past it.

So one sequence's decode step is shorter than with the Triton GEMMs, and shorter again for each of
these choices (BENCHMARKS.md, "One sequence", with the settings tried and not taken). Qwen3-8B's
whole rows are four times a slab: 8 rows a program, 1,024 columns at a time, stream o_proj's and
down_proj's weights faster than whole-row slabs of two rows, and, unsplit, leave the next fused
norm one row in the model dtype instead of three float32 partials.

Imported only where it runs: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests)."""

import torch
import triton
import triton.language as tl

from inferlab.kernels import pdl
from inferlab.kernels.silu_mul import silu_times_up

# The row the slab multiplies: x itself, RMSNorm of x, RMSNorm of x + residual, SiLU(gate) * up.
PLAIN, NORM, ADD_NORM, SILU_MUL = 0, 1, 2, 3
# A program's weight slab, in elements (16 KB of bf16: 64 registers a thread at 4 warps): half as
# large and twice as large were slower (BENCHMARKS.md, "One sequence", tried and not taken).
SLAB = 8192
# Rows a program of an unsplit o_proj or down_proj takes, reading K a slab at a time (unsplit_rows):
# with 4 or 16, and split into whole-row slabs, Qwen3-8B's decode step was slower (BENCHMARKS.md,
# "One sequence").
LOOP_ROWS = 8


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    """ptrs' values, or zero where mask is false if MASKED (unmasked, the loads vectorize whole)."""
    if MASKED:
        values = tl.load(ptrs, mask=mask, other=0.0)
    else:
        values = tl.load(ptrs)
    return values


@triton.jit
def _row_chunk(
    x_ptr, residual_ptr, ks, in_slice, part_stride, K, X_PARTS: tl.constexpr, PROLOGUE: tl.constexpr, MASKED
):
    """The row at ks in float32, before any norm: SiLU(gate) * up, or x (summed over its split-K
    partials) plus the residual where ADD_NORM."""
    if PROLOGUE == 3:  # SILU_MUL: x [1, 2K], gate then up
        gate = _load(x_ptr + ks, in_slice, MASKED)
        up = _load(x_ptr + K + ks, in_slice, MASKED)
        row = silu_times_up(gate, up).to(tl.float32)
    else:
        row = _load(x_ptr + ks, in_slice, MASKED).to(tl.float32)
        for part in tl.static_range(1, X_PARTS):  # x is split-K partials: their sum is the row
            row += _load(x_ptr + part * part_stride + ks, in_slice, MASKED)
        if PROLOGUE == 2:
            row += _load(residual_ptr + ks, in_slice, MASKED).to(tl.float32)
    return row


@triton.jit
def _normed(row, rstd, norm_weight_ptr, ks, in_slice, MASKED, dtype):
    """The RMSNorm of row at ks, rounded as rms_norm.py's kernels round it."""
    norm_weight = _load(norm_weight_ptr + ks, in_slice, MASKED).to(tl.float32)
    return ((row * rstd).to(dtype).to(tl.float32) * norm_weight).to(dtype).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    N,
    eps,
    part_stride,
    K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    K_BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    X_PARTS: tl.constexpr,
    PROLOGUE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRELOAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: BLOCK_N outputs of x @ weight.T over one K_SPLIT-wide slice of K (the grid's
    second axis), in float32, stored as that slice's partial (float32) or, unsplit, rounded to
    the output's dtype. The slice is read K_BLOCK columns at a time: a power of two dividing
    K_SPLIT, or one tile of K_SPLIT's next power of two, MASKED past it."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offsets = tl.arange(0, K_BLOCK)
    in_slice = offsets < K_SPLIT
    ks = split * K_SPLIT + offsets
    weight_ptrs = weight_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :]
    if PRELOAD:
        w = _load(weight_ptrs, in_slice[None, :], MASKED)
        pdl.wait_for_inputs(PDL)
    else:
        pdl.wait_for_inputs(PDL)
        w = _load(weight_ptrs, in_slice[None, :], MASKED)
    dtype = weight_ptr.dtype.element_ty
    row = _row_chunk(x_ptr, residual_ptr, ks, in_slice, part_stride, K, X_PARTS, PROLOGUE, MASKED)
    if PROLOGUE == 1 or PROLOGUE == 2:  # the norms: K_SPLIT == K, the program reads the whole row
        if PROLOGUE == 2 and pid_n == 0:
            tl.store(residual_out_ptr + ks, row.to(dtype), mask=in_slice)
        sum_sq = tl.sum(row * row, 0)
        for start in tl.range(K_BLOCK, K, K_BLOCK):  # the rest of the row, for its norm
            later = _row_chunk(x_ptr, residual_ptr, ks + start, in_slice, part_stride, K, X_PARTS, PROLOGUE, MASKED)
            if PROLOGUE == 2 and pid_n == 0:
                tl.store(residual_out_ptr + ks + start, later.to(dtype))
            sum_sq += tl.sum(later * later, 0)
        rstd = tl.rsqrt(sum_sq / K + eps)
        row = _normed(row, rstd, norm_weight_ptr, ks, in_slice, MASKED, dtype)
    acc = w.to(tl.float32) * row[None, :]
    for start in tl.range(K_BLOCK, K_SPLIT, K_BLOCK):
        w = tl.load(weight_ptrs + start)
        row = _row_chunk(x_ptr, residual_ptr, ks + start, in_slice, part_stride, K, X_PARTS, PROLOGUE, MASKED)
        if PROLOGUE == 1 or PROLOGUE == 2:
            row = _normed(row, rstd, norm_weight_ptr, ks + start, in_slice, MASKED, dtype)
        acc += w.to(tl.float32) * row[None, :]
    tl.store(out_ptr + split * N + cols, tl.sum(acc, 1).to(out_ptr.dtype.element_ty))


def slab_columns(n: int, k_split: int, slab: int = SLAB) -> int | None:
    """Columns a program takes: a slab's worth of weight rows k_split long (counted at its power of
    two, the tile's width), a power of two from 2 that divides n; None where no such count does or
    two rows overflow the slab."""
    if k_split < 16:
        return None
    block_n = slab // triton.next_power_of_2(k_split)
    while block_n >= 2 and n % block_n:
        block_n //= 2
    return block_n if block_n >= 2 else None


def tiling(n: int, k_split: int, slab: int = SLAB, rows: int | None = None) -> tuple[int, int] | None:
    """(BLOCK_N, K_BLOCK) for a [n, k_split] slice: by default a slab's worth of whole rows
    (slab_columns) in one tile; given rows, that many (the largest power of two up to it dividing n)
    read a slab at a time, K_BLOCK being the largest power of two that divides k_split and fits."""
    if rows is None:
        block_n = slab_columns(n, k_split, slab)
        return None if block_n is None else (block_n, triton.next_power_of_2(k_split))
    block_n = triton.next_power_of_2(rows + 1) // 2
    while block_n > 1 and n % block_n:
        block_n //= 2
    k_block = min(k_split & -k_split, max(slab // block_n, 16))
    return None if k_block < 16 else (block_n, k_block)


def unsplit_rows(n: int, k: int, slab: int = SLAB) -> int | None:
    """LOOP_ROWS where an [n, k] weight can run unsplit that many rows a program, reading K a slab at
    a time, in 256 programs or more; else None (splits_for's split of whole-row slabs). Unsplit,
    the output is one row in the model dtype, which the norm after o_proj and down_proj reads in
    every program of a fused GEMV instead of float32 partials."""
    tile = tiling(n, k, slab, LOOP_ROWS)
    return LOOP_ROWS if tile is not None and tile[0] == LOOP_ROWS and n // LOOP_ROWS >= 256 else None


def splits_for(n: int, k: int, slab: int = SLAB, rows: int | None = None) -> int | None:
    """The split of K for a [n, k] weight: the least that gives 256 programs or more (two a
    multiprocessor of a Hopper GPU), else the one that gives the most; splits into power-of-two
    slices first, whose tiles have no masked columns, then any (a tile of 2,560 is 4,096 wide).
    None where none fits."""
    for whole_tiles in (True, False):
        best, most = None, 0
        for split in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16):
            k_split = k // split
            if k % split or (whole_tiles and rows is None and k_split & (k_split - 1)):
                continue
            tile = tiling(n, k_split, slab, rows)
            if tile is None:
                continue
            programs = n // tile[0] * split
            if programs >= 256:
                return split
            if programs > most:
                best, most = split, programs
        if best is not None:
            return best
    return None


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    split: int = 1,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    preload: bool = True,
    slab: int = SLAB,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, the new residual or None) for one token: y = row @ weight.T, weight [N, K] contiguous.
    The row is x [1, K] (or float32 split-K partials [S, 1, K], summed); given norm_weight, its
    RMSNorm (after adding residual [1, K], whose sum is also returned); with silu_mul, SiLU(gate) *
    up of x [1, 2K]. split > 1 leaves y as float32 partials [split, 1, N] (not with a norm).
    preload: read the weight's first slab before the PDL wait. slab, rows: a program's tile (tiling).
    """
    n, k = weight.shape
    parts = x.shape[0] if x.dim() == 3 else 1
    if x.shape[-2] != 1 or x.shape[-1] != (2 * k if silu_mul else k):
        raise ValueError(f"gemv takes one row of {k} (silu_mul: {2 * k}) values, got x of shape {tuple(x.shape)}")
    if norm_weight is not None and split != 1:
        raise ValueError("a GEMV with the norm first needs the whole row in each program: split=1")
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    k_split = k // split
    tile = tiling(n, k_split, slab, rows)
    if k % split or tile is None:
        raise ValueError(f"no GEMV tiling of a [{n}, {k}] weight split {split} ways")
    out_dtype = torch.float32 if split > 1 else weight.dtype
    out = torch.empty((split, 1, n) if split > 1 else (1, n), dtype=out_dtype, device=x.device)
    residual_out = torch.empty((1, k), dtype=weight.dtype, device=x.device) if residual is not None else None
    if silu_mul:
        prologue = SILU_MUL
    elif norm_weight is None:
        prologue = PLAIN
    else:
        prologue = NORM if residual is None else ADD_NORM
    block_n, k_block = tile
    _gemv_kernel[(n // block_n, split)](
        x,
        x if residual is None else residual,
        weight if norm_weight is None else norm_weight,
        weight,
        out,
        out if residual_out is None else residual_out,
        n,
        eps,
        x.stride(0) if parts > 1 else 0,
        K=k,
        K_SPLIT=k_split,
        K_BLOCK=k_block,
        MASKED=k_block > k_split,
        X_PARTS=parts,
        PROLOGUE=prologue,
        BLOCK_N=block_n,
        PRELOAD=preload,
        # 8 or 16 warps made the batch-1 decode graph slower with the norms inside the GEMVs
        # (BENCHMARKS.md, "One sequence", tried and not taken)
        num_warps=4,
        **pdl.launch_options(x.device),
    )
    return out, residual_out
