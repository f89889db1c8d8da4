"""How fast could the batch-1 decode graph be if its reads hit the L2 cache? A probe, not the model.

One sequence decodes 1,024 tokens after a 256-token prompt (as scripts/one_sequence_gpu.py), which
leaves the batch-1 graph's static inputs at that step. Then the batch-1 decode graph is captured
again in variants and each is replayed back to back:
- as the model runs (the control, first and last);
- "one layer's weights": every layer's parameters are layer 0's, so after the first layer (31.5 MB
  with Qwen3-0.6B shapes, of an L2 of 50 MB) they come from L2; "one layer's KV" likewise gives
  every layer layer 0's cache; both together bound what the kernels cost when nothing waits on DRAM;
- "prefetch": the weights and the sequence's KV blocks are pulled into L2 on a second stream
  (`prefetch.global.L2`, 128-byte lines, or `cp.async.bulk.prefetch.L2` a chunk a
  thread), each piece forked off as the kernel DEPTH pieces before its reader starts, so that DRAM
  streams the next projection's weights while the kernel chain runs on what L2 holds.
It also prints the rate the prefetch kernels alone pull all the layers' weights at, and what a
kernel boundary costs: a graph of as many empty kernels (PDL as the model's) as the decode graph
has (six a layer).

    python3 scripts/l2_probe_gpu.py MODEL_DIR
"""

import functools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from microbench_gpu import back_to_back_us  # noqa: E402

from inferlab import LLM, SamplingParams  # noqa: E402
from inferlab.core.cuda_graphs import DecodeGraphs  # noqa: E402
from inferlab.kernels import pdl  # noqa: E402

LINE = 128  # bytes a prefetch.global.L2 brings


@triton.jit
def _prefetch_lines(base_ptr, nbytes, sink_ptr, LINES: tl.constexpr):
    """Each thread asks L2 for lines of [base, base + nbytes), LINES a program."""
    offs = (tl.program_id(0).to(tl.int64) * LINES + tl.arange(0, LINES)) * 128
    offs = tl.minimum(offs, nbytes - 1)
    got = tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [base_ptr + offs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    tl.store(sink_ptr + tl.arange(0, LINES), got, mask=got != 0)  # never: keeps the asm


@triton.jit
def _prefetch_bulk(base_ptr, nbytes, sink_ptr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Each thread asks the copy engine to bring one CHUNK-byte piece into L2."""
    starts = (tl.program_id(0).to(tl.int64) * CHUNKS + tl.arange(0, CHUNKS)) * CHUNK
    size = tl.minimum(nbytes - starts, CHUNK).to(tl.int32)
    live = size > 0
    got = tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,r",
        [base_ptr + tl.where(live, starts, 0), tl.where(live, size, 0)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    tl.store(sink_ptr + tl.arange(0, CHUNKS), got, mask=got != 0)


@triton.jit
def _empty(sink_ptr, PDL: tl.constexpr):
    """A kernel boundary and nothing else: waits for its predecessor, stores one value a program."""
    pdl.wait_for_inputs(PDL)
    tl.store(sink_ptr + tl.program_id(0), 1)


def empty_chain_us(kernels: int, programs: int, device) -> float:
    """Microseconds a kernel for a graph of `kernels` empty kernels of `programs` programs, PDL as the model's."""
    sink = torch.zeros(programs, dtype=torch.int32, device=device)
    launch = functools.partial(_empty[(programs,)], sink, num_warps=4, **pdl.launch_options(device))
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            launch()
    return back_to_back_us(graph.replay, 100, warmup=5) / kernels


class Prefetcher:
    """Launches the prefetch of byte ranges (tensor, offset, length) on the current stream."""

    def __init__(self, mode: str, device):
        self.mode = mode
        self.sink = torch.zeros(4096, dtype=torch.int32, device=device)

    def __call__(self, ranges) -> None:
        for tensor, offset, length in ranges:
            base = tensor.view(torch.uint8).view(-1)[offset : offset + length]
            if self.mode == "line":
                lines = 1024
                grid = -(-length // (LINE * lines))
                _prefetch_lines[(grid,)](base, length, self.sink, LINES=lines, num_warps=4)
            else:
                chunk, chunks = 16384, 32
                grid = -(-length // (chunk * chunks))
                _prefetch_bulk[(grid,)](base, length, self.sink, CHUNK=chunk, CHUNKS=chunks, num_warps=1)


def whole(tensor):
    return (tensor, 0, tensor.numel() * tensor.element_size())


@torch.inference_mode()
def main(model_dir: str) -> None:
    llm = LLM(model_dir, attention="triton", max_model_len=4096)
    runner = llm.runner
    model = runner.model
    one = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1024)
    llm.generate([[(13 * i) % 10000 for i in range(256)]], one, use_tqdm=False)
    ran = runner.decode_graphs
    seq_len = int(ran.seq_lens[0])
    settings = list(runner._graph_settings())
    settings[3] = 1  # max_num_seqs: the batch-1 graph alone
    kv_caches = runner.kv_caches
    blocks = ran.block_tables[0, : -(-seq_len // ran.block_size)].tolist()
    layers = model.layers
    block_bytes = kv_caches[0][0, 0].numel() * kv_caches[0].element_size()

    def kv_ranges(layer):
        cache = kv_caches[layer]
        return [(cache, (half * cache.shape[1] + b) * block_bytes, block_bytes) for half in (0, 1) for b in blocks]

    def weights(layer, *names):
        return [whole(layer_module.get_parameter(n)) for layer_module in [layers[layer]] for n in names]

    # what each of a layer's five readers (the qkv GEMV, attention, o, gate_up, down GEMVs) reads
    pieces = []
    for i in range(len(layers)):
        pieces += [
            weights(i, "self_attn.qkv_proj.weight"),
            kv_ranges(i),
            weights(i, "self_attn.o_proj.weight"),
            weights(i, "mlp.gate_up_proj.weight"),
            weights(i, "mlp.down_proj.weight"),
        ]
    weight_bytes = sum(n for piece in pieces[::5] + pieces[2::5] + pieces[3::5] + pieces[4::5] for _, _, n in piece)
    kv_bytes = sum(n for piece in pieces[1::5] for _, _, n in piece)
    print(
        f"{len(layers)} layers at {seq_len} keys: weights {weight_bytes / 1e6:.0f} MB, the sequence's KV "
        f"{kv_bytes / 1e6:.0f} MB ({(weight_bytes + kv_bytes) / len(layers) / 1e6:.1f} MB a layer)",
        flush=True,
    )

    def capture(caches=None):
        settings[2] = caches or kv_caches
        graphs = DecodeGraphs(*settings)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "context_lens"):
            getattr(graphs, name)[:1].copy_(getattr(ran, name)[:1])
        graphs.block_tables[:1].copy_(ran.block_tables[:1, : graphs.block_tables.shape[1]])
        return graphs

    outputs = {}

    def time_us(graphs):
        graphs.graphs[1].replay()
        outputs[len(outputs)] = graphs.hidden[:1].clone()
        us = back_to_back_us(graphs.graphs[1].replay, 500, warmup=20)
        graphs.release()
        return us

    results = {}
    engine_us = back_to_back_us(ran.graphs[1].replay, 500, warmup=20)
    print(f"the engine's own batch-1 graph: {engine_us:.1f} us", flush=True)
    results["as run"] = time_us(capture())

    originals = [{n: p.data for n, p in layer.named_parameters()} for layer in layers]

    def share_weights(on: bool):
        with torch.no_grad():
            for layer, own in zip(layers, originals):
                for n, p in layer.named_parameters():
                    p.data = originals[0][n] if on else own[n]

    share_weights(True)
    results["one layer's weights"] = time_us(capture())
    results["one layer's weights and KV"] = time_us(capture([kv_caches[0]] * len(kv_caches)))
    share_weights(False)
    results["one layer's KV"] = time_us(capture([kv_caches[0]] * len(kv_caches)))

    # prefetch: wrap each layer's GEMV and attention calls to fork the piece DEPTH readers on
    side = torch.cuda.Stream()
    state = {"reader": 0}
    plans = [layer.gemv for layer in layers]
    attends = [layer.self_attn.attend for layer in layers]
    forward = model.forward

    def install(prefetch, depth):
        def fork():
            ahead = state["reader"] + depth
            state["reader"] += 1
            if ahead < len(pieces):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    prefetch(pieces[ahead])

        def gemv(*a, **k):
            fork()
            return plans[0].gemv(*a, **k)

        def attend_of(inner):
            def attend(*a, **k):
                fork()
                return inner(*a, **k)

            return attend

        def model_forward(*a, **k):
            state["reader"] = 0
            side.wait_stream(torch.cuda.current_stream())  # joins the capture before it launches
            with torch.cuda.stream(side):
                for piece in pieces[:depth]:  # those no reader before them forks
                    prefetch(piece)
            out = forward(*a, **k)
            torch.cuda.current_stream().wait_stream(side)
            return out

        for layer, plan, inner in zip(layers, plans, attends):
            layer.gemv = plan._replace(gemv=gemv)
            layer.self_attn.attend = attend_of(inner)
        model.forward = model_forward

    def uninstall():
        for layer, plan, inner in zip(layers, plans, attends):
            layer.gemv = plan
            layer.self_attn.attend = inner
        model.forward = forward

    for mode in ("line", "bulk"):
        prefetch = Prefetcher(mode, runner.device)
        every_weight = [r for i, piece in enumerate(pieces) if i % 5 != 1 for r in piece]
        graph = torch.cuda.CUDAGraph()
        prefetch(every_weight)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            prefetch(every_weight)
        us = back_to_back_us(graph.replay, 20, warmup=3)
        print(f"prefetch {mode} alone: all weights in {us:.0f} us, {weight_bytes / us / 1e3:.0f} GB/s", flush=True)
        del graph
        for depth in (1, 2):
            install(prefetch, depth)
            try:
                results[f"prefetch {mode}, depth {depth}"] = time_us(capture())
            finally:
                uninstall()

    results["as run, again"] = time_us(capture())
    same = [label for k, label in enumerate(results) if torch.equal(outputs[k], outputs[0])]
    print(f"outputs equal to the control's: {', '.join(same)}", flush=True)
    n = len(layers)
    for programs in (1, 132, 512):
        us = empty_chain_us(6 * n, programs, runner.device)
        print(f"a chain of {6 * n} empty kernels of {programs} programs: {us:.2f} us a kernel", flush=True)
    for label, us in results.items():
        print(f"{label:32s} {us:7.1f} us a graph, {us / n:5.2f} us a layer", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
