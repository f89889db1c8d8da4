"""Conformance suites a plugin author runs against their own plugin: subclass one in a pytest
file, name your plugin, and pytest runs the suite's tests against it through public interfaces.

    from inferlab.testing import SchedulerPolicySuite

    class TestMyPolicy(SchedulerPolicySuite):
        scheduler = "my_policy"

One a kind: SchedulerPolicySuite, KVCacheManagerSuite, AttentionBackendSuite, SamplerSuite,
RouterSuite, KVTransferSuite.
Needs pytest and hypothesis (`pip install inferlab[test]`).
"""

from inferlab.testing.attention import AttentionBackendSuite
from inferlab.testing.kv_cache import KVCacheManagerSuite
from inferlab.testing.kv_transfer import KVTransferSuite
from inferlab.testing.router import RouterSuite
from inferlab.testing.sampler import SamplerSuite
from inferlab.testing.scheduler import SchedulerPolicySuite

__all__ = [
    "AttentionBackendSuite",
    "KVCacheManagerSuite",
    "KVTransferSuite",
    "RouterSuite",
    "SamplerSuite",
    "SchedulerPolicySuite",
]
