"""Every Triton kernel variant the CPU tests reach compiles for a Hopper GPU (sm_90).

CI has no GPU, and Triton's interpreter runs kernels that its compiler rejects (a loop that
changes a variable's shape, a branch that makes a value of two types), so the kernel tests below
are re-run interpreted with their launches recorded, and each distinct variant is then compiled,
with PDL as a Hopper GPU launches it, by the installed Triton (kernel_variants.py)."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import kernel_variants
import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(TESTS, "helpers")  # kernel_variants, loaded by the subprocesses below

# slow: it re-runs the kernel tests interpreted, then compiles every variant they reached
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]

SAMPLING = textwrap.dedent("""
    import sys
    import kernel_variants
    kernel_variants.start_recording()
    import torch
    from inferlab.kernels.sampling import sample_tokens
    for rows, vocab in [(3, 4099), (2, 7)]:
        temperatures = torch.tensor([0.0, 0.7, 1.3][:rows])
        sample_tokens(torch.randn(rows, vocab).bfloat16(), temperatures, torch.arange(rows), torch.arange(rows))
    kernel_variants.save(sys.argv[1])
""")


def test_every_kernel_variant_the_cpu_tests_reach_compiles_for_sm90(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU the kernel tests compile every variant themselves")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HELPERS, os.environ.get("PYTHONPATH", "")])}
    recording = {**env, "TRITON_INTERPRET": "1"}
    tests = [
        os.path.join(TESTS, name) for name in ("plugins/test_triton_attention.py", "kernels/test_model_kernels.py")
    ]
    # the tests in two shards, each recorded by its own process at once: a core each on CI's two
    shards = 2
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "kernel_variants", "-p", "no:cacheprovider", *tests]
            + ["-m", "not gpu", "-k", "not generate"]  # the slow kernel tests too
            + ["-n", "0"],  # launches are recorded in this process, not in xdist's workers
            env={
                **recording,
                "INFERLAB_KERNEL_LAUNCHES": str(tmp_path / f"tests{i}.pkl"),
                "INFERLAB_KERNEL_SHARD": f"{i}/{shards}",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(shards)
    ]
    for shard, (stdout, stderr) in [(shard, shard.communicate(timeout=900)) for shard in runs]:
        assert shard.returncode == 0, stdout[-3000:] + stderr[-3000:]
        assert " passed" in stdout, stdout[-3000:]  # each shard ran tests
    run = subprocess.run(
        [sys.executable, "-c", SAMPLING, str(tmp_path / "sampling.pkl")],
        env=recording,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]

    compiling = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    compiling["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled here, not found from an earlier run
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(HELPERS, "kernel_variants.py"),
            *(str(tmp_path / f"tests{i}.pkl") for i in range(shards)),
            str(tmp_path / "sampling.pkl"),
        ],
        env=compiling,
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = run.stdout + run.stderr[-3000:]
    if run.returncode == kernel_variants.NO_INTERNALS:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0 and "FAILED" not in run.stdout, report
    assert "never compiled" not in run.stdout, report  # each kernel reached by some test
    assert run.stdout.count("compiled ") >= 14, report
