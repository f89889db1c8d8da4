"""Attention with FlashAttention 2 over the paged cache: inferlab's Triton kernel stores new K/V,
flash_attn_varlen_func with block tables computes prefill (cached prefixes, chunks) and
flash_attn_with_kvcache computes decode. flash-attn is imported only when this backend is built."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferlab.core.batch import AttentionInputs
from inferlab.core.hookspecs import hookimpl
from inferlab.plugins.attention.triton_backend import TritonBackend, import_kernels

# flash-attn's paged KV path rejects other block sizes ("must be divisible by 256")
PAGED_BLOCK_MULTIPLE = 256


@dataclass(slots=True)
class FlashAttnMetadata:
    inputs: AttentionInputs
    cu_seqlens_k: torch.Tensor | None  # int32 [B+1]: prefix sums of seq_lens; None for decode


class FlashAttnBackend:
    """K/V cache layout: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V), as the
    torch backend's; K and V are each the [num_blocks, block_size, Hkv, D] tensor flash-attn pages."""

    name = "flash_attn"
    supports_cuda_graphs = True

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
        self.store_kv = import_kernels()[1].store_kv

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
        else:
            try:
                import_kernels()
                from inferlab.kernels.pdl import kernel_mode_problems

                reasons += kernel_mode_problems(device)
            except ImportError as e:
                reasons.append(str(e))
        if dtype not in (torch.float16, torch.bfloat16):
            reasons.append(f"flash-attn needs dtype float16 or bfloat16, got {dtype}")
        if block_size % PAGED_BLOCK_MULTIPLE:
            reasons.append(
                f"flash-attn's paged KV cache needs a block size that is a multiple of "
                f"{PAGED_BLOCK_MULTIPLE}, got {block_size} (use attention='triton' for smaller blocks)"
            )
        if head_dim % 8 or head_dim > 256:
            reasons.append(f"flash-attn needs head_dim a multiple of 8 and at most 256, got {head_dim}")
        return reasons

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    kv_store_target = TritonBackend.kv_store_target  # the same cache layout and slot_mapping

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
