"""Serving a cluster: the OpenAI API in front of local replicas, streaming from whichever replica
serves each request, with the replicas' gauges summed in /metrics; and `inferlab job=serve
cluster.replicas=N router=...` as a command."""

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from inferlab import LLM, Cluster, SamplingParams
from inferlab.conf import ServeConfig
from inferlab.server import InferenceServer

SETTINGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=128, max_num_seqs=16)
PROMPTS = [f"Request {i}: the quick brown fox" + " jumps" * (i % 3) for i in range(6)]


def complete(url: str, prompt: str, stream: bool) -> tuple[str, list[int]]:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if not stream:
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        return choice["text"], choice["token_ids"]
    text, ids = "", []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                import json

                for choice in json.loads(line[6:])["choices"]:
                    text += choice["text"]
                    ids += choice.get("token_ids", [])
    return text, ids


def test_a_cluster_serves_the_openai_api_from_every_replica(one_torch_thread):
    with LLM(**SETTINGS) as alone:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        expected = [out["token_ids"] for out in alone.generate(PROMPTS, params, use_tqdm=False)]
    cluster = Cluster(replicas=2, router="least_load", **SETTINGS)
    with cluster, InferenceServer(cluster, ServeConfig(port=0, log_level="warning")) as server:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: complete(server.url, PROMPTS[i], stream=i % 2 == 0), range(6)))
        assert [ids for _, ids in results] == expected
        assert set(cluster.placement.values()) == {0, 1}
        metrics = httpx.get(f"{server.url}/metrics").text
        usage = float(re.search(r"^inferlab:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", metrics, re.M)[1])
        assert usage == 0.0  # every replica's blocks free again
        assert cluster.gauges()["num_blocks"] == 2 * 128
        models = httpx.get(f"{server.url}/v1/models").json()
        assert models["data"][0]["id"]


@pytest.mark.slow
def test_inferlab_job_serve_with_a_cluster(tmp_path):
    command = [
        sys.executable,
        "-m",
        "inferlab",
        "job=serve",
        "serve.port=0",
        "cluster.replicas=2",
        "router=prefix_aware",
        "engine.device=cpu",
        "engine.kvcache_block_size=16",
        "engine.num_kvcache_blocks=64",
        f"hydra.run.dir={tmp_path}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("INFERLAB_API_KEY", None)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    found = threading.Event()

    def read():
        for line in process.stdout:
            lines.append(line)
            if re.search(r"serving .* at http://", line):
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert found.wait(180) and process.poll() is None, "".join(lines)
        url = re.search(r"at (http://[0-9.]+:[0-9]+)", "".join(lines))[1]
        text, ids = complete(url, "Hello there", stream=True)
        assert len(ids) == 6
        info = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert info["plugins"]["router"] == "prefix_aware"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, "".join(lines)
