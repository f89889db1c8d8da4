"""scripts/disagg_gpu.py (run on the GPU for BENCHMARKS.md) end to end on the CPU with the embedded
model: the serial pass's disaggregated outputs equal the colocated ones, every move is timed beside
the cost model's prediction, and both engines end with every block free."""

import importlib.util
import json
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "disagg_gpu.py"


def test_the_device_script_runs_on_the_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("disagg_gpu", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--tiny", "--out", str(tmp_path)])  # the command docs/disaggregation.md gives
    result = json.loads((tmp_path / "disagg.json").read_text())
    for name in ("serial", "concurrent"):
        part = result[name]
        assert part["all_blocks_freed"] and part["kv_bytes_sent"] == part["kv_bytes_received"] > 0
        summary = part["transfers"]["summary"]
        assert summary["moves"] == part["match"]["requests"] and summary["measured_s"]["p50"] > 0
        for move in part["transfers"]["moves"]:
            assert move["nvlink_s"] < move["infiniband_s"] and move["bytes"] % result["kv_block_bytes"] == 0
        assert 0 < part["busy_fraction"]["prefill"] <= 1 and 0 < part["busy_fraction"]["decode"] <= 1
    assert result["serial"]["match"]["equal"] == result["serial"]["match"]["requests"] == 3
    assert result["concurrent"]["match"]["equal"] == 6  # float32 on the CPU: no batch dependence either
