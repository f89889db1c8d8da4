"""Shared fixtures: tiny random checkpoints of each architecture (built once per session per
shape), the Hugging Face reference for greedy decoding, plugins registered by hand, and one torch
thread for the whole run; and which tests `-m slow` runs beside those marked in their files."""

import json
import os
import re
import types

import pytest
import torch

from inferlab.tiny_model import make_checkpoint

# Shapes that differ in what the engine must get right: GQA ratio, head_dim vs hidden/heads, tying.
SHAPES = {
    "gqa2-tied": dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True
    ),
    "gqa4-untied": dict(
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        num_hidden_layers=3,
    ),
    "mha-wide-head": dict(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
        intermediate_size=96,
    ),
    # The Llama family (same tokenizer): between them GQA and MHA, tied and untied, Qwen2's q/k/v
    # biases (with one KV head, replicated under tensor parallelism), llama3 and linear rope
    # scaling and none, head_dim given (and not hidden / heads) or derived.
    "llama-gqa-llama3": dict(
        architecture="LlamaForCausalLM",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        # a short original context and a low theta, so that the scaling changes the greedy tokens
        rope_theta=10000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "llama-mha-linear-tied": dict(
        architecture="LlamaForCausalLM",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=True,
        rope_scaling=dict(rope_type="linear", factor=4.0),
    ),
    "mistral-gqa4": dict(
        architecture="MistralForCausalLM",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=None,  # derived: 16
        tie_word_embeddings=False,
        num_hidden_layers=3,
        # Mistral's default sliding_window (4096) equals max_model_len: every token sees them all
    ),
    "qwen2-bias-kv1-tied": dict(
        architecture="Qwen2ForCausalLM",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=None,
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name_or_shape_dict, **extra) -> path of a tiny checkpoint, cached per session."""
    made = {}
    root = tmp_path_factory.mktemp("checkpoints")

    def build(shape="gqa2-tied", **extra):
        settings = {**(SHAPES[shape] if isinstance(shape, str) else shape), **extra}
        key = json.dumps(settings, sort_keys=True)
        if key not in made:
            made[key] = make_checkpoint(os.path.join(root, f"ck{len(made)}"), **settings)
        return made[key]

    return build


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(path, prompt_ids, n) -> the n tokens transformers' own implementation of the
    checkpoint's architecture picks greedily, in float32."""
    from transformers import AutoModelForCausalLM

    models = {}

    def run(path, prompt_ids, num_tokens):
        if path not in models:
            models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            for _ in range(num_tokens):
                ids = torch.cat([ids, models[path](ids).logits[0, -1].argmax().view(1, 1)], dim=1)
        return ids[0, len(prompt_ids) :].tolist()

    return run


@pytest.fixture
def plugin_module():
    """plugin_module(name, hook_name=function, ...) -> a module holding those functions as inferlab
    hook implementations, as a third-party plugin's module would (for PluginRegistry.register)."""
    from inferlab.core.hookspecs import hookimpl

    def build(name, **hooks):
        module = types.ModuleType(name)
        for hook_name, fn in hooks.items():
            setattr(module, hook_name, hookimpl(fn))
        return module

    return build


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Every test, and the processes tests start, on one torch thread: tiny models run fastest
    so, and OpenMP threads that spin-wait on a loaded machine make each step 30x slower."""
    num_threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(num_threads)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS")
    else:
        os.environ["OMP_NUM_THREADS"] = omp


# Heavy tests of files that others are editing at the same time, marked here so that those files
# stay as they are (other heavy tests carry @pytest.mark.slow themselves): a file, or one test.
SLOW = (
    "tests/core/test_fault_injection.py",  # Ctrl-C at every line, four times over
    "tests/server/test_server_shutdown.py::test_a_signal_ends_every_stream_with_a_final_event_and_exits_0[2]",
    "tests/test_sim_vs_real_script.py",  # the GPU script end to end on the CPU
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
    collected = {item.nodeid for item in items} | {item.nodeid.split("::")[0] for item in items}
    files = {nodeid.split("::")[0] for nodeid in collected}
    missing = [nodeid for nodeid in SLOW if nodeid.split("::")[0] in files and nodeid not in collected]
    if missing:  # a test renamed or gone: say so rather than run it in the wrong run
        raise pytest.UsageError(f"tests/conftest.py SLOW names tests that are not there: {missing}")
    for item in items:
        if item.nodeid in SLOW or item.nodeid.split("::")[0] in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto` (pyproject's addopts): two for the CPU tests, the two cores of the CI
    machine; none where GPU tests are selected, since they share one card's memory."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    if re.search(r"(?<!not )\bgpu\b", config.option.markexpr or ""):
        return 0
    return min(2, os.cpu_count() or 1)
