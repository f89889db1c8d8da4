"""A disaggregated cluster (cluster.prefill_replicas, cluster.decode_replicas): routers pick a pair,
the prefill replica hands each request to its decode replica through the kv_transfer plugin, greedy
outputs equal one engine's, bad settings and bad answers fail clearly, and a simulated fleet
delivers each handoff in time order."""

import json
import random
import types

import pytest

from inferlab import LLM, Cluster, SamplingParams
from inferlab.conf import compose
from inferlab.conf.cluster import ClusterConfigError
from inferlab.core.hookspecs import hookimpl
from inferlab.core.plugins import PluginRegistry
from inferlab.core.routing import decode_replica_by_room
from inferlab.experiment.bench import run_bench
from inferlab.experiment.driver import run_workload
from inferlab.experiment.workload import WorkloadRequest

CPU = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=40)
SIM = dict(executor="simulated", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=1024)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompts_of(count=8, seed=0, shared=0):
    rng = random.Random(seed)
    stem = [rng.randrange(3, 300) for _ in range(shared)]
    return [stem + [rng.randrange(3, 300) for _ in range(rng.randrange(5, 60))] for _ in range(count)]


def drained(cluster) -> bool:
    """Every replica's blocks free once the senders have polled at the latest clock."""
    engines = cluster.fleet.engines
    latest = max(engine.clock() for engine in engines)
    for engine in engines:
        engine.wait_until(latest)
        engine.poll_kv_transfer()
    return all(e.kv_manager.num_free_blocks == e.kv_manager.num_blocks for e in engines)


def registry_with(**routers) -> PluginRegistry:
    registry = PluginRegistry()

    @hookimpl
    def register_routers(register):
        for name, cls in routers.items():
            register(name, cls)

    registry.register(types.SimpleNamespace(register_routers=register_routers), name="test_routers")
    return registry


# RouterSuite.test_serves_a_cluster checks every built-in router's pairs against a lone engine too
@pytest.mark.parametrize("router", ["round_robin", "kv_aware"])
def test_greedy_outputs_equal_one_engines_whatever_the_router(router):
    prompts = prompts_of(shared=20)
    with LLM(**CPU) as alone:
        expected = alone.generate(prompts, GREEDY, use_tqdm=False)
    with Cluster(prefill_replicas=1, decode_replicas=2, router=router, **CPU) as cluster:
        outputs = cluster.generate(prompts, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outputs] == [e["token_ids"] for e in expected]
        served = {cluster.replica_of(i) for i in range(len(prompts))}
        assert served == {1, 2}  # the pairing spreads decodes
        stats = [engine.stats for engine in cluster.fleet.engines]
        assert stats[0].num_decode_tokens == 0 and stats[1].num_prefill_tokens == stats[2].num_prefill_tokens == 0
        assert stats[0].kv_bytes_sent == stats[1].kv_bytes_received + stats[2].kv_bytes_received > 0
        assert drained(cluster)


def test_greedy_outputs_equal_one_engines_under_chunked_prefill_and_preemption_on_both_sides():
    """Small caches and a small token budget: prompts are prefilled in chunks, prefill replicas
    preempt while their blocks wait to be sent, decode replicas preempt and recompute."""
    prompts = prompts_of(count=10, seed=5, shared=20)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tight = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=7, max_num_batched_tokens=24)
    with LLM(**CPU) as alone:
        expected = alone.generate(prompts, params, use_tqdm=False)
    with Cluster(prefill_replicas=1, decode_replicas=1, router="least_load", **tight) as cluster:
        outputs = cluster.generate(prompts, params, use_tqdm=False)
        assert [o["token_ids"] for o in outputs] == [e["token_ids"] for e in expected]
        prefill, decode = (engine.stats for engine in cluster.fleet.engines)
        assert prefill.num_preemptions > 0 and decode.num_preemptions > 0
        assert drained(cluster)


def test_roles_need_a_replica_of_each_and_the_right_count():
    for roles, message in [
        (dict(prefill_replicas=2, decode_replicas=0), "cluster.decode_replicas=0"),
        (dict(prefill_replicas=None, decode_replicas=3), "cluster.prefill_replicas=None"),
        (dict(prefill_replicas=2, decode_replicas=2, replicas=3), "cluster.replicas=3 but cluster.prefill_replicas"),
    ]:
        with pytest.raises(ClusterConfigError, match=message):
            Cluster(**roles, **CPU)
    # Roles on Ray take the transfer between processes, one GPU a replica: refused before Ray starts
    for settings, message in [
        (dict(kv_transfer="local"), "roles on cluster.backend=ray move K/V between processes: kv_transfer=distributed"),
        (dict(gpus_per_replica=0.5), "cluster.gpus_per_replica=0.5 shares one"),
    ]:
        with pytest.raises(ValueError, match=message):
            Cluster(prefill_replicas=1, decode_replicas=1, backend="ray", **settings, **CPU)
    with pytest.raises(ClusterConfigError, match="each a whole number >= 1.*leave both unset for colocated"):
        compose(["cluster.prefill_replicas=2", "cluster.decode_replicas=0"])
    with pytest.raises(Exception, match="kv_transfer.link must be one of"):
        Cluster(
            prefill_replicas=1, decode_replicas=1, kv_transfer="simulated", kv_transfer_options={"link": "x"}, **SIM
        )


class RouteOnly:
    """A router without route_pair: the cluster asks it over the prefill replicas, then the decode."""

    asked: list = []

    def route(self, request, replicas, state):
        RouteOnly.asked.append((request.request_id, [(r.replica_id, r.role) for r in replicas]))
        return replicas[-1]


class BadPairs:
    """Answers a decode replica as the prefill one for odd ids, raises for ids divisible by 4."""

    def route(self, request, replicas, state):
        return replicas[0]

    def route_pair(self, request, prefill, decode, state):
        if request.request_id % 4 == 0 and request.request_id:
            raise RuntimeError("no pair today")
        return (decode[0], decode[0]) if request.request_id % 2 else (prefill[0], decode[0])


def test_a_router_without_route_pair_is_asked_over_each_role():
    RouteOnly.asked = []
    registry = registry_with(route_only=RouteOnly)
    with Cluster(prefill_replicas=2, decode_replicas=2, router="route_only", registry=registry, **CPU) as cluster:
        outputs = cluster.generate(prompts_of(2), GREEDY, use_tqdm=False)
        assert all(len(o["token_ids"]) == 6 for o in outputs)
        assert {cluster.replica_of(i) for i in range(2)} == {3}
    assert RouteOnly.asked[:2] == [(0, [(0, "prefill"), (1, "prefill")]), (0, [(2, "decode"), (3, "decode")])]


def test_a_bad_pair_fails_that_request_alone():
    registry = registry_with(bad_pairs=BadPairs)
    with Cluster(prefill_replicas=1, decode_replicas=1, router="bad_pairs", registry=registry, **CPU) as cluster:
        outputs = cluster.generate(prompts_of(5), GREEDY, use_tqdm=False)
        reasons = [o["finish_reason"] for o in outputs]
        assert reasons == ["length", "error", "length", "error", "error"]
        assert "route_pair returned ReplicaView(1" in outputs[1]["error"]
        assert "not one of the replicas offered (replica_ids [0])" in outputs[1]["error"]
        assert "route raised RuntimeError: no pair today" in outputs[4]["error"]
        assert drained(cluster)


def test_decode_replica_by_room_prefers_room_then_load():
    class View:
        def __init__(self, replica_id, free, queued, outstanding):
            self.replica_id, self.num_free_blocks, self.block_size = replica_id, free, 16
            self.num_queued_prompt_tokens, self.num_outstanding_tokens = queued, outstanding

    request = types.SimpleNamespace(num_prompt_tokens=100)
    busy_roomy, idle_tight, mid = View(0, 40, 0, 900), View(1, 5, 0, 10), View(2, 20, 100, 300)
    assert decode_replica_by_room(request, (busy_roomy, idle_tight, mid)) is mid  # room for 100, least load
    assert decode_replica_by_room(request, (busy_roomy, idle_tight)) is busy_roomy
    full = (View(0, 2, 0, 0), View(1, 3, 40, 0))  # no room anywhere: the most
    assert decode_replica_by_room(request, full) is full[0]


def test_aborts_on_either_side_free_both():
    with Cluster(prefill_replicas=1, decode_replicas=1, **CPU) as cluster:
        ids = [cluster.add_request(p, GREEDY) for p in prompts_of(4)]
        assert cluster.abort(ids[0])  # on its prefill replica
        finished = []
        for _ in range(3):
            finished += cluster.step().finished
        assert ids[1] in cluster.fleet.engines[1].requests  # on its decode replica by now
        assert cluster.abort(ids[1])
        while not cluster.is_finished():
            finished += cluster.step().finished
        reasons = {r.request_id: r.finish_reason for r in finished}  # each reported once, an abort too
        assert reasons == {ids[0]: "abort", ids[1]: "abort", ids[2]: "length", ids[3]: "length"}
        assert len(finished) == 4
        assert drained(cluster)


def test_an_abort_between_the_two_replicas_frees_the_senders_blocks_and_is_reported():
    """On virtual clocks a handed-off request waits for its handoff time before its decode replica
    takes it: aborted then, its prefill replica frees what it held for the move."""
    with Cluster(prefill_replicas=1, decode_replicas=1, **SIM) as cluster:
        ids = [cluster.add_request(p, GREEDY, arrival_time=0.0) for p in prompts_of(3)]
        finished = []
        while not cluster.handoffs:
            finished += cluster.step().finished
        between = cluster.handoffs[0][2].request_id
        assert cluster.abort(between) and all(entry[2].request_id != between for entry in cluster.handoffs)
        while not cluster.is_finished():
            finished += cluster.step().finished
        reasons = {r.request_id: r.finish_reason for r in finished}
        assert reasons == {i: "abort" if i == between else "length" for i in ids} and len(finished) == 3
        assert drained(cluster)


def test_a_move_that_times_out_fails_its_request_naming_both_replicas_and_the_others_go_on():
    """A link so slow that moves of long prompts outlast kv_transfer.timeout_s: those requests end
    with an error naming their prefill and decode replica, short ones decode on, blocks all free."""
    prompts = [[7] * 20, [8] * 30, [9] * 500, [10] * 400]  # 2 and 25-32 blocks of 16 tokens
    slow = dict(bandwidth_bytes_per_s=20 * 4096, timeout_s=0.5)  # 20 of the simulated model's blocks a second
    with Cluster(prefill_replicas=1, decode_replicas=1, kv_transfer_options=slow, **SIM) as cluster:
        outputs = cluster.generate(prompts, GREEDY, use_tqdm=False)
        assert cluster.fleet.engines[0].runner.kv_block_bytes == 4096
        assert [o["finish_reason"] for o in outputs] == ["length", "length", "error", "error"]
        for out, request_id in ((outputs[2], 2), (outputs[3], 3)):
            assert f"request {request_id} from replica 0 to replica 1 failed: timed out after 0.5 s" in out["error"]
        assert drained(cluster)


def simulated_workload(count=60, rate=100.0, seed=3):
    rng = random.Random(seed)
    t, requests = 0.0, []
    for i in range(count):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(50, 400))]
        requests.append(WorkloadRequest(i, t, prompt, rng.randrange(4, 30)))
    return requests


def test_a_simulated_fleet_hands_each_request_over_in_time_order():
    requests = simulated_workload()
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
    runs = []
    for _ in range(2):
        with Cluster(prefill_replicas=1, decode_replicas=2, router="least_load", **SIM) as cluster:
            assert cluster.fleet.virtual and cluster.kv_transfer_name == "simulated"
            runs.append((run_workload(cluster, requests, params), cluster.fleet.engines))
            assert drained(cluster)
    (first, engines), (second, _) = runs
    assert first.requests == second.requests  # deterministic
    for record, request in zip(first.requests, requests):
        assert record.finish_reason == "length" and record.num_output_tokens == request.output_len
        assert record.replica_id in (1, 2)
        if record.num_output_tokens > 1:
            # the second token comes after the K/V arrived, which is after the first token
            assert record.kv_transfer_s > 0
            assert record.token_times_s[1] >= record.first_token_s + record.kv_transfer_s - 1e-9
    # a decode replica is never made to wait for a handoff from its future: no gap between its
    # tokens longer than a step plus what a move and a queue add, as a clock that jumped would give
    gaps = [b - a for r in first.requests for a, b in zip(r.token_times_s[1:], r.token_times_s[2:])]
    assert max(gaps) < 0.1
    assert engines[0].stats.num_decode_tokens == 0


def test_bench_records_the_split(tmp_path, capsys):
    cfg = compose(
        [
            "job=bench",
            "executor=simulated",
            "engine.kvcache_block_size=16",
            "engine.num_kvcache_blocks=256",
            "engine.max_model_len=1024",
            "bench.warmup=false",
            "bench.arrival=poisson",
            "bench.request_rate=50",
            "bench.num_seqs=40",
            "bench.max_len=200",
            "cluster.prefill_replicas=1",
            "cluster.decode_replicas=2",
            "kv_transfer=simulated",
            "kv_transfer.link=infiniband",
            "bench.slo_ttft_s=1",
            "bench.slo_tpot_s=0.05",
        ]
    )
    result = run_bench(cfg, str(tmp_path))
    assert result["num_requests"] == 40 and result["num_failed_requests"] == 0
    assert result["cluster"] == {
        "replicas": 3,
        "backend": "local",
        "gpus_per_replica": 1.0,
        "prefill_replicas": 1,
        "decode_replicas": 2,
    }
    assert result["plugins"]["kv_transfer"] == "simulated"
    assert result["plugin_options"]["kv_transfer"]["link"] == "infiniband"
    split = result["disaggregation"]
    assert split["prefill_replicas"] == 1 and split["decode_replicas"] == 2
    assert 0 < split["prefill_busy_fraction"] <= 1 and 0 < split["decode_busy_fraction"] <= 1
    assert split["kv_bytes_moved"] == result["kv_transfer_bytes"] > 0
    assert result["num_kv_transfers"] <= 40 and result["kv_transfer_s"]["p99"] >= result["kv_transfer_s"]["p50"] > 0
    assert "goodput" in result
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert all(line["replica_id"] in (1, 2) or line["num_output_tokens"] <= 1 for line in lines)
    assert any("kv_transfer_s" in line for line in lines)
    assert "prefill/decode: 1 + 2 replicas, busy" in capsys.readouterr().out
