"""Start-up work that keeps compiling out of a user's first generate: the step shapes the engine
runs at start-up (compile_at_start) and what running them leaves behind. On a GPU,
tests/core/test_gpu.py checks that a varied workload then compiles nothing."""

import contextlib
import sys
import types

import pytest

from inferlab import LLM, SamplingParams
from inferlab.core.config import EngineConfig
from inferlab.core.model_runner import WARMUP_SAMPLING, warmup_shapes


def test_warmup_shapes_cross_every_tiling_threshold_within_the_limits():
    config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
    shapes = warmup_shapes(config, min_split_len=256)
    prefill_tokens = {sum(n for _, n in parts) for parts, _ in shapes if any(n > 1 for _, n in parts)}
    for threshold in (16, 32, 64, 128, 256):  # where the GEMMs' and norms' tilings change
        assert any(t <= threshold for t in prefill_tokens) and any(t > threshold for t in prefill_tokens)
    assert any(c > 0 and n > 1 for parts, _ in shapes for c, n in parts)  # a prefill after cached context
    assert any(len(parts) > 1 and {n for _, n in parts} != {1} for parts, _ in shapes)  # prefill beside decodes
    decode_batches = {len(parts) for parts, _ in shapes if all(n == 1 for _, n in parts)}
    assert {1, 2, 4, 8, 16, 32, 64, 128, 256} <= decode_batches  # the GEMM tilings, the decode order's block
    one_sequence_contexts = {parts[0][0] for parts, _ in shapes if len(parts) == 1 and parts[0][1] == 1}
    assert {256, 512, 1024, 2048, 4095} <= one_sequence_contexts  # every power of two of decode splits
    # a decode the backend splits beside a prompt (after the model's q/k kernel), where one fits
    assert ([(1024, 1), (0, 16)], "sampled") in warmup_shapes(config, 256, mixed_decode_split_len=1024)
    assert not any(c >= 8192 for parts, _ in warmup_shapes(config, 256, 8192) for c, _ in parts)
    assert {kind for _, kind in shapes} == set(WARMUP_SAMPLING)
    for parts, _ in shapes:
        assert len(parts) <= config.max_num_seqs
        assert sum(n for _, n in parts) <= config.max_num_batched_tokens
        assert all(c + n <= config.max_model_len for c, n in parts)


@pytest.mark.parametrize("max_model_len, max_num_seqs, max_tokens", [(64, 2, 64), (300, 8, 100)])
def test_small_limits_shrink_the_shapes(max_model_len, max_num_seqs, max_tokens):
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, max_model_len=max_model_len)
    shapes = warmup_shapes(config, min_split_len=16)
    assert shapes
    for parts, _ in shapes:
        assert len(parts) <= max_num_seqs and sum(n for _, n in parts) <= max_tokens
        assert all(c + n <= max_model_len for c, n in parts)


def test_running_the_start_up_steps_leaves_the_engine_as_it_was():
    """The steps run on a scratch cache: the engine's KV cache, prefix cache and sampling state
    are untouched, so a generate afterwards gives the same tokens (greedy and seeded)."""
    settings = dict(device="cpu", max_num_seqs=8, max_model_len=512, max_num_batched_tokens=512)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0.8, seed=3, max_tokens=6)]
    expected = [o["token_ids"] for o in LLM(**settings).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**settings)
    launched = []
    launch = llm.runner.launch
    llm.runner.launch = lambda batch, *args, **kwargs: launched.append(batch) or launch(batch, *args, **kwargs)
    llm.runner._compile_kernels()
    llm.runner.launch = launch
    assert len(launched) == len(warmup_shapes(llm.config, 256))
    assert llm.kv_manager.num_free_blocks == llm.kv_manager.num_blocks
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == expected


class FakeKernel:
    """Stands for a Triton JITFunction: preload compiles a specialization (or fails to) and
    returns the compiled kernel, whose _init_handles loads it (or fails to)."""

    def __init__(self, name, fails=False, fails_to_load=False):
        self.name, self.fails, self.fails_to_load, self.preloaded, self.loaded = name, fails, fails_to_load, [], []

    def preload(self, specialization):
        from triton import knobs

        # As Triton's preload does, it asks the cache hook first and compiles nothing on "skip".
        hook = knobs.runtime.jit_cache_hook
        info = types.SimpleNamespace(jit_function=self)
        if hook is not None and hook(key=specialization, fn=info, compile={"specialization_data": specialization}):
            return None
        if self.fails:
            raise RuntimeError("no such variant")
        self.preloaded.append(specialization)
        return types.SimpleNamespace(_init_handles=lambda: self.load(specialization))

    def load(self, specialization):
        if self.fails_to_load:
            raise RuntimeError("out of shared memory")
        self.loaded.append(specialization)


def test_compile_ahead_compiles_each_variant_once_and_skips_the_launches(monkeypatch):
    """The dry run's launches reach Triton's cache hook, which answers 'skip' and lists each new
    variant once; nothing compiles while the dry run lasts (a compiled variant would launch for
    real on its values), then the pool compiles and loads each; a variant that fails to compile or
    load ahead is left to its first launch, a call the hook does not understand goes ahead as
    usual, and the previous hook comes back."""
    pytest.importorskip("triton")
    from triton import knobs

    from inferlab.kernels import ahead

    monkeypatch.setattr(ahead.torch.cuda, "device", lambda device: contextlib.nullcontext())
    norm, gemm, broken = FakeKernel("norm"), FakeKernel("gemm", fails_to_load=True), FakeKernel("broken", fails=True)
    answers = []

    def launch(kernel, key):
        info = types.SimpleNamespace(jit_function=kernel)
        hook = knobs.runtime.jit_cache_hook
        answers.append(hook(key=key, fn=info, compile={"specialization_data": f"{kernel.name}-{key}"}))

    def dry_run():
        for kernel, key in [(norm, 1), (gemm, 1), (norm, 1), (norm, 2), (broken, 1), (gemm, 1)]:
            launch(kernel, key)
        answers.append(knobs.runtime.jit_cache_hook(key=3))  # no fn: not a launch it understands
        assert norm.preloaded == gemm.preloaded == []

    previous = knobs.runtime.jit_cache_hook
    assert ahead.compile_ahead(dry_run, threads=2, device="cuda") == 3
    assert answers == [True] * 6 + [False]
    assert norm.preloaded == ["norm-1", "norm-2"] and gemm.preloaded == ["gemm-1"]
    assert norm.loaded == ["norm-1", "norm-2"] and gemm.loaded == []
    assert knobs.runtime.jit_cache_hook is previous


def listed_kernel(x_ptr):  # the body of a kernel the listing test names; never compiled
    pass


def test_a_listed_dry_run_is_read_back_and_dropped_when_stale(tmp_path, monkeypatch):
    """The variants of a dry run are kept in a file named by what picks them; a later start reads
    them instead of dry-running, unless a listed kernel's source changed (or is gone), the file is
    damaged, or another tensor-parallel rank could not read its own."""
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    from inferlab.kernels import ahead

    # A kernel of this module, as a JITFunction whatever TRITON_INTERPRET says (other tests set it).
    kernel = JITFunction(listed_kernel)
    monkeypatch.setattr(sys.modules[__name__], "listed_kernel", kernel)
    listing = ahead.variants_file({"steps": [[[0, 16]], "greedy"]}, [__file__])
    assert listing == ahead.variants_file({"steps": [[[0, 16]], "greedy"]}, [__file__])
    assert listing != ahead.variants_file({"steps": [[[0, 32]], "greedy"]}, [__file__])
    listing = str(tmp_path / "variants.json")
    assert ahead.read_variants(listing) is None  # none kept yet
    ahead.write_variants(listing, {(id(kernel), "a"): (kernel, '{"a": 1}'), (id(kernel), "b"): (kernel, '{"b": 2}')})
    assert list(ahead.read_variants(listing).values()) == [(kernel, '{"a": 1}'), (kernel, '{"b": 2}')]
    monkeypatch.setattr(kernel, "hash", "its source changed")  # what cache_key returns once computed
    assert ahead.read_variants(listing) is None
    monkeypatch.undo()
    for damage in (f'[{{"kernel": "{__name__}:gone", "source": "x", "specialization": "{{}}"}}]', "[{"):
        (tmp_path / "damaged.json").write_text(damage)
        assert ahead.read_variants(str(tmp_path / "damaged.json")) is None

    # compile_ahead with a current list compiles it without the dry run; a rank without one makes all dry-run
    norm = FakeKernel("norm")
    monkeypatch.setattr(ahead.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(ahead, "read_variants", lambda path: {(id(norm), "1"): (norm, "norm-1")})
    dry_runs = []
    assert ahead.compile_ahead(lambda: dry_runs.append(1), 2, "cuda", listing) == 1
    assert dry_runs == [] and norm.preloaded == ["norm-1"]
    written = []
    monkeypatch.setattr(ahead, "write_variants", lambda path, found: written.append(path))
    assert ahead.compile_ahead(lambda: dry_runs.append(1), 2, "cuda", listing, on_every_rank=lambda read: False) == 0
    assert dry_runs == [1] and written == [listing]


def test_the_variants_list_is_named_by_the_engine_that_starts(monkeypatch):
    pytest.importorskip("triton")
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    settings = dict(device="cpu", max_num_seqs=8, max_model_len=512, max_num_batched_tokens=512)
    names = []
    for extra in ({}, {}, {"max_num_seqs": 4}, {"kvcache_block_size": 16}):
        with LLM(**settings | extra) as llm:
            shapes = warmup_shapes(llm.config, 256)
            names.append(llm.runner._kernel_variants_file(shapes, 2))
    assert names[0] == names[1] and len(set(names)) == 3
    assert names[0].endswith(".json") and "inferlab-variants" in names[0]


def test_a_warm_up_step_never_lends_its_sampling_settings_to_the_engines_requests():
    """The runner caches sampling settings by request ids: the memory warm-up's one greedy
    request must not pass its settings to the user's first request (id 0), which samples."""
    settings = dict(device="cpu", max_num_seqs=8, max_model_len=512, max_num_batched_tokens=512)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8)
    expected = LLM(**settings).generate([[3, 1, 4, 1, 5]], params, use_tqdm=False)[0]["token_ids"]
    llm = LLM(**settings)
    runner = llm.runner
    batch = runner._scratch_batch(0, [(0, 5)], 1, "greedy")  # as _warmup builds its step
    runner.launch(batch, list(runner._new_kv_cache(1).unbind(0))).tokens()
    assert all(r.request_id < 0 for r in batch.requests)
    assert llm.generate([[3, 1, 4, 1, 5]], params, use_tqdm=False)[0]["token_ids"] == expected


@pytest.mark.slow
def test_the_dry_run_over_the_representative_layers_runs_those_layers_alone(checkpoint):
    """The decoder runs one layer per KV cache it is given: start-up's runs of its step shapes,
    given the caches of kernel_variant_layers layers, run those alone (and the final norm and
    head); a step of the engine runs every layer."""
    llm = LLM(checkpoint("gqa4-untied"), device="cpu", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256)
    runner, ran = llm.runner, []
    assert len(runner.model.layers) == 3 and runner.model.kernel_variant_layers == 2
    for i, layer in enumerate(runner.model.layers):
        layer.register_forward_hook(lambda module, args, output, i=i: ran.append(i))
    scratch = list(runner._new_kv_cache(4).unbind(0))
    batch = runner._scratch_batch(0, [(0, 8), (16, 1)], 4, "greedy")
    for caches, layers in ((scratch[:2], [0, 1]), (scratch, [0, 1, 2])):
        ran.clear()
        assert len(runner.launch(batch, caches).tokens()) == 2
        assert ran == layers
    ran.clear()
    runner._compile_kernels()
    assert ran and set(ran) == {0, 1} and ran.count(0) == ran.count(1)
    ran.clear()
    llm.generate([[3, 1, 4]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert ran == [0, 1, 2] * 2


def stubbed_decode_graphs(runner, monkeypatch, capture):
    """Decode graphs of batches 1 and 4 over the runner's shapes, their buffers allocated and nothing
    captured yet, with CUDA's capture calls standing in: `capture(graph, pool)` for torch.cuda.graph,
    graphs whose pool is "pool", and a synchronize that does nothing (the model runs eagerly on the
    CPU under them)."""
    import torch

    from inferlab.core.cuda_graphs import DecodeGraphs

    class Graph:
        def pool(self):
            return "pool"

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.sizes, graphs.pool = [1, 4], None
    hidden_size = runner.model.config.hidden_size
    graphs._allocate_buffers(4, 4, 256, runner.block_size, hidden_size, runner.dtype, runner.device)
    return graphs


def test_the_run_before_each_graph_capture_goes_over_the_representative_layers(checkpoint, monkeypatch):
    """Each graph's capture runs every layer; the plain run before it (which loads the kernels the
    capture launches) only the model's kernel_variant_layers."""
    import torch

    llm = LLM(checkpoint("gqa4-untied"), device="cpu", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256)
    runner, ran = llm.runner, []
    for i, layer in enumerate(runner.model.layers):
        layer.register_forward_hook(lambda module, args, output, i=i: ran.append(i))
    captured = []

    @contextlib.contextmanager
    def capturing(graph, pool=None):
        captured.append(len(ran))
        yield
        captured.append(len(ran))

    graphs = stubbed_decode_graphs(runner, monkeypatch, capturing)
    with torch.inference_mode():  # as DecodeGraphs fills it: one token a sequence
        torch.arange(5, out=graphs.query_start_loc)
    graphs._capture(runner.model, runner.backend, runner.kv_caches)
    assert set(graphs.graphs) == {1, 4} and graphs.pool == "pool"
    plain, capture = [0, 1], [0, 1, 2]
    assert ran == (plain + capture) * 2
    assert [ran[a:b] for a, b in zip(captured[::2], captured[1::2])] == [capture, capture]


def test_the_lm_head_runs_only_at_row_counts_start_up_ran():
    """Steps sample any number of rows; the LM head runs them padded to the runner's
    logits_sizes, each of which start-up runs once (cuBLAS's first GEMM of a new row count costs
    the host tens of milliseconds on a GPU). The padding changes no token."""
    settings = dict(device="cpu", max_num_seqs=40, max_model_len=256, max_num_batched_tokens=2048)
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3 + i % 11)] for i in range(37)]
    params = [SamplingParams(temperature=0, max_tokens=2 + i % 9) for i in range(37)]
    unpadded = LLM(**settings)
    unpadded.runner.logits_sizes = []  # every row count as it comes
    expected = [o["token_ids"] for o in unpadded.generate(prompts, params, use_tqdm=False)]

    llm = LLM(**settings)
    runner, rows = llm.runner, []
    compute_logits = runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: rows.append(hidden.shape[0]) or compute_logits(hidden)
    runner._compile_kernels()
    warmed, rows[:] = set(rows), []
    assert warmed == set(runner.logits_sizes) == {1, 2, 4, 8, 16, 32, 40}
    sampled, logits = [], runner.logits
    runner.logits = lambda hidden: sampled.append(hidden.shape[0]) or logits(hidden)
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert set(sampled) - warmed  # steps sampled row counts between the sizes (37 first tokens, ...)
    assert set(rows) <= warmed and len(rows) == len(sampled)


def test_sampling_graphs_capture_each_size_and_kind_and_name_a_sampler_that_cannot_be_captured(checkpoint, monkeypatch):
    """The LM head and sampler of each decode batch size are captured once greedy and once sampled,
    over the decode graphs' hidden rows, with the index each row samples taken as its position plus
    one. A sampler that declares supports_cuda_graphs but reads a tensor back during the capture
    fails start-up with an error naming it and what to change. A reading sampler fails under the
    stand-ins for CUDA's capture calls as CUDA's capture makes it fail."""
    import torch

    from inferlab.core.cuda_graphs import SamplingGraphs
    from inferlab.plugins.samplers.default_sampler import DefaultSampler

    llm = LLM(checkpoint("gqa4-untied"), device="cpu", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256)
    runner = llm.runner
    capturing = []

    @contextlib.contextmanager
    def capture(graph, pool=None):
        capturing.append(graph)
        try:
            yield
        finally:
            capturing.remove(graph)

    decode_graphs = stubbed_decode_graphs(runner, monkeypatch, capture)
    with torch.inference_mode():
        decode_graphs.positions.copy_(torch.tensor([10, 20, 30, 40]))
    calls = []

    class Recording(DefaultSampler):
        def __call__(self, logits, params):
            calls.append((bool(capturing), logits.shape[0], params.all_greedy, params.steps.tolist()))
            return super().__call__(logits, params)

    graphs = SamplingGraphs(decode_graphs, runner.model.compute_logits, Recording(), runner.vocab_size)
    assert set(graphs.graphs) == {(4, "greedy"), (4, "sampled"), (1, "greedy"), (1, "sampled")}
    expected = [(4, True, [11, 21, 31, 41]), (4, False, [11, 21, 31, 41]), (1, True, [11]), (1, False, [11])]
    # each capture follows a plain run of the same call, which loads its kernels
    assert calls == [(captured, *call) for call in expected for captured in (False, True)]

    class Reading(DefaultSampler):
        def __call__(self, logits, params):
            hottest = params.temperatures.max()
            if capturing:  # CUDA refuses to read a tensor back while the stream captures
                raise RuntimeError("operation not permitted when stream is capturing")
            if hottest.item() > 1:
                logits = logits / hottest
            return super().__call__(logits, params)

    with pytest.raises(
        RuntimeError,
        match=r"sampler Reading of 4 greedy decode rows.*declares supports_cuda_graphs.*remove the declaration",
    ):
        SamplingGraphs(decode_graphs, runner.model.compute_logits, Reading(), runner.vocab_size)
