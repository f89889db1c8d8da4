"""Programmatic dependent launch (PDL) for our Triton kernels, on Hopper and newer GPUs.

A decode step runs about ten kernels a layer, most of them a few microseconds long, so the launch
and ramp-up between two kernels is a visible share of the step. With PDL a kernel may be launched
while its predecessor in the stream still runs: its programs become resident as the predecessor's
last programs drain, and wait (griddepcontrol.wait) until the predecessor has finished and its
writes are visible. Each kernel that launches this way calls wait_for_inputs before its first
load or store, so results are exactly those of plain launches, and (since every such kernel waits
for its predecessor to finish before it finishes) a kernel also sees everything written earlier in
the stream. The kernel then lets its own successor launch. That shortens each kernel boundary, and with it the
bench (BENCHMARKS.md, "Why the defaults are what they are").

On by default where it works: CUDA, compute capability 9.0 or more, compiled (not interpreted)
Triton. INFERLAB_PDL=0 turns it off, for ablations.

Triton fixes at import whether our kernels run compiled or interpreted; INTERPRETED and
kernel_mode_problems say which, for every kernel module."""

import functools
import os

import torch
import triton
import triton.language as tl

# Whether Triton runs our kernels in its interpreter (TRITON_INTERPRET=1, the only way they run on
# CPU). Triton decides that when a kernel is decorated, so this is read once, at import, as Triton
# reads it; the kernel modules import it from here.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_mode_problems(device: torch.device) -> list[str]:
    """Why inferlab's Triton kernels, as imported, cannot run on device (compiled vs interpreted)."""
    if device.type == "cpu" and not INTERPRETED:
        return [
            "on CPU the Triton kernels run only in Triton's interpreter: set TRITON_INTERPRET=1 "
            "before inferlab's Triton kernels are first imported"
        ]
    if device.type == "cuda" and INTERPRETED:
        return [
            "TRITON_INTERPRET=1 was set when the Triton kernels were imported, so they would run in the "
            "interpreter; unset it to run them on CUDA"
        ]
    if device.type not in ("cpu", "cuda"):
        return [f"runs on cuda (or cpu in Triton's interpreter), got device {device.type!r}"]
    return []


@functools.cache
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
