"""Compiling Triton kernel variants ahead of the steps that need them, all at once.

Run as it launches, a step compiles each kernel variant it reaches in turn: the kernels of a
layer, then the next, each compile waiting for the one before. Here a dry run of the steps lists
the variants without compiling or launching any Triton kernel (Triton's cache hook skips them;
torch's own kernels still run, on values that do not matter), and each variant starts compiling
on a pool of threads as soon as the dry run reaches it (LLVM and ptxas release the GIL), into
Triton's in-memory and on-disk caches. A real run of the same steps afterwards finds every
variant compiled and loaded (its launcher built, which Triton 3.6 compiles from C); one that
could not be compiled ahead (a Triton whose hook passes other arguments, say) compiles there, as
it would have without this module."""

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from triton import knobs

log = logging.getLogger("inferlab")


def compile_ahead(run: Callable[[], None], threads: int, device: torch.device) -> int:
    """Dry-runs run() and compiles every Triton kernel variant it reaches that is not compiled
    yet, each once, on `threads` threads; returns how many compiled. Not thread-safe: Triton's
    hook is global while the dry run lasts."""
    seen: set = set()
    compiles = []
    pool_thread = threading.local()  # marks the pool's own compiles, which the hook lets through

    def compile_one(function, specialization) -> None:
        pool_thread.compiling = True
        with torch.cuda.device(device):  # Triton compiles for the thread's current device
            kernel = function.preload(specialization)
            # Loading it builds its launcher too, which Triton 3.6 compiles from C (gcc, a
            # fraction of a second each) at a kernel's first launch: here, beside the others.
            load = getattr(kernel, "_init_handles", None)
            if load is not None:
                try:
                    load()
                except Exception:  # its first launch loads it again, and raises if it truly cannot
                    pass

    with ThreadPoolExecutor(threads) as pool:

        def skip_and_compile(**kwargs) -> bool:
            if getattr(pool_thread, "compiling", False):
                return False  # preload asks the hook too: answering "skip" would compile nothing
            try:
                function = kwargs["fn"].jit_function
                key = (id(function), str(kwargs["key"]))
                specialization = kwargs["compile"]["specialization_data"]
            except (KeyError, AttributeError, TypeError):
                return False  # not a call this module understands: Triton compiles and launches it
            if key not in seen:
                seen.add(key)
                compiles.append((function, pool.submit(compile_one, function, specialization)))
            return True  # Triton then neither compiles nor launches this call

        previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = skip_and_compile
        try:
            run()
        finally:
            knobs.runtime.jit_cache_hook = previous
        compiled = 0
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
