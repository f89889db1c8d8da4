"""Conformance tests for an attention backend plugin, through its Protocol only.

    import torch
    from inferlab.testing import AttentionBackendSuite

    class TestMyBackend(AttentionBackendSuite):
        attention = "my_backend"        # the name it is registered under
        attention_options = {}           # its options, if any
        device = "cuda"                  # default "cpu"
        dtypes = (torch.bfloat16,)       # the model dtypes to test; default (torch.float32,)

Each test drives the backend over one layer's paged cache as the model runner does (AttentionInputs
laid out as the runner lays them out, blocks scattered over the cache, K/V stored by forward and read
back by later calls) and checks every output against a float64 reference: causal softmax attention
of each new token over its sequence's cached context and the new tokens before it, query heads
sharing KV heads (GQA). The scenarios: prefill of ragged sequences, a cached prefix shared from
another sequence, chunked prefill beside decodes, decodes of long contexts leading a prompt, decode
of ragged contexts over several steps, blocks reused after an earlier owner, CUDA-graph padding
rows (and on CUDA a captured graph replayed), an fp8 cache, every block size and head shape
validate accepts, a model storing K/V itself (FusedKVStore), decode steps from the QKV
projection's output (DecodesFromQKV), and validate's answers. The cache layout is the backend's own: the suite
reads the cache only through forward.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from inferlab.core.batch import AttentionInputs
from inferlab.core.config import DTYPES, EngineConfig
from inferlab.core.kv_cache_dtype import FP8, to_cache_dtype
from inferlab.core.plugins import get_registry
from inferlab.core.protocols import DecodesFromQKV, FusedKVStore, PrefillGraphCapture
from inferlab.testing.common import ceil_div

MODEL_DTYPES = tuple(getattr(torch, name) for name in sorted(DTYPES - {"auto"}))


def attention_inputs(
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
    is_decode: bool | None = None,
) -> AttentionInputs:
    """AttentionInputs for sequences holding context_lens[i] tokens in the cache and computing
    query_lens[i] new ones, in the blocks block_tables[i], laid out as the runner lays them out
    (ModelRunner.prepare_inputs and upload): int32 views of one buffer and the int64 slots of the
    new tokens, block tables padded with 0, the leading one-token sequences counted in num_decodes.
    is_decode: whether every sequence computes its last token (the runner's decode step); by
    default, whether each computes one."""
    num_seqs = len(query_lens)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    width = max(map(len, block_tables))
    for i, (n, table) in enumerate(zip(seq_lens, block_tables)):
        if len(table) * block_size < n:
            raise ValueError(f"sequence {i} holds {n} tokens but its {len(table)} blocks of {block_size} hold fewer")
    tables = torch.zeros(num_seqs, width, dtype=torch.int64)
    for row, table in enumerate(block_tables):
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.int64)
    slots = [
        block_tables[row][pos // block_size] * block_size + pos % block_size
        for row in range(num_seqs)
        for pos in range(context_lens[row], seq_lens[row])
    ]
    query_start = torch.zeros(num_seqs + 1, dtype=torch.int64)
    query_start[1:] = torch.tensor(query_lens).cumsum(0)
    ints = torch.cat([query_start, torch.tensor(seq_lens), torch.tensor(context_lens), tables.flatten()])
    ints = ints.to(torch.int32).to(device)
    query_start_loc, seq_lens_t, context_lens_t, tables_t = ints.split(
        [num_seqs + 1, num_seqs, num_seqs, tables.numel()]
    )
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), num_seqs)  # the leading one-token rows
    return AttentionInputs(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        context_lens=context_lens_t,
        block_tables=tables_t.view(num_seqs, width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        is_decode=all(q == 1 for q in query_lens) if is_decode is None else is_decode,
        block_size=block_size,
        num_decodes=num_decodes,
        max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
    )


def padded_for_cuda_graphs(inputs: AttentionInputs, num_rows: int, max_blocks: int) -> AttentionInputs:
    """A decode batch as a CUDA graph of num_rows sequences and max_blocks-wide block tables sees it
    (inferlab.core.cuda_graphs): padding rows of one query token with seq_len 0 and slot -1, whose
    block tables are stale (here the first row's), and max_seq_len the longest a sequence may grow."""
    num_seqs, width = inputs.block_tables.shape
    num_padding = num_rows - num_seqs
    if num_padding < 0 or max_blocks < width or not inputs.is_decode:
        raise ValueError(
            f"pads a decode batch to at least its {num_seqs} rows and {width} blocks, got {num_rows} and {max_blocks}"
        )
    tables = inputs.block_tables.new_zeros(num_rows, max_blocks)
    tables[:num_seqs, :width] = inputs.block_tables
    tables[num_seqs:] = tables[0]
    return AttentionInputs(
        query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32, device=inputs.seq_lens.device),
        seq_lens=torch.cat([inputs.seq_lens, inputs.seq_lens.new_zeros(num_padding)]),
        context_lens=torch.cat([inputs.context_lens, inputs.context_lens.new_zeros(num_padding)]),
        block_tables=tables,
        slot_mapping=torch.cat([inputs.slot_mapping, inputs.slot_mapping.new_full((num_padding,), -1)]),
        max_query_len=1,
        max_seq_len=max_blocks * inputs.block_size,
        is_decode=True,
        block_size=inputs.block_size,
    )


def padded_for_prefill_graphs(
    inputs: AttentionInputs, num_tokens: int, num_rows: int, max_blocks: int
) -> AttentionInputs:
    """A step with prefill as a graph of num_tokens tokens and num_rows sequences sees it
    (inferlab.core.cuda_graphs.PrefillGraphs): padding tokens with slot -1, padding sequences with
    no new tokens and seq_len 0 (stale block tables: the first row's), max_query_len the graph's
    token capacity and static_shapes set."""
    num_seqs, width = inputs.block_tables.shape
    real_tokens = inputs.slot_mapping.shape[0]
    if num_rows < num_seqs or num_tokens < real_tokens or max_blocks < width or num_rows > num_tokens:
        raise ValueError(
            f"pads a step of {real_tokens} tokens, {num_seqs} sequences and {width} blocks to at least as many "
            f"(and no more sequences than tokens), got {num_tokens}, {num_rows} and {max_blocks}"
        )
    tables = inputs.block_tables.new_zeros(num_rows, max_blocks)
    tables[:num_seqs, :width] = inputs.block_tables
    tables[num_seqs:] = tables[0]
    padding = num_rows - num_seqs
    ends = inputs.query_start_loc.new_full((padding,), real_tokens)
    return AttentionInputs(
        query_start_loc=torch.cat([inputs.query_start_loc, ends]),
        seq_lens=torch.cat([inputs.seq_lens, inputs.seq_lens.new_zeros(padding)]),
        context_lens=torch.cat([inputs.context_lens, inputs.context_lens.new_zeros(padding)]),
        block_tables=tables,
        slot_mapping=torch.cat([inputs.slot_mapping, inputs.slot_mapping.new_full((num_tokens - real_tokens,), -1)]),
        max_query_len=num_tokens,
        max_seq_len=max_blocks * inputs.block_size,
        is_decode=False,
        block_size=inputs.block_size,
        static_shapes=True,
    )


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one sequence's new tokens q [n, H, D], the last n of its keys and values
    [L, Hkv, D], in float64: token i attends causally to keys 0 .. L - n + i, query head h to KV
    head h // (H / Hkv)."""
    num_new, num_heads = q.shape[:2]
    group = num_heads // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    positions = torch.arange(keys.shape[0] - num_new, keys.shape[0])
    scores.masked_fill_(torch.arange(keys.shape[0])[None, :] > positions[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)


def rotary_table(head_dim: int, num_positions: int, theta: float = 10000.0) -> torch.Tensor:
    """The rotary's cos/sin table as DecodesFromQKV takes it: float32 [positions, D], each row the
    D / 2 cosines of the angles, then their sines."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(num_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def reference_norm_rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, norm) -> torch.Tensor:
    """Head vectors x [T, heads, D] RMSNorm'd per head with norm = (weight, eps) (None: not) and
    rotated at positions [T], in float64: the first half of a head pairs with the second."""
    x = x.double()
    if norm is not None:
        weight, eps = norm
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    half = x.shape[-1] // 2
    table = cos_sin[positions.long()].double()[:, None, :]
    cos, sin = table[..., :half], table[..., half:]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass(slots=True, eq=False)
class SequenceState:
    """One sequence in the cache: its blocks and, for the reference, the K and V [L, Hkv, D] of
    every token as the cache holds them (rounded to the cache's dtype), in float64."""

    block_table: list[int]
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[0]


@dataclass(slots=True)
class Step:
    """One forward call's inputs and its reference output."""

    work: list[tuple[SequenceState, int]]  # (sequence, tokens it computes)
    inputs: AttentionInputs
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    expected: torch.Tensor  # float64 [T, H, D], on the CPU


class AttentionRun:
    """A backend over one layer's paged cache, driven as the model runner drives it, with what each
    sequence stored kept aside for the reference. step() computes some sequences' next tokens and
    checks the output; blocks are handed out in a shuffled order, and freed ones are reused first."""

    def __init__(
        self,
        backend,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        tolerance: tuple[float, float],
        num_blocks: int = 48,
        fused_store: bool = False,
        seed: int = 0,
    ):
        self.backend = backend
        self.device, self.dtype, self.kv_cache_dtype = device, dtype, kv_cache_dtype
        self.block_size, self.num_blocks = block_size, num_blocks
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.atol, self.rtol = tolerance
        self.scale = 0.7 / math.sqrt(head_dim)  # not the usual 1/sqrt(D): the backend must use the one it is given
        self.fused_store = fused_store  # store K/V through kv_store_target, as a model may (FusedKVStore)
        self.generator = torch.Generator().manual_seed(seed)
        shape = backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        self.cache = torch.zeros(shape, dtype=kv_cache_dtype, device=device)  # as the runner allocates it
        self.free_blocks = torch.randperm(num_blocks, generator=self.generator).tolist()

    def new_sequence(self) -> SequenceState:
        empty = torch.zeros(0, self.num_kv_heads, self.head_dim, dtype=torch.float64)
        return SequenceState([], empty, empty)

    def share_prefix(self, sequence: SequenceState, num_blocks: int) -> SequenceState:
        """A new sequence whose first num_blocks blocks are sequence's (a prefix-cache hit)."""
        num_tokens = num_blocks * self.block_size
        assert sequence.num_tokens >= num_tokens, "only full, computed blocks are shared"
        return SequenceState(
            sequence.block_table[:num_blocks], sequence.keys[:num_tokens], sequence.values[:num_tokens]
        )

    def release(self, sequence: SequenceState) -> None:
        """Frees the sequence's blocks, which keep its K/V until the next owner overwrites them."""
        self.free_blocks[:0] = sequence.block_table
        sequence.block_table = []

    def random(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(self.dtype).to(self.device)

    def prepare(self, work: list[tuple[SequenceState, int]], is_decode: bool | None = None, qkv=None) -> Step:
        """The inputs of a call computing work's (sequence, num_new_tokens) and their reference
        output; records the new tokens' K/V as the sequences' own. qkv: the new tokens' (q, k, v),
        random by default."""
        for sequence, num_new in work:
            needed = ceil_div(sequence.num_tokens + num_new, self.block_size) - len(sequence.block_table)
            if needed > len(self.free_blocks):
                raise ValueError(f"the suite's cache ran out of blocks: {needed} needed, {len(self.free_blocks)} free")
            sequence.block_table = sequence.block_table + self.free_blocks[:needed]
            del self.free_blocks[:needed]
        inputs = attention_inputs(
            [s.num_tokens for s, _ in work],
            [n for _, n in work],
            [s.block_table for s, _ in work],
            self.block_size,
            self.device,
            is_decode,
        )
        num_tokens = sum(n for _, n in work)
        q, k, v = qkv or (
            self.random(num_tokens, self.num_heads, self.head_dim),
            self.random(num_tokens, self.num_kv_heads, self.head_dim),
            self.random(num_tokens, self.num_kv_heads, self.head_dim),
        )
        expected, start = [], 0
        for sequence, num_new in work:
            end = start + num_new
            stored_k = to_cache_dtype(k[start:end], self.kv_cache_dtype).cpu().double()
            stored_v = to_cache_dtype(v[start:end], self.kv_cache_dtype).cpu().double()
            sequence.keys = torch.cat([sequence.keys, stored_k])
            sequence.values = torch.cat([sequence.values, stored_v])
            expected.append(reference_attention(q[start:end].cpu(), sequence.keys, sequence.values, self.scale))
            start = end
        return Step(work, inputs, q, k, v, torch.cat(expected))

    @torch.inference_mode()
    def forward(self, inputs: AttentionInputs, q, k, v, cache: torch.Tensor | None = None) -> torch.Tensor:
        """The backend's build_metadata and forward, as a model layer calls them."""
        cache = self.cache if cache is None else cache
        metadata = self.backend.build_metadata(inputs)
        if not self.fused_store:
            return self.backend.forward(q, k, v, cache, metadata, self.scale)
        k_cache, v_cache, slots = self.backend.kv_store_target(cache, metadata)
        array_shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        assert tuple(k_cache.shape) == tuple(v_cache.shape) == array_shape, (
            f"kv_store_target must give [num_blocks, block_size, Hkv, D] arrays, got {tuple(k_cache.shape)}"
        )
        assert k_cache.is_contiguous() and v_cache.is_contiguous(), "kv_store_target must give contiguous arrays"
        real = slots >= 0
        for target, x in ((k_cache, k), (v_cache, v)):
            target.view(-1, self.num_kv_heads, self.head_dim)[slots[real]] = to_cache_dtype(x[real], target.dtype)
        return self.backend.forward(q, None, None, cache, metadata, self.scale)

    def check(self, step: Step, out: torch.Tensor, what: str = "") -> None:
        """out (the first rows of it, where the batch was padded) against the step's reference."""
        num_tokens = step.expected.shape[0]
        expected_shape = (num_tokens, self.num_heads, self.head_dim)
        assert tuple(out.shape[1:]) == expected_shape[1:] and out.shape[0] >= num_tokens, (
            f"forward returned shape {tuple(out.shape)}, expected {expected_shape}"
        )
        assert out.dtype == self.dtype and out.device.type == self.device.type, (
            f"forward returned {out.dtype} on {out.device}, expected q's dtype {self.dtype} on {self.device}"
        )
        got = out[:num_tokens].double().cpu()
        error = (got - step.expected).abs()
        bad = ~(error <= self.atol + self.rtol * step.expected.abs())  # NaN counts as bad
        if not bad.any():
            return
        token, head = bad.nonzero()[0, :2].tolist()
        starts = step.inputs.query_start_loc.tolist()
        row = next(i for i in range(len(step.work)) if starts[i + 1] > token)
        sequence, num_new = step.work[row]
        raise AssertionError(
            f"{what or 'attention'}: sequence {row} of the batch ({sequence.num_tokens - num_new} cached + {num_new} "
            f"new tokens, block size {self.block_size}, {self.dtype}, cache {self.kv_cache_dtype}): token "
            f"{token - starts[row]}, head {head} is off by {error[token, head].max().item():.3g} "
            f"(allowed {self.atol} + {self.rtol} * |expected|; {int(bad.sum())} values off in the batch)"
        )

    def step(self, work: list[tuple[SequenceState, int]], is_decode: bool | None = None, what: str = ""):
        prepared = self.prepare(work, is_decode)
        out = self.forward(prepared.inputs, prepared.q, prepared.k, prepared.v)
        self.check(prepared, out, what)
        return out

    @torch.inference_mode()
    def decode_from_qkv(self, work: list[SequenceState], qk_norm: bool, what: str = "") -> torch.Tensor:
        """A decode step of work's sequences through the backend's decode_qkv (DecodesFromQKV), from
        random QKV rows; the reference normalizes (qk_norm) and rotates q and k in float64, rounded
        to the model dtype once, and records the rotated k as the sequences' own."""
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        positions = torch.tensor([s.num_tokens for s in work], device=self.device)
        qkv = self.random(len(work), (heads + 2 * kv_heads) * dim)
        cos_sin = rotary_table(dim, int(positions.max()) + 1).to(self.device)
        weights = self.random(2, dim).abs() + 0.5
        eps = 1e-6
        norm = (weights[0], weights[1], eps) if qk_norm else None
        rows = qkv.view(len(work), -1, dim)
        # the reference runs on the CPU, its norm weights with it
        q_norm, k_norm = ((weights[0].cpu(), eps), (weights[1].cpu(), eps)) if qk_norm else (None, None)
        q = reference_norm_rotate(rows[:, :heads].cpu(), positions.cpu(), cos_sin.cpu(), q_norm)
        k = reference_norm_rotate(rows[:, heads : heads + kv_heads].cpu(), positions.cpu(), cos_sin.cpu(), k_norm)
        as_model = (q.to(self.dtype).to(self.device), k.to(self.dtype).to(self.device), rows[:, heads + kv_heads :])
        step = self.prepare([(s, 1) for s in work], True, qkv=as_model)
        metadata = self.backend.build_metadata(step.inputs)
        assert self.backend.decodes_qkv(metadata), f"decodes_qkv refuses a decode step ({what})"
        out = self.backend.decode_qkv(qkv, positions, cos_sin, norm, heads, self.cache, metadata, self.scale)
        self.check(step, out, what)
        return out


def run_scenario(run: AttentionRun) -> None:
    """The runner's kinds of calls in a few steps: ragged prefill, a cached prefix beside a decode
    and a first prefill chunk, the chunk's rest beside decodes, then a decode of every sequence."""
    bs = run.block_size
    a, b, d = run.new_sequence(), run.new_sequence(), run.new_sequence()
    run.step([(a, bs + 3), (b, 5)], what="ragged prefill")
    c = run.share_prefix(a, 1)
    run.step([(c, 4), (b, 1), (d, bs + 1)], what="cached prefix, decode and a first chunk")
    run.step([(a, 1), (c, 1), (d, 6)], what="the chunk's rest after decodes, as the runner lays them out")
    run.step([(a, 1), (b, 1), (c, 1), (d, 1)], what="decode")


class AttentionBackendSuite:
    """Subclass with `attention` (a registered name) and optionally `attention_options`, `device`,
    `dtypes` and the shapes below; pytest collects the subclass's tests, each once per dtype."""

    attention: str = "torch"
    attention_options: dict = {}
    device: str = "cpu"
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    # (atol, rtol) of outputs against the float64 reference, by the model's dtype; with an fp8 cache
    # the reference reads K/V rounded as the cache holds them, within fp8_tolerance, since a backend
    # may attend to a step's new K/V before rounding them (which moves outputs by up to ~3e-2 here)
    tolerances = {torch.float32: (2e-4, 2e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
    fp8_tolerance = (6e-2, 6e-2)
    # block sizes to try: the first that validate accepts serves the tests, test_block_sizes runs all it accepts
    block_sizes: tuple[int, ...] = (16, 32, 256)
    heads: tuple[int, int, int] = (4, 2, 32)  # (query heads, KV heads, head_dim) of most tests
    head_shapes: tuple[tuple[int, int, int], ...] = ((2, 2, 32), (8, 2, 32), (4, 1, 64))  # test_head_shapes'

    def pytest_generate_tests(self, metafunc):
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes, ids=[str(d).removeprefix("torch.") for d in self.dtypes])

    # -- helpers --------------------------------------------------------------------------------

    def make_backend(self, block_size: int | None = None):
        config = EngineConfig(device=self.device, kvcache_block_size=block_size or self.block_sizes[0])
        return get_registry().create("attention", self.attention, config, options=self.attention_options)

    def accepted_block_sizes(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, head_dim: int) -> list[int]:
        validate = self.make_backend().validate
        return [
            bs
            for bs in self.block_sizes
            if not validate(torch.device(self.device), dtype, bs, head_dim, kv_cache_dtype)
        ]

    def make_run(self, dtype, kv_cache_dtype=None, block_size=None, heads=None, **options) -> AttentionRun:
        """An AttentionRun over a configuration the backend validates (by default the first of
        block_sizes it accepts); fails with validate's reasons when it refuses it."""
        kv_cache_dtype = kv_cache_dtype or dtype
        heads = heads or self.heads
        device = torch.device(self.device)
        if block_size is None:
            accepted = self.accepted_block_sizes(dtype, kv_cache_dtype, heads[2])
            block_size = accepted[0] if accepted else self.block_sizes[0]
        backend = self.make_backend(block_size)
        reasons = backend.validate(device, dtype, block_size, heads[2], kv_cache_dtype)
        assert not reasons, (
            f"validate refuses the configuration under test ({dtype}, block size {block_size}, head_dim "
            f"{heads[2]}, cache {kv_cache_dtype} on {self.device}): {reasons}; choose the suite's dtypes, "
            "block_sizes and heads among those the backend serves"
        )
        options.setdefault("tolerance", self.fp8_tolerance if kv_cache_dtype == FP8 else self.tolerances[dtype])
        return AttentionRun(backend, device, dtype, kv_cache_dtype, block_size, *heads, **options)

    # -- tests ----------------------------------------------------------------------------------

    def test_validate_answers_with_reasons(self, dtype):
        """validate returns a list of strings (empty: served) for every configuration the engine
        may ask about, never raising; and every configuration of this dtype it accepts is served
        (checked with one prefill and one decode each)."""
        device = torch.device(self.device)
        validate = self.make_backend().validate
        served = []
        for model_dtype in MODEL_DTYPES:
            for kv_cache_dtype in (model_dtype, FP8):
                for block_size in sorted({1, 8, 24, *self.block_sizes}):
                    for head_dim in sorted({8, 48, 96, 512, self.heads[2]}):
                        config = (model_dtype, block_size, head_dim, kv_cache_dtype)
                        reasons = validate(device, *config)
                        assert isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons), (
                            f"validate{(device, *config)} must return a list of reasons (strings), got {reasons!r}"
                        )
                        if not reasons and model_dtype == dtype:
                            served.append(config)
        self.make_run(dtype)  # the suite's own configuration is accepted
        for model_dtype, block_size, head_dim, kv_cache_dtype in served:
            run = self.make_run(model_dtype, kv_cache_dtype, block_size, (2, 1, head_dim), num_blocks=8)
            a, b = run.new_sequence(), run.new_sequence()
            what = f"validate accepted block size {block_size}, head_dim {head_dim}, cache {kv_cache_dtype}"
            run.step([(a, 3), (b, 1)], what=what)
            run.step([(a, 1), (b, 1)], what=what)

    def test_prefill_of_ragged_sequences(self, dtype):
        run = self.make_run(dtype)
        bs = run.block_size
        sequences = [run.new_sequence() for _ in range(4)]
        # across a block boundary, a single token, exactly two blocks, a few tokens
        run.step(list(zip(sequences, [bs + 3, 1, 2 * bs, 5])), what="ragged prefill")

    def test_prefill_after_a_cached_prefix(self, dtype):
        """Sequences whose first blocks another sequence computed in an earlier call (prefix-cache
        hits) read them from the cache, beside a fresh prompt; later decodes of the owner and the
        sharers read the shared blocks too."""
        run = self.make_run(dtype)
        bs = run.block_size
        owner = run.new_sequence()
        run.step([(owner, 2 * bs + 5)], what="the prefix's owner")
        two_blocks, one_block, fresh = run.share_prefix(owner, 2), run.share_prefix(owner, 1), run.new_sequence()
        run.step([(two_blocks, 7), (one_block, bs + 2), (fresh, 4)], what="prefill after a cached prefix")
        run.step([(owner, 1), (two_blocks, 1), (one_block, 1), (fresh, 1)], what="decode over shared blocks")

    def test_chunked_prefill(self, dtype):
        """A prompt computed in chunks over several calls, one of them a lone token that is not a
        decode (the sequence does not sample yet), beside decodes and a new prompt."""
        run = self.make_run(dtype)
        bs = run.block_size
        chunked, other, late = run.new_sequence(), run.new_sequence(), run.new_sequence()
        run.step([(chunked, bs + 5), (other, 9)], what="first chunk")
        run.step([(chunked, 1)], is_decode=False, what="a one-token chunk")
        run.step([(other, 1), (chunked, bs + 4), (late, 3)], what="last chunk beside a decode")
        run.step([(chunked, 1), (other, 1), (late, 1)], what="decode after chunked prefill")

    def test_decodes_leading_a_prefill(self, dtype):
        """Decodes of contexts many blocks long leading a step that also computes a prompt, as the
        runner lays such steps out (num_decodes): a backend may attend for them as for decodes."""
        run = self.make_run(dtype)
        bs = run.block_size
        long, short, prompt = run.new_sequence(), run.new_sequence(), run.new_sequence()
        run.step([(long, 5 * bs + 3), (short, 2)], what="prompts")
        run.step([(long, 1), (short, 1), (prompt, bs + 5)], what="decodes leading a prompt's first chunk")
        run.step([(long, 1), (prompt, 3)], what="a decode leading a prompt's last chunk")

    def test_decode_of_ragged_contexts(self, dtype):
        """Decode steps over contexts of many lengths (one token, a block less one, a block, a
        block and one, several blocks), reading what prefill and earlier decodes stored."""
        run = self.make_run(dtype)
        bs = run.block_size
        sequences = [run.new_sequence() for _ in range(5)]
        run.step(list(zip(sequences, [1, bs - 1, bs, bs + 1, 3 * bs + 2])), what="prefill")
        for step in range(3):
            run.step([(s, 1) for s in sequences], what=f"decode step {step}")
        run.step([(s, 1) for s in sequences[1::2]], what="decode of some of the sequences")

    def test_reused_blocks_hide_their_earlier_owner(self, dtype):
        """Blocks freed by one sequence and handed to another still hold the first one's K/V past
        the new owner's length: attention must never reach them."""
        run = self.make_run(dtype)
        bs = run.block_size
        earlier = run.new_sequence()
        run.step([(earlier, 3 * bs)], what="the earlier owner")
        run.release(earlier)
        later = run.new_sequence()
        run.step([(later, bs + 3)], what="prefill in reused blocks")
        run.step([(later, 1)], what="decode in reused blocks")

    def test_cuda_graph_padding_rows(self, dtype):
        """A backend that supports CUDA graphs gets decode batches padded as the graphs pad them:
        rows with seq_len 0 and slot -1 (and stale block tables) store nothing, change nothing in
        the other rows and give finite outputs (which are discarded), with max_seq_len the longest
        a sequence may grow."""
        run = self.make_run(dtype)
        if not run.backend.supports_cuda_graphs:
            pytest.skip(f"attention {self.attention!r} does not support CUDA graphs")
        bs = run.block_size
        sequences = [run.new_sequence() for _ in range(3)]
        run.step(list(zip(sequences, [bs + 4, 9, 2 * bs + 1])), what="prefill")
        step = run.prepare([(s, 1) for s in sequences])
        unpadded_cache = run.cache.clone()
        run.forward(step.inputs, step.q, step.k, step.v, unpadded_cache)
        padded = padded_for_cuda_graphs(step.inputs, num_rows=8, max_blocks=6)
        q, k, v = (torch.cat([x, run.random(5, *x.shape[1:])]) for x in (step.q, step.k, step.v))
        out = run.forward(padded, q, k, v)
        run.check(step, out, "a decode batch padded for CUDA graphs")
        assert out.shape[0] == 8 and torch.isfinite(out[3:].float()).all(), "padding rows must give finite outputs"
        assert torch.equal(run.cache.view(torch.uint8), unpadded_cache.view(torch.uint8)), (
            "padding rows changed the cache (slot -1 must store nothing)"
        )
        run.step([(s, 1) for s in sequences], what="decode after a padded one")

    def test_cuda_graph_capture_replays(self, dtype):
        """On CUDA, build_metadata and forward captured in a CUDA graph over static buffers (after
        a plain run, as the runner does) and replayed for two decode steps give the right outputs
        and store K/V that an eager decode then reads."""
        run = self.make_run(dtype)
        if run.device.type != "cuda" or not run.backend.supports_cuda_graphs:
            pytest.skip("captures CUDA graphs: needs a CUDA device and a backend that supports them")
        bs, num_rows, max_blocks = run.block_size, 4, 4
        sequences = [run.new_sequence() for _ in range(3)]
        run.step(list(zip(sequences, [bs + 4, 9, 2 * bs + 1])), what="prefill")
        step = run.prepare([(s, 1) for s in sequences])
        static = padded_for_cuda_graphs(step.inputs, num_rows, max_blocks)
        static.seq_lens.zero_()
        static.slot_mapping.fill_(-1)  # the plain run before capture: every row is padding
        q, k, v = (x.new_zeros(num_rows, *x.shape[1:]) for x in (step.q, step.k, step.v))
        run.forward(static, q, k, v)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run.forward(static, q, k, v)
        for replay in range(2):
            if replay:
                step = run.prepare([(s, 1) for s in sequences])
            filled = padded_for_cuda_graphs(step.inputs, num_rows, max_blocks)
            for name in ("seq_lens", "context_lens", "block_tables", "slot_mapping"):
                getattr(static, name).copy_(getattr(filled, name))
            for buffer, x in ((q, step.q), (k, step.k), (v, step.v)):
                buffer[: x.shape[0]].copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            run.check(step, out, f"decode replayed from a CUDA graph (replay {replay})")
        run.step([(s, 1) for s in sequences], what="eager decode after graph replays")

    def test_prefill_graph_padding(self, dtype):
        """A backend that supports graphs of steps with prefill gets such steps padded as the graphs
        pad them (padded_for_prefill_graphs): decodes, a chunk after a cached prefix and a new
        prompt are right, padding stores nothing and its outputs are finite."""
        run = self.make_run(dtype)
        if not (isinstance(run.backend, PrefillGraphCapture) and run.backend.supports_prefill_graphs):
            pytest.skip(f"attention {self.attention!r} does not support graphs of steps with prefill")
        bs = run.block_size
        decoding, chunked, prompt = run.new_sequence(), run.new_sequence(), run.new_sequence()
        run.step([(decoding, 2 * bs + 1), (chunked, bs + 2)], what="prompts")
        step = run.prepare([(decoding, 1), (chunked, bs - 1), (prompt, 2 * bs + 5)])  # tiles at unaligned starts
        num_tokens = step.q.shape[0]
        unpadded_cache = run.cache.clone()
        run.forward(step.inputs, step.q, step.k, step.v, unpadded_cache)
        padded = padded_for_prefill_graphs(step.inputs, num_tokens + 7, 6, 6)
        q, k, v = (torch.cat([x, run.random(7, *x.shape[1:])]) for x in (step.q, step.k, step.v))
        out = run.forward(padded, q, k, v)
        run.check(step, out, "a step with prefill padded for a graph")
        assert out.shape[0] == num_tokens + 7
        assert torch.equal(run.cache.view(torch.uint8), unpadded_cache.view(torch.uint8)), (
            "padding changed the cache (slot -1 must store nothing)"
        )
        run.step([(decoding, 1), (chunked, 1), (prompt, 1)], what="decode after a padded step")

    def test_prefill_graph_capture_replays(self, dtype):
        """On CUDA, a step with prefill captured in a CUDA graph over padded static buffers and
        replayed for two different steps (other token counts, sequences and contexts) is right."""
        run = self.make_run(dtype)
        if run.device.type != "cuda" or not (
            isinstance(run.backend, PrefillGraphCapture) and run.backend.supports_prefill_graphs
        ):
            pytest.skip("captures CUDA graphs: needs a CUDA device and a backend that supports prefill graphs")
        bs, num_tokens, num_rows, max_blocks = run.block_size, 2 * run.block_size, 4, 6
        first, second, third = run.new_sequence(), run.new_sequence(), run.new_sequence()
        run.step([(first, bs + 3)], what="a prompt")
        steps = [
            run.prepare([(first, 1), (second, bs + 2)]),
            run.prepare([(first, 1), (second, 3), (third, bs - 1)]),
        ]
        static = padded_for_prefill_graphs(steps[0].inputs, num_tokens, num_rows, max_blocks)
        static.query_start_loc.zero_()  # the plain run before capture: every sequence and token is padding
        static.seq_lens.zero_()
        static.slot_mapping.fill_(-1)
        q, k, v = (x.new_zeros(num_tokens, *x.shape[1:]) for x in (steps[0].q, steps[0].k, steps[0].v))
        run.forward(static, q, k, v)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run.forward(static, q, k, v)
        for replay, step in enumerate(steps):
            filled = padded_for_prefill_graphs(step.inputs, num_tokens, num_rows, max_blocks)
            for name in ("query_start_loc", "seq_lens", "context_lens", "block_tables", "slot_mapping"):
                getattr(static, name).copy_(getattr(filled, name))
            for buffer, x in ((q, step.q), (k, step.k), (v, step.v)):
                buffer.zero_()
                buffer[: x.shape[0]].copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            run.check(step, out, f"a step with prefill replayed from a CUDA graph (replay {replay})")
        run.step([(first, 1), (second, 1), (third, 1)], what="eager decode after graph replays")

    def test_fp8_cache(self, dtype):
        """An fp8 cache (float8_e4m3fn, scale 1, rounded as inferlab.core.kv_cache_dtype says),
        where validate accepts one."""
        if not self.accepted_block_sizes(dtype, FP8, self.heads[2]):
            reasons = self.make_backend().validate(
                torch.device(self.device), dtype, self.block_sizes[0], self.heads[2], FP8
            )
            pytest.skip(f"validate refuses an fp8 cache: {reasons}")
        run_scenario(self.make_run(dtype, FP8))

    def test_block_sizes(self, dtype):
        """Every one of block_sizes that validate accepts serves the scenario."""
        accepted = self.accepted_block_sizes(dtype, dtype, self.heads[2])
        assert accepted, f"validate accepts none of block_sizes={self.block_sizes}"
        for block_size in accepted:
            run_scenario(self.make_run(dtype, block_size=block_size, num_blocks=24))

    def test_head_shapes(self, dtype):
        """Query heads sharing KV heads in groups of several sizes, and several head dims: those of
        head_shapes whose head_dim validate accepts."""
        served = [heads for heads in self.head_shapes if self.accepted_block_sizes(dtype, dtype, heads[2])]
        assert served or not self.head_shapes, f"validate refuses every head_dim of head_shapes={self.head_shapes}"
        for heads in served:
            run_scenario(self.make_run(dtype, heads=heads))

    def test_decodes_from_qkv(self, dtype):
        """A backend with DecodesFromQKV attends from the QKV rows in decode steps: q and k normalized
        (Qwen3) or not (Llama) and rotated, the new k and v stored where a later step reads them."""
        if not isinstance(self.make_backend(), DecodesFromQKV):
            pytest.skip(f"attention {self.attention!r} does not implement DecodesFromQKV")
        run = self.make_run(dtype)
        a, b, c = run.new_sequence(), run.new_sequence(), run.new_sequence()
        run.step([(a, run.block_size + 3), (b, 5), (c, 1)], what="ragged prefill")
        run.decode_from_qkv([a, b, c], qk_norm=True, what="decode from QKV with the q/k norms")
        run.decode_from_qkv([c, a], qk_norm=False, what="decode from QKV, the rotary alone")
        run.step([(a, 1), (b, 1), (c, 1)], is_decode=True, what="a decode reading the K/V decode_qkv stored")

    def test_fused_kv_store(self, dtype):
        """A backend with FusedKVStore lets a model write K/V into kv_store_target's arrays itself
        (rounded as to_cache_dtype rounds) and call forward with k = v = None: the outputs are
        right and the cache holds exactly what the backend's own store writes."""
        if not isinstance(self.make_backend(), FusedKVStore):
            pytest.skip(f"attention {self.attention!r} does not implement FusedKVStore")
        for kv_cache_dtype in (dtype, FP8):
            if not self.accepted_block_sizes(dtype, kv_cache_dtype, self.heads[2]):
                continue
            own, fused = (self.make_run(dtype, kv_cache_dtype, fused_store=fused) for fused in (False, True))
            run_scenario(own)
            run_scenario(fused)
            assert torch.equal(own.cache.view(torch.uint8), fused.cache.view(torch.uint8)), (
                f"a model's store through kv_store_target ({kv_cache_dtype} cache) differs from the backend's own"
            )
