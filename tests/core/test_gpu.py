"""On a CUDA GPU: every attention backend, with and without CUDA graphs, against the torch backend
on a small random-weight model of each architecture in bfloat16 (head_dim 128, GQA 4; Qwen3 takes
its fused q/k norm + rotary kernel, Llama with llama3 rope scaling and Qwen2 with its q/k/v biases
the rotary-only one): teacher-forced logits on prefill (chunked, with a cached prefix) and decode
(ragged, padded graph batches), free greedy generations, the fp8 cache; then, on Qwen3,
attention=auto's choice and the KV cache sized from GPU memory.

Run: python -m pytest -m gpu -rP tests/core/test_gpu.py (-rP prints the measured logit errors)."""

import gc
import importlib.util
import logging
from collections import Counter

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

from inferlab import LLM, SamplingParams
from inferlab.tiny_model import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
needs_flash_attn = pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash_attn is not importable")

# (attention backend, KV block size): flash-attn pages need multiples of 256; triton takes any power of two
BACKENDS = [
    pytest.param("triton", 256, id="triton-256"),
    pytest.param("triton", 16, id="triton-16"),
    pytest.param("flash_attn", 256, id="flash_attn-256", marks=needs_flash_attn),
    pytest.param("torch", 256, id="torch-256"),
]
GRAPHS = [pytest.param(True, id="eager"), pytest.param(False, id="cuda-graphs")]


# make_checkpoint's settings over SHAPE for each architecture
ARCHITECTURES = {
    "qwen3": dict(architecture="Qwen3ForCausalLM"),
    "llama": dict(
        architecture="LlamaForCausalLM",
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=512,
        ),
    ),
    "qwen2": dict(architecture="Qwen2ForCausalLM"),
}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model_path(request, tmp_path_factory):
    """Each architecture in turn, for the comparisons against the torch backend."""
    settings = {**SHAPE, **ARCHITECTURES[request.param]}
    return make_checkpoint(str(tmp_path_factory.mktemp(f"gpu-{request.param}")), seed=0, **settings)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("gpu-qwen3")), seed=0, **SHAPE)


@pytest.fixture(scope="module")
def workload(model_path):
    from transformers import AutoConfig

    return make_requests(AutoConfig.from_pretrained(model_path).vocab_size)


def run_engine(path, workload, attention, block_size, enforce_eager, sampler=None, kv_cache_dtype="auto"):
    """Token ids generated for both request groups (the second after the first, so that it hits
    the prefix cache), in order."""
    llm = LLM(
        path,
        attention=attention,
        kvcache_block_size=block_size,
        enforce_eager=enforce_eager,
        num_kvcache_blocks=CACHE_TOKENS // block_size,
        kv_cache_dtype=kv_cache_dtype,
        **ENGINE,
    )
    try:
        assert llm.runner.backend.name == attention
        assert (llm.runner.decode_graphs is not None) == (not enforce_eager and llm.runner.backend.supports_cuda_graphs)
        if sampler is not None:
            llm.runner.sampler = sampler
        outputs = []
        for group in workload:
            prompts, params = zip(*group)
            outputs += llm.generate(list(prompts), list(params), use_tqdm=False)
        assert not llm.scheduler.has_unfinished()
        return [o["token_ids"] for o in outputs]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def reference(model_path, workload):
    """The torch backend, eager, greedy: its logits and tokens at every sampled (seed, step)."""
    sampler = RecordingSampler()
    tokens = run_engine(model_path, workload, "torch", 256, True, sampler)
    forced = {key: int(row.argmax()) for key, row in sampler.logits.items()}
    return sampler.logits, forced, tokens


@pytest.mark.parametrize("enforce_eager", GRAPHS)
@pytest.mark.parametrize("attention,block_size", BACKENDS)
def test_logits_match_torch_backend(model_path, workload, reference, attention, block_size, enforce_eager):
    expected, forced, _ = reference
    sampler = RecordingSampler(forced)
    run_engine(model_path, workload, attention, block_size, enforce_eager, sampler)
    first, second = workload
    prompt_steps = {(p.seed, len(prompt)) for prompt, p in first + second}  # first token: sampled by prefill
    errors = logits_errors(sampler.logits, expected, prompt_steps)
    for phase, values in errors.items():
        print(
            f"{attention} block {block_size} {'eager' if enforce_eager else 'graphs'} {phase}: "
            f"{len(values)} rows, relative logits error vs torch max {max(values):.4f} "
            f"mean {sum(values) / len(values):.4f}"
        )
    assert errors["prefill"] and errors["decode"]
    worst = {phase: max(values) for phase, values in errors.items()}
    assert max(worst.values()) <= LOGITS_RTOL, f"logits differ from the torch backend's: {worst}"


@pytest.mark.parametrize("enforce_eager", GRAPHS)
@pytest.mark.parametrize("attention,block_size", BACKENDS)
def test_greedy_generations_agree(model_path, workload, reference, attention, block_size, enforce_eager):
    """Free-running greedy tokens equal the torch backend's. bfloat16 rounding may flip a near-tie:
    a sequence may then diverge, but only where the reference's own logits nearly tie the two."""
    expected_logits, _, expected_tokens = reference
    got_tokens = run_engine(model_path, workload, attention, block_size, enforce_eager)
    diverged = assert_diverged_only_at_near_ties(workload, got_tokens, expected_tokens, expected_logits)
    print(
        f"{attention} block {block_size} {'eager' if enforce_eager else 'graphs'}: "
        f"{len(got_tokens) - len(diverged)}/{len(got_tokens)} identical; near-tie divergences "
        f"(seed, token, margin, bound): {diverged}"
    )


@pytest.fixture(scope="module")
def fp8_reference(model_path, workload, reference):
    """The torch backend over an fp8 cache, forced along the bf16 reference's tokens."""
    sampler = RecordingSampler(reference[1])
    run_engine(model_path, workload, "torch", 256, True, sampler, kv_cache_dtype="fp8")
    return sampler.logits


@pytest.mark.parametrize("enforce_eager", GRAPHS)
@pytest.mark.parametrize("block_size", [256, 16])
def test_fp8_cache_logits_match_torch_backend(
    model_path, workload, reference, fp8_reference, block_size, enforce_eager
):
    """kv_cache_dtype=fp8: the triton backend (its kernels store and read fp8) against the torch
    backend over an fp8 cache, as tight as in bf16; and how far fp8 moves the logits from bf16."""
    expected, forced, _ = reference
    sampler = RecordingSampler(forced)
    run_engine(model_path, workload, "triton", block_size, enforce_eager, sampler, kv_cache_dtype="fp8")
    first, second = workload
    prompt_steps = {(p.seed, len(prompt)) for prompt, p in first + second}
    errors = logits_errors(sampler.logits, fp8_reference, prompt_steps)
    from_bf16 = logits_errors(fp8_reference, expected, prompt_steps)
    for phase in errors:
        print(
            f"fp8 triton block {block_size} {'eager' if enforce_eager else 'graphs'} {phase}: relative logits "
            f"error vs torch fp8 max {max(errors[phase]):.4f}; torch fp8 vs torch bf16 max "
            f"{max(from_bf16[phase]):.4f} mean {sum(from_bf16[phase]) / len(from_bf16[phase]):.4f}"
        )
    assert max(max(v) for v in errors.values()) <= LOGITS_RTOL
    assert max(max(v) for v in from_bf16.values()) <= 0.15  # fp8's own rounding, not a misread cache


@needs_flash_attn
def test_flash_attn_refuses_an_fp8_cache_and_says_why(qwen3_path):
    with pytest.raises(ValueError, match=r"flash-attn needs the KV cache in the model's dtype"):
        LLM(qwen3_path, attention="flash_attn", kv_cache_dtype="fp8", **ENGINE)


def test_auto_picks_triton(qwen3_path, caplog):
    caplog.set_level(logging.INFO, logger="inferlab")
    llm = LLM(qwen3_path, attention="auto", enforce_eager=True, num_kvcache_blocks=8, **ENGINE)
    chosen = llm.runner.backend.name
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert chosen == "triton"


def test_auto_falls_back_past_triton_and_says_why(qwen3_path, caplog):
    # blocks of 768: a multiple of 256 (flash-attn's paged cache) but not a power of two (triton's)
    caplog.set_level(logging.INFO, logger="inferlab")
    settings = dict(attention="auto", kvcache_block_size=768, enforce_eager=True, num_kvcache_blocks=8, **ENGINE)
    if not HAS_FLASH_ATTN:
        # the torch backend needs power-of-two blocks too: no backend is left, and the error says
        # why for each
        with pytest.raises(ValueError, match="no attention backend can serve") as error:
            LLM(qwen3_path, **settings)
        for reason in (
            "triton: block size must be a power of two >= 16, got 768",
            "flash_attn: flash-attn is not installed or does not load",
            "torch: block size must be a power of two >= 16, got 768",
        ):
            assert reason in str(error.value)
        return
    llm = LLM(qwen3_path, **settings)
    chosen = llm.runner.backend.name
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert chosen == "flash_attn"
    assert "triton: block size must be a power of two >= 16, got 768" in caplog.text


@pytest.mark.parametrize("attention", ["triton", pytest.param("flash_attn", marks=needs_flash_attn)])
def test_kv_cache_is_sized_from_gpu_memory(qwen3_path, attention, caplog):
    caplog.set_level(logging.INFO, logger="inferlab")
    utilization = 0.5
    gc.collect()
    torch.cuda.empty_cache()
    settings = {**ENGINE, "gpu_memory_utilization": utilization}
    llm = LLM(qwen3_path, attention=attention, kvcache_block_size=256, **settings)
    try:
        free, total = torch.cuda.mem_get_info()
        num_blocks = llm.runner.num_kv_blocks
        cache_bytes = llm.runner.kv_cache.numel() * llm.runner.kv_cache.element_size()
        print(
            f"{attention}: {num_blocks} KV blocks ({cache_bytes / 2**30:.2f} GiB); "
            f"{(total - free) / 2**30:.2f} of {total / 2**30:.2f} GiB in use"
        )
        assert f"KV cache: {num_blocks} blocks of 256 tokens" in caplog.text
        assert num_blocks * llm.runner._kv_block_bytes() == cache_bytes
        # the cache takes what the budget leaves: in use now is the budget, less the warm-up's
        # (freed) activations, plus the decode graphs' pool; never far above or below it
        in_use = total - free
        assert in_use <= utilization * total + 2**30
        assert in_use >= utilization * total - 4 * 2**30
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0]["token_ids"]) == 4
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_close_gives_the_gpu_memory_back_for_a_second_engine(qwen3_path):
    """A notebook user's second LLM: the first one's weights, KV cache and CUDA graphs go back to
    the driver at close(), so the second, at the same gpu_memory_utilization, gets as many KV
    blocks and the same greedy tokens."""
    gc.collect()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    settings = {**ENGINE, "gpu_memory_utilization": 0.9, "enforce_eager": False}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    with LLM(qwen3_path, attention="triton", **settings) as first:
        first_blocks = first.kv_manager.num_blocks
        first_tokens = [o["token_ids"] for o in first.generate(prompts, params, use_tqdm=False)]
        assert first.runner.decode_graphs is not None
        held = free_before - torch.cuda.mem_get_info()[0]
        assert held > 0.5 * free_before  # the KV cache took most of the GPU
    free_after = torch.cuda.mem_get_info()[0]
    print(f"held {held / 2**30:.1f} GiB; after close() {(free_before - free_after) / 2**20:.0f} MiB not returned")
    assert free_before - free_after < 512 * 2**20  # the CUDA context's own growth (cuBLAS, loaded kernels)
    assert torch.cuda.memory_allocated() < 128 * 2**20
    with LLM(qwen3_path, attention="triton", **settings) as second:
        assert abs(second.kv_manager.num_blocks - first_blocks) <= max(2, first_blocks // 100)
        assert [o["token_ids"] for o in second.generate(prompts, params, use_tqdm=False)] == first_tokens


def forget_compiled_kernels() -> None:
    """Empties the in-memory caches of inferlab's Triton kernels (earlier tests filled them)."""
    import sys

    import triton

    for name, module in list(sys.modules.items()):
        if name.startswith("inferlab.") and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, triton.runtime.jit.JITFunction):
                    value.device_caches.clear()


def varied_workload_compiles(llm) -> tuple[list[str], list[list[int]]]:
    """The kernels a varied workload (one to many sequences, prompts of many lengths, a cached
    prefix, every sampling path, CUDA graphs) compiles on llm, and its tokens."""
    from triton import knobs

    compiled = []
    knobs.runtime.jit_cache_hook = lambda **kwargs: compiled.append(kwargs["fn"].name)
    try:
        shared = list(range(40, 90))
        prompts = [shared + [i] * (1 + 37 * i % 300) for i in range(40)] + [[5] * 1500, [6]]
        params = [
            SamplingParams(temperature=0, max_tokens=20),
            SamplingParams(temperature=0.7, max_tokens=33, ignore_eos=True, seed=1),
            SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.1, max_tokens=9, ignore_eos=True, seed=2),
        ]
        outputs = llm.generate(prompts, [params[i % 3] for i in range(len(prompts))], use_tqdm=False)
        outputs += llm.generate([[7, 8, 9]], params[1], use_tqdm=False)
    finally:
        knobs.runtime.jit_cache_hook = None
    return compiled, [o["token_ids"] for o in outputs]


START_UP_SETTINGS = {**ENGINE, "max_num_seqs": 64, "num_kvcache_blocks": 256, "kvcache_block_size": 16}


def test_start_up_compiles_every_kernel_variant_a_workload_selects(qwen3_path):
    """compile_at_start: with the in-memory kernel caches emptied first, the constructor compiles
    what a varied workload needs, so the workload compiles nothing."""
    forget_compiled_kernels()
    with LLM(qwen3_path, attention="triton", **START_UP_SETTINGS) as llm:
        assert varied_workload_compiles(llm)[0] == []


def test_a_second_start_reads_the_variants_the_first_listed(qwen3_path, tmp_path, monkeypatch, caplog):
    """With Triton's cache in an empty directory, a first engine dry-runs its start-up steps and
    keeps the list of their kernel variants there; a second one (in-memory caches emptied again)
    reads the list instead of dry-running, and still compiles everything the workload needs."""
    from triton import knobs

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    runs = []
    for _ in range(2):
        forget_compiled_kernels()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="inferlab"):
            with LLM(qwen3_path, attention="triton", **START_UP_SETTINGS) as llm:
                runs.append((*varied_workload_compiles(llm), "kernel variants of these steps from" in caplog.text))
    assert len(list((tmp_path / "inferlab-variants").iterdir())) == 1
    (first_compiled, first_tokens, first_read), (second_compiled, second_tokens, second_read) = runs
    assert (first_read, second_read) == (False, True)
    assert first_compiled == second_compiled == [] and second_tokens == first_tokens


def test_pinned_staging_reuses_its_buffers_only_after_their_copies():
    """Uploads of many sizes and dtypes through the runner's pinned staging ring, more than it has
    buffers, each overwritten on the host right after: every device copy holds what was sent."""
    import numpy as np

    from inferlab.core.model_runner import PinnedStaging

    staging, stream, device = PinnedStaging(), torch.cuda.Stream(), torch.device("cuda")
    rng = np.random.default_rng(0)
    sent, received = [], []
    for i in range(5 * PinnedStaging.SLOTS):
        array = rng.integers(-(2**40), 2**40, size=(int(rng.integers(0, 5000)), 1 + i % 3), dtype=np.int64)
        dtype = (torch.int64, torch.int32, torch.float32)[i % 3]
        if dtype != torch.int64:
            array = array % 10_000
        received.append(staging.upload(array, dtype, stream, device))
        sent.append(torch.from_numpy(array.copy()).to(dtype))
        array[:] = 7  # the caller's array may change once upload returns
    torch.cuda.synchronize()
    for expected, got in zip(sent, received):
        assert got.device.type == "cuda" and got.dtype == expected.dtype
        assert torch.equal(got.cpu(), expected)


def test_sampling_graphs_draw_the_tokens_the_eager_sampler_draws(qwen3_path):
    """Decode batches' LM head and sampler replayed from graphs (the default sampler, captured at
    start-up) give the tokens the same sampler gives launched eagerly (an engine whose runner was
    handed another instance): greedy batches, seeded sampling with a greedy row among the sampled
    ones, and top-k/top-p batches (eager on both sides), as the batches shrink."""
    from inferlab.core.cuda_graphs import sampling_graph_kind
    from inferlab.plugins.samplers.default_sampler import DefaultSampler

    prompts = [[(7 * i + j) % 1000 for j in range(n)] for i, n in enumerate([5, 40, 300, 17])]
    lengths = [30, 12, 45, 3]
    cases = {
        "greedy": [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths],
        "sampled": [
            SamplingParams(temperature=0 if i == 1 else 0.9, seed=100 + i, max_tokens=m, ignore_eos=True)
            for i, m in enumerate(lengths)
        ],
        "filtered": [
            SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=200 + i, max_tokens=m, ignore_eos=True)
            for i, m in enumerate(lengths)
        ],
    }

    def generate_all(llm) -> dict:
        return {
            case: [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
            for case, params in cases.items()
        }

    replays = Counter()
    with LLM(qwen3_path, attention="triton", **ENGINE) as llm:
        graphs = llm.runner.sampling_graphs
        assert graphs is not None and graphs.sampler is llm.runner.sampler
        replay = graphs.run

        def counted(hidden, params):
            replayed = replay(hidden, params)
            replays[sampling_graph_kind(params) if replayed else "eager"] += 1
            return replayed

        graphs.run = counted
        from_graphs = generate_all(llm)
    with LLM(qwen3_path, attention="triton", **ENGINE) as llm:
        llm.runner.sampler = DefaultSampler()
        llm.runner.sampling_graphs.run = lambda hidden, params: pytest.fail("a replaced sampler was replayed")
        eager = generate_all(llm)
    print(dict(replays))
    # every decode step but the first of each request group (its prompt's token comes with prefill)
    assert replays["greedy"] >= max(lengths) - 2 and replays["sampled"] >= max(lengths) - 2
    assert replays["eager"] >= max(lengths) - 2  # the filtered batches
    assert from_graphs == eager
    assert from_graphs["sampled"] != from_graphs["greedy"]  # the sampled rows did sample
