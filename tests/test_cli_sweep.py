"""The `inferlab` app end to end on CPU: the default job, a bench sweep writing one result.json per
run, and `inferlab-report` turning the sweep into a table, a CSV and a PNG."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from inferlab.experiment.report import main as report_main
from inferlab.experiment.report import report

ENGINE = [
    "engine.device=cpu",
    "engine.kvcache_block_size=16",
    "engine.num_kvcache_blocks=256",
    "engine.max_model_len=256",
]
TINY_BENCH = [
    "job=bench",
    "bench.num_seqs=6",
    "bench.min_len=8",
    "bench.max_len=40",
    "bench.min_output_len=2",
    "bench.max_output_len=6",
]


def inferlab(args, cwd, env=None, check=True, command=(sys.executable, "-m", "inferlab")):
    proc = subprocess.run(
        [*command, *args], cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=600
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"inferlab {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_default_command_generates_on_the_tiny_model(tmp_path):
    script = shutil.which("inferlab", path=os.path.dirname(sys.executable))
    proc = inferlab([], tmp_path, command=[script] if script else [sys.executable, "-m", "inferlab"])
    lines = proc.stdout.splitlines()
    assert "model=qwen3 scheduler=fcfs kv_cache=paged attention=torch sampler=default" in lines
    assert sum(" -> " in line for line in lines) == 3
    assert re.fullmatch(r"\d+ tokens in [\d.]+ s: \d+ tok/s \(prefill \d+ tok/s, decode \d+ tok/s\)", lines[-1])
    assert (tmp_path / "outputs").is_dir()  # Hydra's run directory


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("sweep")
    proc = inferlab(
        [
            "-m",
            "attention=torch",
            "scheduler=fcfs,lpm",
            f"model.path={checkpoint('gqa2-tied')}",
            f"hydra.sweep.dir={root / 'sweep'}",
            *TINY_BENCH,
            *ENGINE,
        ],
        root,
    )
    return root / "sweep", proc


def test_sweep_writes_one_result_per_run(sweep, checkpoint):
    sweep_dir, proc = sweep
    results = [json.loads((sweep_dir / str(i) / "result.json").read_text()) for i in range(2)]
    assert not (sweep_dir / "2").exists()
    assert [r["plugins"]["scheduler"] for r in results] == ["fcfs", "lpm"]
    for result in results:
        assert result["plugins"] == {
            "model": "qwen3",
            "scheduler": result["plugins"]["scheduler"],
            "kv_cache": "paged",
            "attention": "torch",
            "sampler": "default",
        }
        assert (
            result["output_tokens_per_s"] > 0
            and result["prefill_tokens_per_s"] > 0
            and result["decode_tokens_per_s"] > 0
        )
        assert result["wall_time_s"] > 0 and result["num_requests"] == 6
        assert (
            result["num_output_tokens"] == result["num_decode_tokens"] + 6
        )  # each request's first token comes with its prefill
        assert result["num_preemptions"] == 0
        # the floor of this very workload on this device, and how close the run came
        assert 0 < result["floor_seconds"] < result["wall_time_s"]
        assert result["percent_of_floor"] == pytest.approx(100 * result["floor_seconds"] / result["wall_time_s"])
        assert result["bandwidth_GBps"] > 0 and result["matmul_TFLOPs"] > 0
        assert "of it" in proc.stdout and "floor on this device" in proc.stdout
        assert result["engine"]["max_model_len"] == 256 and result["engine"]["kvcache_block_size"] == 16
        assert result["num_kvcache_blocks"] == 256 and result["model_path"] == checkpoint("gqa2-tied")
        assert result["bench"]["num_seqs"] == 6 and result["choices"]["bench.max_output_len"] == 6
        assert result["device"] == "cpu" and result["dtype"] == "float32"
        assert result["torch_version"] and result["inferlab_version"]
        assert "git_commit" in result
        # the sweep ran with this process's environment, where other test modules may set it
        assert result["triton_interpret"] == (os.environ.get("TRITON_INTERPRET") == "1")
        assert {"distribution": "inferlab", "version": result["inferlab_version"]}.items() <= next(
            p for p in result["plugin_packages"] if p["distribution"] == "inferlab"
        ).items()
        assert result["workload"]["arrival"] == "burst" and result["workload"]["num_requests"] == 6
        assert "attention=torch" in result["overrides"]
    assert results[1]["plugin_options"]["scheduler"] == {"max_sort_waiting": 1024}


def test_report_table_csv_and_png(sweep, capsys):
    sweep_dir, _ = sweep
    report_main([str(sweep_dir)])
    out = capsys.readouterr().out.splitlines()
    header = out[0].split()
    # Only what differs across runs is a column: the scheduler, not attention, nor lpm's own option,
    # which every run that has it holds at one value.
    assert header[:3] == ["run", "scheduler", "output"]
    assert "attention" not in header and "scheduler.max_sort_waiting" not in header
    assert out[2].split()[:2] == ["0", "fcfs"] and out[3].split()[:2] == ["1", "lpm"]
    with open(sweep_dir / "report.csv") as f:
        rows = list(csv.DictReader(f))
    results = [json.loads((sweep_dir / str(i) / "result.json").read_text()) for i in range(2)]
    assert [r["scheduler"] for r in rows] == ["fcfs", "lpm"]
    assert [float(r["output tok/s"]) for r in rows] == pytest.approx([r["output_tokens_per_s"] for r in results])
    png = sweep_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(png) as image:
        image.verify()
    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 300


def test_report_of_an_empty_dir_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        report_main([str(tmp_path)])
    assert exit_info.value.code == 1
    assert "no result.json under" in capsys.readouterr().err


@pytest.mark.slow
def test_sweep_over_triton_under_the_interpreter(tmp_path, checkpoint):
    inferlab(
        [
            "-m",
            "attention=torch,triton",
            f"model.path={checkpoint('gqa2-tied')}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            *TINY_BENCH,
            "bench.num_seqs=2",
            "bench.warmup=false",  # its generate of 64 tokens would be most of the interpreter's time
            *ENGINE,
        ],
        tmp_path,
        env={"TRITON_INTERPRET": "1"},
    )
    results = [json.loads((tmp_path / "sweep" / str(i) / "result.json").read_text()) for i in range(2)]
    assert [r["plugins"]["attention"] for r in results] == ["torch", "triton"]
    assert all(r["triton_interpret"] for r in results)
    header, rows = report(str(tmp_path / "sweep"))
    assert header[1] == "attention" and [row[1] for row in rows] == ["torch", "triton"]


def test_a_sweep_frees_each_jobs_engine(tmp_path, monkeypatch):
    """A sweep runs its jobs one after another in one process: each job's engine (and the workload
    its requests hold) is freed when the job ends, not left in reference cycles for a full
    collection that may come jobs later (on the whole Mooncake trace, every job's prompts stacked)."""
    import gc
    import weakref

    from hydra.core.global_hydra import GlobalHydra

    import inferlab
    from inferlab import cli

    engines = []

    class RecordedLLM(inferlab.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(weakref.ref(self))

    monkeypatch.setattr(inferlab, "LLM", RecordedLLM)
    args = [*TINY_BENCH, "executor=simulated", "executor.profile=h200-qwen3-0.6b-triton", "scheduler=fcfs,lpm"]
    monkeypatch.setattr(sys, "argv", ["inferlab", "-m", *args, f"hydra.sweep.dir={tmp_path}"])
    monkeypatch.chdir(tmp_path)
    GlobalHydra.instance().clear()
    gc.disable()  # no collection but the job's own may free the engines
    try:
        cli.main()
    finally:
        gc.enable()
        GlobalHydra.instance().clear()
    assert len(engines) == 2
    assert all(engine() is None for engine in engines)
