"""Per-request generation settings: validated and normalized when constructed, immutable after."""

from dataclasses import dataclass, field
from numbers import Integral, Real

# The sampler scales logits by log2(e) / temperature in float32, where a GPU flushes subnormal
# numbers to zero: temperatures above 2**126 would scale every logit to 0 and masked ones to NaN.
MAX_TEMPERATURE = 2.0**126
# Temperatures below this sample greedily, as vLLM's _SAMPLING_EPS: dividing the logits by a
# smaller one overflows float32 (1e-39 turned every logit into inf and picked the last token).
GREEDY_BELOW_TEMPERATURE = 1e-5
SEED_LIMIT = 2**32  # the sampler hashes one 32-bit word of seed, so larger seeds would alias
TOP_K_LIMIT = 2**31 - 1  # above any vocabulary, so the largest top_k disables the filter
INT64_LIMIT = 2**63 - 1  # counts and token ids travel as int64


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 (or below 1e-5) means greedy; at most 2**126. top_k=-1, top_p=1 and min_p=0 disable their
    filters. seed (an integer in [0, 2**32)) makes one request reproducible regardless of what
    else is in the batch. stop strings end the returned text before the first match.

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
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        set_field(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        set_field(
            self,
            "stop_token_ids",
            tuple(_integer(t, "stop_token_ids", 0, INT64_LIMIT, "token ids, each ") for t in ids),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


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
