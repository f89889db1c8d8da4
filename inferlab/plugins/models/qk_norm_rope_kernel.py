"""Qwen3's per-head RMSNorm of q and k and their rotary embedding, in one Triton kernel that reads
the fused QKV projection's output. Unfused (or through torch.compile) this is four kernels a layer
(two norms, two rotary passes with a gather of the cos/sin rows), each a few microseconds on tensors
of a few hundred kilobytes: launch and tail latency, not bandwidth. One program does one token.

The rounding follows the unfused code (rms_norm, then apply_rotary): the normalized values are
rounded to the model dtype before the weight, and the weighted values before the rotation, so
bf16 results agree with it to the last bit or nearly.

Imported only where it runs: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, q_out_ptr, k_out_ptr, q_weight_ptr, k_weight_ptr, cos_sin_ptr, positions_ptr,
                         qkv_stride_token, eps,
                         NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_POW2: tl.constexpr,
                         HALF: tl.constexpr):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    # rows 0..NUM_Q_HEADS-1 are q's heads, the next NUM_KV_HEADS k's: they sit in that order in qkv
    heads = tl.arange(0, HEADS_POW2)
    is_q = heads < NUM_Q_HEADS
    is_k = (heads >= NUM_Q_HEADS) & (heads < NUM_Q_HEADS + NUM_KV_HEADS)
    rows = is_q | is_k
    dims = tl.arange(0, HALF)
    src = qkv_ptr + token.to(tl.int64) * qkv_stride_token + heads[:, None] * (2 * HALF) + dims[None, :]
    x1 = tl.load(src, mask=rows[:, None], other=0.0)
    x2 = tl.load(src + HALF, mask=rows[:, None], other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.where(is_q[:, None], tl.load(q_weight_ptr + dims)[None, :], tl.load(k_weight_ptr + dims)[None, :])
    w2 = tl.where(is_q[:, None], tl.load(q_weight_ptr + HALF + dims)[None, :], tl.load(k_weight_ptr + HALF + dims)[None, :])
    n1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1.to(tl.float32)).to(dtype).to(tl.float32)
    n2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2.to(tl.float32)).to(dtype).to(tl.float32)
    row = cos_sin_ptr + position * (2 * HALF)
    cos = tl.load(row + dims)[None, :]
    sin = tl.load(row + HALF + dims)[None, :]
    o1 = (n1 * cos - n2 * sin).to(dtype)
    o2 = (n2 * cos + n1 * sin).to(dtype)
    q_dst = q_out_ptr + token.to(tl.int64) * (NUM_Q_HEADS * 2 * HALF) + heads[:, None] * (2 * HALF) + dims[None, :]
    tl.store(q_dst, o1, mask=is_q[:, None])
    tl.store(q_dst + HALF, o2, mask=is_q[:, None])
    k_heads = heads - NUM_Q_HEADS
    k_dst = k_out_ptr + token.to(tl.int64) * (NUM_KV_HEADS * 2 * HALF) + k_heads[:, None] * (2 * HALF) + dims[None, :]
    tl.store(k_dst, o1, mask=is_k[:, None])
    tl.store(k_dst + HALF, o2, mask=is_k[:, None])


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos_sin: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim], normalized per head and rotated,
    from qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] (q's heads, then k's, then v's).
    cos_sin: float32 [positions, head_dim], each row cos then sin of the rotary angles."""
    num_tokens = qkv.shape[0]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = qkv.new_empty((num_tokens, num_heads, head_dim))
    k = qkv.new_empty((num_tokens, num_kv_heads, head_dim))
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens,)](
            qkv, q, k, q_weight, k_weight, cos_sin, positions, qkv.stride(0), eps,
            NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
            HEADS_POW2=triton.next_power_of_2(num_heads + num_kv_heads), HALF=head_dim // 2,
            num_warps=4)
    return q, k
