"""The fused CUDA sampling kernel, run by Triton's interpreter on CPU, picks exactly the tokens of
the torch reference (same counter hash, same Gumbel-max)."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

# Only looked up, not imported: importing triton here, without TRITON_INTERPRET, would fix its mode
# for the other interpreter tests that run in this process.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHECK = textwrap.dedent("""
    import torch
    from inferlab.plugins.samplers.default import gumbel_argmax_reference
    from inferlab.plugins.samplers.gumbel_kernel import gumbel_argmax
    torch.manual_seed(0)
    for rows, vocab in [(1, 7), (5, 3000), (9, 4099)]:
        logits = torch.randn(rows, vocab) * 3
        temperatures = torch.rand(rows) * 1.5
        temperatures[::3] = 0  # greedy rows mixed in
        seeds = torch.randint(0, 2**32, (rows,))
        steps = torch.randint(0, 10**6, (rows,))
        got = gumbel_argmax(logits, temperatures, seeds, steps)
        want = gumbel_argmax_reference(logits, temperatures, seeds, steps)
        assert torch.equal(got, want), (rows, vocab, got, want)
    # with -inf entries (filtered logits) the winner is never a filtered token
    logits = torch.randn(4, 500)
    logits[:, 1::2] = float("-inf")
    got = gumbel_argmax(logits, torch.ones(4), torch.arange(4), torch.zeros(4, dtype=torch.int64))
    assert torch.all(got % 2 == 0), got
    # greedy ties across chunks of the vocabulary: the lowest index, as torch.argmax; int64 tokens
    logits = torch.zeros(3, 5000)
    logits[:, [3000, 100, 4999]] = 5.0
    logits[2, 100] = 0.0
    got = gumbel_argmax(logits, torch.zeros(3), torch.arange(3), torch.zeros(3, dtype=torch.int64))
    assert got.tolist() == [100, 100, 3000] and got.dtype == torch.int64, got
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("torch") and __import__("torch").cuda.is_available(),
                    reason="with a GPU the compiled kernel is tested instead")
def test_kernel_matches_reference_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernel_matches_reference_on_gpu():
    import torch

    from inferlab.plugins.samplers.default import gumbel_argmax_reference
    from inferlab.plugins.samplers.gumbel_kernel import gumbel_argmax
    torch.manual_seed(0)
    for rows, vocab in [(1, 7), (64, 151936), (300, 4099)]:
        logits = torch.randn(rows, vocab, device="cuda") * 3
        temperatures = torch.rand(rows, device="cuda") * 1.5
        temperatures[::3] = 0
        seeds = torch.randint(0, 2**32, (rows,), device="cuda")
        steps = torch.randint(0, 10**6, (rows,), device="cuda")
        got = gumbel_argmax(logits, temperatures, seeds, steps)
        want = gumbel_argmax_reference(logits, temperatures, seeds, steps)
        # fast-math logs may move a score by an ulp: near-ties aside, the same tokens
        assert (got == want).float().mean().item() > 0.99, (got != want).sum()


NOISE_CHECK = textwrap.dedent("""
    import torch
    import triton
    import triton.language as tl
    from inferlab.plugins.samplers.gumbel_kernel import gumbel_noise

    @triton.jit
    def noise_kernel(out_ptr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, gumbel_noise(i.to(tl.uint32) << 9, True))

    n = 1 << 23
    out = torch.empty(n, device="cuda")
    noise_kernel[(n // 1024,)](out, BLOCK=1024)
    u = (torch.arange(n, device="cuda", dtype=torch.float64) + 0.5) / n
    error = (out.double() + torch.log(-torch.log(u))).abs()
    assert torch.isfinite(out).all()
    assert error.max().item() < 1e-5, (error.max().item(), u[error.argmax()].item())
    assert abs(out[-1].item() - 16.6355) < 1e-3, out[-1].item()  # the largest noise the kernel can draw
    print("ok")
""")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_noise_is_close_to_exact_for_every_uniform(tmp_path):
    """The hash's top 23 bits give 2^23 possible uniforms: the compiled noise (fast logs) of every
    one is finite and within 1e-5 of -log(-log(u)) in float64, the top of the range included. (A
    script file of its own: Triton compiles from a kernel's source, and this file imports no triton.)"""
    script = tmp_path / "noise_check.py"
    script.write_text(NOISE_CHECK)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
