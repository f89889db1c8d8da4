"""`inferlab job=serve` as a subprocess: on SIGTERM or SIGINT with streams in flight, each stream
ends with a final event (its finish, or "abort" past serve.shutdown_timeout_s) and [DONE], and
the process exits 0."""

import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

COMMAND = [
    sys.executable,
    "-m",
    "inferlab",
    "job=serve",
    "serve.port=0",
    "serve.shutdown_timeout_s=1.5",
    "engine.device=cpu",
    "engine.kvcache_block_size=16",
    "engine.num_kvcache_blocks=256",
]


def start_server(tmp_path) -> tuple[subprocess.Popen, str, list[str]]:
    """The server process, its URL and its output lines so far (a thread keeps reading them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("INFERLAB_API_KEY", None)
    process = subprocess.Popen(
        [*COMMAND, f"hydra.run.dir={tmp_path}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    found = threading.Event()

    def read():
        for line in process.stdout:
            lines.append(line)
            if re.search(r"serving .* at http://", line):
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(180) or process.poll() is not None:
        process.kill()
        pytest.fail("the server did not start:\n" + "".join(lines))
    url = re.search(r"at (http://[0-9.]+:[0-9]+)", "".join(lines))[1]
    return process, url, lines


def stream_events(url: str, max_tokens: int, started: threading.Barrier, events: list) -> None:
    body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    started.wait(30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_every_stream_with_a_final_event_and_exits_0(tmp_path, sig):
    process, url, lines = start_server(tmp_path)
    try:
        lengths = [3000, 3000, 3000, 12]  # three outlast the grace period, one finishes within it
        streams = [[] for _ in lengths]
        started = threading.Barrier(len(lengths) + 1)
        threads = [
            threading.Thread(target=stream_events, args=(url, n, started, events))
            for n, events in zip(lengths, streams)
        ]
        for thread in threads:
            thread.start()
        started.wait(60)  # every stream has its first event
        process.send_signal(sig)
        for thread in threads:
            thread.join(60)
        assert process.wait(60) == 0, "".join(lines)
    finally:
        process.kill()
    for n, events in zip(lengths, streams):
        assert events[-1] == "[DONE]", events[-3:]
        final = json.loads(events[-2])["choices"][0]
        assert final["finish_reason"] == ("length" if n == 12 else "abort")
    assert "server stopped" in "".join(lines)
