"""The plugin registry: built-ins arrive through entry points like any third-party package, and a
third-party scheduler with options runs. Plugins that break their contract: test_plugin_failures.py."""

from dataclasses import dataclass

from inferlab import LLM, SamplingParams
from inferlab.core import hookspecs
from inferlab.core.plugins import KINDS, PluginRegistry


def test_builtins_come_from_entry_points():
    registry = PluginRegistry()
    assert registry.failures == []
    expected = {"scheduler": "fcfs", "kv_cache": "paged", "attention": "torch", "model": "qwen3", "sampler": "default"}
    for kind, name in expected.items():
        entry = registry.get(kind, name)
        assert entry.distribution.startswith("inferlab ")
    assert registry.get("model", "qwen3").factory.architectures == ("Qwen3ForCausalLM",)


def test_every_hook_is_documented():
    for hook_name, _ in KINDS.values():
        assert getattr(hookspecs, hook_name).__doc__.strip()


def test_third_party_policy_with_options_runs(checkpoint, plugin_module):
    """A policy written from scratch against the Protocol, with an options class, selected by name."""

    @dataclass
    class NewestFirstOptions:
        reverse: bool = False

    class NewestFirst:
        """Admits the most recent request first (a toy policy with one option)."""

        def __init__(self, reverse: bool):
            self.reverse = reverse

        def admission_order(self, waiting, state):
            return sorted(waiting, key=lambda view: view.arrival_time, reverse=self.reverse)

        def preemption_victim(self, running, state):
            return running[-1]

    registry = PluginRegistry()
    registry.register(
        plugin_module(
            "newest",
            register_schedulers=lambda register: register("newest", NewestFirst, options=NewestFirstOptions),
        )
    )
    llm = LLM(
        checkpoint("gqa2-tied"),
        scheduler="newest",
        scheduler_options={"reverse": True},
        registry=registry,
        kvcache_block_size=16,
        num_kvcache_blocks=32,
        max_num_seqs=1,
    )
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    reference = LLM(checkpoint("gqa2-tied"), kvcache_block_size=16, num_kvcache_blocks=32)
    prompts = [[1, 2], [3, 4], [5, 6]]
    order = []
    for i, prompt in enumerate(prompts):
        llm.add_request(prompt, params, arrival_time=float(i))
    while not llm.is_finished():
        order += [r.request_id for r in llm.step().finished]
    assert order == [2, 1, 0]  # one at a time, newest first
    assert llm.generate(prompts, params, use_tqdm=False) == reference.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.policy.reverse is True
