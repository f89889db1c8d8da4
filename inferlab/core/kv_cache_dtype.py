"""The KV cache's element type: the model's dtype ("auto"), or float8 e4m3 ("fp8"), which halves
the bytes every decode step reads for attention (its largest cost at large batches) and doubles
the tokens a GPU's memory holds.

fp8 values are stored with a scale of 1, as vLLM does for checkpoints that carry no K/V scales:
each value rounds to the nearest float8_e4m3fn (3 mantissa bits, so a relative error of at most
1/16) and saturates at +-448, its largest finite value. Attention reads them back in the model's
dtype. Keys after Qwen3's per-head RMSNorm and values of a few units sit well inside that range."""

import torch

KV_CACHE_DTYPES = ("auto", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for a name of KV_CACHE_DTYPES (EngineConfig checks the name)."""
    return model_dtype if name == "auto" else FP8


def kv_cache_dtype_problems(model_dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> list[str]:
    """For a backend's validate: why it cannot hold that cache, when it reads caches of the model's
    dtype and fp8 (stored as to_cache_dtype stores them)."""
    if kv_cache_dtype in (model_dtype, FP8):
        return []
    return [f"kv_cache_dtype must be the model's dtype or {FP8}, got {kv_cache_dtype}"]


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as stored in a cache of cache_dtype: fp8 rounds to nearest even and saturates (a plain
    cast would turn values past 448 into NaN)."""
    if cache_dtype == FP8:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x.to(cache_dtype)
