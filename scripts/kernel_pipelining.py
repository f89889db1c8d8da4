"""How Triton software-pipelines the attention kernels' K/V loads, read from an sm_90 compile that
needs no GPU: for each configuration, the K buffers in shared memory (1 means every tile waits for
its own loads), the kernel's shared memory, and its async copies.

    python scripts/kernel_pipelining.py [--kernel decode|prefill] [--capability 90]

Compiles with whatever Triton is installed; the GPU machine's may differ (BENCHMARKS.md item 48
used 3.6.0, the device's, unpacked from its wheel onto PYTHONPATH; item 49 measured the read-ahead
candidate it found and removed it)."""

import argparse
import itertools
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from inferlab.plugins.attention import triton_kernels as tk  # noqa: E402

POINTERS = {
    "q_ptr": "*bf16",
    "k_cache_ptr": "*bf16",
    "v_cache_ptr": "*bf16",
    "out_ptr": "*bf16",
    "partial_out_ptr": "*fp32",
    "partial_lse_ptr": "*fp32",
    "seq_lens_ptr": "*i32",
    "block_tables_ptr": "*i32",
    "seq_order_ptr": "*i32",
    "query_start_ptr": "*i32",
}
# Qwen3-0.6B: 16 query heads over 8 KV heads, head_dim 128; the engine's 256-token blocks
SHAPE = {"GROUP": 2, "BLOCK_SIZE": 256, "HEAD_DIM": 128, "PRECISION": "tf32", "PDL": False}


def compile_kernel(fn, constexprs: dict, warps: int, stages: int, capability: int):
    names = fn.arg_names
    signature = {
        n: POINTERS.get(n, "constexpr" if n in constexprs else "fp32" if n == "scale_log2" else "i32") for n in names
    }
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in POINTERS or "stride" in n}
    source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=aligned)
    return triton.compile(
        source, target=GPUTarget("cuda", capability, 32), options={"num_warps": warps, "num_stages": stages}
    )


def k_buffers(ttgir: str) -> int:
    """How many K tiles the kernel's shared memory holds: the leading dimension of its K buffer."""
    sizes = re.findall(r"%k_\d+ = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", ttgir)
    return int(sizes[0]) if sizes else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--capability", type=int, default=90)
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_{args.capability}, {args.kernel}")
    if args.kernel == "decode":
        fn = tk._decode_split_kernel
        space = itertools.product((64, 128), (4, 8), (2, 3, 4))
        fixed = {"BLOCK_H": tk.MIN_DOT_ROWS, "SINGLE_SPLIT": True, "ORDERED": True}
    else:
        fn = tk._prefill_kernel
        space = itertools.product((32, 64), (4,), (2, 3))
        fixed = {"HEADS": 2, "BLOCK_M": 64}
    for block_n, warps, stages in space:
        constexprs = {**SHAPE, **fixed, "BLOCK_N": block_n}
        kernel = compile_kernel(fn, constexprs, warps, stages, args.capability)
        ptx = kernel.asm["ptx"]
        print(
            f"  block_n {block_n:>3} warps {warps} stages {stages}: K buffers {k_buffers(kernel.asm['ttgir'])}, "
            f"shared {kernel.metadata.shared / 1024:5.1f} KiB, cp.async {len(re.findall(r'cp[.]async[.]c[ag]', ptx))}, "
            f"wgmma {ptx.count('wgmma.mma_async')}",
            flush=True,
        )


if __name__ == "__main__":
    main()
