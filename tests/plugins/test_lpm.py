"""The lpm scheduler: waiting requests ordered by cached prefix length, FCFS when nothing is
cached, and fewer prefill tokens than FCFS on a shared-prefix workload that outgrows the cache."""

from itertools import count

import pytest

from inferlab import LLM
from inferlab.conf import compose, engine_arguments
from inferlab.core.config import EngineConfig
from inferlab.core.plugins import PluginError, get_registry
from inferlab.core.request import Request
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.scheduler import Scheduler
from inferlab.experiment.bench import measure
from inferlab.experiment.workload import build_workload
from inferlab.plugins.kv_cache.paged import PagedKVCache
from inferlab.plugins.schedulers.lpm import LPMOptions, LPMPolicy

BLOCK = 4
PREFIX = list(range(100, 112))  # three blocks
ids = count()


def make(num_blocks=64, max_sort_waiting=1024, **settings):
    config = EngineConfig(kvcache_block_size=BLOCK, **settings)
    kv = PagedKVCache(config, num_blocks)
    policy = LPMPolicy(max_sort_waiting=max_sort_waiting)
    return Scheduler(config, kv, policy, policy_name="lpm", clock=lambda: 0.0, decode=str), kv


def cache(kv, token_ids):
    """Computes a request's tokens and frees it, leaving its full blocks in the prefix cache."""
    request = Request(next(ids), token_ids, SamplingParams())
    assert kv.allocate(request, len(token_ids))
    request.num_computed_tokens = len(token_ids)
    kv.commit(request)
    kv.free(request)


def add_requests(scheduler):
    """Adds, in this arrival order, requests with none cached, 4 cached, 8 cached, none cached,
    8 cached; returns them by name."""
    requests = {
        "cold1": [1, 2, 3, 4, 5, 6, 7],
        "one_block": PREFIX[:4] + [7, 7, 7, 7, 7],
        "two_blocks": PREFIX[:8] + [8, 8],
        "cold2": [9, 9, 9],
        "two_blocks_later": PREFIX[:8] + [5, 5, 5, 5, 5, 5],
    }
    requests = {name: Request(next(ids), tokens, SamplingParams()) for name, tokens in requests.items()}
    for request in requests.values():
        scheduler.add(request)
    return requests


def admission_order(scheduler, requests):
    names = {r.request_id: name for name, r in requests.items()}
    order = scheduler.policy.admission_order(tuple(r.view for r in scheduler.waiting), scheduler.state(0.0))
    return [names[view.request_id] for view in order]


def test_registered_with_its_options():
    entry = get_registry().get("scheduler", "lpm")
    assert entry.factory is LPMPolicy and entry.options is LPMOptions


def test_orders_waiting_by_cached_prefix_length_stably():
    scheduler, kv = make()
    cache(kv, PREFIX)
    requests = add_requests(scheduler)
    assert [r.view.num_cached_prefix_tokens for r in requests.values()] == [0, 4, 8, 0, 8]
    assert admission_order(scheduler, requests) == ["two_blocks", "two_blocks_later", "one_block", "cold1", "cold2"]


def test_schedule_admits_the_longest_cached_prefix_first():
    scheduler, kv = make(max_num_seqs=1)
    cache(kv, PREFIX)
    requests = add_requests(scheduler)
    batch = scheduler.schedule()
    assert batch.requests == [requests["two_blocks"]]
    assert batch.num_scheduled_tokens == [2]  # only the two uncached tokens are computed
    assert requests["two_blocks"].num_cached_tokens == 8


def test_nothing_cached_or_a_long_queue_keeps_queue_order():
    scheduler, kv = make()
    requests = add_requests(scheduler)
    assert admission_order(scheduler, requests) == list(requests)
    scheduler, kv = make(max_sort_waiting=3)
    cache(kv, PREFIX)
    requests = add_requests(scheduler)  # five waiting > max_sort_waiting
    assert admission_order(scheduler, requests) == list(requests)


def test_rejects_a_bad_option():
    with pytest.raises(PluginError, match="lpm's max_sort_waiting must be >= 0, got -1"):
        get_registry().create("scheduler", "lpm", options={"max_sort_waiting": -1})
    with pytest.raises(PluginError, match="Key 'include_prompt' not in 'LPMOptions'.*max_sort_waiting=1024"):
        LLM(device="cpu", scheduler="lpm", scheduler_options={"include_prompt": "no"})


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
        workload = build_workload(cfg.bench, llm.hf_config.vocab_size, llm.config.max_model_len)
        params = workload.sampling_params(cfg.bench)
        figures[scheduler], _ = measure(llm, workload.requests, params)
    fcfs, lpm = figures["fcfs"], figures["lpm"]
    assert fcfs["num_output_tokens"] == lpm["num_output_tokens"] == sum(p.max_tokens for p in params)
    assert lpm["num_prefill_tokens"] < 0.85 * fcfs["num_prefill_tokens"]
    assert lpm["prefix_cache_hit_rate"] > fcfs["prefix_cache_hit_rate"]
