"""Conformance tests for a KV transfer plugin whose endpoints share a process, through its Protocol.

    from inferlab.testing import KVTransferSuite

    class TestMyTransfer(KVTransferSuite):
        kv_transfer = "my_transfer"      # the name it is registered under
        kv_transfer_options = {}          # its options, if any
        moves_data = True                 # False for one that only times moves (a simulation)

Over runners of numbered blocks on the CPU, with clocks the suite moves, it checks that every move
is reported exactly once at each side with what it moved, in any order of sends and receives, that
a receive of no blocks still ends, that a receiver's cancel releases the sender, and that polling
never blocks; then it joins a prefill engine and a decode engine on the embedded tiny model and
checks their greedy outputs against one engine's.
"""

import random
from time import perf_counter

import torch

from inferlab.core.plugins import get_registry
from inferlab.core.protocols import KVMove, KVMoveEnded

BLOCK_BYTES = 64


class BlockRunner:
    """A runner (the members a transfer reads: clock, wait_until, KVBlockStore, KVBlockBytes) whose
    cache is num_blocks rows of BLOCK_BYTES bytes, each block's bytes telling which block it is."""

    runs_ahead = False
    checkpoint = None

    def __init__(self, endpoint: int, num_blocks: int = 64):
        self.num_kv_blocks = num_blocks
        self.kv_block_bytes = BLOCK_BYTES
        self.device = torch.device("cpu")
        self.cache = torch.zeros(num_blocks, BLOCK_BYTES, dtype=torch.uint8)
        for block in range(num_blocks):
            self.cache[block] = (endpoint * 101 + block) % 251
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def wait_until(self, t: float) -> None:
        self.now = max(self.now, t)

    def launch(self, batch):
        raise NotImplementedError("the suite's runners hold blocks, they run no steps")

    def close(self) -> None:
        pass

    def read_kv_blocks(self, blocks: list[int]) -> torch.Tensor:
        return self.cache[torch.tensor(blocks, dtype=torch.long)].clone()

    def write_kv_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        self.cache[torch.tensor(blocks, dtype=torch.long)] = data

    def empty_kv_blocks(self, num_blocks: int) -> torch.Tensor:
        return torch.empty(num_blocks, BLOCK_BYTES, dtype=torch.uint8)


class KVTransferSuite:
    """Subclass with `kv_transfer` (a registered name) and optionally `kv_transfer_options` and
    `moves_data`; pytest collects the subclass's tests."""

    kv_transfer: str = "local"
    kv_transfer_options: dict = {}
    moves_data: bool = True
    executor: str = "real"  # what the engines of test_serves_two_engines run on
    executor_options: dict = {}

    def make(self, num_endpoints: int = 2):
        transfer = get_registry().create("kv_transfer", self.kv_transfer, options=self.kv_transfer_options)
        runners = [BlockRunner(endpoint) for endpoint in range(num_endpoints)]
        for endpoint, runner in enumerate(runners):
            transfer.attach(endpoint, runner, 16)
        return transfer, runners

    @staticmethod
    def drain(transfer, runners, expected: dict[int, set[int]], rounds: int = 10_000) -> dict[int, list[KVMoveEnded]]:
        """Polls every endpoint until each has reported the moves expected of it (endpoint -> request
        ids), waiting when one has none new; the clocks move to the latest as moves end."""
        reported: dict[int, list[KVMoveEnded]] = {endpoint: [] for endpoint in expected}
        started = perf_counter()
        for _ in range(rounds):
            if all({e.move.request_id for e in reported[ep]} >= ids for ep, ids in expected.items()):
                return reported
            for endpoint in expected:
                ended = transfer.poll(endpoint)
                reported[endpoint] += ended
                if not ended and {e.move.request_id for e in reported[endpoint]} < expected[endpoint]:
                    transfer.wait(endpoint)
            latest = max(r.clock() for r in runners)
            for runner in runners:  # a sender's clock follows its receivers', as a cluster's events do
                runner.wait_until(latest)
            assert perf_counter() - started < 60, "moves did not end within 60 s"
        raise AssertionError(f"moves not reported after {rounds} polls: {reported}")

    def test_moves_are_reported_once_at_each_side_with_what_they_moved(self):
        transfer, runners = self.make(3)
        rng = random.Random(0)
        moves, expected_data = [], {}
        free = {endpoint: list(range(64)) for endpoint in range(3)}
        for request_id in range(12):
            sender, receiver = rng.sample(range(3), 2)
            move = KVMove(request_id, sender, receiver)
            sent = [free[sender].pop(rng.randrange(len(free[sender]))) for _ in range(rng.randrange(1, 5))]
            first = rng.randrange(len(sent))
            received = [free[receiver].pop(rng.randrange(len(free[receiver]))) for _ in range(len(sent) - first)]
            expected_data[request_id] = (receiver, received, runners[sender].read_kv_blocks(sent[first:]))
            if rng.random() < 0.3:  # a receiver may ask first
                transfer.receive(move, received, first)
                transfer.send(move, sent)
            else:
                transfer.send(move, sent)
                transfer.receive(move, received, first)
            moves.append(move)
        expected = {endpoint: set() for endpoint in range(3)}
        for move in moves:
            expected[move.sender].add(move.request_id)
            expected[move.receiver].add(move.request_id)
        reported = self.drain(transfer, runners, expected)
        for endpoint, ended in reported.items():
            ids = [e.move.request_id for e in ended]
            assert sorted(ids) == sorted(expected[endpoint]), f"endpoint {endpoint} reported {ids}"
            for e in ended:
                assert isinstance(e, KVMoveEnded) and e.error is None, e
                assert e.move == moves[e.move.request_id] and e.seconds >= 0
        for e in reported[1] + reported[0] + reported[2]:
            receiver, received, data = expected_data[e.move.request_id]
            assert e.num_bytes == len(received) * BLOCK_BYTES
            if self.moves_data and e.move.receiver == receiver:
                assert torch.equal(runners[receiver].read_kv_blocks(received), data), f"{e.move} moved other bytes"
        for endpoint in range(3):
            assert transfer.poll(endpoint) == [], "a move was reported twice"
        transfer.close()

    def test_a_receive_of_no_blocks_ends_at_both_sides(self):
        transfer, runners = self.make()
        move = KVMove(7, 0, 1)
        transfer.send(move, [3, 4])
        transfer.receive(move, [], 2)  # the receiver's prefix cache held both blocks
        reported = self.drain(transfer, runners, {0: {7}, 1: {7}})
        assert all(e.error is None and e.num_bytes == 0 for side in reported.values() for e in side)
        transfer.close()

    def test_a_receivers_cancel_releases_the_sender(self):
        transfer, runners = self.make()
        move = KVMove(3, 0, 1)
        transfer.send(move, [1, 2])
        transfer.receive(move, [5, 6], 0)
        transfer.cancel(move, 1)
        reported = self.drain(transfer, runners, {0: {3}})
        assert [e.move for e in reported[0]] == [move]
        for _ in range(3):
            assert transfer.poll(1) == [], "a move cancelled at the receiver was reported there"
        transfer.close()

    def test_polling_an_endpoint_with_nothing_in_flight_returns_at_once(self):
        transfer, _ = self.make()
        start = perf_counter()
        assert transfer.poll(0) == [] and transfer.poll(1) == []
        assert perf_counter() - start < 1.0
        transfer.close()

    def test_serves_two_engines(self):
        """A prefill engine and a decode engine on the embedded tiny model, joined by the transfer:
        every request gets its max_tokens, with a lone engine's greedy tokens when data moves, and
        both caches end empty."""
        from inferlab import LLM, SamplingParams

        rng = random.Random(1)
        prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 70))] for _ in range(6)]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        settings = dict(
            device="cpu",
            kvcache_block_size=16,
            num_kvcache_blocks=24,
            executor=self.executor,
            executor_options=self.executor_options,
        )
        transfer = get_registry().create("kv_transfer", self.kv_transfer, options=self.kv_transfer_options)
        prefill, decode = LLM(**settings), LLM(**settings)
        prefill.connect_kv_transfer(transfer, 0)
        decode.connect_kv_transfer(transfer, 1)
        requests, outputs = [], {}
        for prompt in prompts:
            request = prefill.make_request(prompt, params)
            request.kv_send = KVMove(request.request_id, 0, 1)
            prefill.queue(request)
            requests.append(request)
        for _ in range(10_000):
            if prefill.is_finished() and decode.is_finished():
                break
            for request in prefill.step().finished:
                assert request.finish_reason == "handoff", request.finish_reason
                request.kv_send, request.kv_receive = None, KVMove(request.request_id, 0, 1)
                decode.queue(request)
            for request in decode.step().finished:
                outputs[request.request_id] = decode.output(request)
            prefill.wait_until(decode.clock())
            prefill.poll_kv_transfer()
        assert len(outputs) == len(prompts), f"{len(prompts) - len(outputs)} requests never finished"
        for request in requests:
            out = outputs[request.request_id]
            assert out["finish_reason"] == "length" and len(out["token_ids"]) == 6, out
        for engine in (prefill, decode):
            assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks, "blocks were left held"
        if self.moves_data:
            with LLM(**settings) as alone:
                expected = alone.generate(prompts, params, use_tqdm=False)
            assert [outputs[r.request_id]["token_ids"] for r in requests] == [e["token_ids"] for e in expected]
        for engine in (prefill, decode):
            engine.close()
        transfer.close()
