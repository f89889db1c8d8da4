"""The built-in scheduler policies and KV manager pass the conformance suites plugin authors run."""

import pytest

from inferlab.core.plugins import get_registry
from inferlab.testing import KVCacheManagerSuite, SchedulerPolicySuite


class TestFCFS(SchedulerPolicySuite):
    scheduler = "fcfs"


class TestLPM(SchedulerPolicySuite):
    scheduler = "lpm"


class TestLPMUnsorted(SchedulerPolicySuite):
    scheduler = "lpm"
    scheduler_options = {"max_sort_waiting": 0}


class TestPriority(SchedulerPolicySuite):
    scheduler = "priority"


class TestPaged(KVCacheManagerSuite):
    kv_cache = "paged"


@pytest.mark.parametrize("kind", ["scheduler", "kv_cache"])
def test_every_builtin_is_covered(kind):
    covered = {"scheduler": {"fcfs", "lpm", "priority"}, "kv_cache": {"paged"}}[kind]
    builtin = {
        n for n in get_registry().names(kind) if get_registry().get(kind, n).distribution.startswith("inferlab ")
    }
    assert builtin == covered


class TestFCFSWithCollidingHashes(SchedulerPolicySuite):
    """Hash collisions in the prefix cache cost misses, never another request's K/V."""

    scheduler = "fcfs"

    @pytest.fixture(autouse=True)
    def colliding_hashes(self, monkeypatch):
        from inferlab.plugins.kv_cache import paged

        monkeypatch.setattr(paged, "chain_hash", lambda parent, tokens: sum(tokens) % 3)

    def test_serves_an_engine(self):
        """The engine run is the same as TestFCFS's."""
