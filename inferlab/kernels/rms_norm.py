"""RMSNorm over the hidden size, with or without the residual add before it, as one Triton kernel.

A decode step runs two of these a layer on a few hundred kilobytes each, so their cost is launch
and latency, and torch.compile's kernel for the same code is slower at both and reads a large
prefill chunk well below the bandwidth. One program normalizes one row, with a warp for every 128
values of its width (4 to 16): at one sequence the step waits on that single program's loads, which
more warps issue sooner (BENCHMARKS.md, "Why the defaults are what they are").

The rounding follows layers.rms_norm and layers.add_rms_norm: the sum x + residual is kept in
float32 for the norm and rounded to the model dtype as the new residual; the normalized values are
rounded to the model dtype before the weight multiplies them.

x may also be a projection's float32 split-K partials [S, T, hidden] (split_k_gemm.py): the
kernel adds them up as it loads the row, so the split needs no reduction kernel of its own.
Imported only where it runs: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests)."""

import torch
import triton
import triton.language as tl

from inferlab.kernels import pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_stride,
    partial_stride,
    residual_stride,
    width,
    eps,
    BLOCK: tl.constexpr,
    PARTIALS: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    for part in tl.static_range(1, PARTIALS):  # x is split-K partials: their sum is the row
        x += tl.load(x_ptr + part * partial_stride + row * x_stride + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        x += tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_out_ptr + row * width + cols, x.to(dtype), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / width + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (x * rstd).to(dtype).to(tl.float32) * weight
    tl.store(out_ptr + row * width + cols, out.to(dtype), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    partials = x.dim() == 3
    num_tokens, width = x.shape[-2:]
    if x.stride(-1) != 1 or (partials and x.stride(1) != width):
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    # partials are float32 whatever the model's dtype; the output is in the weight's (the model's)
    dtype = weight.dtype if partials else x.dtype
    out = torch.empty((num_tokens, width), dtype=dtype, device=x.device)
    block = triton.next_power_of_2(width)
    residual_out = torch.empty_like(out) if residual is not None else out
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            x,
            x if residual is None else residual,
            weight,
            out,
            residual_out,
            x.stride(-2),
            x.stride(0) if partials else 0,
            0 if residual is None else residual.stride(0),
            width,
            eps,
            BLOCK=block,
            PARTIALS=x.shape[0] if partials else 1,
            ADD_RESIDUAL=residual is not None,
            num_warps=max(4, min(16, block // 128)),
            **pdl.launch_options(x.device),
        )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, hidden] (or of the sum of float32 partials [S, T, hidden]),
    times weight [hidden]."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x [T, hidden] (or float32 partials [S, T, hidden],
    summed) and residual [T, hidden]."""
    return _launch(x, residual, weight, eps)
