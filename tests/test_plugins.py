"""The plugin registry: built-ins arrive through entry points like any third-party package, and
plugins that break their contract are rejected with their name and what they lack."""
import types

import pytest

from inferlab import LLM, SamplingParams
from inferlab.core import hookspecs
from inferlab.core.hookspecs import hookimpl
from inferlab.core.plugins import KINDS, PluginError, PluginRegistry
from inferlab.plugins.schedulers.fcfs import FCFSScheduler


def plugin_module(name, **hooks):
    module = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(module, hook_name, hookimpl(fn))
    return module


def test_builtins_come_from_entry_points():
    registry = PluginRegistry()
    assert registry.failures == []
    expected = {"scheduler": "fcfs", "kv_cache": "paged", "attention": "torch", "model": "qwen3", "sampler": "default"}
    for kind, name in expected.items():
        entry = registry.get(kind, name)
        assert entry.distribution.startswith("inferlab ")
    assert getattr(registry.get("model", "qwen3").factory, "architectures") == ("Qwen3ForCausalLM",)


def test_every_hook_is_documented():
    for hook_name, _ in KINDS.values():
        assert getattr(hookspecs, hook_name).__doc__.strip()


def test_class_missing_protocol_methods_is_rejected_at_load():
    class HalfScheduler:
        def __init__(self, config, kv_cache):
            pass

        def add(self, seq):
            pass

    registry = PluginRegistry()
    registry.register(plugin_module("half", register_schedulers=lambda register: register("half", HalfScheduler)))
    assert "half" not in registry.names("scheduler")
    failure = registry.failures[-1]
    assert failure.plugin == "half"
    assert "does not satisfy Scheduler: missing ['abort', 'finish', 'is_finished', 'postprocess', 'schedule']" in failure.reason
    with pytest.raises(PluginError, match=r"unknown scheduler 'half'.*\n.*plugin 'half' failed to load: .*missing \['abort'"):
        registry.get("scheduler", "half")


def test_factory_returning_incomplete_object_is_rejected_when_built(checkpoint):
    def make_sampler(config, **options):
        return object()

    registry = PluginRegistry()
    registry.register(plugin_module("bad_sampler", register_samplers=lambda register: register("bad", make_sampler)))
    with pytest.raises(PluginError, match=r"sampler 'bad' from plugin 'bad_sampler' does not satisfy Sampler: missing \['__call__'\]"):
        LLM(checkpoint("gqa2-tied"), sampler="bad", registry=registry)


def test_factory_that_raises_names_the_plugin(checkpoint):
    def broken(config, kv_cache, **options):
        raise RuntimeError("boom")

    registry = PluginRegistry()
    registry.register(plugin_module("broken", register_schedulers=lambda register: register("broken", broken)))
    with pytest.raises(PluginError, match=r"scheduler 'broken' from plugin 'broken' failed to build .*RuntimeError: boom"):
        LLM(checkpoint("gqa2-tied"), scheduler="broken", registry=registry)


def test_name_collision_is_an_error_naming_both(checkpoint):
    registry = PluginRegistry()
    registry.register(plugin_module("again", register_schedulers=lambda register: register("fcfs", FCFSScheduler)))
    with pytest.raises(PluginError, match=r"scheduler 'fcfs' is registered by more than one plugin: fcfs \(inferlab .*\), again"):
        registry.get("scheduler", "fcfs")


def test_misspelled_hook_fails_loudly():
    registry = PluginRegistry()
    registry.register(plugin_module("typo", register_scheduler=lambda register: None))
    assert registry.failures[-1].plugin == "typo" and "register_scheduler" in registry.failures[-1].reason


def test_hook_that_raises_is_reported():
    def explode(register):
        raise ImportError("needs a library that is not installed")

    registry = PluginRegistry()
    registry.register(plugin_module("explodes", register_samplers=explode))
    assert "ImportError: needs a library" in registry.failures[-1].reason


def test_third_party_scheduler_with_options_runs(checkpoint):
    class NewestFirst(FCFSScheduler):
        """Admits the most recent request first (a toy policy with one option)."""

        def __init__(self, config, kv_cache, reverse=True, **options):
            super().__init__(config, kv_cache, **options)
            self.reverse = reverse

        def order_waiting(self):
            if self.reverse:
                self.waiting = type(self.waiting)(sorted(self.waiting, key=lambda s: -s.seq_id))

    registry = PluginRegistry()
    registry.register(plugin_module("newest", register_schedulers=lambda register: register("newest", NewestFirst)))
    llm = LLM(checkpoint("gqa2-tied"), scheduler="newest", scheduler_options={"reverse": True}, registry=registry,
              kvcache_block_size=16, num_kvcache_blocks=32, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    reference = LLM(checkpoint("gqa2-tied"), kvcache_block_size=16, num_kvcache_blocks=32)
    prompts = [[1, 2], [3, 4], [5, 6]]
    assert llm.generate(prompts, params, use_tqdm=False) == reference.generate(prompts, params, use_tqdm=False)
    assert isinstance(llm.scheduler, NewestFirst) and llm.scheduler.reverse
