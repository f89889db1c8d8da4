"""The `inferlab` command on a user's mistakes: the message alone and exit status 2 (the
traceback only with HYDRA_FULL_ERROR=1); requests that fail are printed with why, exit status 1."""

import os
import signal
import subprocess
import sys

import pytest

TINY = ["engine.device=cpu", "engine.kvcache_block_size=16", "generate.use_tqdm=false"]


def inferlab(args, cwd, **env):
    return subprocess.run(
        [sys.executable, "-m", "inferlab", *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["model.path=/nowhere/at/all"], "inferlab: model directory '/nowhere/at/all' does not exist"),
        (["engine.max_num_seqs=0"], "inferlab: max_num_seqs must be a positive integer, got 0"),
        (["generate.prompts=['']"], "inferlab: prompt 0: the prompt is empty: give at least one token"),
        (
            ["generate.temperature=-1"],
            "inferlab: temperature must be a number in [0, 2**126] (below 1e-5: greedy), got -1.0",
        ),
    ],
    ids=["bad-path", "bad-setting", "empty-prompt", "bad-sampling"],
)
def test_a_user_error_prints_its_message_alone(tmp_path, args, message):
    proc = inferlab([*TINY, "generate.max_tokens=4", *args], tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr


@pytest.mark.slow
def test_hydra_full_error_shows_the_traceback(tmp_path):
    proc = inferlab([*TINY, "model.path=/nowhere/at/all"], tmp_path, HYDRA_FULL_ERROR="1")
    assert proc.returncode == 1  # Hydra's own report
    assert (
        "Traceback" in proc.stderr
        and "FileNotFoundError: model directory '/nowhere/at/all' does not exist" in proc.stderr
    )


@pytest.mark.slow
def test_failed_requests_are_printed_and_fail_the_command(tmp_path):
    """One KV block of 16 tokens cannot hold any of the default prompts: each is printed with why."""
    proc = inferlab([*TINY, "engine.num_kvcache_blocks=1"], tmp_path)
    assert proc.returncode == 1
    lines = [line for line in proc.stdout.splitlines() if " -> " in line]
    assert len(lines) == 3 and all(
        " -> error: the request needs up to 3 KV blocks of 16 tokens" in line for line in lines
    )
    assert "inferlab: 3 of 3 requests failed" in proc.stderr
    ok = inferlab([*TINY, "engine.num_kvcache_blocks=4"], tmp_path)
    assert ok.returncode == 0 and " -> error" not in ok.stdout


@pytest.mark.slow
def test_ctrl_c_exits_130_with_a_one_line_message(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "inferlab", *TINY, "generate.max_tokens=4000", "generate.ignore_eos=true"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in process.stdout:  # the engine is built once the KV cache is announced
            if "KV cache:" in line:
                break
        process.send_signal(signal.SIGINT)
        rest = process.stdout.read()
        assert process.wait(timeout=60) == 130
        assert "inferlab: interrupted" in rest and "Traceback" not in rest
    finally:
        process.kill()
        process.wait()
