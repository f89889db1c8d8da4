"""Conformance tests for a KV cache manager plugin, through its Protocol only.

    from inferlab.testing import KVCacheManagerSuite

    class TestMyKV(KVCacheManagerSuite):
        kv_cache = "my_kv"            # the name it is registered under
        kv_cache_options = {}          # its options, if any

A hypothesis state machine drives the manager the way the core scheduler does (admit with the
cached prefix, compute chunks, append sampled tokens, preempt, finish, steps interrupted between
allocation and compute) against a model of what each block holds, and checks after every step:
no block is lost or handed out twice, every request reads its own prefix, shared blocks are
full and computed for every holder, and refused allocations and prefix queries change nothing.
"""

from collections import Counter
from itertools import count

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inferlab.core.config import EngineConfig
from inferlab.core.plugins import get_registry
from inferlab.core.protocols import UnheldPrefixBlocks
from inferlab.core.request import Request
from inferlab.core.sampling_params import SamplingParams
from inferlab.testing.common import assert_blocks_accounted, assert_own_prefixes, ceil_div, run_machine

TOKENS = st.integers(0, 3)  # a tiny alphabet, so that prompts share prefixes and whole blocks repeat


def public_snapshot(kv, requests) -> tuple:
    """Everything the Protocol shows of the manager's state for these requests."""
    return (
        kv.num_free_blocks,
        [list(kv.block_table(r)) for r in requests],
        [kv.num_cached_prefix_tokens(r) for r in requests if not kv.block_table(r)],
    )


class KVCacheMachine(RuleBasedStateMachine):
    """The state machine; KVCacheManagerSuite runs it against a registered manager."""

    kv_cache = "paged"
    kv_cache_options: dict = {}
    seen = Counter()

    def __init__(self):
        super().__init__()
        self.ids = count()
        self.pending: list[Request] = []  # hold no blocks: new, or preempted
        self.running: list[Request] = []  # hold blocks
        self.content: dict[int, tuple[int, ...]] = {}  # block -> the token prefix whose K/V it holds

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 12), prefix_caching=st.booleans())
    def make_manager(self, block_size, num_blocks, prefix_caching):
        config = EngineConfig(kvcache_block_size=block_size, enable_prefix_caching=prefix_caching)
        self.kv = get_registry().create("kv_cache", self.kv_cache, config, num_blocks, options=self.kv_cache_options)
        self.bs = block_size
        assert self.kv.block_size == block_size and self.kv.num_blocks == num_blocks
        assert self.kv.num_free_blocks == num_blocks

    def live(self) -> list[Request]:
        return self.pending + self.running

    # -- rules ------------------------------------------------------------------------------

    @rule(data=st.data())
    def new_request(self, data):
        prefix = []
        if self.live() and data.draw(st.booleans(), label="share a prefix"):
            base = data.draw(st.sampled_from(self.live())).token_ids
            prefix = base[: data.draw(st.integers(0, len(base)))]
        tokens = prefix + data.draw(st.lists(TOKENS, max_size=20))
        if tokens:
            self.pending.append(Request(next(self.ids), tokens, SamplingParams()))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def admit(self, data):
        kv = self.kv
        request = data.draw(st.sampled_from(self.pending))
        before = public_snapshot(kv, self.live())
        num_cached = kv.num_cached_prefix_tokens(request)
        assert public_snapshot(kv, self.live()) == before, "num_cached_prefix_tokens changed the manager"
        assert 0 <= num_cached <= request.num_tokens - 1, "a cached prefix must leave the last token to compute"
        num_new = data.draw(st.integers(1, request.num_tokens - num_cached), label="prefill chunk")
        # UnheldPrefixBlocks: admitting takes the unheld cached blocks from the free ones too, so a
        # request needing more than are free is refused (a run of decode steps relies on it)
        unheld = kv.num_unheld_prefix_blocks(request, num_cached) if isinstance(kv, UnheldPrefixBlocks) else None
        if unheld is not None:
            assert public_snapshot(kv, self.live()) == before, "num_unheld_prefix_blocks changed the manager"
            assert 0 <= unheld <= num_cached // self.bs, f"{unheld} unheld blocks of {num_cached // self.bs} cached"
        needed = ceil_div(num_cached + num_new, self.bs) - num_cached // self.bs + (unheld or 0)
        free_before = kv.num_free_blocks
        if not kv.allocate(request, num_new, num_cached):
            assert public_snapshot(kv, self.live()) == before, "a refused allocate changed the manager"
            self.seen["refused allocate"] += 1
            return
        assert unheld is None or needed <= free_before, (
            f"allocate took {needed} blocks (its unheld cached ones included) with {free_before} free"
        )
        self.pending.remove(request)
        self.running.append(request)
        request.num_computed_tokens = request.num_cached_tokens = num_cached
        table = kv.block_table(request)
        assert len(table) * self.bs >= num_cached + num_new, "allocate gave too few blocks"
        for i in range(num_cached // self.bs):  # every prefix hit holds exactly this prefix
            assert self.content.get(table[i]) == tuple(request.token_ids[: (i + 1) * self.bs]), (
                f"prefix block {i} of request {request.request_id} holds another prefix"
            )
        self.seen["prefix hit"] += num_cached > 0
        self._compute(request, num_new, data)

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens for r in self.running))
    @rule(data=st.data())
    def compute(self, data):
        request = data.draw(st.sampled_from([r for r in self.running if r.num_computed_tokens < r.num_tokens]))
        num_new = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens), label="tokens")
        before = public_snapshot(self.kv, self.live())
        table = list(self.kv.block_table(request))
        if not self.kv.allocate(request, num_new):
            assert public_snapshot(self.kv, self.live()) == before, "a refused allocate changed the manager"
            return
        assert self.kv.block_table(request)[: len(table)] == table, "allocate rewrote blocks the request had"
        assert len(self.kv.block_table(request)) * self.bs >= request.num_computed_tokens + num_new
        self._compute(request, num_new, data)

    def _compute(self, request: Request, num_new: int, data):
        """What a step does after allocating: the runner writes K/V (unless the step is interrupted
        first), the core advances and commits, and the sampler may add a token."""
        if data.draw(st.integers(0, 9), label="interrupted") == 0:
            return  # allocated, never computed: the next allocate must cope
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        table = self.kv.block_table(request)
        for i in range(start // self.bs, ceil_div(end, self.bs)):
            self.content[table[i]] = tuple(request.token_ids[: min((i + 1) * self.bs, end)])
        request.num_computed_tokens = end
        self.kv.commit(request)
        if end == request.num_tokens:
            request.token_ids.append(data.draw(TOKENS, label="sampled"))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        """Finish (the request leaves) or preempt (it waits to be recomputed from scratch)."""
        request = data.draw(st.sampled_from(self.running))
        self.kv.free(request)
        assert not self.kv.block_table(request), "free left blocks in the request's table"
        request.num_computed_tokens = 0
        self.running.remove(request)
        if preempt:
            self.pending.append(request)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def finish_waiting(self, data):
        """A waiting request finishes (aborted): the core frees it too."""
        request = data.draw(st.sampled_from(self.pending))
        self.kv.free(request)
        self.pending.remove(request)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def no_block_lost_or_doubled(self):
        kv = self.kv
        for request in self.pending:
            assert not kv.block_table(request), "a request without blocks holds some"
        for request in self.running:
            table = kv.block_table(request)
            assert len(set(table)) == len(table), "a block twice in one table"
            assert all(0 <= b < kv.num_blocks for b in table), "a block id outside the cache"
        assert_blocks_accounted(kv, self.running, self.bs, lost="a block lost or doubled")

    @invariant()
    def requests_read_their_own_prefix(self):
        assert_own_prefixes(self.kv, self.running, self.bs, self.content)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for request in self.live():
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.num_blocks, "blocks leaked once every request was freed"


class KVCacheManagerSuite:
    """Subclass with `kv_cache` (a registered name) and optionally `kv_cache_options`; pytest
    collects the subclass's tests."""

    kv_cache: str = "paged"
    kv_cache_options: dict = {}
    machine: type = KVCacheMachine  # a subclass may add invariants of its own
    hypothesis_settings = settings(max_examples=150, stateful_step_count=50, deadline=None, derandomize=True)

    def make(self, num_blocks: int = 8, block_size: int = 4, **settings_):
        config = EngineConfig(kvcache_block_size=block_size, **settings_)
        return get_registry().create("kv_cache", self.kv_cache, config, num_blocks, options=self.kv_cache_options)

    def test_state_machine(self):
        seen = run_machine(
            self.machine, self.hypothesis_settings, kv_cache=self.kv_cache, kv_cache_options=self.kv_cache_options
        )
        assert seen["refused allocate"] > 0, "no allocation was ever refused: the machine missed that path"

    def test_reuses_a_computed_prefix(self):
        kv = self.make()
        first = Request(0, list(range(9)), SamplingParams())
        assert kv.allocate(first, 9)
        first.num_computed_tokens = 9
        kv.commit(first)
        kv.free(first)
        again = Request(1, list(range(9)) + [50], SamplingParams())
        assert kv.num_cached_prefix_tokens(again) == 8, "a freed, computed prefix should be served from the cache"

    def test_prefix_caching_can_be_turned_off(self):
        kv = self.make(enable_prefix_caching=False)
        first = Request(0, list(range(9)), SamplingParams())
        assert kv.allocate(first, 9)
        first.num_computed_tokens = 9
        kv.commit(first)
        assert kv.num_cached_prefix_tokens(Request(1, list(range(9)), SamplingParams())) == 0

    def test_could_ever_fit_is_exact(self):
        """A request that could ever fit fits in an empty cache, and one that fits is never refused."""
        num_blocks, block_size = 8, 4
        answers = [self.make(num_blocks, block_size).could_ever_fit(n) for n in range(1, 2 * num_blocks * block_size)]
        assert answers[0], "one token must fit"
        assert answers == sorted(answers, reverse=True), "could_ever_fit must not grow back with more tokens"
        for n, fits in enumerate(answers, start=1):
            allocated = self.make(num_blocks, block_size).allocate(Request(0, [1] * n, SamplingParams()), n)
            assert allocated == fits, (
                f"could_ever_fit({n}) is {fits} but allocating {n} tokens in an empty cache {'succeeded' if allocated else 'failed'}"
            )
