"""Qwen3ForCausalLM, written for tensor parallelism (column/row-parallel linears, vocab-parallel
embedding and LM head). Attention goes through the selected backend over the paged cache."""

import glob
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from inferlab.core.hookspecs import hookimpl
from inferlab.core.parallel import SINGLE, TPGroup
from inferlab.core.protocols import FusedKVStore
from inferlab.plugins.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    compiled,
    silu_and_mul,
)

log = logging.getLogger("inferlab")


class CheckpointError(ValueError):
    """The checkpoint's files or tensors do not match what the model needs."""


class ModelKernels(NamedTuple):
    """The Triton kernels the model runs in place of its torch code (Qwen3Options.triton_kernels)."""

    qk_norm_rope: Callable  # q/k per-head RMSNorm + rotary (+ the K/V store): kernels/qk_norm_rope.py
    silu_and_mul: Callable  # kernels/silu_mul.py
    rms_norm: Callable  # these two: kernels/rms_norm.py
    add_rms_norm: Callable

    @property
    def norms(self) -> tuple[Callable, Callable]:
        return self.rms_norm, self.add_rms_norm


class Qwen3Attention(nn.Module):
    def __init__(self, config, backend, tp: TPGroup, fused: bool, qk_norm_rope=None):
        """qk_norm_rope: the fused Triton kernel for q/k norm + rotary, or None for the unfused path."""
        super().__init__()
        head_dim = _head_dim(config)
        self.backend = backend
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            tp,
            bias=getattr(config, "attention_bias", False),
        )
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, tp, bias=getattr(config, "attention_bias", False)
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, fused, per_head=True)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, fused, per_head=True)
        self.scale = head_dim**-0.5
        self.qk_norm_rope = qk_norm_rope
        self.kv_store_target = backend.kv_store_target if isinstance(backend, FusedKVStore) else None

    def forward(self, positions, hidden, kv_cache, rotary, attn_metadata):
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm_rope is not None:
            # where the backend lets it, the kernel also stores k and v, one kernel less a layer
            kv_store = self.kv_store_target(kv_cache, attn_metadata) if self.kv_store_target else None
            q, k = self.qk_norm_rope(
                qkv,
                positions,
                self.q_norm.weight,
                self.k_norm.weight,
                rotary.cos_sin,
                self.q_norm.eps,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                kv_store,
            )
            if kv_store is not None:
                v = None
        else:
            q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
            q, k = rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata, self.scale)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class Qwen3MLP(nn.Module):
    def __init__(self, config, tp: TPGroup, fused: bool, silu_mul_kernel=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp)
        self.act = silu_mul_kernel or (compiled(silu_and_mul) if fused else silu_and_mul)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        backend,
        tp: TPGroup,
        fused: bool,
        kernels: ModelKernels | None = None,
        split_k_tokens: int = 0,
        triton_gemm_tokens: int = 0,
    ):
        """split_k_tokens, triton_gemm_tokens: see Qwen3Options (only with kernels, whose norms sum
        the partials)."""
        super().__init__()
        norms = kernels.norms if kernels else None
        self.self_attn = Qwen3Attention(config, backend, tp, fused, kernels.qk_norm_rope if kernels else None)
        self.mlp = Qwen3MLP(config, tp, fused, kernels.silu_and_mul if kernels else None)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused, kernels=norms)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused, kernels=norms)
        if kernels is not None:
            # each output goes only to an add + RMSNorm kernel: post_attention_layernorm, then the
            # next layer's input_layernorm or the model's final norm
            self.self_attn.o_proj.return_partials(split_k_tokens)
            self.mlp.down_proj.return_partials(split_k_tokens)
            self.self_attn.qkv_proj.use_triton_gemm(triton_gemm_tokens)
            self.mlp.gate_up_proj.use_triton_gemm(triton_gemm_tokens)

    def forward(self, positions, hidden, residual, kv_cache, rotary, attn_metadata):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, rotary, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


# checkpoint name fragment -> (our fragment, shard id) for projections stored fused here
PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass
class Qwen3Options:
    """The model's switches, typed for Hydra (`model=qwen3 model.triton_kernels=false`).
    torch_compile: fuse the elementwise chains (norms, rotary, SiLU) with torch.compile;
    triton_kernels: our Triton kernels (ModelKernels: q/k norms + rotary, SiLU*mul, the hidden
    RMSNorms) instead. None means on CUDA only, for both (and for the Triton kernels, only where
    they can run: Triton importable, a power-of-two head_dim)."""

    torch_compile: bool | None = None
    triton_kernels: bool | None = None
    # Batches of at most this many tokens run o_proj and down_proj as split-K Triton GEMMs whose
    # partial sums the next RMSNorm kernel adds up (kernels/split_k_gemm.py), on one GPU, with the
    # Triton kernels, where the projection is narrow enough to gain. 0: cuBLAS always. On an H200
    # the bench ran 3.3% faster with 256 (every decode step) than with 0, and 1.5% with 64.
    split_k_tokens: int = 256
    # Batches of at most this many tokens run qkv_proj and gate_up_proj through our Triton GEMM
    # (kernels/split_k_gemm.py's linear, launched with PDL) instead of cuBLAS, with the Triton
    # kernels. 0: never. On an H200 64 made the decoder stack 1.8% faster at 30 and 63 sequences
    # and the bench 0.4%, within its noise; 128 was 1.8% slower at 126.
    triton_gemm_tokens: int = 64


class Qwen3ForCausalLM(nn.Module):
    architectures = ("Qwen3ForCausalLM",)

    def __init__(
        self,
        hf_config,
        *,
        backend,
        tp_group: TPGroup = SINGLE,
        dtype=None,
        device=None,
        torch_compile: bool | None = None,
        triton_kernels: bool | None = None,
        split_k_tokens: int = Qwen3Options.split_k_tokens,
        triton_gemm_tokens: int = Qwen3Options.triton_gemm_tokens,
    ):
        """Options: see Qwen3Options."""
        super().__init__()
        for name, value in (("split_k_tokens", split_k_tokens), ("triton_gemm_tokens", triton_gemm_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: off), got {value!r}")
        on_cuda = device is not None and torch.device(device).type == "cuda"
        fused = on_cuda if torch_compile is None else bool(torch_compile)
        kernels = _triton_kernels(hf_config, on_cuda, triton_kernels)
        scaling = getattr(hf_config, "rope_scaling", None)
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling {scaling!r} is not supported by the qwen3 plugin; supported: none/default")
        self.config = hf_config
        self.tp = tp_group
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, tp_group)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(hf_config, backend, tp_group, fused, kernels, split_k_tokens, triton_gemm_tokens)
            for _ in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(
            hf_config.hidden_size, hf_config.rms_norm_eps, fused, kernels=kernels.norms if kernels else None
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp_group)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        attn = self.layers[0].self_attn
        self.rotary = RotaryEmbedding(attn.head_dim, hf_config.max_position_embeddings, _rope_theta(hf_config), fused)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        attn = self.layers[0].self_attn
        return len(self.layers), attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, self.rotary, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states):
        return self.lm_head(hidden_states)

    def load_weights(self, path: str) -> None:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weight files in {path!r}")
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):  # a sharded checkpoint must have every shard it lists
            with open(index) as f:
                listed = set(json.load(f)["weight_map"].values())
            absent = sorted(name for name in listed if not os.path.exists(os.path.join(path, name)))
            if absent:
                raise FileNotFoundError(f"weight files listed in {index!r} are missing: {absent}")
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded, unexpected = set(), []
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for ckpt_name in f.keys():
                    target, shard_id = _map_name(ckpt_name)
                    if target == "lm_head.weight" and self.tie_word_embeddings:
                        continue  # the embedding serves as the head
                    if target not in params:
                        unexpected.append(ckpt_name)
                        continue
                    module = self.get_submodule(target.rsplit(".", 1)[0])
                    module.load(params[target], f.get_slice(ckpt_name), ckpt_name, shard_id)
                    loaded.add(target if shard_id is None else (target, shard_id))
        if unexpected:
            raise CheckpointError(f"checkpoint {path!r} has tensors the model does not know: {sorted(unexpected)[:20]}")
        missing = []
        for name, module in self.named_modules():
            for suffix, _ in module.named_parameters(recurse=False):
                full = f"{name}.{suffix}"
                if full == "lm_head.weight" and self.tie_word_embeddings:
                    continue
                shards = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}.get(name.rsplit(".", 1)[-1])
                needed = [(full, s) for s in shards] if shards and suffix == "weight" else [full]
                missing += [_checkpoint_name(n) for n in needed if n not in loaded]
        if missing:
            raise CheckpointError(f"checkpoint {path!r} lacks tensors the model needs: {missing[:20]}")


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _triton_kernels(config, on_cuda: bool, asked: bool | None) -> ModelKernels | None:
    """The Triton kernels, or None for the torch code. They need Triton and a power-of-two head_dim.
    Asked for (True) where they cannot run, that is an error; by default (None) they are used on
    CUDA where they can run, and the torch code otherwise."""
    if asked is False or (asked is None and not on_cuda):
        return None
    head_dim = _head_dim(config)
    problem = None
    if head_dim < 16 or head_dim & (head_dim - 1):
        problem = f"triton_kernels needs a power-of-two head_dim >= 16, got {head_dim}"
    else:
        try:
            from inferlab.kernels import rms_norm
            from inferlab.kernels.qk_norm_rope import qk_norm_rope
            from inferlab.kernels.silu_mul import silu_and_mul as silu_mul_kernel
        except ImportError as e:
            problem = f"triton_kernels needs Triton, which does not import: {e}"
    if problem is None:
        return ModelKernels(qk_norm_rope, silu_mul_kernel, rms_norm.rms_norm, rms_norm.add_rms_norm)
    if asked:
        raise ValueError(f"{problem}; set model_options.triton_kernels=false")
    log.info("qwen3: %s; using the torch code for the norms, rotary and SiLU*mul", problem)
    return None


def _rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:  # transformers 5 keeps it in rope_parameters
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def _map_name(ckpt_name: str) -> tuple[str, Any]:
    name = ckpt_name.removeprefix("model.")
    for fragment, (ours, shard_id) in PACKED.items():
        if f".{fragment}." in name:
            return name.replace(fragment, ours), shard_id
    return name, None


def _checkpoint_name(loaded_key) -> str:
    if isinstance(loaded_key, tuple):
        name, shard_id = loaded_key
        theirs = {v: k for k, v in PACKED.items()}
        fused = "qkv_proj" if "qkv_proj" in name else "gate_up_proj"
        name = name.replace(fused, theirs[(fused, shard_id)])
    else:
        name = loaded_key
    return name if name.startswith("lm_head") else f"model.{name}"


@hookimpl
def register_models(register):
    register("qwen3", Qwen3ForCausalLM, options=Qwen3Options)
