"""The example plugin packages, installed offline as a user would install theirs, and used through
the CLI (with their options as Hydra config nodes) and through LLM: the sjf, edf and vtc scheduler
policies, for a second kind the ban sampler, and for a third the session_affinity router. Each example's own tests (the conformance suite
with one import) pass, and the docs' plugin walk-through shows the very files."""

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from inferlab import LLM, SamplingParams
from inferlab.core import plugins

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
EXAMPLE_PACKAGES = ("sjf_scheduler", "edf_scheduler", "vtc_scheduler", "ban_sampler", "session_router")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A directory holding the installed example packages (put it on the path to use them)."""
    root = tmp_path_factory.mktemp("plugins")
    sources = [shutil.copytree(EXAMPLES / name, root / "src" / name) for name in EXAMPLE_PACKAGES]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(root / "site"),
            *map(str, sources),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return root / "site"


def run(args, cwd, site, check=True):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_docs_show_the_example_files():
    text = (REPO / "docs" / "plugins.md").read_text()
    assert "## Write your own scheduler" in text
    for label, path in (
        ("`inferlab_sjf/policy.py`:", "inferlab_sjf/policy.py"),
        ("`pyproject.toml`:", "pyproject.toml"),
    ):
        block = re.search(re.escape(label) + r"\n\n```\w+\n(.*?)\n```", text, re.S)
        assert block, f"docs/plugins.md has no code block after {label}"
        assert block[1] == (EXAMPLES / "sjf_scheduler" / path).read_text().rstrip("\n"), (
            f"docs/plugins.md: {path} differs"
        )


def test_example_policies_are_short_and_import_no_builtin_plugin():
    for name in ("sjf", "edf", "vtc"):
        source = (EXAMPLES / f"{name}_scheduler" / f"inferlab_{name}" / "policy.py").read_text()
        assert "inferlab.plugins" not in source
        policy_class = re.search(r"^class \w+:\n(.*?)(?=^@hookimpl)", source, re.S | re.M)[0]
        assert len([line for line in policy_class.splitlines() if line.strip()]) <= 40, name


def test_the_example_router_is_at_most_40_lines_and_imports_no_builtin_plugin():
    source = (EXAMPLES / "session_router" / "inferlab_session" / "router.py").read_text()
    assert "inferlab.plugins" not in source
    assert len(source.splitlines()) <= 40


@pytest.fixture(scope="module")
def example_test_runs(request, site, tmp_path_factory):
    """The selected examples' own test runs, a process each, as many at once as there are cores:
    each process computes on one thread, so on a 2-core CI machine two at a time take half the time."""
    selected = [
        item.callspec.params["package"]
        for item in request.session.items
        if item.originalname == "test_each_example_passes_its_own_tests"
    ]
    pool = ThreadPoolExecutor(max(1, min(len(selected), os.cpu_count() or 1)))
    runs = {
        package: pool.submit(
            run,
            [
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-n",
                "0",
                str(EXAMPLES / package / "tests"),
            ],  # runs go in parallel
            tmp_path_factory.mktemp(package),
            site,
            check=False,
        )
        for package in selected
    }
    yield runs
    pool.shutdown(cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("package", EXAMPLE_PACKAGES)
def test_each_example_passes_its_own_tests(example_test_runs, package):
    """What a plugin author runs: their tests, the conformance suite among them, in their package."""
    proc = example_test_runs[package].result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


@pytest.mark.slow
def test_listed_with_distribution_and_options(site, tmp_path):
    out = run(["inferlab.list_plugins"], tmp_path, site).stdout
    assert re.search(r"^  sjf +inferlab-sjf 0\.1\.0 \(plugin 'sjf'\)  options: include_prompt=False$", out, re.M)
    assert re.search(
        r"^  vtc +inferlab-vtc 0\.1\.0 \(plugin 'vtc'\)  options: input_weight=1\.0, output_weight=2\.0$", out, re.M
    )
    assert re.search(r"^  ban +inferlab-ban 0\.1\.0 \(plugin 'ban'\)  options: token_ids=\[\]$", out, re.M)
    assert re.search(
        r"^  session_affinity +inferlab-session 0\.1\.0 \(plugin 'session_affinity'\)  options: max_sessions=100000$",
        out,
        re.M,
    )
    assert "problems:" not in out


@pytest.mark.slow
def test_cli_selects_them_with_their_own_parameters(site, tmp_path, checkpoint):
    proc = run(
        [
            "inferlab",
            "job=bench",
            "scheduler=sjf",
            "scheduler.include_prompt=true",
            "sampler=ban",
            "sampler.token_ids=[3,4]",
            f"model.path={checkpoint('gqa2-tied')}",
            "engine.device=cpu",
            "engine.kvcache_block_size=16",
            "engine.num_kvcache_blocks=128",
            "bench.num_seqs=4",
            "bench.min_len=4",
            "bench.max_len=12",
            "bench.max_output_len=4",
            "bench.min_output_len=2",
            "hydra.run.dir=run",
        ],
        tmp_path,
        site,
    )
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["plugins"]["scheduler"] == "sjf" and result["plugins"]["sampler"] == "ban"
    assert result["plugin_options"]["scheduler"] == {"include_prompt": True}
    assert result["plugin_options"]["sampler"] == {"token_ids": [3, 4]}
    assert "tok/s" in proc.stdout


@pytest.mark.slow
def test_cli_checks_their_parameters(site, tmp_path):
    proc = run(["inferlab", "scheduler=sjf", "scheduler.include_prompt=maybe"], tmp_path, site, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "inferlab: Error merging override scheduler.include_prompt=maybe: Value 'maybe' is not a valid bool "
        "(type str) (SJFOptions)"
    ]
    proc = run(["inferlab", "sampler=ban", "sampler.tokens=[1]"], tmp_path, site, check=False)
    assert proc.returncode == 2 and "Key 'tokens' not in 'BanOptions'" in proc.stderr


@pytest.fixture
def installed(site, monkeypatch):
    """The example plugins importable in this process, seen by a freshly loaded registry."""
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(plugins, "_default", None)


@pytest.mark.slow
def test_llm_uses_the_scheduler_and_its_option(installed, checkpoint):
    """With include_prompt the job size counts the prompt: the long prompt with few tokens to
    generate is no longer the shortest job."""
    for include_prompt, expected in ((False, [1, 2, 3]), (True, [2, 3, 1])):
        llm = LLM(
            checkpoint("gqa2-tied"),
            scheduler="sjf",
            scheduler_options={"include_prompt": include_prompt},
            max_num_seqs=1,
            kvcache_block_size=16,
            num_kvcache_blocks=32,
            device="cpu",
        )
        assert type(llm.scheduler.policy).__name__ == "ShortestJobFirst"
        for prompt_len, max_tokens in ((40, 1), (3, 2), (4, 3)):
            llm.add_request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        finished = []
        while not llm.is_finished():
            finished += llm.step().finished
        assert [r.params.max_tokens for r in finished] == expected


@pytest.mark.slow
def test_llm_uses_the_sampler_and_its_option(installed, checkpoint):
    prompts = ["Hello, world!", "Once upon a time,"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    settings = dict(kvcache_block_size=16, num_kvcache_blocks=32, device="cpu")
    plain = LLM(checkpoint("gqa2-tied"), **settings).generate(prompts, greedy, use_tqdm=False)
    banned = sorted({t for out in plain for t in out["token_ids"]})
    llm = LLM(checkpoint("gqa2-tied"), sampler="ban", sampler_options={"token_ids": banned}, **settings)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert all(len(out["token_ids"]) == 12 and not set(out["token_ids"]) & set(banned) for out in outputs)
