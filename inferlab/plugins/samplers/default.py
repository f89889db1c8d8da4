"""Greedy, temperature, top-k, top-p and min-p sampling, vectorized over the batch (Gumbel-max:
argmax of filtered logits / T plus Gumbel noise, so no per-row loop and no multinomial)."""
import torch

from inferlab.core.batch import SamplingTensors
from inferlab.core.hookspecs import hookimpl

MASK32 = 0xFFFFFFFF


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), [N, vocab], from a 32-bit integer hash of (seed, step, token index):
    the same seed and step give the same noise on any device and in any batch."""
    index = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = (seeds[:, None] * 0x9E3779B1 + steps[:, None] * 0x85EBCA77 + index[None, :] * 0xC2B2AE3D) & MASK32
    # murmur3's finalizer; products wrap in int64 and the mask keeps the low 32 bits
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    x = x ^ (x >> 16)
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def filter_logits(logits: torch.Tensor, p: SamplingTensors) -> torch.Tensor:
    """Sets the logits that top-k, top-p and min-p exclude to -inf (logits already / temperature)."""
    if p.any_top_k or p.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        keep = torch.ones_like(sorted_logits, dtype=torch.bool)
        if p.any_top_k:
            ranks = torch.arange(logits.shape[-1], device=logits.device)
            keep &= ranks[None, :] < p.top_k[:, None]
        if p.any_top_p:
            probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            keep &= mass_before < p.top_p[:, None]  # the top token always stays
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(~keep, float("-inf")))
    if p.any_min_p:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
        threshold = logits.max(dim=-1, keepdim=True).values + torch.log(p.min_p[:, None])
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return logits


class DefaultSampler:
    def __init__(self, config=None, **options):
        if options:
            raise TypeError(f"the default sampler takes no options, got {sorted(options)}")

    def __call__(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        if params.all_greedy:
            return logits.argmax(dim=-1)
        temperatures = params.temperatures
        if params.any_top_k or params.any_top_p or params.any_min_p:
            sampling = temperatures > 0
            inverse = 1.0 / torch.where(sampling, temperatures, 1.0)
            logits = filter_logits(logits.float() * inverse[:, None], params)
            temperatures = sampling.float()  # already scaled; 0 keeps greedy rows greedy
        if logits.is_cuda:
            from inferlab.plugins.samplers.gumbel_kernel import gumbel_argmax
            return gumbel_argmax(logits, temperatures, params.seeds, params.steps)
        return gumbel_argmax_reference(logits, temperatures, params.seeds, params.steps)


def gumbel_argmax_reference(logits, temperatures, seeds, steps) -> torch.Tensor:
    """argmax(logits / T + Gumbel(seed, step)) per row, plain argmax where T == 0 (the fused CUDA
    kernel computes the same)."""
    sampling = temperatures > 0
    inverse = 1.0 / torch.where(sampling, temperatures, 1.0)
    gumbel = -torch.log(-torch.log(counter_uniform(seeds, steps, logits.shape[-1])))
    sampled = (logits.float() * inverse[:, None] + gumbel).argmax(dim=-1)
    return torch.where(sampling, sampled, logits.argmax(dim=-1))


@hookimpl
def register_samplers(register):
    register("default", DefaultSampler)
