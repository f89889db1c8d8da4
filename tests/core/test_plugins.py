"""The plugin registry: built-ins arrive through entry points like any third-party package, and a
third-party scheduler with options runs. Plugins that break their contract: test_plugin_failures.py."""

import re
from dataclasses import dataclass, field
from pathlib import Path

from inferlab import LLM, SamplingParams
from inferlab.core import hookspecs, protocols
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


# Capabilities of the engine a server's loop drives (an LLMEngine or a Cluster), not of a plugin:
# docs/serving.md documents them instead of a hook
ENGINE_CAPABILITIES = {protocols.WakeableStep}


def capability_protocols() -> list[str]:
    """The optional capabilities of plugins: the runtime Protocols of core/protocols.py other than
    the kinds' own, the handle a Runner's launch returns and the engine's own capabilities."""
    kinds = {protocol for _, protocol in KINDS.values()} | {protocols.StepHandle} | ENGINE_CAPABILITIES
    return sorted(
        name
        for name, obj in vars(protocols).items()
        if isinstance(obj, type)
        and obj.__module__ == protocols.__name__
        and getattr(obj, "_is_runtime_protocol", False)
        and obj not in kinds
    )


def test_the_engines_own_capabilities_are_documented_for_servers():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    for protocol in ENGINE_CAPABILITIES:
        assert f"`{protocol.__name__}`" in docs, f"{protocol.__name__} is not in docs/serving.md"


def test_each_capability_is_listed_by_its_hook_and_documented():
    """The contract is the Protocols: each hookspec names the capabilities of its kind (each under
    exactly one hook), and docs/plugins.md's table documents every one."""
    names = capability_protocols()
    assert {"ObservingPolicy", "AutoPriority", "ConfigDefaults", "GraphCapturableSampler", "OnDevice"} <= set(names)
    docs = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    for name in names:
        hooks = [hook for hook, _ in KINDS.values() if re.search(rf"\b{name}\b", getattr(hookspecs, hook).__doc__)]
        assert len(hooks) == 1, f"{name} is named by the hooks {hooks}"
        assert re.search(rf"^\| `[a-z_]+` \| `{name}`[^|]*\|", docs, re.MULTILINE), (
            f"{name} is not in docs/plugins.md's table"
        )


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


def test_a_third_party_executor_replays_recorded_step_times(checkpoint, plugin_module):
    """A runner written outside the core against the Runner Protocol (as docs/plugins.md shows),
    replaying recorded step times on a clock of its own: the engine schedules, stamps and finishes
    requests by it, and builds no model."""
    from inferlab.core.checkpoint import open_checkpoint

    @dataclass
    class ReplayOptions:
        step_seconds: list[float] = field(default_factory=lambda: [0.01])
        token_id: int = 7

    class ReplayedStep:
        def __init__(self, samples: list[bool], token_id: int):
            self.samples, self.token_id = samples, token_id

        def tokens(self):
            return [self.token_id if sampled else None for sampled in self.samples]

        def placeholders(self):
            rows = [i for i, sampled in enumerate(self.samples) if sampled]
            out = [None] * len(self.samples)
            for k, row in enumerate(rows):
                out[row] = -(k + 1)
            return out

    class ReplayRunner:
        runs_ahead = False

        def __init__(self, checkpoint, num_kv_blocks, step_seconds, token_id):
            self.checkpoint, self.num_kv_blocks = checkpoint, num_kv_blocks
            self.step_seconds, self.token_id = step_seconds, token_id
            self.now, self.num_steps, self.batch_sizes = 0.0, 0, []

        def clock(self):
            return self.now

        def wait_until(self, t):
            self.now = max(self.now, t)

        def launch(self, batch):
            self.now += self.step_seconds[self.num_steps % len(self.step_seconds)]
            self.num_steps += 1
            self.batch_sizes.append(batch.total_tokens)
            ends = [
                r.num_computed_tokens + n == len(r.token_ids)
                for r, n in zip(batch.requests, batch.num_scheduled_tokens)
            ]
            return ReplayedStep(ends, self.token_id)

        def close(self):
            pass

    def replay(config, model_path, registry, step_seconds, token_id):
        blocks = config.num_kvcache_blocks if config.num_kvcache_blocks > 0 else 64
        return ReplayRunner(open_checkpoint(config, model_path, registry), blocks, step_seconds, token_id)

    registry = PluginRegistry()
    registry.register(
        plugin_module("replay", register_executors=lambda register: register("replay", replay, options=ReplayOptions))
    )
    llm = LLM(
        checkpoint("gqa2-tied"),
        registry=registry,
        executor="replay",
        executor_options={"step_seconds": [0.5, 0.25]},
        kvcache_block_size=16,
    )
    assert isinstance(llm.runner, ReplayRunner) and not hasattr(llm.runner, "model")
    params = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=2, ignore_eos=True)]
    for prompt, p in zip([[1, 2, 3], [4, 5, 6, 7]], params):
        llm.add_request(prompt, p)
    finished = {}
    while not llm.is_finished():
        finished.update((r.request_id, r) for r in llm.step().finished)
    # one step prefills both prompts, then the two decode, then the first alone: 0.5, 0.25, 0.5 seconds
    assert llm.runner.batch_sizes == [7, 2, 1] and llm.clock() == 1.25
    assert finished[0].output_token_ids == [7, 7, 7] and finished[0].token_times == [0.5, 0.75, 1.25]
    assert finished[1].output_token_ids == [7, 7] and finished[1].token_times == [0.5, 0.75]
    assert llm.generate(["Hello"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]["token_ids"] == [
        7,
        7,
    ]
    assert llm.clock() == 2.0  # two more steps: 0.25, 0.5
