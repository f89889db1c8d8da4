"""Attention with torch's scaled_dot_product_attention over the paged cache. Runs wherever torch
runs (CPU and CUDA); it is the reference the other backends are tested against, not the fast one."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferlab.core.batch import AttentionInputs
from inferlab.core.hookspecs import hookimpl
from inferlab.core.kv_cache_dtype import kv_cache_dtype_problems, to_cache_dtype


@dataclass(slots=True)
class TorchMetadata:
    inputs: AttentionInputs
    token_seq: torch.Tensor  # int64 [T]: which sequence each new token belongs to
    token_row: torch.Tensor  # int64 [T]: its row within that sequence's padded queries
    mask: torch.Tensor  # bool [B, 1, max_q, max_k]: causal over cached + new tokens, no padding


class TorchBackend:
    """K/V cache layout: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V)."""

    name = "torch"
    supports_cuda_graphs = False  # build_metadata reads token counts back to the host
    auto_priority = {"cuda": 10, "cpu": 10}  # the fallback on CUDA; the choice on CPU, where Triton only interprets

    def __init__(self, config=None, **options):
        if options:
            raise TypeError(f"the torch backend takes no options, got {sorted(options)}")

    @classmethod
    def validate(cls, device, dtype, block_size, head_dim, kv_cache_dtype) -> list[str]:
        reasons = kv_cache_dtype_problems(dtype, kv_cache_dtype)
        if block_size < 16 or block_size & (block_size - 1):
            reasons.append(f"block size must be a power of two >= 16, got {block_size}")
        return reasons

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, inputs: AttentionInputs) -> TorchMetadata:
        device = inputs.seq_lens.device
        starts = inputs.query_start_loc.long()
        query_lens = starts[1:] - starts[:-1]
        num_tokens = int(starts[-1])
        token_seq = torch.repeat_interleave(
            torch.arange(inputs.num_seqs, device=device), query_lens, output_size=num_tokens
        )
        token_row = torch.arange(num_tokens, device=device) - starts[token_seq]
        max_k = inputs.block_tables.shape[1] * inputs.block_size
        # query row r of sequence b sits at absolute position context_len[b] + r
        query_pos = inputs.context_lens.long()[:, None] + torch.arange(inputs.max_query_len, device=device)[None, :]
        key_pos = torch.arange(max_k, device=device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        # padded query rows attend to key 0 so their (discarded) softmax stays finite
        mask[:, :, 0] = True
        return TorchMetadata(inputs, token_seq, token_row, mask.unsqueeze(1))

    def forward(self, q, k, v, kv_cache, metadata: TorchMetadata, scale):
        inputs = metadata.inputs
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
        k_cache.view(-1, num_kv_heads, head_dim)[inputs.slot_mapping] = to_cache_dtype(k, k_cache.dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[inputs.slot_mapping] = to_cache_dtype(v, v_cache.dtype)
        batch, max_q = inputs.num_seqs, inputs.max_query_len
        # gather each sequence's blocks into a contiguous [B, H, max_k, D] context, in q's dtype
        keys = k_cache[inputs.block_tables].flatten(1, 2).transpose(1, 2).to(q.dtype)
        values = v_cache[inputs.block_tables].flatten(1, 2).transpose(1, 2).to(q.dtype)
        queries = q.new_zeros(batch, max_q, q.shape[1], head_dim)
        queries[metadata.token_seq, metadata.token_row] = q
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys,
            values,
            attn_mask=metadata.mask,
            scale=scale,
            enable_gqa=q.shape[1] != num_kv_heads,
        )
        return out.transpose(1, 2)[metadata.token_seq, metadata.token_row]


@hookimpl
def register_attention_backends(register):
    register("torch", TorchBackend)
