"""scripts/fleet_gpu.py, the real-against-simulated fleet comparison the device runs, end to end on
this CPU with its tiny settings: Ray's check, the trace, a profile measured here, two replicas on
Ray and in simulation for two routers, and the comparison it writes. Slow (Ray starts three times)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_fleet_script_runs_end_to_end_on_this_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "fleet_gpu.py"), "--out", str(tmp_path), "--tiny"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check = json.loads((tmp_path / "ray-check.json").read_text())
    assert len(check["actors"]) == 2
    # the calibration ran on the CPU actors: their kernels, timed alone and together
    assert [run["duration_s"] for run in check["sharing"]["runs"]] == [0.0002, 0.001, 0.005]
    assert all(run["kernel_s"] > 0 and run["kernels"] > 0 for run in check["sharing"]["runs"])
    comparison = json.loads((tmp_path / "comparison.json").read_text())
    assert set(comparison["sharing"]) == {"context_switch_s", "timeslice_s"}
    for router in ("round_robin", "kv_aware"):
        for key in ("output_tokens_per_s", "ttft_s.p50", "tpot_s.p50"):
            figures = comparison[router][key]
            assert figures["real"] > 0 and figures["sim"] > 0 and figures["relative_difference"] is not None
        assert comparison[router]["router_us_per_request"]["real"] > 0
        result = json.loads((tmp_path / f"real-{router}" / "result.json").read_text())
        assert result["cluster"]["backend"] == "ray" and result["num_failed_requests"] == 0
    assert "| kv_aware | TTFT p50 s |" in (tmp_path / "comparison.md").read_text()
