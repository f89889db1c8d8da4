"""The server's loop in front of a Ray cluster (cluster.backend=ray, a local Ray instance): a
request that reaches the server while the loop waits for the actors' reports is routed and sent
to its actor at once, not when the wait ends. Slow: starting Ray takes this machine tens of
seconds."""

import asyncio
import random
import time

import pytest

from inferlab import Cluster, SamplingParams
from inferlab.server.engine_loop import ClusterLoop, Prompt, RequestStream

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

# a simulated engine on the host's clock: replica 0's long prefill keeps it silent, with no model to run
SIMULATED = dict(executor="simulated", executor_options={"profile": "h200-qwen3-8b-triton", "real_time": True})


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    yield
    ray.shutdown()


class ByLength:
    """Sends prompts longer than 64 tokens to replica 0, the others to replica 1."""

    def route(self, request, replicas, state):
        return replicas[0] if request.num_prompt_tokens > 64 else replicas[1]


def test_a_request_reaching_the_server_while_its_loop_waits_for_reports_is_sent_at_once(local_ray):
    """Replica 0 prefills a long prompt, so the loop is in the cluster's step, waiting for reports;
    short requests submitted meanwhile (as an HTTP handler submits them, on the event loop) reach
    the driver's send to replica 1 within a fraction of the wait for reports (POLL_S, which they
    used to wait out)."""
    with Cluster(replicas=2, backend="ray", gpus_per_replica=0, **SIMULATED) as cluster:
        cluster.router = ByLength()
        routed: dict[int, float] = {}  # a short request's index -> when the driver routed it to its replica
        sent: dict[int, float] = {}  # -> when the driver's call to the actor returned
        driver_requests = {}
        queue = cluster.fleet.queue

        def timed_queue(replica, request, at=None):
            started = time.perf_counter()
            queue(replica, request, at)
            if request.metadata:
                routed[request.metadata["i"]], sent[request.metadata["i"]] = started, time.perf_counter()
                driver_requests[request.metadata["i"]] = request

        cluster.fleet.queue = timed_queue
        loop = ClusterLoop(cluster)
        submitted: dict[int, float] = {}
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        rng = random.Random(0)

        async def serve() -> None:
            loop.start(asyncio.get_running_loop())
            loop.submit(RequestStream(), [Prompt(list(range(1, 4001)), params)])
            await asyncio.sleep(0.03)  # the loop is in the cluster's step now, replica 0 prefilling
            for i in range(16):
                submitted[i] = time.perf_counter()
                loop.submit(RequestStream(), [Prompt([7, 8, 9, i], params, metadata={"i": i})])
                await asyncio.sleep(rng.uniform(0.004, 0.012))  # at every point of the wait for reports
            deadline = time.monotonic() + 60
            while loop.num_in_flight() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)

        try:
            asyncio.run(serve())
        finally:
            loop.stop()
        assert sorted(sent) == list(range(16))
        assert all(cluster.replica_of(r.request_id) == 1 for r in driver_requests.values())
        routed_ms, sent_ms = (sorted(round((t[i] - submitted[i]) * 1e3, 2) for i in range(16)) for t in (routed, sent))
        scheduled_ms = sorted(
            round((r.first_scheduled_time - submitted[i]) * 1e3, 2) for i, r in driver_requests.items()
        )
        figures = f"ms from submit: to routed {routed_ms}, to sent {sent_ms}, to scheduled there {scheduled_ms}"
        # the loop used to route them only when its wait for reports (up to POLL_S, 10 ms) ended,
        # and to ask each actor for its counters after every step
        assert routed_ms[8] < 1.5, figures
        assert sent_ms[8] < 3, figures
