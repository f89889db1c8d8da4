"""Plugin failures are reported by `inferlab-plugins`, break nothing until selected, and selecting
one is an error naming the plugin and why: an entry point that fails to import, two plugins with
one name, a factory that raises, a plugin that does not satisfy its Protocol, a bad config node."""

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
from hydra.core.config_store import ConfigStore

from inferlab import LLM, SamplingParams
from inferlab.conf import compose
from inferlab.core import plugins
from inferlab.core.plugins import KINDS, PluginError, PluginRegistry
from inferlab.list_plugins import listing
from inferlab.list_plugins import main as list_plugins_main
from inferlab.plugins.schedulers.fcfs import FCFSPolicy

BROKEN_IMPORT = (
    "import of 'inferlab_broken_missing.scheduler' failed: ModuleNotFoundError: "
    "No module named 'inferlab_broken_missing'"
)


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory):
    """An installed distribution whose entry point names a module that does not exist."""
    site = tmp_path_factory.mktemp("broken_site")
    info = site / "inferlab_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: inferlab-broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[inferlab]\nbroken = inferlab_broken_missing.scheduler\n")
    return site


SMALL = dict(kvcache_block_size=16, num_kvcache_blocks=32, device="cpu")


def test_entry_point_that_fails_to_import(broken_site, monkeypatch, checkpoint, capsys):
    monkeypatch.syspath_prepend(str(broken_site))
    monkeypatch.setattr(plugins, "_default", None)
    list_plugins_main([])
    out = capsys.readouterr().out
    assert f"  FAILED    plugin 'broken' (inferlab-broken 0.1): {BROKEN_IMPORT}" in out.splitlines()
    assert "  fcfs      inferlab " in out  # the others still load
    registry = plugins.get_registry()
    llm = LLM(checkpoint("gqa2-tied"), registry=registry, **SMALL)  # unselected: harmless
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0]["token_ids"]) <= 2
    with pytest.raises(PluginError) as info:
        LLM(checkpoint("gqa2-tied"), scheduler="broken", registry=registry)
    assert "unknown scheduler 'broken'; available: ['fcfs', 'lpm', 'priority']" in str(info.value)
    assert f"plugin 'broken' failed to load: {BROKEN_IMPORT}" in str(info.value)


@pytest.mark.slow
def test_cli_names_the_broken_plugin_only_when_selected(broken_site, tmp_path, checkpoint):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(broken_site), os.environ.get("PYTHONPATH", "")])}
    selected = subprocess.run(
        [sys.executable, "-m", "inferlab", "scheduler=broken"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert selected.returncode == 2
    assert "no scheduler named 'broken' is registered; plugins that failed to load:" in selected.stderr
    assert f"'broken' (inferlab-broken 0.1): {BROKEN_IMPORT}" in selected.stderr
    assert "Could not find 'scheduler/broken'" in selected.stderr  # and Hydra's own message with the options
    unselected = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferlab",
            f"model.path={checkpoint('gqa2-tied')}",
            "generate.max_tokens=2",
            "generate.use_tqdm=false",
            "engine.device=cpu",
            "engine.kvcache_block_size=16",
            "engine.num_kvcache_blocks=32",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert unselected.returncode == 0, unselected.stderr
    assert "broken" not in unselected.stdout + unselected.stderr


def test_name_collision(checkpoint, plugin_module):
    """A plugin registered by hand under a built-in's name: the built-in keeps the name, the other
    is selected as again:fcfs; two plugins of one name neither built in: the name is ambiguous."""
    registry = PluginRegistry()
    registry.register(plugin_module("again", register_schedulers=lambda register: register("fcfs", FCFSPolicy)))
    text = listing(registry)
    assert re.search(r"^  fcfs +inferlab 0.1.0 \(plugin 'fcfs'\)  \[COLLISION\]$", text, re.M)
    assert re.search(r"^  again:fcfs +registered by hand \(plugin 'again'\)  \[COLLISION\]$", text, re.M)
    assert (
        "  COLLISION scheduler 'fcfs' is registered by inferlab 0.1.0 (plugin 'fcfs') as 'inferlab:fcfs', registered "
        "by hand (plugin 'again') as 'again:fcfs': 'fcfs' selects the built-in; the qualified names select each"
    ) in text
    assert registry.get("scheduler", "fcfs").package == "inferlab"
    assert registry.get("scheduler", "again:fcfs").plugin == "again"
    assert len(LLM(checkpoint("gqa2-tied"), registry=registry, **SMALL).generate([[1, 2]], use_tqdm=False)) == 1

    registry.register(plugin_module("one", register_schedulers=lambda register: register("mine", FCFSPolicy)))
    registry.register(plugin_module("two", register_schedulers=lambda register: register("mine", FCFSPolicy)))
    with pytest.raises(
        PluginError,
        match=r"scheduler 'mine' is registered by more than one package: registered by hand \(plugin 'one'\) as "
        r"'one:mine', registered by hand \(plugin 'two'\) as 'two:mine'; select one of those",
    ):
        LLM(checkpoint("gqa2-tied"), registry=registry, scheduler="mine", **SMALL)
    LLM(checkpoint("gqa2-tied"), registry=registry, scheduler="two:mine", **SMALL)
    with pytest.raises(PluginError, match="a plugin named 'one' is already registered \\(registered by hand\\)"):
        registry.register(plugin_module("one"))


def test_factory_that_raises(checkpoint, plugin_module):
    @dataclass
    class BoomOptions:
        depth: int = 1

    def boom(depth):
        raise RuntimeError(f"cannot schedule at depth {depth}")

    registry = PluginRegistry()
    registry.register(
        plugin_module("boom_plugin", register_schedulers=lambda register: register("boom", boom, options=BoomOptions))
    )
    assert "problems:" not in listing(registry)  # it registers fine; it fails when built
    with pytest.raises(
        PluginError,
        match=r"scheduler 'boom' from plugin 'boom_plugin' failed to build: RuntimeError: cannot schedule at depth 3",
    ):
        LLM(checkpoint("gqa2-tied"), scheduler="boom", scheduler_options={"depth": 3}, registry=registry, **SMALL)


def test_plugins_that_do_not_satisfy_their_protocol(checkpoint, plugin_module):
    class NoVictim:
        def admission_order(self, waiting, state):
            return waiting

    registry = PluginRegistry()
    registry.register(plugin_module("half", register_schedulers=lambda register: register("half", NoVictim)))
    registry.register(
        plugin_module("hollow", register_samplers=lambda register: register("hollow", lambda config: object()))
    )
    # rejected when registered: not selectable, recorded with the plugin's name and what it lacks
    assert "half" not in registry.names("scheduler")
    failure = next(f for f in registry.failures if f.plugin == "half")
    assert "does not satisfy SchedulerPolicy: missing ['preemption_victim']" in failure.reason
    with pytest.raises(
        PluginError,
        match=r"unknown scheduler 'half'.*\n.*plugin 'half' failed to load: .*missing \['preemption_victim'",
    ):
        registry.get("scheduler", "half")
    text = listing(registry)
    assert (
        "FAILED    plugin 'half' (registered by hand): scheduler 'half' (test_plugins_that_do_not_satisfy_their_protocol"
        ".<locals>.NoVictim) does not satisfy SchedulerPolicy: missing ['preemption_victim']"
    ) in text
    with pytest.raises(
        PluginError,
        match=r"unknown scheduler 'half'(.|\n)*plugin 'half' failed to load: .*missing \['preemption_victim'",
    ):
        LLM(checkpoint("gqa2-tied"), scheduler="half", registry=registry)
    # A factory function is checked on what it returns, when selected.
    with pytest.raises(
        PluginError, match=r"sampler 'hollow' from plugin 'hollow' does not satisfy Sampler: missing \['__call__'\]"
    ):
        LLM(checkpoint("gqa2-tied"), sampler="hollow", registry=registry, **SMALL)


def test_hook_that_raises_is_listed(plugin_module):
    def explode(register):
        raise ImportError("needs cuda-only-lib")

    registry = PluginRegistry()
    registry.register(plugin_module("needs_lib", register_attention_backends=explode))
    assert (
        "  FAILED    plugin 'needs_lib' (registered by hand): explode raised ImportError: needs cuda-only-lib"
        in listing(registry).splitlines()
    )


def test_misspelled_hook_fails_loudly(plugin_module):
    registry = PluginRegistry()
    registry.register(plugin_module("typo", register_scheduler=lambda register: None))
    assert registry.failures[-1].plugin == "typo" and "register_scheduler" in registry.failures[-1].reason


def test_bad_options_classes_are_listed(plugin_module):
    """An options class that cannot serve (not a dataclass, fields the factory does not take, a type
    Hydra cannot type) makes the plugin fail to register, with the reason listed."""

    @dataclass
    class Options:
        depth: int = 1

    @dataclass
    class SetOptions:
        ids: set = None  # OmegaConf has no set type

    class Deep(FCFSPolicy):
        def __init__(self, width=2):
            self.width = width

    def register_all(register):
        register("as_dict", Deep, options={"depth": 1})
        register("deep", Deep, options=Options)
        register("withset", Deep, options=SetOptions)

    registry = PluginRegistry()
    registry.register(plugin_module("deep_plugin", register_schedulers=register_all), distribution="deep-dist 2.0")
    reasons = [f.reason for f in registry.failures if f.plugin == "deep_plugin"]
    assert reasons == [
        "the options of scheduler 'as_dict' must be a dataclass type, got {'depth': 1}",
        "the options class test_bad_options_classes_are_listed.<locals>.Options of scheduler 'deep' has fields "
        "['depth'] that its factory 'test_bad_options_classes_are_listed.<locals>.Deep' does not accept",
        "the options class test_bad_options_classes_are_listed.<locals>.SetOptions of scheduler 'withset' is not a "
        "valid Hydra structured config: Unexpected type annotation: set",
    ]
    assert not {"as_dict", "deep", "withset"} & set(registry.names("scheduler"))
    assert (
        "  FAILED    plugin 'deep_plugin' (deep-dist 2.0): the options of scheduler 'as_dict' must be a dataclass "
        "type, got {'depth': 1}"
    ) in listing(registry).splitlines()
    store = ConfigStore.instance()
    saved = {kind: dict(store.repo.get(kind, {})) for kind in KINDS}  # the options of a hand-made registry
    try:
        assert compose(["scheduler=lpm"], registry=registry).scheduler.name == "lpm"  # the rest still composes
    finally:
        store.repo.update(saved)


def test_options_from_python_are_checked_as_the_command_line_checks_them(checkpoint):
    with pytest.raises(PluginError, match=r"bad options for scheduler 'lpm': Key 'include_prompt' not in 'LPMOptions'"):
        LLM(checkpoint("gqa2-tied"), scheduler="lpm", scheduler_options={"include_prompt": "no"}, **SMALL)
    with pytest.raises(PluginError, match=r"bad options for scheduler 'lpm': Value 'many' of type 'str' could not be"):
        LLM(checkpoint("gqa2-tied"), scheduler="lpm", scheduler_options={"max_sort_waiting": "many"}, **SMALL)
    with pytest.raises(PluginError, match=r"scheduler 'fcfs' takes no options, got \['x'\]"):
        LLM(checkpoint("gqa2-tied"), scheduler_options={"x": 1}, **SMALL)
    with pytest.raises(PluginError, match=r"attention 'triton'.*Key 'block_q' not in"):
        LLM(checkpoint("gqa2-tied"), attention="triton", attention_options={"block_q": 16}, **SMALL)
