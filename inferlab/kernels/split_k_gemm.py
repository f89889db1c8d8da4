"""Split-K GEMM for the narrow projections of decode batches, leaving its partial sums for the
next RMSNorm kernel to add up; unsplit, the small batches' GEMM for the wide ones.

A projection with few output features (Qwen3-0.6B's o_proj and down_proj: 1,024) gives a GEMM
only a few dozen column blocks, so a few dozen of the GPU's 132 multiprocessors stream its weight.
Splitting K fills the others, but the partial sums then need adding, and a separate reduction
kernel costs what the split saves (cuBLAS adds one of its own at these sizes). Here each program
stores its fp32 partial [BLOCK_M, BLOCK_N] tile into partials[split], and the add + RMSNorm kernel
that reads the projection's output anyway (rms_norm.py) sums them as it loads, which is faster
than cuBLAS at these sizes, for the decoder stack and for the bench (BENCHMARKS.md, "Why the
defaults are what they are").

A wide projection (Qwen3-8B's o_proj and down_proj: 4,096 outputs, 128 column blocks) fills the
GPU with one program a multiprocessor, each streaming a deep slice of K; at up to 64 tokens a split
in two gives each multiprocessor two programs, half as deep, and its partials replace cuBLAS's
split-K GEMM and reduction kernel, which shortens small decode batches' graphs; splits of 3, 4 and
8 were slower.

The sum of the partials is the product in float32, rounded once by the norm kernel, where cuBLAS
rounds the product to the model dtype before the residual add: both are the projection to within
one rounding.

Unsplit, the same kernel serves the wide projections (qkv_proj, gate_up_proj) of batches of up to
64 tokens (`linear`): there it gains nothing from its tiling but from its PDL launch, which lets
it start while the kernel before it drains, which makes the decoder stack faster up to 64 tokens;
above, cuBLAS is faster.
Imported only where it runs: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests)."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from inferlab.kernels import pdl


class SplitKPlan(NamedTuple):
    block_n: int
    block_k: int
    split: int


# Fewer 32-wide column blocks than this leave most of a large GPU's multiprocessors idle: split K.
MIN_COLUMN_BLOCKS = 64
# A wide weight is split in two at up to 64 tokens only where each half of K is this deep or more
# (measured with K of 4,096 and 12,288; shallower wide weights stay with cuBLAS).
MIN_DEEP_SPLIT = 2048


def plan(n: int, k: int, num_tokens: int = 1) -> SplitKPlan | None:
    """The tiling for num_tokens rows against a [n, k] weight, in whole 128-wide K steps: 32 columns
    and a split of 4 (or 2) for up to 64 rows, 64 columns and a split of 2 above 128 (the fastest
    of 32/64 columns, 128/256-wide K steps and splits of 1, 2, 4 at 8, 64 and 256 rows);
    between them 32 columns and a split of 2, which gives 65-128 rows (two row blocks) as many
    programs as 256 rows get, and made the decoder stack faster there. A
    weight wide enough to fill the GPU with column blocks is split in two up to 64 rows where K is
    deep (see the module's docstring), and not above. None where a split does not pay or does not
    divide (then use a plain GEMM)."""
    if num_tokens <= 64:
        return fit(n, k, 32, (4, 2)) or deep_split(n, k)
    return fit(n, k, 32 if num_tokens <= 128 else 64, (2,))


def deep_split(n: int, k: int) -> SplitKPlan | None:
    """32 columns and a split of 2 for a [n, k] weight of whole column blocks whose halves of K are
    at least MIN_DEEP_SPLIT deep, in whole 128-wide steps; else None."""
    if n % 32 or k < 2 * MIN_DEEP_SPLIT or k % 256:
        return None
    return SplitKPlan(32, 128, 2)


def max_planned_tokens(n: int, k: int, max_tokens: int) -> int:
    """The most tokens, up to max_tokens, such that a batch of any count from 1 to it gets a
    tiling for a [n, k] weight (plan changes only above 64 and above 128 tokens); 0 if none."""
    covered = 0
    for first, last in ((1, 64), (65, 128), (129, max_tokens)):
        if first > max_tokens or plan(n, k, first) is None:
            break
        covered = min(last, max_tokens)
    return covered


def fit(n: int, k: int, block_n: int, splits: tuple[int, ...]) -> SplitKPlan | None:
    """block_n-column blocks with the first of splits that divides K into whole 128-wide steps, for
    a [n, k] weight narrow enough to gain from a split; else None."""
    if n % block_n or n // 32 >= MIN_COLUMN_BLOCKS:
        return None
    for split in splits:
        if k % (128 * split) == 0:
            return SplitKPlan(block_n, 128, split)
    return None


@triton.jit(do_not_specialize=["M"])  # the batch's tokens: one variant serves every count
def _split_k_kernel(
    x_ptr,
    weight_ptr,
    partials_ptr,
    M,
    N,
    K,
    x_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: the BLOCK_M x BLOCK_N tile of x @ weight.T over one SPLIT-th of K, accumulated
    in float32, into partials[split], stored in the partials' dtype (float32, or unsplit, the
    output itself in the model dtype)."""
    pdl.wait_for_inputs(PDL)
    pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows[:, None] < M
    k_per_split = K // SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * k_per_split, (split + 1) * k_per_split, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :], mask=row_mask, other=0.0)
        w = tl.load(weight_ptr + cols[:, None] * K + ks[None, :])
        acc += tl.dot(a, tl.trans(w), input_precision="ieee" if a.dtype == tl.float32 else "tf32")
    out = partials_ptr + (split * M + rows)[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc, mask=row_mask)


def wide_plan(n: int, k: int) -> SplitKPlan | None:
    """The tiling of the same kernel unsplit, for a weight too wide to gain from a split (qkv_proj,
    gate_up_proj): 32 columns a program up to 4,096 outputs, 64 above, 128-wide K steps (the
    fastest tilings at 8 and 64 tokens). None where they do not divide."""
    block_n = 32 if n <= 4096 else 64
    if n % block_n or k % 128:
        return None
    return SplitKPlan(block_n, 128, 1)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in x's dtype (the float32 accumulator rounded once), for x [T, K] and a
    contiguous weight [N, K] that wide_plan tiles: a cuBLAS GEMM's replacement whose PDL launch
    lets it start while the kernel before it drains."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return _launch(x, weight, out, wide_plan(*weight.shape))


def linear_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 partials [split, T, N] whose sum over the first dimension is x @ weight.T, for x
    [T, K] and a contiguous weight [N, K] that `plan` gives a tiling for at T tokens."""
    tiling = plan(*weight.shape, x.shape[0])
    partials = torch.empty((tiling.split, x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    return _launch(x, weight, partials, tiling)


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, tiling: SplitKPlan) -> torch.Tensor:
    num_tokens, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if num_tokens:
        block_m = min(64, max(16, triton.next_power_of_2(num_tokens)))
        grid = (n // tiling.block_n, tiling.split, triton.cdiv(num_tokens, block_m))
        _split_k_kernel[grid](
            x,
            weight,
            out,
            num_tokens,
            n,
            k,
            x.stride(0),
            BLOCK_M=block_m,
            BLOCK_N=tiling.block_n,
            BLOCK_K=tiling.block_k,
            SPLIT=tiling.split,
            num_warps=4,
            num_stages=4,
            **pdl.launch_options(x.device),
        )
    return out
