"""`inferlab` / `python -m inferlab`: generate for a few prompts on the embedded tiny model (or
the directory given as the first argument) and print the completions and throughput."""
import sys
import time

from inferlab import LLM, SamplingParams

PROMPTS = ["Hello, world! How are you today?", "The quick brown fox", "Once upon a time,"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    llm = LLM(argv[0] if argv else None)
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.6, max_tokens=32))
    elapsed = time.perf_counter() - start
    for prompt, out in zip(PROMPTS, outputs):
        print(f"{prompt!r} -> {out['text']!r}")
    tokens = sum(len(o["token_ids"]) for o in outputs)
    print(f"{tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.0f} tok/s")


if __name__ == "__main__":
    main()
