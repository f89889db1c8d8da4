"""Comparing two engines' bfloat16 outputs on a GPU (tests/core/test_gpu.py: a backend against the torch
backend; tests/core/test_gpu_tp.py: two ranks against one): a workload, a sampler that records logits
and can force tokens, the logits' distance, and greedy runs that may part only at a near-tie."""

import torch

from inferlab import SamplingParams

# a small random Qwen3 in bfloat16 (head_dim 128, GQA 4), and the engine settings both sides use
SHAPE = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    tie_word_embeddings=True,
)
ENGINE = dict(device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=1024)
CACHE_TOKENS = 16384  # the KV cache of the comparison runs, whatever their block size
# per-row relative L2 distance of logits from the reference's, both in bfloat16
LOGITS_RTOL = 0.05


def make_requests(vocab_size: int):
    """Two groups of (prompt ids, params). Prompts of ragged lengths (one spans 3 chunks of the
    1024-token budget, one is a single token) with different output lengths, so decode batches
    shrink and get padded; then a prompt sharing 600 tokens (2 full blocks of 256) with the first,
    served from the prefix cache."""
    gen = torch.Generator().manual_seed(0)
    lengths = [700, 300, 17, 1, 513, 1050]
    max_tokens = [40, 24, 64, 8, 33, 5]
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
    first = [
        (p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, seed=1000 + i))
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    shared = prompts[0][:600] + torch.randint(0, vocab_size, (50,), generator=gen).tolist()
    second = [(shared, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, seed=2000))]
    return first, second


class RecordingSampler:
    """Replaces the engine's sampler: keeps each sampled row's logits under (request seed, token
    index) and returns the forced token there (teacher forcing), or the argmax without one."""

    def __init__(self, forced: dict | None = None):
        self.forced = forced
        self.logits: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, logits, params):
        keys = list(zip(params.seeds.tolist(), params.steps.tolist()))
        for row, key in enumerate(keys):
            self.logits[key] = logits[row].float().cpu()
        if self.forced is None:
            return logits.argmax(dim=-1)
        missing = [key for key in keys if key not in self.forced]
        if missing:
            raise AssertionError(f"(seed, step) {missing} were not sampled by the reference run")
        return torch.tensor([self.forced[key] for key in keys], device=logits.device)


def logits_errors(got: dict, expected: dict, prompt_steps: set) -> dict:
    """Each row's relative distance from the reference, split into prefill rows (a prompt's
    first sampled token, in prompt_steps) and decode rows."""
    assert got.keys() == expected.keys()
    errors = {"prefill": [], "decode": []}
    for key, row in expected.items():
        distance = ((got[key] - row).norm() / row.norm()).item()
        errors["prefill" if key in prompt_steps else "decode"].append(distance)
    return errors


def assert_diverged_only_at_near_ties(workload, got_tokens, expected_tokens, expected_logits) -> list:
    """Free-running greedy tokens against the reference's. bfloat16 rounding may flip a near-tie:
    a sequence may then diverge, but only where the reference's own logits nearly tie the two.
    Returns (seed, token, margin, bound) of each divergence."""
    first, second = workload
    diverged = []
    for (prompt, params), got, want in zip(first + second, got_tokens, expected_tokens):
        assert len(got) == len(want) == params.max_tokens
        mismatch = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if mismatch is None:
            continue
        row = expected_logits[(params.seed, len(prompt) + mismatch)]
        margin = (row[want[mismatch]] - row[got[mismatch]]).item()
        tie = 0.02 * (row.max() - row.min()).item()
        diverged.append((params.seed, mismatch, round(margin, 4), round(tie, 4)))
        assert margin <= tie, (
            f"request {params.seed} diverged at token {mismatch}: {got[mismatch]} instead of "
            f"{want[mismatch]}, whose logit was {margin:.4f} higher (near-tie bound {tie:.4f})"
        )
    return diverged
