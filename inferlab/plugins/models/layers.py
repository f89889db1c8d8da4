"""Tensor-parallel building blocks for decoder models: each linear layer holds this rank's shard
and knows how to cut it from a checkpoint tensor. A checkpoint tensor arrives as a safetensors
slice (or a tensor), so a rank reads only its shard from disk."""

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from inferlab.core.parallel import TPGroup


def source_shape(src) -> tuple[int, ...]:
    return tuple(src.get_shape()) if hasattr(src, "get_shape") else tuple(src.shape)


def read(src, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
    """src[..., start:start+length, ...] along dim (everything when dim is None), as a tensor."""
    if dim is None:
        return src[:]
    index = (slice(None),) * dim + (slice(start, start + length),)
    return src[index]


def copy_checked(param: torch.Tensor, value: torch.Tensor, name: str):
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(
            f"tensor {name!r}: checkpoint shard has shape {tuple(value.shape)}, the model expects {tuple(param.shape)}"
        )
    param.data.copy_(value)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks; the output stays sharded.

    After use_triton_gemm(n), batches of up to n tokens go through inferlab.kernels.split_k_gemm.linear instead
    of cuBLAS."""

    triton_tokens = 0
    _triton_linear = None

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.out_per_rank = tp.split(out_features, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None

    def use_triton_gemm(self, max_tokens: int) -> bool:
        """Run batches of up to max_tokens tokens through our Triton GEMM where it tiles the
        weight and there is no bias. Whether it will."""
        if max_tokens <= 0 or self.bias is not None:
            return False
        from inferlab.kernels import split_k_gemm

        if split_k_gemm.wide_plan(*self.weight.shape) is None:
            return False
        self.triton_tokens, self._triton_linear = max_tokens, split_k_gemm.linear
        return True

    def forward(self, x):
        if self._triton_linear is not None and x.shape[0] <= self.triton_tokens:
            return self._triton_linear(x, self.weight)
        return F.linear(x, self.weight, self.bias)

    def load(self, param: nn.Parameter, src, name: str, shard_id=None):
        copy_checked(param, read(src, 0, self.tp.rank * self.out_per_rank, self.out_per_rank), name)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (gate and up): shard_id picks the part."""

    def __init__(self, in_features: int, out_sizes: list[int], tp: TPGroup, bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), tp, bias)

    def load(self, param, src, name, shard_id=None):
        size = self.out_sizes[shard_id] // self.tp.size
        offset = sum(self.out_sizes[:shard_id]) // self.tp.size
        expected = (self.out_sizes[shard_id],) + tuple(param.shape[1:])
        if source_shape(src) != expected:
            raise ValueError(f"tensor {name!r}: checkpoint has shape {source_shape(src)}, the model expects {expected}")
        param.data.narrow(0, offset, size).copy_(read(src, 0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul. Query heads are split across ranks; KV heads too, or,
    when there are fewer KV heads than ranks, each rank keeps a replica of the one its queries use."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TPGroup, bias: bool = False):
        self.head_dim = head_dim
        self.num_heads = tp.split(num_heads, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = tp.split(num_kv_heads, "KV heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({tp.size}) must be a multiple of the KV heads ({num_kv_heads})"
                )
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        self.total_num_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        nn.Module.__init__(self)
        self.tp = tp
        self.out_per_rank = out
        self.weight = nn.Parameter(torch.empty(out, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def load(self, param, src, name, shard_id=None):
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, start, total_heads = 0, q_size, self.tp.rank * q_size, self.num_heads * self.tp.size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start, total_heads = kv_size, self.kv_head_start * d, self.total_num_kv_heads
        expected = (total_heads * d,) + tuple(param.shape[1:])
        if source_shape(src) != expected:
            raise ValueError(f"tensor {name!r}: checkpoint has shape {source_shape(src)}, the model expects {expected}")
        param.data.narrow(0, offset, size).copy_(read(src, 0, start, size))


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced.

    After return_partials(n), batches of up to n tokens (or as many as the weight's split-K plan
    covers) get float32 split-K partials [S, T, out] instead of y (inferlab.kernels.split_k_gemm),
    for a next kernel that sums them as it reads them."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.in_per_rank = tp.split(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.partials_tokens, self._split_k = 0, None

    def return_partials(self, max_tokens: int) -> bool:
        """Return split-K partials for batches of up to max_tokens tokens, or fewer where the
        weight's shape gains from a split only at fewer (split_k_gemm.plan), when nothing has to
        follow the GEMM here: one rank (no all-reduce), no bias. Whether it will."""
        if max_tokens <= 0 or self.tp.size > 1 or self.bias is not None:
            return False
        from inferlab.kernels import split_k_gemm

        tokens = split_k_gemm.max_planned_tokens(*self.weight.shape, max_tokens)
        if not tokens:
            return False
        self.partials_tokens, self._split_k = tokens, split_k_gemm.linear_partials
        return True

    def forward(self, x):
        if self._split_k is not None and x.shape[0] <= self.partials_tokens:
            return self._split_k(x, self.weight)
        # The bias is added once, after the reduction, not once per rank.
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def load(self, param, src, name, shard_id=None):
        if param is self.bias:
            return copy_checked(param, read(src), name)
        copy_checked(param, read(src, 1, self.tp.rank * self.in_per_rank, self.in_per_rank), name)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks (vocab padded to a multiple of the TP size); each rank
    looks up the ids it holds and the all-reduce fills in the rest."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.row_start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden), requires_grad=False)

    def forward(self, ids):
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.row_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        y = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight) * mine.unsqueeze(-1)
        return self.tp.all_reduce(y)

    def load(self, param, src, name, shard_id=None):
        full = source_shape(src)
        if full[1:] != tuple(param.shape[1:]) or full[0] != self.vocab_size:
            raise ValueError(
                f"tensor {name!r}: checkpoint has shape {full}, the model expects "
                f"{(self.vocab_size,) + tuple(param.shape[1:])}"
            )
        rows = max(0, min(self.rows_per_rank, self.vocab_size - self.row_start))
        param.data.zero_()
        if rows:
            param.data[:rows].copy_(read(src, 0, self.row_start, rows))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over a vocab-sharded weight; logits are gathered to the full vocab."""

    def forward(self, hidden):
        logits = F.linear(hidden, self.weight)
        return self.tp.all_gather(logits, dim=-1)[:, : self.vocab_size]


@functools.cache
def compiled(fn):
    """fn under torch.compile: its chain of elementwise ops becomes one fused kernel. Compiled on
    the first call, so an engine that never calls it (the Triton kernels run in its place) never
    imports the compiler, which takes seconds; one code object for every layer, so no recompiles."""
    compiled_fn = None

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled_fn
        if compiled_fn is None:
            compiled_fn = torch.compile(fn, dynamic=True)
        return compiled_fn(*args)

    return run


def rms_norm(x, weight, eps: float):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(dtype) * weight


def rms_norm_heads(x, weight, eps: float):
    """rms_norm over each head of [tokens, heads, head_dim]: its own code object, so torch.compile
    keeps one graph per tensor rank instead of recompiling between the two uses."""
    return rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps: float):
    """(rms_norm(x + residual), x + residual): the residual add fused into the norm."""
    dtype = x.dtype
    x = x.float() + residual.float()
    residual = x.to(dtype)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(dtype) * weight, residual


class RMSNorm(nn.Module):
    """RMSNorm in float32; with `residual` it first adds it and returns the new residual too.
    fused=True runs it through torch.compile (for CUDA); kernels, a (rms_norm, add_rms_norm) pair
    with these functions' signatures (inferlab.kernels.rms_norm), replaces both."""

    def __init__(self, size: int, eps: float, fused: bool = False, per_head: bool = False, kernels=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        if kernels is not None:
            self.norm, self.add_norm = kernels
        else:
            norm = rms_norm_heads if per_head else rms_norm
            self.norm = compiled(norm) if fused else norm
            self.add_norm = compiled(add_rms_norm) if fused else add_rms_norm

    def forward(self, x, residual=None):
        if residual is None:
            return self.norm(x, self.weight, self.eps)
        return self.add_norm(x, residual, self.weight, self.eps)

    def load(self, param, src, name, shard_id=None):
        copy_checked(param, read(src), name)


ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """The rotary frequencies [head_dim / 2] in float32, as transformers computes them for
    scaling["rope_type"] (see ROPE_TYPES; no scaling: default) and the scaling's own fields."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
    if rope_type == "default":
        return inv_freq
    needed = ["factor"] + (
        ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"] if rope_type == "llama3" else []
    )
    absent = [key for key in needed if scaling.get(key) is None]
    if absent:
        raise ValueError(f"rope scaling of type {rope_type!r} needs {absent}; got {scaling!r}")
    factor = scaling["factor"]
    if rope_type == "linear":  # positions divided by factor, folded into the frequencies
        return inv_freq / factor
    # llama3: long wavelengths slowed by factor, short ones kept, a smooth blend in between
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half / NeoX layout) with a precomputed cos/sin table;
    scaling: see rope_inv_freq."""

    def __init__(self, head_dim: int, max_position: int, base: float, fused: bool = False, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        self.apply_rotary = compiled(apply_rotary) if fused else apply_rotary

    def forward(self, positions, q, k):
        return self.apply_rotary(self.cos_sin, positions, q, k)


def apply_rotary(cos_sin, positions, q, k):
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
