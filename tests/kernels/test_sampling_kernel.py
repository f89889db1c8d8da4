"""The CUDA sampling kernel (inferlab.kernels.sampling.sample_tokens), run by Triton's interpreter
on CPU and compiled on a GPU, against the float64 inverse-transform reference: greedy rows exactly,
sampled rows on a token whose share of the cumulative mass holds the row's target, up to float32
rounding."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

# Only looked up, not imported: importing triton here, without TRITON_INTERPRET, would fix its mode
# for the other interpreter tests that run in this process.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# Shared by both tests: how far a kernel token may sit from the reference's, in the float64
# cumulative mass, as a fraction of the row's total (float32 sums over a chunk of a few thousand).
CHECKS = textwrap.dedent("""
    import torch
    from inferlab.plugins.samplers.default_sampler import inverse_transform_reference, relative_mass, row_uniform
    from inferlab.kernels.sampling import sample_tokens

    def check_tokens(logits, temperatures, seeds, steps, tolerance=1e-5):
        got = sample_tokens(logits, temperatures, seeds, steps)
        want = inverse_transform_reference(logits.cpu(), temperatures.cpu(), seeds.cpu(), steps.cpu())
        got, logits, temperatures = got.cpu(), logits.cpu().float(), temperatures.cpu()
        assert got.dtype == torch.int64
        greedy = temperatures == 0
        assert torch.equal(got[greedy], want[greedy]), (got[greedy], want[greedy])
        mass = relative_mass(logits, temperatures)
        cumulative = mass.cumsum(-1)
        total = cumulative[:, -1]
        target = row_uniform(seeds.cpu(), steps.cpu()) * total
        rows = torch.arange(len(got))
        below = torch.where(got > 0, cumulative[rows, (got - 1).clamp(min=0)], torch.zeros_like(total))
        above = cumulative[rows, got]
        sampled = ~greedy
        assert torch.all(mass[rows, got][sampled] > 0), "a token without mass was drawn"
        assert torch.all(below[sampled] <= target[sampled] + tolerance * total[sampled]), "token too late"
        assert torch.all(target[sampled] <= above[sampled] + tolerance * total[sampled]), "token too early"
        return (got == want).float().mean().item()
""")

INTERPRETED = CHECKS + textwrap.dedent("""
    torch.manual_seed(0)
    for rows, vocab in [(1, 7), (5, 3000), (9, 4099), (4, 70000)]:
        logits = torch.randn(rows, vocab) * 3
        temperatures = torch.rand(rows) * 1.5 + 0.05
        temperatures[::3] = 0  # greedy rows mixed in
        seeds = torch.randint(0, 2**32, (rows,))
        steps = torch.randint(0, 10**6, (rows,))
        agree = check_tokens(logits, temperatures, seeds, steps)
        assert agree == 1.0, (rows, vocab, agree)  # rounding moves a token only near a boundary
    # filtered (-inf) logits are never drawn, even where a whole chunk of the vocabulary is filtered
    logits = torch.randn(4, 5000)
    logits[:, 1::2] = float("-inf")
    logits[:, 1024:3072] = float("-inf")
    got = sample_tokens(logits, torch.ones(4), torch.arange(4), torch.zeros(4, dtype=torch.int64))
    assert torch.all(got % 2 == 0) and torch.all((got < 1024) | (got >= 3072)), got
    # one token holds all the mass: drawn whatever the uniform
    logits = torch.full((6, 3000), float("-inf"))
    logits[:, 2500] = 1.0
    assert sample_tokens(logits, torch.ones(6), torch.arange(6), torch.arange(6)).tolist() == [2500] * 6
    # greedy ties across chunks of the vocabulary: the lowest index, as torch.argmax
    logits = torch.zeros(3, 5000)
    logits[:, [3000, 100, 4999]] = 5.0
    logits[2, 100] = 0.0
    got = sample_tokens(logits, torch.zeros(3), torch.arange(3), torch.zeros(3, dtype=torch.int64))
    assert got.tolist() == [100, 100, 3000], got
    # bf16 logits, as the model gives them
    logits = (torch.randn(3, 2000) * 2).bfloat16()
    check_tokens(logits, torch.tensor([0.6, 1.0, 0.0]), torch.arange(3), torch.arange(3))
    print("ok")
""")


@pytest.mark.skipif(
    importlib.util.find_spec("torch") and __import__("torch").cuda.is_available(),
    reason="with a GPU the compiled kernel is tested instead",
)
def test_kernel_matches_reference_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


COMPILED = CHECKS + textwrap.dedent("""
    torch.manual_seed(0)
    for rows, vocab in [(1, 7), (64, 151936), (300, 4099), (256, 151936)]:
        logits = (torch.randn(rows, vocab, device="cuda") * 3).bfloat16()
        temperatures = torch.rand(rows, device="cuda") * 1.5 + 0.05
        temperatures[::3] = 0
        seeds = torch.randint(0, 2**32, (rows,), device="cuda")
        steps = torch.randint(0, 10**6, (rows,), device="cuda")
        agree = check_tokens(logits, temperatures, seeds, steps)
        assert agree > 0.9, (rows, vocab, agree)
    # the draws follow softmax(logits / T): 20,000 rows of one 4-token row, one step each
    n = 20000
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = (probs.log() * 0.6).expand(n, 4).contiguous().cuda()
    got = sample_tokens(logits, torch.full((n,), 0.6, device="cuda"), torch.full((n,), 7, device="cuda"),
                        torch.arange(n, device="cuda"))
    freq = torch.bincount(got.cpu(), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015), freq
    print("ok")
""")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernel_matches_reference_on_gpu(tmp_path):
    """(A script file of its own: Triton compiles from a kernel's source, and this file imports no triton.)"""
    script = tmp_path / "sampling_check.py"
    script.write_text(COMPILED)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        result.stdout[-2000:] + result.stderr[-3000:]
    )
