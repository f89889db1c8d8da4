"""Traces: the Mooncake JSONL and Azure CSV formats parse, time scaling and request limits apply, and
requests that share Mooncake hash ids share those blocks' tokens, hence prefix-cache hits."""

import json
import math
import os
from datetime import datetime, timezone

import numpy as np
import pytest

from inferlab.conf import BenchConfig
from inferlab.conf.bench import detect_trace_format
from inferlab.experiment.traces import (
    HEAD_TOKENS,
    MOONCAKE_BLOCK_SIZE,
    RUN_LENGTH,
    TOKEN_ID_RANGE,
    parse_azure_timestamp,
    read_trace,
    trace_prompt,
)
from inferlab.experiment.workload import build_workload

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
MOONCAKE = os.path.join(DATA, "mooncake_conversation_200.jsonl")
AZURE = os.path.join(DATA, "azure_llm_inference_tiny.csv")


def test_the_mooncake_excerpt_parses_line_for_line():
    lines = [json.loads(line) for line in open(MOONCAKE)]
    trace_format, requests = read_trace(MOONCAKE)
    assert trace_format == "mooncake" == detect_trace_format(MOONCAKE)
    assert len(requests) == len(lines) == 200
    for request, line in zip(requests, lines):
        assert request.arrival_s == line["timestamp"] / 1000
        assert (request.input_length, request.output_length) == (line["input_length"], line["output_length"])
        assert request.hash_ids == line["hash_ids"]
    assert requests[-1].arrival_s == 72.0


def test_the_azure_csv_parses_with_its_100ns_timestamps():
    trace_format, requests = read_trace(AZURE)
    assert trace_format == "azure"
    # seconds after 18:15:46.6805900, by hand
    expected = [0.0, 0.1504690, 0.3194100, 2.5694100, 13.3194099, 14.8194100]
    assert [r.arrival_s for r in requests] == pytest.approx(expected, abs=1e-9)
    assert [(r.input_length, r.output_length) for r in requests] == [
        (374, 44),
        (396, 109),
        (879, 0),
        (91, 250),
        (1500, 12),
        (2048, 7),
    ]
    assert all(r.hash_ids is None for r in requests)


def test_azure_timestamps_with_and_without_an_offset():
    whole, fraction = parse_azure_timestamp("2023-11-16 18:15:46.6805900")
    assert whole == int(datetime(2023, 11, 16, 18, 15, 46, tzinfo=timezone.utc).timestamp())
    assert fraction == pytest.approx(0.68059)
    plus_two = parse_azure_timestamp("2024-05-10 00:00:00.009930+02:00")
    assert plus_two[0] == int(datetime(2024, 5, 9, 22, 0, 0, tzinfo=timezone.utc).timestamp())
    assert plus_two[1] == pytest.approx(0.00993)
    with pytest.raises(ValueError, match="not a date-time like"):
        parse_azure_timestamp("16/11/2023 18:15")


def test_time_scale_and_max_requests(tmp_path):
    base = BenchConfig(arrival="trace", trace=MOONCAKE)
    full = build_workload(base, vocab_size=50_000, max_model_len=200_000)
    fast = build_workload(
        BenchConfig(arrival="trace", trace=MOONCAKE, time_scale=0.5, max_requests=20), 50_000, 200_000
    )
    assert len(full.requests) == 200 and len(fast.requests) == 20
    assert [r.arrival_s for r in fast.requests] == [0.5 * r.arrival_s for r in full.requests[:20]]
    assert full.num_fitted == 0 and full.summary()["trace_format"] == "mooncake"
    assert full.summary()["offered_request_rate"] == pytest.approx(199 / 72.0)
    assert [len(r.prompt_token_ids) for r in full.requests] == [r.input_length for r in read_trace(MOONCAKE)[1]]


def test_azure_workload_fits_lengths_and_counts_the_changed_requests():
    workload = build_workload(BenchConfig(arrival="trace", trace=AZURE), vocab_size=384, max_model_len=1024)
    lengths = [(len(r.prompt_token_ids), r.output_len) for r in workload.requests]
    # 879+0: output raised to 1; 1500 and 2048: prompt cut to 1023, output to what is left
    assert lengths == [(374, 44), (396, 109), (879, 1), (91, 250), (1023, 1), (1023, 1)]
    assert workload.num_fitted == 3
    assert all(0 <= t < 384 for r in workload.requests for t in r.prompt_token_ids)
    prompts = [tuple(r.prompt_token_ids[:64]) for r in workload.requests]
    assert len(set(prompts)) == len(prompts)  # no hash ids: every prompt is its own


def test_shared_hash_ids_give_shared_token_blocks():
    bs = MOONCAKE_BLOCK_SIZE

    def prompt(hash_ids, length, index):
        return trace_prompt(hash_ids, length, bs, index, seed=0, vocab_size=50_000)

    a = prompt([0, 1, 2], 1300, 0)  # the last block partial: 276 tokens of block 2
    b = prompt([0, 1, 3], 1100, 1)
    c = prompt([5, 1], 1024, 2)
    assert len(a) == 1300 and len(b) == 1100
    assert a[: 2 * bs] == b[: 2 * bs]  # blocks 0 and 1
    assert a[2 * bs : 1100] != b[2 * bs :]  # block 2 against block 3
    assert c[bs:] == a[bs : 2 * bs]  # block 1 has the same tokens wherever it appears
    assert c[:bs] != a[:bs]
    assert prompt([0, 1, 2], 1300, 9) == a  # a pure function of the ids, not of the request
    assert trace_prompt([0], 100, bs, 0, seed=1, vocab_size=50_000) != a[:100]  # the seed changes contents
    # tokens past the listed blocks are the request's own
    longer = prompt([0], 700, 3)
    assert longer[:bs] == a[:bs] and longer[bs:] != prompt([0], 700, 4)[bs:]
    # a block cache shared across prompts changes nothing, and no prompt can change the cache
    shared: dict = {}
    cached = [trace_prompt(ids, n, bs, i, 0, 50_000, shared) for ids, n, i in [([0, 1, 2], 1300, 0), ([5, 1], 1024, 2)]]
    assert cached == [a, c] and sorted(shared) == [0, 1, 2, 5]
    cached[0][0] = -1
    assert trace_prompt([0], 10, bs, 0, 0, 50_000, shared) == a[:10]


def test_distinct_hash_ids_differ_in_their_first_tokens():
    # A block is its key's own head and a window of a shared run: two keys must part at the head,
    # or the prefix cache would join requests that share no hash id.
    prompts = [trace_prompt([h], MOONCAKE_BLOCK_SIZE, MOONCAKE_BLOCK_SIZE, 0, 0, 151_936) for h in range(20_000)]
    assert len({tuple(p[:HEAD_TOKENS]) for p in prompts}) == len(prompts)
    assert all(len(p) == MOONCAKE_BLOCK_SIZE and 0 <= min(p) and max(p) < TOKEN_ID_RANGE for p in prompts)
    # ids are drawn evenly over the range, not stuck in a corner of it
    counts = np.bincount(np.concatenate(prompts), minlength=TOKEN_ID_RANGE)
    assert counts.min() > 0.5 * counts.mean() and counts.max() < 1.5 * counts.mean()


def test_a_prompt_longer_than_the_shared_run_goes_on_from_its_start():
    prompt = trace_prompt(None, RUN_LENGTH + 1000, MOONCAKE_BLOCK_SIZE, 7, 0, 151_936)
    assert len(prompt) == RUN_LENGTH + 1000
    assert prompt == trace_prompt(None, RUN_LENGTH + 1000, MOONCAKE_BLOCK_SIZE, 7, 0, 151_936)
    # a long trace's prompts hold one int object per id value, not one per token
    assert len({id(t) for t in prompt}) <= TOKEN_ID_RANGE


def test_the_excerpt_shares_its_system_prompt_block():
    workload = build_workload(BenchConfig(arrival="trace", trace=MOONCAKE), vocab_size=151_936, max_model_len=4096)
    first_blocks = {tuple(r.prompt_token_ids[:MOONCAKE_BLOCK_SIZE]) for r in workload.requests}
    assert len(first_blocks) == 1  # every request opens with hash id 0
    assert all(len(r.prompt_token_ids) <= 4095 for r in workload.requests)


def test_scaled_blocks_stay_shared():
    workload = build_workload(
        BenchConfig(arrival="trace", trace=MOONCAKE, fit="scale", max_requests=30), vocab_size=384, max_model_len=512
    )
    block = math.ceil(MOONCAKE_BLOCK_SIZE * workload.length_scale)
    assert 1 <= block < MOONCAKE_BLOCK_SIZE
    assert len({tuple(r.prompt_token_ids[:block]) for r in workload.requests}) == 1


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"timestamp": 0, "input_length": 5}\n', r"needs Mooncake's keys .*lacks \['output_length'\]"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{not json\n', "line 2 is not JSON"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1}\n', "timestamp must be finite non-negative"),
        ('{"timestamp": 0, "input_length": 5.5, "output_length": 1}\n', "input_length must be a non-negative integer"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]}\n', "hash_ids must be"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,1\n", "line 2: 'yesterday' is not a date-time"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "holds no requests"),
        # Python's json reads NaN and Infinity: a NaN arrival hung the run, an infinite length raised OverflowError
        ('{"timestamp": NaN, "input_length": 5, "output_length": 1}\n', "line 1: timestamp must be finite"),
        ('{"timestamp": 0, "input_length": Infinity, "output_length": 1}\n', "line 1: input_length must be a non"),
        ('{"timestamp": 0, "input_length": 1e400, "output_length": 1}\n', "line 1: input_length must be a non"),
        ('{"timestamp": 0, "input_length": 5, "output_length": NaN}\n', "line 1: output_length must be a non"),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [18446744073709551616]}\n',
            r"\[0, 2\*\*64\)",
        ),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,inf,1\n", "line 2: ContextTokens must be"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5\n", "line 2: a row needs exactly the col"),
    ],
)
def test_bad_trace_files_name_the_line(tmp_path, content, message):
    path = tmp_path / "trace"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_trace(str(path))


def test_shared_hash_ids_give_prefix_cache_hits(tmp_path, one_torch_thread):
    from inferlab import LLM, SamplingParams

    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]},
        {"timestamp": 10, "input_length": 700, "output_length": 2, "hash_ids": [0, 2]},
        {"timestamp": 20, "input_length": 300, "output_length": 2, "hash_ids": [3]},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with LLM(device="cpu", kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=1024) as llm:
        bench = BenchConfig(arrival="trace", trace=str(trace))
        workload = build_workload(bench, llm.hf_config.vocab_size, llm.config.max_model_len)
        hits = []
        for request in workload.requests:  # one at a time, as their arrivals are far apart
            before = llm.kv_manager.prefix_cache_stats()[0]
            outputs = llm.generate(
                [request.prompt_token_ids],
                SamplingParams(max_tokens=request.output_len, ignore_eos=True),
                use_tqdm=False,
            )
            assert len(outputs[0]["token_ids"]) == 2
            hits.append(llm.kv_manager.prefix_cache_stats()[0] - before)
    assert hits == [0, MOONCAKE_BLOCK_SIZE, 0]  # the second reuses block 0, 32 cache blocks of 16
