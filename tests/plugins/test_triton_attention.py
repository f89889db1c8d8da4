"""The Triton attention kernels against the torch backend: store, paged prefill with cached
prefixes, split decode, mixed and ragged batches, CUDA-graph padding rows, and a greedy generate.

Without CUDA the kernels run in Triton's interpreter, which Triton fixes when a kernel is decorated:
so TRITON_INTERPRET is set here before inferlab's kernel module is first imported (and the module is
reloaded if something imported it compiled). With CUDA the same tests run the compiled kernels."""

import importlib
import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from inferlab import LLM, SamplingParams  # noqa: E402
from inferlab.core.cuda_graphs import DecodeGraphs, PrefillGraphs, prefill_graph_sizes  # noqa: E402
from inferlab.core.kv_cache_dtype import FP8, to_cache_dtype  # noqa: E402
from inferlab.core.protocols import DecodesFromQKV  # noqa: E402
from inferlab.kernels.kv_store import store_kv  # noqa: E402
from inferlab.kernels.qk_norm_rope import qk_norm_rope  # noqa: E402
from inferlab.kernels.qk_norm_rope import rotary as rotary_kernel  # noqa: E402
from inferlab.plugins.attention import triton_kernels  # noqa: E402
from inferlab.plugins.attention.torch_backend import TorchBackend  # noqa: E402
from inferlab.plugins.attention.triton_backend import TritonBackend  # noqa: E402
from inferlab.plugins.models.layers import RotaryEmbedding  # noqa: E402
from inferlab.testing.attention import attention_inputs, padded_for_cuda_graphs  # noqa: E402

if not torch.cuda.is_available() and not triton_kernels.INTERPRETED:
    triton_kernels = importlib.reload(triton_kernels)
DEVICE = torch.device("cpu" if triton_kernels.INTERPRETED else "cuda")


def make_batch(query_lens, context_lens, block_size, num_kv_heads, head_dim, group, seed=0):
    """A batch over a random paged cache: sequence i has context_lens[i] cached tokens and
    query_lens[i] new ones, its blocks scattered over the cache (never in order)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(order[used : used + n])
        used += n
    inputs = attention_inputs(context_lens, query_lens, tables, block_size, DEVICE)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(DEVICE)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    return inputs, q, k, v, cache


def run_both(inputs, q, k, v, cache, scale=0.3, backend=None):
    """(triton output, torch output, triton cache, torch cache) for the same batch and cache."""
    torch_backend, triton_backend = TorchBackend(), backend or TritonBackend()
    torch_cache, triton_cache = cache.clone(), cache.clone()
    expected = torch_backend.forward(q, k, v, torch_cache, torch_backend.build_metadata(inputs), scale)
    got = triton_backend.forward(q, k, v, triton_cache, triton_backend.build_metadata(inputs), scale)
    return got, expected, triton_cache, torch_cache


def assert_matches_torch(inputs, q, k, v, cache, backend=None):
    """The triton backend's output and stored cache against the torch backend's."""
    got, expected, got_cache, expected_cache = run_both(inputs, q, k, v, cache, backend=backend)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    if cache.dtype == FP8:  # compared bit for bit (assert_close takes no float8)
        got_cache, expected_cache = got_cache.view(torch.uint8), expected_cache.view(torch.uint8)
    torch.testing.assert_close(got_cache, expected_cache, rtol=0, atol=0)


def test_store_writes_each_token_to_its_slot_and_skips_minus_one():
    num_kv_heads, head_dim = 2, 16
    cache = torch.zeros(2, 4, 16, num_kv_heads, head_dim, device=DEVICE)
    k = torch.randn(5, num_kv_heads, head_dim, device=DEVICE)
    v = torch.randn(5, num_kv_heads, head_dim, device=DEVICE)
    slots = torch.tensor([17, 3, -1, 63, 40], dtype=torch.int64, device=DEVICE)
    store_kv(k, v, cache, slots)
    expected = torch.zeros_like(cache)
    keep = slots >= 0
    expected[0].view(-1, num_kv_heads, head_dim)[slots[keep]] = k[keep]
    expected[1].view(-1, num_kv_heads, head_dim)[slots[keep]] = v[keep]
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_store_reads_strided_rows_of_a_fused_projection():
    # v arrives as a column slice of the fused QKV output: rows are strided, each row contiguous
    num_kv_heads, head_dim = 2, 16
    fused = torch.randn(3, 4 * num_kv_heads * head_dim, device=DEVICE)
    k = fused[:, : num_kv_heads * head_dim].view(3, num_kv_heads, head_dim)
    v = fused[:, 2 * num_kv_heads * head_dim : 3 * num_kv_heads * head_dim].view(3, num_kv_heads, head_dim)
    cache = torch.zeros(2, 1, 16, num_kv_heads, head_dim, device=DEVICE)
    store_kv(k, v, cache, torch.tensor([0, 5, 9], device=DEVICE))
    torch.testing.assert_close(cache[1, 0, [0, 5, 9]], v, rtol=0, atol=0)
    torch.testing.assert_close(cache[0, 0, [0, 5, 9]], k, rtol=0, atol=0)


# (block size, query heads per KV head, head_dim, query lens, cached prefix lens)
PREFILL_CASES = [
    (16, 1, 16, [5, 21, 1], [0, 3, 40]),  # no prefix, a prefix inside a block, a one-token chunk
    (32, 2, 32, [33, 7], [17, 64]),  # a chunk crossing blocks after an unaligned prefix
    (64, 4, 16, [18, 2, 9], [0, 70, 1]),
    # several query tiles: each reads the whole key tiles before it unmasked, then its diagonal
    (16, 2, 16, [70, 16, 33], [0, 48, 15]),
]


@pytest.mark.parametrize("block_size,group,head_dim,query_lens,context_lens", PREFILL_CASES)
def test_prefill_with_cached_prefix_matches_torch(block_size, group, head_dim, query_lens, context_lens):
    inputs, q, k, v, cache = make_batch(query_lens, context_lens, block_size, 2, head_dim, group)
    assert not inputs.is_decode
    assert_matches_torch(inputs, q, k, v, cache)


def test_prefill_programs_of_one_head_or_a_whole_group_agree():
    inputs, q, k, v, cache = make_batch([33, 7], [17, 64], 32, 2, 32, 4, seed=4)
    expected = TorchBackend().forward(q, k, v, cache.clone(), TorchBackend().build_metadata(inputs), 0.3)
    store_kv(k, v, cache, inputs.slot_mapping)
    for heads in (1, 4):  # one query head a program, or the four sharing a KV head
        got = triton_kernels.paged_prefill(
            q,
            cache,
            torch.empty_like(q),
            inputs.query_start_loc,
            inputs.seq_lens,
            inputs.block_tables,
            inputs.max_query_len,
            0.3,
            16,
            16,
            heads_per_program=heads,
        )
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # by default a program takes the group where it is a power of two and its rows fit
    assert triton_kernels.prefill_heads_per_program(4, 16) == 4
    assert triton_kernels.prefill_heads_per_program(2, 64) == 2  # Qwen3-0.6B: 128 rows
    assert triton_kernels.prefill_heads_per_program(4, 64) == 1  # Qwen3-8B: 256 rows would not fit
    assert triton_kernels.prefill_heads_per_program(5, 16) == 1
    with pytest.raises(ValueError, match="heads_per_program must be 1 or the group size 4"):
        triton_kernels.paged_prefill(
            q,
            cache,
            torch.empty_like(q),
            inputs.query_start_loc,
            inputs.seq_lens,
            inputs.block_tables,
            inputs.max_query_len,
            0.3,
            16,
            16,
            heads_per_program=2,
        )


# (block size, query heads per KV head, head_dim, context lens before the new token)
DECODE_CASES = [
    (16, 4, 32, [0, 37, 95, 16]),  # a first token, block-aligned and unaligned contexts
    (32, 1, 16, [63, 5]),
    (64, 2, 32, [130, 1, 64]),
]


@pytest.mark.parametrize("order", ["longest_first", "batch"])
@pytest.mark.parametrize("block_size,group,head_dim,context_lens", DECODE_CASES)
def test_decode_matches_torch(block_size, group, head_dim, context_lens, order):
    inputs, q, k, v, cache = make_batch([1] * len(context_lens), context_lens, block_size, 2, head_dim, group, seed=1)
    assert inputs.is_decode
    assert_matches_torch(inputs, q, k, v, cache, backend=TritonBackend(decode_order=order))


@pytest.mark.parametrize("num_splits", [1, 3, 8, pytest.param(40, marks=pytest.mark.slow)])
def test_split_decode_combines_partials_exactly(num_splits):
    # more splits than some sequences have keys: their empty splits must weigh nothing, and (as a
    # graph plans splits for max_model_len) the reduction must not read the scratch they leave, here
    # NaN; 40 splits of 300 keys give 19 parts of 16, more than the reduction reads at once
    context_lens = [100, 9, 47, 300]
    inputs, q, k, v, cache = make_batch([1] * 4, context_lens, 16, 2, 16, 2, seed=2)
    expected = TorchBackend().forward(q, k, v, cache.clone(), TorchBackend().build_metadata(inputs), 0.25)
    store_kv(k, v, cache, inputs.slot_mapping)
    partial_out = torch.full((4, q.shape[1], num_splits, 16), float("nan"), device=DEVICE)
    partial_lse = torch.full((4, q.shape[1], num_splits), float("nan"), device=DEVICE)
    for min_split_len in (0, 32):  # each sequence split evenly; or in parts of at least 32 keys
        got = triton_kernels.paged_decode(
            q,
            cache,
            torch.empty_like(q),
            inputs.seq_lens,
            inputs.block_tables,
            0.25,
            num_splits,
            16,
            partial_out,
            partial_lse,
            min_split_len,
        )
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # started longest first, each program still writes its own sequence's rows
    order = triton_kernels.longest_first(inputs.seq_lens)
    assert order.tolist() == [3, 0, 2, 1] and order.dtype == torch.int32
    got = triton_kernels.paged_decode(
        q,
        cache,
        torch.empty_like(q),
        inputs.seq_lens,
        inputs.block_tables,
        0.25,
        num_splits,
        16,
        partial_out,
        partial_lse,
        32,
        seq_order=order,
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "rotary"])
@pytest.mark.parametrize(
    "group,context_lens,num_splits",
    [(2, [0, 37, 95, 16], 8), (4, [63, 5], 3), pytest.param(2, [20], 1, marks=pytest.mark.gpu)],
)
def test_decode_from_qkv_is_the_q_k_kernel_then_decode(cache_dtype, norm, group, context_lens, num_splits):
    """The QKV rows as the projection leaves them: the kernel's own q/k norms, rotary and K/V store
    give the outputs and the cache that the q/k kernel (storing K/V) and the decode after it give,
    split into more parts than the short sequences have keys, in a batch padded as a CUDA graph
    pads it (padding rows store nothing and output zeros); through the backend as the model calls it."""
    num_kv_heads, head_dim, block_size = 2, 32, 16
    num_heads = num_kv_heads * group
    inputs, _, _, _, cache = make_batch(
        [1] * len(context_lens), context_lens, block_size, num_kv_heads, head_dim, group
    )
    padded = padded_for_cuda_graphs(inputs, num_rows=len(context_lens) + 2, max_blocks=12)
    num_rows = padded.num_seqs
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(num_rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE)
    positions = torch.cat([inputs.context_lens, torch.zeros(2, dtype=torch.int32, device=DEVICE)]).long()
    weights = (torch.rand(2, head_dim, generator=gen) + 0.5).to(DEVICE)
    qk_norm = (weights[0], weights[1], 1e-6) if norm else None
    cos_sin = RotaryEmbedding(head_dim, 128, 10000.0).to(DEVICE).cos_sin
    cache = to_cache_dtype(cache, cache_dtype)
    scratch = dict(
        partial_out=torch.empty(num_rows, num_heads, num_splits, head_dim, device=DEVICE),
        partial_lse=torch.empty(num_rows, num_heads, num_splits, device=DEVICE),
    )

    def decode(q, cache, new_tokens=None):
        out = torch.full((num_rows, num_heads, head_dim), float("nan"), device=DEVICE)
        args = (padded.seq_lens, padded.block_tables, 0.3, num_splits, 16)
        return triton_kernels.paged_decode(q, cache, out, *args, **scratch, new_tokens=new_tokens)

    want_cache = cache.clone()
    kv_store = (want_cache[0], want_cache[1], padded.slot_mapping)
    heads = (num_heads, num_kv_heads, head_dim)
    if norm:
        q, _ = qk_norm_rope(qkv, positions, *qk_norm[:2], cos_sin, qk_norm[2], *heads, kv_store=kv_store)
    else:
        q, _ = rotary_kernel(qkv, positions, cos_sin, *heads, kv_store=kv_store)
    want = decode(q, want_cache)
    got_cache = cache.clone()
    new_tokens = triton_kernels.NewTokens(positions, padded.slot_mapping, cos_sin, qk_norm)
    got = decode(qkv.view(num_rows, -1, head_dim), got_cache, new_tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[len(context_lens) :], torch.zeros_like(got[len(context_lens) :]))
    if cache_dtype == FP8:  # compared bit for bit
        assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    else:  # the same arithmetic, the norm's squares summed in another order
        torch.testing.assert_close(got_cache, want_cache, rtol=1e-6, atol=1e-6)

    backend = TritonBackend(min_split_len=16)
    metadata = backend.build_metadata(padded)
    assert isinstance(backend, DecodesFromQKV) and backend.decodes_qkv(metadata)
    through_backend = backend.decode_qkv(qkv, positions, cos_sin, qk_norm, num_heads, cache.clone(), metadata, 0.3)
    torch.testing.assert_close(through_backend, want, rtol=1e-4, atol=1e-4)
    assert not backend.decodes_qkv(backend.build_metadata(make_batch([1, 3], [4, 0], 16, 2, 32, 2)[0]))
    assert not TritonBackend(decode_from_qkv=False).decodes_qkv(metadata)
    with pytest.raises(ValueError, match="with new_tokens q must be the QKV rows"):
        decode(q, cache.clone(), new_tokens)


@pytest.mark.parametrize("query_lens,context_lens", [([1, 1, 1], [0, 37, 20]), ([21, 3], [0, 40])])
def test_slots_past_a_sequence_never_reach_its_output(query_lens, context_lens):
    """Slots of a sequence's blocks past its length (free, or an earlier owner's, here NaN) share
    its key tiles but must weigh nothing, in decode and in prefill."""
    inputs, q, k, v, cache = make_batch(query_lens, context_lens, 16, 2, 16, 2, seed=3)
    poisoned = torch.full_like(cache, float("nan"))
    for row in range(len(query_lens)):
        for pos in range(context_lens[row]):  # keep the cached context, poison the rest
            slot = int(inputs.block_tables[row, pos // 16]) * 16 + pos % 16
            poisoned[:, slot // 16, slot % 16] = cache[:, slot // 16, slot % 16]
    backend = TritonBackend()
    got = backend.forward(q, k, v, poisoned, backend.build_metadata(inputs), 0.3)
    _, expected, _, _ = run_both(inputs, q, k, v, cache)  # the torch backend on the clean cache
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_longest_first_orders_by_length_then_batch_position():
    seq_lens = torch.tensor([5, 9, 0, 9, 1, 5, 7], dtype=torch.int32, device=DEVICE)
    assert triton_kernels.longest_first(seq_lens).tolist() == [1, 3, 6, 0, 5, 4, 2]
    assert triton_kernels.longest_first(seq_lens[:0]).tolist() == []


def test_decode_plan_splits_long_contexts_of_small_batches():
    q = torch.empty(1, 8, 128)
    assert triton_kernels.decode_splits(q, num_kv_heads=1, max_seq_len=100, min_split_len=16, programs_per_sm=4) == 4
    # no more splits than the longest sequence has parts of min_split_len keys
    assert triton_kernels.decode_splits(q, num_kv_heads=1, max_seq_len=40, min_split_len=16, programs_per_sm=4) == 3
    # a large batch fills the device without splitting
    assert triton_kernels.decode_splits(q.expand(64, 8, 128), 8, 100, 16, 4) == 1


@pytest.mark.parametrize(
    "query_lens, context_lens, num_decodes",
    [
        ([1, 12, 1, 30], [50, 32, 7, 0], 1),  # one decode leads; the other runs in the prefill kernel
        ([1, 1, 12, 30], [90, 7, 32, 0], 2),  # as the runner lays a step out: decodes first
        ([1, 30], [200, 0], 1),  # one long decode beside a prompt: its context is split
    ],
)
@pytest.mark.parametrize("split", [True, False])
def test_mixed_decode_and_prefill_chunks_match_torch(query_lens, context_lens, num_decodes, split):
    """A chunked-prefill step: decoding sequences beside a chunk with a prefix and a new prompt, the
    leading decodes run as split decodes (from mixed_decode_split_len on) or in the prefill kernel."""
    inputs, q, k, v, cache = make_batch(query_lens, context_lens, 16, 1, 32, 4, seed=3)
    assert not inputs.is_decode and inputs.num_decodes == num_decodes
    longest = inputs.max_decode_seq_len
    backend = TritonBackend(mixed_decode_split_len=longest if split else longest + 1)
    assert backend.build_metadata(inputs).num_decodes == (num_decodes if split else 0)
    assert_matches_torch(inputs, q, k, v, cache, backend)


def test_cuda_graph_padding_rows_store_nothing_and_output_zeros():
    inputs, q, k, v, cache = make_batch([1, 1], [20, 44], 16, 2, 16, 2, seed=4)
    _, expected, _, expected_cache = run_both(inputs, q, k, v, cache)
    padded = padded_for_cuda_graphs(inputs, num_rows=4, max_blocks=16)  # as the decode graphs pad
    backend = TritonBackend(min_split_len=16)
    padded_cache = cache.clone()
    got = backend.forward(
        torch.cat([q, torch.randn_like(q)]),
        torch.cat([k, torch.randn_like(k)]),
        torch.cat([v, torch.randn_like(v)]),
        padded_cache,
        backend.build_metadata(padded),
        0.3,
    )
    torch.testing.assert_close(got[:2], expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[2:], torch.zeros_like(got[2:]))
    torch.testing.assert_close(padded_cache, expected_cache, rtol=0, atol=0)


def fp8_probe_values() -> torch.Tensor:
    """Values where rounding to float8_e4m3fn is easy to get wrong: every finite fp8 value, the
    midpoints between neighbours (ties go to the even one), the floats just beside them (a carry
    into the exponent at the top of each binade), subnormals, and values past 448 (saturate)."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    grid = grid[~grid.isnan()].unique()
    mids = (grid[:-1] + grid[1:]) / 2
    beside = torch.cat([torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))])
    extremes = torch.tensor([449.0, 464.0, 480.0, 1e6, -1e6, 3e-3, -1e-3, 1e-30, 2.0**-10, 0.0, -0.0])
    gen = torch.Generator().manual_seed(0)
    return torch.cat([grid, mids, beside, extremes, torch.randn(512, generator=gen) * 4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_into_an_fp8_cache_rounds_as_torch_bit_for_bit(dtype):
    num_kv_heads, head_dim = 2, 16
    values = fp8_probe_values().to(dtype)
    num_tokens = -(-values.numel() // (num_kv_heads * head_dim))
    padded = torch.zeros(num_tokens * num_kv_heads * head_dim, dtype=dtype)
    padded[: values.numel()] = values
    k = padded.view(num_tokens, num_kv_heads, head_dim).to(DEVICE)
    v = -k.flip(0)
    cache = torch.zeros(2, -(-num_tokens // 16), 16, num_kv_heads, head_dim, dtype=FP8, device=DEVICE)
    slots = torch.arange(num_tokens, device=DEVICE)
    store_kv(k, v, cache, slots)
    for got, want in ((cache[0], k), (cache[1], v)):
        got = got.view(-1, num_kv_heads, head_dim)[:num_tokens]
        assert torch.equal(got.view(torch.uint8), to_cache_dtype(want, FP8).view(torch.uint8))
    assert not cache.float().isnan().any()  # past 448 saturates: a plain cast would give NaN


FP8_CASES = [
    pytest.param([5, 21, 1], [0, 3, 40], id="prefill"),
    pytest.param([1, 1, 1, 1], [0, 37, 95, 16], id="decode"),
    pytest.param([1, 9, 1], [30, 12, 0], id="mixed"),
]


@pytest.mark.parametrize("query_lens,context_lens", FP8_CASES)
def test_attention_over_an_fp8_cache_matches_torch(query_lens, context_lens):
    """The kernels read fp8 K/V back in q's dtype, as the torch backend does; both store the new
    tokens' K/V rounded the same way. Cached values of a few units exercise the whole fp8 range."""
    inputs, q, k, v, cache = make_batch(query_lens, context_lens, 16, 2, 32, 2, seed=5)
    assert_matches_torch(inputs, q, k * 3, v * 3, to_cache_dtype(cache * 3, FP8))


def test_validate_names_unsupported_settings():
    reasons = TritonBackend.validate(DEVICE, torch.int8, 24, 48, torch.int8)
    assert any("dtype" in r for r in reasons)
    assert any("block size must be a power of two >= 16, got 24" in r for r in reasons)
    assert any("head_dim must be a power of two" in r for r in reasons)
    assert TritonBackend.validate(DEVICE, torch.float32, 16, 32, torch.float32) == []
    assert TritonBackend.validate(DEVICE, torch.float32, 16, 32, FP8) == []
    assert TritonBackend.validate(DEVICE, torch.float32, 16, 32, torch.float16) == [
        "kv_cache_dtype must be the model's dtype or torch.float8_e4m3fn, got torch.float16"
    ]
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        TritonBackend(block_m=24)
    with pytest.raises(ValueError, match=r"decode_order must be one of \['longest_first', 'batch'\], got 'shortest'"):
        TritonBackend(decode_order="shortest")
    with pytest.raises(ValueError, match="mixed_decode_split_len must be a whole number of tokens, got 8.5"):
        TritonBackend(mixed_decode_split_len=8.5)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_greedy_generate_with_triton_equals_torch(checkpoint, kv_cache_dtype):
    # small chunks force mixed prefill/decode steps; the second call reuses the first's prefix blocks
    path = checkpoint("gqa4-untied")
    prompt = "The quick brown fox jumps over the lazy dog. A paged cache keeps keys"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for attention in ("torch", "triton"):
        llm = LLM(
            path,
            attention=attention,
            device=str(DEVICE),
            dtype="float32",
            kvcache_block_size=16,
            max_model_len=128,
            max_num_batched_tokens=24,
            num_kvcache_blocks=64,
            kv_cache_dtype=kv_cache_dtype,
        )
        assert llm.runner.kv_cache.dtype == (FP8 if kv_cache_dtype == "fp8" else torch.float32)
        first = llm.generate([prompt, "Hello, world!"], params, use_tqdm=False)
        second = llm.generate([prompt + " and values in blocks."], params, use_tqdm=False)
        results[attention] = [o["token_ids"] for o in first + second]
    assert results["triton"] == results["torch"]


class EagerReplay:
    """Graphs (DecodeGraphs or PrefillGraphs, mixed in before them) whose 'graphs' rerun the
    forward eagerly over the static buffers: exercises the copy-in, padding and replay plumbing
    where CUDA graphs cannot run."""

    def _capture(self, model, backend, kv_caches, pool=None):
        self.replayed = []
        self.graphs = {size: EagerGraph(self, model, backend, kv_caches, size) for size in self.sizes}


class EagerGraph:
    def __init__(self, graphs, model, backend, kv_caches, size):
        self.graphs, self.model, self.backend, self.kv_caches, self.size = graphs, model, backend, kv_caches, size

    def replay(self):
        g, size = self.graphs, self.size
        g.replayed.append(size)
        metadata = self.backend.build_metadata(g._inputs(size))
        g.hidden[:size] = self.model(g.input_ids[:size], g.positions[:size], self.kv_caches, metadata)


class EagerReplayGraphs(EagerReplay, DecodeGraphs):
    pass


class EagerReplayPrefillGraphs(EagerReplay, PrefillGraphs):
    pass


@pytest.mark.slow
def test_decode_graph_buffers_pad_and_replay_like_eager(checkpoint):
    path = checkpoint("gqa2-tied")
    prompts = ["Hello, world! How are", "Numbers: zero one two three", "Readability counts."]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 3, 7)]
    settings = dict(
        attention="triton",
        device=str(DEVICE),
        dtype="float32",
        kvcache_block_size=16,
        max_model_len=128,
        max_num_seqs=6,
        num_kvcache_blocks=32,
        enforce_eager=True,
    )
    eager = [o["token_ids"] for o in LLM(path, **settings).generate(prompts, params, use_tqdm=False)]
    # with overlap scheduling the decode inputs hold placeholders for the previous step's samples,
    # which the graphs' input kernel swaps in
    for overlap in (False, True):
        llm = LLM(path, **settings, overlap_scheduling=overlap)
        runner = llm.runner
        runner.decode_graphs = graphs = EagerReplayGraphs(*runner._graph_settings())
        assert graphs.sizes == [1, 2, 4, 6]
        replayed = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert replayed == eager
        assert 4 in graphs.replayed and 2 in graphs.replayed and 1 in graphs.replayed  # 3 sequences padded to 4


def test_prefill_graph_sizes():
    assert prefill_graph_sizes(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert prefill_graph_sizes(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]
    assert prefill_graph_sizes(100) == [16, 32, 64, 100]
    assert prefill_graph_sizes(16) == [16]
    assert prefill_graph_sizes(5) == [5]
    assert prefill_graph_sizes(0) == []
    # eight sizes an octave above 2,048: padding at most an eighth of a step
    large = prefill_graph_sizes(16384)
    assert large[11:] == [2048 + 256 * k for k in range(9)] + [4096 + 512 * k for k in range(1, 9)] + [
        8192 + 1024 * k for k in range(1, 9)
    ]
    assert all((after - before) / before <= 1 / 8 for before, after in zip(large[11:], large[12:]))
    assert prefill_graph_sizes(5000)[-3:] == [4096, 4608, 5000]


def test_graphs_of_steps_with_prefill_are_sized_to_the_model():
    """graph_prefill_tokens=None: the largest size whose matmuls stay within 16 TFLOP a rank, at
    most a step's tokens."""
    from inferlab.core.cuda_graphs import auto_graph_prefill_tokens
    from inferlab.core.model_config import native_model_config
    from inferlab.core.model_cost import model_cost
    from inferlab.plugins.models.qwen3 import Qwen3ForCausalLM

    def flops(shape):  # matmul FLOPs a prefill token (the LM head apart) of a model shape
        cost = model_cost(native_model_config(shape, Qwen3ForCausalLM.config_defaults, source="test"), torch.bfloat16)
        return cost.flops_per_token - cost.head_flops_per_token

    qwen3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, tie_word_embeddings=False, rms_norm_eps=1e-6)
    small = dict(qwen3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16)
    large = dict(qwen3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32)
    qwen3_0_6b, qwen3_8b = flops({**small, "num_key_value_heads": 8}), flops({**large, "num_key_value_heads": 8})
    assert auto_graph_prefill_tokens(qwen3_0_6b, 32768) == 16384  # the next size, 18,432, is 16.2 TFLOP
    assert auto_graph_prefill_tokens(qwen3_0_6b, 4000) == 4000  # a step's most
    assert auto_graph_prefill_tokens(qwen3_8b, 16384) == 1024  # 1,280 is 17.8 TFLOP
    assert auto_graph_prefill_tokens(1e12, 16384) == 16  # never below the smallest graph
    assert auto_graph_prefill_tokens(qwen3_8b, 0) == 0


@pytest.mark.slow
def test_prefill_graphs_pad_and_replay_like_eager(checkpoint):
    """Steps with prefill (prompts, chunks, and decodes beside them) copied into padded static
    buffers and replayed give the eager engine's tokens, with and without overlap scheduling
    (whose placeholders the filling kernel resolves); steps too large for the graphs run eagerly."""
    path = checkpoint("gqa2-tied")
    # 12, 25, 10 and 8 tokens in steps of 20 (eager: above the graphs' 18), 20 (a decode beside
    # chunks) and 18 (two decodes beside the rest); then two short prompts in a step of 16
    prompts = ["Hello, world! How are", "Numbers: zero one two three four five six seven", "Readability counts."]
    prompts.append("Flat is better than that")
    later = ["Hi", "Flat"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 3, 7, 4)]
    settings = dict(
        attention="triton",
        device=str(DEVICE),
        dtype="float32",
        kvcache_block_size=16,
        max_model_len=128,
        max_num_seqs=6,
        max_num_batched_tokens=20,
        num_kvcache_blocks=32,
        enforce_eager=True,
        # the decodes beside prompts attend in the prefill kernel, as in the graphs (they stay eager
        # where the backend would split them over their context)
        attention_options={"mixed_decode_split_len": 4096},
    )

    def run(llm):
        outputs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(later, params[:2], use_tqdm=False)
        return [o["token_ids"] for o in outputs]

    eager = run(LLM(path, **settings))
    for overlap in (False, True):
        llm = LLM(path, **settings, overlap_scheduling=overlap)
        runner = llm.runner
        runner.prefill_graphs = graphs = EagerReplayPrefillGraphs(*runner._graph_settings(), 18)
        assert graphs.sizes == [16, 18]
        assert run(llm) == eager
        assert graphs.replayed == [18, 16]


def buffers_of_sevens(num_tokens: int, num_seqs: int, width: int, query_start_loc: bool = False) -> dict:
    """A graph's static input buffers by name, every entry 7, so that what a fill leaves alone shows."""

    def sevens(*shape, dtype):
        return torch.full(shape, 7, dtype=dtype, device=DEVICE)

    out = {name: sevens(num_tokens, dtype=torch.int64) for name in ("input_ids", "positions", "slot_mapping")}
    if query_start_loc:
        out["query_start_loc"] = sevens(num_seqs + 1, dtype=torch.int32)
    out.update(
        seq_lens=sevens(num_seqs, dtype=torch.int32),
        context_lens=sevens(num_seqs, dtype=torch.int32),
        block_tables=sevens(num_seqs, width, dtype=torch.int32),
    )
    return out


def test_step_inputs_kernel_resolves_placeholders_and_pads():
    from inferlab.kernels.graph_inputs import fill_step_inputs

    out = buffers_of_sevens(num_tokens=8, num_seqs=5, width=4, query_start_loc=True)
    buffers = SimpleNamespace(**out)  # as PrefillGraphs holds them
    # 5 tokens of 2 sequences: a decode (placeholder) and a 4-token chunk after 8 cached tokens
    ids = torch.tensor([-1, 11, 12, 13, 14], device=DEVICE)
    positions = torch.tensor([20, 8, 9, 10, 11], device=DEVICE)
    slots = torch.tensor([100, 40, 41, 42, 43], device=DEVICE)
    ints = torch.tensor([0, 1, 5, 21, 12, 20, 8, 1, 2, 3, 4], dtype=torch.int32, device=DEVICE)
    tables = ints[7:].view(2, 2)
    sampled = torch.tensor([99], device=DEVICE)
    fill_step_inputs(6, 4, ids, positions, slots, ints[:3], ints[3:5], ints[5:7], tables, sampled, buffers)
    assert out["input_ids"].tolist() == [99, 11, 12, 13, 14, 0, 7, 7]  # token 5 pads the 6 of the graph
    assert out["positions"].tolist() == [20, 8, 9, 10, 11, 0, 7, 7]
    assert out["slot_mapping"].tolist() == [100, 40, 41, 42, 43, -1, 7, 7]
    assert out["query_start_loc"].tolist() == [0, 1, 5, 5, 5, 7]  # sequences 2-3 pad the 4: no new tokens
    assert out["seq_lens"].tolist() == [21, 12, 0, 0, 7]
    assert out["context_lens"].tolist() == [20, 8, 0, 0, 7]
    assert out["block_tables"][:2].tolist() == [[1, 2, 7, 7], [3, 4, 7, 7]]
    fill_step_inputs(6, 4, ids.abs(), positions, slots, ints[:3], ints[3:5], ints[5:7], tables, None, buffers)
    assert out["input_ids"][:2].tolist() == [1, 11]


def test_static_inputs_kernel_resolves_placeholders_and_pads():
    from inferlab.kernels.graph_inputs import fill_static_inputs

    out = buffers_of_sevens(num_tokens=8, num_seqs=8, width=5)
    buffers = SimpleNamespace(**out)  # as DecodeGraphs holds them
    longs = torch.tensor([11, -2, -1, 4, 9, 30, 40, 90, 300], device=DEVICE)  # ids, positions, slots of 3 rows
    ints = torch.tensor([5, 10, 31, 4, 9, 30, 1, 2, 3, 4, 5, 6], dtype=torch.int32, device=DEVICE)
    tables = ints[6:].view(3, 2)
    sampled = torch.tensor([21, 22], device=DEVICE)
    fill_static_inputs(4, longs[:3], longs[3:6], longs[6:], ints[:3], ints[3:6], tables, sampled, buffers)
    assert out["input_ids"].tolist() == [11, 22, 21, 7, 7, 7, 7, 7]  # -(k + 1) is sample k; padding untouched
    assert out["positions"].tolist() == [4, 9, 30, 7, 7, 7, 7, 7]
    assert out["slot_mapping"].tolist() == [40, 90, 300, -1, 7, 7, 7, 7]  # row 3 pads the batch of 4
    assert out["seq_lens"].tolist() == [5, 10, 31, 0, 7, 7, 7, 7]
    assert out["context_lens"].tolist() == [4, 9, 30, 0, 7, 7, 7, 7]
    assert out["block_tables"][:3].tolist() == [[1, 2, 7, 7, 7], [3, 4, 7, 7, 7], [5, 6, 7, 7, 7]]
    fill_static_inputs(3, longs[:3].abs(), longs[3:6], longs[6:], ints[:3], ints[3:6], tables, None, buffers)
    assert out["input_ids"][:3].tolist() == [11, 2, 1]  # without samples the ids are taken as they are
