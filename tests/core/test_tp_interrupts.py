"""Tensor parallelism on CPU: a second Ctrl-C while rank 0 waits in a collective with a worker
stopped by SIGSTOP stops at once (it used to wait for tp_step_timeout_s), shutting the workers down."""

import os
import signal
import threading
import time

import pytest
from worker_processes import alive, prompts_of

from inferlab import LLM, SamplingParams
from inferlab.core.workers import TensorParallelError

SETTINGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=128, max_model_len=1024)


def test_a_second_ctrl_c_stops_at_once_while_a_worker_is_stopped(checkpoint):
    llm = LLM(checkpoint("gqa2-tied"), tensor_parallel_size=2, tp_step_timeout_s=60.0, **SETTINGS)
    pids = llm.runner.workers.pids
    sent = []

    def stop_then_interrupt_twice():
        while llm.stats.num_steps < 3:
            time.sleep(0.01)
        os.kill(pids[0], signal.SIGSTOP)
        time.sleep(0.5)  # rank 0 is in the next step's collective by now, waiting for rank 1
        sent.append(time.monotonic())
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)

    thread = threading.Thread(target=stop_then_interrupt_twice, daemon=True)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(
                prompts_of([6, 9]), SamplingParams(temperature=0, max_tokens=900, ignore_eos=True), use_tqdm=False
            )
        seconds = time.monotonic() - sent[0]
        assert seconds < 10, seconds  # the step timeout is 60 s
        thread.join(5)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in pids)
        with pytest.raises(TensorParallelError, match="shut down"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        llm.close()
