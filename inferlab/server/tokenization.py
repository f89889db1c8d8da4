"""vLLM's /tokenize and /detokenize: a prompt or a conversation to the token ids the engine would
see for it, and token ids back to text. Clients probe them (lm-eval counts tokens through them);
the bodies and answers are vLLM's."""

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from inferlab.server.protocol import ApiError, ChatMessage, ServedModel, _check_text, chat_token_ids


class TokenizeBody(BaseModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`), as one
    body: exactly one of the two is given."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: vLLM's default for the kind of body, True for a prompt (its BOS, where the tokenizer
    # adds one), False for messages (the chat template writes its own)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    # vLLM's fields this server cannot honour: accepted only at these defaults
    chat_template: Any = None
    chat_template_kwargs: Any = None
    tools: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        return None if value is None else _check_text(value)

    def unsupported(self) -> str | None:
        for name in ("chat_template", "chat_template_kwargs", "tools"):
            if getattr(self, name):
                return name
        return None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[int]

    def unsupported(self) -> str | None:
        return None


def tokenize(body: TokenizeBody, model: ServedModel) -> dict:
    """vLLM's TokenizeResponse: count, max_model_len, tokens (and token_strs when asked)."""
    tokenizer = model.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give either prompt (a string) or messages (a conversation), not both or neither", "prompt")
    if body.prompt is not None:
        token_ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        if body.add_generation_prompt and body.continue_final_message:
            raise ApiError(
                400,
                "continue_final_message and add_generation_prompt cannot both be true: set add_generation_prompt "
                "to false to continue the last message",
                "continue_final_message",
            )
        token_ids = chat_token_ids(
            body,
            model,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            add_special_tokens=bool(body.add_special_tokens),
        )
    answer = {"count": len(token_ids), "max_model_len": model.max_model_len, "tokens": token_ids, "token_strs": None}
    if body.return_token_strs:
        answer["token_strs"] = tokenizer.convert_ids_to_tokens(token_ids)
    return answer


def detokenize(body: DetokenizeBody, model: ServedModel) -> dict:
    """vLLM's DetokenizeResponse: the text of the token ids, special tokens included."""
    bad = [t for t in body.tokens if not 0 <= t < model.vocab_size][:10]
    if bad:
        raise ApiError(400, f"tokens: token ids {bad} are outside the vocabulary [0, {model.vocab_size})", "tokens")
    return {"prompt": model.tokenizer.decode(body.tokens)}
