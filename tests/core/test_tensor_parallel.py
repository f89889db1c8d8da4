"""Tensor parallelism on CPU (gloo, 2 ranks): the same greedy tokens as one rank and as Hugging Face,
each rank reading only its shard of the weights, and failures that name the rank, arrive within
seconds and leave no process or shared-memory segment behind."""

import functools
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from worker_processes import alive, assert_nothing_left, child_pids, prompts_of, run_until_failure, shm_entries

from inferlab import LLM, SamplingParams
from inferlab.core.engine import EngineClosedError
from inferlab.core.hookspecs import hookimpl
from inferlab.core.parallel import TPGroup
from inferlab.core.plugins import PluginRegistry
from inferlab.core.workers import TensorParallelError
from inferlab.plugins.attention.torch_backend import TorchBackend
from inferlab.plugins.models import checkpoint as checkpoint_files
from inferlab.plugins.models.checkpoint import CheckpointError
from inferlab.plugins.models.decoder import head_dim_of
from inferlab.plugins.models.llama import LlamaForCausalLM
from inferlab.plugins.models.qwen2 import Qwen2ForCausalLM
from inferlab.plugins.models.qwen3 import Qwen3ForCausalLM

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SETTINGS = dict(kvcache_block_size=16, num_kvcache_blocks=64, device="cpu")
KV1 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    """Two ranks share CI's few cores: more threads per rank only make them wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tied(checkpoint):
    """2 query heads and 1 KV head per rank; tied embeddings; prompts prefilled whole."""
    llm = LLM(checkpoint("gqa2-tied"), tensor_parallel_size=2, **SETTINGS)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def untied(checkpoint):
    """4 query heads and 1 KV head per rank, 3 layers, untied head; chunked prefill (24 tokens a
    step) and overlap scheduling (the workers swap rank 0's samples in for placeholders)."""
    llm = LLM(
        checkpoint("gqa4-untied"),
        tensor_parallel_size=2,
        max_num_batched_tokens=24,
        overlap_scheduling=True,
        **SETTINGS,
    )
    yield llm
    llm.close()


@pytest.mark.parametrize("engine", ["tied", "untied"])
def test_greedy_equals_one_rank_and_hf(engine, request, hf_greedy):
    llm = request.getfixturevalue(engine)
    prompts = prompts_of([1, 7, 16, 33, 50])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    one_rank = LLM(llm.model_path, **{**SETTINGS, "max_num_batched_tokens": llm.config.max_num_batched_tokens})
    assert outputs == one_rank.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(llm.model_path, prompt, GREEDY.max_tokens)
    # again: the prompts' full blocks now come from the prefix cache, on every rank
    hits_before = llm.kv_manager.prefix_cache_stats()[0]
    assert llm.generate(prompts, GREEDY, use_tqdm=False) == outputs
    assert llm.kv_manager.prefix_cache_stats()[0] > hits_before


@pytest.mark.parametrize("engine", ["tied", "untied"])
def test_seeded_sampling_equals_one_rank(engine, request):
    llm = request.getfixturevalue(engine)
    params = [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=8, seed=seed, ignore_eos=True)
        for seed in (1, 2, 3)
    ]
    prompts = prompts_of([4, 9, 20], start=11)
    one_rank = LLM(llm.model_path, **SETTINGS)
    assert llm.generate(prompts, params, use_tqdm=False) == one_rank.generate(prompts, params, use_tqdm=False)


def test_logprobs_and_penalties_on_two_ranks_equal_one_rank(untied):
    """Chunked prompts whose first chunks only score prompt tokens (no row samples: rank 0 then
    broadcasts nothing), logprobs of the sampled distribution, penalties and logit_bias."""
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2, presence_penalty=0.5,
        logit_bias={5: 2.0},
    )  # fmt: skip
    prompts = prompts_of([50, 9], start=3)
    outputs = untied.generate(prompts, params, use_tqdm=False)
    one_rank = LLM(untied.model_path, **{**SETTINGS, "max_num_batched_tokens": 24}).generate(
        prompts, params, use_tqdm=False
    )
    for got, expected in zip(outputs, one_rank):
        assert got["token_ids"] == expected["token_ids"]
        for key in ("logprobs", "prompt_logprobs"):
            for a, b in zip(got[key], expected[key]):
                assert (a is None) == (b is None)
                if a is not None:
                    assert list(a) == list(b) and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)


@pytest.mark.slow
def test_an_fp8_cache_on_two_ranks_equals_one_rank(checkpoint):
    """Each rank holds its KV heads' share of the cache in fp8, rounded as on one rank."""
    fp8 = {**SETTINGS, "kv_cache_dtype": "fp8"}
    prompts = prompts_of([3, 17, 40])
    with LLM(checkpoint("gqa2-tied"), tensor_parallel_size=2, **fp8) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outputs == LLM(checkpoint("gqa2-tied"), **fp8).generate(prompts, GREEDY, use_tqdm=False)


def test_two_engines_at_once(tied, untied, hf_greedy):
    """Each engine has its own store port and group: their steps interleave freely."""
    assert tied.runner.store.port != untied.runner.store.port
    prompts = prompts_of([5, 12], start=40)
    for llm in (tied, untied):
        for prompt in prompts:
            llm.add_request(prompt, GREEDY)
    done = {tied: [], untied: []}
    while not (tied.is_finished() and untied.is_finished()):
        for llm in (tied, untied):
            if not llm.is_finished():
                done[llm] += llm.step().finished
    for llm, finished in done.items():
        assert len(finished) == len(prompts)
        for seq in finished:
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            assert llm.output(seq)["token_ids"] == hf_greedy(llm.model_path, prompt, GREEDY.max_tokens)


@pytest.mark.slow
def test_kv_heads_fewer_than_ranks_as_context_manager(checkpoint, hf_greedy):
    """1 KV head over 2 ranks: each rank keeps a replica. The KV cache is sized from the CPU budget
    on each rank (same count everywhere). Leaving the `with` block stops the workers."""
    path = checkpoint(KV1)
    prompts = prompts_of([3, 18, 40], start=7)
    sized = {**SETTINGS, "num_kvcache_blocks": -1, "max_num_seqs": 4, "max_model_len": 256}
    with LLM(path, tensor_parallel_size=2, **sized) as llm:
        pids = llm.runner.workers.pids
        assert llm.runner.model_runner.model.kv_cache_spec()[1] == 1
        assert llm.kv_manager.num_blocks == llm.runner.num_kv_blocks == 4 * 256 // 16
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(alive(pid) for pid in pids)
    assert not any(alive(pid) for pid in pids)
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(path, prompt, GREEDY.max_tokens)
    with pytest.raises(EngineClosedError, match="closed engine"):
        llm.generate(prompts, GREEDY, use_tqdm=False)


# -- weights: each rank reads its shard, and only that ----------------------------------------


class RecordingFile:
    """A safetensors file whose slices note how many elements each read returned."""

    def __init__(self, file, reads):
        self.file, self.reads = file, reads

    def __enter__(self):
        self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def keys(self):
        return self.file.keys()

    def get_slice(self, name):
        source, reads = self.file.get_slice(name), self.reads

        class Slice:
            def get_shape(self):
                return source.get_shape()

            def __getitem__(self, index):
                value = source[index]
                reads[name] = reads.get(name, 0) + value.numel()
                return value

        return Slice()


def rank_part(name: str, tensor: torch.Tensor, rank: int, config) -> torch.Tensor:
    """What rank `rank` of 2 holds of checkpoint tensor `name` (before the fused projections
    concatenate q, k, v and gate, up)."""
    d = head_dim_of(config)
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    q = slice(rank * heads // 2 * d, (rank + 1) * heads // 2 * d)  # also o_proj's input columns
    kv_start = rank * kv_heads // 2 if kv_heads < 2 else rank * (kv_heads // 2)  # one KV head: a replica
    kv = slice(kv_start * d, (kv_start + max(1, kv_heads // 2)) * d)
    mlp = slice(rank * inter // 2, (rank + 1) * inter // 2)
    vocab_rows = -(-config.vocab_size // 2)
    vocab = slice(rank * vocab_rows, min(config.vocab_size, (rank + 1) * vocab_rows))
    is_bias = name.endswith(".bias")
    for part, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("gate_proj", mlp), ("up_proj", mlp)):
        if f".{part}." in name:
            return tensor[rows]
    for part, columns in (("o_proj", q), ("down_proj", mlp)):
        if f".{part}." in name:
            return tensor if is_bias else tensor[:, columns]  # a row-parallel bias is added once, whole
    if "embed_tokens" in name or name.startswith("lm_head"):
        return tensor[vocab]
    return tensor  # the norms


@pytest.mark.parametrize("shape", ["gqa2-tied", "gqa4-untied", "kv1", "qwen2-bias-kv1-tied", "llama-mha-linear-tied"])
def test_each_rank_reads_only_its_shard(shape, checkpoint, monkeypatch):
    path = checkpoint(KV1 if shape == "kv1" else shape)
    full = load_file(os.path.join(path, "model.safetensors"))
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    model_class = {"Qwen3ForCausalLM": Qwen3ForCausalLM, "Qwen2ForCausalLM": Qwen2ForCausalLM}.get(
        config.architectures[0], LlamaForCausalLM
    )
    for rank in range(2):
        reads = {}
        real_open = checkpoint_files.safe_open
        monkeypatch.setattr(
            checkpoint_files, "safe_open", functools.partial(recording_open, real_open=real_open, reads=reads)
        )
        model = model_class(config, backend=TorchBackend(), tp_group=TPGroup(rank, 2))
        model.load_weights(path)
        monkeypatch.undo()
        params = dict(model.named_parameters())
        for layer in range(config.num_hidden_layers):
            for ours, theirs in (
                ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
            ):
                prefix = f"model.layers.{layer}.{ours.split('.')[0]}."
                for suffix in ("weight", "bias"):
                    names = [f"{prefix}{part}.{suffix}" for part in theirs]
                    if names[0] in full:
                        expected = torch.cat([rank_part(n, full[n], rank, config) for n in names])
                        assert torch.equal(params[f"layers.{layer}.{ours}.{suffix}"], expected)
            for ours in ("self_attn.o_proj", "mlp.down_proj"):
                for suffix in ("weight", "bias"):
                    name = f"model.layers.{layer}.{ours}.{suffix}"
                    if name in full:
                        assert torch.equal(
                            params[f"layers.{layer}.{ours}.{suffix}"], rank_part(name, full[name], rank, config)
                        )
        embedding = rank_part("model.embed_tokens.weight", full["model.embed_tokens.weight"], rank, config)
        assert torch.equal(model.embed_tokens.weight[: len(embedding)], embedding)
        if config.tie_word_embeddings:
            assert model.lm_head.weight is model.embed_tokens.weight and "lm_head.weight" not in reads
        else:
            head = rank_part("lm_head.weight", full["lm_head.weight"], rank, config)
            assert torch.equal(model.lm_head.weight[: len(head)], head)
        assert set(full) - {"lm_head.weight"} <= set(reads)
        for name, tensor in full.items():
            if name in reads:
                held = rank_part(name, tensor, rank, config).numel()
                assert reads[name] == held, f"rank {rank} read {reads[name]} of {name}'s {tensor.numel()} elements"


def recording_open(*args, real_open, reads, **kwargs):
    return RecordingFile(real_open(*args, **kwargs), reads)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["llama-gqa-llama3", "llama-mha-linear-tied", "mistral-gqa4", "qwen2-bias-kv1-tied"])
def test_the_llama_family_on_two_ranks_equals_one_rank(shape, checkpoint):
    """Sharded attention heads and MLP, KV heads split or replicated, Qwen2's biases sliced with
    them; chunked prefill, then the prompts again from the prefix cache."""
    path = checkpoint(shape)
    settings = {**SETTINGS, "max_num_batched_tokens": 24}
    prompts = prompts_of([1, 7, 16, 33, 50])
    with LLM(path, tensor_parallel_size=2, **settings) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.generate(prompts, GREEDY, use_tqdm=False) == outputs
    assert outputs == LLM(path, **settings).generate(prompts, GREEDY, use_tqdm=False)


# -- failures ----------------------------------------------------------------------------------


class ExplodingQwen3(Qwen3ForCausalLM):
    """Raises on rank 1 in its fourth forward pass: a worker failing mid-generation."""

    def forward(self, *args):
        self.num_calls = getattr(self, "num_calls", 0) + 1
        if self.tp.rank == 1 and self.num_calls == 4:
            raise ValueError("rank 1 exploded on purpose")
        return super().forward(*args)


class VanishingQwen3(Qwen3ForCausalLM):
    """Rank 1's process exits while the model is being built: a worker lost during start-up."""

    def __init__(self, hf_config, **kwargs):
        if kwargs["tp_group"].rank == 1:
            os._exit(3)
        super().__init__(hf_config, **kwargs)


class ExplodingPlugin:
    @hookimpl
    def register_models(self, register):
        register("exploding_qwen3", ExplodingQwen3)
        register("vanishing_qwen3", VanishingQwen3)


def test_killed_worker_names_its_rank_within_seconds(checkpoint):
    children_before, shm_before = child_pids(), shm_entries()
    llm = LLM(checkpoint("gqa2-tied"), tensor_parallel_size=2, **{**SETTINGS, "num_kvcache_blocks": 128})
    pids = llm.runner.workers.pids
    error, seconds = run_until_failure(llm, lambda: os.kill(pids[0], signal.SIGKILL))
    assert f"rank 1 (pid {pids[0]}) was killed by signal SIGKILL" in str(error)
    assert seconds < 5
    assert_nothing_left(llm, pids, children_before, shm_before)


@pytest.mark.slow
def test_raising_worker_reports_its_exception(checkpoint):
    children_before, shm_before = child_pids(), shm_entries()
    registry = PluginRegistry()
    registry.register(ExplodingPlugin(), name="exploding")
    llm = LLM(
        checkpoint("gqa2-tied"),
        tensor_parallel_size=2,
        registry=registry,
        model="exploding_qwen3",
        **{**SETTINGS, "num_kvcache_blocks": 128},
    )
    pids = llm.runner.workers.pids
    started = time.monotonic()
    with pytest.raises(TensorParallelError) as error:
        llm.generate(prompts_of([6, 9]), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert f"rank 1 (pid {pids[0]}) raised ValueError: rank 1 exploded on purpose" in message
    assert "--- rank 1 traceback ---" in message and "in forward" in message
    assert_nothing_left(llm, pids, children_before, shm_before)


@pytest.mark.slow
def test_worker_lost_during_start_up_is_named(checkpoint):
    children_before, shm_before = child_pids(), shm_entries()
    registry = PluginRegistry()
    registry.register(ExplodingPlugin(), name="exploding")
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code 3"):
        LLM(checkpoint("gqa2-tied"), tensor_parallel_size=2, registry=registry, model="vanishing_qwen3", **SETTINGS)
    assert time.monotonic() - started < 30  # start-up included; the loss itself is seen at once
    assert child_pids() <= children_before
    assert shm_entries() <= shm_before


def test_heads_that_do_not_split_fail_before_any_process_starts(checkpoint):
    children_before = child_pids()
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=3 does not divide the model's 4 attention heads; "
        r"use one of \[1, 2, 4\]",
    ):
        LLM(checkpoint("gqa2-tied"), tensor_parallel_size=3, **SETTINGS)
    assert child_pids() <= children_before


@pytest.mark.slow
def test_error_every_rank_hits_is_raised_as_is(checkpoint, tmp_path):
    """A checkpoint missing a tensor fails on every rank alike: rank 0's own CheckpointError comes
    out, not a TensorParallelError, and the workers are gone."""
    source = checkpoint("gqa2-tied")
    shutil.copytree(source, tmp_path / "broken")
    weights = load_file(os.path.join(source, "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "broken" / "model.safetensors", metadata={"format": "pt"})
    children_before, shm_before = child_pids(), shm_entries()
    with pytest.raises(
        CheckpointError, match=r"lacks tensors the model needs: \['model.layers.1.mlp.down_proj.weight'\]"
    ):
        LLM(str(tmp_path / "broken"), tensor_parallel_size=2, **SETTINGS)
    assert child_pids() <= children_before
    assert shm_entries() <= shm_before


SCRIPT = """
import sys
from inferlab import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=32, device="cpu")
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    print(llm.runner.workers.pids[0], len(out[0]["token_ids"]), flush=True)
    sys.stdin.readline()  # then exit without close(), unless killed first
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["exit", "killed"])
def test_workers_end_with_their_process(ending, checkpoint, tmp_path):
    """A script that exits without close() stops its workers at exit; one killed outright (no
    atexit) still takes them along, as each worker watches its parent."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT))
    shm_before = shm_entries()
    process = subprocess.Popen(
        [sys.executable, str(script), checkpoint("gqa2-tied")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        worker_pid, num_tokens = map(int, process.stdout.readline().split())
        assert num_tokens == 3 and alive(worker_pid)
        if ending == "killed":
            process.kill()
        else:
            process.stdin.write("exit\n")
            process.stdin.flush()
        assert process.wait(timeout=30) == (-signal.SIGKILL if ending == "killed" else 0)
        deadline = time.monotonic() + 10
        while alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker_pid)
        assert shm_entries() <= shm_before
    finally:
        process.kill()
        process.wait()


def test_graphs_are_released_before_the_group_is_aborted_and_a_stuck_abort_is_left_behind(monkeypatch, caplog):
    """NCCL's abort spins until every CUDA graph that captured the communicator's collectives is
    destroyed (seen on two H200s): rank 0 destroys its graphs first, and an abort that still
    cannot finish costs ABORT_GRACE_S, not a hung program."""
    from inferlab.core import workers

    order = []

    class Graphs:
        def release(self):
            order.append("release graphs")

    class Group:
        def abort(self):
            order.append("abort")

    class StuckGroup:
        def abort(self):
            order.append("abort stuck")
            threading.Event().wait()

    graphs = [Graphs()]
    workers.shutdown_workers([], [], [], [Group()], graphs, grace=0.0)
    assert order == ["release graphs", "abort"] and graphs == []
    monkeypatch.setattr(workers, "ABORT_GRACE_S", 0.2)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="inferlab"):
        workers.shutdown_workers([], [], [], [StuckGroup()], [], grace=0.0)
    assert time.monotonic() - started < 2
    assert "abort did not finish within 0.2 s; leaving it behind" in caplog.text


@pytest.mark.slow
def test_hung_worker_is_named_within_the_step_timeout(checkpoint):
    """A worker stopped with SIGSTOP answers nothing, and rank 0 waits in a collective with it:
    the hang watch names the rank once a step has run tp_step_timeout_s, and stops it."""
    children_before, shm_before = child_pids(), shm_entries()
    llm = LLM(
        checkpoint("gqa2-tied"),
        tensor_parallel_size=2,
        tp_step_timeout_s=2.0,
        **{**SETTINGS, "num_kvcache_blocks": 128},
    )
    pids = llm.runner.workers.pids
    error, seconds = run_until_failure(llm, lambda: os.kill(pids[0], signal.SIGSTOP))
    assert f"rank 1 (pid {pids[0]}) did not finish a step within tp_step_timeout_s=2 s: it is stopped" in str(error)
    assert 2 <= seconds < 15  # the timeout, then at most a poll interval and the report (slack for a loaded host)
    assert_nothing_left(llm, pids, children_before, shm_before)


def test_step_timeout_is_a_checked_setting(checkpoint):
    with pytest.raises(ValueError, match="tp_step_timeout_s must be a positive number of seconds, got 0"):
        LLM(checkpoint("gqa2-tied"), tensor_parallel_size=2, tp_step_timeout_s=0, **SETTINGS)


def test_ctrl_c_leaves_a_tensor_parallel_engine_usable(tied):
    """Ctrl-C (a real SIGINT) at several points of a generate: each time the call raises
    KeyboardInterrupt, the workers live on, and the engine gives the same tokens as before."""
    prompts = prompts_of([6, 30, 17], start=60)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = tied.generate(prompts, params, use_tqdm=False)
    pids = tied.runner.workers.pids
    for after_steps in (0, 1, 3, 7):
        start = tied.stats.num_steps

        def interrupt(start=start, after_steps=after_steps):
            while not tied.requests or tied.stats.num_steps < start + after_steps:  # inside the call
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)

        thread = threading.Thread(target=interrupt, daemon=True)
        thread.start()
        with pytest.raises(KeyboardInterrupt):
            tied.generate(prompts, params, use_tqdm=False)
            time.sleep(5)  # the signal can arrive only just after the call: still a KeyboardInterrupt here
        thread.join()
        assert all(alive(pid) for pid in pids) and not tied.runner.closed_because
        assert not tied.requests and tied.kv_manager.num_free_blocks == tied.kv_manager.num_blocks
        assert tied.generate(prompts, params, use_tqdm=False) == expected
