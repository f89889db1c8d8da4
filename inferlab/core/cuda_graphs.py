"""CUDA graphs for decode steps, as nano-vllm captures them: one graph per batch size in a ladder
(1, 2, 4, 8, 16, 32, ... up to the largest decode batch), all reading static input buffers. A
decode batch is copied into the buffers, padded to the next captured size (padding rows store
nothing and attend to nothing) and replayed, which removes the per-kernel launch cost that
dominates small decode steps. The copy-in, the padding and the swap of placeholder ids for the
previous step's samples are one kernel (inferlab.kernels.graph_inputs)."""

import bisect
import logging
from time import perf_counter

import torch

from inferlab.core.batch import AttentionInputs

log = logging.getLogger("inferlab")

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
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
        self.batch_sizes = graph_batch_sizes(min(max_num_seqs, MAX_GRAPH_BATCH))
        max_batch = self.batch_sizes[-1]
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        with torch.inference_mode():
            self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
            self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
            self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
            self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
            self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros(max_batch, self.max_blocks, dtype=torch.int32, device=device)
            self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
            self.hidden = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        start = perf_counter()
        self._compile_fill()
        self._capture(model, backend, kv_caches)
        log.info(
            "captured CUDA graphs for decode batches of %s sequences in %.1f s",
            self.batch_sizes,
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

    @torch.inference_mode()
    def _capture(self, model, backend, kv_caches):
        pool = None
        for batch in reversed(self.batch_sizes):  # largest first, so the smaller ones fit in its pool
            inputs = self._inputs(batch)
            args = (self.input_ids[:batch], self.positions[:batch], kv_caches)
            # a plain run first: compiles Triton kernels and settles allocations outside the capture
            self.hidden[:batch] = model(*args, backend.build_metadata(inputs))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.hidden[:batch] = model(*args, backend.build_metadata(inputs))
            if pool is None:
                pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def release(self) -> None:
        """Destroys the graphs now, whoever still refers to this object. NCCL counts every graph
        that captured one of its collectives and will not finish tearing down (or aborting) the
        communicator until each is destroyed: tensor-parallel rank 0 releases its graphs first."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.batch_sizes = [0]  # run() finds no graph for any batch: it returns None, the eager path

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
        width = inputs.block_tables.shape[1]
        if num_seqs > self.batch_sizes[-1] or width > self.max_blocks:
            return None
        batch = self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]
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
