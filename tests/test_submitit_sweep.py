"""A bench sweep through Hydra's submitit launcher (`hydra/launcher=submitit_local`: each job a
process of its own, as submitit_slurm makes each a SLURM job), then `inferlab-report` on the sweep
directory."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher (extra: test)")

TINY = [
    "job=bench",
    "bench.num_seqs=4",
    "bench.min_len=8",
    "bench.max_len=24",
    "bench.min_output_len=2",
    "bench.max_output_len=4",
    "engine.device=cpu",
    "engine.kvcache_block_size=16",
    "engine.num_kvcache_blocks=128",
    "engine.max_model_len=128",
]


@pytest.mark.slow
def test_submitit_local_sweep_then_report(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferlab",
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=10",
            "scheduler=fcfs,lpm",
            f"hydra.sweep.dir={sweep}",
            *TINY,
        ],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Submitit 'local' sweep output dir" in proc.stdout + proc.stderr
    assert sorted(os.listdir(sweep / ".submitit"))  # submitit's own logs, one folder per job
    results = [json.loads((sweep / str(job) / "result.json").read_text()) for job in range(2)]
    assert [r["plugins"]["scheduler"] for r in results] == ["fcfs", "lpm"]
    assert all(r["num_requests"] == 4 and r["num_output_tokens"] > 0 for r in results)

    report = subprocess.run(
        [sys.executable, "-c", "from inferlab.experiment.report import main; main()", str(sweep)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    assert lines[0].split()[:3] == ["run", "scheduler", "output"]
    assert [line.split()[:2] for line in lines[2:4]] == [["0", "fcfs"], ["1", "lpm"]]
    assert not any("failed" in line for line in lines)
    assert (sweep / "report.csv").is_file() and (sweep / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_the_documented_slurm_overrides_compose(tmp_path):
    """docs/experiments.md's submitit_slurm command: one GPU per job, its partition and time limit."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferlab",
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.gpus_per_node=1",
            "hydra.launcher.cpus_per_task=8",
            "hydra.launcher.mem_gb=64",
            "hydra.launcher.timeout_min=60",
            "job=bench",
            "--cfg",
            "hydra",
            "--package",
            "hydra.launcher",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    from omegaconf import OmegaConf

    launcher = OmegaConf.create(proc.stdout)  # the hydra.launcher node alone
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.timeout_min) == ("gpu", 1, 60)
