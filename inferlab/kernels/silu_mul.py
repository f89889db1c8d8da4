"""SiLU(gate) * up over the fused gate/up projection's output, as one Triton kernel.

torch.compile's kernel for the same expression (compiled with dynamic shapes, so the split point
of x is symbolic) reads far below the bandwidth (BENCHMARKS.md, "Why the defaults are what they
are"). Here each program covers one contiguous span of one row, so loads and stores vectorize.

The rounding follows F.silu(gate) * up in the model dtype: SiLU is rounded before the product.
Imported only where it runs: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests)."""

import torch
import triton
import triton.language as tl

from inferlab.kernels import pdl

BLOCK = 1024


@triton.jit
def silu_times_up(gate, up):
    """SiLU(gate) * up in gate's dtype, SiLU rounded before the product (also gemv.py's SILU_MUL
    rows, which must round as this kernel does)."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, width, x_stride, out_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, silu_times_up(gate, up), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] (gate, then up) -> SiLU(gate) * up [T, I]."""
    num_tokens, double_width = x.shape
    width = double_width // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x.new_empty((num_tokens, width))
    if num_tokens:
        _silu_mul_kernel[(num_tokens, triton.cdiv(width, BLOCK))](
            x, out, width, x.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4, **pdl.launch_options(x.device)
        )
    return out
