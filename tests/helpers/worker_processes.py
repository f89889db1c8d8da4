"""What the tensor-parallel tests check of worker processes, on CPU (test_tensor_parallel.py) and
on two GPUs (test_gpu_tp.py): which processes are alive, a failure provoked mid-generation, and
that nothing is left behind once the engine has shut its workers down."""

import os
import threading
import time

import pytest

from inferlab import SamplingParams
from inferlab.core.workers import TensorParallelError


def prompts_of(lengths, start=5):
    return [[(start + 7 * i + j * 13) % 300 + 3 for j in range(n)] for i, n in enumerate(lengths)]


def alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def child_pids() -> set[int]:
    """This process's children (zombies too), except multiprocessing's resource tracker, which
    the first spawn starts and which lives as long as this process."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                tracker = b"resource_tracker" in f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if ppid == os.getpid() and not tracker:
            found.add(int(entry))
    return found


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def run_until_failure(llm, fail):
    """Generates while `fail` runs in a thread once 3 steps are done; returns (error, seconds from
    the failure to the error)."""
    failed_at = []

    def trigger():
        while llm.stats.num_steps < 3:
            time.sleep(0.01)
        failed_at.append(time.monotonic())
        fail()

    thread = threading.Thread(target=trigger, daemon=True)
    thread.start()
    long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
    with pytest.raises(TensorParallelError) as error:
        llm.generate(prompts_of([6, 9]), long, use_tqdm=False)
    thread.join(5)
    return error.value, time.monotonic() - failed_at[0]


def assert_nothing_left(llm, pids, children_before, shm_before):
    """The workers are gone, no child process or shared-memory segment remains, and the engine
    refuses further work, saying why."""
    assert not any(alive(pid) for pid in pids)
    assert child_pids() <= children_before
    assert shm_entries() <= shm_before
    with pytest.raises(TensorParallelError, match="shut down"):
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
