"""Compiling Triton kernel variants ahead of the steps that need them, all at once.

Run as it launches, a step compiles each kernel variant it reaches in turn: the kernels of a
layer, then the next, each compile waiting for the one before. Here a dry run of the steps lists
the variants without compiling or launching any Triton kernel (Triton's cache hook skips them;
torch's own kernels still run, on values that do not matter), then every variant compiles at once
on a pool of threads (LLVM, ptxas and gcc release the GIL) into Triton's in-memory and on-disk
caches, and is loaded there (its launcher built, which Triton 3.6 compiles from C). The compiles
wait for the dry run to end: a variant compiled during it would launch for real on the dry run's
meaningless values. A real run of the same steps afterwards finds every variant ready; one that
could not be compiled ahead (a Triton whose hook passes other arguments, say) compiles there, as
it would have without this module."""

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from triton import knobs

log = logging.getLogger("inferlab")


def compile_ahead(run: Callable[[], None], threads: int, device: torch.device) -> int:
    """Dry-runs run(), then compiles and loads every Triton kernel variant it reached, each once,
    on `threads` threads; returns how many compiled. Not thread-safe: Triton's hook is global
    while the dry run lasts."""
    found: dict = {}  # (kernel, key) -> (kernel, specialization data), in the order reached

    def skip_and_list(**kwargs) -> bool:
        try:
            function = kwargs["fn"].jit_function
            key = (id(function), str(kwargs["key"]))
            specialization = kwargs["compile"]["specialization_data"]
        except (KeyError, AttributeError, TypeError):
            return False  # not a call this module understands: Triton compiles and launches it
        found.setdefault(key, (function, specialization))
        return True  # Triton then neither compiles nor launches this call

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = skip_and_list
    try:
        run()
    finally:
        knobs.runtime.jit_cache_hook = previous

    def compile_one(function, specialization) -> None:
        with torch.cuda.device(device):  # Triton compiles for the thread's current device
            kernel = function.preload(specialization)
            load = getattr(kernel, "_init_handles", None)
            if load is not None:
                try:
                    load()
                except Exception:  # its first launch loads it again, and raises if it truly cannot
                    pass

    compiled = 0
    with ThreadPoolExecutor(threads) as pool:
        compiles = [(function, pool.submit(compile_one, function, spec)) for function, spec in found.values()]
        for function, compiling in compiles:
            try:
                compiling.result()
                compiled += 1
            except Exception as e:  # the real run compiles it, and raises if it truly cannot
                log.warning(
                    "could not compile %s ahead (%s: %s); it compiles at its first launch",
                    function,
                    type(e).__name__,
                    e,
                )
    return compiled
