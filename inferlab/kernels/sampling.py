"""Exact sampling from softmax(logits / T) on CUDA by the inverse transform, in two kernels.

1. One program per (row, chunk of 4,096 vocabulary entries) reads its logits once and keeps, per
   lane, a running maximum and the sum of 2^(x - max) (x = logit / T in log2 units), which costs
   one exp2 an element: when x exceeds the lane's maximum, e = 2^-(x - max) rescales the old sum.
   It stores the chunk's maximum and its mass relative to that maximum (greedy rows: the maximum
   and its first index).
2. One program per row draws one uniform u from (seed, step), picks the chunk whose cumulative
   mass first exceeds u times the row's total, and rescans that chunk alone (1/38 of Qwen3's
   vocabulary) for the token where the running sum crosses.

The Gumbel-max kernel it replaced drew a hashed uniform and took two logarithms an element and
was bound by arithmetic rather than by reading the logits (BENCHMARKS.md, "Why the defaults are
what they are").

The token depends on float32 sums, so it may differ from the float64 reference (the default
sampler's inverse_transform_reference) where u lands within rounding of a boundary between two
tokens' shares; never on a token of probability zero.
"""

import torch
import triton
import triton.language as tl

from inferlab.kernels import pdl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _log2_scale(temperatures_ptr, row):
    """log2(e) / T for a sampled row, 1 for a greedy one (T == 0); and whether it is greedy."""
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0
    return LOG2E / tl.where(greedy, 1.0, temperature), greedy


@triton.jit
def row_uniform(seed, step):
    """u in [0, 1) from the low 32 bits of seed and step (murmur3's finalizer), with 24 bits, so
    every value is exact in float32: the default sampler's row_uniform computes the same on the host."""
    x = seed.to(tl.uint32) * 0x9E3779B1 + step.to(tl.uint32) * 0x85EBCA77
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    x = x ^ (x >> 16)
    return (x >> 8).to(tl.float32) * (1.0 / 16777216.0)


FLOAT32_LOWEST: tl.constexpr = tl.constexpr(-3.4028234663852886e38)
# The per-row settings are rows of one buffer per batch (ModelRunner.sampling_tensors), aligned as
# the batch's size makes them: not specialized on, or each batch size would compile its variants.
ROW_SETTINGS = ["temperatures_ptr", "seeds_ptr", "steps_ptr"]


@triton.jit(do_not_specialize_on_alignment=ROW_SETTINGS[:1])
def _chunk_mass_kernel(
    logits_ptr,
    stride,
    temperatures_ptr,
    max_ptr,
    mass_ptr,
    argmax_ptr,
    vocab_size,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (row, chunk of CHUNK entries): a sampled row's chunk maximum of x and sum of
    2^(x - maximum); a greedy row's chunk maximum and its first index."""
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    scale, greedy = _log2_scale(temperatures_ptr, row)
    # finite, so that -inf entries (masked or filtered) need no test: 2^-inf adds nothing
    lane_max = tl.full([BLOCK], FLOAT32_LOWEST, tl.float32)
    chunk_start = chunk * CHUNK
    chunk_end = tl.minimum(chunk_start + CHUNK, vocab_size)
    if greedy:
        lane_arg = tl.zeros([BLOCK], tl.int32)
        for start in range(chunk_start, chunk_end, BLOCK):
            index = start + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + row * stride + index, mask=index < chunk_end, other=float("-inf")).to(tl.float32)
            lane_arg = tl.where(x > lane_max, index, lane_arg)  # strictly greater: a lane keeps its first maximum
            lane_max = tl.maximum(lane_max, x)
        top = tl.max(lane_max, axis=0)
        tl.store(max_ptr + row * num_chunks + chunk, top)
        # lowest index among the maxima, as torch.argmax picks
        tl.store(argmax_ptr + row * num_chunks + chunk, tl.min(tl.where(lane_max == top, lane_arg, vocab_size), axis=0))
    else:
        lane_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(chunk_start, chunk_end, BLOCK):
            index = start + tl.arange(0, BLOCK)
            x = (
                tl.load(logits_ptr + row * stride + index, mask=index < chunk_end, other=float("-inf")).to(tl.float32)
                * scale
            )
            # one exp2 an element: below the lane's maximum e is x's share; above it, e rescales the sum
            d = x - lane_max
            e = tl.exp2(-tl.abs(d))
            lane_sum = tl.where(d > 0, lane_sum * e + 1.0, lane_sum + e)
            lane_max = tl.maximum(lane_max, x)
        top = tl.max(lane_max, axis=0)
        tl.store(max_ptr + row * num_chunks + chunk, top)
        tl.store(mass_ptr + row * num_chunks + chunk, tl.sum(lane_sum * tl.exp2(lane_max - top), axis=0))


@triton.jit(do_not_specialize_on_alignment=ROW_SETTINGS)
def _pick_token_kernel(
    logits_ptr,
    stride,
    temperatures_ptr,
    seeds_ptr,
    steps_ptr,
    max_ptr,
    mass_ptr,
    argmax_ptr,
    out_ptr,
    vocab_size,
    num_chunks,
    CHUNKS_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program a row: the sampled token (greedy rows: the first chunk's argmax among equal
    maxima, so torch.argmax's lowest index), as int64."""
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0)
    scale, greedy = _log2_scale(temperatures_ptr, row)
    chunks = tl.arange(0, CHUNKS_POW2)
    valid = chunks < num_chunks
    chunk_max = tl.load(max_ptr + row * num_chunks + chunks, mask=valid, other=float("-inf"))
    top = tl.max(chunk_max, axis=0)
    if greedy:
        first_top = tl.min(tl.where(valid & (chunk_max == top), chunks, CHUNKS_POW2), axis=0)
        token = tl.load(argmax_ptr + row * num_chunks + first_top)
    else:
        chunk_mass = tl.load(mass_ptr + row * num_chunks + chunks, mask=valid, other=0.0)
        mass = chunk_mass * tl.exp2(chunk_max - top)  # masked chunks: 0 * 2^-inf
        target = row_uniform(tl.load(seeds_ptr + row), tl.load(steps_ptr + row)) * tl.sum(mass, axis=0)
        chosen = tl.min(tl.where(valid & (tl.cumsum(mass, axis=0) > target), chunks, CHUNKS_POW2), axis=0)
        # rounding can leave the target at the total: the last chunk with mass then
        chosen = tl.where(chosen < CHUNKS_POW2, chosen, tl.max(tl.where(mass > 0, chunks, 0), axis=0))
        remaining = target - tl.sum(tl.where(chunks < chosen, mass, 0.0), axis=0)
        # the chosen chunk's running sum, in the same units, up to where it passes what remains
        index = chosen * CHUNK + tl.arange(0, CHUNK)
        in_chunk = index < vocab_size
        x = tl.load(logits_ptr + row * stride + index, mask=in_chunk, other=float("-inf")).to(tl.float32) * scale
        e = tl.exp2(x - top)
        passed = (tl.cumsum(e, axis=0) > remaining) & (e > 0)
        found = tl.min(tl.where(passed, index, vocab_size), axis=0)
        # the rescan's float32 sum may fall short of the chunk's: then its last token with mass
        token = tl.where(found < vocab_size, found, tl.max(tl.where(e > 0, index, -1), axis=0))
    tl.store(out_ptr + row, token.to(tl.int64))


CHUNK = 4096  # vocabulary entries a program: 38 a row for Qwen3's 151,936, enough to fill the GPU at a few rows
BLOCK = 1024
CHUNK_WARPS = 4
PICK_WARPS = 8


def sample_tokens(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """A token per row drawn from softmax(logits / T) by the uniform of (seed, step); argmax where T == 0."""
    rows, vocab_size = logits.shape
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_mass = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_arg = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        options = pdl.launch_options(logits.device)
        _chunk_mass_kernel[(rows, num_chunks)](
            logits,
            logits.stride(0),
            temperatures,
            chunk_max,
            chunk_mass,
            chunk_arg,
            vocab_size,
            CHUNK=CHUNK,
            BLOCK=BLOCK,
            num_warps=CHUNK_WARPS,
            **options,
        )
        _pick_token_kernel[(rows,)](
            logits,
            logits.stride(0),
            temperatures,
            seeds,
            steps,
            chunk_max,
            chunk_mass,
            chunk_arg,
            tokens,
            vocab_size,
            num_chunks,
            CHUNKS_POW2=triton.next_power_of_2(num_chunks),
            CHUNK=CHUNK,
            num_warps=PICK_WARPS,
            **options,
        )
    return tokens
