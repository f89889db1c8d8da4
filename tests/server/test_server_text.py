"""The server's streamed text: incremental detokenization (multi-byte characters split across
byte-level BPE tokens) and stop strings across chunk boundaries, however the tokens are chunked."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from inferlab.core.text import IncrementalDecoder, StopStrings, TextStream, text_decoder
from inferlab.tiny_model import default_model_path

# The embedded tokenizer was trained on ASCII text: these characters are 2 to 4 bytes, each byte
# a token of its own, so a character is complete only after several tokens.
TEXT = "Hello, wörld! Ünïcode ✓ 日本語 and emoji 🙂🚀 — the quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


def chunked(items: list, sizes: list[int]) -> list[list]:
    """items cut into consecutive chunks of the given sizes (cycled), the last one what is left."""
    chunks, start, i = [], 0, 0
    while start < len(items):
        size = max(1, sizes[i % len(sizes)]) if sizes else 1
        chunks.append(items[start : start + size])
        start += size
        i += 1
    return chunks


def stream_text(tokenizer, prompt_ids, chunks, stop=()) -> tuple[list[str], bool]:
    stream = TextStream(text_decoder(tokenizer), prompt_ids, stop)
    deltas, stopped = [], False
    for i, chunk in enumerate(chunks):
        text, stopped = stream.push(chunk, last=i == len(chunks) - 1)
        deltas.append(text)
        if stopped:
            break
    return deltas, stopped


def test_multibyte_characters_are_never_split_across_deltas(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT.encode()) // 2  # mostly byte tokens: characters span several
    decoder = IncrementalDecoder(text_decoder(tokenizer), tokenizer.encode("Prompt: "))
    deltas = [decoder.push([t]) for t in ids]
    deltas.append(decoder.flush())
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if not d) > 5  # tokens that only began a character sent nothing


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 7), min_size=1, max_size=8))
def test_any_chunking_gives_the_whole_decode(tokenizer, sizes):
    ids = tokenizer.encode(TEXT)
    deltas, _ = stream_text(tokenizer, tokenizer.encode("Hi"), chunked(ids, sizes))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    start=st.integers(0, len(TEXT) - 6),
    length=st.integers(1, 6),
)
def test_a_stop_string_anywhere_cuts_the_text_before_it(tokenizer, sizes, start, length):
    stop = TEXT[start : start + length]
    ids = tokenizer.encode(TEXT)
    deltas, stopped = stream_text(tokenizer, [], chunked(ids, sizes), stop=[stop, "never appears"])
    assert stopped
    assert "".join(deltas) == TEXT[: TEXT.find(stop)]


def test_text_that_could_start_a_stop_string_waits_for_what_follows():
    stops = StopStrings(["STOP here", "xyz"])
    assert stops.push("abc ST") == ("abc ", False)  # "ST" may begin "STOP here"
    assert stops.push("OP h") == ("", False)
    assert stops.push("ow") == ("STOP how", False)  # ruled out: released
    assert stops.push(" x") == (" ", False)
    assert stops.push("yz tail") == ("", True)
    assert StopStrings(["ab"]).flush() == ""
    held = StopStrings(["abc"])
    assert held.push("xab") == ("x", False) and held.flush() == "ab"  # the stream ended undecided


def test_stop_strings_must_be_non_empty():
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings([""])


def test_special_tokens_are_not_streamed(tokenizer):
    ids = tokenizer.encode("Hello") + [tokenizer.eos_token_id] + tokenizer.encode(" world")
    deltas, _ = stream_text(tokenizer, [], [[t] for t in ids])
    assert "".join(deltas) == "Hello world"
