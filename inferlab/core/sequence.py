"""One request's state as it moves through the engine."""

from enum import Enum, auto
from itertools import count

from inferlab.core.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids (prompt then completion) plus how far their K/V has been computed.

    num_computed_tokens counts tokens whose K/V is in the cache (prefix hits included);
    block_table lists the cache blocks holding them, owned by the KVCacheManager.
    """

    _ids = count()

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams,
        eos_token_id: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.seed = seed  # params.seed, or one drawn for the request: sampling noise is a function of it
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full blocks, filled by the KV manager
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.error: str | None = None

    def __len__(self):
        return len(self.token_ids)

    def __repr__(self):
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)

    def hits_stop_token(self, token: int) -> bool:
        return (token == self.eos_token_id and not self.params.ignore_eos) or token in self.params.stop_token_ids

    def check_stop(self) -> str | None:
        """The finish reason the last appended token causes, if any (stop strings are the engine's).
        A placeholder (negative, not sampled yet) can only end the sequence by length."""
        token = self.token_ids[-1]
        if token >= 0 and self.hits_stop_token(token):
            return "stop"
        if self.num_completion_tokens >= self.params.max_tokens:
            return "length"
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return "length"
        return None
