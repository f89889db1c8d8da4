"""The vtc policy: the conformance suite (one import), and fairness between tenants in an engine."""

from inferlab import LLM, SamplingParams
from inferlab.testing import SchedulerPolicySuite


class TestVTC(SchedulerPolicySuite):
    scheduler = "vtc"


def finish_order(scheduler: str) -> list[str]:
    """A heavy tenant queues eight requests, then a light tenant two; one runs at a time."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(scheduler=scheduler, max_num_seqs=1, device="cpu", num_kvcache_blocks=16) as llm:
        for _ in range(8):
            llm.add_request([5, 6, 7, 8], params, metadata={"tenant": "heavy"})
        for _ in range(2):
            llm.add_request([9, 10, 11, 12], params, metadata={"tenant": "light"})
        order = []
        while not llm.is_finished():
            order += [r.metadata["tenant"] for r in llm.step().finished]
    return order


def test_the_light_tenant_is_not_starved():
    fcfs, vtc = finish_order("fcfs"), finish_order("vtc")
    assert fcfs[-2:] == ["light", "light"]  # first come, first served: the light tenant waits for all eight
    assert vtc[:4] == ["heavy", "light", "heavy", "light"]  # the counters alternate the tenants
