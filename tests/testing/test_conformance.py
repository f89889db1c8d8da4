"""The built-in plugins pass the conformance suites plugin authors run: the scheduler policies, the
KV manager, the attention backends (torch on CPU, triton in Triton's interpreter on CPU, and each in
bfloat16 on a GPU) and the default sampler (on CPU, and its CUDA kernel on a GPU).

Without CUDA the triton backend's kernels run in Triton's interpreter, which Triton fixes when a
kernel is decorated: so TRITON_INTERPRET is set here before inferlab's kernel modules are imported."""

import importlib.util
import os

import pytest
import torch
from colliding_names import collide_block_names
from hypothesis import settings
from hypothesis_profiles import QUICK_EXAMPLES

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from inferlab.core.hookspecs import hookimpl  # noqa: E402
from inferlab.core.plugins import PluginRegistry, get_registry  # noqa: E402
from inferlab.testing import (  # noqa: E402
    AttentionBackendSuite,
    KVCacheManagerSuite,
    SamplerSuite,
    SchedulerPolicySuite,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# The default run's state machines draw QUICK_EXAMPLES; test_state_machines_with_the_suites_own_examples
# (-m slow) runs them with the suite's own settings, as a plugin author's run does.
QUICK_SCHEDULER = settings(SchedulerPolicySuite.hypothesis_settings, max_examples=QUICK_EXAMPLES)
QUICK_KV_CACHE = settings(KVCacheManagerSuite.hypothesis_settings, max_examples=QUICK_EXAMPLES)


class TestFCFS(SchedulerPolicySuite):
    scheduler = "fcfs"
    hypothesis_settings = QUICK_SCHEDULER


class TestLPM(SchedulerPolicySuite):
    scheduler = "lpm"
    hypothesis_settings = QUICK_SCHEDULER


@pytest.mark.slow  # lpm again, with its sort turned off
class TestLPMUnsorted(SchedulerPolicySuite):
    scheduler = "lpm"
    scheduler_options = {"max_sort_waiting": 0}


class TestPriority(SchedulerPolicySuite):
    scheduler = "priority"
    hypothesis_settings = QUICK_SCHEDULER


class TestPaged(KVCacheManagerSuite):
    kv_cache = "paged"
    hypothesis_settings = QUICK_KV_CACHE


class TestTorchAttention(AttentionBackendSuite):
    attention = "torch"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernels are tested instead")
class TestTritonAttentionInterpreted(AttentionBackendSuite):
    """Small block sizes: Triton's interpreter takes seconds a call."""

    attention = "triton"
    block_sizes = (16, 32)


class TestDefaultSampler(SamplerSuite):
    sampler = "default"


# On a GPU, in the dtype models run in, at a real head_dim.


@pytest.mark.gpu
@needs_cuda
class TestTorchAttentionOnGPU(AttentionBackendSuite):
    attention = "torch"
    device = "cuda"
    dtypes = (torch.bfloat16,)
    heads = (8, 2, 128)


@pytest.mark.gpu
@needs_cuda
class TestTritonAttentionOnGPU(AttentionBackendSuite):
    attention = "triton"
    device = "cuda"
    dtypes = (torch.bfloat16, torch.float16)
    heads = (8, 2, 128)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash_attn is not importable")
class TestFlashAttentionOnGPU(AttentionBackendSuite):
    attention = "flash_attn"
    device = "cuda"
    dtypes = (torch.bfloat16, torch.float16)
    heads = (8, 2, 128)


@pytest.mark.gpu
@needs_cuda
class TestDefaultSamplerOnGPU(SamplerSuite):
    sampler = "default"
    device = "cuda"
    dtypes = (torch.bfloat16, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("suite_class", [TestFCFS, TestLPM, TestPriority, TestPaged], ids=lambda cls: cls.__name__)
def test_state_machines_with_the_suites_own_examples(suite_class):
    suite = suite_class()
    suite.hypothesis_settings = next(
        base.hypothesis_settings for base in suite_class.__mro__ if base.__module__.startswith("inferlab.testing")
    )
    assert suite.hypothesis_settings.max_examples > QUICK_EXAMPLES
    suite.test_state_machine()


SUITES = {
    "scheduler": (SchedulerPolicySuite, "scheduler"),
    "kv_cache": (KVCacheManagerSuite, "kv_cache"),
    "attention": (AttentionBackendSuite, "attention"),
    "sampler": (SamplerSuite, "sampler"),
}


@pytest.mark.parametrize("kind", sorted(SUITES))
def test_every_builtin_is_covered(kind):
    """Each built-in plugin has a suite class in this file (flash_attn's runs on a GPU only)."""
    suite, attribute = SUITES[kind]
    covered = {
        getattr(cls, attribute)
        for cls in globals().values()
        if isinstance(cls, type) and issubclass(cls, suite) and cls is not suite
    }
    builtin = {
        n for n in get_registry().names(kind) if get_registry().get(kind, n).distribution.startswith("inferlab ")
    }
    assert builtin == covered


@pytest.mark.slow
class TestFCFSWithCollidingHashes(SchedulerPolicySuite):
    """Hash collisions in the prefix cache cost misses, never another request's K/V."""

    scheduler = "fcfs"

    @pytest.fixture(autouse=True)
    def colliding_hashes(self, monkeypatch):
        collide_block_names(monkeypatch, lambda parent, identity: hash(identity) % 3)

    def test_serves_an_engine(self):
        """The engine run is the same as TestFCFS's."""


class _ClockOrder:
    """Declares an order fixed and pure that follows the clock and rotates with each call."""

    admission_order_is_pure = True
    admission_order_is_fixed = True

    def __init__(self, rotates: bool):
        self.rotates, self.calls = rotates, 0

    def admission_order(self, waiting, state):
        self.calls += 1
        if self.rotates:
            return waiting[self.calls % len(waiting) :] + waiting[: self.calls % len(waiting)]
        return waiting if int(state.now) % 2 == 0 else waiting[::-1]

    def preemption_victim(self, running, state):
        return running[-1]


class _ClockOrderPlugin:
    @staticmethod
    @hookimpl
    def register_schedulers(register):
        register("clock_order", lambda: _ClockOrder(rotates=False))
        register("rotating_order", lambda: _ClockOrder(rotates=True))


@pytest.mark.parametrize(("name", "broken"), [("clock_order", "declared fixed"), ("rotating_order", "declared pure")])
def test_the_suite_catches_an_admission_order_that_breaks_its_declaration(monkeypatch, name, broken):
    import inferlab.testing.scheduler as suite_module

    registry = PluginRegistry()
    registry.register(_ClockOrderPlugin, "clock_order_plugin")
    monkeypatch.setattr(suite_module, "get_registry", lambda: registry)

    class Suite(SchedulerPolicySuite):
        scheduler = name

    with pytest.raises(AssertionError, match=broken):
        Suite().test_admission_order_keeps_its_declarations()
