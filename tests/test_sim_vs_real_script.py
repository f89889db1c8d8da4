"""scripts/sim_vs_real_gpu.py end to end on the CPU (--tiny), so that its one GPU call cannot fail
on a mistake the CPU would have shown."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_sim_vs_real_script_runs_on_the_cpu(tmp_path):
    command = [
        sys.executable,
        os.path.join(ROOT, "scripts", "sim_vs_real_gpu.py"),
        "--tiny",
        "--out",
        str(tmp_path),
        "--time-scales",
        "0.2",
        "--rates",
        "40",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "sim_vs_real.json").read_text())
    workloads = report["sizes"]["0.6b"]["workloads"]
    assert set(workloads) == {"trace x0.2", "poisson 40/s"}
    for figures in workloads.values():
        assert {"real", "sim", "sim, no noise", "sim, no host costs"} <= set(figures)
        assert figures["real"]["num_kvcache_blocks"] == figures["sim"]["num_kvcache_blocks"]
        assert figures["real"]["num_requests"] == figures["sim"]["num_requests"]
    profile = json.loads((tmp_path / "cpu-tiny-torch.json").read_text())
    assert profile["kind"] == "measured" and profile["launch_in_run_factor"] > 0
    table = (tmp_path / "sim_vs_real.md").read_text()
    assert "| trace x0.2 |" in table and "host time in the real runs" in table
