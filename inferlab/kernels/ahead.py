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
it would have without this module.

The dry run costs a second or more of Python (each launch on Triton's slow path). Its list is kept
beside Triton's own cache, under a name hashed from everything that picks the variants (the steps,
the model, the dtypes, the device, the versions and the source of the code that launches them), so
a later process with a warm cache compiles, or loads, the same list without it. A listed kernel
whose source changed since makes the list stale: the dry run runs again and rewrites it."""

import hashlib
import importlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

log = logging.getLogger("inferlab")


def compile_ahead(
    run: Callable[[], None],
    threads: int,
    device: torch.device,
    listing: str | None = None,
    on_every_rank: Callable[[bool], bool] = bool,
) -> int:
    """Dry-runs run(), then compiles and loads every Triton kernel variant it reached, each once,
    on `threads` threads; returns how many compiled. `listing`: a file (variants_file) that holds
    the variants of an earlier dry run of the same steps, read instead of dry-running when it is
    current, written after a dry run otherwise. `on_every_rank(read)`: whether every
    tensor-parallel rank read its list, for their dry runs hold collectives: all run one or none.
    Not thread-safe: Triton's hook is global while the dry run lasts."""
    found = read_variants(listing) if listing else None
    if not on_every_rank(found is not None):
        found = None
    if found is None:
        found = list_variants(run)
        if listing:
            write_variants(listing, found)
    else:
        log.info("read the %d kernel variants of these steps from %s", len(found), listing)

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


def list_variants(run: Callable[[], None]) -> dict:
    """The Triton kernel variants run() reaches, none compiled or launched: (kernel, key) ->
    (kernel, specialization data), in the order reached."""
    found: dict = {}

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
    return found


def variants_file(description: dict, sources: Iterable[str]) -> str:
    """The listing file of the steps `description` sets out (JSON-able, str() for the rest), whose
    variants the code in the `sources` files picks, in Triton's cache directory."""
    digest = hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode())
    for path in sorted(set(sources)):
        with open(path, "rb") as f:
            digest.update(f.read())
    return os.path.join(knobs.cache.dir, "inferlab-variants", f"{digest.hexdigest()[:32]}.json")


def _name(function: JITFunction) -> str:
    return f"{function.fn.__module__}:{function.fn.__qualname__}"


def _kernel(name: str) -> JITFunction | None:
    """The kernel a _name names, through the wrappers (autotuners, heuristics) around it; None
    when it is gone."""
    module, _, qualname = name.partition(":")
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # gone, renamed, or failing to import now: the list is stale, not start-up broken
        return None
    while not isinstance(found, JITFunction) and hasattr(found, "fn"):
        found = found.fn
    return found if isinstance(found, JITFunction) else None


def write_variants(path: str, found: dict) -> None:
    """Writes a list_variants result; an unwritable cache only costs the next start its dry run."""
    try:
        entries = [
            {"kernel": _name(function), "source": function.cache_key, "specialization": specialization}
            for function, specialization in found.values()
        ]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}"
        with open(partial, "w", encoding="utf-8") as f:
            json.dump(entries, f)
        os.replace(partial, path)  # whole or absent, for a process that reads it meanwhile
    except (OSError, TypeError, AttributeError) as e:
        log.info("could not keep the kernel variants' list in %s (%s)", path, e)


def read_variants(path: str) -> dict | None:
    """The variants a write_variants file lists, as list_variants gives them; None when there is
    no such file, it is unreadable, or a kernel it lists is gone or its source changed."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
        found = {}
        for entry in entries:
            function = _kernel(entry["kernel"])
            if function is None or function.cache_key != entry["source"]:
                return None
            found[(id(function), entry["specialization"])] = (function, entry["specialization"])
        return found
    except Exception:  # a damaged or foreign file costs the dry run, never the start-up
        return None
