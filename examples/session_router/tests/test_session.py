"""The session_affinity router: the conformance suite (one import), and its own behaviour in a cluster."""

from inferlab import Cluster, SamplingParams
from inferlab.testing import RouterSuite


class TestSessionAffinity(RouterSuite):
    router = "session_affinity"


class TestSessionAffinityForgetting(RouterSuite):
    router = "session_affinity"
    router_options = {"max_sessions": 2}


def test_a_session_stays_on_its_replica():
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    sessions = ["a", "b", "c", "a", "b", "c", "a"]
    with Cluster(replicas=3, router="session_affinity", device="cpu", num_kvcache_blocks=16) as cluster:
        ids = [cluster.add_request([5, 6, 7], params, metadata={"session": s}) for s in sessions]
        while not cluster.is_finished():
            cluster.step()
        homes = {}
        for session, request_id in zip(sessions, ids):
            assert homes.setdefault(session, cluster.replica_of(request_id)) == cluster.replica_of(request_id)
    assert sorted(homes.values()) == [0, 1, 2]  # three new sessions: each to the least loaded
