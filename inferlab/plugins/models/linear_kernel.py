"""A decoder layer's projections for small decode batches as one Triton GEMM each, with the
elementwise kernel before each projection folded into the GEMM's loads.

At decode sizes a layer's cuBLAS GEMMs take 5-8 µs where their weights stream in 1-3 µs, and the
RMSNorm and SiLU*mul kernels between them 1.5-2 µs each: most of that is per-kernel latency
(BENCHMARKS.md, session 4, item 24). Here, y = prologue(x) @ W^T, where the prologue is one of
- NONE: x itself;
- RMS_NORM / ADD_RMS_NORM: RMSNorm of x (of x + residual, whose sum the programs of the first
  column block also store as the new residual). The row's 1/rms is a scalar of the row, so it
  scales the accumulator after the K loop: each program sums the squares of the row as it streams
  it, and no separate pass over the row is needed;
- SILU_MUL: SiLU(gate) * up of a fused gate/up output x = [gate | up], rounded as silu_mul_kernel.
Each program computes one BLOCK_M x BLOCK_N tile over all of K, and launches with PDL.

The normalized rows differ in rounding from rms_norm_kernel followed by a GEMM: there the
normalized values are rounded to the model dtype before the GEMM; here x * weight is, and 1/rms
multiplies the float32 accumulator. Both are RMSNorm then the projection to within bf16 rounding.

Imported only where it runs: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests)."""
import torch
import triton
import triton.language as tl

from inferlab.plugins import pdl

NONE, RMS_NORM, ADD_RMS_NORM, SILU_MUL = 0, 1, 2, 3


@triton.jit
def _linear_kernel(x_ptr, residual_ptr, weight_ptr, norm_weight_ptr, out_ptr, residual_out_ptr,
                   M, N, K, x_stride, residual_stride, eps,
                   PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = (rows < M)[:, None]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows + ks[None, :], mask=row_mask, other=0.0)
        if PROLOGUE == 1 or PROLOGUE == 2:
            h = a.to(tl.float32)
            if PROLOGUE == 2:
                h += tl.load(residual_ptr + rows.to(tl.int64)[:, None] * residual_stride + ks[None, :],
                             mask=row_mask, other=0.0).to(tl.float32)
                if pid_n == 0:  # one column block stores the new residual
                    tl.store(residual_out_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], h.to(a.dtype),
                             mask=row_mask)
            sum_sq += tl.sum(h * h, 1)
            a = (h * tl.load(norm_weight_ptr + ks).to(tl.float32)[None, :]).to(a.dtype)
        elif PROLOGUE == 3:
            up = tl.load(x_rows + K + ks[None, :], mask=row_mask, other=0.0)
            gate = a.to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(a.dtype)
            a = (silu.to(tl.float32) * up.to(tl.float32)).to(a.dtype)
        w = tl.load(weight_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :])
        acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
    if PROLOGUE == 1 or PROLOGUE == 2:
        acc = acc * tl.rsqrt(sum_sq / K + eps)[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_mask)


def _block(size: int, largest: int) -> int | None:
    """The largest power of two <= largest (and >= 16) dividing size, or None."""
    block = largest
    while block >= 16:
        if size % block == 0:
            return block
        block //= 2
    return None


def supports(n: int, k: int) -> bool:
    """Whether a [n, k] weight has the tile-divisible shape the kernel needs."""
    return _block(n, 64) is not None and _block(k, 128) is not None


def linear(x: torch.Tensor, weight: torch.Tensor, prologue: int = NONE, residual: torch.Tensor | None = None,
           norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(prologue(x) @ weight.T, the new residual for ADD_RMS_NORM else None). x [T, K] (SILU_MUL:
    [T, 2K], gate then up), weight [N, K] contiguous with supports(N, K); residual [T, K] and
    norm_weight [K] for the norms."""
    num_tokens = x.shape[0]
    n, k = weight.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x.new_empty((num_tokens, n))
    residual_out = x.new_empty((num_tokens, k)) if prologue == ADD_RMS_NORM else None
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    if num_tokens:
        block_m = min(64, max(16, triton.next_power_of_2(num_tokens)))
        # from scripts/microbench_launch.py's sweep at 8-64 tokens on an H200 (BENCHMARKS.md item 24)
        block_n = _block(n, 64 if n >= 6144 else 32)
        block_k = _block(k, 128)
        _linear_kernel[(n // block_n, triton.cdiv(num_tokens, block_m))](
            x, residual if residual is not None else x, weight, norm_weight if norm_weight is not None else weight,
            out, residual_out if residual_out is not None else out,
            num_tokens, n, k, x.stride(0), residual.stride(0) if residual is not None else 0, eps,
            PROLOGUE=prologue, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=4,
            **pdl.launch_options(x.device))
    return out, residual_out
