"""On two CUDA GPUs with Ray (the device tool's nvidia-h100-x2, Ray from the slim kit,
docs/cluster.md): one prefill and one decode actor, a GPU each, their K/V over NCCL through
kv_transfer=distributed; greedy outputs equal one engine's (the embedded model in float32), every
block freed on both, and close() leaves Ray down.

Run: python -m pytest -m gpu -q tests/cluster/test_disaggregated_ray_gpu.py"""

import time

import pytest
import torch

from inferlab import LLM, Cluster, SamplingParams

ray = pytest.importorskip("ray")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

SETTINGS = dict(device="cuda", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64, enforce_eager=True)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_ray_roles_move_kv_over_nccl_and_equal_one_engine():
    prompts = [list(range(10, 10 + n)) for n in (5, 40, 77, 130)]
    with LLM(**SETTINGS) as alone:
        expected = [alone.generate([p], GREEDY, use_tqdm=False)[0]["token_ids"] for p in prompts]
    with Cluster(prefill_replicas=1, decode_replicas=1, backend="ray", gpus_per_replica=1, **SETTINGS) as cluster:
        assert cluster.kv_transfer_name == "distributed"
        got = [cluster.generate([p], GREEDY, use_tqdm=False)[0]["token_ids"] for p in prompts]
        assert got == expected
        stats = cluster.stats
        assert stats.kv_bytes_sent == stats.kv_bytes_received > 0 and stats.num_failed_kv_transfers == 0
        for replica in cluster.fleet.replicas:
            deadline = time.monotonic() + 30
            read = replica.actor.call.remote(lambda e: (e.kv_manager.num_free_blocks, e.kv_manager.num_blocks))
            while (counts := ray.get(read))[0] != counts[1] and time.monotonic() < deadline:
                time.sleep(0.2)
                read = replica.actor.call.remote(lambda e: (e.kv_manager.num_free_blocks, e.kv_manager.num_blocks))
            assert counts[0] == counts[1], f"replica {replica.replica_id} holds blocks after every move ended"
    assert not ray.is_initialized()
