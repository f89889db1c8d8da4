"""The rotary embedding of q and k, with Qwen3's per-head RMSNorm of q and k before it or without
it (Llama, Mistral, Qwen2), in one Triton kernel that reads the fused QKV projection's output.
Unfused (or through torch.compile) this is up to four kernels a layer (two norms, two rotary passes
with a gather of the cos/sin rows), each a few microseconds on tensors of a few hundred kilobytes:
launch and tail latency, not bandwidth. One program does one token. Given the attention backend's
cache (kv_store), it also writes the token's rotated k and its v into their cache slot, which saves
the backend's store kernel.

The rounding follows the unfused code: with the norm (rms_norm, then apply_rotary) the normalized
values are rounded to the model dtype before the weight, and the weighted values before the
rotation, so bf16 results agree with it to the last bit or nearly; without it (apply_rotary) the
rotation runs in float32 and is rounded once.

Imported only where it runs: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests)."""

import torch
import triton
import triton.language as tl

from inferlab.kernels import pdl
from inferlab.kernels.kv_store import cache_value, slot_stride


@triton.jit
def norm_rotate(x1, x2, w1, w2, cos, sin, eps, NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Head vectors given as their halves x1, x2 [rows, HEAD_DIM / 2]: RMSNorm'd each (NORM) with
    the weight's halves w1, w2, then rotated by the angles' cos and sin [rows or 1, HEAD_DIM / 2];
    (o1, o2) in x's dtype, rounded as the unfused code rounds (module docstring). The decode
    attention kernel rotates the new token's q and k with this too."""
    dtype = x1.dtype
    n1, n2 = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        rstd = tl.rsqrt((tl.sum(n1 * n1, 1) + tl.sum(n2 * n2, 1)) / HEAD_DIM + eps)[:, None]
        n1 = ((n1 * rstd).to(dtype).to(tl.float32) * w1.to(tl.float32)).to(dtype).to(tl.float32)
        n2 = ((n2 * rstd).to(dtype).to(tl.float32) * w2.to(tl.float32)).to(dtype).to(tl.float32)
    return (n1 * cos - n2 * sin).to(dtype), (n2 * cos + n1 * sin).to(dtype)


# positions and slots are slices of one buffer per step (ModelRunner.upload), aligned as the
# batch's size makes them: not specialized on, or new batch sizes would compile new variants.
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_mapping_ptr"])
def _qk_rotary_kernel(
    qkv_ptr,
    q_out_ptr,
    k_out_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_sin_ptr,
    positions_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    cache_stride_slot,
    qkv_stride_token,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_POW2: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait_for_inputs(PDL)
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    # rows 0..NUM_Q_HEADS-1 are q's heads, the next NUM_KV_HEADS k's, then v's (read only to be
    # stored): they sit in that order in qkv
    heads = tl.arange(0, HEADS_POW2)
    is_q = heads < NUM_Q_HEADS
    is_k = (heads >= NUM_Q_HEADS) & (heads < NUM_Q_HEADS + NUM_KV_HEADS)
    is_v = (heads >= NUM_Q_HEADS + NUM_KV_HEADS) & (heads < NUM_Q_HEADS + 2 * NUM_KV_HEADS)
    rows = (is_q | is_k | is_v) if STORE_KV else (is_q | is_k)
    dims = tl.arange(0, HALF)
    src = qkv_ptr + token.to(tl.int64) * qkv_stride_token + heads[:, None] * (2 * HALF) + dims[None, :]
    x1 = tl.load(src, mask=rows[:, None], other=0.0)
    x2 = tl.load(src + HALF, mask=rows[:, None], other=0.0)
    if NORM:
        w1 = tl.where(is_q[:, None], tl.load(q_weight_ptr + dims)[None, :], tl.load(k_weight_ptr + dims)[None, :])
        w2 = tl.where(
            is_q[:, None], tl.load(q_weight_ptr + HALF + dims)[None, :], tl.load(k_weight_ptr + HALF + dims)[None, :]
        )
    else:  # unread
        w1 = x1
        w2 = x2
    row = cos_sin_ptr + position * (2 * HALF)
    cos = tl.load(row + dims)[None, :]
    sin = tl.load(row + HALF + dims)[None, :]
    o1, o2 = norm_rotate(x1, x2, w1, w2, cos, sin, eps, NORM, 2 * HALF)
    q_dst = q_out_ptr + token.to(tl.int64) * (NUM_Q_HEADS * 2 * HALF) + heads[:, None] * (2 * HALF) + dims[None, :]
    tl.store(q_dst, o1, mask=is_q[:, None])
    tl.store(q_dst + HALF, o2, mask=is_q[:, None])
    k_heads = heads - NUM_Q_HEADS
    if STORE_KV:
        # the token's slot, once per row (a scalar mask trips Triton's interpreter); -1 is a padding
        # row of a CUDA-graph batch, which stores nothing
        slot = tl.load(slot_mapping_ptr + token + heads * 0)
        row = (slot * cache_stride_slot)[:, None]
        store_k = (is_k & (slot >= 0))[:, None]
        store_v = (is_v & (slot >= 0))[:, None]
        k_dst = k_cache_ptr + row + k_heads[:, None] * (2 * HALF) + dims[None, :]
        tl.store(k_dst, cache_value(o1, k_cache_ptr), mask=store_k)
        tl.store(k_dst + HALF, cache_value(o2, k_cache_ptr), mask=store_k)
        v_dst = v_cache_ptr + row + (k_heads - NUM_KV_HEADS)[:, None] * (2 * HALF) + dims[None, :]
        tl.store(v_dst, cache_value(x1, v_cache_ptr), mask=store_v)
        tl.store(v_dst + HALF, cache_value(x2, v_cache_ptr), mask=store_v)
    else:
        k_dst = (
            k_out_ptr + token.to(tl.int64) * (NUM_KV_HEADS * 2 * HALF) + k_heads[:, None] * (2 * HALF) + dims[None, :]
        )
        tl.store(k_dst, o1, mask=is_k[:, None])
        tl.store(k_dst + HALF, o2, mask=is_k[:, None])


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim], normalized per head and rotated,
    from qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] (q's heads, then k's, then v's).
    cos_sin: float32 [positions, head_dim], each row cos then sin of the rotary angles.
    kv_store: (k_cache, v_cache, slot_mapping) as an attention backend's kv_store_target gives
    them; k and v then go into the caches at each token's slot (-1 skips it), and k is None."""
    return _qk_rotary(qkv, positions, (q_weight, k_weight, eps), cos_sin, num_heads, num_kv_heads, head_dim, kv_store)


def rotary(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """qk_norm_rope without the norms: q and k rotated, for models without per-head q/k norms."""
    return _qk_rotary(qkv, positions, None, cos_sin, num_heads, num_kv_heads, head_dim, kv_store)


def _qk_rotary(qkv, positions, norm, cos_sin, num_heads, num_kv_heads, head_dim, kv_store):
    """Both entry points' launch; norm: (q_weight, k_weight, eps), or None for rotary alone."""
    num_tokens = qkv.shape[0]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = qkv.new_empty((num_tokens, num_heads, head_dim))
    if kv_store is None:
        k = qkv.new_empty((num_tokens, num_kv_heads, head_dim))
        k_cache = v_cache = slot_mapping = k  # unused by the kernel: any tensor serves as the pointer
        cache_stride_slot = 0
    else:
        k = None
        k_cache, v_cache, slot_mapping = kv_store
        cache_stride_slot = slot_stride(k_cache, v_cache, num_kv_heads, head_dim)
    q_weight, k_weight, eps = norm if norm is not None else (cos_sin, cos_sin, 0.0)  # unread without the norm
    if num_tokens:
        rows = num_heads + num_kv_heads * (2 if kv_store is not None else 1)
        _qk_rotary_kernel[(num_tokens,)](
            qkv,
            q,
            q if k is None else k,
            q_weight,
            k_weight,
            cos_sin,
            positions,
            k_cache,
            v_cache,
            slot_mapping,
            cache_stride_slot,
            qkv.stride(0),
            eps,
            NUM_Q_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEADS_POW2=triton.next_power_of_2(rows),
            HALF=head_dim // 2,
            NORM=norm is not None,
            STORE_KV=kv_store is not None,
            num_warps=4,
            **pdl.launch_options(qkv.device),
        )
    return q, k
