"""Plugin failures are reported by `inferlab-plugins`, break nothing until selected, and selecting
one is an error naming the plugin and why: an entry point that fails to import, two plugins with
one name, a factory that raises, a plugin that does not satisfy its Protocol, a bad config node."""

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
from hydra.core.config_store import ConfigStore

from inferlab import LLM, SamplingParams
from inferlab.conf import compose, engine_arguments
from inferlab.core import plugins
from inferlab.core.plugins import KINDS, PluginError, PluginRegistry
from inferlab.list_plugins import listing
from inferlab.list_plugins import main as list_plugins_main
from inferlab.plugins.schedulers.fcfs import FCFSScheduler

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
    assert "  fcfs  inferlab " in out  # the others still load
    registry = plugins.get_registry()
    llm = LLM(checkpoint("gqa2-tied"), registry=registry, **SMALL)  # unselected: harmless
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0]["token_ids"]) <= 2
    with pytest.raises(PluginError) as info:
        LLM(checkpoint("gqa2-tied"), scheduler="broken", registry=registry)
    assert "unknown scheduler 'broken'; available: ['fcfs', 'lpm']" in str(info.value)
    assert f"plugin 'broken' failed to load: {BROKEN_IMPORT}" in str(info.value)


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
    assert selected.returncode == 1
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
    registry = PluginRegistry()
    registry.register(plugin_module("again", register_schedulers=lambda register: register("fcfs", FCFSScheduler)))
    text = listing(registry)
    assert "  fcfs  inferlab 0.1.0 (plugin 'fcfs')  [COLLISION]" in text
    assert (
        "  COLLISION scheduler 'fcfs' is registered by 'fcfs' (inferlab 0.1.0), 'again' (registered by hand): "
        "selecting it is an error until one is uninstalled or renamed"
    ) in text
    with pytest.raises(
        PluginError, match=r"scheduler 'fcfs' is registered by more than one plugin: fcfs \(inferlab .*\), again"
    ):
        LLM(checkpoint("gqa2-tied"), registry=registry, **SMALL)


def test_factory_that_raises(checkpoint, plugin_module):
    def boom(config, kv_cache, depth=1):
        raise RuntimeError(f"cannot schedule at depth {depth}")

    registry = PluginRegistry()
    registry.register(plugin_module("boom_plugin", register_schedulers=lambda register: register("boom", boom)))
    assert "problems:" not in listing(registry)  # it registers fine; it fails when built
    with pytest.raises(
        PluginError,
        match=r"scheduler 'boom' from plugin 'boom_plugin' failed to build \(options \['depth'\]\): "
        r"RuntimeError: cannot schedule at depth 3",
    ):
        LLM(checkpoint("gqa2-tied"), scheduler="boom", scheduler_options={"depth": 3}, registry=registry, **SMALL)


def test_plugins_that_do_not_satisfy_their_protocol(checkpoint, plugin_module):
    class NoSchedule:
        def __init__(self, config, kv_cache):
            pass

        def add(self, seq):
            pass

    registry = PluginRegistry()
    registry.register(plugin_module("half", register_schedulers=lambda register: register("half", NoSchedule)))
    registry.register(
        plugin_module("hollow", register_samplers=lambda register: register("hollow", lambda config: object()))
    )
    # rejected when registered: not selectable, recorded with the plugin's name and what it lacks
    assert "half" not in registry.names("scheduler")
    failure = next(f for f in registry.failures if f.plugin == "half")
    assert (
        "does not satisfy Scheduler: missing ['abort', 'finish', 'is_finished', 'postprocess', 'schedule']"
        in failure.reason
    )
    with pytest.raises(
        PluginError, match=r"unknown scheduler 'half'.*\n.*plugin 'half' failed to load: .*missing \['abort'"
    ):
        registry.get("scheduler", "half")
    text = listing(registry)
    assert (
        "FAILED    plugin 'half' (registered by hand): scheduler 'half' (test_plugins_that_do_not_satisfy_their_protocol"
        ".<locals>.NoSchedule) does not satisfy Scheduler: missing ['abort', 'finish', 'is_finished', 'postprocess', "
        "'schedule']"
    ) in text
    with pytest.raises(
        PluginError, match=r"unknown scheduler 'half'(.|\n)*plugin 'half' failed to load: .*missing \['abort'"
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


def test_bad_config_nodes_are_listed(plugin_module):
    @dataclass
    class Options:
        depth: int = 1

    class Deep(FCFSScheduler):
        def __init__(self, config, kv_cache, width=2):
            super().__init__(config, kv_cache)

    def nodes(register):
        register("schedulers", "deep", Options)
        register("scheduler", "deep", {"depth": 1})
        register("scheduler", "deep", Options)

    registry = PluginRegistry()
    registry.register(
        plugin_module(
            "deep_plugin", register_schedulers=lambda register: register("deep", Deep), register_config_nodes=nodes
        )
    )
    reasons = [f.reason for f in registry.failures if f.plugin == "deep_plugin"]
    assert reasons == [
        "config node 'deep' is for an unknown kind 'schedulers'; kinds: ['attention', 'kv_cache', 'model', 'sampler', 'scheduler']",
        "config node for scheduler 'deep' must be a dataclass type, got {'depth': 1}",
        "config node test_bad_config_nodes_are_listed.<locals>.Options for scheduler 'deep' has fields ['depth'] that its "
        "factory 'test_bad_config_nodes_are_listed.<locals>.Deep' does not accept",
    ]
    assert ("scheduler", "deep") not in registry.config_nodes
    assert "deep" in registry.names("scheduler")  # still selectable, without options


def test_config_node_hydra_cannot_type_is_listed_and_breaks_nothing(plugin_module):
    @dataclass
    class SetOptions:
        ids: set = None  # OmegaConf has no set type

    class WithSet(FCFSScheduler):
        def __init__(self, config, kv_cache, ids=None):
            super().__init__(config, kv_cache)

    registry = PluginRegistry()
    registry.register(
        plugin_module(
            "set_plugin",
            register_schedulers=lambda register: register("withset", WithSet),
            register_config_nodes=lambda register: register("scheduler", "withset", SetOptions),
        ),
        distribution="set-dist 2.0",
    )
    store = ConfigStore.instance()
    saved = {kind: dict(store.repo.get(kind, {})) for kind in KINDS}  # the options of a hand-made registry
    try:
        cfg = compose(["scheduler=withset"], registry=registry)  # still selectable, without options
        assert engine_arguments(cfg)[1]["scheduler_options"] == {}
        assert compose(["scheduler=lpm"], registry=registry).scheduler.name == "lpm"
    finally:
        store.repo.update(saved)
    assert (
        "  FAILED    plugin 'set_plugin' (set-dist 2.0): config node "
        "test_config_node_hydra_cannot_type_is_listed_and_breaks_nothing.<locals>.SetOptions for scheduler "
        "'withset' is not a valid Hydra structured config: Unexpected type annotation: set"
    ) in listing(registry).splitlines()
