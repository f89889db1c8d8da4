"""Prefill/decode roles on Ray actors (cluster.backend=ray) on this CPU: each actor joins one gloo
group through kv_transfer=distributed, the prefill actor sends a request's K/V, the decode actor
receives it, and the driver hands the request over as the local cluster does. Slow: starting Ray
takes this machine tens of seconds."""

import time

import pytest

from inferlab import LLM, Cluster, SamplingParams
from inferlab.conf import compose
from inferlab.experiment.bench import run_bench
from tests.cluster.test_cluster_ray import assert_closed_leaving_nothing, descendants

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

TINY = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=32, max_num_seqs=8, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(10, 60)), [5, 6, 7], list(range(10, 40)) + [3, 4], list(range(200, 230))]


def run(cluster, ids, finished=None) -> dict[int, dict]:
    outputs = {}
    deadline = time.monotonic() + 120
    while set(ids) - outputs.keys() and time.monotonic() < deadline:
        for request in cluster.step().finished:
            outputs[request.request_id] = cluster.output(request)
            if finished is not None:
                finished.append(request)
    return outputs


def all_blocks_free(cluster, replica_id) -> bool:
    """Whether the replica's cache is empty again (a sender frees its blocks once the move ended)."""
    actor = cluster.fleet.replicas[replica_id].actor
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ray.get(actor.call.remote(lambda e: e.kv_manager.num_free_blocks == e.kv_manager.num_blocks)):
            return True
        time.sleep(0.2)
    return False


def test_one_prefill_and_one_decode_actor_equal_one_engine_and_close_leaves_no_process():
    with LLM(**TINY) as alone:
        expected = [out["token_ids"] for out in alone.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert not ray.is_initialized()
    before = descendants()
    cluster = Cluster(prefill_replicas=1, decode_replicas=1, backend="ray", gpus_per_replica=0, **TINY)
    assert cluster.kv_transfer_name == "distributed"  # auto, on Ray
    assert cluster.kv_transfer_options["world_size"] == 2
    assert cluster.kv_transfer_options["address"].startswith("127.0.0.1:")  # chosen by the driver
    assert [replica.role for replica in cluster.fleet.replicas] == ["prefill", "decode"]
    outputs = cluster.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [out["token_ids"] for out in outputs] == expected
    assert all(cluster.replica_of(i) == 1 for i in range(len(PROMPTS)))  # each ended on its decode replica
    finished = []
    ids = [cluster.add_request(prompt, GREEDY) for prompt in PROMPTS[:2]]
    assert [out["token_ids"] for out in run(cluster, ids, finished).values()] == expected[:2]
    for request in finished:  # the driver's request hears how its K/V moved (records read it)
        assert request.kv_transfer_s > 0 and request.kv_transfer_bytes > 0
    assert all_blocks_free(cluster, 0) and all_blocks_free(cluster, 1)
    stats = cluster.stats
    assert stats.kv_bytes_sent == stats.kv_bytes_received > 0 and stats.num_failed_kv_transfers == 0
    assert_closed_leaving_nothing(cluster, before)


def test_a_decode_actor_killed_mid_move_fails_its_request_naming_both_and_the_others_go_on():
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[5, 6, 7, i] for i in range(6)]
    with LLM(**TINY) as alone:
        expected = [out["token_ids"] for out in alone.generate(prompts, long, use_tqdm=False)]
    with Cluster(
        prefill_replicas=1,
        decode_replicas=2,
        backend="ray",
        gpus_per_replica=0,
        kv_transfer_options={"timeout_s": 10},
        **TINY,
    ) as cluster:
        ids = [cluster.add_request(prompt, long) for prompt in prompts]
        outputs, victim = {}, None
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            for request in cluster.step().finished:
                outputs[request.request_id] = cluster.output(request)
            # handed over to replica 2 in this step: the driver has heard nothing of its move yet
            victim = next((i for i in ids if cluster.replica_of(i) == 2 and i not in outputs), None)
        assert victim is not None, "no request reached decode replica 2"
        ray.kill(cluster.fleet.replicas[2].actor)
        outputs |= run(cluster, ids)
        assert outputs[victim]["finish_reason"] == "error"
        assert f"the KV transfer of request {victim} from replica 0 to replica 2 failed" in outputs[victim]["error"]
        assert "replica 2 died" in outputs[victim]["error"]
        survivors = [i for i in ids if cluster.replica_of(i) == 1]
        assert survivors, "no request decoded on replica 1"
        for i in survivors:
            assert outputs[i]["token_ids"] == expected[i]
        for i in set(ids) - set(survivors):
            assert outputs[i]["finish_reason"] == "error" and "replica 2" in outputs[i]["error"]
        assert all_blocks_free(cluster, 0)  # the prefill replica freed the blocks of the failed moves too
        more = cluster.generate(prompts[:2], long, use_tqdm=False)  # the pair that is left goes on
        assert [out["token_ids"] for out in more] == expected[:2]
        assert all(cluster.replica_of(i) == 1 for i in range(len(ids), len(ids) + 2))


def test_bench_on_ray_roles_records_the_moves(tmp_path):
    """job=bench with kv_transfer=distributed named on the command line: its default address and
    world_size give way to the cluster's."""
    cfg = compose(
        [
            "job=bench",
            "cluster.backend=ray",
            "cluster.gpus_per_replica=0",
            "cluster.prefill_replicas=1",
            "cluster.decode_replicas=1",
            "kv_transfer=distributed",
            "engine.device=cpu",
            "engine.kvcache_block_size=16",
            "engine.num_kvcache_blocks=64",
            "engine.max_model_len=256",
            "bench.num_seqs=6",
            "bench.min_len=8",
            "bench.max_len=48",
            "bench.min_output_len=4",
            "bench.max_output_len=8",
            "bench.warmup=false",
        ]
    )
    result = run_bench(cfg, str(tmp_path))
    assert result["num_requests"] == 6 and result["num_failed_requests"] == 0
    assert result["disaggregation"]["kv_transfer"] == "distributed"
    assert result["kv_transfer_bytes"] > 0 and result["kv_transfer_s"]["p50"] > 0
    options = result["plugin_options"]["kv_transfer"]
    assert options["world_size"] == 2 and options["address"] != "127.0.0.1:29600"
