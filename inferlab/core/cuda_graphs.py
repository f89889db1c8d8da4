"""CUDA graphs for decode steps, as nano-vllm captures them: one graph per batch size in a ladder
(1, 2, 4, 8, 16, 32, ... up to the largest decode batch), all reading static input buffers. A
decode batch is copied into the buffers, padded to the next captured size (padding rows store
nothing and attend to nothing) and replayed, which removes the per-kernel launch cost that
dominates small decode steps. The copy-in, the padding and the swap of placeholder ids for the
previous step's samples are one kernel (inferlab.kernels.graph_inputs). Where the sampler allows,
the LM head and the sampler of each decode batch replay from graphs too (SamplingGraphs).

Small steps with prefill (PrefillGraphs) are captured the same way, by token count, over buffers
padded in tokens and sequences; they share the decode graphs' memory pool (one stream replays
one graph at a time, and every graph's output is copied into its own static buffer)."""

import bisect
import functools
import logging
from dataclasses import dataclass
from time import perf_counter

import torch

from inferlab.core.batch import AttentionInputs, SamplingTensors
from inferlab.core.protocols import RepresentativeLayers, SplitDecodes

log = logging.getLogger("inferlab")

MAX_GRAPH_BATCH = 512


@dataclass(frozen=True, slots=True)
class GraphLimits:
    """Which steps replay CUDA graphs: decode-only steps of up to decode_batch sequences, steps with
    prefill of up to prefill_tokens tokens whose decodes hold fewer than decode_context tokens
    each (0: any). All 0: every step runs eagerly."""

    decode_batch: int = 0
    prefill_tokens: int = 0
    decode_context: int = 0


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


def smallest_size_holding(sizes: list[int], rows: int) -> int | None:
    """The smallest of ascending `sizes` that holds `rows`, or None when none does."""
    index = bisect.bisect_left(sizes, rows)
    return sizes[index] if index < len(sizes) else None


class CapturedGraphs:
    """What the decode graphs and the graphs of steps with prefill share: a graph per size in
    `sizes` (rows of the static buffers input_ids, positions and hidden: a batch's sequences, or a
    step's tokens), each replaying the model over the buffers' first rows as `_inputs(size)`
    describes them to the attention backend."""

    sizes: list[int]
    graphs: dict[int, torch.cuda.CUDAGraph]
    pool = None  # the memory pool the graphs share

    def _allocate_buffers(
        self,
        num_tokens: int,
        num_seqs: int,
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Static buffers for up to num_tokens tokens of num_seqs sequences, all padding: no
        sequence has new tokens or keys, no token a slot."""
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        with torch.inference_mode():
            self.input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
            self.positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
            self.query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
            self.seq_lens = torch.zeros(num_seqs, dtype=torch.int32, device=device)
            self.context_lens = torch.zeros(num_seqs, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros(num_seqs, self.max_blocks, dtype=torch.int32, device=device)
            self.hidden = torch.zeros(num_tokens, hidden_size, dtype=dtype, device=device)

    def _inputs(self, size: int) -> AttentionInputs:
        raise NotImplementedError

    def _size_for(self, rows: int) -> int | None:
        """The smallest captured size that holds `rows`, or None."""
        return smallest_size_holding(self.sizes, rows)

    @torch.inference_mode()
    def _capture(self, model, backend, kv_caches, pool=None) -> None:
        self.graphs = {}
        # A plain run before each capture loads every kernel the capture will launch (loading one
        # while a stream captures aborts the capture) and settles allocations outside it: over the
        # model's first layers alone where later ones repeat their kernels (kernel_variant_layers).
        plain_layers = (model.kernel_variant_layers if isinstance(model, RepresentativeLayers) else None) or len(
            kv_caches
        )
        for size in reversed(self.sizes):  # largest first, so the smaller ones fit in its pool
            ids, positions = self.input_ids[:size], self.positions[:size]
            model(ids, positions, kv_caches[:plain_layers], backend.build_metadata(self._inputs(size)))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.hidden[:size] = model(ids, positions, kv_caches, backend.build_metadata(self._inputs(size)))
            pool = pool or graph.pool()
            self.graphs[size] = graph
        self.pool = pool
        torch.cuda.synchronize()

    def release(self) -> None:
        """Destroys the graphs now, whoever still refers to this object. NCCL counts every graph
        that captured one of its collectives and will not finish tearing down (or aborting) the
        communicator until each is destroyed: tensor-parallel rank 0 releases its graphs first."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.sizes = [0]  # run() finds no graph for any step: it returns None, the eager path


class DecodeGraphs(CapturedGraphs):
    """Captured decode graphs over static buffers; run() replays the one that fits a batch."""

    def __init__(
        self,
        model,
        backend,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.sizes = graph_batch_sizes(min(max_num_seqs, MAX_GRAPH_BATCH))
        max_batch = self.sizes[-1]
        self._allocate_buffers(max_batch, max_batch, max_model_len, block_size, hidden_size, dtype, device)
        with torch.inference_mode():  # one token a sequence, in every replay
            torch.arange(max_batch + 1, out=self.query_start_loc)
        start = perf_counter()
        self._compile_fill()
        self._capture(model, backend, kv_caches)
        log.info(
            "captured CUDA graphs for decode batches of %s sequences in %.1f s",
            self.sizes,
            perf_counter() - start,
        )

    def _inputs(self, batch: int) -> AttentionInputs:
        """The static buffers' first `batch` rows, as the backend sees them in every replay."""
        return AttentionInputs(
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            context_lens=self.context_lens[:batch],
            block_tables=self.block_tables[:batch],
            slot_mapping=self.slot_mapping[:batch],
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,
            is_decode=True,
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def _compile_fill(self) -> None:
        """Runs the input-filling kernel once in each of its variants (with and without
        placeholders), so that neither compiles during a run; the buffers are filled anew by
        every replay."""
        from inferlab.kernels.graph_inputs import fill_static_inputs

        device = self.input_ids.device
        ids = torch.zeros(1, dtype=torch.int64, device=device)
        lens = torch.ones(1, dtype=torch.int32, device=device)
        table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        for sampled in (None, ids):
            fill_static_inputs(1, ids, ids, ids, lens, lens, table, sampled, self)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs: AttentionInputs,
        last_sampled: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Hidden states [B, hidden] of a decode batch, or None when no graph fits it. With
        last_sampled, input ids -(k + 1) stand for last_sampled[k] (placeholders)."""
        num_seqs = inputs.num_seqs
        batch = self._size_for(num_seqs)
        if batch is None or inputs.block_tables.shape[1] > self.max_blocks:
            return None
        from inferlab.kernels.graph_inputs import fill_static_inputs  # Triton: imported where it runs

        fill_static_inputs(
            batch,
            input_ids,
            positions,
            inputs.slot_mapping,
            inputs.seq_lens,
            inputs.context_lens,
            inputs.block_tables,
            last_sampled,
            self,
        )
        self.graphs[batch].replay()
        return self.hidden[:num_seqs]


# The kinds of decode batches whose LM head and sampling SamplingGraphs replay, by their rows'
# settings: every row greedy, or some sampled and none filtered by top-k, top-p or min-p (greedy
# rows may be among them). Filtered batches run eagerly.
SAMPLING_GRAPH_KINDS = ("greedy", "sampled")


def sampling_graph_kind(params: SamplingTensors) -> str | None:
    """Which of SAMPLING_GRAPH_KINDS a batch with these settings replays, or None (eager): rows
    whose logits are adjusted (penalties, logit_bias, min_tokens, constraints) sample eagerly."""
    if params.adjustments is not None:
        return None
    if params.all_greedy:
        return "greedy"
    if params.any_top_k or params.any_top_p or params.any_min_p:
        return None
    return "sampled"


class SamplingGraphs:
    """The LM head and the sampler of decode batches, captured per decode graph batch size and
    kind of rows (SAMPLING_GRAPH_KINDS), over the decode graphs' hidden-state buffer: replayed
    right after the decode graph, they take the place of the head's and the sampler's eager
    launches, which take the host longer than the device takes to run them in a one-sequence step
    (BENCHMARKS.md, "One sequence"). Each graph samples into the static `tokens` buffer; the rows' settings are copied into
    static buffers when the batch's rows change, and the index of the token each row samples is
    its position plus one (a decode row samples the token after the one it computes). Only for a
    sampler whose calls a graph can capture (Sampler.supports_cuda_graphs)."""

    def __init__(self, decode_graphs: DecodeGraphs, compute_logits, sampler, vocab_size: int):
        self.decode_graphs = decode_graphs
        self.sampler = sampler  # the one captured: a runner given another one samples eagerly
        rows, device = decode_graphs.sizes[-1], decode_graphs.hidden.device
        with torch.inference_mode():
            self.floats = torch.zeros(3, rows, dtype=torch.float32, device=device)  # temperature, top-p, min-p
            self.ints = torch.zeros(2, rows, dtype=torch.int64, device=device)  # top-k, seed
            self.ints[0] = vocab_size
            self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.settings_of: torch.Tensor | None = None  # the temperatures of the settings held (by identity)
        self.tokens_copied: torch.cuda.Event | None = None  # the latest download of `tokens`
        start = perf_counter()
        self.graphs = self._capture(compute_logits, sampler, decode_graphs.pool)
        log.info("captured the LM head and sampling of decode batches in %.1f s", perf_counter() - start)

    def _settings(self, rows: int, kind: str) -> SamplingTensors:
        graphs = self.decode_graphs
        return SamplingTensors(
            temperatures=self.floats[0, :rows],
            top_p=self.floats[1, :rows],
            min_p=self.floats[2, :rows],
            top_k=self.ints[0, :rows],
            seeds=self.ints[1, :rows],
            steps=graphs.positions[:rows] + 1,
            all_greedy=kind == "greedy",
            any_top_k=False,
            any_top_p=False,
            any_min_p=False,
        )

    @torch.inference_mode()
    def _capture(self, compute_logits, sampler, pool) -> dict[tuple[int, str], torch.cuda.CUDAGraph]:
        graphs = {}
        hidden = self.decode_graphs.hidden
        for rows in reversed(self.decode_graphs.sizes):
            for kind in SAMPLING_GRAPH_KINDS:
                sampler(compute_logits(hidden[:rows]), self._settings(rows, kind))  # loads its kernels
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool):
                        self.tokens[:rows] = sampler(compute_logits(hidden[:rows]), self._settings(rows, kind))
                except RuntimeError as e:
                    raise RuntimeError(
                        f"capturing the LM head and sampler {type(sampler).__name__} of {rows} {kind} decode rows in "
                        f"a CUDA graph failed: {e}. The sampler declares supports_cuda_graphs; a capturable sampler "
                        f"never reads a tensor back to the host nor copies from host memory: if it does, remove the "
                        f"declaration to run it eagerly"
                    ) from e
                graphs[rows, kind] = graph
        torch.cuda.synchronize()
        return graphs

    def run(self, hidden: torch.Tensor, params: SamplingTensors) -> bool:
        """Samples hidden's N rows with params into tokens[:N]; False where no graph does it:
        hidden must be the decode graphs' own buffer (as DecodeGraphs.run returns it)."""
        kind = sampling_graph_kind(params)
        rows = hidden.shape[0]
        if kind is None or hidden.data_ptr() != self.decode_graphs.hidden.data_ptr():
            return False
        size = self.decode_graphs._size_for(rows)
        if size is None:
            return False
        if self.settings_of is not params.temperatures:  # the rows changed: their settings go up
            self.floats[0, :rows].copy_(params.temperatures)
            self.floats[1, :rows].copy_(params.top_p)
            self.floats[2, :rows].copy_(params.min_p)
            self.ints[0, :rows].copy_(params.top_k)
            self.ints[1, :rows].copy_(params.seeds)
            self.settings_of = params.temperatures
        if self.tokens_copied is not None:  # the previous step's tokens are on their way to the host
            torch.cuda.current_stream(self.tokens.device).wait_event(self.tokens_copied)
        self.graphs[size, kind].replay()
        return True


# graph_prefill_tokens=None captures steps with prefill up to this much matmul work a rank: up to
# there, launching the step eagerly can take the host longer than the device takes to run it, above
# all in a process's first burst (BENCHMARKS.md, "Where the time goes").
AUTO_GRAPH_PREFILL_FLOPS = 16e12


def auto_graph_prefill_tokens(flops_per_token: float, max_tokens: int) -> int:
    """The largest graph size (prefill_graph_sizes, up to max_tokens: a step's most) whose tokens'
    matmuls stay within AUTO_GRAPH_PREFILL_FLOPS, and at least the smallest size."""
    sizes = prefill_graph_sizes(max_tokens)
    fitting = [size for size in sizes if size * flops_per_token <= AUTO_GRAPH_PREFILL_FLOPS]
    return fitting[-1] if fitting else sizes[0] if sizes else 0


def prefill_graph_capacity(tokens: int, max_tokens: int) -> int:
    """The token capacity of the graph that replays a step of `tokens` tokens when graphs go up to
    max_tokens: the tokens it computes, padding included."""
    sizes = _prefill_graph_sizes(max_tokens)
    return sizes[bisect.bisect_left(sizes, tokens)]


@functools.cache
def _prefill_graph_sizes(max_tokens: int) -> tuple[int, ...]:
    return tuple(prefill_graph_sizes(max_tokens))


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """Token capacities of the graphs of steps with prefill: powers of two from 16 to 256, every
    multiple of 256 to 2,048, then eight sizes an octave (steps of 256 to 4,096, of 512 to 8,192,
    of 1,024 to 16,384, ...), up to max_tokens (itself included). A step runs the smallest that
    holds it, so padding costs at most 256 tokens' work to 2,048 and an eighth of the step above
    (a power-of-two ladder would make a 1,100-token step do 2,048's work: 8B shapes' device time
    grows faster than the host's launch saves)."""
    sizes = [size for size in (16, 32, 64, 128) if size < max_tokens]
    size = 256
    while size < max_tokens:
        sizes.append(size)
        size += 256 << max(0, (size // 2048).bit_length() - 1)
    return sizes + [max_tokens] if max_tokens >= 1 else []


class PrefillGraphs(CapturedGraphs):
    """Captured graphs of steps with prefill (prompts, chunks, and the decodes beside them), one per
    token capacity (prefill_graph_sizes), each for up to min(capacity, max_num_seqs) sequences.
    Run eagerly, such a step costs the host a launch per kernel and more, many times the device's
    work for a short prompt (BENCHMARKS.md, "Where the time goes"): every prompt's first token waits for
    it, and so does every running request in a step that takes in a prompt. A step is copied into
    the static buffers with its tokens and sequences padded to the capacity (padding tokens store
    nothing, padding sequences have no new tokens) and replayed. The attention backend must launch
    grids that follow the buffers' sizes (AttentionBackend.supports_prefill_graphs)."""

    def __init__(
        self,
        model,
        backend,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_tokens: int,
        pool=None,
    ):
        self.sizes = prefill_graph_sizes(max_tokens)
        self.max_num_seqs = max_num_seqs
        # decodes beside the prompt attend in the prefill kernel here (num_decodes is 0): where the
        # backend would split long ones over their context, those steps stay eager
        self.max_decode_seq_len = backend.mixed_decode_split_len if isinstance(backend, SplitDecodes) else None
        max_tokens = self.sizes[-1]
        self._allocate_buffers(
            max_tokens, self._seq_rows(max_tokens), max_model_len, block_size, hidden_size, dtype, device
        )
        start = perf_counter()
        self._compile_fill()
        self._fill_padding()  # what the plain run before each capture sees
        self._capture(model, backend, kv_caches, pool)
        log.info(
            "captured CUDA graphs for steps with prefill of up to %s tokens in %.1f s",
            self.sizes,
            perf_counter() - start,
        )

    def _seq_rows(self, tokens: int) -> int:
        return min(tokens, self.max_num_seqs)

    def _inputs(self, tokens: int) -> AttentionInputs:
        seqs = self._seq_rows(tokens)
        return AttentionInputs(
            query_start_loc=self.query_start_loc[: seqs + 1],
            seq_lens=self.seq_lens[:seqs],
            context_lens=self.context_lens[:seqs],
            block_tables=self.block_tables[:seqs],
            slot_mapping=self.slot_mapping[:tokens],
            max_query_len=tokens,
            max_seq_len=self.max_blocks * self.block_size,
            is_decode=False,
            block_size=self.block_size,
            static_shapes=True,
        )

    @torch.inference_mode()
    def _compile_fill(self) -> None:
        """Both variants of the filling kernel (with and without placeholders), before any step."""
        from inferlab.kernels.graph_inputs import fill_step_inputs

        device = self.input_ids.device
        ids = torch.zeros(1, dtype=torch.int64, device=device)
        starts = torch.tensor([0, 1], dtype=torch.int32, device=device)
        lens = torch.ones(1, dtype=torch.int32, device=device)
        table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        for sampled in (None, ids):
            fill_step_inputs(1, 1, ids, ids, ids, starts, lens, lens, table, sampled, self)

    @torch.inference_mode()
    def _fill_padding(self) -> None:
        """Every token and sequence of the buffers as padding."""
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        self.context_lens.zero_()
        self.slot_mapping.fill_(-1)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs: AttentionInputs,
        last_sampled: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Hidden states [T, hidden] of a step with prefill, or None when no graph fits it (too many
        tokens, sequences or blocks, or decodes the backend would split). With last_sampled, input
        ids -(k + 1) stand for last_sampled[k]."""
        num_tokens = input_ids.shape[0]
        tokens = self._size_for(num_tokens)
        if tokens is None:
            return None
        seqs = self._seq_rows(tokens)
        if inputs.num_seqs > seqs or inputs.block_tables.shape[1] > self.max_blocks:
            return None
        if inputs.num_decodes and self.max_decode_seq_len and inputs.max_decode_seq_len >= self.max_decode_seq_len:
            return None
        from inferlab.kernels.graph_inputs import fill_step_inputs

        fill_step_inputs(
            tokens,
            seqs,
            input_ids,
            positions,
            inputs.slot_mapping,
            inputs.query_start_loc,
            inputs.seq_lens,
            inputs.context_lens,
            inputs.block_tables,
            last_sampled,
            self,
        )
        self.graphs[tokens].replay()
        return self.hidden[:num_tokens]
