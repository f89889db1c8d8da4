"""Storing new K and V into the paged KV cache: store_kv writes each token's k and v into its slot,
and cache_value is how any of inferlab's Triton kernels converts a value for the cache it stores
it in: a cast to the cache's element type, which for a float8_e4m3fn cache (engine
kv_cache_dtype=fp8) is rounded to nearest even and saturated at +-448, bit for bit as
inferlab.core.kv_cache_dtype.to_cache_dtype.

Cache layout (one layer): [2, num_blocks, block_size, num_kv_heads, head_dim], K then V; token j
of a sequence lives in slot block_table[j // block_size] * block_size + j % block_size.

The fp8 bits are computed here with integer arithmetic rather than by a cast: Triton's interpreter
(the CPU tests) rounds float -> fp8 casts wrongly (no carry into the exponent, no subnormals), so a
cast would make the tests check something other than what the GPU runs. The few extra integer
instructions a value cost nothing measurable in kernels that store one token's K and V."""

import torch
import triton
import triton.language as tl

from inferlab.kernels import pdl


@triton.jit
def _to_e4m3(x):
    """float32 x -> float8e4nv, round to nearest even, saturating."""
    a = tl.minimum(tl.abs(x), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    # From 2^-6 up, e4m3 keeps float32's top 3 mantissa bits: round the 20 dropped ones to nearest
    # even (a carry moves into the exponent), then rebias the exponent from 127 to 7.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Below 2^-6 it counts steps of 2^-9: adding 2^23 leaves round-to-nearest-even(a * 2^9) in
    # the float's low mantissa bits (8 steps is 2^-6, whose bits 0x08 are the same either way).
    subnormal = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    magnitude = tl.where(a < 0.015625, subnormal, normal)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (magnitude | sign).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def cache_value(x, cache_ptr):
    """x as stored through cache_ptr (a pointer into a K or V cache)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        return _to_e4m3(x.to(tl.float32))
    else:
        return x.to(cache_ptr.dtype.element_ty)


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])  # a slice of the step's buffer
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_stride_token,
    v_stride_token,
    cache_stride_slot,
    ROW: tl.constexpr,
    ROW_POW2: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait_for_inputs(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # a padding row of a CUDA-graph batch: nothing to store
        return
    offsets = tl.arange(0, ROW_POW2)
    mask = offsets < ROW
    k = tl.load(k_ptr + token * k_stride_token + offsets, mask=mask)
    v = tl.load(v_ptr + token * v_stride_token + offsets, mask=mask)
    tl.store(k_cache_ptr + slot * cache_stride_slot + offsets, cache_value(k, k_cache_ptr), mask=mask)
    tl.store(v_cache_ptr + slot * cache_stride_slot + offsets, cache_value(v, v_cache_ptr), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes k, v [T, Hkv, D] into kv_cache at slot_mapping [T] (int64; -1 skips the token)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    row = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        k_cache.stride(1),
        ROW=row,
        ROW_POW2=triton.next_power_of_2(row),
        **pdl.launch_options(k.device),
    )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] with each token's Hkv * D values contiguous (a split of a fused QKV is)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def slot_stride(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """The elements from one slot to the next in contiguous [num_blocks, block_size, Hkv, D] caches."""
    for cache in (k_cache, v_cache):
        if tuple(cache.shape[-2:]) != (num_kv_heads, head_dim) or not cache.is_contiguous():
            raise ValueError(
                f"kv_store caches must be contiguous [num_blocks, block_size, {num_kv_heads}, {head_dim}], "
                f"got shape {tuple(cache.shape)} strides {cache.stride()}"
            )
    return num_kv_heads * head_dim
