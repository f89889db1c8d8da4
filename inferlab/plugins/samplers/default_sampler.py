"""Greedy, temperature, top-k, top-p and min-p sampling, vectorized over the batch: each row's
token is drawn from softmax(filtered logits / T) by the inverse transform of one uniform, hashed
from the request's seed and the step, so no per-row loop and no torch generator state.

Its capabilities (inferlab.core.protocols): the logits each row was drawn from, for logprobs
(LogprobsSampler); penalties, logit_bias, min_tokens and allowed-token masks applied before
temperature (LogitsProcessingSampler); and grammars compiled by xgrammar (StructuredOutputSampler,
in grammar.py, imported when a request first asks for one)."""

import torch

from inferlab.core.batch import LogitsAdjustments, SamplingTensors
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
        self.grammars = None  # the grammar compiler, made when a request first asks for structured outputs

    def __call__(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        return self._sample(logits, params, with_logits=False)[0]

    def sample_with_logits(self, logits: torch.Tensor, params: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sample(logits, params, with_logits=True)

    def _sample(self, logits: torch.Tensor, params: SamplingTensors, with_logits: bool):
        logits = self.adjust_logits(logits, params)
        if params.all_greedy and not with_logits:
            return logits.argmax(dim=-1), None
        temperatures = params.temperatures
        filtered = params.any_top_k or params.any_top_p or params.any_min_p
        scaled = None
        if filtered or with_logits:  # greedy rows are scaled by 1
            scaled = logits.float() * (1.0 / torch.where(temperatures > 0, temperatures, 1.0))[:, None]
        if filtered:
            excluded = filter_logits(scaled, params) == float("-inf")
            # the filters only exclude tokens: the rest keep their logits and are drawn as without
            # filters, so a row's draw never depends on whether other rows of its batch filter
            logits = logits.masked_fill(excluded, float("-inf"))
            scaled = scaled.masked_fill(excluded, float("-inf")) if with_logits else None
        if params.all_greedy:
            return logits.argmax(dim=-1), scaled
        if logits.is_cuda:
            from inferlab.kernels.sampling import sample_tokens

            return sample_tokens(logits, temperatures, params.seeds, params.steps), scaled
        return inverse_transform_reference(logits, temperatures, params.seeds, params.steps), scaled

    def adjust_logits(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        adjustments = params.adjustments
        return logits if adjustments is None else adjusted_logits(logits, adjustments)

    def compile_constraint(self, spec, tokenizer, vocab_size: int):
        if self.grammars is None:
            from inferlab.plugins.samplers.grammar import GrammarCompiler

            self.grammars = GrammarCompiler()
        return self.grammars.compile(spec, tokenizer, vocab_size)


def adjusted_logits(logits: torch.Tensor, a: LogitsAdjustments) -> torch.Tensor:
    """logits (as float32) with a's rows penalized, biased, banned and masked, vectorized over
    those rows: repetition_penalty divides positive and multiplies negative logits of every token
    seen in the prompt or output, then frequency_penalty times each token's count in the output
    and presence_penalty once for each token in it are subtracted (vLLM's order)."""
    num_rows, vocab = a.rows.shape[0], logits.shape[-1]
    rows = logits[a.rows].float()
    if a.any_penalty:
        counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=logits.device)
        counts.index_add_(0, a.output_tokens, torch.ones_like(a.output_tokens, dtype=torch.float32))
        seen = (counts > 0).index_fill_(0, a.prompt_tokens, True).view(num_rows, vocab)
        counts = counts.view(num_rows, vocab)
        repetition = a.repetition[:, None]
        rows = torch.where(seen, torch.where(rows > 0, rows / repetition, rows * repetition), rows)
        rows = rows - a.frequency[:, None] * counts - a.presence[:, None] * (counts > 0)
    flat = rows.reshape(-1)
    flat.index_add_(0, a.bias_index, a.bias)
    flat.index_fill_(0, a.banned, float("-inf"))
    rows = flat.view(num_rows, vocab)
    if a.allowed is not None:
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        bits = ((a.allowed[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
        rows[a.allowed_rows] = rows[a.allowed_rows].masked_fill(~bits, float("-inf"))
    out = logits.to(torch.float32, copy=True)  # the caller keeps its logits (raw logprobs read them)
    out[a.rows] = rows
    return out


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
