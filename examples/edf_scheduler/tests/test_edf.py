"""The edf policy: the conformance suite (one import), and its own behaviour in an engine."""

import pytest

from inferlab import LLM, SamplingParams
from inferlab.testing import SchedulerPolicySuite


class TestEDF(SchedulerPolicySuite):
    scheduler = "edf"


class TestEDFRelative(SchedulerPolicySuite):
    scheduler = "edf"
    scheduler_options = {"relative": True}


def test_a_tighter_deadline_displaces_a_running_request():
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(scheduler="edf", max_num_seqs=1, device="cpu", num_kvcache_blocks=16) as llm:
        loose = llm.add_request([5, 6, 7], params, metadata={"deadline": 100.0})
        llm.step()
        llm.step()
        urgent = llm.add_request([8, 9], params, metadata={"deadline": 1.0})
        later = llm.add_request([3], params)  # no deadline: last
        order = []
        while not llm.is_finished():
            order += [r.request_id for r in llm.step().finished]
    assert order == [urgent, loose, later]
    assert llm.stats.num_preemptions == 1


def test_a_deadline_that_is_not_a_number_is_refused_when_added():
    with LLM(scheduler="edf", device="cpu", num_kvcache_blocks=16) as llm:
        with pytest.raises(
            ValueError, match=r"metadata\['deadline'\] must be int or float \(scheduler 'edf' reads it\)"
        ):
            llm.add_request([5, 6, 7], metadata={"deadline": "soon"})
        assert not llm.requests
