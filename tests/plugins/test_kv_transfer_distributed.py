"""kv_transfer=distributed across processes on CPU (gloo): a prefill engine in one process, a
decode engine in another, requests handed from one to the other as a cluster would (here through
a queue), their K/V through torch.distributed. The outputs equal one engine's, token for token."""

import multiprocessing as mp
import pickle
import queue
import random
import socket

import pytest

from inferlab import LLM, SamplingParams

SETTINGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=40, max_num_batched_tokens=64)
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts_of(count, seed=0, shared_prefix=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 300) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 300) for _ in range(rng.randrange(5, 50))] for _ in range(count)]


def endpoint(rank, address, prompts, handoffs, results, options, forged=None):
    """One process: replica 0 prefills and hands off, replica 1 decodes what it is handed."""
    import time

    from inferlab.core.plugins import get_registry
    from inferlab.core.protocols import KVMove

    try:
        engine = LLM(**SETTINGS)
        transfer = get_registry().create(
            "kv_transfer", "distributed", options={"address": address, "world_size": 2, **options}
        )
        engine.connect_kv_transfer(transfer, rank)
        deadline = time.monotonic() + 120
        if rank == 0:
            for prompt in prompts:
                request = engine.make_request(prompt, PARAMS)
                request.kv_send = KVMove(request.request_id, 0, 1)
                engine.queue(request)
            while not engine.is_finished():
                for request in engine.step().finished:
                    handoffs.put(pickle.dumps(request))
                    if forged is not None and request.request_id == 0:  # a handoff this replica never sent
                        copy = pickle.loads(pickle.dumps(request))
                        copy.request_id = forged
                        handoffs.put(pickle.dumps(copy))
            kv = engine.kv_manager
            while kv.num_free_blocks < kv.num_blocks and time.monotonic() < deadline:
                engine.poll_kv_transfer()  # frees the blocks of each send once it ended
                time.sleep(0.01)
            results.put(("prefill", kv.num_free_blocks == kv.num_blocks, engine.stats.kv_bytes_sent))
        else:
            outputs, pending = {}, len(prompts) + (forged is not None)
            while len(outputs) < pending and time.monotonic() < deadline:
                try:
                    while True:
                        request = pickle.loads(handoffs.get_nowait())
                        request.kv_send, request.kv_receive = None, KVMove(request.request_id, 0, 1)
                        engine.queue(request)
                except queue.Empty:
                    pass
                for request in engine.step().finished:
                    outputs[request.request_id] = engine.output(request)
            kv = engine.kv_manager
            results.put(("decode", outputs, kv.num_free_blocks == kv.num_blocks, engine.stats.kv_bytes_received))
        transfer.close()
    except BaseException as e:
        results.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise


def run_pair(prompts, forged=None, **options):
    ctx = mp.get_context("spawn")
    handoffs, results = ctx.Queue(), ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    processes = [
        ctx.Process(target=endpoint, args=(rank, address, prompts, handoffs, results, options, forged))
        for rank in (0, 1)
    ]
    for p in processes:
        p.start()
    try:
        got = {}
        for _ in processes:
            item = results.get(timeout=240)
            assert item[0] != "error", f"replica {item[1]} failed: {item[2]}"
            got[item[0]] = item[1:]
        for p in processes:
            p.join(timeout=30)
        return got
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()


@pytest.mark.slow
def test_greedy_outputs_across_processes_equal_one_engines():
    prompts = prompts_of(6, shared_prefix=20)
    with LLM(**SETTINGS) as alone:
        expected = alone.generate(prompts, PARAMS, use_tqdm=False)
    got = run_pair(prompts, timeout_s=30)
    prefill_freed, bytes_sent = got["prefill"]
    outputs, decode_freed, bytes_received = got["decode"]
    assert [outputs[i]["token_ids"] for i in range(len(prompts))] == [e["token_ids"] for e in expected]
    assert prefill_freed and decode_freed
    assert bytes_sent == bytes_received > 0


@pytest.mark.slow
def test_a_move_the_sender_never_made_fails_alone_and_the_pair_goes_on():
    """The decode replica is handed a request whose K/V the prefill replica never sent: its move
    fails after the timeout, with both replicas named, and the moves after it still pair up."""
    prompts = prompts_of(3, seed=1)
    with LLM(**SETTINGS) as alone:
        expected = alone.generate(prompts, PARAMS, use_tqdm=False)
    got = run_pair(prompts, forged=99, timeout_s=3)
    outputs, decode_freed, _ = got["decode"]
    assert outputs[99]["finish_reason"] == "error"
    assert "the KV transfer of request 99 from replica 0 to replica 1 failed" in outputs[99]["error"]
    assert [outputs[i]["token_ids"] for i in range(3)] == [e["token_ids"] for e in expected]
    assert decode_freed and got["prefill"][0]


def test_options_are_checked():
    from inferlab.core.plugins import PluginError, get_registry

    for options, message in [
        ({"address": "nohost"}, "kv_transfer.address must be host:port"),
        ({"world_size": 1}, "kv_transfer.world_size must be a whole number >= 2"),
        ({"backend": "mpi"}, "kv_transfer.backend must be one of auto, nccl, gloo"),
    ]:
        with pytest.raises(PluginError, match=message):
            get_registry().create("kv_transfer", "distributed", options=options)
