"""The decoder-only transformer that Qwen3 and the Llama family (Llama, Mistral, Qwen2) share,
written for tensor parallelism (column/row-parallel linears, vocab-parallel embedding and LM head):
pre-norm layers whose residual add is fused into the norms, attention through the selected backend
over the paged cache, a SwiGLU MLP, and the loading of its safetensors checkpoint. A model plugin
subclasses DecoderForCausalLM and says where its architecture differs: per-head q/k RMSNorm
(qk_norm) and which projections carry a bias (biases)."""

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from inferlab.core.parallel import SINGLE, TPGroup
from inferlab.core.protocols import DecodesFromQKV, FusedKVStore
from inferlab.plugins.models.checkpoint import CheckpointError, read_tensors, weight_files
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


class ModelKernels(NamedTuple):
    """The Triton kernels the model runs in place of its torch code (DecoderOptions.triton_kernels)."""

    # q/k rotary (+ the K/V store), reading the QKV projection's output, with the per-head q/k
    # RMSNorm first (qk_norm_rope) or without (rotary): both kernels/qk_norm_rope.py
    qk_rotary: Callable
    silu_and_mul: Callable  # kernels/silu_mul.py
    rms_norm: Callable  # these two: kernels/rms_norm.py
    add_rms_norm: Callable

    @property
    def norms(self) -> tuple[Callable, Callable]:
        return self.rms_norm, self.add_rms_norm


class Biases(NamedTuple):
    """Which projections carry a bias."""

    qkv: bool
    o: bool
    mlp: bool


class Attention(nn.Module):
    def __init__(self, config, backend, tp: TPGroup, fused: bool, biases: Biases, qk_norm: bool, qk_rotary=None):
        """qk_norm: a per-head RMSNorm of q and k before the rotary (Qwen3). qk_rotary: the fused
        Triton kernel for (the norms and) the rotary, or None for the torch code."""
        super().__init__()
        head_dim = head_dim_of(config)
        self.backend = backend
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads, tp, bias=biases.qkv
        )
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, tp, bias=biases.o)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, fused, per_head=True)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, fused, per_head=True)
        else:
            self.q_norm = self.k_norm = None
        self.scale = head_dim**-0.5
        self.qk_rotary = qk_rotary
        self.kv_store_target = backend.kv_store_target if isinstance(backend, FusedKVStore) else None
        # the backend may take the QKV rows as they come in decode steps, where the rotary is the
        # cos/sin table the kernels read
        self.decodes_from_qkv = qk_rotary is not None and isinstance(backend, DecodesFromQKV)

    def forward(self, positions, hidden, kv_cache, rotary, attn_metadata):
        return self.o_proj(self.attend(positions, self.qkv_proj(hidden), kv_cache, rotary, attn_metadata))

    def attend(self, positions, qkv, kv_cache, rotary, attn_metadata, after_gemv=False):
        """Attention over the QKV projection's output: [T, heads * head_dim], o_proj's input.
        after_gemv: the projection ran as a GEMV (one token), and the backend may then take its
        rows as they are (DecodesFromQKV), one kernel fewer than the q/k kernel's path. Not after
        the GEMMs of larger batches, whose decode graphs it made slower (the attention kernel,
        launched early under PDL, likely held multiprocessors the GEMM's later waves needed;
        BENCHMARKS.md, "One sequence")."""
        if after_gemv and self.decodes_from_qkv and self.backend.decodes_qkv(attn_metadata):
            norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            out = self.backend.decode_qkv(
                qkv, positions, rotary.cos_sin, norm, self.num_heads, kv_cache, attn_metadata, self.scale
            )
            return out.reshape(-1, self.num_heads * self.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_rotary is not None:
            # where the backend lets it, the kernel also stores k and v, one kernel less a layer
            kv_store = self.kv_store_target(kv_cache, attn_metadata) if self.kv_store_target else None
            if self.q_norm is not None:
                q, k = self.qk_rotary(
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
            else:
                q, k = self.qk_rotary(
                    qkv, positions, rotary.cos_sin, self.num_heads, self.num_kv_heads, self.head_dim, kv_store
                )
            if kv_store is not None:
                v = None
        else:
            q = qkv[:, :q_size].view(-1, self.num_heads, self.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, config, tp: TPGroup, fused: bool, bias: bool, silu_mul_kernel=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, tp, bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp, bias)
        self.act = silu_mul_kernel or (compiled(silu_and_mul) if fused else silu_and_mul)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemvPlan(NamedTuple):
    """How one token runs through a layer's GEMVs (DecoderLayer.forward_gemv): the split of K for
    o_proj and down_proj (1: unsplit, their output in the model dtype) and the rows a program of
    theirs takes (None: a slab of whole rows; see kernels/gemv.py's tiling), whether the norms and
    SiLU*mul are formed inside the GEMVs (fused), whether the weights are read before the PDL wait
    (preload), and the GEMV (kernels/gemv.py's)."""

    o_split: int
    down_split: int
    o_rows: int | None
    down_rows: int | None
    fused: bool
    preload: bool
    gemv: Callable


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        backend,
        tp: TPGroup,
        fused: bool,
        biases: Biases,
        qk_norm: bool,
        kernels: ModelKernels | None = None,
        split_k_tokens: int = 0,
        triton_gemm_tokens: int = 0,
        gemv: GemvPlan | None = None,
    ):
        """split_k_tokens, triton_gemm_tokens: see DecoderOptions (only with kernels, whose norms sum
        the partials; each projection takes them only where it has no bias). gemv: how a single
        token runs through the layer's GEMVs (gemv_plan), or None."""
        super().__init__()
        self.gemv = gemv
        norms = kernels.norms if kernels else None
        self.self_attn = Attention(config, backend, tp, fused, biases, qk_norm, kernels.qk_rotary if kernels else None)
        self.mlp = MLP(config, tp, fused, biases.mlp, kernels.silu_and_mul if kernels else None)
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
        if self.gemv is not None and hidden.shape[-2] == 1:
            return self.forward_gemv(positions, hidden, residual, kv_cache, rotary, attn_metadata)
        hidden, residual = self.first_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, rotary, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def first_norm(self, hidden, residual):
        """(input_layernorm of hidden, the residual): the first layer's input is its own residual,
        the others add theirs first."""
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)

    def forward_gemv(self, positions, hidden, residual, kv_cache, rotary, attn_metadata):
        """forward for one token through GEMVs (kernels/gemv.py). With plan.fused each norm and
        SiLU*mul is formed inside the GEMV after it, so the layer runs the GEMVs and attention's
        kernels alone. hidden may be the previous layer's split-K partials, as it may return them."""
        plan, attn, mlp = self.gemv, self.self_attn, self.mlp
        gemv = functools.partial(plan.gemv, preload=plan.preload)
        input_norm, post_norm = self.input_layernorm, self.post_attention_layernorm
        if plan.fused:
            qkv, summed = gemv(
                hidden, attn.qkv_proj.weight, norm_weight=input_norm.weight, eps=input_norm.eps, residual=residual
            )
            residual = hidden if residual is None else summed
        else:
            hidden, residual = self.first_norm(hidden, residual)
            qkv, _ = gemv(hidden, attn.qkv_proj.weight)
        attended = attn.attend(positions, qkv, kv_cache, rotary, attn_metadata, after_gemv=True)
        hidden, _ = gemv(attended, attn.o_proj.weight, split=plan.o_split, rows=plan.o_rows)
        if plan.fused:
            gate_up, residual = gemv(
                hidden, mlp.gate_up_proj.weight, norm_weight=post_norm.weight, eps=post_norm.eps, residual=residual
            )
            down = gemv(gate_up, mlp.down_proj.weight, split=plan.down_split, rows=plan.down_rows, silu_mul=True)
            return down[0], residual
        hidden, residual = post_norm(hidden, residual)
        gate_up, _ = gemv(hidden, mlp.gate_up_proj.weight)
        return gemv(mlp.act(gate_up), mlp.down_proj.weight, split=plan.down_split, rows=plan.down_rows)[0], residual


# checkpoint name fragment -> (our fragment, shard id) for projections stored fused here
PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
SHARDS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}
# checkpoint tensors that hold no weights: the rotary frequencies some Llama exports include
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class DecoderOptions:
    """The model's switches, typed for Hydra (`model=llama model.triton_kernels=false`).
    torch_compile: fuse the elementwise chains (norms, rotary, SiLU) with torch.compile;
    triton_kernels: our Triton kernels (ModelKernels: (q/k norms +) rotary, SiLU*mul, the hidden
    RMSNorms) instead. None means on CUDA only, for both (and for the Triton kernels, only where
    they can run: Triton importable, a power-of-two head_dim)."""

    torch_compile: bool | None = None
    triton_kernels: bool | None = None
    # Batches of at most this many tokens run o_proj and down_proj as split-K Triton GEMMs whose
    # partial sums the next RMSNorm kernel adds up (kernels/split_k_gemm.py), on one GPU, with the
    # Triton kernels, where the projection's shape gains (narrow ones up to 256 tokens, wide and
    # deep ones such as Qwen3-8B's up to 64). 0: cuBLAS always. 256 (every decode step of the bench)
    # made the bench faster than 64 or 0 (BENCHMARKS.md, "Why the defaults are what they are").
    split_k_tokens: int = 256
    # Batches of at most this many tokens run qkv_proj and gate_up_proj through our Triton GEMM
    # (kernels/split_k_gemm.py's linear, launched with PDL) instead of cuBLAS, with the Triton
    # kernels. 0: never. Above 64, cuBLAS is faster (BENCHMARKS.md, "Why the defaults are what they
    # are").
    triton_gemm_tokens: int = 64
    # A single token (one sequence's decode step) runs each layer's projections as GEMVs
    # (kernels/gemv.py, DecoderLayer.forward_gemv) where it can: on one GPU, with the Triton
    # kernels, no projection with a bias. gemv_fused: the norms and SiLU*mul formed inside the GEMVs
    # instead of kernels of their own; None: where the row that every program then reads (the
    # previous projection's output, the residual and the norm's weight) is no larger than two of
    # its weight slabs (Qwen3-0.6B's 16 KB row; Qwen3-8B's 24 KB with o_proj and down_proj unsplit,
    # where down_proj split 3 ways left a 64 KB row that made fusing slower). gemv_preload=false
    # reads the weights after the PDL wait. Each default was the fastest form of one sequence's
    # decode step (BENCHMARKS.md, "One sequence").
    gemv_decode: bool = True
    gemv_fused: bool | None = None
    gemv_preload: bool = True


class DecoderForCausalLM(nn.Module):
    """A decoder-only causal LM from its HF config. Subclasses set architectures (ServesArchitectures),
    config_defaults (ConfigDefaults), qk_norm and, where they differ from the config's attention_bias
    and mlp_bias, biases."""

    architectures: ClassVar[tuple[str, ...]] = ()
    config_defaults: ClassVar[dict[str, dict]] = {}
    qk_norm: ClassVar[bool] = False  # a per-head RMSNorm of q and k before the rotary
    # forward runs one layer per KV cache it is given (RepresentativeLayers). The first layer
    # norms its input alone, the others add the residual first; every later layer launches the
    # second's kernels on the same shapes.
    kernel_variant_layers: ClassVar[int] = 2

    @classmethod
    def biases(cls, config) -> Biases:
        attention = bool(getattr(config, "attention_bias", False))
        return Biases(qkv=attention, o=attention, mlp=bool(getattr(config, "mlp_bias", False)))

    def __init__(
        self,
        hf_config,
        *,
        backend,
        tp_group: TPGroup = SINGLE,
        dtype=None,
        device=None,
        max_model_len: int | None = None,
        torch_compile: bool | None = None,
        triton_kernels: bool | None = None,
        split_k_tokens: int = DecoderOptions.split_k_tokens,
        triton_gemm_tokens: int = DecoderOptions.triton_gemm_tokens,
        gemv_decode: bool = DecoderOptions.gemv_decode,
        gemv_fused: bool | None = DecoderOptions.gemv_fused,
        gemv_preload: bool = DecoderOptions.gemv_preload,
    ):
        """max_model_len: the longest sequence the engine will run (default: the config's
        max_position_embeddings). Options: see DecoderOptions."""
        super().__init__()
        for name, value in (("split_k_tokens", split_k_tokens), ("triton_gemm_tokens", triton_gemm_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: off), got {value!r}")
        for name, value in (("gemv_decode", gemv_decode), ("gemv_fused", gemv_fused), ("gemv_preload", gemv_preload)):
            if not isinstance(value, bool) and (value is not None or name != "gemv_fused"):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        check_config(hf_config, max_model_len or hf_config.max_position_embeddings)
        on_cuda = device is not None and torch.device(device).type == "cuda"
        fused = on_cuda if torch_compile is None else bool(torch_compile)
        kernels = triton_kernels_for(hf_config, self.qk_norm, on_cuda, triton_kernels)
        biases = self.biases(hf_config)
        gemv = gemv_plan(hf_config, dtype, kernels, tp_group, biases, gemv_fused, gemv_preload) if gemv_decode else None
        theta, scaling = rope_settings(hf_config)
        # first, so that unsupported rotary scaling fails before the weights are allocated
        self.rotary = RotaryEmbedding(
            head_dim_of(hf_config), hf_config.max_position_embeddings, theta, fused, scaling=scaling
        )
        self.config = hf_config
        self.tp = tp_group
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, tp_group)
        self.layers = nn.ModuleList(
            DecoderLayer(
                hf_config,
                backend,
                tp_group,
                fused,
                biases,
                self.qk_norm,
                kernels,
                split_k_tokens,
                triton_gemm_tokens,
                gemv,
            )
            for _ in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(
            hf_config.hidden_size, hf_config.rms_norm_eps, fused, kernels=kernels.norms if kernels else None
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp_group)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def kv_cache_spec(self) -> tuple[int, int, int]:
        attn = self.layers[0].self_attn
        return len(self.layers), attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):  # fewer caches: fewer layers (kernel_variant_layers)
            hidden, residual = layer(positions, hidden, residual, kv_cache, self.rotary, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states):
        return self.lm_head(hidden_states)

    def load_weights(self, path: str) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        first = next(iter(params.values()))
        loaded: dict[Any, tuple[str, str]] = {}  # (param name, shard id) -> (file, tensor name)
        unexpected = []
        for file, ckpt_name, tensor in read_tensors(weight_files(path), first.dtype, first.device):
            if ckpt_name.endswith(IGNORED_SUFFIXES):
                continue
            target, shard_id = _map_name(ckpt_name)
            if target == "lm_head.weight" and self.tie_word_embeddings:
                continue  # the embedding serves as the head
            if target not in params:
                unexpected.append(ckpt_name)
                continue
            key = target if shard_id is None else (target, shard_id)
            if key in loaded:
                raise CheckpointError(
                    f"tensor {ckpt_name!r} of {file!r} is in the checkpoint twice: {loaded[key][1]!r} of "
                    f"{loaded[key][0]!r} gives the same weight; remove the stray file or tensor"
                )
            module = self.get_submodule(target.rsplit(".", 1)[0])
            try:
                module.load(params[target], tensor, ckpt_name, shard_id)
            except CheckpointError:
                raise
            except ValueError as e:  # a shape that does not fit
                raise CheckpointError(f"weight file {file!r}: {e}") from None
            loaded[key] = (file, ckpt_name)
        if unexpected:
            raise CheckpointError(f"checkpoint {path!r} has tensors the model does not know: {sorted(unexpected)[:20]}")
        missing = []
        for name, module in self.named_modules():
            for suffix, _ in module.named_parameters(recurse=False):
                full = f"{name}.{suffix}"
                if full == "lm_head.weight" and self.tie_word_embeddings:
                    continue
                shards = SHARDS.get(name.rsplit(".", 1)[-1])
                needed = [(full, s) for s in shards] if shards else [full]
                missing += [_checkpoint_name(n) for n in needed if n not in loaded]
        if missing:
            raise CheckpointError(f"checkpoint {path!r} lacks tensors the model needs: {missing[:20]}")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_settings(config) -> tuple[float, dict | None]:
    """(rope_theta, the scaling dict with its rope_type, or None) from transformers 5's
    rope_parameters or from transformers 4's rope_theta and rope_scaling (whose type may be
    spelt `type`, as in older config.json files)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    merged = {**scaling, **params}
    if any(isinstance(value, dict) for value in merged.values()):
        raise ValueError(f"rotary parameters per layer type are not supported: {merged!r}")
    theta = merged.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
    merged["rope_type"] = merged.get("rope_type", merged.pop("type", None)) or "default"
    partial = merged.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported: the rotary covers the whole head")
    return float(theta), (merged if merged["rope_type"] != "default" else None)


def sliding_window_of(config) -> int | None:
    """The attention window some layer of the model uses, or None when every layer attends to the
    whole sequence. Mistral sets sliding_window; Qwen2 and Qwen3 also need use_sliding_window and
    apply it from layer max_window_layers on (transformers 5 writes that out as layer_types)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    first_sliding = getattr(config, "max_window_layers", None)
    if first_sliding is not None and first_sliding >= config.num_hidden_layers:
        return None
    return window


def check_config(config, max_model_len: int) -> None:
    """Raises for what the shared decoder does not compute: another activation than SiLU, an
    attention window shorter than the sequences (the rotary's scaling is checked as it is built)."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; supported: 'silu'")
    window = sliding_window_of(config)
    if window is not None and window < max_model_len:
        raise ValueError(
            f"the model attends within a sliding window of {window} tokens (config sliding_window), shorter "
            f"than max_model_len={max_model_len}; sliding-window attention is not implemented: set "
            f"max_model_len <= {window}"
        )


def triton_kernels_for(config, qk_norm: bool, on_cuda: bool, asked: bool | None) -> ModelKernels | None:
    """The Triton kernels, or None for the torch code. They need Triton and a power-of-two head_dim.
    Asked for (True) where they cannot run, that is an error; by default (None) they are used on
    CUDA where they can run, and the torch code otherwise."""
    if asked is False or (asked is None and not on_cuda):
        return None
    head_dim = head_dim_of(config)
    problem = None
    if head_dim < 16 or head_dim & (head_dim - 1):
        problem = f"triton_kernels needs a power-of-two head_dim >= 16, got {head_dim}"
    else:
        try:
            from inferlab.kernels import rms_norm
            from inferlab.kernels.qk_norm_rope import qk_norm_rope, rotary
            from inferlab.kernels.silu_mul import silu_and_mul as silu_mul_kernel
        except ImportError as e:
            problem = f"triton_kernels needs Triton, which does not import: {e}"
    if problem is None:
        return ModelKernels(
            qk_norm_rope if qk_norm else rotary, silu_mul_kernel, rms_norm.rms_norm, rms_norm.add_rms_norm
        )
    if asked:
        raise ValueError(f"{problem}; set model_options.triton_kernels=false")
    log.info("%s; using the torch code for the norms, rotary and SiLU*mul", problem)
    return None


def gemv_plan(
    config, dtype, kernels: ModelKernels | None, tp: TPGroup, biases: Biases, fused: bool | None, preload: bool
):
    """The layers' GemvPlan, or None where the GEMVs cannot serve: they need the Triton kernels
    (without them, as on CPU by default, quietly), one rank, no biases and weights the GEMV tiles
    (gemv.slab_columns); the reason is logged. fused: see DecoderOptions.gemv_fused."""
    if kernels is None:
        return None
    problem = None
    if tp.size > 1:
        problem = "it runs on one GPU only"
    elif any(biases):
        problem = "it has no bias add"
    if problem is None:
        from inferlab.kernels import gemv

        hidden, inter = config.hidden_size, config.intermediate_size
        head_dim = head_dim_of(config)
        qkv_out = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
        q_width = config.num_attention_heads * head_dim
        o_rows, down_rows = gemv.unsplit_rows(hidden, q_width), gemv.unsplit_rows(hidden, inter)
        o_split, down_split = (
            gemv.splits_for(hidden, q_width, rows=o_rows),
            gemv.splits_for(hidden, inter, rows=down_rows),
        )
        wide = gemv.slab_columns(qkv_out, hidden) and gemv.slab_columns(2 * inter, hidden)
        if o_split is None or down_split is None or not wide:
            problem = f"no GEMV tiling fits these shapes (hidden {hidden}, intermediate {inter}, head_dim {head_dim})"
        else:
            if fused is None:
                # the projection's output before each norm (float32 partials where split), then the
                # residual and the norm's weight in the model dtype, read by every program
                size = torch.empty((), dtype=dtype or torch.get_default_dtype()).element_size()
                row_bytes = max(
                    hidden * ((4 * split if split > 1 else size) + 2 * size) for split in (o_split, down_split)
                )
                fused = row_bytes <= 2 * gemv.SLAB * size
            return GemvPlan(o_split, down_split, o_rows, down_rows, fused, preload, gemv.gemv)
    log.info("gemv_decode is off: %s", problem)
    return None


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
