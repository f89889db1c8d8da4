"""Triton kernels that fill the CUDA graphs' static input buffers for a step (decode, and steps with prefill).

Copied in with torch, a decode step's inputs took a dozen small kernels before the graph replay:
one copy a buffer, the padding rows' fills, and five elementwise ops that swap the placeholder ids
(-(k + 1): the previous step's k-th sample, not yet on the host) for the samples, each a launch
on a GPU that has nothing else to do then, which together took several times what one kernel
takes (BENCHMARKS.md, "Why the defaults are what they are"). Here one program a row does all of it: the batch's rows get
their token (placeholders resolved), position, slot, lengths and block table; padding rows up to
the graph's batch get no keys and no slot.

Imported only where it runs: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_token(
    ids_ptr,
    positions_ptr,
    slots_ptr,
    sampled_ptr,
    out_ids_ptr,
    out_positions_ptr,
    out_slots_ptr,
    row,
    RESOLVE: tl.constexpr,
):
    """Token `row`'s id (a placeholder resolved), position and slot."""
    token = tl.load(ids_ptr + row)
    if RESOLVE:  # -(k + 1) stands for the previous step's k-th sample
        token = tl.where(token < 0, tl.load(sampled_ptr + tl.maximum(-token - 1, 0)), token)
    tl.store(out_ids_ptr + row, token)
    tl.store(out_positions_ptr + row, tl.load(positions_ptr + row))
    tl.store(out_slots_ptr + row, tl.load(slots_ptr + row))


@triton.jit
def _copy_sequence(
    seq_lens_ptr,
    context_lens_ptr,
    tables_ptr,
    out_seq_lens_ptr,
    out_context_lens_ptr,
    out_tables_ptr,
    row,
    width,
    tables_stride,
    out_tables_stride,
    BLOCK_W: tl.constexpr,
):
    """Sequence `row`'s lengths and block table."""
    tl.store(out_seq_lens_ptr + row, tl.load(seq_lens_ptr + row))
    tl.store(out_context_lens_ptr + row, tl.load(context_lens_ptr + row))
    for start in range(0, width, BLOCK_W):
        cols = start + tl.arange(0, BLOCK_W)
        mask = cols < width
        blocks = tl.load(tables_ptr + row * tables_stride + cols, mask=mask)
        tl.store(out_tables_ptr + row * out_tables_stride + cols, blocks, mask=mask)


# The step's inputs are slices of one buffer (ModelRunner.upload) whose offsets follow the batch's
# size: neither their alignment nor the sizes are specialized on, or new batch sizes would compile
# new variants in the middle of a run.
@triton.jit(
    do_not_specialize=["num_seqs", "width", "tables_stride"],
    do_not_specialize_on_alignment=[
        "ids_ptr",
        "positions_ptr",
        "slots_ptr",
        "seq_lens_ptr",
        "context_lens_ptr",
        "tables_ptr",
        "sampled_ptr",
    ],
)
def _fill_kernel(
    ids_ptr,
    positions_ptr,
    slots_ptr,
    seq_lens_ptr,
    context_lens_ptr,
    tables_ptr,
    sampled_ptr,
    out_ids_ptr,
    out_positions_ptr,
    out_slots_ptr,
    out_seq_lens_ptr,
    out_context_lens_ptr,
    out_tables_ptr,
    num_seqs,
    width,
    tables_stride,
    out_tables_stride,
    RESOLVE: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    if row < num_seqs:
        _copy_token(
            ids_ptr, positions_ptr, slots_ptr, sampled_ptr, out_ids_ptr, out_positions_ptr, out_slots_ptr, row, RESOLVE
        )
        _copy_sequence(
            seq_lens_ptr,
            context_lens_ptr,
            tables_ptr,
            out_seq_lens_ptr,
            out_context_lens_ptr,
            out_tables_ptr,
            row,
            width,
            tables_stride,
            out_tables_stride,
            BLOCK_W,
        )
    else:  # a padding row: no keys to attend to, no slot to store into
        tl.store(out_seq_lens_ptr + row, 0)
        tl.store(out_context_lens_ptr + row, 0)
        tl.store(out_slots_ptr + row, -1)


# Block-table columns a loop step copies: one size for every table width, so that the kernel has
# two variants (with and without placeholders) and both compile at start-up.
FILL_BLOCK_W = 128


def fill_static_inputs(
    batch: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    last_sampled: torch.Tensor | None,
    out,
) -> None:
    """Writes a step's n rows into the static buffers that `out` (a DecodeGraphs) holds as
    attributes input_ids, positions, slot_mapping, seq_lens, context_lens and block_tables, each
    with at least `batch` rows, and pads rows n..batch.
    input_ids may hold placeholders when last_sampled is given. The block tables' columns beyond
    the step's width keep stale blocks, which no row's seq_lens reaches."""
    num_seqs, width = block_tables.shape
    resolve = last_sampled is not None
    _fill_kernel[(batch,)](
        input_ids,
        positions,
        slot_mapping,
        seq_lens,
        context_lens,
        block_tables,
        last_sampled if resolve else input_ids,  # unused unless RESOLVE: any tensor serves as the pointer
        out.input_ids,
        out.positions,
        out.slot_mapping,
        out.seq_lens,
        out.context_lens,
        out.block_tables,
        num_seqs,
        width,
        block_tables.stride(0),
        out.block_tables.stride(0),
        RESOLVE=resolve,
        BLOCK_W=FILL_BLOCK_W,
        num_warps=1,
    )


@triton.jit(
    do_not_specialize=["num_tokens", "num_seqs", "width", "tables_stride", "token_rows", "seq_rows"],
    do_not_specialize_on_alignment=[
        "ids_ptr",
        "positions_ptr",
        "slots_ptr",
        "query_start_ptr",
        "seq_lens_ptr",
        "context_lens_ptr",
        "tables_ptr",
        "sampled_ptr",
    ],
)
def _fill_step_kernel(
    ids_ptr,
    positions_ptr,
    slots_ptr,
    query_start_ptr,
    seq_lens_ptr,
    context_lens_ptr,
    tables_ptr,
    sampled_ptr,
    out_ids_ptr,
    out_positions_ptr,
    out_slots_ptr,
    out_query_start_ptr,
    out_seq_lens_ptr,
    out_context_lens_ptr,
    out_tables_ptr,
    num_tokens,
    num_seqs,
    width,
    tables_stride,
    out_tables_stride,
    token_rows,
    seq_rows,
    RESOLVE: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Program r fills token r and sequence r of a graph with token_rows tokens and seq_rows
    sequences (r <= seq_rows also writes query_start[r])."""
    row = tl.program_id(0)
    if row < num_tokens:
        _copy_token(
            ids_ptr, positions_ptr, slots_ptr, sampled_ptr, out_ids_ptr, out_positions_ptr, out_slots_ptr, row, RESOLVE
        )
    elif row < token_rows:  # a padding token: a valid id and position, no slot to store into
        tl.store(out_ids_ptr + row, 0)
        tl.store(out_positions_ptr + row, 0)
        tl.store(out_slots_ptr + row, -1)
    if row < num_seqs:
        tl.store(out_query_start_ptr + row, tl.load(query_start_ptr + row))
        _copy_sequence(
            seq_lens_ptr,
            context_lens_ptr,
            tables_ptr,
            out_seq_lens_ptr,
            out_context_lens_ptr,
            out_tables_ptr,
            row,
            width,
            tables_stride,
            out_tables_stride,
            BLOCK_W,
        )
    elif row <= seq_rows:  # past the batch: sequences with no new tokens and no keys
        tl.store(out_query_start_ptr + row, num_tokens)
        if row < seq_rows:
            tl.store(out_seq_lens_ptr + row, 0)
            tl.store(out_context_lens_ptr + row, 0)


def fill_step_inputs(
    token_rows: int,
    seq_rows: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    last_sampled: torch.Tensor | None,
    out,
) -> None:
    """As fill_static_inputs, for a graph of a step with prefill: its first token_rows tokens and
    seq_rows sequences (seq_rows <= token_rows) get the step's, then padding (tokens with slot -1,
    sequences with no new tokens and seq_len 0); `out` (a PrefillGraphs) also holds query_start_loc."""
    num_seqs, width = block_tables.shape
    resolve = last_sampled is not None
    _fill_step_kernel[(max(token_rows, seq_rows + 1),)](
        input_ids,
        positions,
        slot_mapping,
        query_start_loc,
        seq_lens,
        context_lens,
        block_tables,
        last_sampled if resolve else input_ids,
        out.input_ids,
        out.positions,
        out.slot_mapping,
        out.query_start_loc,
        out.seq_lens,
        out.context_lens,
        out.block_tables,
        input_ids.shape[0],
        num_seqs,
        width,
        block_tables.stride(0),
        out.block_tables.stride(0),
        token_rows,
        seq_rows,
        RESOLVE=resolve,
        BLOCK_W=FILL_BLOCK_W,
        num_warps=1,
    )
