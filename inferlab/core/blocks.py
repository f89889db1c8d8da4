"""Blocks of a token sequence and what names them: the identity and chained hash by which a prefix
cache and a router recognise equal prefixes, and prompts given by their blocks' identities
instead of their token ids.

A block's identity is a hashable equal for equal contents: the tuple of its token ids, or, for
the part of a prompt given as a BlockPrompt, the keys of the blocks it spans. Block i of a
sequence is named by the hash of (block i-1's name, block i's identity), so that equal names mean
equal prefixes (up to a 64-bit hash collision, which a prefix cache confirms against the
identities). Python's hash of ints and tuples is the same in every process, so a Ray actor and
the driver name blocks alike.

A BlockPrompt is a trace replay's prompt at fleet scale: a request's tokens are those of the
trace's hash blocks, named by their keys, and a million requests of 12,000 tokens could not be
held as token ids. The engine keeps its tokens as KeyedTokens, a list whose prompt part holds
placeholders and is read (indexing, slicing, iteration) through the prompt's source, so that a
runner that reads the ids gets them, a simulated one never makes them, and a prefix cache names
the prompt's blocks by their keys without hashing tokens.
"""

from collections.abc import Hashable, Iterator, Sequence
from itertools import islice
from typing import Protocol

PLACEHOLDER = -1  # what a KeyedTokens list holds in place of its prompt's ids (an id no vocabulary has)


class TokenSource(Protocol):
    """Where a BlockPrompt's token ids come from, when something reads them. It must be picklable
    (a prompt may travel to a Ray actor)."""

    def block_tokens(self, key: Hashable, length: int) -> list[int]:
        """The first `length` token ids of the keyed block `key` (the same wherever it appears)."""

    def own_tokens(self, key: Hashable, start: int, end: int) -> list[int]:
        """Token ids start..end of the tokens past the keyed blocks of the prompt whose own_key is key."""


class BlockPrompt:
    """A prompt of num_tokens tokens given by blocks: the first min(num_tokens, len(keys) *
    block_len) tokens are the blocks named by keys, block_len tokens each (the last may be cut
    short); the rest are the prompt's own, named by own_key. Equal keys (within one namespace)
    mean equal tokens; `source` gives the ids themselves. id_bound: every id is below it."""

    __slots__ = ("namespace", "keys", "block_len", "num_tokens", "own_key", "source", "id_bound", "keyed_len")

    def __init__(
        self,
        namespace: Hashable,
        keys: Sequence[Hashable],
        block_len: int,
        num_tokens: int,
        own_key: Hashable,
        source: TokenSource,
        id_bound: int,
    ):
        if block_len < 1 or num_tokens < 0:
            raise ValueError(f"a BlockPrompt needs block_len >= 1 and num_tokens >= 0, got {block_len}, {num_tokens}")
        self.namespace = namespace
        self.keys = keys
        self.block_len = block_len
        self.num_tokens = num_tokens
        self.own_key = own_key
        self.source = source
        self.id_bound = id_bound
        self.keyed_len = min(num_tokens, len(keys) * block_len)

    def __repr__(self):
        return f"BlockPrompt({self.num_tokens} tokens, {len(self.keys)} keyed blocks of {self.block_len})"

    def __len__(self) -> int:
        return self.num_tokens

    def identity(self, start: int, end: int) -> tuple:
        """The identity of tokens start..end (within the prompt): which keyed blocks (or own
        tokens) they are, never their ids."""
        length, keyed = self.block_len, self.keyed_len
        i = start // length
        if end <= keyed and end <= (i + 1) * length:  # within one keyed block: the common case
            return (self.namespace, self.keys[i], start - i * length, end - i * length)
        pieces: list = [self.namespace]
        while start < end and start < keyed:
            i = start // length
            stop = min(end, (i + 1) * length, keyed)
            pieces.append((self.keys[i], start - i * length, stop - i * length))
            start = stop
        if start < end:
            pieces.append((("own", self.own_key), start - keyed, end - keyed))
        return tuple(pieces)

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Token ids start..end, made from the source."""
        end = self.num_tokens if end is None else min(end, self.num_tokens)
        out: list[int] = []
        length, keyed = self.block_len, self.keyed_len
        while start < end and start < keyed:
            i = start // length
            stop = min(end, (i + 1) * length, keyed)
            out += self.source.block_tokens(self.keys[i], stop - i * length)[start - i * length :]
            start = stop
        if start < end:
            out += self.source.own_tokens(self.own_key, start - keyed, end - keyed)
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(self.token_ids())

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.num_tokens)
            return self.token_ids(start, stop) if step == 1 else self.token_ids()[index]
        i = index + self.num_tokens if index < 0 else index
        if not 0 <= i < self.num_tokens:
            raise IndexError("BlockPrompt index out of range")
        return self.token_ids(i, i + 1)[0]

    def __eq__(self, other) -> bool:
        """Equal to any sequence of the same ids (comparing makes them)."""
        if isinstance(other, BlockPrompt) and (other.namespace, other.keys, other.own_key) == (
            self.namespace,
            self.keys,
            self.own_key,
        ):
            return (other.block_len, other.num_tokens) == (self.block_len, self.num_tokens)
        try:
            return len(other) == self.num_tokens and list(other) == self.token_ids()
        except TypeError:
            return NotImplemented

    __hash__ = None

    def token_list(self) -> "KeyedTokens":
        """A new engine token list for this prompt (its outputs are appended to it)."""
        return KeyedTokens(self)


class KeyedTokens(list):
    """A request's token ids when its prompt is a BlockPrompt: a list as long as the sequence, so
    that its length, appends and output writes cost what a list's do, whose prompt part holds
    placeholders. Reading it (indexing, slicing, iterating) gives the prompt's ids from its
    source; C code that reads the list's storage directly (list + list, ==) would see the
    placeholders, and the engine never does that."""

    __slots__ = ("prompt",)

    def __init__(self, prompt: BlockPrompt):
        super().__init__()
        self.prompt = prompt
        if prompt.num_tokens:
            self.append(PLACEHOLDER)
            self *= prompt.num_tokens

    def __getitem__(self, index):
        n = self.prompt.num_tokens
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            if start >= n or stop <= start:
                return list.__getitem__(self, index)
            return self.prompt.token_ids(start, min(stop, n)) + list.__getitem__(self, slice(n, stop))
        i = index + len(self) if index < 0 else index
        if 0 <= i < n:
            return self.prompt.token_ids(i, i + 1)[0]
        return list.__getitem__(self, index)

    def __iter__(self) -> Iterator[int]:
        yield from self.prompt.token_ids()
        yield from islice(list.__iter__(self), self.prompt.num_tokens, None)

    def copy(self) -> "KeyedTokens":
        other = KeyedTokens(self.prompt)
        other += list.__getitem__(self, slice(self.prompt.num_tokens, None))
        return other

    def __reduce__(self):
        return _keyed_tokens, (self.prompt, list.__getitem__(self, slice(self.prompt.num_tokens, None)))


def _keyed_tokens(prompt: BlockPrompt, outputs: list[int]) -> KeyedTokens:
    tokens = KeyedTokens(prompt)
    tokens += outputs
    return tokens


def chain_hash(parent: int, identity: Hashable) -> int:
    """The name of a block whose identity is `identity` after the block named `parent` (0: none).
    Python's tuple hash in C: it needs only spread, since a prefix cache confirms a hit on the
    identities themselves."""
    return hash((parent, identity))


def block_identity(token_ids: Sequence[int], start: int, end: int) -> Hashable:
    """The identity of token_ids[start:end]: the tuple of the ids, or for the prompt part of
    KeyedTokens, the keys of the blocks it spans (a tuple that never equals a tuple of ids)."""
    if type(token_ids) is KeyedTokens:
        n = token_ids.prompt.num_tokens
        if end <= n:
            return token_ids.prompt.identity(start, end)
        outputs = list.__getitem__(token_ids, slice(max(start, n), end))
        return (token_ids.prompt.identity(start, n), *outputs) if start < n else tuple(outputs)
    return tuple(token_ids[start:end])


def block_identities(token_ids: Sequence[int], block_size: int, first: int, last: int) -> list[Hashable]:
    """block_identity of blocks first..last-1 of block_size tokens (the same values), in one call:
    a keyed prompt's blocks that lie within one of its keyed blocks without a call each."""
    if type(token_ids) is not KeyedTokens:
        return [block_identity(token_ids, b * block_size, (b + 1) * block_size) for b in range(first, last)]
    prompt = token_ids.prompt
    length, keyed, namespace, keys = prompt.block_len, prompt.keyed_len, prompt.namespace, prompt.keys
    if length % block_size == 0:  # every block before the keyed part's end lies within one keyed block
        within = max(first, min(last, keyed // block_size))
        identities: list[Hashable] = [
            (namespace, keys[start // length], start % length, start % length + block_size)
            for start in range(first * block_size, within * block_size, block_size)
        ]
        first = within
    else:
        identities = []
    for b in range(first, last):
        start = b * block_size
        end = start + block_size
        i = start // length
        if end <= keyed and end <= (i + 1) * length:  # BlockPrompt.identity's common case
            identities.append((namespace, keys[i], start - i * length, end - i * length))
        else:
            identities.append(block_identity(token_ids, start, end))
    return identities


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    hashes: list[int] | None = None,
    identities: list[Hashable] | None = None,
) -> list[int]:
    """The chained names of the first num_blocks full blocks of token_ids: hashes extended in
    place (pass the list of an earlier call on the same tokens to continue it) and returned;
    identities, when given, is extended with the identities of the blocks named (block_identity)."""
    hashes = [] if hashes is None else hashes
    first = len(hashes)
    if first >= num_blocks:
        return hashes
    parent = hashes[-1] if first else 0
    if type(token_ids) is list:
        named = [tuple(token_ids[i * block_size : (i + 1) * block_size]) for i in range(first, num_blocks)]
    else:
        named = block_identities(token_ids, block_size, first, num_blocks)
    for identity in named:
        parent = hash((parent, identity))  # chain_hash, inline
        hashes.append(parent)
    if identities is not None:
        identities += named
    return hashes
