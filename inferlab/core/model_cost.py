"""What a model costs a device: its weight bytes, K/V bytes and FLOPs per token, and the rates of
a device that runs it. The real runner sizes its prefill graphs from it, the simulator's roofline
estimate and the bench's hardware floor time it."""

from dataclasses import dataclass

import torch


@dataclass
class DeviceRates:
    name: str
    bandwidth: float  # bytes/s, a large device-to-device copy counting bytes read + written
    matmul_rate: float  # FLOP/s, a large square matmul in the model's dtype


@dataclass
class ModelCost:
    weight_bytes: int
    kv_bytes_per_token: int
    flops_per_token: float  # the matmuls' 2 * parameters, lm_head included
    head_flops_per_token: float  # the lm_head's share: prefill pays it once a request, for the last prompt token
    attention_flops_per_pair: float  # QK^T and PV for one (query, key) pair over all layers


def model_cost(
    hf_config, dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None, tensor_parallel_size: int = 1
) -> ModelCost:
    """The costs, on one of `tensor_parallel_size` ranks, of a model whose weights are in dtype and
    K/V cache in kv_cache_dtype (default dtype). A rank holds its share of the attention heads, of
    the MLP's intermediate features and of the (padded) vocabulary; with fewer KV heads than ranks
    it holds a replica of one KV head. The norms' weights are too small to count."""
    c, ranks = hf_config, tensor_parallel_size
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    heads = c.num_attention_heads // ranks
    kv_heads = max(1, c.num_key_value_heads // ranks)
    per_layer = (
        c.hidden_size * (heads + 2 * kv_heads) * head_dim
        + heads * head_dim * c.hidden_size
        + 3 * c.hidden_size * c.intermediate_size // ranks
    )
    head = -(-c.vocab_size // ranks) * c.hidden_size
    tied = bool(getattr(c, "tie_word_embeddings", False))
    params = c.num_hidden_layers * per_layer + head * (1 if tied else 2)
    size = dtype.itemsize
    kv_size = (kv_cache_dtype or dtype).itemsize
    return ModelCost(
        weight_bytes=params * size,
        kv_bytes_per_token=2 * c.num_hidden_layers * kv_heads * head_dim * kv_size,
        flops_per_token=2.0 * (c.num_hidden_layers * per_layer + head),
        head_flops_per_token=2.0 * head,
        attention_flops_per_pair=4.0 * c.num_hidden_layers * heads * head_dim,
    )
