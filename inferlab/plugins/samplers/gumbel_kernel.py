"""Fused Gumbel-max sampling for CUDA: one pass over each row of logits computes
logit / T + Gumbel noise (the same counter hash as default.counter_uniform) and its argmax,
instead of a dozen elementwise passes over [batch, vocab] in torch."""
import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, temperatures_ptr, seeds_ptr, steps_ptr, out_ptr,
                          vocab_size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    # low 32 bits of seed and step, as the torch reference masks them
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    step = tl.load(steps_ptr + row).to(tl.uint32)
    base = seed * 0x9E3779B1 + step * 0x85EBCA77
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab_size, BLOCK):
        index = start + tl.arange(0, BLOCK)
        valid = index < vocab_size
        logit = tl.load(logits_ptr + row * stride + index, mask=valid, other=float("-inf")).to(tl.float32)
        x = base + index.to(tl.uint32) * 0xC2B2AE3D
        x = x ^ (x >> 16)
        x = x * 0x85EBCA6B
        x = x ^ (x >> 13)
        x = x * 0xC2B2AE35
        x = x ^ (x >> 16)
        u = ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(greedy, logit, logit * inv_t + gumbel)
        score = tl.where(valid, score, float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_index = tl.where(better, index, best_index)
    top = tl.max(best, axis=0)
    # lowest index among the maxima, as torch.argmax picks
    winner = tl.min(tl.where(best == top, best_index, vocab_size), axis=0)
    tl.store(out_ptr + row, winner.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """argmax(logits / T + Gumbel(seed, step)) per row; plain argmax where T == 0."""
    rows, vocab_size = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](logits, logits.stride(0), temperatures, seeds, steps, out, vocab_size, BLOCK=2048)
    return out
