"""Sweeps that finish: a job that fails writes its error into its directory (error.txt) and the
sweep runs the others; `inferlab` exits 1 at the end, naming the failed jobs; `inferlab-report`
lists every job of the sweep (from multirun.yaml) with its status. And a config mistake is one
line, not Hydra's report of several (HYDRA_FULL_ERROR=1 shows the traceback)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from inferlab.experiment.report import main as report_main

ENGINE = [
    "engine.device=cpu",
    "engine.kvcache_block_size=16",
    "engine.num_kvcache_blocks=64",
    "engine.max_model_len=64",
]
TINY_BENCH = [
    "job=bench",
    "bench.num_seqs=3",
    "bench.min_len=8",
    "bench.max_len=16",
    "bench.min_output_len=2",
    "bench.max_output_len=3",
    "bench.warmup=false",
]


def inferlab(args, cwd, **env):
    return subprocess.run(
        [sys.executable, "-m", "inferlab", *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("failing_sweep")
    proc = inferlab(["-m", *TINY_BENCH, *ENGINE, "engine.max_num_seqs=8,0,4", f"hydra.sweep.dir={root / 's'}"], root)
    return root / "s", proc


def test_a_failed_job_writes_its_error_and_the_sweep_goes_on(sweep):
    sweep_dir, proc = sweep
    assert proc.returncode == 1, proc.stderr  # was 2, at the failed job, and job 2 never ran
    assert (sweep_dir / "1" / "error.txt").read_text().startswith("max_num_seqs must be a positive integer, got 0\n")
    assert "Traceback" in (sweep_dir / "1" / "error.txt").read_text()
    assert json.loads((sweep_dir / "1" / "result.json").read_text())["error"].startswith("ValueError: max_num_seqs")
    for job in ("0", "2"):
        result = json.loads((sweep_dir / job / "result.json").read_text())
        assert "error" not in result and result["num_requests"] == 3
    assert "inferlab: 1 job(s) of the sweep failed:" in proc.stderr
    assert f"{sweep_dir / '1'}: max_num_seqs must be a positive integer, got 0" in proc.stderr


def test_the_report_lists_every_job_of_the_sweep_with_its_status(sweep, tmp_path, capsys):
    copy = tmp_path / "s"
    shutil.copytree(sweep[0], copy)
    shutil.rmtree(copy / "2")  # as if the sweep had stopped before its last job
    report_main([str(copy)])
    out = capsys.readouterr().out.splitlines()
    start = out.index("jobs of the sweep (3, from multirun.yaml):")
    assert out[start + 1] == "  0  engine.max_num_seqs=8: ok"
    assert (
        out[start + 2]
        == "  1  engine.max_num_seqs=0: failed: ValueError: max_num_seqs must be a positive integer, got 0"
    )
    assert out[start + 3].startswith("  2  engine.max_num_seqs=4: missing: it left no directory")


def test_a_generate_job_whose_requests_fail_fails_alone_in_a_sweep(tmp_path):
    """One KV block cannot hold the default prompts: that job's requests fail; the other job runs."""
    proc = inferlab(
        ["-m", "engine.device=cpu", "engine.kvcache_block_size=16", "generate.use_tqdm=false",
         "engine.num_kvcache_blocks=1,64", f"hydra.sweep.dir={tmp_path / 's'}"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    assert (tmp_path / "s" / "0" / "error.txt").read_text().startswith("3 of 3 requests failed")
    assert not (tmp_path / "s" / "1" / "error.txt").exists() and proc.stdout.count(" tok/s (prefill") == 2


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["engine.max_num_seqs=abc"],
            "inferlab: Error merging override engine.max_num_seqs=abc: Value 'abc' of type 'str' could not be "
            "converted to Integer (EngineSettings)",
        ),
        (
            ["engine.nothing=1"],
            "inferlab: Could not override 'engine.nothing': Key 'nothing' not in 'EngineSettings' (EngineSettings)",
        ),
        (
            ["scheduler=nope"],
            "inferlab: In 'config': Could not find 'scheduler/nope'; Available options in 'scheduler': fcfs, lpm, "
            "priority",
        ),
        (
            ["-m", "engine.max_num_seqs=1,abc"],  # a sweep: refused before any job runs
            "inferlab: Error merging override engine.max_num_seqs=abc: Value 'abc' of type 'str' could not be "
            "converted to Integer (EngineSettings)",
        ),
    ],
    ids=["bad-type", "unknown-key", "unknown-option", "bad-sweep-value"],
)
def test_a_config_error_prints_one_line(tmp_path, args, line):
    proc = inferlab([*args, f"hydra.sweep.dir={tmp_path / 's'}"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [line]
    assert not (tmp_path / "s").exists()


def test_hydra_full_error_shows_a_config_errors_traceback(tmp_path):
    proc = inferlab(["engine.max_num_seqs=abc"], tmp_path, HYDRA_FULL_ERROR="1")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "could not be converted to Integer" in proc.stderr
