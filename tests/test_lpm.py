"""The lpm scheduler: waiting requests ordered by cached prefix length, FCFS when nothing is
cached, and fewer prefill tokens than FCFS on a shared-prefix workload that outgrows the cache."""

import pytest

from inferlab import LLM
from inferlab.bench import bench_workload, measure
from inferlab.conf import compose, engine_arguments
from inferlab.core.config import EngineConfig
from inferlab.core.plugins import get_registry
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.sequence import Sequence
from inferlab.plugins.kv_cache.paged import PagedKVCache
from inferlab.plugins.schedulers.lpm import LPMScheduler

BLOCK = 4
PREFIX = list(range(100, 112))  # three blocks


def make(num_blocks=64, max_sort_waiting=1024, **settings):
    config = EngineConfig(kvcache_block_size=BLOCK, **settings)
    kv = PagedKVCache(config, num_blocks)
    return LPMScheduler(config, kv, max_sort_waiting=max_sort_waiting), kv


def cache(kv, token_ids):
    """Computes a request's tokens and frees it, leaving its full blocks in the prefix cache."""
    seq = Sequence(token_ids, SamplingParams())
    assert kv.allocate(seq, len(token_ids))
    seq.num_computed_tokens = len(token_ids)
    kv.commit(seq)
    kv.free(seq)


def add_requests(scheduler):
    """Adds, in this arrival order, requests with none cached, 4 cached, 8 cached, none cached,
    8 cached; returns them by name."""
    seqs = {
        "cold1": Sequence([1, 2, 3, 4, 5, 6, 7], SamplingParams()),
        "one_block": Sequence(PREFIX[:4] + [7, 7, 7, 7, 7], SamplingParams()),
        "two_blocks": Sequence(PREFIX[:8] + [8, 8], SamplingParams()),
        "cold2": Sequence([9, 9, 9], SamplingParams()),
        "two_blocks_later": Sequence(PREFIX[:8] + [5, 5, 5, 5, 5, 5], SamplingParams()),
    }
    for seq in seqs.values():
        scheduler.add(seq)
    return seqs


def order(scheduler, seqs):
    names = {id(seq): name for name, seq in seqs.items()}
    return [names[id(seq)] for seq in scheduler.waiting]


def test_registered_with_its_options():
    registry = get_registry()
    assert registry.get("scheduler", "lpm").factory is LPMScheduler
    assert [f for f in registry.config_nodes["scheduler", "lpm"].__dataclass_fields__] == ["max_sort_waiting"]


def test_orders_waiting_by_cached_prefix_length_stably():
    scheduler, kv = make()
    cache(kv, PREFIX)
    seqs = add_requests(scheduler)
    assert [kv.num_cached_prefix_tokens(s) for s in seqs.values()] == [0, 4, 8, 0, 8]
    scheduler.order_waiting()
    assert order(scheduler, seqs) == ["two_blocks", "two_blocks_later", "one_block", "cold1", "cold2"]


def test_schedule_admits_the_longest_cached_prefix_first():
    scheduler, kv = make(max_num_seqs=1)
    cache(kv, PREFIX)
    seqs = add_requests(scheduler)
    batch = scheduler.schedule()
    assert batch.seqs == [seqs["two_blocks"]]
    assert batch.num_scheduled_tokens == [2]  # only the two uncached tokens are computed
    assert seqs["two_blocks"].num_cached_tokens == 8


def test_nothing_cached_is_fcfs():
    scheduler, kv = make()
    seqs = add_requests(scheduler)
    scheduler.order_waiting()
    assert order(scheduler, seqs) == list(seqs)


def test_long_queue_or_full_batch_keeps_arrival_order():
    scheduler, kv = make(max_sort_waiting=3)
    cache(kv, PREFIX)
    seqs = add_requests(scheduler)
    scheduler.order_waiting()  # five waiting > max_sort_waiting
    assert order(scheduler, seqs) == list(seqs)

    scheduler, kv = make(max_num_seqs=1)
    cache(kv, PREFIX)
    running = Sequence([42, 43], SamplingParams())
    scheduler.add(running)
    scheduler.schedule()  # running is now full
    seqs = add_requests(scheduler)
    scheduler.order_waiting()
    assert order(scheduler, seqs) == list(seqs)


def test_rejects_a_bad_option():
    with pytest.raises(ValueError, match="lpm's max_sort_waiting must be an integer >= 0, got -1"):
        make(max_sort_waiting=-1)


def test_fewer_prefill_tokens_than_fcfs_in_the_prefix_ablation(checkpoint):
    """The experiment=prefix_ablation preset: 32 requests over 8 shared 128-token prefixes, a
    cache that holds about two. FCFS admits prefixes in random order and recomputes evicted ones;
    lpm serves the cached ones first."""
    figures = {}
    for scheduler in ("fcfs", "lpm"):
        cfg = compose(
            [
                "experiment=prefix_ablation",
                f"scheduler={scheduler}",
                f"model.path={checkpoint('gqa2-tied')}",
                "engine.device=cpu",
            ]
        )
        model_path, settings = engine_arguments(cfg)
        llm = LLM(model_path, **settings)
        prompts, params = bench_workload(cfg.bench, llm.hf_config.vocab_size, llm.config.max_model_len)
        figures[scheduler] = measure(llm, prompts, params, warmup=False)
    fcfs, lpm = figures["fcfs"], figures["lpm"]
    assert fcfs["num_output_tokens"] == lpm["num_output_tokens"] == sum(p.max_tokens for p in params)
    assert lpm["num_prefill_tokens"] < 0.85 * fcfs["num_prefill_tokens"]
    assert lpm["prefix_cache_hit_rate"] > fcfs["prefix_cache_hit_rate"]
