"""How the runner picks an attention backend (attention=auto follows the priorities the backends
declare), the optional fused K/V store, and the flash_attn backend without Triton."""

import importlib
import logging
import sys
import types

import pytest
import torch

from inferlab import LLM
from inferlab.core.batch import AttentionInputs
from inferlab.core.plugins import PluginRegistry
from inferlab.core.protocols import FusedKVStore
from inferlab.plugins.attention.flash_attn_backend import FlashAttnBackend
from inferlab.plugins.attention.torch_backend import TorchBackend
from inferlab.plugins.attention.triton_backend import TritonBackend

SMALL = dict(kvcache_block_size=16, num_kvcache_blocks=32, device="cpu")


class Declining(TorchBackend):
    """First in auto's order on CPU, but serves no configuration."""

    name = "declining"
    auto_priority = {"cpu": 99}

    @classmethod
    def validate(cls, device, dtype, block_size, head_dim, kv_cache_dtype):
        return ["declines every configuration"]


class Preferred(TorchBackend):
    name = "preferred"
    auto_priority = {"cpu": 50}


class ByNameOnly(TorchBackend):
    name = "by_name_only"
    auto_priority = {}


def registry_with(plugin_module, *backends) -> PluginRegistry:
    def register_attention_backends(register):
        for backend in backends:
            register(backend.name, backend)

    registry = PluginRegistry()
    registry.register(plugin_module("extra_backends", register_attention_backends=register_attention_backends))
    return registry


def test_builtin_backends_declare_todays_auto_order():
    """On CUDA: triton (the fastest decode), flash_attn, torch; on CPU the torch backend alone."""
    registry = PluginRegistry()
    factories = {name: entry.factory for name, entry in registry.entries["attention"].items()}
    for device, expected in (("cuda", ["triton", "flash_attn", "torch"]), ("cpu", ["torch"])):
        candidates = [name for name, factory in factories.items() if device in factory.auto_priority]
        assert sorted(candidates, key=lambda name: -factories[name].auto_priority[device]) == expected


def test_auto_tries_the_highest_priority_first_and_says_what_it_skipped(checkpoint, plugin_module, caplog):
    caplog.set_level(logging.WARNING, logger="inferlab")
    registry = registry_with(plugin_module, Declining, ByNameOnly)
    llm = LLM(checkpoint("gqa2-tied"), registry=registry, attention="auto", **SMALL)
    assert type(llm.runner.backend) is TorchBackend
    assert "attention=auto chose 'torch'; skipped: declining: declines every configuration" in caplog.text
    assert "by_name_only" not in caplog.text  # no priority on CPU: auto never tries it
    assert type(LLM(checkpoint("gqa2-tied"), registry=registry, attention="by_name_only", **SMALL).runner.backend) is (
        ByNameOnly
    )


def test_auto_takes_a_higher_priority_backend_that_serves(checkpoint, plugin_module):
    registry = registry_with(plugin_module, Preferred)
    assert type(LLM(checkpoint("gqa2-tied"), registry=registry, attention="auto", **SMALL).runner.backend) is Preferred


def test_fused_kv_store_is_an_optional_capability():
    assert issubclass(TritonBackend, FusedKVStore) and issubclass(FlashAttnBackend, FusedKVStore)
    assert not issubclass(TorchBackend, FusedKVStore)  # the torch backend stores K/V itself


def test_flash_attn_backend_builds_and_stores_kv_without_triton(monkeypatch):
    """With `import triton` failing, the flash_attn backend still imports, validates on CUDA and
    stores new K/V with torch, exactly where the torch backend puts them."""
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.setitem(sys.modules, name, None)  # a None entry makes `import name` fail
    monkeypatch.setitem(sys.modules, "triton", None)  # also where it was not imported yet
    monkeypatch.delitem(sys.modules, "inferlab.kernels.kv_store", raising=False)
    monkeypatch.delitem(sys.modules, "inferlab.plugins.attention.flash_attn_backend", raising=False)
    with pytest.raises(ImportError):
        importlib.import_module("inferlab.kernels.kv_store")
    module = importlib.import_module("inferlab.plugins.attention.flash_attn_backend")

    def attend(q, *args, **kwargs):  # stands in for flash-attn's kernels, which need a GPU
        return torch.zeros_like(q)

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = fake.flash_attn_with_kvcache = fake.flash_attn_func = attend
    monkeypatch.setitem(sys.modules, "flash_attn", fake)

    backend_class = module.FlashAttnBackend
    assert backend_class.validate(torch.device("cuda"), torch.bfloat16, 256, 128, torch.bfloat16) == []
    backend = backend_class()
    assert backend.store_kv is module.store_kv_torch

    num_tokens, num_kv_heads, head_dim, block_size = 5, 2, 8, 16
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(num_tokens, 4, head_dim, generator=gen)
    inputs = AttentionInputs(
        query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        seq_lens=torch.tensor([2, 3], dtype=torch.int32),
        context_lens=torch.tensor([0, 0], dtype=torch.int32),
        block_tables=torch.tensor([[3], [1]], dtype=torch.int32),
        slot_mapping=torch.tensor([48, 49, 16, 17, 18]),
        max_query_len=3,
        max_seq_len=3,
        is_decode=False,
        block_size=block_size,
    )
    shape = backend.kv_cache_shape(4, block_size, num_kv_heads, head_dim)
    cache, expected = torch.zeros(shape), torch.zeros(shape)
    backend.forward(q, k, v, cache, backend.build_metadata(inputs), 0.5)
    torch_backend = TorchBackend()
    torch_backend.forward(q, k, v, expected, torch_backend.build_metadata(inputs), 0.5)
    assert cache.count_nonzero() > 0
    assert torch.equal(cache, expected)


def test_flash_attn_validate_names_head_dims_the_installed_build_cannot_run(monkeypatch):
    """A trimmed flash-attn build serves some head dims only; validate asks the build by a call."""
    from inferlab.plugins.attention.flash_attn_backend import build_problem

    def flash_attn_func(q, k, v):
        if q.shape[-1] % 32:
            raise RuntimeError("This flash attention build does not support headdim not being a multiple of 32.\n...")
        return q

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=flash_attn_func))
    build_problem.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert build_problem(cpu, torch.bfloat16, 64) is None
        problem = build_problem(cpu, torch.bfloat16, 48)
        assert "cannot run head_dim 48" in problem and "multiple of 32" in problem and "..." not in problem
    finally:
        build_problem.cache_clear()
