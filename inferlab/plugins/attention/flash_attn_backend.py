"""Attention with FlashAttention 2 over the paged cache: inferlab's Triton K/V store kernel (or,
where Triton does not import, a torch store) writes new K/V, flash_attn_varlen_func with block
tables computes prefill (cached prefixes, chunks) and flash_attn_with_kvcache computes decode.
flash-attn is imported only when this backend is built."""

import functools
import importlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferlab.core.batch import AttentionInputs
from inferlab.core.hookspecs import hookimpl
from inferlab.core.kv_cache_dtype import to_cache_dtype

log = logging.getLogger("inferlab")

# flash-attn's paged KV path rejects other block sizes ("must be divisible by 256")
PAGED_BLOCK_MULTIPLE = 256


def import_triton_kv_store():
    """inferlab's Triton K/V store module, or the ImportError that says why Triton does not import
    (Triton fixes interpreter mode at import, so it is imported when the backend is built)."""
    try:
        return importlib.import_module("inferlab.kernels.kv_store")
    except ImportError as e:
        return e


@functools.cache
def build_problem(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the installed flash-attn build cannot run this head_dim, or None: builds may leave head
    dims out (a trimmed build serves multiples of 32 only), which only a call tells."""
    if device.type == "cuda" and not torch.cuda.is_available():  # a check on a machine without the GPU
        return None
    try:
        from flash_attn import flash_attn_func
    except ImportError as e:
        return f"flash-attn does not import ({e})"
    q = torch.zeros(1, 1, 1, head_dim, dtype=dtype, device=device)
    try:
        flash_attn_func(q, q, q)
    except RuntimeError as e:
        return f"the installed flash-attn build cannot run head_dim {head_dim}: {str(e).splitlines()[0]}"
    return None


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The K/V store in torch, for where Triton does not import: k, v [T, Hkv, D] into their slots.
    Every slot must be real (>= 0): only CUDA graphs' padding rows have none, and without Triton
    the runner captures no graphs (their input kernel is a Triton kernel too)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = to_cache_dtype(k, kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = to_cache_dtype(v, kv_cache.dtype)


@dataclass(slots=True)
class FlashAttnMetadata:
    inputs: AttentionInputs
    cu_seqlens_k: torch.Tensor | None  # int32 [B+1]: prefix sums of seq_lens; None for decode


class FlashAttnBackend:
    """K/V cache layout: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V), as the
    torch backend's; K and V are each the [num_blocks, block_size, Hkv, D] tensor flash-attn pages."""

    name = "flash_attn"
    supports_cuda_graphs = True
    auto_priority = {"cuda": 20}  # after triton, before torch

    def __init__(self, config=None, **options):
        if options:
            raise TypeError(f"the flash_attn backend takes no options, got {sorted(options)}")
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except (ImportError, OSError) as e:  # OSError: a build whose CUDA library does not load
            raise ImportError(
                f"flash-attn is not installed or does not load ({type(e).__name__}: {e}); "
                "install it with pip install 'inferlab[cuda]' (see README)"
            ) from e
        self.varlen_func = flash_attn_varlen_func
        self.with_kvcache = flash_attn_with_kvcache
        kv_store = import_triton_kv_store()
        if isinstance(kv_store, ImportError):
            log.info("flash_attn: Triton does not import (%s); new K/V are stored with torch", kv_store)
            self.store_kv = store_kv_torch
        else:
            self.store_kv = kv_store.store_kv

    @classmethod
    def validate(cls, device, dtype, block_size, head_dim, kv_cache_dtype) -> list[str]:
        reasons = []
        if kv_cache_dtype != dtype:  # flash-attn 2 reads a cache of the query's dtype only
            reasons.append(
                f"flash-attn needs the KV cache in the model's dtype {dtype}, got {kv_cache_dtype} "
                "(use attention='triton' for kv_cache_dtype=fp8)"
            )
        if device.type != "cuda":
            reasons.append(f"flash-attn runs on CUDA devices only, got {device.type!r}")
        elif not isinstance(import_triton_kv_store(), ImportError):  # without Triton a torch store serves
            from inferlab.kernels.pdl import kernel_mode_problems

            reasons += kernel_mode_problems(device)
        if dtype not in (torch.float16, torch.bfloat16):
            reasons.append(f"flash-attn needs dtype float16 or bfloat16, got {dtype}")
        if block_size % PAGED_BLOCK_MULTIPLE:
            reasons.append(
                f"flash-attn's paged KV cache needs a block size that is a multiple of "
                f"{PAGED_BLOCK_MULTIPLE}, got {block_size} (use attention='triton' for smaller blocks)"
            )
        if head_dim % 8 or head_dim > 256:
            reasons.append(f"flash-attn needs head_dim a multiple of 8 and at most 256, got {head_dim}")
        elif not reasons and (problem := build_problem(device, dtype, head_dim)):
            reasons.append(problem)
        return reasons

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def kv_store_target(self, kv_cache, metadata: FlashAttnMetadata):
        # K and V are contiguous halves of the cache, so a model's kernel may store into them
        return kv_cache[0], kv_cache[1], metadata.inputs.slot_mapping

    def build_metadata(self, inputs: AttentionInputs) -> FlashAttnMetadata:
        if inputs.is_decode:  # flash_attn_with_kvcache takes seq_lens itself
            return FlashAttnMetadata(inputs, None)
        cu_seqlens_k = F.pad(torch.cumsum(inputs.seq_lens, 0, dtype=torch.int32), (1, 0))
        return FlashAttnMetadata(inputs, cu_seqlens_k)

    def forward(self, q, k, v, kv_cache, metadata: FlashAttnMetadata, scale):
        inputs = metadata.inputs
        if k is not None:
            self.store_kv(k, v, kv_cache, inputs.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if inputs.is_decode:
            out = self.with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=inputs.seq_lens,
                block_table=inputs.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        # causal is bottom-right aligned: new token i of a sequence sees its context plus tokens <= i
        return self.varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=inputs.query_start_loc,
            cu_seqlens_k=metadata.cu_seqlens_k,
            max_seqlen_q=inputs.max_query_len,
            max_seqlen_k=inputs.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=inputs.block_tables,
        )


@hookimpl
def register_attention_backends(register):
    register("flash_attn", FlashAttnBackend)
