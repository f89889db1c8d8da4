"""One request's fault stays its own, and a plugin that raises leaves the engine consistent: a
policy that raises on one request's metadata fails that request alone (PolicyError naming the
policy and the request) while the others get their tokens; a policy that declares the metadata
it reads refuses bad values when a request is added; a KV manager whose commit or free raises
once costs one step's error, not a wedged request or a leaked block."""

import sys
from pathlib import Path

import pytest
from deadline_policy import Deadlines
from engine_books import assert_books_clean, assert_kv_books

from inferlab import LLM, SamplingParams
from inferlab.core.plugins import PluginRegistry
from inferlab.core.scheduler import PolicyError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SETTINGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=128)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


class Broken:
    """Fails whatever it is given: no request's fault."""

    def admission_order(self, waiting, state):
        return waiting

    def preemption_victim(self, running, state):
        return running[-1]

    def token_budget(self, state):
        raise RuntimeError("no budget today")

    def chunk_size(self, request, budget_left):
        return budget_left


def registry_with(plugin_module, name, policy_class):
    registry = PluginRegistry()
    registry.register(
        plugin_module(f"{name}_plugin", register_schedulers=lambda register: register(name, policy_class))
    )
    return registry


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint()


@pytest.fixture(scope="module")
def reference(path):
    with LLM(path, **SETTINGS) as llm:
        return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_a_policy_fault_one_requests_metadata_causes_fails_that_request_alone(path, reference, plugin_module):
    registry = registry_with(plugin_module, "deadlines", Deadlines)
    with LLM(path, registry=registry, scheduler="deadlines", **SETTINGS) as llm:
        metadata = [{"deadline": 1.0}, {"deadline": 2.0}, {"deadline": "soon"}, {"deadline": 3.0}]
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, metadata=metadata)
        assert [o["token_ids"] for o in outputs[:2] + outputs[3:]] == reference[:2] + reference[3:]
        bad = outputs[2]
        assert bad["finish_reason"] == "error" and bad["token_ids"] == []
        assert bad["error"].startswith(
            "PolicyError: scheduler 'deadlines' failed on request 2 (metadata {'deadline': 'soon'}"
        )
        assert "TypeError" in bad["error"]
        assert llm.stats.num_failed_requests == 1
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference  # serves on
        assert_books_clean(llm)


def test_a_request_that_breaks_the_policys_preemption_fails_alone_in_a_step_loop(path, reference, plugin_module):
    """Three requests run (one sequence slot each, all taken); a fourth whose deadline is a string
    asks the preemptive policy for room, which raises: it fails, reported by the next step with
    its PolicyError, and the three finish with their tokens."""
    registry = registry_with(plugin_module, "deadlines", Deadlines)
    with LLM(path, registry=registry, scheduler="deadlines", max_num_seqs=3, **SETTINGS) as llm:
        good = [llm.add_request(p, GREEDY, metadata={"deadline": float(i)}) for i, p in enumerate(PROMPTS[:3])]
        llm.step()
        bad = llm.add_request(PROMPTS[3], GREEDY, metadata={"deadline": "soon"})
        finished = {}
        while not llm.is_finished():
            finished.update({r.request_id: r for r in llm.step().finished})
        assert [finished[i].output_token_ids for i in good] == reference[:3]
        assert finished[bad].finish_reason == "error" and "failed on request 3" in finished[bad].error
        assert "its preempts raised TypeError" in finished[bad].error
        assert_books_clean(llm)


def test_a_policy_fault_no_request_explains_is_the_calls_error_naming_the_policy(path, plugin_module):
    registry = registry_with(plugin_module, "broken", Broken)
    with LLM(path, registry=registry, scheduler="broken", **SETTINGS) as llm:
        with pytest.raises(PolicyError, match="scheduler 'broken': token_budget raised RuntimeError: no budget today"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert not llm.requests


@pytest.fixture
def edf_registry(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "edf_scheduler"))
    from inferlab_edf import policy

    registry = PluginRegistry()
    registry.register(policy, "edf")
    yield registry
    sys.modules.pop("inferlab_edf.policy", None)
    sys.modules.pop("inferlab_edf", None)


def test_metadata_a_policy_declares_is_checked_when_a_request_is_added(path, edf_registry):
    with LLM(path, registry=edf_registry, scheduler="edf", **SETTINGS) as llm:
        assert llm.scheduler.metadata_fields == {"deadline": (int, float)}
        message = r"metadata\['deadline'\] must be int or float \(scheduler 'edf' reads it\), got 'soon'"
        with pytest.raises(ValueError, match=message):
            llm.add_request([1, 2, 3], GREEDY, metadata={"deadline": "soon"})
        with pytest.raises(ValueError, match="prompt 1: " + message):
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, metadata=[{"deadline": 1}, {"deadline": "soon"}])
        with pytest.raises(ValueError, match=r"must be int or float .* got True"):
            llm.add_request([1, 2, 3], GREEDY, metadata={"deadline": True})
        assert not llm.requests
        llm.add_request([1, 2, 3], GREEDY, metadata={"deadline": 2, "other": "free-form"})


def test_a_malformed_declaration_is_refused_naming_the_policy(path, plugin_module):
    class Declares:
        metadata_fields = {"deadline": "a number"}

        def admission_order(self, waiting, state):
            return waiting

        def preemption_victim(self, running, state):
            return running[-1]

    registry = registry_with(plugin_module, "declares", Declares)
    with pytest.raises(PolicyError, match="scheduler 'declares': metadata_fields must map field names to a type"):
        LLM(path, registry=registry, scheduler="declares", **SETTINGS)


def fail_once(target, method: str, message: str, after: int = 0):
    """Makes target.method raise RuntimeError(message) on its call number after + 1, once."""
    real, calls = getattr(target, method), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == after + 1:
            raise RuntimeError(message)
        return real(*args, **kwargs)

    setattr(target, method, failing)
    return calls


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_commit_that_raises_once_costs_one_step_not_the_request(path, overlap):
    # prompts of 13-15 tokens, so that a block of 16 fills within two steps and commits (BlockAligned skips
    # a step's commits that fill none)
    prompts = [list(range(5 + n, 18 + n + n % 3)) for n in range(4)]
    with LLM(path, **SETTINGS) as llm:
        reference = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(path, overlap_scheduling=overlap, **SETTINGS) as llm:
        requests = [llm.requests[llm.add_request(p, GREEDY)] for p in prompts]
        llm.step()
        calls = fail_once(llm.kv_manager, "commit", "commit failed")
        with pytest.raises(RuntimeError, match="commit failed"):
            for _ in range(3):
                llm.step()
        assert calls == [1]
        while not llm.is_finished():
            llm.step()  # was: IndexError every step, the request wedged until aborted
        assert [r.output_token_ids for r in requests] == reference
        assert_books_clean(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_free_that_raises_once_is_reported_and_leaks_nothing(path, reference, overlap):
    with LLM(path, overlap_scheduling=overlap, **SETTINGS) as llm:
        fail_once(llm.kv_manager, "free", "free failed")
        with pytest.raises(RuntimeError, match="free failed"):  # was: ValueError: list.remove(x)
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        # every block is held by a pending request or listed to be freed again (the abort of the call's others did)
        assert_kv_books(llm.kv_manager, [*llm.requests.values(), *llm.scheduler.to_free])
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
        llm.step()
        assert_books_clean(llm)


class PickyChunks:
    """A BudgetPolicy whose chunk_size and preemption_victim fail on a request marked "bad"."""

    def admission_order(self, waiting, state):
        return waiting

    def preemption_victim(self, running, state):
        return max(running, key=lambda view: (int(view.metadata.get("weight", 0)), view.arrival_time))

    def token_budget(self, state):
        return 24

    def chunk_size(self, request, budget_left):
        return int(request.metadata.get("chunk", 8))


def test_a_request_whose_fields_break_chunk_size_or_the_victim_choice_fails_alone(path, plugin_module):
    registry = registry_with(plugin_module, "picky", PickyChunks)
    long = [[(7 * i + j) % 300 + 3 for j in range(40)] for i in range(4)]
    with LLM(path, **SETTINGS) as llm:
        expected = [o["token_ids"] for o in llm.generate(long, GREEDY, use_tqdm=False)]
    # few blocks: running requests must be preempted, and the victim choice meets the bad weight
    with LLM(path, registry=registry, scheduler="picky", **{**SETTINGS, "num_kvcache_blocks": 7}) as llm:
        metadata = [{}, {"chunk": "big"}, {}, {"weight": "heavy"}]
        outputs = llm.generate(long, GREEDY, use_tqdm=False, metadata=metadata)
        assert outputs[1]["finish_reason"] == "error" and "its chunk_size raised ValueError" in outputs[1]["error"]
        assert (
            outputs[3]["finish_reason"] == "error" and "its preemption_victim raised ValueError" in outputs[3]["error"]
        )
        assert [outputs[0]["token_ids"], outputs[2]["token_ids"]] == [expected[0], expected[2]]
        assert_books_clean(llm)
