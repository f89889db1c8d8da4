"""The fp8 KV cache (engine kv_cache_dtype=fp8) through the engine on CPU, with the torch backend:
the setting's checks, the rounding, the room it makes, its reach into the floor, and how far it
moves the logits from a cache in the model's dtype. The Triton kernels' fp8 paths are tested
against the torch backend in test_triton_attention.py and test_model_kernels.py."""

import pytest
import torch

from inferlab import LLM, SamplingParams
from inferlab.conf import compose, engine_arguments
from inferlab.core.kv_cache_dtype import FP8, to_cache_dtype
from inferlab.plugins.attention.flash_attn_backend import FlashAttnBackend
from inferlab.plugins.attention.torch_backend import TorchBackend

ENGINE = dict(attention="torch", device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256)


def test_an_unknown_kv_cache_dtype_names_the_allowed_ones(checkpoint):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8'\], got 'int4'"):
        LLM(checkpoint(), kv_cache_dtype="int4", **ENGINE)


def test_the_setting_reaches_the_engine_from_the_command_line():
    _, settings = engine_arguments(compose(["engine.kv_cache_dtype=fp8"]))
    assert settings["kv_cache_dtype"] == "fp8"


def test_fp8_rounds_to_nearest_even_and_saturates():
    # 1.0625 and 1.1875 are ties between neighbours (to the even mantissa), 2^-10 is half the
    # smallest subnormal; a plain cast would turn 500 into NaN
    x = torch.tensor([1.0, 1.0625, 1.1875, 500.0, -1e6, 2.0**-10, 3.3])
    assert to_cache_dtype(x, FP8).float().tolist() == [1.0, 1.0, 1.25, 448.0, -448.0, 0.0, 3.25]
    assert torch.equal(to_cache_dtype(x, torch.bfloat16), x.to(torch.bfloat16))


def test_backends_say_whether_they_read_an_fp8_cache():
    cpu = torch.device("cpu")
    assert TorchBackend.validate(cpu, torch.bfloat16, 16, 64, FP8) == []
    assert TorchBackend.validate(cpu, torch.bfloat16, 16, 64, torch.float16) == [
        "kv_cache_dtype must be the model's dtype or torch.float8_e4m3fn, got torch.float16"
    ]
    reasons = FlashAttnBackend.validate(cpu, torch.bfloat16, 256, 128, FP8)
    assert any(
        "flash-attn needs the KV cache in the model's dtype torch.bfloat16, got torch.float8_e4m3fn "
        "(use attention='triton' for kv_cache_dtype=fp8)" in r
        for r in reasons
    )


def test_an_fp8_cache_holds_four_times_the_blocks_of_a_float32_one(checkpoint):
    budget = dict(cpu_kv_cache_gib=2.0**-10, max_num_seqs=64)  # 1 MiB: the budget binds, not the sequences
    full = LLM(checkpoint(), **ENGINE, **budget)
    small = LLM(checkpoint(), **ENGINE, **budget, kv_cache_dtype="fp8")
    assert small.runner.kv_cache.dtype == FP8 and full.runner.kv_cache.dtype == torch.float32
    assert small.runner._kv_block_bytes() * 4 == full.runner._kv_block_bytes()
    assert small.runner.num_kv_blocks == 2**20 // small.runner._kv_block_bytes()
    assert small.runner.num_kv_blocks >= 4 * full.runner.num_kv_blocks
    assert small.runner.kv_cache.numel() * small.runner.kv_cache.element_size() <= 2**20


class RecordingSampler:
    """Keeps each step's logits (rows in batch order); returns the argmax, or the tokens another
    run chose at the same step (teacher forcing, so both runs see the same sequences)."""

    def __init__(self, forced: list[torch.Tensor] | None = None):
        self.forced = forced
        self.logits, self.tokens = [], []

    def __call__(self, logits, params):
        self.logits.append(logits.float().clone())
        self.tokens.append(logits.argmax(dim=-1) if self.forced is None else self.forced[len(self.tokens)])
        return self.tokens[-1]


def test_fp8_moves_the_logits_by_its_rounding_only(checkpoint):
    """Against a float32 cache, with prompts prefilled in chunks that read the cached ones back and
    the fp8 run forced along the float32 run's tokens: logits stay within a few percent (each
    cached value is off by at most 1/16 of itself; this random model moved them by 3.4-5.8% a
    step). A cache that stored garbage or misread it would move them by tens of percent."""
    prompts = [list(range(3, 90)), [7, 1, 8, 2, 8] * 9]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    samplers = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(checkpoint("gqa4-untied"), **ENGINE, max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype)
        forced = samplers["auto"].tokens if kv_cache_dtype == "fp8" else None
        llm.runner.sampler = samplers[kv_cache_dtype] = RecordingSampler(forced)
        llm.generate(prompts, params, use_tqdm=False)
    logits, fp8_logits = samplers["auto"].logits, samplers["fp8"].logits
    assert len(logits) == len(fp8_logits) >= 12
    errors = [((b - a).norm(dim=-1) / a.norm(dim=-1)).max().item() for a, b in zip(logits, fp8_logits)]
    print("relative logit error per step, fp8 against float32:", [round(e, 4) for e in errors])
    assert 0 < max(errors) < 0.1, errors
