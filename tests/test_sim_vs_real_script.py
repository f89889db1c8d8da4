"""scripts/sim_vs_real_gpu.py end to end on the CPU (--tiny), so that its one GPU call cannot fail
on a mistake the CPU would have shown."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

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

    # every real step and request kept for the offline analysis, and the simulation's requests beside them
    for name, stem in (("trace x0.2", "trace-x0.2"), ("poisson 40/s", "poisson-40-s")):
        real, figures = np.load(tmp_path / f"steps-0.6b-{stem}.npz"), workloads[name]["real"]
        assert len(real["start_s"]) == figures["num_steps"] and np.all(np.diff(real["start_s"]) > 0)
        assert real["launched"].sum() > 0 and real["prefill_tokens"].sum() == figures["num_prefill_tokens"]
        ttft = real["request_first_token_s"] - real["request_arrival_s"]
        assert np.quantile(ttft, 0.5) == pytest.approx(figures["ttft_s"]["p50"])
        # the run's requests and steps on one clock: a first token comes at the end of a step
        assert np.all(np.isclose(real["request_first_token_s"][:, None], real["end_s"][None], atol=1e-3).any(1))
        sim = np.load(tmp_path / f"sim-0.6b-{stem}.npz")
        assert len(sim["start_s"]) == workloads[name]["sim"]["num_steps"]
    analysis = (tmp_path / "analysis.md").read_text()
    assert "## 0.6b, poisson 40/s" in analysis and "| #1 |" in analysis and "| batch |" in analysis
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    done = subprocess.run(
        [command[0], os.path.abspath(command[1]), "--analyze", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=elsewhere,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == analysis.strip()
    assert list(elsewhere.iterdir()) == []  # --analyze writes nothing (it made ./sim-vs-real/ once)

    # --real-from: the simulations alone against that call's real runs give the same figures
    again = tmp_path / "again"
    command = [*command[:2], "--real-from", str(tmp_path / "sim_vs_real.json"), "--out", str(again)]
    command += ["--profile", str(tmp_path / "cpu-tiny-torch.json")]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resimulated = json.loads((again / "sim_vs_real.json").read_text())["sizes"]["0.6b"]["workloads"]
    assert set(resimulated) == set(workloads)
    for name, figures in resimulated.items():
        assert figures["real"] == workloads[name]["real"]
        for label in ("sim", "sim, no noise"):
            for key in ("output_tokens_per_s", "ttft_s", "tpot_s", "num_preemptions"):
                assert figures[label][key] == workloads[name][label][key], (name, label, key)
    assert "| poisson 40/s |" in (again / "sim_vs_real.md").read_text()
