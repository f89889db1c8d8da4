"""Token ids to text as they arrive: incremental detokenization and stop strings across chunks.

The one implementation of stop strings: the engine checks each request's new tokens with it (a
TextStream per request that has stop strings), and the server cuts each streamed choice's text
with it. A stream's text is the concatenation of the deltas it sends. It equals the decode of all
the output tokens (cut before the first stop string) however the tokens were split into chunks:
each delta decodes the new tokens with the tokens before them as context, text ending in an
incomplete character waits for the bytes that complete it, and text that could begin a stop
string waits until the following text rules it in or out. So a stop string is found however many
tokens spell it.
"""

from collections.abc import Callable, Sequence

# Prompt tokens decoded before the first output token: enough that a tokenizer which spells a
# leading space or a byte sequence across tokens (SentencePiece, byte-level BPE) decodes the
# first output token as it does inside the text.
CONTEXT_TOKENS = 5
REPLACEMENT_CHARACTER = "\ufffd"  # what decoding makes of an incomplete UTF-8 sequence


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """token ids -> text without special tokens, as tokenizer.decode gives it. A fast
    tokenizer's Rust backend is called directly: transformers' decode wrapper costs several
    times the decode itself, twice per streamed chunk."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):  # the wrapper cleans up
        return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=True)
    return lambda token_ids: backend.decode(token_ids, skip_special_tokens=True)


class IncrementalDecoder:
    """Decodes a growing list of token ids into text deltas (vLLM's incremental scheme: decode a
    window that starts a few tokens back and emit what it adds past the previous window). decode:
    token ids to text (text_decoder(tokenizer), or the engine's decode)."""

    __slots__ = ("_decode", "token_ids", "prefix_offset", "read_offset")

    def __init__(self, decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int]):
        self._decode = decode
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # the window decoded for context starts here
        self.read_offset = len(self.token_ids)  # text of the tokens before this was emitted

    def push(self, new_token_ids: Sequence[int]) -> str:
        """The text the new tokens add; "" while it ends in an incomplete character."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHARACTER):
            return ""
        # tokens before the context window are never decoded again: dropped, so a long stream keeps a few
        del self.token_ids[: self.prefix_offset]
        self.prefix_offset = self.read_offset - self.prefix_offset
        self.read_offset = len(self.token_ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back, at the end of the stream (an incomplete character stays
        a replacement character, as in a decode of the whole output)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return text[len(prefix_text) :]


class StopStrings:
    """Cuts a stream of text before the first occurrence of any stop string. The longest tail
    that could be the start of a stop string is held back until later text decides it. Its work
    per delta grows with the stop strings' count and length, which SamplingParams bounds."""

    __slots__ = ("stops", "held")

    def __init__(self, stops: Sequence[str]):
        if not stops or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self.stops = tuple(stops)
        self.held = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found); after a stop, emit nothing more."""
        if not delta:
            return "", False
        text = self.held + delta
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.held = ""
            return text[: min(cuts)], True
        keep = self._possible_stop_start(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, once the stream ends without completing a stop string."""
        held, self.held = self.held, ""
        return held

    def _possible_stop_start(self, text: str) -> int:
        """The length of the longest suffix of text that is a proper prefix of a stop string:
        for each stop string, the earliest place in text's tail where its first character starts
        a match of the rest of text."""
        longest = 0
        for stop in self.stops:
            end = len(text) - longest  # only longer suffixes than the one found count
            i = text.find(stop[0], max(len(text) - len(stop) + 1, 0), end)
            while i >= 0:
                if stop.startswith(text[i:]):
                    longest = len(text) - i
                    break
                i = text.find(stop[0], i + 1, end)
        return longest


class TextStream:
    """One choice's text: the decoder, then the stop strings. push() returns the text to send
    and whether a stop string ended it; after that the stream is done and returns nothing."""

    __slots__ = ("decoder", "stop_strings", "stopped", "num_tokens")

    def __init__(self, decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int], stop: Sequence[str] = ()):
        self.decoder = IncrementalDecoder(decode, prompt_token_ids)
        self.stop_strings = StopStrings(stop) if stop else None
        self.stopped = False
        self.num_tokens = 0  # pushed so far

    def push(self, new_token_ids: Sequence[int], last: bool = False) -> tuple[str, bool]:
        """The text new tokens add (all of what is held back when last) and whether a stop
        string was reached."""
        if self.stopped:
            return "", True
        self.num_tokens += len(new_token_ids)
        delta = self.decoder.push(new_token_ids)
        if last:
            delta += self.decoder.flush()
        if self.stop_strings is None:
            return delta, False
        text, self.stopped = self.stop_strings.push(delta)
        if last and not self.stopped:
            text += self.stop_strings.flush()
        return text, self.stopped
