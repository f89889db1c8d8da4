"""Programmatic dependent launch (PDL) for our Triton kernels, on Hopper and newer GPUs.

A decode step runs about ten kernels a layer, most of them a few microseconds long, so the launch
and ramp-up between two kernels is a visible share of the step. With PDL a kernel may be launched
while its predecessor in the stream still runs: its programs become resident as the predecessor's
last programs drain, and wait (griddepcontrol.wait) until the predecessor has finished and its
writes are visible. Each kernel that launches this way calls wait_for_inputs before its first
load or store, so results are exactly those of plain launches, and (since every such kernel waits
for its predecessor to finish before it finishes) a kernel also sees everything written earlier in
the stream. The kernel then lets its own successor launch.

Measured on an H200 (scripts/microbench_launch.py): 280 RMSNorm kernels in a row take 1.63 µs a
kernel with PDL against 1.94 µs without at 256 tokens; the bench's steady runs are 0.6% faster
(BENCHMARKS.md, session 4).

On by default where it works: CUDA, compute capability 9.0 or more, compiled (not interpreted)
Triton. INFERLAB_PDL=0 turns it off, for ablations."""
import functools
import os

import torch
import triton
import triton.language as tl


# Whether Triton runs our kernels in its interpreter (TRITON_INTERPRET=1, the only way they run on
# CPU). Triton decides that when a kernel is decorated, so this is read once, at import, as Triton
# reads it; the kernel modules import it from here.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _enabled(device_index: int) -> bool:
    if os.environ.get("INFERLAB_PDL", "1") == "0" or INTERPRETED:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL."""
    if device.type != "cuda":
        return False
    return _enabled(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """The launch keywords for a kernel that takes a PDL constexpr and calls wait_for_inputs(PDL)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel in the stream has finished (its writes visible),
    then let the next kernel launch. Call before the kernel's first load or store."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# cuBLAS's Hopper GEMM kernels wait on griddepcontrol before their first load and let their
# successors launch (the xmma kernels' SASS has ACQBULK and PREEXIT; tests/test_gpu.py checks the
# kernels the model runs, nvjet among them, against a predecessor that writes late), but cuBLAS
# launches them plainly, so a captured graph joins them to their predecessor with a full edge.
LIBRARY_KERNEL_PREFIXES = ("nvjet_sm90", "sm90_xmma_gemm")


class _GraphDriver:
    """The CUDA driver's graph-editing calls (12.3+, with edge data), through ctypes."""

    def __init__(self):
        import ctypes
        self.ctypes = ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        get = lib.cuGetProcAddress_v2
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                        ctypes.POINTER(ctypes.c_int)]
        ptr, node_p = ctypes.POINTER, ctypes.c_void_p

        class EdgeData(ctypes.Structure):
            _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                        ("reserved", ctypes.c_ubyte * 5)]

        class KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
            _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                        ("shared_bytes", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                        ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]
        self.EdgeData, self.KernelNodeParams = EdgeData, KernelNodeParams

        def proc(name, *argtypes):
            fn, status = ctypes.c_void_p(), ctypes.c_int()
            result = get(name.encode(), ctypes.byref(fn), 12030, 0, ctypes.byref(status))
            if result != 0 or not fn.value:
                raise RuntimeError(f"the CUDA driver has no {name} (error {result}); programmatic graph edges "
                                   "need a driver for CUDA 12.3 or newer; INFERLAB_PDL_LIBRARY=0 turns them off")
            return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(fn.value)
        self.get_edges = proc("cuGraphGetEdges", node_p, ptr(node_p), ptr(node_p), ptr(EdgeData),
                              ptr(ctypes.c_size_t))
        self.node_type = proc("cuGraphNodeGetType", node_p, ptr(ctypes.c_int))
        self.kernel_params = proc("cuGraphKernelNodeGetParams", node_p, ptr(KernelNodeParams))
        self.func_name = proc("cuFuncGetName", ptr(ctypes.c_char_p), node_p)
        self.kernel_name = proc("cuKernelGetName", ptr(ctypes.c_char_p), node_p)  # library-loaded kernels
        self.remove = proc("cuGraphRemoveDependencies", node_p, ptr(node_p), ptr(node_p), ptr(EdgeData),
                           ctypes.c_size_t)
        self.add = proc("cuGraphAddDependencies", node_p, ptr(node_p), ptr(node_p), ptr(EdgeData), ctypes.c_size_t)

    @staticmethod
    def _check(result: int, what: str):
        if result != 0:
            raise RuntimeError(f"{what} failed with CUDA driver error {result}")

    def edges(self, graph: int):
        """(from nodes, to nodes, edge data) of every edge of graph."""
        c = self.ctypes
        count = c.c_size_t(0)
        self._check(self.get_edges(graph, None, None, None, c.byref(count)), "cuGraphGetEdges")
        froms, tos = (c.c_void_p * count.value)(), (c.c_void_p * count.value)()
        data = (self.EdgeData * count.value)()
        self._check(self.get_edges(graph, froms, tos, data, c.byref(count)), "cuGraphGetEdges")
        return froms, tos, data

    def kernel_name_of(self, node: int) -> str | None:
        """The kernel's name, or None when node is not a kernel node."""
        c = self.ctypes
        kind = c.c_int()
        self._check(self.node_type(node, c.byref(kind)), "cuGraphNodeGetType")
        if kind.value != 0:  # CU_GRAPH_NODE_TYPE_KERNEL
            return None
        params = self.KernelNodeParams()
        self._check(self.kernel_params(node, c.byref(params)), "cuGraphKernelNodeGetParams")
        name = c.c_char_p()
        if params.func:
            self._check(self.func_name(c.byref(name), params.func), "cuFuncGetName")
        else:
            self._check(self.kernel_name(c.byref(name), params.kern), "cuKernelGetName")
        return name.value.decode()

    def make_programmatic(self, graph: int, pairs: list[tuple[int, int]]):
        """Replaces each plain edge (a, b) of graph by a programmatic one: b may launch once every
        block of a has let it (griddepcontrol.launch_dependents) or exited; b's wait does the rest."""
        c = self.ctypes
        n = len(pairs)
        froms = (c.c_void_p * n)(*(a for a, _ in pairs))
        tos = (c.c_void_p * n)(*(b for _, b in pairs))
        self._check(self.remove(graph, froms, tos, None, n), "cuGraphRemoveDependencies")
        data = (self.EdgeData * n)()
        for d in data:
            d.from_port, d.type = 1, 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        result = self.add(graph, froms, tos, data, n)
        if result != 0:  # put the plain edges back, so the graph stays whole
            self._check(self.add(graph, froms, tos, None, n), "cuGraphAddDependencies")
            self._check(result, "cuGraphAddDependencies (programmatic)")


@functools.lru_cache(maxsize=None)
def _graph_driver() -> _GraphDriver:
    return _GraphDriver()


def links_library_kernels(device: torch.device) -> bool:
    """Whether captured graphs on this device join cuBLAS's kernels by programmatic edges: where our
    kernels launch with PDL, unless INFERLAB_PDL_LIBRARY=0 (for ablations)."""
    return enabled(device) and os.environ.get("INFERLAB_PDL_LIBRARY", "1") != "0"


def link_library_kernels(graph: torch.cuda.CUDAGraph, prefixes: tuple[str, ...] = LIBRARY_KERNEL_PREFIXES) -> list[str]:
    """Makes the plain edges from a kernel into a kernel named with one of prefixes (cuBLAS's Hopper
    GEMMs) programmatic, as stream capture makes our own PDL launches. The graph must be captured
    with keep_graph=True and not yet instantiated. Returns the names of the kernels so linked."""
    driver = _graph_driver()
    raw = graph.raw_cuda_graph()
    froms, tos, data = driver.edges(raw)
    names: dict[int, str | None] = {}

    def name(node):
        if node not in names:
            names[node] = driver.kernel_name_of(node)
        return names[node]
    pairs = [(a, b) for a, b, d in zip(froms, tos, data)
             if d.type == 0 and (name(b) or "").startswith(prefixes) and name(a) is not None]
    if pairs:
        driver.make_programmatic(raw, pairs)
    return [name(b) for _, b in pairs]
