"""The single-token GEMVs (kernels/gemv.py) of a model's projections over tilings, each against the
weight-read bound: for each projection as many distinct weights as fill 512 MB (so none is read from
L2), one GEMV each, captured in one CUDA graph with PDL and replayed; the time a GEMV and the
bandwidth its weight streams at, next to a device copy's and cuBLAS's.

    python scripts/gemv_bandwidth_gpu.py 8B "default/rows=16/rows=32;slab=16384"

Tilings are separated by '/': 'default' (a slab of whole rows a program, as the model runs all but
the projections gemv.unsplit_rows gives rows), or ';'-separated rows=N and slab=N (gemv.tiling's). Each projection runs with the prologue it has
in the fused layer (qkv and gate_up: add + RMSNorm; down: SiLU*mul) and plain."""

import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from microbench_gpu import back_to_back_us  # noqa: E402

from inferlab.kernels import gemv  # noqa: E402

# hidden, intermediate, attention heads, KV heads, head_dim
SHAPES = {"0.6B": (1024, 3072, 16, 8, 128), "8B": (4096, 12288, 32, 8, 128)}
BYTES = 512 << 20


def graph_us(calls, replays=50):
    """Microseconds per call of calls (a list of callables), captured in one graph, back to back."""
    for call in calls[:4]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return back_to_back_us(graph.replay, replays) / len(calls)


def main(model: str, tilings: list[str]) -> None:
    hidden, inter, heads, kv_heads, head_dim = SHAPES[model]
    projections = {
        "qkv": (((heads + 2 * kv_heads) * head_dim, hidden), "add_norm"),
        "o": ((hidden, heads * head_dim), "plain"),
        "gate_up": ((2 * inter, hidden), "add_norm"),
        "down": ((hidden, inter), "silu_mul"),
    }
    dtype, device = torch.bfloat16, "cuda"
    big = torch.empty(BYTES // 2, dtype=dtype, device=device)
    copy_us = graph_us([lambda: big.clone()] * 4)
    print(f"{model}: device copy of {BYTES >> 20} MB {2 * BYTES / copy_us / 1e3:.0f} GB/s (read + write)")
    for name, ((n, k), fused) in projections.items():
        copies = max(2, BYTES // (n * k * 2))
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        residual = torch.randn(1, k, device=device, dtype=dtype)
        norm_weight = torch.ones(k, device=device, dtype=dtype)
        floor = n * k * 2
        row = torch.randn(1, k, device=device, dtype=dtype)
        cublas = graph_us([functools.partial(torch.nn.functional.linear, row, w) for w in weights])
        line = [f"{name} [{n}, {k}] x{copies}: cuBLAS {cublas:.1f} us ({floor / cublas / 1e3:.0f} GB/s)"]
        for tiling in tilings:
            settings = dict(kv.split("=") for kv in tiling.split(";")) if tiling != "default" else {}
            slab, rows = int(settings.get("slab", gemv.SLAB)), int(settings.get("rows", 0)) or None
            for prologue in ("plain", fused):
                kwargs = dict(slab=slab, rows=rows)
                x = row
                if prologue == "add_norm":  # a norm needs the whole row in each program: unsplit
                    kwargs.update(norm_weight=norm_weight, eps=1e-6, residual=residual)
                elif prologue == "silu_mul":
                    x, kwargs["silu_mul"] = torch.randn(1, 2 * k, device=device, dtype=dtype), True
                split = 1 if prologue == "add_norm" else gemv.splits_for(n, k, slab, rows)
                tile = gemv.tiling(n, k // split, slab, rows) if split else None
                if tile is None:
                    line.append(f"  {tiling} {prologue}: no tiling")
                    continue
                us = graph_us([functools.partial(gemv.gemv, x, w, split=split, **kwargs) for w in weights])
                line.append(
                    f"  {tiling:24s} {prologue:8s} split {split} tile {tile}: {us:.1f} us ({floor / us / 1e3:.0f} GB/s)"
                )
        print("\n".join(line), flush=True)


if __name__ == "__main__":
    for model in sys.argv[1].split(","):
        main(model, sys.argv[2].split("/"))
