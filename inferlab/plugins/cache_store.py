"""How inferlab's Triton kernels convert a value for the KV cache they store it in: a cast to the
cache's element type, which for a float8_e4m3fn cache (engine kv_cache_dtype=fp8) is rounded to
nearest even and saturated at +-448, bit for bit as inferlab.core.kv_cache_dtype.to_cache_dtype.

The fp8 bits are computed here with integer arithmetic rather than by a cast: Triton's interpreter
(the CPU tests) rounds float -> fp8 casts wrongly (no carry into the exponent, no subnormals), so a
cast would make the tests check something other than what the GPU runs. The few extra integer
instructions a value cost nothing measurable in kernels that store one token's K and V."""

import triton
import triton.language as tl


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
