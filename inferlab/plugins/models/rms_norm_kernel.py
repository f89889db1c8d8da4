"""RMSNorm over the hidden size, with or without the residual add before it, as one Triton kernel.

A decode step runs two of these a layer on a few hundred kilobytes each, so their cost is launch
and latency; torch.compile's kernel for the same code takes about 2 µs at 256 tokens and reads a
16k-token prefill chunk at about half the bandwidth (scripts/microbench_gpu.py). One program
normalizes one row.

The rounding follows layers.rms_norm and layers.add_rms_norm: the sum x + residual is kept in
float32 for the norm and rounded to the model dtype as the new residual; the normalized values are
rounded to the model dtype before the weight multiplies them.
Imported only where it runs: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests)."""
import torch
import triton
import triton.language as tl

from inferlab.plugins import pdl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, x_stride, residual_stride,
                     width, eps, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if ADD_RESIDUAL:
        x += tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_out_ptr + row * width + cols, x.to(dtype), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / width + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (x * rstd).to(dtype).to(tl.float32) * weight
    tl.store(out_ptr + row * width + cols, out.to(dtype), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    num_tokens, width = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    out = x.new_empty((num_tokens, width))
    residual_out = x.new_empty((num_tokens, width)) if residual is not None else out
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            x, x if residual is None else residual, weight, out, residual_out, x.stride(0),
            0 if residual is None else residual.stride(0), width, eps,
            BLOCK=triton.next_power_of_2(width), ADD_RESIDUAL=residual is not None, num_warps=4,
            **pdl.launch_options(x.device))
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, hidden], times weight [hidden]."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual [T, hidden]."""
    return _launch(x, residual, weight, eps)
