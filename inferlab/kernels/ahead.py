"""Compiling Triton kernel variants ahead of the steps that need them, all at once.

Run as it launches, a step compiles each kernel variant it reaches in turn: the kernels of a
layer, then the next, each compile waiting for the one before. Here a dry run of the steps lists
the variants without compiling or launching any Triton kernel (Triton's cache hook skips them;
torch's own kernels still run, on values that do not matter), and each variant starts compiling
on a pool of threads as soon as the dry run reaches it (LLVM and ptxas release the GIL), into
Triton's in-memory and on-disk caches. A real run of the same steps afterwards finds every
variant compiled."""

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from triton import knobs


def compile_ahead(run: Callable[[], None], threads: int, device: torch.device) -> int:
    """Dry-runs run() (no Triton kernel launches) and compiles every Triton kernel variant it
    reaches that is not compiled yet, each once, on `threads` threads; returns how many. Not
    thread-safe: Triton's hook is global while the dry run lasts."""
    seen: set = set()
    compiles = []

    def compile_one(function, specialization) -> None:
        with torch.cuda.device(device):  # Triton compiles for the thread's current device
            function.preload(specialization)

    with ThreadPoolExecutor(threads) as pool:

        def skip_and_compile(**kwargs) -> bool:
            function = kwargs["fn"].jit_function
            key = (id(function), str(kwargs["key"]))
            if key not in seen:
                seen.add(key)
                compiles.append(pool.submit(compile_one, function, kwargs["compile"]["specialization_data"]))
            return True  # Triton then neither compiles nor launches this call

        previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = skip_and_compile
        try:
            run()
        finally:
            knobs.runtime.jit_cache_hook = previous
        for compiling in compiles:
            compiling.result()
    return len(compiles)
