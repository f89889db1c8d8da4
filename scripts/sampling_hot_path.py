"""The CPU hot path with plain sampling: nano-vllm's bench workload (256 sequences, prompts and
outputs of 100 to 1,024 tokens, seed 0, ignore_eos) on the embedded tiny model, timed end to end,
for comparing commits (sampling features must cost requests that use none of them nothing).

    python scripts/sampling_hot_path.py [--repeats 3] [--max-len 1024]
"""

import argparse
import random
import time

import torch

from inferlab import LLM, SamplingParams


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-len", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    num_seqs = 256
    prompts = [[rng.randint(0, 300) for _ in range(rng.randint(100, args.max_len))] for _ in range(num_seqs)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, args.max_len))
        for _ in range(num_seqs)
    ]
    llm = LLM(device="cpu", max_model_len=4096, max_num_seqs=256, cpu_kv_cache_gib=2.0)
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(p.max_tokens for p in params)
        print(f"{elapsed:.2f} s, {tokens / elapsed:.0f} output tok/s")


if __name__ == "__main__":
    main()
