"""Per-request generation settings, validated when constructed."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy. top_k=-1, top_p=1 and min_p=0 disable their filters. seed makes one request reproducible regardless of what else is
    in the batch. stop strings end the returned text before the first match.
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check(
            isinstance(self.temperature, (int, float)) and self.temperature >= 0,
            f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}",
        )
        _check(
            isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}",
        )
        _check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"
        )
        _check(
            isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1,
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
            f"seed must be an integer or None, got {self.seed!r}",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, message: str):
    if not ok:
        raise ValueError(message)
