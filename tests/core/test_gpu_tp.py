"""On two CUDA GPUs (the device tool's nvidia-h200-x2): tensor_parallel_size=2 over NCCL against
one rank, on the GPU tests' small random Qwen3 in bfloat16 (4 query heads and 1 KV head a rank):
teacher-forced logits (chunked prefill, a cached prefix, ragged decode batches) and free greedy
generations, with and without CUDA graphs; rank 1 really on cuda:1; a worker killed
mid-generation, reported by rank within seconds, after which a new engine runs on the same GPUs;
a worker stopped (SIGSTOP), named within tp_step_timeout_s; and Ctrl-C, after which both ranks
serve on.

Run: python -m pytest -m gpu -rP tests/core/test_gpu_tp.py (-rP prints the measured logit errors)."""

import gc
import importlib.util
import os
import signal

import pytest
import torch
from logit_compare import (
    CACHE_TOKENS,
    ENGINE,
    LOGITS_RTOL,
    SHAPE,
    RecordingSampler,
    assert_diverged_only_at_near_ties,
    logits_errors,
    make_requests,
)
from worker_processes import alive, assert_nothing_left, child_pids, prompts_of, run_until_failure, shm_entries

from inferlab import LLM, SamplingParams
from inferlab.core.workers import TensorParallelRunner
from inferlab.tiny_model import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

needs_flash_attn = pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None, reason="flash_attn is not importable"
)
BLOCK_SIZE = 256
# (model, attention backend, enforce_eager)
CASES = [
    pytest.param(("tied", "triton", False), id="tied-triton-graphs"),
    pytest.param(("tied", "triton", True), id="tied-triton-eager"),
    pytest.param(("untied", "triton", False), id="untied-triton-graphs"),
    pytest.param(("tied", "flash_attn", False), id="tied-flash_attn-graphs", marks=needs_flash_attn),
]


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-tp-models")
    return {
        "tied": make_checkpoint(str(root / "tied"), seed=0, **SHAPE),
        "untied": make_checkpoint(str(root / "untied"), seed=1, **{**SHAPE, "tie_word_embeddings": False}),
    }


@pytest.fixture(scope="module")
def workload(model_paths):
    from transformers import AutoConfig

    return make_requests(AutoConfig.from_pretrained(model_paths["tied"]).vocab_size)


def gpu_bytes_in_use(index: int) -> int:
    free, total = torch.cuda.mem_get_info(index)
    return total - free


def run_engine(path, workload, attention, enforce_eager, ranks, sampler=None):
    """Token ids generated for both request groups (the second hits the prefix cache), in order."""
    on_gpu1_before = gpu_bytes_in_use(1)
    llm = LLM(
        path,
        attention=attention,
        kvcache_block_size=BLOCK_SIZE,
        enforce_eager=enforce_eager,
        num_kvcache_blocks=CACHE_TOKENS // BLOCK_SIZE,
        tensor_parallel_size=ranks,
        **ENGINE,
    )
    try:
        assert isinstance(llm.runner, TensorParallelRunner) == (ranks > 1)
        model_runner = llm.runner.model_runner if ranks > 1 else llm.runner  # rank 0's
        assert model_runner.backend.name == attention
        assert (model_runner.decode_graphs is not None) == (not enforce_eager)
        if ranks > 1:  # rank 1 holds its weights and KV cache on the second GPU
            assert gpu_bytes_in_use(1) - on_gpu1_before > 100 * 2**20
        if sampler is not None:
            model_runner.sampler = sampler  # rank 0 samples; the others take its samples
        outputs = []
        for group in workload:
            prompts, params = zip(*group)
            outputs += llm.generate(list(prompts), list(params), use_tqdm=False)
        assert not llm.scheduler.has_unfinished()
        if ranks > 1:
            assert llm.kv_manager.prefix_cache_stats()[0] >= 2 * BLOCK_SIZE  # the shared prefix, on every rank
        return [o["token_ids"] for o in outputs]
    finally:
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module", params=CASES)
def one_rank(request, model_paths, workload):
    """The case's engine on one rank, greedy: its logits and tokens at every sampled (seed, step)."""
    model, attention, enforce_eager = request.param
    sampler = RecordingSampler()
    tokens = run_engine(model_paths[model], workload, attention, enforce_eager, 1, sampler)
    forced = {key: int(row.argmax()) for key, row in sampler.logits.items()}
    return request.param, sampler.logits, forced, tokens


def test_two_ranks_logits_match_one_rank(model_paths, workload, one_rank):
    (model, attention, enforce_eager), expected, forced, _ = one_rank
    sampler = RecordingSampler(forced)
    run_engine(model_paths[model], workload, attention, enforce_eager, 2, sampler)
    first, second = workload
    prompt_steps = {(p.seed, len(prompt)) for prompt, p in first + second}  # first token: sampled by prefill
    errors = logits_errors(sampler.logits, expected, prompt_steps)
    for phase, values in errors.items():
        print(
            f"{model} {attention} {'eager' if enforce_eager else 'graphs'} {phase}: {len(values)} rows, relative "
            f"logits error of 2 ranks vs 1 max {max(values):.4f} mean {sum(values) / len(values):.4f}"
        )
    assert errors["prefill"] and errors["decode"]
    worst = {phase: max(values) for phase, values in errors.items()}
    assert max(worst.values()) <= LOGITS_RTOL, f"two ranks' logits differ from one rank's: {worst}"


def test_two_ranks_greedy_generations_agree(model_paths, workload, one_rank):
    (model, attention, enforce_eager), expected_logits, _, expected_tokens = one_rank
    got_tokens = run_engine(model_paths[model], workload, attention, enforce_eager, 2)
    diverged = assert_diverged_only_at_near_ties(workload, got_tokens, expected_tokens, expected_logits)
    print(
        f"{model} {attention} {'eager' if enforce_eager else 'graphs'}: {len(got_tokens) - len(diverged)}/"
        f"{len(got_tokens)} identical to one rank; near-tie divergences (seed, token, margin, bound): {diverged}"
    )


def test_killed_worker_names_its_rank_and_the_gpus_serve_a_new_engine(model_paths):
    """On CUDA rank 0 may be waiting inside an NCCL collective when its peer dies: the watchdog
    aborts the communicator, so the error comes within seconds, not at NCCL's timeout."""
    settings = dict(kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=CACHE_TOKENS // BLOCK_SIZE, **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = prompts_of([6, 9, 40])
    children_before, shm_before = child_pids(), shm_entries()
    llm = LLM(model_paths["tied"], tensor_parallel_size=2, **settings)
    expected = llm.generate(prompts, greedy, use_tqdm=False)
    pids = llm.runner.workers.pids
    assert all(alive(pid) for pid in pids)
    error, seconds = run_until_failure(llm, lambda: os.kill(pids[0], signal.SIGKILL))
    print(f"killed rank 1; {seconds:.2f} s later rank 0 raised: {str(error).splitlines()[0]}")
    assert f"rank 1 (pid {pids[0]}) was killed by signal SIGKILL" in str(error)
    assert seconds < 10
    assert_nothing_left(llm, pids, children_before, shm_before)
    llm.close()
    del llm
    gc.collect()
    with LLM(model_paths["tied"], tensor_parallel_size=2, **settings) as again:
        assert again.generate(prompts, greedy, use_tqdm=False) == expected


def test_stopped_worker_is_named_within_the_step_timeout(model_paths):
    """A worker stopped with SIGSTOP leaves rank 0 waiting on its GPU for a collective that never
    completes: the hang watch names it once a step has run tp_step_timeout_s, and kills it."""
    settings = dict(kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=CACHE_TOKENS // BLOCK_SIZE, **ENGINE)
    children_before, shm_before = child_pids(), shm_entries()
    llm = LLM(model_paths["tied"], tensor_parallel_size=2, tp_step_timeout_s=3.0, **settings)
    pids = llm.runner.workers.pids
    error, seconds = run_until_failure(llm, lambda: os.kill(pids[0], signal.SIGSTOP))
    print(f"stopped rank 1; {seconds:.2f} s later rank 0 raised: {str(error).splitlines()[0]}")
    assert f"rank 1 (pid {pids[0]}) did not finish a step within tp_step_timeout_s=3 s: it is stopped" in str(error)
    assert seconds < 15
    assert_nothing_left(llm, pids, children_before, shm_before)


def test_ctrl_c_leaves_the_two_ranks_usable(model_paths):
    """A real SIGINT during generate on two GPUs: the call raises KeyboardInterrupt once the ranks
    have finished the step, the workers live on, and the engine gives the same tokens again."""
    import threading
    import time

    settings = dict(kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=CACHE_TOKENS // BLOCK_SIZE, **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompts = prompts_of([6, 9, 40])
    with LLM(model_paths["tied"], tensor_parallel_size=2, **settings) as llm:
        expected = llm.generate(prompts, greedy, use_tqdm=False)
        pids = llm.runner.workers.pids
        for after_steps in (0, 5, 50):
            start = llm.stats.num_steps

            def interrupt(start=start, after_steps=after_steps):
                while not llm.requests or llm.stats.num_steps < start + after_steps:
                    time.sleep(0.0005)
                os.kill(os.getpid(), signal.SIGINT)

            thread = threading.Thread(target=interrupt, daemon=True)
            thread.start()
            with pytest.raises(KeyboardInterrupt):
                llm.generate(prompts, greedy, use_tqdm=False)
                time.sleep(5)
            thread.join()
            assert all(alive(pid) for pid in pids) and not llm.runner.closed_because
            assert llm.generate(prompts, greedy, use_tqdm=False) == expected
