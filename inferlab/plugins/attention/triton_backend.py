"""Attention with inferlab's own Triton kernels over the paged cache: the shared K/V store
(inferlab.kernels.kv_store), and this backend's causal varlen prefill that reads the cached prefix
through the block tables and split-context (flash-decoding) decode that serves all query heads of a
KV head at once (triton_kernels.py). Needs no flash-attn; on CPU it runs under TRITON_INTERPRET=1
(slowly: for tests)."""

from dataclasses import dataclass

import torch

from inferlab.core.batch import AttentionInputs
from inferlab.core.hookspecs import hookimpl
from inferlab.core.kv_cache_dtype import FP8, kv_cache_dtype_problems

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DECODE_ORDERS = ("longest_first", "batch")


def import_kernels():
    """The backend's Triton kernels and the K/V store, imported on first use (Triton fixes
    interpreter mode at import)."""
    try:
        from inferlab.kernels import kv_store
        from inferlab.plugins.attention import triton_kernels
    except ImportError as e:
        raise ImportError(
            f"the triton attention backend needs Triton, which does not import: {e}; "
            "install it with pip install 'inferlab[triton]'"
        ) from e
    return triton_kernels, kv_store


@dataclass
class TritonOptions:
    """The backend's tuning knobs, typed for Hydra (`attention=triton attention.decode_block_n=64`).
    Tile sizes left at None take 32 tokens x 32 keys (prefill: faster than 64 x 64 on a bench
    prefill chunk) and 128 keys (decode), or 16 in Triton's interpreter;
    min_split_len None takes 256 (16 in the interpreter)."""

    block_m: int | None = None
    block_n: int | None = None
    decode_block_n: int | None = None
    min_split_len: int | None = None
    # The fastest of the configurations tried over the bench workload's decode batches (BENCHMARKS.md,
    # "Why the defaults are what they are"): 128-key tiles, 3 stages, 4 warps, and 8 programs per SM
    # with the sequence-major grid and longest-first order.
    decode_num_warps: int = 4
    decode_num_stages: int = 3
    decode_programs_per_sm: int = 8
    # The order the GPU starts the decode programs in: "longest_first" (sorted by length, so the
    # last wave holds short programs) or "batch" (the batch's order).
    decode_order: str = "longest_first"
    # In a step with prefill, the decodes run through the split decode kernel when the longest holds
    # at least this many tokens; shorter ones stay in the prefill kernel. The split pays beside long
    # decodes, which the prefill kernel walks in one program each, and costs host time where short
    # ones ride along a prompt (two more launches a layer, in steps bound by the host's launches;
    # the prefill kernel takes a 1k-token decode in 32 tiles).
    mixed_decode_split_len: int | None = None  # None takes 8192 (16 in the interpreter)
    # Decode steps start from the QKV projection's output where the model hands it over
    # (DecodesFromQKV; inferlab's decoder does after its one-token GEMVs): the split decode kernel
    # normalizes and rotates q and k and stores the new K/V itself, one kernel less a layer.
    # false: the model's q/k kernel first, for ablations.
    decode_from_qkv: bool = True


@dataclass(slots=True)
class TritonMetadata:
    inputs: AttentionInputs
    # A step with prefill whose decodes run as split decodes: how many lead the batch, their
    # (seq_lens, block_tables) and the prefill rows' (query_start_loc, seq_lens, block_tables),
    # sliced once a step for all layers.
    num_decodes: int = 0
    decodes: tuple[torch.Tensor, torch.Tensor] | None = None
    prefills: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Decode plan and scratch, made by the first layer's forward and reused by the others.
    num_splits: int = 0
    partial_out: torch.Tensor | None = None  # float32 [B, H, splits, D]
    partial_lse: torch.Tensor | None = None  # float32 [B, H, splits]
    seq_order: torch.Tensor | None = None  # int32 [B], the order decode programs start in


class TritonBackend:
    """K/V cache layout: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V), as the
    torch backend's, in the model's dtype or fp8 (engine kv_cache_dtype). Options
    (TritonOptions): prefill tile sizes block_m/block_n; for decode the tile
    decode_block_n, its num_warps and num_stages, min_split_len (the fewest keys one split of a
    sequence takes) and decode_programs_per_sm (how many programs the split plan
    aims to give each multiprocessor), decode_order (which sequences' programs start first);
    mixed_decode_split_len (from what context the decodes of a step with prefill run as split
    decodes rather than in the prefill kernel); decode_from_qkv (decode steps start from the QKV
    projection's output, DecodesFromQKV)."""

    name = "triton"
    supports_cuda_graphs = True
    supports_prefill_graphs = True  # the prefill kernel's flat grid follows the buffers' sizes
    # First on CUDA: its decode reads K/V nearer the memory bandwidth than flash-attn's over the
    # bench workload's decode batches. Never auto on CPU, where Triton runs only in its interpreter.
    auto_priority = {"cuda": 30}

    def __init__(
        self,
        config=None,
        *,
        block_m: int | None = None,
        block_n: int | None = None,
        decode_block_n: int | None = None,
        min_split_len: int | None = None,
        decode_num_warps: int = TritonOptions.decode_num_warps,
        decode_num_stages: int = TritonOptions.decode_num_stages,
        decode_programs_per_sm: int = TritonOptions.decode_programs_per_sm,
        decode_order: str = TritonOptions.decode_order,
        mixed_decode_split_len: int | None = None,
        decode_from_qkv: bool = TritonOptions.decode_from_qkv,
    ):
        self.kernels, kv_store = import_kernels()
        self.store_kv = kv_store.store_kv
        # Small tiles in the interpreter, so tiny test shapes still span several tiles and splits.
        small = self.kernels.INTERPRETED
        self.block_m = block_m or (16 if small else 32)
        self.block_n = block_n or (16 if small else 32)
        self.decode_block_n = decode_block_n or (16 if small else 128)
        self.min_split_len = min_split_len or (16 if small else 256)
        for option in ("block_m", "block_n", "decode_block_n", "min_split_len"):
            value = getattr(self, option)
            if not self.kernels.is_power_of_two(value, 16):
                raise ValueError(f"triton attention option {option} must be a power of two >= 16, got {value!r}")
        for option, value, allowed in (
            ("decode_num_warps", decode_num_warps, (1, 2, 4, 8, 16)),
            ("decode_num_stages", decode_num_stages, range(1, 9)),
            ("decode_programs_per_sm", decode_programs_per_sm, range(1, 65)),
            ("decode_order", decode_order, DECODE_ORDERS),
        ):
            if isinstance(value, bool) or value not in allowed:
                raise ValueError(f"triton attention option {option} must be one of {list(allowed)}, got {value!r}")
        self.decode_num_warps = decode_num_warps
        self.decode_num_stages = decode_num_stages
        self.decode_programs_per_sm = decode_programs_per_sm
        self.decode_order = decode_order
        if not isinstance(decode_from_qkv, bool):
            raise ValueError(f"triton attention option decode_from_qkv must be true or false, got {decode_from_qkv!r}")
        self.decode_from_qkv = decode_from_qkv
        if mixed_decode_split_len is None:
            mixed_decode_split_len = 16 if small else 8192
        if isinstance(mixed_decode_split_len, bool) or not isinstance(mixed_decode_split_len, int):
            raise ValueError(
                f"triton attention option mixed_decode_split_len must be a whole number of tokens, "
                f"got {mixed_decode_split_len!r}"
            )
        self.mixed_decode_split_len = mixed_decode_split_len

    @classmethod
    def validate(cls, device, dtype, block_size, head_dim, kv_cache_dtype) -> list[str]:
        try:
            kernels, _ = import_kernels()
        except ImportError as e:
            return [str(e)]
        from inferlab.kernels.pdl import kernel_mode_problems  # Triton imports: it just did

        reasons = kernel_mode_problems(device)
        if dtype not in DTYPES:
            reasons.append(f"dtype must be one of float16, bfloat16, float32, got {dtype}")
        reasons += kv_cache_dtype_problems(dtype, kv_cache_dtype)
        if kv_cache_dtype == FP8 and device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if capability < (8, 9):
                reasons.append(f"an fp8 KV cache needs compute capability 8.9 or more (Ada, Hopper), got {capability}")
        if not kernels.is_power_of_two(block_size, 16):
            reasons.append(f"block size must be a power of two >= 16, got {block_size}")
        if not kernels.is_power_of_two(head_dim, 16) or head_dim > 256:
            reasons.append(f"head_dim must be a power of two in [16, 256], got {head_dim}")
        return reasons

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def kv_store_target(self, kv_cache, metadata: TritonMetadata):
        # K and V are contiguous halves of the cache, so a model's kernel may store into them
        return kv_cache[0], kv_cache[1], metadata.inputs.slot_mapping

    def build_metadata(self, inputs: AttentionInputs) -> TritonMetadata:
        # Nothing to compute on the device: the kernels read the runner's tensors directly, which
        # is what lets a CUDA graph replay them from static buffers.
        metadata = TritonMetadata(inputs)
        num_decodes = inputs.num_decodes
        split = num_decodes and inputs.max_decode_seq_len >= self.mixed_decode_split_len
        if split and not inputs.is_decode and not inputs.static_shapes:
            metadata.num_decodes = num_decodes
            metadata.decodes = (inputs.seq_lens[:num_decodes], inputs.block_tables[:num_decodes])
            metadata.prefills = (
                inputs.query_start_loc[num_decodes:],
                inputs.seq_lens[num_decodes:],
                inputs.block_tables[num_decodes:],
            )
        return metadata

    def forward(self, q, k, v, kv_cache, metadata: TritonMetadata, scale):
        inputs = metadata.inputs
        if k is not None:
            self.store_kv(k, v, kv_cache, inputs.slot_mapping)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        if inputs.is_decode:
            return self._decode(
                q, kv_cache, out, inputs.seq_lens, inputs.block_tables, inputs.max_seq_len, metadata, scale
            )
        # Beside prefill rows, the leading one-token sequences may attend as decodes do: split over
        # their context, where the prefill kernel gives each one program looping over all of it.
        num_decodes = metadata.num_decodes
        if num_decodes:
            seq_lens, block_tables = metadata.decodes
            self._decode(
                q[:num_decodes],
                kv_cache,
                out[:num_decodes],
                seq_lens,
                block_tables,
                inputs.max_decode_seq_len,
                metadata,
                scale,
            )
            if num_decodes == inputs.num_seqs:
                return out
        # the prefill kernel reads its rows through query_start_loc, whose offsets index all of q
        query_start, seq_lens, block_tables = metadata.prefills or (
            inputs.query_start_loc,
            inputs.seq_lens,
            inputs.block_tables,
        )
        return self.kernels.paged_prefill(
            q,
            kv_cache,
            out,
            query_start,
            seq_lens,
            block_tables,
            inputs.max_query_len,
            scale,
            self.block_m,
            self.block_n,
            flat=inputs.static_shapes,
        )

    def decodes_qkv(self, metadata: TritonMetadata) -> bool:
        return self.decode_from_qkv and metadata.inputs.is_decode

    def decode_qkv(self, qkv, positions, cos_sin, qk_norm, num_heads, kv_cache, metadata: TritonMetadata, scale):
        inputs = metadata.inputs
        head_dim = kv_cache.shape[-1]
        rows = qkv.view(qkv.shape[0], -1, head_dim)  # q's heads, then k's, then v's
        out = rows.new_empty((rows.shape[0], num_heads, head_dim))
        new_tokens = self.kernels.NewTokens(positions, inputs.slot_mapping, cos_sin, qk_norm)
        return self._decode(
            rows, kv_cache, out, inputs.seq_lens, inputs.block_tables, inputs.max_seq_len, metadata, scale, new_tokens
        )

    def _decode(
        self, q, kv_cache, out, seq_lens, block_tables, max_seq_len, metadata: TritonMetadata, scale, new_tokens=None
    ):
        """Split-context decode attention of out's rows (q: their queries, or with new_tokens the
        QKV rows); the first layer of a step plans the split and its scratch, which the other
        layers reuse."""
        kernels = self.kernels
        if metadata.num_splits == 0:
            num_seqs, num_heads, head_dim = out.shape
            metadata.num_splits = kernels.decode_splits(
                out, kv_cache.shape[3], max_seq_len, self.min_split_len, self.decode_programs_per_sm
            )
            if metadata.num_splits > 1:
                metadata.partial_out = out.new_empty(
                    (num_seqs, num_heads, metadata.num_splits, head_dim), dtype=torch.float32
                )
                metadata.partial_lse = out.new_empty((num_seqs, num_heads, metadata.num_splits), dtype=torch.float32)
            # one sequence has one order (and its kernel then reads its inputs before the PDL wait)
            if self.decode_order == "longest_first" and num_seqs > 1:
                metadata.seq_order = kernels.longest_first(seq_lens)
        return kernels.paged_decode(
            q,
            kv_cache,
            out,
            seq_lens,
            block_tables,
            scale,
            metadata.num_splits,
            self.decode_block_n,
            metadata.partial_out,
            metadata.partial_lse,
            self.min_split_len,
            self.decode_num_warps,
            self.decode_num_stages,
            metadata.seq_order,
            new_tokens,
        )


@hookimpl
def register_attention_backends(register):
    register("triton", TritonBackend, options=TritonOptions)
