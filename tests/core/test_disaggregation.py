"""Prefill/decode disaggregation in the engine: a request prefilled on one engine (kv_send) and
handed to another (kv_receive) through a kv_transfer plugin decodes exactly as one engine would,
whatever happens to it on either side, and a move that fails fails that request alone."""

import random
from dataclasses import replace

import pytest

from inferlab import LLM, SamplingParams
from inferlab.core.plugins import PluginRegistry, get_registry
from inferlab.core.protocols import KVMove, KVMoveEnded
from inferlab.plugins.kv_transfer.local import LocalTransfer

BASE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=40, max_num_batched_tokens=256)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make_prompts(seed=0, count=10, shared_prefix=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 300) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 300) for _ in range(rng.randrange(5, 60))] for _ in range(count)]


def pair(transfer=None, prefill=None, decode=None, registry=None):
    """A prefill engine (replica 0) and a decode engine (replica 1) joined by a transfer."""
    transfer = transfer or LocalTransfer()
    a = LLM(registry=registry, **{**BASE, **(prefill or {})})
    b = LLM(registry=registry, **{**BASE, **(decode or {})})
    a.connect_kv_transfer(transfer, 0)
    b.connect_kv_transfer(transfer, 1)
    return a, b


def disaggregated(a, b, prompts, params=GREEDY, max_rounds=10_000):
    """Each prompt prefilled on a, handed off, decoded on b, as a cluster would: the outputs in
    order (from b, or from a for requests whose first token ended them) and the requests."""
    requests = []
    for i, prompt in enumerate(prompts):
        request = a.make_request(prompt, params[i] if isinstance(params, list) else params)
        request.kv_send = KVMove(request.request_id, 0, 1)
        a.queue(request)
        requests.append(request)
    outputs = {}
    for _ in range(max_rounds):
        if a.is_finished() and b.is_finished():
            break
        for request in a.step().finished:
            if request.finish_reason == "handoff":
                request.kv_send, request.kv_receive = None, KVMove(request.request_id, 0, 1)
                b.queue(request)
            else:
                outputs[request.request_id] = a.output(request)
        for request in b.step().finished:
            outputs[request.request_id] = b.output(request)
        a.poll_kv_transfer()  # an idle prefill engine frees what it sent
    else:
        raise AssertionError("the engines did not finish")
    a.wait_until(b.clock())  # on virtual clocks the sender frees its blocks once its clock reaches the moves' ends
    a.poll_kv_transfer()
    return [outputs[r.request_id] for r in requests], requests


def all_free(*engines):
    return all(e.kv_manager.num_free_blocks == e.kv_manager.num_blocks for e in engines)


@pytest.mark.parametrize(
    "prefill, decode, shared_prefix",
    [
        (dict(), dict(), 0),
        (dict(), dict(), 40),  # prefix hits on both sides: the decode side receives only what it lacks
        (dict(max_num_batched_tokens=24), dict(), 0),  # chunked prefill
        # preemption on the prefill side: its blocks are held for sending while the decode side is full
        (dict(num_kvcache_blocks=6, max_num_batched_tokens=24), dict(num_kvcache_blocks=9), 0),
        (dict(), dict(num_kvcache_blocks=9), 0),  # a decode side short of room: waits, preempts, never drops
        (dict(overlap_scheduling=True), dict(overlap_scheduling=True), 40),
    ],
    ids=["plain", "prefix-hits", "chunked", "preempt-prefill", "preempt-decode", "overlap"],
)
def test_greedy_outputs_equal_one_engines(prefill, decode, shared_prefix):
    prompts = make_prompts(shared_prefix=shared_prefix)
    with LLM(**BASE) as alone:
        expected = alone.generate(prompts, GREEDY, use_tqdm=False)
    a, b = pair(prefill=prefill, decode=decode)
    outputs, requests = disaggregated(a, b, prompts)
    assert [o["token_ids"] for o in outputs] == [e["token_ids"] for e in expected]
    assert all(o["finish_reason"] == "length" for o in outputs)
    assert all_free(a, b)
    if not decode.get("num_kvcache_blocks"):
        assert b.stats.num_prefill_tokens == 0  # the decode side computed no prompt
    assert a.stats.kv_bytes_sent == b.stats.kv_bytes_received > 0
    assert all(r.kv_transfer_s is not None and r.kv_transfer_s >= 0 for r in requests)
    if prefill.get("num_kvcache_blocks"):
        assert a.stats.num_preemptions > 0
    if decode.get("num_kvcache_blocks"):
        assert b.stats.num_preemptions > 0 or b.stats.num_prefill_tokens > 0
    if shared_prefix:
        hits, _ = b.kv_manager.prefix_cache_stats()
        assert hits > 0  # what it received entered its prefix cache
        full = sum(-(-r.num_prompt_tokens // 16) for r in requests) * b.runner.kv_block_bytes
        assert b.stats.kv_bytes_received < full


def test_decode_side_preemption_recomputes_there():
    """A request preempted on the decode side is recomputed there from its prompt and outputs."""
    prompts = make_prompts(seed=3, count=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(**BASE) as alone:
        expected = alone.generate(prompts, params, use_tqdm=False)
    a, b = pair(decode=dict(num_kvcache_blocks=7))
    outputs, _ = disaggregated(a, b, prompts, params)
    assert [o["token_ids"] for o in outputs] == [e["token_ids"] for e in expected]
    assert b.stats.num_preemptions > 0 and b.stats.num_prefill_tokens > 0
    assert all_free(a, b)


def test_seeded_sampling_draws_what_one_engine_draws():
    """A request's sampling noise is a function of its seed and position, wherever it runs."""
    prompts = make_prompts(count=4)
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=i, ignore_eos=True) for i in range(4)]
    with LLM(**BASE) as alone:
        expected = alone.generate(prompts, params, use_tqdm=False)
    a, b = pair()
    outputs, _ = disaggregated(a, b, prompts, params)
    assert [o["token_ids"] for o in outputs] == [e["token_ids"] for e in expected]


def test_a_first_token_that_ends_the_request_ends_it_on_the_prefill_side():
    prompts = make_prompts(count=4)
    params = [SamplingParams(temperature=0, max_tokens=1), GREEDY, SamplingParams(temperature=0, max_tokens=1), GREEDY]
    a, b = pair()
    outputs, requests = disaggregated(a, b, prompts, params)
    assert [len(o["token_ids"]) for o in outputs] == [1, 8, 1, 8]
    assert [o["finish_reason"] for o in outputs] == ["length"] * 4
    assert requests[0].kv_transfer_s is None and requests[1].kv_transfer_s is not None
    assert a.stats.kv_bytes_sent == b.stats.kv_bytes_received
    assert all_free(a, b)


class FailingTransfer(LocalTransfer):
    """The local transfer, failing the moves of some request ids at both ends."""

    fail_ids: set = set()

    def _copy(self, entry):
        if entry.move.request_id in self.fail_ids:
            entry.ended = KVMoveEnded(entry.move, "the link went down")
            return
        super()._copy(entry)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_first_token_that_stops_the_request_ends_it_on_the_prefill_side(overlap):
    """A stop token as the first token: the request ends there ("stop"), nothing moves, and its
    blocks held for sending are freed (under overlap the token is known a step later)."""
    prompts = make_prompts(count=4)
    with LLM(**BASE) as alone:
        firsts = [o["token_ids"][0] for o in alone.generate(prompts, replace(GREEDY, max_tokens=1), use_tqdm=False)]
        params = [
            replace(GREEDY, ignore_eos=False, stop_token_ids=[t] if i % 2 == 0 else []) for i, t in enumerate(firsts)
        ]
        expected = alone.generate(prompts, params, use_tqdm=False)
    a, b = pair(prefill=dict(overlap_scheduling=overlap), decode=dict(overlap_scheduling=overlap))
    outputs, requests = disaggregated(a, b, prompts, params)
    assert [o["token_ids"] for o in outputs] == [e["token_ids"] for e in expected]
    assert [o["finish_reason"] for o in outputs] == [e["finish_reason"] for e in expected]
    assert [o["finish_reason"] for o in outputs[::2]] == ["stop", "stop"]
    assert [r.kv_transfer_s is None for r in requests] == [True, False, True, False]
    assert a.stats.kv_bytes_sent == b.stats.kv_bytes_received and not a.scheduler.sending
    assert all_free(a, b)


def test_a_send_that_raises_fails_that_request_alone_on_the_prefill_side():
    class Raising(LocalTransfer):
        def send(self, move, blocks):
            if move.request_id == 1:
                raise RuntimeError("no route to replica 1")
            super().send(move, blocks)

    prompts = make_prompts(count=3)
    with LLM(**BASE) as alone:
        expected = alone.generate(prompts, GREEDY, use_tqdm=False)
    a, b = pair(Raising())
    outputs, _ = disaggregated(a, b, prompts)
    assert [o["finish_reason"] for o in outputs] == ["length", "error", "length"]
    assert "from replica 0 to replica 1 failed: send raised RuntimeError: no route to replica 1" in outputs[1]["error"]
    assert outputs[1]["token_ids"] == expected[1]["token_ids"][:1]  # the prefill side's first token
    assert [outputs[i]["token_ids"] for i in (0, 2)] == [expected[i]["token_ids"] for i in (0, 2)]
    assert a.stats.num_failed_kv_transfers == 1 and a.stats.num_failed_requests == 1
    assert all_free(a, b)


def test_a_failed_move_fails_that_request_alone():
    prompts = make_prompts(count=6)
    with LLM(**BASE) as alone:
        expected = alone.generate(prompts, GREEDY, use_tqdm=False)
    transfer = FailingTransfer()
    transfer.fail_ids = {2, 4}
    a, b = pair(transfer)
    outputs, _ = disaggregated(a, b, prompts)
    for i, (out, want) in enumerate(zip(outputs, expected)):
        if i in (2, 4):
            assert out["finish_reason"] == "error" and out["token_ids"] == want["token_ids"][:1]  # from the prefill
            assert f"request {i} from replica 0 to replica 1 failed: the link went down" in out["error"]
        else:
            assert out["token_ids"] == want["token_ids"]
    assert b.stats.num_failed_kv_transfers == 2 and b.stats.num_failed_requests == 2
    assert a.stats.num_failed_kv_transfers == 2
    assert all_free(a, b)


def test_a_receive_that_raises_fails_that_request_alone():
    class Raising(LocalTransfer):
        def receive(self, move, blocks, first_block):
            if move.request_id == 1:
                raise RuntimeError("no route to replica 0")
            super().receive(move, blocks, first_block)

    a, b = pair(Raising())
    outputs, _ = disaggregated(a, b, make_prompts(count=3))
    assert [o["finish_reason"] for o in outputs] == ["length", "error", "length"]
    assert "receive raised RuntimeError: no route to replica 0" in outputs[1]["error"]
    assert all_free(a, b)


def test_aborting_a_request_whose_kv_is_arriving_frees_both_sides():
    a, b = pair()
    request = a.make_request(make_prompts(count=1)[0], GREEDY)
    request.kv_send = KVMove(request.request_id, 0, 1)
    a.queue(request)
    while not a.is_finished():
        a.step()
    request.kv_send, request.kv_receive = None, KVMove(request.request_id, 0, 1)
    b.queue(request)
    b.step()  # admits it and starts receiving; the move ends at the next poll
    assert request.request_id in b.scheduler.receiving
    assert b.abort(request.request_id)
    a.poll_kv_transfer()
    assert all_free(a, b)
    assert b.step().finished == [request]  # an abort is reported by the next step
    assert b.is_finished() and request.finish_reason == "abort"


def simulated_pair(**transfer_options):
    registry = get_registry()
    transfer = registry.create("kv_transfer", "simulated", options=transfer_options)
    sim = dict(executor="simulated", executor_options={"profile": "roofline"}, num_kvcache_blocks=64)
    a, b = LLM(**sim), LLM(**sim)
    a.connect_kv_transfer(transfer, 0)
    b.connect_kv_transfer(transfer, 1)
    return a, b, transfer


def test_simulated_moves_take_the_links_time_on_virtual_clocks():
    a, b, transfer = simulated_pair(link="infiniband", latency_s=0.001)
    prompts = [[5 + i] * 300 for i in range(3)]  # two blocks of 256 tokens each
    outputs, requests = disaggregated(a, b, prompts)
    block_bytes = b.runner.kv_block_bytes
    link_seconds = 2 * block_bytes / 50e9
    # handed off in one step, they queue for the link, one after another
    assert sorted(r.kv_transfer_s for r in requests) == pytest.approx([0.001 + k * link_seconds for k in (1, 2, 3)])
    assert all(r.kv_transfer_bytes == 2 * block_bytes for r in requests)
    assert all(len(o["token_ids"]) == 8 for o in outputs)
    # the decode side's second token came no sooner than its K/V arrived
    for r in requests:
        assert r.token_times[1] >= r.token_times[0] + r.kv_transfer_s - 1e-9
    assert all_free(a, b)


def test_a_simulated_move_past_its_timeout_fails_with_both_replicas_named():
    a, b, _ = simulated_pair(link="infiniband", bandwidth_bytes_per_s=1e3, timeout_s=0.5)
    outputs, _ = disaggregated(a, b, make_prompts(count=2))
    for out in outputs:
        assert out["finish_reason"] == "error"
        assert "from replica 0 to replica 1 failed: timed out after 0.5 s" in out["error"]
    assert b.clock() >= 0.5  # the decode side waited the timeout out on its virtual clock
    assert all_free(a, b)


def test_requests_that_move_kv_need_a_transfer_and_their_own_endpoints():
    with LLM(**BASE) as lone:
        request = lone.make_request([1, 2, 3], GREEDY)
        request.kv_send = KVMove(request.request_id, 0, 1)
        with pytest.raises(ValueError, match="no KV transfer: call connect_kv_transfer first"):
            lone.queue(request)
    a, b = pair()
    request = a.make_request([1, 2, 3], GREEDY)
    request.kv_receive = KVMove(request.request_id, 0, 1)
    with pytest.raises(ValueError, match="to receive its K/V on replica 1, not on this engine \\(replica 0\\)"):
        a.queue(request)
    request = a.make_request([1, 2, 3], SamplingParams(n=2))
    request.kv_send = KVMove(request.request_id, 0, 1)
    with pytest.raises(ValueError, match="asks for n=2 choices.*takes n=1"):
        a.queue(request)
    with pytest.raises(ValueError, match="replica 0 is attached to this KV transfer already"):
        a.handoff.transfer.attach(0, b.runner, 16)
    with pytest.raises(TypeError, match="must be a kv_transfer plugin"):
        b.connect_kv_transfer(object(), 2)


def test_local_transfer_needs_runners_that_hold_blocks_as_data():
    sim = LLM(executor="simulated", executor_options={"profile": "roofline"}, num_kvcache_blocks=8)
    with pytest.raises(TypeError, match="cannot read or write them \\(KVBlockStore\\).*kv_transfer=simulated"):
        sim.connect_kv_transfer(LocalTransfer(), 0)


def test_a_third_party_transfer_registers_like_any_plugin(plugin_module):
    registry = PluginRegistry()
    registry.register(
        plugin_module("my_transfer", register_kv_transfers=lambda register: register("mine", LocalTransfer))
    )
    assert "mine" in registry.names("kv_transfer")
    transfer = registry.create("kv_transfer", "mine")
    a, b = pair(transfer)
    outputs, _ = disaggregated(a, b, make_prompts(count=2))
    assert all(len(o["token_ids"]) == 8 for o in outputs)


def test_the_kv_transfer_group_composes_with_typed_options_outside_the_engine():
    from inferlab.conf import compose, engine_arguments, flat_choices

    cfg = compose(["kv_transfer=simulated", "kv_transfer.link=infiniband", "kv_transfer.timeout_s=5"])
    assert cfg.kv_transfer.name == "simulated" and cfg.kv_transfer.link == "infiniband"
    assert "kv_transfer" not in engine_arguments(cfg)[1]
    assert flat_choices(cfg)["kv_transfer.timeout_s"] == 5
    assert compose().kv_transfer.name == "auto"
    with pytest.raises(Exception, match="kv_transfer.link must be one of \\['infiniband', 'nvlink'\\], got 'pcie'"):
        get_registry().create("kv_transfer", "simulated", options={"link": "pcie"})


def test_run_records_summarize_each_requests_move():
    from inferlab.experiment.driver import request_record
    from inferlab.experiment.latency import latency_figures

    a, b = pair()
    _, requests = disaggregated(a, b, make_prompts(count=5))
    records = [request_record(r, 0.0) for r in requests]
    figures = latency_figures(records, wall_time_s=10.0, slo_ttft_s=100.0, slo_tpot_s=100.0)
    moves = sorted(r.kv_transfer_s for r in requests)
    assert figures["num_kv_transfers"] == 5 and figures["kv_transfer_bytes"] == b.stats.kv_bytes_received
    assert figures["kv_transfer_s"]["p50"] == pytest.approx(moves[2]) and figures["kv_transfer_s"]["p99"] <= moves[-1]
    assert figures["goodput"] == pytest.approx(0.5)
    colocated = [replace(record, kv_transfer_s=None, kv_transfer_bytes=0) for record in records]
    assert "kv_transfer_s" not in latency_figures(colocated, wall_time_s=10.0)  # no moves to summarize


def test_requests_jsonl_carries_a_move_only_where_there_was_one():
    from inferlab.experiment.latency import RequestRecord, request_line

    record = RequestRecord(0, 0.0, 0.1, 0.2, [0.2, 0.3], 0.3, num_prompt_tokens=5, num_output_tokens=2)
    assert "kv_transfer_s" not in request_line(record, 0)
    line = request_line(replace(record, kv_transfer_s=0.004, kv_transfer_bytes=4096), 0)
    assert line["kv_transfer_s"] == 0.004 and line["kv_transfer_bytes"] == 4096
