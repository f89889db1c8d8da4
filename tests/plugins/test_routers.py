"""The router plugin kind: the built-in routers through the conformance suite and their own
decisions over hand-built replica views; the hook, the registry and the config group."""

import pytest
from hypothesis import settings
from hypothesis_profiles import QUICK_EXAMPLES

from inferlab.conf import cluster_arguments, compose
from inferlab.core.plugins import PluginError, PluginRegistry, get_registry
from inferlab.core.protocols import ClusterState, ObservingRouter, Router
from inferlab.core.request import Request
from inferlab.core.routing import ReplicaView, RoutedRequest
from inferlab.core.sampling_params import SamplingParams
from inferlab.testing import RouterSuite
from inferlab.testing.router import FakeReplica

# The default run's state machines draw QUICK_EXAMPLES; test_state_machines_with_the_suites_own_examples
# (-m slow) runs them with the suite's own settings, as a router author's run does.
QUICK_ROUTER = settings(RouterSuite.hypothesis_settings, max_examples=QUICK_EXAMPLES)


class TestRoundRobin(RouterSuite):
    router = "round_robin"
    hypothesis_settings = QUICK_ROUTER


class TestRandom(RouterSuite):
    router = "random"
    router_options = {"seed": 3}
    hypothesis_settings = QUICK_ROUTER


class TestLeastLoad(RouterSuite):
    router = "least_load"
    hypothesis_settings = QUICK_ROUTER


class TestPrefixAware(RouterSuite):
    router = "prefix_aware"
    router_options = {"balance_abs_threshold": 2, "max_tree_size": 4, "eviction_interval_s": 10.0}
    hypothesis_settings = QUICK_ROUTER


class TestKVAware(RouterSuite):
    router = "kv_aware"
    router_options = {"overlap_weight": 2.5}
    hypothesis_settings = QUICK_ROUTER


@pytest.mark.slow
@pytest.mark.parametrize(
    "suite_class", [TestRoundRobin, TestRandom, TestLeastLoad, TestPrefixAware, TestKVAware], ids=lambda c: c.__name__
)
def test_state_machines_with_the_suites_own_examples(suite_class):
    suite = suite_class()
    suite.hypothesis_settings = RouterSuite.hypothesis_settings
    assert suite.hypothesis_settings.max_examples > QUICK_EXAMPLES
    suite.test_state_machine()


def views(n: int, block_size: int = 4, **gauges) -> list[ReplicaView]:
    replicas = [FakeReplica(i, block_size, num_blocks=100) for i in range(n)]
    for name, values in gauges.items():
        for replica, value in zip(replicas, values):
            setattr(replica, name, value)
    return [ReplicaView(r) for r in replicas]


def routed(tokens, request_id: int = 0, max_tokens: int = 8) -> RoutedRequest:
    return RoutedRequest(Request(request_id, tokens, SamplingParams(max_tokens=max_tokens)))


def state(now: float = 0.0, num_routed: int = 0, num_replicas: int = 4) -> ClusterState:
    return ClusterState(now=now, num_routed=num_routed, num_replicas=num_replicas)


def make(name: str, **options):
    return get_registry().create("router", name, options=options)


def test_every_builtin_router_is_a_router_plugin():
    registry = get_registry()
    assert {"random", "round_robin", "least_load", "prefix_aware", "kv_aware"} <= set(registry.names("router"))
    for name in registry.names("router"):
        assert isinstance(make(name), Router)


def test_round_robin_cycles_by_replica_id_and_skips_what_is_not_offered():
    router, offered = make("round_robin"), views(3)
    picks = [router.route(routed([1]), tuple(offered), state()).replica_id for _ in range(4)]
    assert picks == [0, 1, 2, 0]
    without_1 = (offered[0], offered[2])
    assert [router.route(routed([1]), without_1, state()).replica_id for _ in range(3)] == [2, 0, 2]


def test_random_is_seeded():
    offered = tuple(views(5))
    picks = lambda seed: [make("random", seed=seed).route(routed([1]), offered, state()).replica_id for _ in range(1)]  # noqa: E731
    a = make("random", seed=7)
    b = make("random", seed=7)
    assert [a.route(routed([1]), offered, state()).replica_id for _ in range(20)] == [
        b.route(routed([1]), offered, state()).replica_id for _ in range(20)
    ]
    assert len({picks(seed)[0] for seed in range(20)}) > 1


def test_least_load_takes_the_fewest_outstanding_tokens():
    offered = tuple(views(3, num_outstanding_tokens=[500, 120, 120]))
    assert make("least_load").route(routed([1]), offered, state()).replica_id == 1  # the lower id among equals


def test_kv_aware_weighs_cached_prefix_against_load():
    # replica 0 holds the request's 3 leading blocks (12 tokens) but is busier; replica 1 is idle
    offered = views(2, block_size=4, num_free_blocks=[80, 100])
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks, 16 countable as cached at most
    request = routed(prompt)
    from inferlab.core.blocks import block_hashes

    offered[0]._replica.cached.update(block_hashes(prompt, 4, 3))
    assert offered[0].cached_prefix_tokens(request) == 12 and offered[1].cached_prefix_tokens(request) == 0
    # costs: replica 0: w * (17 - 12) / 4 + 20 used blocks; replica 1: w * 17 / 4 + 0
    assert make("kv_aware", overlap_weight=1.0).route(request, tuple(offered), state()).replica_id == 1
    assert make("kv_aware", overlap_weight=10.0).route(request, tuple(offered), state()).replica_id == 0
    assert make("kv_aware", overlap_weight=0.0).route(request, tuple(offered), state()).replica_id == 1
    # replica 1's queued prompt tokens (200: 50 blocks) are blocks it will occupy, not weighted: 21.25 < 54.25
    offered[1]._replica.num_queued_prompt_tokens = 200
    assert make("kv_aware", overlap_weight=1.0).route(request, tuple(offered), state()).replica_id == 0


def test_prefix_aware_follows_the_longest_prefix_it_sent():
    router, offered = make("prefix_aware"), tuple(views(3, block_size=4))
    stem = list(range(100, 124))  # 6 blocks
    first = router.route(routed(stem + [1, 2]), offered, state()).replica_id
    assert first == 0  # nothing sent yet: the smallest tree, lowest id
    second = router.route(routed(list(range(200, 224))), offered, state()).replica_id
    assert second == 1  # no match: the smallest tree
    # a prompt sharing most of the first one's blocks follows it
    assert router.route(routed(stem + [7, 7, 7]), offered, state()).replica_id == first
    # a share below cache_threshold does not: it goes to the smallest tree (replica 2)
    assert router.route(routed(stem[:4] + list(range(300, 340))), offered, state()).replica_id == 2


def test_prefix_aware_balances_when_loads_diverge():
    router = make("prefix_aware", balance_abs_threshold=4, balance_rel_threshold=1.5)
    stem = list(range(100, 124))
    offered = tuple(views(2, block_size=4))
    assert router.route(routed(stem), offered, state()).replica_id == 0
    busy = tuple(views(2, block_size=4, num_waiting=[10, 0], num_running=[4, 1]))
    assert router.route(routed(stem), busy, state()).replica_id == 1  # 14 - 1 > 4 and 14 > 1.5: the least loaded
    mild = tuple(views(2, block_size=4, num_waiting=[3, 0], num_running=[1, 1]))
    assert router.route(routed(stem), mild, state()).replica_id in (0, 1)


def test_prefix_aware_evicts_least_recently_used_blocks_per_replica():
    router = make("prefix_aware", max_tree_size=3, eviction_interval_s=10.0)
    offered = tuple(views(1, block_size=4))
    router.route(routed(list(range(40))), offered, state(now=0.0))  # 10 blocks under replica 0
    assert len(router.owned[0]) == 10
    router.route(routed(list(range(500, 504)) + [1]), offered, state(now=11.0))  # eviction first, then 1 more block
    assert len(router.owned[0]) == 4
    # the three kept are the 10-block prompt's leading blocks: leaves went first
    from inferlab.core.blocks import block_hashes

    assert set(block_hashes(list(range(40)), 4, 3)) <= set(router.owned[0])


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("kv_aware", {"overlap_weight": -1.0}, "overlap_weight"),
        ("prefix_aware", {"cache_threshold": 1.5}, "cache_threshold"),
        ("prefix_aware", {"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ("prefix_aware", {"max_tree_size": 0}, "max_tree_size"),
        ("random", {"seed": "x"}, "seed"),
        ("round_robin", {"anything": 1}, "takes no options"),
    ],
)
def test_bad_router_options_are_refused_naming_them(name, options, message):
    with pytest.raises(PluginError, match=message):
        get_registry().create("router", name, options=options)


def test_a_router_registered_in_process(tmp_path):
    import types

    from inferlab.core.hookspecs import hookimpl

    class Last:
        def route(self, request, replicas, state):
            return replicas[-1]

        def observe(self, request, replica, state):
            pass

    module = types.SimpleNamespace(register_routers=hookimpl(lambda register: register("last", Last)))
    registry = PluginRegistry()
    registry.register(module, name="my_routers")
    router = registry.create("router", "last")
    assert isinstance(router, ObservingRouter)
    assert router.route(routed([1]), tuple(views(3)), state()).replica_id == 2


def test_a_router_missing_route_is_rejected_when_registered():
    import types

    from inferlab.core.hookspecs import hookimpl

    class NotARouter:
        def pick(self, request, replicas, state):
            return replicas[0]

    module = types.SimpleNamespace(register_routers=hookimpl(lambda register: register("broken", NotARouter)))
    registry = PluginRegistry()
    registry.register(module, name="broken_routers")
    with pytest.raises(PluginError, match="does not satisfy Router"):
        registry.get("router", "broken")


def test_cluster_settings_compose_and_become_cluster_arguments():
    cfg = compose(["cluster.replicas=3", "router=kv_aware", "router.overlap_weight=2.0"])
    assert cluster_arguments(cfg) == {
        "replicas": 3,
        "backend": "local",
        "gpus_per_replica": 1.0,
        "ray_address": None,
        "router": "kv_aware",
        "router_options": {"overlap_weight": 2.0},
    }
    assert cluster_arguments(compose([])) is None  # one local replica: today's single engine


def test_bad_cluster_settings_fail_when_composed():
    from inferlab.conf.cluster import ClusterConfigError

    with pytest.raises(ClusterConfigError, match="cluster.replicas must be a whole number >= 1"):
        compose(["cluster.replicas=0"])
    with pytest.raises(ClusterConfigError, match="cluster.backend must be one of local, ray"):
        compose(["cluster.backend=slurm"])
    with pytest.raises(ClusterConfigError, match="cluster.ray_address applies to cluster.backend=ray"):
        compose(["cluster.ray_address=auto"])


class _NamedPrompt:
    """What prefix_aware reads of a request: its blocks' names (any ints, repeats included) and length."""

    def __init__(self, names, block_size):
        self.names, self.num_prompt_tokens = tuple(names), len(names) * block_size + 1

    def prompt_block_hashes(self, block_size):
        return self.names


class _ReferenceCacheAware:
    """cache_aware as documented, written the plain way: a list per replica in recency order, each
    prompt's blocks touched from its last to its first, eviction from the list's front."""

    def __init__(self, options):
        self.options, self.lru, self.last_use = options, {}, {}  # replica_id -> [names]; (replica_id, name) -> now
        self.next_eviction = options["eviction_interval_s"]

    def route(self, names, num_tokens, loads, ids, now, block_size):
        o = self.options
        if now >= self.next_eviction:
            for order in self.lru.values():
                del order[: max(0, len(order) - o["max_tree_size"])]
            self.next_eviction = now + o["eviction_interval_s"]
        if (
            max(loads) - min(loads) > o["balance_abs_threshold"]
            and max(loads) > min(loads) * o["balance_rel_threshold"]
        ):
            choice = ids[loads.index(min(loads))]
        else:
            holders, depth = set(ids), 0
            for name in names:
                common = {r for r in holders if name in self.lru.get(r, ())}
                if not common:
                    break
                holders, depth = common, depth + 1
            if depth and depth * block_size > o["cache_threshold"] * num_tokens:
                choice = max(holders, key=lambda r: (self.last_use[r, names[depth - 1]], -r))
            else:
                sizes = [len(self.lru.get(r, ())) for r in ids]
                choice = ids[sizes.index(min(sizes))]
        order = self.lru.setdefault(choice, [])
        for name in reversed(names):
            if name in order:
                order.remove(name)
            order.append(name)
            self.last_use[choice, name] = now
        return choice


@pytest.mark.parametrize("seed", range(6))
def test_prefix_aware_routes_and_evicts_as_a_plain_lru_does(seed):
    """The router's trees (a dict of replica bits, per replica a dict in recency order, updated a
    prompt at a time) route and evict exactly as lists touched block by block: random prompts that
    share prefixes, repeat names (hash collisions), arrive at equal times and meet uneven loads."""
    import random

    rng = random.Random(seed)
    options = dict(
        cache_threshold=rng.choice([0.0, 0.3, 0.6]),
        balance_abs_threshold=3,
        balance_rel_threshold=1.5,
        max_tree_size=rng.choice([3, 8, 20]),
        eviction_interval_s=5.0,
    )
    router, reference = make("prefix_aware", **options), _ReferenceCacheAware(options)
    stems = [[rng.randrange(30) for _ in range(rng.randrange(1, 8))] for _ in range(6)]
    now = 0.0
    for step in range(400):
        names = rng.choice(stems)[: rng.randrange(1, 9)] + [rng.randrange(30) for _ in range(rng.randrange(0, 4))]
        now += rng.choice([0.0, 0.0, 0.5, 1.0])  # equal times: ties by last use go to the lowest replica_id
        offered = views(4, block_size=4, num_waiting=[rng.randrange(5) for _ in range(4)])
        if step % 50 > 40:
            offered = offered[1:]  # replica 0 not offered for a while
        offered = tuple(offered)
        loads = [r.num_waiting + r.num_running for r in offered]
        ids = [r.replica_id for r in offered]
        prompt = _NamedPrompt(names, 4)
        want = reference.route(prompt.names, prompt.num_prompt_tokens, loads, ids, now, 4)
        assert router.route(prompt, offered, state(now=now)).replica_id == want, step
        assert {r: list(o) for r, o in router.owned.items()} == reference.lru, step
