"""Triton kernel variants that CPU tests reach, compiled for a GPU without one.

On CPU the kernels run only in Triton's interpreter, which never type-checks a kernel as its
compiler does (a loop that changes a variable's shape, say, runs there and fails to compile).
Loaded as a pytest plugin (`-p kernel_variants`) in an interpreted run, this module records every
launch of an inferlab kernel into the pickle INFERLAB_KERNEL_LAUNCHES names (start_recording and
save do the same outside pytest), of the run's tests or of one shard of them (INFERLAB_KERNEL_SHARD); run as a script (`python kernel_variants.py LAUNCHES...`,
without TRITON_INTERPRET), it compiles each distinct variant among them for sm_90, with PDL as
launches there have it, prints a line a kernel and one a failure, and exits 1 on any failure.
The compiler is the installed Triton's, which may differ from a GPU machine's."""

import os
import pickle
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch


class TensorArg:
    """A launch's tensor argument: what the compiler specializes on (dtype, and whether its
    address is 16-byte aligned), not its values."""

    def __init__(self, tensor: torch.Tensor):
        self.dtype = tensor.dtype
        self.misalignment = tensor.data_ptr() % 16

    def rebuild(self) -> torch.Tensor:
        size = torch.empty((), dtype=self.dtype).element_size()
        base = torch.empty(64 // size + 16, dtype=self.dtype)  # CPU allocations are 64-byte aligned
        return base[self.misalignment // size :]


def describe(value):
    if isinstance(value, torch.Tensor):
        return TensorArg(value)
    return value


def rebuilt(value):
    # by name: unpickled in a script, the class is kernel_variants.TensorArg, not __main__'s
    return value.rebuild() if type(value).__name__ == "TensorArg" else value


_launches = []


def start_recording() -> None:
    """Records each launch of an inferlab kernel from here on (Triton must run interpreted)."""
    import triton  # noqa: F401  (imported here, after whoever set TRITON_INTERPRET)
    from triton.runtime.interpreter import InterpretedFunction

    interpreted_run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.startswith("inferlab."):
            described = {k: describe(v) for k, v in kwargs.items()}
            _launches.append((self.fn.__module__, self.fn.__name__, [describe(a) for a in args], described))
        return interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


def save(path: str) -> None:
    with open(path, "wb") as f:
        pickle.dump(_launches, f)


def pytest_configure(config):
    start_recording()


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config, items):
    """With INFERLAB_KERNEL_SHARD=i/n, runs only every n-th test from the i-th: n processes, one a
    core, then record all the launches between them in the time of one n-th."""
    shard = os.environ.get("INFERLAB_KERNEL_SHARD")
    if shard:
        index, count = map(int, shard.split("/"))
        kept = items[index::count]
        config.hook.pytest_deselected(items=[item for item in items if item not in set(kept)])
        items[:] = kept


def pytest_unconfigure(config):
    save(os.environ["INFERLAB_KERNEL_LAUNCHES"])


def compile_variants(launches, threads: int = 2) -> tuple[dict, list[str]]:
    """Compiles each distinct variant among launches for sm_90; returns the count compiled by
    kernel and a line for each failure."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    variants, binders = {}, {}
    for module, name, args, kwargs in launches:
        kernel = getattr(importlib.import_module(module), name)
        args = [rebuilt(a) for a in args]
        kwargs = {k: rebuilt(v) for k, v in kwargs.items()}
        if "PDL" in kwargs:  # the interpreter launches without PDL, a Hopper GPU with it
            kwargs.update(PDL=True, launch_pdl=True)
        if kernel not in binders:  # one per kernel, as Triton builds it once a device
            binders[kernel] = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binders[kernel](*args, **kwargs)
        key = (module, name, compute_cache_key({}, specialization, options))
        if key not in variants:
            variants[key] = (kernel, *kernel._pack_args(backend, kwargs, bound, specialization, options))

    def compile_one(item):
        kernel, options, signature, constexprs, attrs = item
        compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)

    compiled, failures = {}, []
    with ThreadPoolExecutor(threads) as pool:
        for (module, name, _), item, done in [(k, v, pool.submit(compile_one, v)) for k, v in variants.items()]:
            try:
                done.result()
                compiled[f"{module}.{name}"] = compiled.get(f"{module}.{name}", 0) + 1
            except Exception as e:
                constexprs = {item[0].arg_names[path[0]]: v for path, v in item[3].items()}
                failures.append(f"{module}.{name} {constexprs}: {type(e).__name__}: {str(e)[-2000:]}")
    return compiled, failures


def launched_kernels() -> set[str]:
    """Every kernel inferlab launches: the JIT functions named *_kernel of its modules that hold one."""
    import importlib
    import pathlib

    from triton.runtime.jit import JITFunction

    import inferlab

    root = pathlib.Path(inferlab.__file__).parent
    names = set()
    for path in sorted(root.rglob("*.py")):
        if "@triton.jit" in path.read_text():
            module = ".".join(("inferlab", *path.relative_to(root).with_suffix("").parts))
            for name, value in vars(importlib.import_module(module)).items():
                if isinstance(value, JITFunction) and name.endswith("_kernel"):
                    names.add(f"{module}.{name}")
    return names


# The exit status when this Triton lacks the internals compile_variants builds a launch's
# signature with (they are Triton's own, not its API): the test then skips, saying so.
NO_INTERNALS = 3

if __name__ == "__main__":
    try:
        from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature  # noqa: F401

        assert hasattr(JITFunction, "_pack_args")
    except (ImportError, AssertionError):
        import triton

        print(f"Triton {triton.__version__} lacks the runtime.jit internals this script was written against (3.9)")
        sys.exit(NO_INTERNALS)
    launches = []
    for path in sys.argv[1:]:
        with open(path, "rb") as f:
            launches += pickle.load(f)
    compiled, failures = compile_variants(launches)
    for kernel, count in sorted(compiled.items()):
        print(f"compiled {count} variants of {kernel}")
    for kernel in sorted(launched_kernels() - set(compiled)):
        print(f"never compiled: {kernel}")
    for failure in failures:
        print("FAILED", failure)
    sys.exit(1 if failures else 0)
