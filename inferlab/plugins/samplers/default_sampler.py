"""Greedy, temperature, top-k, top-p and min-p sampling, vectorized over the batch: each row's
token is drawn from softmax(filtered logits / T) by the inverse transform of one uniform, hashed
from the request's seed and the step, so no per-row loop and no torch generator state."""

import torch

from inferlab.core.batch import SamplingTensors
from inferlab.core.hookspecs import hookimpl

MASK32 = 0xFFFFFFFF
LOG2E = 1.4426950408889634


def row_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A uniform in [0, 1) per row from a 32-bit integer hash of (seed, step), 24 bits of it (exact
    in float32): the same seed and step give the same uniform on any device and in any batch
    (inferlab.kernels.sampling.row_uniform computes the same)."""
    x = (seeds * 0x9E3779B1 + steps * 0x85EBCA77) & MASK32
    # murmur3's finalizer; products wrap in int64 and the mask keeps the low 32 bits
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    x = x ^ (x >> 16)
    return (x >> 8).to(torch.float64) / (1 << 24)


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
            # rows without top_p keep all, though float32 sums over a large vocabulary reach 1
            # before their tail; the top token always stays, also where a top_p below float32's
            # range arrives as 0
            keep &= (mass_before < p.top_p[:, None]) | (p.top_p[:, None] >= 1)
            keep[:, 0] = True
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(~keep, float("-inf")))
    if p.any_min_p:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
        threshold = logits.max(dim=-1, keepdim=True).values + torch.log(p.min_p[:, None])
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return logits


class DefaultSampler:
    # Its launches follow only the logits' shape and the settings' flags, and it never waits on the
    # device: the runner may capture it in CUDA graphs.
    supports_cuda_graphs = True

    def __init__(self, config=None, **options):
        if options:
            raise TypeError(f"the default sampler takes no options, got {sorted(options)}")

    def __call__(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        if params.all_greedy:
            return logits.argmax(dim=-1)
        temperatures = params.temperatures
        if params.any_top_k or params.any_top_p or params.any_min_p:
            inverse = 1.0 / torch.where(temperatures > 0, temperatures, 1.0)
            excluded = filter_logits(logits.float() * inverse[:, None], params) == float("-inf")
            # the filters only exclude tokens: the rest keep their logits and are drawn as without
            # filters, so a row's draw never depends on whether other rows of its batch filter
            logits = logits.masked_fill(excluded, float("-inf"))
        if logits.is_cuda:
            from inferlab.kernels.sampling import sample_tokens

            return sample_tokens(logits, temperatures, params.seeds, params.steps)
        return inverse_transform_reference(logits, temperatures, params.seeds, params.steps)


def relative_mass(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Per row, softmax(logits / T) up to its row's sum: 2^(x - max x) in float64, with
    x = logits * log2(e) / T (T taken as 1 on greedy rows, where T == 0)."""
    x = logits.float() * (LOG2E / torch.where(temperatures > 0, temperatures, 1.0))[:, None]
    return torch.exp2((x - x.max(dim=-1, keepdim=True).values).double())


def inverse_transform_reference(logits, temperatures, seeds, steps) -> torch.Tensor:
    """Per row, the first token whose cumulative softmax(logits / T) mass (in float64) exceeds
    row_uniform(seed, step) times the total; plain argmax where T == 0. The CUDA kernel
    (inferlab.kernels.sampling.sample_tokens) computes the same in float32."""
    sampling = temperatures > 0
    mass = relative_mass(logits, temperatures)
    cumulative = mass.cumsum(dim=-1)
    target = row_uniform(seeds, steps).to(cumulative.device) * cumulative[:, -1]
    sampled = torch.searchsorted(cumulative, target[:, None], right=True).squeeze(1)
    # the target reaches the total only by rounding: never past the last token with mass
    last = mass.shape[-1] - 1 - (mass > 0).flip(-1).int().argmax(dim=-1)
    return torch.where(sampling, torch.minimum(sampled, last), logits.argmax(dim=-1))


@hookimpl
def register_samplers(register):
    register("default", DefaultSampler)
