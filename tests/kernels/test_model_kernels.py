"""The model's Triton kernels (q/k norm + rotary, SiLU*mul, RMSNorm, the split-K GEMM whose partials
the RMSNorm sums) against the torch code they replace, and a greedy generate through them against
Hugging Face. Without CUDA the kernels run in Triton's interpreter, so TRITON_INTERPRET is set
before the kernel modules are first imported."""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from inferlab import LLM, SamplingParams  # noqa: E402
from inferlab.core.kv_cache_dtype import FP8, to_cache_dtype  # noqa: E402
from inferlab.core.parallel import TPGroup  # noqa: E402
from inferlab.kernels import gemv as gemv_kernel  # noqa: E402
from inferlab.kernels import rms_norm as rms_norm_kernel  # noqa: E402
from inferlab.kernels import split_k_gemm  # noqa: E402
from inferlab.kernels.qk_norm_rope import qk_norm_rope  # noqa: E402
from inferlab.kernels.qk_norm_rope import rotary as rotary_kernel  # noqa: E402
from inferlab.kernels.silu_mul import silu_and_mul as silu_mul_kernel  # noqa: E402
from inferlab.plugins.models.layers import (  # noqa: E402
    ColumnParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    add_rms_norm,
    rms_norm,
    silu_and_mul,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def unfused(qkv, positions, q_weight, k_weight, rotary, eps, num_heads, num_kv_heads, head_dim):
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(-1, num_kv_heads, head_dim)
    return rotary(positions, rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps))


def wrapping_engine(path, attention="triton", max_num_batched_tokens=24, **model_options):
    """A small engine through the Triton kernels with model_options, eager on CUDA too: a captured
    graph would replay past the kernels a test wraps to see them called."""
    return LLM(
        path,
        kvcache_block_size=16,
        num_kvcache_blocks=16,
        max_num_batched_tokens=max_num_batched_tokens,
        attention=attention,
        model_options={"triton_kernels": True, **model_options},
        enforce_eager=True,
    )


# (tokens, query heads, KV heads, head_dim, dtype): q+k heads a power of two or not, GQA and MHA
# two prompts for the greedy comparisons against Hugging Face: the second is longer than a prefill chunk
GREEDY_PROMPTS = [
    [3, 14, 15, 92, 65, 35, 89, 79, 32, 38],
    [2, 71, 82, 81, 82, 84, 59, 4, 52, 35, 36, 2, 87, 47, 13, 52, 66, 24, 97, 75, 7, 1, 3, 5, 9, 11, 13, 17, 19],
]
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


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float32, None),
        (torch.float32, FP8),
        pytest.param(torch.bfloat16, None, marks=pytest.mark.gpu),
        pytest.param(torch.bfloat16, FP8, marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm_rope", "rotary"])
def test_kernel_stores_k_and_v_in_their_cache_slots(dtype, cache_dtype, norm):
    """Into a cache of the model's dtype, or an fp8 one (rounded as to_cache_dtype rounds), with
    the q/k norms (Qwen3) and without them (the Llama family)."""
    cache_dtype = cache_dtype or dtype
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    torch.manual_seed(0)
    qkv = (torch.randn(4, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE) * 3).to(dtype)
    q_weight, k_weight = (torch.rand(2, head_dim, device=DEVICE) + 0.5).to(dtype)
    positions = torch.tensor([7, 0, 33, 2], device=DEVICE)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0).to(DEVICE)
    cache = torch.zeros(2, 3, block_size, num_kv_heads, head_dim, dtype=cache_dtype, device=DEVICE)
    slots = torch.tensor([5, -1, 40, 16], device=DEVICE)  # -1: a padding row, stores nothing
    heads = (num_heads, num_kv_heads, head_dim)

    def kernel(qkv, positions, kv_store=None):
        if norm:
            return qk_norm_rope(qkv, positions, q_weight, k_weight, rotary.cos_sin, 1e-6, *heads, kv_store=kv_store)
        return rotary_kernel(qkv, positions, rotary.cos_sin, *heads, kv_store=kv_store)

    q, k = kernel(qkv, positions, kv_store=(cache[0], cache[1], slots))
    want_q, want_k = kernel(qkv, positions)
    assert k is None and torch.equal(q, want_q)
    want_v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(-1, num_kv_heads, head_dim)
    expected = torch.zeros_like(cache)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0].view(-1, num_kv_heads, head_dim)[slot] = to_cache_dtype(want_k[token], cache_dtype)
            expected[1].view(-1, num_kv_heads, head_dim)[slot] = to_cache_dtype(want_v[token], cache_dtype)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    with pytest.raises(ValueError, match="kv_store caches must be contiguous"):
        kernel(qkv, positions, kv_store=(cache[0].transpose(0, 1), cache[1], slots))
    empty_q, empty_k = kernel(qkv[:0], positions[:0])
    assert empty_q.shape == (0, num_heads, head_dim) and empty_k.shape == (0, num_kv_heads, head_dim)


def test_no_tokens_is_empty():
    qkv = torch.empty(0, (4 + 2 * 2) * 32, device=DEVICE)
    rotary = RotaryEmbedding(32, 16, 10000.0).to(DEVICE)
    q, k = qk_norm_rope(
        qkv,
        torch.empty(0, dtype=torch.int64, device=DEVICE),
        torch.ones(32, device=DEVICE),
        torch.ones(32, device=DEVICE),
        rotary.cos_sin,
        1e-6,
        4,
        2,
        32,
    )
    assert q.shape == (0, 4, 32) and k.shape == (0, 2, 32)


# Llama's rotary without the q/k norms: the same cases, plus a llama3-scaled table
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim,dtype", CASES)
def test_rotary_kernel_matches_unfused_rotary(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    torch.manual_seed(num_tokens)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(num_tokens, width, device=DEVICE) * 3).to(dtype)
    positions = torch.randint(0, 500, (num_tokens,), device=DEVICE)
    scaling = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, scaling=scaling).to(DEVICE)
    before = qkv.clone()
    q, k = rotary_kernel(qkv, positions, rotary.cos_sin, num_heads, num_kv_heads, head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    want_q, want_k = rotary(
        positions,
        qkv[:, :q_size].view(-1, num_heads, head_dim),
        qkv[:, q_size : q_size + kv_size].view(-1, num_kv_heads, head_dim),
    )
    assert q.shape == want_q.shape and k.shape == want_k.shape and q.dtype == dtype
    # one rounding of the same float32 rotation: a last-bit difference at most (an FMA on the GPU)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-6)
    torch.testing.assert_close(q, want_q, **tolerance)
    torch.testing.assert_close(k, want_k, **tolerance)
    assert torch.equal(qkv, before)


QWEN2_WIDE = dict(
    architecture="Qwen2ForCausalLM", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=None
)


# the Triton GEMM's batches for qkv_proj: none where its input is narrower than one 128-wide step
# (hidden 64) or where it has a bias (Qwen2)
# Triton's interpreter makes each generate here slow: one case in the default run, the rest with -m slow.
# The attention backend only decides who stores K/V (the rotary kernel for triton's, torch's
# backend itself), which llama-gqa-llama3 checks both ways; the other shapes each add a path of
# their own (mistral's qkv through the Triton GEMM, Qwen2's biases), taken once, with triton's.
@pytest.mark.parametrize(
    "shape,qkv_triton_tokens,attention",
    [
        pytest.param("llama-gqa-llama3", 0, "triton", id="triton-llama-gqa-llama3"),
        pytest.param("llama-gqa-llama3", 0, "torch", id="torch-llama-gqa-llama3", marks=pytest.mark.slow),
        pytest.param("mistral-gqa4", 64, "triton", id="triton-mistral-gqa4", marks=pytest.mark.slow),
        pytest.param(QWEN2_WIDE, 0, "triton", id="triton-qwen2-wide", marks=pytest.mark.slow),
    ],
)
def test_greedy_generate_of_the_llama_family_through_the_kernels_matches_hf(
    checkpoint, hf_greedy, shape, qkv_triton_tokens, attention
):
    """The rotary kernel in place of the q/k norm one, with the other kernels as for Qwen3."""
    path = checkpoint(shape)
    llm = LLM(
        path,
        kvcache_block_size=16,
        num_kvcache_blocks=16,
        max_num_batched_tokens=24,
        attention=attention,
        model_options={"triton_kernels": True, "split_k_tokens": 64, "triton_gemm_tokens": 64},
    )
    layer = llm.runner.model.layers[0]
    assert layer.self_attn.qk_rotary is rotary_kernel and layer.self_attn.q_norm is None
    assert layer.mlp.act is silu_mul_kernel and layer.input_layernorm.add_norm is rms_norm_kernel.add_rms_norm
    assert (layer.self_attn.kv_store_target is not None) == (attention == "triton")
    assert layer.self_attn.qkv_proj.triton_tokens == qkv_triton_tokens
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for prompt, out in zip(GREEDY_PROMPTS, llm.generate(GREEDY_PROMPTS, params, use_tqdm=False)):
        assert out["token_ids"] == hf_greedy(path, prompt, 6)


@pytest.mark.parametrize(
    "num_tokens,width,dtype",
    [
        (3, 40, torch.float32),  # narrower than one block
        (5, 2500, torch.float32),  # several blocks a row, the last one partial
        (0, 64, torch.float32),
        pytest.param(7, 3072, torch.bfloat16, marks=pytest.mark.gpu),  # bf16 rounding: see CASES above
    ],
)
def test_silu_mul_kernel_matches_torch(num_tokens, width, dtype):
    torch.manual_seed(width)
    x = (torch.randn(num_tokens, 2 * width, device=DEVICE) * 4).to(dtype)
    got = silu_mul_kernel(x)
    want = silu_and_mul(x)
    assert got.shape == (num_tokens, width) and got.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize(
    "num_tokens,width,dtype",
    [
        (3, 1024, torch.float32),
        (5, 40, torch.float32),  # not a power of two: a masked tail
        (0, 64, torch.float32),
        pytest.param(9, 1024, torch.bfloat16, marks=pytest.mark.gpu),  # bf16 rounding: see CASES above
    ],
)
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


@pytest.mark.slow  # the llama family's generate in the default run takes the same kernels, rotary aside
@pytest.mark.parametrize("attention,split_k_tokens", [("torch", 64), ("triton", 64), ("triton", 0)])
def test_greedy_generate_through_the_kernels_matches_hf(checkpoint, hf_greedy, attention, split_k_tokens):
    # torch's backend stores K/V itself; triton's lets the q/k kernel store them (kv_store_target)
    path = checkpoint("gqa4-untied")
    llm = wrapping_engine(path, attention=attention, split_k_tokens=split_k_tokens)
    layer = llm.runner.model.layers[0]
    assert layer.self_attn.qk_rotary is qk_norm_rope and layer.mlp.act is silu_mul_kernel
    assert layer.input_layernorm.add_norm is rms_norm_kernel.add_rms_norm
    assert llm.runner.model.norm.norm is rms_norm_kernel.rms_norm
    assert (layer.self_attn.kv_store_target is not None) == (attention == "triton")
    # o_proj [128, 256] splits K into two 128-wide steps; down_proj [128, 128] has one step, so no split
    projections = [p for layer in llm.runner.model.layers for p in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    calls = []
    for p in projections:
        if p._split_k is not None:
            p._split_k = lambda x, w, kernel=p._split_k: calls.append(x.shape[0]) or kernel(x, w)
    assert [p.partials_tokens for p in projections] == [split_k_tokens, 0] * len(llm.runner.model.layers)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for prompt, out in zip(GREEDY_PROMPTS, llm.generate(GREEDY_PROMPTS, params, use_tqdm=False)):
        assert out["token_ids"] == hf_greedy(path, prompt, 6)
    assert bool(calls) == (split_k_tokens > 0)  # the split path ran


@pytest.mark.slow
@pytest.mark.parametrize("prompt_len,tiling", [(100, (32, 128, 2)), (130, (64, 128, 2))])
def test_greedy_generate_with_the_split_k_tilings_above_64_rows_matches_hf(checkpoint, hf_greedy, prompt_len, tiling):
    """A prompt of 65-128 tokens in one prefill chunk takes the middle tiling (two row blocks of
    32-wide columns, K in 2), one of more than 128 the wider one (64-wide columns); their partials
    go through the norms, and the decode step takes the tiling for a few rows (not the GEMVs that
    one sequence's steps take by default)."""
    path = checkpoint("gqa4-untied")
    llm = wrapping_engine(path, max_num_batched_tokens=256, split_k_tokens=256, gemv_decode=False)
    rows = []
    for layer in llm.runner.model.layers:
        o_proj = layer.self_attn.o_proj
        o_proj._split_k = lambda x, w, kernel=o_proj._split_k: rows.append(x.shape[0]) or kernel(x, w)
    prompt = [(7 * i + 3) % 97 + 1 for i in range(prompt_len)]
    # one decode step is enough to take the tiling for a few rows, and each costs the interpreter dear
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(path, prompt, 2)
    assert split_k_gemm.plan(128, 256, prompt_len) == tiling and prompt_len in rows and 1 in rows


def test_split_k_plan_splits_narrow_weights_and_wide_deep_ones_into_whole_steps():
    assert split_k_gemm.plan(1024, 2048) == (32, 128, 4)  # Qwen3-0.6B's o_proj: 32 column blocks
    assert split_k_gemm.plan(1024, 3072, 64) == (32, 128, 4)  # its down_proj
    assert split_k_gemm.plan(1024, 3072, 65) == (32, 128, 2)  # two row blocks: fewer splits
    assert split_k_gemm.plan(1024, 3072, 128) == (32, 128, 2)
    assert split_k_gemm.plan(1024, 3072, 129) == (64, 128, 2)  # three or more: wider tiles too
    assert split_k_gemm.plan(128, 256) == (32, 128, 2)  # 256 = 2 whole steps, not 4
    assert split_k_gemm.plan(4096, 4096) == (32, 128, 2)  # Qwen3-8B's o_proj: wide, but K deep
    assert split_k_gemm.plan(4096, 12288, 64) == (32, 128, 2)  # its down_proj
    assert split_k_gemm.plan(4096, 4096, 65) is None  # 128 column blocks fill the GPU above 64 rows
    assert split_k_gemm.plan(4096, 2048) is None  # wide and shallow: cuBLAS
    assert split_k_gemm.plan(4096, 4096 + 128) is None  # halves of K not in whole 128-wide steps
    assert split_k_gemm.plan(128, 192) is None  # no split into whole 128-wide steps
    assert split_k_gemm.plan(100, 256) is None  # no whole column blocks
    assert split_k_gemm.plan(32, 256, 200) is None  # no whole 64-wide column blocks


@pytest.mark.parametrize(
    "num_tokens,n,k,dtype",
    [
        (1, 64, 512, torch.float32),
        (5, 128, 256, torch.float32),
        (70, 64, 512, torch.float32),  # two row blocks, the second partial
        (130, 128, 256, torch.float32),  # three row blocks: the wider tiles
        pytest.param(3, 2048, 4096, torch.float32, marks=pytest.mark.slow),  # wide and deep: a split in two
        (0, 64, 256, torch.float32),
        pytest.param(9, 1024, 3072, torch.bfloat16, marks=pytest.mark.gpu),
        pytest.param(256, 1024, 2048, torch.bfloat16, marks=pytest.mark.gpu),
        pytest.param(1, 4096, 12288, torch.bfloat16, marks=pytest.mark.gpu),
    ],
)
def test_split_k_partials_are_the_products_of_the_k_slices(num_tokens, n, k, dtype):
    torch.manual_seed(n + num_tokens)
    x = torch.randn(num_tokens, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) * 0.05).to(dtype)
    tiling = split_k_gemm.plan(n, k, num_tokens)
    partials = split_k_gemm.linear_partials(x, weight)
    assert partials.shape == (tiling.split, num_tokens, n) and partials.dtype == torch.float32
    part = k // tiling.split
    # float32: sums of k products in another order than torch's (off by 1.1e-5 at k = 4,096 on an H200)
    tolerance = dict(rtol=1e-5, atol=1e-5 * max(1, k // 1024)) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    for s in range(tiling.split):
        want = x[:, s * part : (s + 1) * part].float() @ weight[:, s * part : (s + 1) * part].float().T
        torch.testing.assert_close(partials[s], want, **tolerance)
    torch.testing.assert_close(partials.sum(0), x.float() @ weight.float().T, **tolerance)


@pytest.mark.parametrize(
    "num_tokens,width,splits,dtype",
    [
        (3, 1024, 4, torch.float32),
        (5, 40, 2, torch.float32),  # a masked tail
        (0, 64, 2, torch.float32),
        pytest.param(9, 1024, 4, torch.bfloat16, marks=pytest.mark.gpu),
        pytest.param(1, 4096, 2, torch.bfloat16, marks=pytest.mark.gpu),  # 16 warps a row
    ],
)
def test_rms_norm_kernels_sum_split_k_partials(num_tokens, width, splits, dtype):
    """The norms read float32 partials as their sum, rounded once, and answer in the weight's dtype."""
    torch.manual_seed(width)
    partials = torch.randn(splits, num_tokens, width, device=DEVICE) * 2
    residual = (torch.randn(num_tokens, width, device=DEVICE) * 3).to(dtype)
    weight = (torch.rand(width, device=DEVICE) + 0.5).to(dtype)
    summed = partials.sum(0)
    got, got_residual = rms_norm_kernel.add_rms_norm(partials, residual, weight, 1e-6)
    want_residual = (summed + residual.float()).to(dtype)
    want = rms_norm(want_residual.float(), weight.float(), 1e-6)  # layers.rms_norm: float32 math
    assert got.dtype == got_residual.dtype == dtype and got.shape == (num_tokens, width)
    exact = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-6)
    torch.testing.assert_close(
        got_residual, want_residual, **(exact if dtype == torch.float32 else dict(rtol=2**-8, atol=2**-8))
    )
    torch.testing.assert_close(got.float(), want, **exact)
    torch.testing.assert_close(
        rms_norm_kernel.rms_norm(partials, weight, 1e-6).float(), rms_norm(summed, weight.float(), 1e-6), **exact
    )


def test_row_parallel_linear_returns_partials_only_on_one_rank_without_bias():
    assert RowParallelLinear(2048, 1024, TPGroup()).return_partials(64)
    assert not RowParallelLinear(2048, 1024, TPGroup()).return_partials(0)
    assert not RowParallelLinear(2048, 1024, TPGroup(rank=0, size=2)).return_partials(64)  # needs the all-reduce
    assert not RowParallelLinear(2048, 1024, TPGroup(), bias=True).return_partials(64)
    assert not RowParallelLinear(2048, 4096, TPGroup()).return_partials(64)  # wide and shallow: no gain
    wide = RowParallelLinear(4096, 4096, TPGroup())
    assert wide.return_partials(256) and wide.partials_tokens == 64  # wide and deep: split up to 64 only
    narrow = RowParallelLinear(256, 32, TPGroup())
    assert narrow.return_partials(129) and narrow.partials_tokens == 128  # no 64-wide tiling above 128
    assert split_k_gemm.max_planned_tokens(32, 256, 100) == 100 and split_k_gemm.max_planned_tokens(32, 192, 8) == 0
    linear = RowParallelLinear(256, 128, TPGroup()).to(DEVICE)
    linear.weight.data.normal_(0, 0.05)
    assert linear.return_partials(4)
    x = torch.randn(4, 256, device=DEVICE)
    assert linear(x).shape == (2, 4, 128)  # partials up to 4 tokens
    torch.testing.assert_close(linear(x).sum(0), x @ linear.weight.T, rtol=1e-5, atol=1e-5)
    assert linear(torch.randn(5, 256, device=DEVICE)).shape == (5, 128)  # cuBLAS above
    assert RowParallelLinear(256, 128, TPGroup())(torch.randn(0, 256)).shape == (0, 128)  # off: an empty batch too


@pytest.mark.parametrize("option", ["split_k_tokens", "triton_gemm_tokens"])
@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_token_thresholds_must_be_counts(checkpoint, option, value):
    from inferlab.core.plugins import PluginError

    # a wrong type is caught by the options class, a negative count by the model itself
    expected = (
        f"{option} must be an integer >= 0" if value == -1 else f"Value '{value}' of type '{type(value).__name__}'"
    )
    with pytest.raises(PluginError, match=expected):
        LLM(
            checkpoint("gqa2-tied"),
            kvcache_block_size=16,
            num_kvcache_blocks=8,
            model_options={"triton_kernels": True, option: value},
        )


@pytest.mark.parametrize(
    "num_tokens,n,k,dtype",
    [
        (1, 96, 256, torch.float32),
        (70, 64, 128, torch.float32),  # two row blocks
        (0, 64, 128, torch.float32),
        pytest.param(9, 4096, 1024, torch.bfloat16, marks=pytest.mark.gpu),  # Qwen3-0.6B's qkv_proj
        pytest.param(64, 6144, 1024, torch.bfloat16, marks=pytest.mark.gpu),  # its gate_up_proj: 64-wide blocks
    ],
)
def test_triton_linear_is_the_matmul(num_tokens, n, k, dtype):
    torch.manual_seed(n + num_tokens)
    x = torch.randn(num_tokens, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) * 0.05).to(dtype)
    got = split_k_gemm.linear(x, weight)
    assert got.shape == (num_tokens, n) and got.dtype == dtype
    want = (x.float() @ weight.float().T).to(dtype)  # the float32 product rounded once
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(got, want, **tolerance)


def test_wide_plan_and_column_parallel_linear_use_of_it():
    assert split_k_gemm.wide_plan(4096, 1024) == (32, 128, 1)  # Qwen3-0.6B's qkv_proj: 128 column blocks
    assert split_k_gemm.wide_plan(6144, 1024) == (64, 128, 1)  # its gate_up_proj
    assert split_k_gemm.wide_plan(96, 192) is None  # K not in whole 128-wide steps
    assert split_k_gemm.wide_plan(100, 256) is None  # no whole column blocks
    assert not ColumnParallelLinear(256, 128, TPGroup(), bias=True).use_triton_gemm(64)
    assert not ColumnParallelLinear(256, 128, TPGroup()).use_triton_gemm(0)
    assert not ColumnParallelLinear(192, 128, TPGroup()).use_triton_gemm(64)
    linear = ColumnParallelLinear(256, 128, TPGroup(rank=1, size=2)).to(DEVICE)  # a shard: no all-reduce to mind
    linear.weight.data.normal_(0, 0.05)
    assert linear.use_triton_gemm(4)
    calls = []
    linear._triton_linear = lambda x, w, kernel=linear._triton_linear: calls.append(x.shape[0]) or kernel(x, w)
    for rows in (4, 5):  # the Triton GEMM up to 4 rows, cuBLAS above
        x = torch.randn(rows, 256, device=DEVICE)
        torch.testing.assert_close(linear(x), x @ linear.weight.T, rtol=1e-5, atol=1e-5)
    assert calls == [4]
    assert ColumnParallelLinear(256, 128, TPGroup())(torch.randn(0, 256)).shape == (0, 128)  # off: an empty batch too


@pytest.mark.slow
def test_greedy_generate_through_the_triton_gemm_matches_hf(checkpoint, hf_greedy):
    path = checkpoint("gqa4-untied")
    llm = wrapping_engine(path, triton_gemm_tokens=16)
    rows = []
    for layer in llm.runner.model.layers:
        for p in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
            assert p.triton_tokens == 16
            p._triton_linear = lambda x, w, kernel=p._triton_linear: rows.append(x.shape[0]) or kernel(x, w)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for prompt, out in zip(GREEDY_PROMPTS, llm.generate(GREEDY_PROMPTS, params, use_tqdm=False)):
        assert out["token_ids"] == hf_greedy(path, prompt, 5)
    assert rows and max(rows) <= 16  # decode steps took it; the 24-token prefill chunks took cuBLAS


def test_asking_for_the_kernels_with_an_odd_head_dim_is_an_error_but_the_default_falls_back(checkpoint, caplog):
    path = checkpoint("gqa2-tied")
    from transformers import AutoConfig

    from inferlab.plugins.models.decoder import triton_kernels_for

    config = AutoConfig.from_pretrained(path)
    assert triton_kernels_for(config, qk_norm=True, on_cuda=True, asked=None) == (
        qk_norm_rope,
        silu_mul_kernel,
        rms_norm_kernel.rms_norm,
        rms_norm_kernel.add_rms_norm,
    )
    assert triton_kernels_for(config, qk_norm=True, on_cuda=False, asked=None) is None  # CPU: torch code
    assert triton_kernels_for(config, qk_norm=True, on_cuda=True, asked=False) is None
    config.head_dim = 48
    with pytest.raises(ValueError, match="power-of-two head_dim >= 16, got 48; set model_options.triton_kernels=false"):
        triton_kernels_for(config, qk_norm=True, on_cuda=True, asked=True)
    caplog.set_level("INFO", logger="inferlab")
    assert triton_kernels_for(config, qk_norm=True, on_cuda=True, asked=None) is None  # the CUDA default falls back
    assert "got 48; using the torch code" in caplog.text


def test_pdl_only_on_compiled_hopper_kernels_and_switchable(monkeypatch):
    """Kernels launch with programmatic dependent launch on CUDA devices of compute capability 9.0
    or more, compiled, unless INFERLAB_PDL=0; never on CPU or under the interpreter."""
    from inferlab.kernels import pdl

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


@pytest.mark.parametrize(
    "n,k,split,prologue,parts,dtype,looped",
    [
        (64, 256, 1, "plain", 1, torch.float32, None),
        (64, 256, 4, "plain", 1, torch.float32, None),  # float32 partials out
        (48, 128, 1, "norm", 1, torch.float32, None),  # 48: 16-column programs, not the slab's 64
        (64, 128, 1, "add_norm", 1, torch.float32, None),
        (64, 128, 1, "add_norm", 3, torch.float32, None),  # the row from float32 partials
        (32, 256, 2, "silu_mul", 1, torch.float32, None),
        (16, 96, 1, "add_norm", 2, torch.float32, None),  # slices of no power of two: tiles masked past them
        (32, 480, 3, "silu_mul", 1, torch.float32, None),
        # looped: (rows, slab), a program's rows read a slab at a time along K
        (64, 256, 1, "add_norm", 3, torch.float32, (8, 256)),  # 8 parts of 32 columns, the norm over all
        (32, 384, 1, "norm", 1, torch.float32, (4, 256)),  # 6 parts of 64
        (64, 192, 1, "silu_mul", 1, torch.float32, (8, 256)),
        (64, 256, 2, "plain", 1, torch.float32, (16, 256)),  # partials of 8 parts each
        (48, 256, 1, "add_norm", 1, torch.float32, (32, 512)),  # 48: 16 rows a program, not 32
        # Qwen3-0.6B's qkv_proj, o_proj, gate_up_proj and down_proj
        pytest.param(4096, 1024, 1, "add_norm", 3, torch.bfloat16, None, marks=pytest.mark.gpu),
        pytest.param(1024, 2048, 1, "plain", 1, torch.bfloat16, None, marks=pytest.mark.gpu),
        pytest.param(6144, 1024, 1, "add_norm", 1, torch.bfloat16, None, marks=pytest.mark.gpu),
        pytest.param(1024, 3072, 3, "silu_mul", 1, torch.bfloat16, None, marks=pytest.mark.gpu),
        # Qwen3-8B's qkv_proj, o_proj and down_proj as planned, and its down_proj split into whole rows
        pytest.param(6144, 4096, 1, "add_norm", 1, torch.bfloat16, None, marks=pytest.mark.gpu),
        pytest.param(4096, 4096, 1, "plain", 1, torch.bfloat16, (8, 8192), marks=pytest.mark.gpu),
        pytest.param(4096, 12288, 1, "silu_mul", 1, torch.bfloat16, (8, 8192), marks=pytest.mark.gpu),
        pytest.param(4096, 12288, 3, "silu_mul", 1, torch.bfloat16, None, marks=pytest.mark.gpu),
    ],
)
def test_gemv_is_the_projection_of_its_row(n, k, split, prologue, parts, dtype, looped):
    """The GEMV's row is what the norm and SiLU*mul kernels would have written, to the bit; its
    product is the float32 product of that row (in partials with a split)."""
    torch.manual_seed(n + k)
    weight = (torch.randn(n, k, device=DEVICE) * 0.05).to(dtype)
    width = 2 * k if prologue == "silu_mul" else k
    x = torch.randn(parts, 1, width, device=DEVICE) * 2
    x = x if parts > 1 else x[0].to(dtype)
    residual = (torch.randn(1, k, device=DEVICE) * 3).to(dtype)
    norm_weight = (torch.rand(k, device=DEVICE) + 0.5).to(dtype)
    kwargs, want_residual = {}, None
    if prologue == "silu_mul":
        row, kwargs = silu_mul_kernel(x), dict(silu_mul=True)
    elif prologue == "norm":
        row, kwargs = rms_norm_kernel.rms_norm(x, norm_weight, 1e-6), dict(norm_weight=norm_weight, eps=1e-6)
    elif prologue == "add_norm":
        row, want_residual = rms_norm_kernel.add_rms_norm(x, residual, norm_weight, 1e-6)
        kwargs = dict(norm_weight=norm_weight, eps=1e-6, residual=residual)
    else:
        row = x
    if looped is not None:
        kwargs.update(rows=looped[0], slab=looped[1])
        assert gemv_kernel.tiling(n, k // split, looped[1], looped[0])[1] < k // split  # more than one part
    got, got_residual = gemv_kernel.gemv(x, weight, split=split, **kwargs)
    if want_residual is None:
        assert got_residual is None
    else:
        assert torch.equal(got_residual, want_residual)
    part = k // split
    want = torch.stack(
        [
            row[:, s * part : (s + 1) * part].float() @ weight[:, s * part : (s + 1) * part].float().T
            for s in range(split)
        ]
    )
    if split == 1:
        want = want[0].to(dtype)
    assert got.shape == want.shape and got.dtype == (torch.float32 if split > 1 else dtype)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(got, want, **tolerance)


def test_gemv_tilings():
    assert gemv_kernel.slab_columns(4096, 1024) == 8  # Qwen3-0.6B's qkv_proj: 512 programs of 16 KB
    assert gemv_kernel.splits_for(4096, 1024) == 1
    assert gemv_kernel.splits_for(1024, 2048) == 1  # its o_proj: 256 programs unsplit
    assert gemv_kernel.splits_for(1024, 3072) == 3  # its down_proj: K in power-of-two slices of 1,024
    assert gemv_kernel.splits_for(4096, 12288) == 3  # Qwen3-8B's
    assert gemv_kernel.splits_for(128, 256) == 16  # too small for 256 programs: the most it can have
    # Qwen3-4B's down_proj [2560, 9728]: no split into power-of-two slices; 2,432-long ones in 4,096-wide
    # tiles, since whole 9,728-long rows would overflow a slab two at a time
    assert gemv_kernel.splits_for(2560, 9728) == 4 and gemv_kernel.slab_columns(2560, 2432) == 2
    assert gemv_kernel.slab_columns(5120, 5120) is None  # Qwen3-14B's qkv_proj: two rows overflow the slab
    assert gemv_kernel.slab_columns(64, 96) == 64 and gemv_kernel.slab_columns(24, 96) == 8
    assert gemv_kernel.slab_columns(3, 1024) is None and gemv_kernel.slab_columns(64, 8) is None
    assert gemv_kernel.splits_for(3, 1024) is None
    # more rows a program, K read a slab at a time in the largest power of two that divides it
    assert gemv_kernel.tiling(4096, 4096, rows=8) == (8, 1024) and gemv_kernel.tiling(2560, 9728, rows=8) == (8, 512)
    assert gemv_kernel.tiling(24, 96, rows=16) == (8, 32) and gemv_kernel.tiling(64, 8, rows=8) is None
    assert gemv_kernel.unsplit_rows(4096, 4096) == 8 and gemv_kernel.unsplit_rows(4096, 12288) == 8  # Qwen3-8B's
    assert gemv_kernel.unsplit_rows(1024, 2048) is None  # Qwen3-0.6B's o_proj: 128 programs of 8 rows
    assert gemv_kernel.splits_for(1024, 2048, rows=8) == 2
    with pytest.raises(ValueError, match="whole row"):
        gemv_kernel.gemv(torch.zeros(1, 256), torch.zeros(64, 256), split=2, norm_weight=torch.ones(256))
    with pytest.raises(ValueError, match="one row of 256"):
        gemv_kernel.gemv(torch.zeros(2, 256), torch.zeros(64, 256))


@pytest.mark.parametrize(
    "fused,intermediate,looped",
    [
        (True, 128, False),
        pytest.param(False, 128, False, marks=pytest.mark.slow),
        pytest.param(True, 120, False, marks=pytest.mark.slow),
        pytest.param(True, 128, True, marks=pytest.mark.slow),
    ],
)
def test_greedy_generate_through_the_gemvs_matches_hf(checkpoint, hf_greedy, fused, intermediate, looped):
    """One sequence's decode steps go through the layers' GEMVs (the prefill chunks of several
    tokens do not), with the norms and SiLU*mul inside them or between them; an intermediate size
    of 120 has no power-of-two slices, so down_proj's tiles are masked past them. looped: o_proj
    and down_proj unsplit, 8 rows a program reading K 32 columns at a time (a slab of 256), as
    Qwen3-8B's run at its full slab."""
    path = checkpoint("gqa4-untied", intermediate_size=intermediate)
    llm = wrapping_engine(path, gemv_decode=True, gemv_fused=fused)
    calls = []
    for layer in llm.runner.model.layers:
        plan = layer.gemv
        assert plan.fused == fused and plan.o_split == 16 and plan.o_rows is None  # o_proj [128, 256]: 16-long slices
        assert plan.down_split == (8 if intermediate == 128 else 6)  # 120: six slices of 20 in 32-wide tiles
        kernel = functools.partial(plan.gemv, slab=256) if looped else plan.gemv
        if looped:
            plan = plan._replace(o_split=1, down_split=1, o_rows=8, down_rows=8)
        layer.gemv = plan._replace(gemv=lambda x, w, kernel=kernel, **kw: calls.append(kw) or kernel(x, w, **kw))
    backend, attended = llm.runner.backend, []  # after the QKV GEMV, attention takes its rows as they are
    backend.decode_qkv = lambda *args, original=backend.decode_qkv: attended.append(1) or original(*args)
    # one prompt and three decode steps: each step costs the interpreter dear
    prompt, params = GREEDY_PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, prompt, 4)
    layers = len(llm.runner.model.layers)
    assert len(calls) == 3 * 4 * layers  # three decode steps, four projections a layer
    assert len(attended) == 3 * layers
    assert sum("norm_weight" in kw for kw in calls) == (3 * 2 * layers if fused else 0)
    assert sum(kw.get("rows") == 8 for kw in calls) == (3 * 2 * layers if looped else 0)


def test_gemv_plan_fuses_the_norms_where_the_row_is_no_larger_than_two_slabs():
    from types import SimpleNamespace

    from inferlab.plugins.models.decoder import Biases, ModelKernels, gemv_plan

    kernels = ModelKernels(*[None] * 4)

    def plan(hidden, inter, heads, kv_heads, fused=None, **kw):
        config = SimpleNamespace(
            hidden_size=hidden,
            intermediate_size=inter,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=128,
        )
        return gemv_plan(
            config,
            torch.bfloat16,
            kernels,
            kw.get("tp", TPGroup()),
            kw.get("biases", Biases(False, False, False)),
            fused,
            True,
        )

    small = plan(1024, 3072, 16, 8)  # Qwen3-0.6B: a row of 1,024 x (3 partials + residual + weight) = 16 KB
    assert (small.o_split, small.down_split, small.o_rows, small.down_rows) == (1, 3, None, None)
    assert small.fused and small.preload
    large = plan(4096, 12288, 32, 8)  # Qwen3-8B: o_proj and down_proj unsplit, 8 rows a program; a 24 KB row
    assert (large.o_split, large.down_split, large.o_rows, large.down_rows, large.fused) == (1, 1, 8, 8, True)
    split = plan(1536, 18944, 12, 2)  # down_proj split 8 ways: a row of 1,536 x (8 partials + 2) = 54 KB
    assert (split.o_split, split.down_split, split.o_rows, split.down_rows, split.fused) == (3, 8, None, None, False)
    assert plan(1536, 18944, 12, 2, fused=True).fused and not plan(1024, 3072, 16, 8, fused=False).fused
    assert plan(1024, 3072, 16, 8, tp=TPGroup(rank=0, size=2)) is None
    assert plan(1024, 3072, 16, 8, biases=Biases(True, False, False)) is None
    assert plan(1001, 3072, 16, 8) is None  # an odd width: no count of columns from 2 divides it


def test_gemv_decode_needs_what_it_folds(checkpoint, caplog):
    import logging

    options = dict(kvcache_block_size=16, num_kvcache_blocks=8, enforce_eager=True)
    with caplog.at_level(logging.INFO, logger="inferlab"):
        llm = LLM(checkpoint("gqa2-tied"), model_options={"triton_kernels": False, "gemv_decode": True}, **options)
    assert llm.runner.model.layers[0].gemv is None and "gemv_decode" not in caplog.text  # the torch code: quietly
    with caplog.at_level(logging.INFO, logger="inferlab"):
        llm = LLM(checkpoint("qwen2-bias-kv1-tied"), model_options={"triton_kernels": True}, **options)
    assert llm.runner.model.layers[0].gemv is None and "gemv_decode is off: it has no bias add" in caplog.text
    from inferlab.core.plugins import PluginError

    with pytest.raises(PluginError, match="gemv_fused"):
        LLM(
            checkpoint("gqa2-tied"),
            model_options={"triton_kernels": True, "gemv_decode": True, "gemv_fused": "sometimes"},
            **options,
        )
