"""Logprobs in OpenAI's shapes: completions' {tokens, token_logprobs, top_logprobs, text_offset}
and chat's {content: [{token, logprob, bytes, top_logprobs}]}, from the engine's entries
(logprob, top ids, top logprobs) per token. Tokens are shown as their own decoded text, special
tokens included; -inf (a token the filters or a grammar excluded) is shown as -9999.0, as vLLM
does, since JSON has no infinity."""

import math

FLOOR = -9999.0


def finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class LogprobsFormatter:
    """Formats one response's logprobs; remembers the text of each token id it has decoded."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self.texts.get(token_id)
        if text is None:
            text = self.texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def completion(self, token_ids: list[int], entries: list, offset: int) -> tuple[dict, int]:
        """Completions' logprobs object for these tokens (an entry None: a prompt's first token,
        which has no logprob), their text offsets counted from `offset`; and the offset after them."""
        tokens = [self.text(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        body = {
            "tokens": tokens,
            "token_logprobs": [None if e is None else finite(e[0]) for e in entries],
            "top_logprobs": [None if e is None else self._top(e) for e in entries],
            "text_offset": offsets,
        }
        return body, offset

    def _top(self, entry) -> dict[str, float]:
        """{token text: logprob} of the top tokens, most likely first; where two tokens decode to
        the same text (bytes of one character), the likelier one's."""
        top: dict[str, float] = {}
        for token_id, value in zip(entry[1], entry[2]):
            top.setdefault(self.text(token_id), finite(value))
        return top

    def chat(self, token_ids: list[int], entries: list) -> list[dict]:
        """Chat's logprobs content entries for these tokens."""
        return [
            {
                **self._chat_token(token_id, entry[0]),
                "top_logprobs": [self._chat_token(i, v) for i, v in zip(entry[1], entry[2])],
            }
            for token_id, entry in zip(token_ids, entries)
        ]

    def _chat_token(self, token_id: int, value: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": finite(value), "bytes": list(text.encode("utf-8"))}
