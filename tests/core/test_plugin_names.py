"""Plugin names two packages share: an installed package whose entry point and scheduler are both
named `fcfs`, like the built-in's. The built-in keeps the name (the default engine and
`inferlab-plugins` work, where they used to crash with "a plugin named 'fcfs' is already
registered"), the other is selected as `inferlab-evil:fcfs` (its distribution's name, then the
plugin's), from Python and from the command line, and the listing names both packages."""

import os
import re
import subprocess
import sys

import pytest

from inferlab import LLM, SamplingParams
from inferlab.core import plugins
from inferlab.list_plugins import main as list_plugins_main

EVIL = '''
from inferlab.core.hookspecs import hookimpl


class LastFirst:
    """Admits the newest waiting request first."""

    def admission_order(self, waiting, state):
        return list(reversed(waiting))

    def preemption_victim(self, running, state):
        return running[-1]


@hookimpl
def register_schedulers(register):
    register("fcfs", LastFirst)
'''


@pytest.fixture(scope="module")
def evil_site(tmp_path_factory):
    """An installed distribution, inferlab-evil 1.0, whose entry point `fcfs` registers a scheduler `fcfs`."""
    site = tmp_path_factory.mktemp("evil_site")
    (site / "inferlab_evil_fcfs.py").write_text(EVIL)
    info = site / "inferlab_evil-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: inferlab_evil\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[inferlab]\nfcfs = inferlab_evil_fcfs\n")
    return site


@pytest.fixture
def registry(evil_site, monkeypatch):
    monkeypatch.syspath_prepend(str(evil_site))
    monkeypatch.setattr(plugins, "_default", None)
    yield plugins.get_registry()
    sys.modules.pop("inferlab_evil_fcfs", None)


def test_the_builtin_keeps_its_name_and_the_other_is_package_colon_name(registry, checkpoint):
    assert registry.get("scheduler", "fcfs").package == "inferlab"
    assert registry.get("scheduler", "inferlab-evil:fcfs").factory.__name__ == "LastFirst"
    assert registry.get("scheduler", "inferlab:fcfs").package == "inferlab"
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with LLM(checkpoint(), registry=registry, device="cpu", max_num_seqs=1) as llm:  # the default: unbroken
        assert type(llm.scheduler.policy).__name__ == "FCFSPolicy"
        ids = [llm.add_request([i + 1, i + 2], params) for i in range(3)]
        order = [r.request_id for _ in range(6) for r in llm.step().finished]
        assert order == ids
    with LLM(checkpoint(), registry=registry, scheduler="inferlab-evil:fcfs", device="cpu", max_num_seqs=1) as llm:
        assert type(llm.scheduler.policy).__name__ == "LastFirst"
        ids = [llm.add_request([i + 1, i + 2], params) for i in range(3)]
        order = [r.request_id for _ in range(6) for r in llm.step().finished]
        assert order == ids[::-1]


def test_the_listing_shows_both_and_names_both_packages(registry, capsys):
    list_plugins_main([])
    out = capsys.readouterr().out
    assert re.search(r"^  fcfs +inferlab 0\.1\.0 \(plugin 'fcfs'\)  \[COLLISION\]$", out, re.M)
    assert re.search(
        r"^  inferlab-evil:fcfs +inferlab_evil 1\.0 \(plugin 'inferlab-evil:fcfs'\)  \[COLLISION\]$", out, re.M
    )
    assert (
        "  COLLISION scheduler 'fcfs' is registered by inferlab 0.1.0 (plugin 'fcfs') as 'inferlab:fcfs', "
        "inferlab_evil 1.0 (plugin 'inferlab-evil:fcfs') as 'inferlab-evil:fcfs': 'fcfs' selects the built-in; "
        "the qualified names select each"
    ) in out


def test_the_command_line_selects_either(evil_site, tmp_path, checkpoint):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(evil_site), os.environ.get("PYTHONPATH", "")])}
    common = [f"model.path={checkpoint()}", "engine.device=cpu", "generate.max_tokens=2", "generate.use_tqdm=false"]
    for choice in ("fcfs", "inferlab-evil:fcfs"):
        proc = subprocess.run(
            [sys.executable, "-m", "inferlab", f"scheduler={choice}", *common],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert f"scheduler={choice} " in proc.stdout
