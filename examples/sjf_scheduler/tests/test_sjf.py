"""The sjf policy: the conformance suite (one import), and its own behaviour in an engine."""

from inferlab import LLM, SamplingParams
from inferlab.testing import SchedulerPolicySuite


class TestSJF(SchedulerPolicySuite):
    scheduler = "sjf"


class TestSJFWithPrompts(SchedulerPolicySuite):
    scheduler = "sjf"
    scheduler_options = {"include_prompt": True}


def test_one_at_a_time_the_shortest_job_finishes_first():
    with LLM(scheduler="sjf", max_num_seqs=1, device="cpu", num_kvcache_blocks=16) as llm:
        for max_tokens in (9, 3, 6):
            llm.add_request([5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        order = []
        while not llm.is_finished():
            order += [r.params.max_tokens for r in llm.step().finished]
    assert order == [3, 6, 9]  # all three wait at the first step
