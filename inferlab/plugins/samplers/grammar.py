"""Structured outputs through xgrammar: a StructuredOutputs spec compiled once per request into a
grammar, and a TokenConstraint per generated sequence that fills its row of the allowed-token
bitmask and advances on each token drawn. xgrammar was chosen over llguidance on the measured
per-token cost of the mask (BENCHMARKS.md, "Structured outputs"). Needs the `structured` extra."""

import json
import re
from collections.abc import Callable

import torch

# xgrammar's errors start with a time and the C++ source line: "[12:16:28] /project/cpp/x.cc:94: "
SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\]\s*\S+:\d+:\s*")


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(
            f"structured outputs need xgrammar, which does not import ({e}): pip install 'inferlab[structured]'"
        ) from None
    return xgrammar


class GrammarConstraint:
    """One sequence's place in a compiled grammar (an xgrammar GrammarMatcher)."""

    __slots__ = ("matcher",)

    def __init__(self, matcher):
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles specs over one tokenizer's vocabulary at a time (xgrammar's compiler caches the
    grammars it has compiled, so n choices and repeated schemas compile once)."""

    def __init__(self):
        self.tokenizer = None
        self.vocab_size = 0
        self.compiler = None

    def compile(self, spec, tokenizer, vocab_size: int) -> Callable[[], GrammarConstraint]:
        xgr = _xgrammar()
        if self.compiler is None or tokenizer is not self.tokenizer or vocab_size != self.vocab_size:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
            self.compiler = xgr.GrammarCompiler(info)
            self.tokenizer, self.vocab_size = tokenizer, vocab_size
        compiler = self.compiler
        kind = (
            next(name for name in ("json", "regex", "choice", "grammar") if getattr(spec, name) is not None)
            if not spec.json_object
            else "json_object"
        )
        try:
            if kind == "json":
                # no free whitespace between tokens: a model may otherwise spend max_tokens on it
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                compiled = compiler.compile_json_schema(schema, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            else:
                compiled = compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            lines = [line for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__]
            message = SOURCE_PREFIX.sub("", lines[0])
            raise ValueError(f"structured_outputs.{kind}: the grammar library rejects it: {message}") from None
        return lambda: GrammarConstraint(xgr.GrammarMatcher(compiled))
