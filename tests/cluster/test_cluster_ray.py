"""cluster.backend=ray on this CPU: replicas as Ray actors on a local Ray instance (small actors,
the embedded model). They serve what local replicas serve, their KV events tell the driver what
each caches, a killed actor fails its own requests alone and is no longer offered, and close()
leaves no process behind. Slow: starting Ray takes this machine tens of seconds."""

import os
import time

import pytest

from inferlab import LLM, Cluster, SamplingParams
from inferlab.core.blocks import block_hashes
from inferlab.core.request import Request
from inferlab.core.routing import RoutedRequest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

TINY = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=32, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def descendants() -> set[int]:
    """The live processes this one started, at any depth (read from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":  # a zombie is gone but for its parent's wait
                parents[int(entry)] = int(fields[1])
    mine, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - mine
        mine |= frontier
    return mine


def assert_closed_leaving_nothing(cluster, before: set[int]) -> None:
    """close() shuts Ray down, and within a minute no process it started (beyond `before`) lives."""
    cluster.close()
    assert not ray.is_initialized()
    deadline = time.monotonic() + 60
    while descendants() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not descendants() - before, "processes Ray started are still alive after close()"


def test_close_shuts_ray_down_and_leaves_no_process():
    """Run first in this file: the cluster starts Ray itself, so close() stops it."""
    assert not ray.is_initialized()
    before = descendants()
    cluster = Cluster(replicas=2, backend="ray", gpus_per_replica=0, **TINY)
    assert ray.is_initialized() and descendants() - before
    outputs = cluster.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [4, 4]
    assert_closed_leaving_nothing(cluster, before)


@pytest.fixture(scope="module")
def local_ray():
    """One Ray instance for the tests below (starting one takes most of their time)."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    yield
    ray.shutdown()


def test_asking_for_gpus_the_ray_cluster_lacks_is_refused(local_ray):
    with pytest.raises(
        ValueError, match=r"cluster.gpus_per_replica=1 asks for 2 GPUs for 2 replicas, but the Ray cluster has 0"
    ):
        Cluster(replicas=2, backend="ray", gpus_per_replica=1, **TINY)


def test_ray_replicas_serve_what_one_engine_does_and_report_their_cache(local_ray):
    stem = list(range(10, 10 + 48))  # three blocks of 16
    prompts = [stem + [3], list(range(100, 140)), stem + [4, 5], [7, 8, 9]]
    with Cluster(replicas=2, backend="ray", gpus_per_replica=0, router="kv_aware", **TINY) as cluster:
        first = cluster.generate(prompts[:2], GREEDY, use_tqdm=False)
        holder = cluster.fleet.replicas[cluster.replica_of(0)]
        assert set(block_hashes(prompts[0], 16, 3)) <= holder.cached  # from its KV events
        view = cluster.views[holder.replica_id]
        probe = RoutedRequest(Request(999, prompts[2], GREEDY))
        assert view.cached_prefix_tokens(probe) == 48
        rest = cluster.generate(prompts[2:], GREEDY, use_tqdm=False)
        assert cluster.replica_of(2) == holder.replica_id  # kv_aware followed the cached prefix
        assert cluster.stats.num_decode_tokens == 4 * 3  # each request's first token comes from its prefill
        result_plugins = cluster.fleet.on_front(lambda engine: engine.config.scheduler)
        assert result_plugins == "fcfs"
    with LLM(**TINY) as alone:
        for prompt, out in zip(prompts, first + rest):
            assert out["token_ids"] == alone.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"]


def test_a_killed_replica_fails_its_requests_alone_and_is_offered_no_more(local_ray):
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    with Cluster(replicas=2, backend="ray", gpus_per_replica=0, router="round_robin", **TINY) as cluster:
        ids = [cluster.add_request([5, 6, 7, i], long) for i in range(4)]
        assert [cluster.replica_of(i) for i in ids] == [0, 1, 0, 1]
        ray.kill(cluster.fleet.replicas[1].actor)
        outputs = {}
        while not cluster.is_finished():
            for request in cluster.step().finished:
                outputs[request.request_id] = cluster.output(request)
        for request_id in ids[1::2]:
            assert outputs[request_id]["finish_reason"] == "error"
            assert "replica 1 died" in outputs[request_id]["error"]
        for request_id in ids[0::2]:
            assert outputs[request_id]["finish_reason"] == "length" and len(outputs[request_id]["token_ids"]) == 120
        more = cluster.generate([[1, 2], [3, 4], [5, 6]], GREEDY, use_tqdm=False)
        assert all(len(o["token_ids"]) == 4 for o in more)
        assert all(cluster.replica_of(i) == 0 for i in range(4, 7))


class ByLength:
    """Sends prompts longer than 64 tokens to replica 0, the others to replica 1."""

    def route(self, request, replicas, state):
        return replicas[0] if request.num_prompt_tokens > 64 else replicas[1]


def test_a_request_arriving_while_the_driver_waits_reaches_its_actor_on_time(local_ray):
    """Replica 0 runs a prefill that takes the host a long time (a simulated engine on the host's
    clock), so it reports nothing meanwhile; requests arriving then for the idle replica 1 are sent
    when they arrive (the driver's wait ends at the next arrival it was promised, and sending waits
    for no round trip) and scheduled there soon after, on the actor's own clock."""
    from inferlab.experiment.driver import run_workload
    from inferlab.experiment.workload import WorkloadRequest

    simulated = dict(executor="simulated", executor_options={"profile": "h200-qwen3-8b-triton", "real_time": True})
    with Cluster(replicas=2, backend="ray", gpus_per_replica=0, **simulated) as cluster:
        cluster.router = ByLength()
        sent: dict[int, float] = {}
        queue = cluster.fleet.queue

        def timed_queue(replica, request, at=None):
            queue(replica, request, at)
            sent[request.request_id] = time.perf_counter() - request.arrival_time

        cluster.fleet.queue = timed_queue
        short = [WorkloadRequest(i + 1, 0.02 + 0.009 * i, [7, 8, 9, i], 1) for i in range(9)]
        workload = [WorkloadRequest(0, 0.0, list(range(1, 4001)), 1), *short]
        params = [SamplingParams(max_tokens=1, ignore_eos=True)] * len(workload)
        run = run_workload(cluster, workload, params)
        assert all(r.finish_reason == "length" for r in run.requests)
        assert [cluster.replica_of(i) for i in range(len(workload))] == [0] + [1] * len(short)
        first_end = run.requests[0].finish_s
        assert first_end > short[-1].arrival_s  # the short ones arrived while replica 0 was silent
        late = sorted(sent[i] for i in range(1, len(workload)))
        queued = sorted(r.first_scheduled_s - r.arrival_s for r in run.requests[1:])
        # the driver used to wait up to POLL_S for a report and then a round trip for each add (a
        # median of 19 ms sent); the bounds leave room for Ray's own call on a loaded 2-core machine
        assert late[len(late) // 2] < 0.005, late
        assert queued[len(queued) // 2] < 0.008, queued


def test_a_request_its_replica_refuses_fails_alone_with_the_reason(local_ray):
    """The driver sends a request without waiting for its actor: one the replica's engine refuses
    (it would never fit its KV cache) ends with an error naming the replica and the reason, and the
    requests around it are served."""
    small = dict(TINY, num_kvcache_blocks=4)  # 64 tokens
    with Cluster(replicas=2, backend="ray", gpus_per_replica=0, router="round_robin", **small) as cluster:
        ids = [
            cluster.add_request([5, 6, 7], GREEDY),
            cluster.add_request(list(range(1, 41)), SamplingParams(max_tokens=60)),
        ]
        ids += [cluster.add_request([8, 9], GREEDY), cluster.add_request([1, 2, 3], GREEDY)]
        outputs = {}
        while not cluster.is_finished():
            for request in cluster.step().finished:
                outputs[request.request_id] = cluster.output(request)
        refused = outputs[ids[1]]
        assert refused["finish_reason"] == "error"
        assert refused["error"].startswith("replica 1 refused the request: the request needs up to 7 KV blocks of 16")
        assert all(len(outputs[i]["token_ids"]) == 4 for i in ids[:1] + ids[2:])
        assert [cluster.replica_of(i) for i in ids] == [0, 1, 0, 1]
