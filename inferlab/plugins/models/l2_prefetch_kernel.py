"""Weights asked into L2 while attention runs (Qwen3Options.prefetch_weights).

A decode step's GEMMs are small: each reads its weight once, a few MB, and at a few dozen tokens
it spends most of its 5-8 µs waiting on DRAM. Attention, which comes before them, takes 50-150 µs
a layer streaming the K/V cache and leaves the weights' turn idle. So the layer, just before its
attention, launches on a side stream one small kernel per weight that the next GEMMs read (its
own o_proj, gate_up_proj and down_proj, the next layer's qkv_proj): each of its threads issues one
bulk L2 prefetch (cp.async.bulk.prefetch, Hopper and newer) of a chunk, marked evict_last, so the
K/V lines streaming past (normal priority) are evicted before them. The kernels return at once;
the copies run beside attention, and the main stream joins the side stream before o_proj, which
a CUDA graph records as a fork and a join. Nothing a kernel computes depends on it.

Only compiled Triton on sm90+ runs it: the interpreter has no inline PTX, so on CPU it is off."""
import functools

import torch
import triton
import triton.language as tl

from inferlab.plugins.pdl import INTERPRETED

CHUNK_BYTES = 16384  # one bulk prefetch; a multiple of 16, as the instruction requires
THREADS = 128  # one prefetch per thread; a program covers CHUNK_BYTES * THREADS


@triton.jit
def _l2_prefetch_kernel(base_ptr, num_bytes, CHUNK: tl.constexpr, THREADS: tl.constexpr, MODE: tl.constexpr):
    if MODE == "line":  # one prefetch instruction a 128-byte line, CHUNK bytes a thread
        for line in tl.static_range(CHUNK // 128):
            offsets = ((tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64) * CHUNK + line * 128)
            ptrs = base_ptr.to(tl.pointer_type(tl.int8)) + offsets
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.lt.s64 p, $2, $3; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                "=r,l,l,l", [ptrs, offsets, num_bytes + offsets * 0], dtype=tl.int32, is_pure=False, pack=1)
    else:
        offsets = (tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64) * CHUNK
        sizes = tl.minimum(tl.maximum(num_bytes - offsets, 0), CHUNK).to(tl.int32)
        ptrs = base_ptr.to(tl.pointer_type(tl.int8)) + offsets
        # The output register is a dummy: inline asm must return something; is_pure=False keeps it.
        if MODE == "bulk":
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b64 policy; setp.ne.u32 p, $2, 0; "
                "createpolicy.fractional.L2::evict_last.b64 policy, 1.0; "
                "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy; mov.u32 $0, 0; }",
                "=r,l,r", [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


MODE = "bulk"  # experiment: "bulk", "bulk_nohint", "line"


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return not INTERPRETED and torch.cuda.get_device_capability(device_index)[0] >= 9


def supported(device: torch.device) -> bool:
    """Whether weights on this device can be prefetched (CUDA, sm90+, compiled Triton)."""
    if device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def prefetch_l2(tensor: torch.Tensor) -> None:
    """Launches, on the current stream, the prefetch of a contiguous tensor's bytes into L2."""
    num_bytes = tensor.numel() * tensor.element_size()
    # the instruction wants 16-byte aligned addresses and sizes; a torch allocation starts on 512
    if num_bytes == 0 or tensor.data_ptr() % 16 or num_bytes % 16 or not tensor.is_contiguous():
        return
    chunk = 2048 if MODE == "line" else CHUNK_BYTES
    _l2_prefetch_kernel[(triton.cdiv(num_bytes, chunk * THREADS),)](
        tensor, num_bytes, CHUNK=chunk, THREADS=THREADS, MODE=MODE, num_warps=THREADS // 32)


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class WeightPrefetch:
    """issue() before a stretch of work that does not need the weights (attention), join() before
    the first kernel that reads them."""

    def __init__(self, weights: list[torch.nn.Parameter]):
        self.weights = weights  # the Parameters themselves: their storage may move (.to, loading)

    def issue(self) -> None:
        main = torch.cuda.current_stream()
        side = _side_stream(main.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for weight in self.weights:
                prefetch_l2(weight)

    def join(self) -> None:
        main = torch.cuda.current_stream()
        main.wait_stream(_side_stream(main.device))
