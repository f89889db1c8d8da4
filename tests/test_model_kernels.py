"""The model's Triton kernels (q/k norm + rotary, SiLU*mul, RMSNorm) against the torch code they replace,
and a greedy generate through them against Hugging Face. Without CUDA the kernels run in Triton's
interpreter, so TRITON_INTERPRET is set before the kernel modules are first imported."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from inferlab import LLM, SamplingParams  # noqa: E402
from inferlab.plugins.models import rms_norm_kernel  # noqa: E402
from inferlab.plugins.models.layers import RotaryEmbedding, add_rms_norm, rms_norm, silu_and_mul  # noqa: E402
from inferlab.plugins.models.qk_norm_rope_kernel import qk_norm_rope  # noqa: E402
from inferlab.plugins.models.silu_mul_kernel import silu_and_mul as silu_mul_kernel  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def unfused(qkv, positions, q_weight, k_weight, rotary, eps, num_heads, num_kv_heads, head_dim):
    q = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(-1, num_kv_heads, head_dim)
    return rotary(positions, rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps))


# (tokens, query heads, KV heads, head_dim, dtype): q+k heads a power of two or not, GQA and MHA
CASES = [
    (5, 4, 2, 32, torch.float32),
    (3, 16, 8, 128, torch.float32),
    (7, 3, 1, 64, torch.float32),
    # Triton's interpreter truncates float32 -> bfloat16 where CUDA rounds to nearest, so the
    # bf16 rounding points are checked on the GPU only
    pytest.param(6, 4, 4, 16, torch.bfloat16, marks=pytest.mark.gpu),
    pytest.param(4, 16, 8, 128, torch.bfloat16, marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim,dtype", CASES)
def test_kernel_matches_unfused_norms_and_rotary(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    torch.manual_seed(num_tokens)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(num_tokens, width, device=DEVICE) * 3).to(dtype)
    q_weight = (torch.rand(head_dim, device=DEVICE) + 0.5).to(dtype)
    k_weight = (torch.rand(head_dim, device=DEVICE) + 0.5).to(dtype)
    positions = torch.randint(0, 500, (num_tokens,), device=DEVICE)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0).to(DEVICE)
    before = qkv.clone()
    q, k = qk_norm_rope(qkv, positions, q_weight, k_weight, rotary.cos_sin, 1e-6, num_heads, num_kv_heads, head_dim)
    want_q, want_k = unfused(qkv, positions, q_weight, k_weight, rotary, 1e-6, num_heads, num_kv_heads, head_dim)
    assert q.shape == want_q.shape and k.shape == want_k.shape and q.dtype == dtype
    # float32: rounding order only. bf16: the same rounding points, but a last-bit difference in
    # rsqrt can flip a rounding of a normalized value (|x| < 8, one bf16 step <= 2**-5), and the
    # rotation adds two of them; such flips are rare, so the mean difference stays far smaller.
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-6, atol=2**-4)
    for got, want in ((q, want_q), (k, want_k)):
        torch.testing.assert_close(got, want, **tolerance)
        assert (got.float() - want.float()).abs().mean() < (1e-6 if dtype == torch.float32 else 2e-3)
    assert torch.equal(qkv, before)  # the input (and so v, read from it later) is untouched


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_kernel_stores_k_and_v_in_their_cache_slots(dtype):
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    torch.manual_seed(0)
    qkv = (torch.randn(4, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE) * 3).to(dtype)
    q_weight, k_weight = (torch.rand(2, head_dim, device=DEVICE) + 0.5).to(dtype)
    positions = torch.tensor([7, 0, 33, 2], device=DEVICE)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0).to(DEVICE)
    cache = torch.zeros(2, 3, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    slots = torch.tensor([5, -1, 40, 16], device=DEVICE)  # -1: a padding row, stores nothing
    q, k = qk_norm_rope(qkv, positions, q_weight, k_weight, rotary.cos_sin, 1e-6, num_heads, num_kv_heads, head_dim,
                        kv_store=(cache[0], cache[1], slots))
    want_q, want_k = qk_norm_rope(qkv, positions, q_weight, k_weight, rotary.cos_sin, 1e-6, num_heads, num_kv_heads,
                                  head_dim)
    assert k is None and torch.equal(q, want_q)
    want_v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(-1, num_kv_heads, head_dim)
    expected = torch.zeros_like(cache)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0].view(-1, num_kv_heads, head_dim)[slot] = want_k[token]
            expected[1].view(-1, num_kv_heads, head_dim)[slot] = want_v[token]
    assert torch.equal(cache, expected)
    with pytest.raises(ValueError, match="kv_store caches must be contiguous"):
        qk_norm_rope(qkv, positions, q_weight, k_weight, rotary.cos_sin, 1e-6, num_heads, num_kv_heads, head_dim,
                     kv_store=(cache[0].transpose(0, 1), cache[1], slots))


def test_no_tokens_is_empty():
    qkv = torch.empty(0, (4 + 2 * 2) * 32, device=DEVICE)
    rotary = RotaryEmbedding(32, 16, 10000.0).to(DEVICE)
    q, k = qk_norm_rope(qkv, torch.empty(0, dtype=torch.int64, device=DEVICE), torch.ones(32, device=DEVICE),
                        torch.ones(32, device=DEVICE), rotary.cos_sin, 1e-6, 4, 2, 32)
    assert q.shape == (0, 4, 32) and k.shape == (0, 2, 32)


@pytest.mark.parametrize("num_tokens,width,dtype", [
    (3, 40, torch.float32),  # narrower than one block
    (5, 2500, torch.float32),  # several blocks a row, the last one partial
    (0, 64, torch.float32),
    pytest.param(7, 3072, torch.bfloat16, marks=pytest.mark.gpu),  # bf16 rounding: see CASES above
])
def test_silu_mul_kernel_matches_torch(num_tokens, width, dtype):
    torch.manual_seed(width)
    x = (torch.randn(num_tokens, 2 * width, device=DEVICE) * 4).to(dtype)
    got = silu_mul_kernel(x)
    want = silu_and_mul(x)
    assert got.shape == (num_tokens, width) and got.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("num_tokens,width,dtype", [
    (3, 1024, torch.float32),
    (5, 40, torch.float32),  # not a power of two: a masked tail
    (0, 64, torch.float32),
    pytest.param(9, 1024, torch.bfloat16, marks=pytest.mark.gpu),  # bf16 rounding: see CASES above
])
def test_rms_norm_kernels_match_torch(num_tokens, width, dtype):
    torch.manual_seed(width)
    x = (torch.randn(num_tokens, width, device=DEVICE) * 3).to(dtype)
    residual = (torch.randn(num_tokens, width, device=DEVICE) * 3).to(dtype)
    weight = (torch.rand(width, device=DEVICE) + 0.5).to(dtype)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-6)
    torch.testing.assert_close(rms_norm_kernel.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), **tolerance)
    got, got_residual = rms_norm_kernel.add_rms_norm(x, residual, weight, 1e-6)
    want, want_residual = add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(got, want, **tolerance)
    torch.testing.assert_close(got_residual, want_residual, rtol=0, atol=0)  # one rounding of the same sum
    assert got.shape == (num_tokens, width) and got.dtype == dtype


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_greedy_generate_through_the_kernels_matches_hf(checkpoint, hf_greedy, attention):
    # torch's backend stores K/V itself; triton's lets the q/k kernel store them (kv_store_target)
    path = checkpoint("gqa4-untied")
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=16, max_num_batched_tokens=24, attention=attention,
              model_options={"triton_kernels": True})
    layer = llm.runner.model.layers[0]
    assert layer.self_attn.qk_norm_rope is qk_norm_rope and layer.mlp.act is silu_mul_kernel
    assert layer.input_layernorm.add_norm is rms_norm_kernel.add_rms_norm
    assert llm.runner.model.norm.norm is rms_norm_kernel.rms_norm
    assert (layer.self_attn.kv_store_target is not None) == (attention == "triton")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [2, 71, 82, 81, 82, 84, 59, 4, 52, 35, 36, 2, 87, 47, 13, 52,
                                                          66, 24, 97, 75, 7, 1, 3, 5, 9, 11, 13, 17, 19]]
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert out["token_ids"] == hf_greedy(path, prompt, 6)


def test_asking_for_the_kernels_with_an_odd_head_dim_is_an_error_but_the_default_falls_back(checkpoint, caplog):
    path = checkpoint("gqa2-tied")
    from inferlab.plugins.models.qwen3 import _triton_kernels
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    assert _triton_kernels(config, on_cuda=True, asked=None) == (qk_norm_rope, silu_mul_kernel, rms_norm_kernel.rms_norm,
                                                                 rms_norm_kernel.add_rms_norm)
    assert _triton_kernels(config, on_cuda=False, asked=None) is None  # CPU: torch code
    assert _triton_kernels(config, on_cuda=True, asked=False) is None
    config.head_dim = 48
    with pytest.raises(ValueError, match="power-of-two head_dim >= 16, got 48; set model_options.triton_kernels=false"):
        _triton_kernels(config, on_cuda=True, asked=True)
    caplog.set_level("INFO", logger="inferlab")
    assert _triton_kernels(config, on_cuda=True, asked=None) is None  # the CUDA default falls back
    assert "got 48; using the torch code" in caplog.text


def test_pdl_only_on_compiled_hopper_kernels_and_switchable(monkeypatch):
    """Kernels launch with programmatic dependent launch on CUDA devices of compute capability 9.0
    or more, compiled, unless INFERLAB_PDL=0; never on CPU or under the interpreter."""
    from inferlab.plugins import pdl
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability["value"])
    cuda = torch.device("cuda", 0)

    def check(env_pdl, interpret, cap, expected):
        pdl._enabled.cache_clear()
        # pdl reads TRITON_INTERPRET once, at import, as Triton does: stand in for that reading
        monkeypatch.setattr(pdl, "INTERPRETED", interpret == "1")
        if env_pdl is None:
            monkeypatch.delenv("INFERLAB_PDL", raising=False)
        else:
            monkeypatch.setenv("INFERLAB_PDL", env_pdl)
        capability["value"] = cap
        assert pdl.enabled(cuda) is expected, (env_pdl, interpret, cap)
        assert pdl.launch_options(cuda) == ({"PDL": True, "launch_pdl": True} if expected else {"PDL": False})

    try:
        check(None, "0", (9, 0), True)
        check("1", "0", (10, 0), True)
        check("0", "0", (9, 0), False)
        check(None, "1", (9, 0), False)
        check(None, "0", (8, 0), False)
        assert pdl.enabled(torch.device("cpu")) is False
        assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    finally:
        pdl._enabled.cache_clear()  # the real device's answer, for the tests after this one
