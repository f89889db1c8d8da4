"""Fused Gumbel-max sampling for CUDA: one pass over each row of logits computes
logit / T + Gumbel noise (the same counter hash as default.counter_uniform) and its argmax,
instead of a dozen elementwise passes over [batch, vocab] in torch.

Compiled, the two logs of the Gumbel noise are the GPU's approximate log2 (one instruction each):
Triton's accurate log takes about twenty instructions, and with two of them a row element the
kernel was bound by arithmetic, not by reading the logits (107 µs for 256 rows of 151,936 on an
H200, where torch's plain argmax takes 54 µs). The noise then differs from the torch reference by
at most about 6e-6 (near u = 1 the inner log takes a series, see gumbel_noise), which moves a token
only at a near-tie. Under Triton's interpreter (CPU tests), which lacks the fast log, the kernel
takes the exact one and matches the reference token for token.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from inferlab.plugins import pdl
from inferlab.plugins.pdl import INTERPRETED

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
ONE_MINUS_HALF_ULP: tl.constexpr = tl.constexpr(1.0 - 2.0 ** -24)


@triton.jit
def gumbel_noise(x, FAST_LOG: tl.constexpr):
    """-log(-log(u)) for the uniform u = (top 23 bits of the 32-bit hash x + 0.5) / 2^23."""
    # u without an int-to-float conversion (a quarter-rate instruction, like the two logs):
    # 1.m as float bits, minus 1 - 2^-24, exact
    u = ((x >> 9) | 0x3F800000).to(tl.float32, bitcast=True) - ONE_MINUS_HALF_ULP
    if FAST_LOG:
        # The fast log2's absolute error (about 2^-22) swamps log(u) for u near 1, where the largest
        # noise comes from (it read 18.6 for 16.6 at the top). Below 2^-7, -log(1 - t) takes its
        # series t + t^2/2 + t^3/3 instead (t = 1 - u is exact there): every one of the 2^23 values
        # is then within 6e-6 of float64 (BENCHMARKS.md item 72).
        t = 1.0 - u
        minus_log_u = tl.where(t < 0.0078125, t * (1.0 + t * (0.5 + t * 0.33333334)), -LN2 * libdevice.fast_log2f(u))
        return -LN2 * libdevice.fast_log2f(minus_log_u)
    else:
        return -tl.log(-tl.log(u))


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, temperatures_ptr, seeds_ptr, steps_ptr, best_ptr, index_ptr,
                          vocab_size, chunk_size, num_chunks, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr,
                          PDL: tl.constexpr):
    """One program per (row, chunk of the vocabulary): the chunk's best score and its index."""
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    # low 32 bits of seed and step, as the torch reference masks them
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    step = tl.load(steps_ptr + row).to(tl.uint32)
    base = seed * 0x9E3779B1 + step * 0x85EBCA77
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    chunk_start = chunk * chunk_size
    chunk_end = tl.minimum(chunk_start + chunk_size, vocab_size)
    for start in range(chunk_start, chunk_end, BLOCK):
        index = start + tl.arange(0, BLOCK)
        valid = index < chunk_end
        logit = tl.load(logits_ptr + row * stride + index, mask=valid, other=float("-inf")).to(tl.float32)
        x = base + index.to(tl.uint32) * 0xC2B2AE3D
        x = x ^ (x >> 16)
        x = x * 0x85EBCA6B
        x = x ^ (x >> 13)
        x = x * 0xC2B2AE35
        x = x ^ (x >> 16)
        gumbel = gumbel_noise(x, FAST_LOG)
        score = tl.where(greedy, logit, logit * inv_t + gumbel)
        score = tl.where(valid, score, float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_index = tl.where(better, index, best_index)
    top = tl.max(best, axis=0)
    # lowest index among the maxima, as torch.argmax picks
    winner = tl.min(tl.where(best == top, best_index, vocab_size), axis=0)
    tl.store(best_ptr + row * num_chunks + chunk, top)
    tl.store(index_ptr + row * num_chunks + chunk, winner)


@triton.jit
def _pick_chunk_kernel(best_ptr, index_ptr, out_ptr, num_chunks, CHUNKS_POW2: tl.constexpr, PDL: tl.constexpr):
    """One program a row: the index of its best chunk's winner, the first chunk among equal
    scores (chunks are in vocabulary order, so that is torch.argmax's lowest index), as int64."""
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS_POW2)
    valid = chunks < num_chunks
    best = tl.load(best_ptr + row * num_chunks + chunks, mask=valid, other=float("-inf"))
    index = tl.load(index_ptr + row * num_chunks + chunks, mask=valid, other=0)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(valid & (best == top), chunks, CHUNKS_POW2), axis=0)
    tl.store(out_ptr + row, tl.sum(tl.where(chunks == first, index, 0), axis=0).to(tl.int64))


BLOCK = 1024
CHUNKS = 32  # per row: enough programs to fill the GPU even for a handful of rows


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """argmax(logits / T + Gumbel(seed, step)) per row; plain argmax where T == 0."""
    rows, vocab_size = logits.shape
    chunk_size = -(-vocab_size // CHUNKS // BLOCK) * BLOCK
    num_chunks = -(-vocab_size // chunk_size)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        options = pdl.launch_options(logits.device)
        _gumbel_argmax_kernel[(rows, num_chunks)](logits, logits.stride(0), temperatures, seeds, steps, best, index,
                                                  vocab_size, chunk_size, num_chunks, BLOCK=BLOCK, FAST_LOG=not INTERPRETED,
                                                  **options)
        # one small kernel where argmax, gather and the cast to int64 took three (BENCHMARKS.md item 47)
        _pick_chunk_kernel[(rows,)](best, index, tokens, num_chunks, CHUNKS_POW2=triton.next_power_of_2(num_chunks),
                                    num_warps=1, **options)
    return tokens
