"""Request traces: reading the Mooncake and Azure formats, and the token ids of Mooncake's hash blocks.

Mooncake (JSONL, kvcache-ai/Mooncake's FAST'25 release): one object a line with `timestamp`
(milliseconds), `input_length`, `output_length` and `hash_ids`, one id per 512-token block of the
prompt (the last block may be partial); requests listing the same id share that block's tokens.

Azure LLM inference trace (CSV, Azure/AzurePublicDataset): header `TIMESTAMP,ContextTokens,
GeneratedTokens`, timestamps as date-times such as `2023-11-16 18:15:46.6805900` (100 ns ticks;
the 2024 release appends a UTC offset). It has no prefix information: every prompt is its own.

A Mooncake line may also say its request's `class` (one of bench.classes), `priority`,
`slo_ttft_s`, `slo_tpot_s` and `tenant`; each wins over what its class says.

Both read into TraceRequests whose arrivals count seconds from the trace's first request.
"""

import csv
import functools
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import numpy as np

from inferlab.conf.bench import AZURE_COLUMNS, MOONCAKE_KEYS, TRACE_REQUEST_KEYS, detect_trace_format

TRACE_FORMATS = ("mooncake", "azure")
MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id
TOKEN_ID_RANGE = 10001  # ids drawn as bench.py draws them, in [0, 10000], then taken modulo the vocabulary

AZURE_TIMESTAMP = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?")


@dataclass(slots=True)
class TraceRequest:
    arrival_s: float  # seconds after the trace's first request
    input_length: int
    output_length: int
    hash_ids: list[int] | None = None  # Mooncake's 512-token prefix blocks; None: a prompt of its own
    # What the line says of its request (TRACE_REQUEST_KEYS), those it gives: class, priority, SLOs, tenant
    own: dict | None = None


def read_trace(path: str) -> tuple[str, list[TraceRequest]]:
    """(format, requests in arrival order, the first at 0 s) of a Mooncake or Azure trace file."""
    trace_format = detect_trace_format(path)
    requests = read_mooncake(path) if trace_format == "mooncake" else read_azure(path)
    if not requests:
        raise ValueError(f"trace {path!r} holds no requests")
    requests.sort(key=lambda r: r.arrival_s)  # stable: equal timestamps keep the file's order
    start = requests[0].arrival_s
    for request in requests:
        request.arrival_s -= start
    return trace_format, requests


def _length(value, what: str, where: str) -> int:
    # math.isfinite first: int() of an infinity or NaN raises an error that names neither the line nor the field
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
        or value < 0
    ):
        raise ValueError(f"{where}: {what} must be a non-negative integer, got {value!r}")
    return int(value)


def read_mooncake(path: str) -> list[TraceRequest]:
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"trace {path!r} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not JSON ({e})") from None
            if not isinstance(record, dict) or any(key not in record for key in MOONCAKE_KEYS):
                raise ValueError(f"{where}: a Mooncake record needs {list(MOONCAKE_KEYS)}, got {line.strip()[:120]!r}")
            timestamp = record["timestamp"]
            if (
                isinstance(timestamp, bool)
                or not isinstance(timestamp, (int, float))
                or not 0 <= timestamp < math.inf  # Python's json reads NaN and Infinity
            ):
                raise ValueError(f"{where}: timestamp must be finite non-negative milliseconds, got {timestamp!r}")
            hash_ids = record.get("hash_ids")
            if hash_ids is not None and (
                not isinstance(hash_ids, list)
                or not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**64 for h in hash_ids)
            ):
                raise ValueError(f"{where}: hash_ids must be a list of integers in [0, 2**64), got {hash_ids!r}")
            requests.append(
                TraceRequest(
                    arrival_s=timestamp / 1000,
                    input_length=_length(record["input_length"], "input_length", where),
                    output_length=_length(record["output_length"], "output_length", where),
                    hash_ids=hash_ids,
                    own=_own_settings(record, where),
                )
            )
    return requests


def _own_settings(record: dict, where: str) -> dict | None:
    """The TRACE_REQUEST_KEYS a Mooncake line gives, checked."""
    own = {key: record[key] for key in TRACE_REQUEST_KEYS if record.get(key) is not None}
    if not own:
        return None
    if "class" in own and (not isinstance(own["class"], str) or not own["class"]):
        raise ValueError(f"{where}: class must be the name of one of bench.classes, got {own['class']!r}")
    priority = own.get("priority")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise ValueError(f"{where}: priority must be an integer (lower is served first), got {priority!r}")
    for key in ("slo_ttft_s", "slo_tpot_s"):
        value = own.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
        ):
            raise ValueError(f"{where}: {key} must be a positive number of seconds, got {value!r}")
    if "tenant" in own:
        if not isinstance(own["tenant"], (str, int)) or isinstance(own["tenant"], bool):
            raise ValueError(f"{where}: tenant must be a name (a string or an integer), got {own['tenant']!r}")
        own["tenant"] = str(own["tenant"])
    return own


def parse_azure_timestamp(text: str) -> tuple[int, float]:
    """(whole seconds since the epoch, fraction of a second) of an Azure trace date-time; kept apart
    so that 100 ns ticks survive (a float of the epoch seconds keeps only about 0.2 us). A time
    without an offset is taken as UTC, as the dataset's are."""
    match = AZURE_TIMESTAMP.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a date-time like '2023-11-16 18:15:46.6805900'")
    year, month, day, hour, minute, second = (int(match[i]) for i in range(1, 7))
    fraction = int(match[7]) / 10 ** len(match[7]) if match[7] else 0.0
    zone = timezone.utc
    if match[8] and match[8] != "Z":
        sign = -1 if match[8][0] == "-" else 1
        digits = match[8][1:].replace(":", "")
        zone = timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))
    whole = datetime(year, month, day, hour, minute, second, tzinfo=zone)
    return int(whole.timestamp()), fraction


def read_azure(path: str) -> list[TraceRequest]:
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, skipinitialspace=True)
        for number, row in enumerate(reader, 2):
            where = f"trace {path!r} line {number}"
            if None in row.values() or None in row:  # DictReader's fill for short rows and key for long ones
                raise ValueError(f"{where}: a row needs exactly the columns {', '.join(AZURE_COLUMNS)}")
            try:
                seconds, fraction = parse_azure_timestamp(row["TIMESTAMP"] or "")
                context, generated = (float(row[column]) for column in AZURE_COLUMNS[1:])
            except (ValueError, TypeError) as e:
                raise ValueError(f"{where}: {e}") from None
            rows.append(
                (
                    seconds,
                    fraction,
                    _length(context, "ContextTokens", where),
                    _length(generated, "GeneratedTokens", where),
                )
            )
    if not rows:
        return []
    first_second = min(seconds for seconds, *_ in rows)
    return [
        TraceRequest(arrival_s=(seconds - first_second) + fraction, input_length=context, output_length=generated)
        for seconds, fraction, context, generated in rows
    ]


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64s: equal inputs give equal outputs, near inputs far ones."""
    x = values.astype(np.uint64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


# Salts keep hash-id blocks, per-request tokens and the shared run of ids in separate streams.
HASH_BLOCK_SALT = 0x5EED_B10C
OWN_TOKENS_SALT = 0x0DD_5EED
RUN_SALT = 0x5EED_0F1D

# Every id a trace prompt can hold, as one shared Python int each: NumPy's object take makes
# lists of these twice as fast as tolist() makes new ints, in a fifth of the memory.
TOKEN_ID_OBJECTS = np.array(range(TOKEN_ID_RANGE), dtype=object)
HEAD_TOKENS = 8  # drawn for each key alone: two keys' rows differ in them but with a chance of 1e-32
RUN_LENGTH = 2**20  # the shared run of ids that the rest of each row is a window of


def _drawn(keys: np.ndarray, length: int, seed: int, salt: int, vocab_size: int) -> list[list[int]]:
    """A row of `length` ids per key, each drawn for (seed, salt, key, position)."""
    base = _mix(np.array([(seed * 0x9E3779B97F4A7C15 + salt) % 2**64], dtype=np.uint64))
    rows = _mix(base ^ keys.astype(np.uint64))[:, None] + np.arange(length, dtype=np.uint64)[None, :]
    return TOKEN_ID_OBJECTS[_mix(rows) % np.uint64(TOKEN_ID_RANGE) % np.uint64(vocab_size)].tolist()


@functools.lru_cache(maxsize=4)
def _shared_run(seed: int, vocab_size: int) -> list[int]:
    return _drawn(np.zeros(1, dtype=np.uint64), RUN_LENGTH, seed, RUN_SALT, vocab_size)[0]


def _token_ids(keys: np.ndarray, length: int, seed: int, salt: int, vocab_size: int) -> list[list[int]]:
    """A row of `length` token ids per key, a pure function of (seed, salt, key, position): its
    first HEAD_TOKENS drawn for the key, the rest a window of the shared run at an offset drawn
    for it. A long trace's prompts are 124 M ids: slicing most of them out of one list of shared
    ints, instead of drawing and converting each, builds them in half the time, and rows still
    differ from their first tokens on."""
    heads = _drawn(keys, min(length, HEAD_TOKENS), seed, salt, vocab_size)
    if length <= HEAD_TOKENS:
        return heads
    run = _shared_run(seed, vocab_size)
    starts = (_mix(keys.astype(np.uint64) ^ np.uint64(salt)) % np.uint64(RUN_LENGTH)).tolist()
    rows = []
    for row, start in zip(heads, starts):
        row += run[start : start + length - HEAD_TOKENS]
        while len(row) < length:  # past the run's end: on from its start
            row += run[: length - len(row)]
        rows.append(row)
    return rows


class TraceTokens:
    """The token ids of a trace's prompts, for BlockPrompts (inferlab.core.blocks) naming them by
    their hash ids: block `key` holds the ids trace_prompt gives hash id key, and request i's own
    tokens those it gives request i. Copy c of the trace (bench.trace_copies) reads hash id key +
    c * stride and request i + c * num_requests instead: its own users. Picklable."""

    CACHED_BLOCKS = 4096  # blocks kept once made, for a runner that reads a prompt's ids

    def __init__(
        self, seed: int, vocab_size: int, block_size: int, copy: int = 0, stride: int = 0, num_requests: int = 0
    ):
        self.seed, self.vocab_size, self.block_size = seed, vocab_size, block_size
        self.block_offset = copy * stride
        self.request_offset = copy * num_requests
        self.cache: dict[int, list[int]] = {}

    def __getstate__(self):
        return {**self.__dict__, "cache": {}}

    def block_tokens(self, key: int, length: int) -> list[int]:
        tokens = self.cache.get(key)
        if tokens is None:
            if len(self.cache) >= self.CACHED_BLOCKS:
                self.cache.clear()
            keys = np.array([(key + self.block_offset) % 2**64], dtype=np.uint64)
            tokens = self.cache[key] = _token_ids(keys, self.block_size, self.seed, HASH_BLOCK_SALT, self.vocab_size)[0]
        return tokens[:length]

    def own_tokens(self, key: int, start: int, end: int) -> list[int]:
        keys = np.array([key + self.request_offset], dtype=np.uint64)
        return _token_ids(keys, end, self.seed, OWN_TOKENS_SALT, self.vocab_size)[0][start:end]


def trace_prompt(
    hash_ids: list[int] | None,
    num_tokens: int,
    block_size: int,
    request_index: int,
    seed: int,
    vocab_size: int,
    blocks: dict[int, list[int]] | None = None,
) -> list[int]:
    """The prompt of a trace request: block i holds the `block_size` tokens of hash_ids[i] (the same
    tokens wherever that id appears, so requests sharing ids share those blocks); tokens past the
    listed blocks, and every token of a request without hash ids, are the request's own.
    `blocks`: hash id -> its tokens, filled as ids are met; pass one dict for a whole trace and its
    prompts share their blocks' lists, which builds a long trace several times faster and smaller."""
    num_blocks = min(len(hash_ids or ()), -(-num_tokens // block_size))
    blocks = {} if blocks is None else blocks
    ids = hash_ids[:num_blocks] if num_blocks else []
    missing = [h for h in dict.fromkeys(ids) if h not in blocks]
    if missing:
        blocks.update(zip(missing, _token_ids(np.asarray(missing), block_size, seed, HASH_BLOCK_SALT, vocab_size)))
    prompt: list[int] = []
    for h in ids:
        prompt += blocks[h]
    del prompt[num_tokens:]
    if len(prompt) < num_tokens:
        own = _token_ids(np.array([request_index]), num_tokens - len(prompt), seed, OWN_TOKENS_SALT, vocab_size)
        prompt += own[0]
    return prompt
