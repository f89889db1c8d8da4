"""Per-token host cost of a grammar constraint, xgrammar against llguidance, on the CPU: B
sequences each follow one JSON schema; a step fills every sequence's row of the allowed-token
bitmask and advances each by its next token (the work the engine does per constrained token,
TokenConstraint.fill_bitmask and accept_token, one row at a time). The tokens are a fixed valid
document's, so both libraries walk the same path. The tokenizer is a byte-level BPE trained here
on Python's standard library sources (32,000 tokens, no download), as a stand-in for a real
model's vocabulary.

    python scripts/grammar_overhead.py [--batch 1 64] [--vocab 32000] [--repeats 5]
"""

import argparse
import glob
import json
import os
import sysconfig
import tempfile
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@analytical.engine",
    "tags": ["mathematics", "poetry", "computing", "notes"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "active": True,
}


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train(files, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    with tempfile.TemporaryDirectory() as directory:  # saved and loaded, as a checkpoint's tokenizer is
        fast.save_pretrained(directory)
        return PreTrainedTokenizerFast.from_pretrained(directory)


def run_xgrammar(tokenizer, tokens: list[int], batch: int) -> tuple[float, float]:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - start
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = torch.full((batch, -(-len(tokenizer) // 32)), -1, dtype=torch.int32)
    start = time.perf_counter()
    for token in tokens:
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
            assert matcher.accept_token(token)
    return compile_s, (time.perf_counter() - start) / len(tokens)


def run_llguidance(tokenizer, tokens: list[int], batch: int) -> tuple[float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    )
    matchers = [llguidance.LLMatcher(lltokenizer, grammar) for _ in range(batch)]
    compile_s = time.perf_counter() - start
    bitmask = llguidance.torch.allocate_token_bitmask(batch, lltokenizer.vocab_size)
    start = time.perf_counter()
    for token in tokens:
        for row, matcher in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)
            assert matcher.consume_token(token), matcher.get_error()
    return compile_s, (time.perf_counter() - start) / len(tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = train_tokenizer(args.vocab)
    text = json.dumps(DOCUMENT)
    tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    print(f"vocabulary {len(tokenizer)}, document of {len(tokens)} tokens")
    print("library     batch  compile ms  per token (all rows) us  per token per row us")
    for batch in args.batch:
        for name, run in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
            results = [run(tokenizer, tokens, batch) for _ in range(args.repeats)]
            compile_s = min(r[0] for r in results)
            per_token = min(r[1] for r in results)
            print(
                f"{name:10s}  {batch:5d}  {compile_s * 1e3:10.1f}  {per_token * 1e6:24.1f}  {per_token * 1e6 / batch:20.1f}"
            )


if __name__ == "__main__":
    main()
