"""Per-request generation settings: validated and normalized when constructed, immutable after."""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

# The sampler scales logits by log2(e) / temperature in float32, where a GPU flushes subnormal
# numbers to zero: temperatures above 2**126 would scale every logit to 0 and masked ones to NaN.
MAX_TEMPERATURE = 2.0**126
# Temperatures below this sample greedily, as vLLM's _SAMPLING_EPS: dividing the logits by a
# smaller one overflows float32 (1e-39 turned every logit into inf and picked the last token).
GREEDY_BELOW_TEMPERATURE = 1e-5
SEED_LIMIT = 2**32  # the sampler hashes one 32-bit word of seed, so larger seeds would alias
TOP_K_LIMIT = 2**31 - 1  # above any vocabulary, so the largest top_k disables the filter
INT64_LIMIT = 2**63 - 1  # counts and token ids travel as int64
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs, and vLLM's default max_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
# Every new token of a request is checked against each of its stop strings, on the engine's thread
# (which all requests share) and the server's event loop: the work per token is bounded by these.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024  # the stop strings' lengths added up


@dataclass(slots=True, frozen=True)
class StructuredOutputs:
    """A constraint on the text a request generates, compiled by the sampler's grammar library
    (vLLM's StructuredOutputsParams): exactly one of json (a JSON schema, as a dict or its JSON
    text), json_object (any JSON object), regex, choice (one of these strings) or grammar (EBNF,
    as xgrammar reads it)."""

    json: Mapping[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of json, json_object, regex, choice, grammar; got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, Mapping)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (an object or its text), got {self.json!r}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must hold strings only, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 (or below 1e-5) means greedy; at most 2**126. top_k=-1, top_p=1 and min_p=0 disable their
    filters. seed (an integer in [0, 2**32)) makes one request reproducible regardless of what
    else is in the batch. stop strings end the returned text before the first match: at most
    MAX_STOP_STRINGS of them, MAX_STOP_CHARS characters in all.

    n: completions generated for the prompt (its prefill is shared through the prefix cache);
    choice i draws with seed + i when a seed is given. logprobs: the log-probability of each
    generated token and of the `logprobs` most likely ones (0 to 20; None: none), of the
    distribution it was drawn from (the engine's logprobs_mode says which); prompt_logprobs: the
    same for each prompt token after the first, from the model's raw distribution.
    presence_penalty and frequency_penalty (in [-2, 2]) subtract from the logits of tokens
    generated so far, once or per occurrence; repetition_penalty (> 0, 1 = none) divides positive
    and multiplies negative logits of tokens in the prompt or generated (vLLM's and OpenAI's
    definitions). logit_bias adds {token id: bias in [-100, 100]} to the logits. min_tokens: EOS
    and stop_token_ids cannot end the output before this many tokens. structured_outputs: a
    grammar the output must follow (StructuredOutputs); constraint: a factory of your own
    TokenConstraint (inferlab.core.protocols), called once per generated sequence.

    Frozen: a SamplingParams is checked once, here, so it cannot be changed afterwards (make a
    new one, or dataclasses.replace(params, top_p=0.9), which checks again). Numbers of any
    numeric type (NumPy's included) are stored as int or float; stop and stop_token_ids as tuples.
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    structured_outputs: StructuredOutputs | None = None
    constraint: Callable[[], Any] | None = None

    def __post_init__(self):
        set_field = object.__setattr__  # the one place a frozen instance is written: normalizing it
        set_field(
            self, "temperature", _real(self.temperature, "temperature", "a number in [0, 2**126] (below 1e-5: greedy)")
        )
        set_field(self, "max_tokens", _integer(self.max_tokens, "max_tokens", 1, INT64_LIMIT))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.top_k != -1:
            set_field(self, "top_k", _integer(self.top_k, "top_k", 1, TOP_K_LIMIT, "-1 (disabled) or "))
        set_field(self, "top_p", _real(self.top_p, "top_p", "in (0, 1]"))
        set_field(self, "min_p", _real(self.min_p, "min_p", "in [0, 1]"))
        if self.seed is not None:
            set_field(self, "seed", _integer(self.seed, "seed", 0, SEED_LIMIT - 1, "None or "))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {_clipped(self.stop)}")
        if len(stop) > MAX_STOP_STRINGS or sum(map(len, stop)) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop must hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters in all, "
                f"got {len(stop)} strings of {sum(map(len, stop))} characters"
            )
        set_field(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        set_field(
            self,
            "stop_token_ids",
            tuple(_integer(t, "stop_token_ids", 0, INT64_LIMIT, "token ids, each ") for t in ids),
        )
        set_field(self, "n", _integer(self.n, "n", 1, INT64_LIMIT))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                set_field(self, name, _integer(getattr(self, name), name, 0, MAX_LOGPROBS, "None or "))
        for name in ("presence_penalty", "frequency_penalty"):
            set_field(self, name, _real(getattr(self, name), name, "in [-2, 2]"))
        set_field(self, "repetition_penalty", _real(self.repetition_penalty, "repetition_penalty", "a number > 0"))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            bias = {
                _integer(t, "logit_bias keys", 0, INT64_LIMIT, "token ids, each "): _real(
                    b, f"logit_bias[{t}]", "in [-100, 100]"
                )
                for t, b in self.logit_bias.items()
            }
            set_field(self, "logit_bias", bias or None)
        set_field(
            self, "min_tokens", _integer(self.min_tokens, "min_tokens", 0, self.max_tokens, "at most max_tokens: ")
        )
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputs, got {type(self.structured_outputs).__name__}"
            )
        if self.constraint is not None and not callable(self.constraint):
            raise ValueError(f"constraint must be a callable returning a TokenConstraint, got {self.constraint!r}")
        if self.constraint is not None and self.structured_outputs is not None:
            raise ValueError("give structured_outputs or constraint, not both")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed before sampling: penalties, logit_bias or min_tokens."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or self.logit_bias is not None
            or self.min_tokens > 0
        )

    @property
    def constrained(self) -> bool:
        """Whether a grammar or a constraint of the user's decides which tokens may come next."""
        return self.structured_outputs is not None or self.constraint is not None


def _integer(value, name: str, low: int, high: int, allowed: str = "") -> int:
    # exact types first: an isinstance against the numbers ABCs costs most of a microsecond
    if (type(value) is not int and (not isinstance(value, Integral) or isinstance(value, bool))) or not (
        low <= value <= high
    ):
        raise ValueError(f"{name} must be {allowed}an integer in [{low}, {_limit(high)}], got {value!r}")
    return int(value)


REAL_RANGES = {
    "a number in [0, 2**126] (below 1e-5: greedy)": lambda x: 0 <= x <= MAX_TEMPERATURE,
    "in (0, 1]": lambda x: 0 < x <= 1,
    "in [0, 1]": lambda x: 0 <= x <= 1,
    "in [-2, 2]": lambda x: -2 <= x <= 2,
    "a number > 0": lambda x: 0 < x < math.inf,
    "in [-100, 100]": lambda x: -MAX_LOGIT_BIAS <= x <= MAX_LOGIT_BIAS,
}


def _real(value, name: str, allowed: str) -> float:
    if (
        type(value) is not float
        and type(value) is not int
        and (not isinstance(value, Real) or isinstance(value, bool))
        or not REAL_RANGES[allowed](value)  # NaN fails every test
    ):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _limit(high: int) -> str:
    """2**k - 1 reads better than its digits."""
    return f"2**{(high + 1).bit_length() - 1} - 1" if high > 2**20 and (high + 1) & high == 0 else str(high)


def _clipped(value) -> str:
    """A value's repr, cut short: a bad stop list may be megabytes long."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"
