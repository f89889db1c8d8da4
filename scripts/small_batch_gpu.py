"""Decode at small batches against model options (DecoderOptions), in one process: per setting
and batch B of 1-16 sequences, B sequences decoding 512 tokens each after 256-token prompts of
their own ids (output tok/s, the best of two runs), then the decode graph of B sequences replayed
300 times back to back as the last step left it (device time a step at a context of 767 tokens).
A SETTING is KEY=VALUE[,KEY=VALUE...], each VALUE read as JSON (256, false, null).

    python3 scripts/small_batch_gpu.py MODEL_DIR SETTING...   # e.g. split_k_tokens=256 split_k_tokens=0,gemv_decode=false
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from microbench_gpu import back_to_back_us  # noqa: E402

from inferlab import LLM, SamplingParams  # noqa: E402

BATCHES = (1, 2, 4, 8, 16)
params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=512)
seed = 0
for setting in sys.argv[2:]:
    options = {k: json.loads(v) for k, v in (pair.split("=", 1) for pair in setting.split(","))}
    with LLM(sys.argv[1], attention="triton", max_model_len=4096, model_options=options) as llm:
        graphs = llm.runner.decode_graphs.graphs
        rates, device = {}, {}
        for b in BATCHES:
            best = 0.0
            for _ in range(2):
                seed += 1  # fresh ids: no run reuses another's prefix cache
                prompts = [[(97 * seed + 31 * i + j) % 10000 for j in range(256)] for i in range(b)]
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                best = max(best, b * 512 / (time.perf_counter() - t))
            rates[b] = best
            device[b] = back_to_back_us(graphs[b].replay, 300, warmup=20)
        print(f"{setting}: decode graph " + ", ".join(f"{b}: {us:.0f} us" for b, us in device.items()))
        print(f"{setting}: output tok/s " + ", ".join(f"{b}: {r:.0f}" for b, r in rates.items()), flush=True)
