"""The OpenAI request bodies the server accepts, checked into engine prompts, and OpenAI's error
JSON for what it refuses.

Fields are strictly typed (a string is not a number). Besides OpenAI's sampling fields
(max_tokens, temperature, top_p, seed, stop, n, logprobs, echo, penalties, logit_bias,
response_format) a body may carry vLLM's top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids and structured outputs (guided_json, guided_regex, guided_choice,
guided_grammar, structured_outputs), priority and metadata (for the scheduler policy), and
return_token_ids (each choice also lists the token ids it generated). Fields OpenAI defines that
the engine cannot honour are refused unless left at their defaults; unknown fields are ignored, as
OpenAI's clients send some (user, store, ...).
"""

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from inferlab.core.sampling_params import MAX_LOGPROBS, SamplingParams
from inferlab.server.engine_loop import Prompt
from inferlab.server.structured import FieldError, structured_outputs

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# OpenAI's error type for each status the server answers with; other 4xx are invalid requests.
ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An error answered as OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # sent with the error: Allow on a 405, Retry-After on a 429

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP side knows of the engine, fixed when the server starts."""

    name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    num_cache_tokens: int  # what the whole KV cache holds: a default max_tokens must fit in it
    plugins: dict = field(default_factory=dict)  # the plugin serving each kind, for the model card
    max_n: int = 16  # serve.max_n: the most choices one request may ask for
    # The most characters one token spells (longest_token_chars), or None: a text longer than
    # max_model_len tokens of it is refused before it is tokenized.
    max_token_chars: int | None = None


WHITESPACE_PROBE = "a  b\n\n\tc   \u00e9  "


def longest_token_chars(tokenizer) -> int | None:
    """The most characters any token of the vocabulary spells, for a tokenizer that keeps every
    character of its input (it decodes a probe of spaces, tabs and newlines back as it was): then
    a text of n characters holds at least n / this many tokens. None for a tokenizer that may drop
    characters (one that strips whitespace), of which nothing can be said before tokenizing."""
    try:
        if tokenizer.decode(tokenizer.encode(WHITESPACE_PROBE, add_special_tokens=False)) != WHITESPACE_PROBE:
            return None
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    except Exception:  # a tokenizer without these methods: no shortcut
        return None
    return max((len(t) for t in tokens if isinstance(t, str)), default=None)


def refuse_text_longer_than_the_context(text: str, model: ServedModel, param: str) -> None:
    """ApiError 400 (context_length_exceeded) for a text that must tokenize to max_model_len tokens
    or more, found from its length alone: a 45 MB prompt took minutes to tokenize before it was
    refused."""
    longest = model.max_token_chars
    # twice that: a normalizer may join characters first (NFC composes "e" and an accent into "é")
    if longest and len(text) > 2 * (model.max_model_len - 1) * longest:
        raise ApiError(
            400,
            f"this model's maximum context length is {model.max_model_len} tokens; the {param} has "
            f"{len(text)} characters, at least {-(-len(text) // (2 * longest))} tokens",
            param,
            "context_length_exceeded",
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class GenerationBody(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    priority: int = 0
    metadata: dict[str, Any] | None = None
    return_token_ids: bool = False
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    # Structured outputs: OpenAI's response_format, vLLM's guided_* fields and structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        """The first field set to something the engine cannot do, or None."""
        return None

    def num_logprobs(self) -> int | None:
        """The top logprobs asked for each generated token, or None when no logprobs are."""
        raise NotImplementedError


def _check_text(value: str) -> str:
    """JSON's \\u escapes can spell a lone surrogate, which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start : e.end].encode("unicode_escape").decode()
        raise ValueError(f"holds {bad} at character {e.start}, a lone surrogate, which is not text") from None
    return value


def _check_prompt(value):
    if isinstance(value, str):
        return _check_text(value)
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        if all(isinstance(p, str) for p in value):
            return [_check_text(p) for p in value]
        if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in value):
            return value
    raise ValueError("must be a string, a list of token ids, or a non-empty list of strings or of token id lists")


class CompletionBody(GenerationBody):
    prompt: Any
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        return _check_prompt(value)

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        return super().unsupported()

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_generated(self) -> int:
        """Completions generated a prompt: best_of when it asks for more than n (the best n are
        returned), else n."""
        n = 1 if self.n is None else self.n
        if self.best_of is None or self.best_of == n:
            return n
        if self.best_of < n:
            raise ApiError(400, f"best_of ({self.best_of}) must be at least n ({n})", "best_of", "invalid_value")
        if self.stream:
            raise ApiError(
                400, "best_of cannot be used with stream (the best are known at the end)", "best_of", "invalid_value"
            )
        return self.best_of


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = Field(None, validate_default=True)  # absent and null alike: empty text

    @field_validator("content")
    @classmethod
    def _text(cls, value):
        """A string, or a list of {"type": "text", "text": ...} parts (joined)."""
        if value is None or isinstance(value, str):
            return _check_text(value or "")
        if isinstance(value, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value
        ):
            return _check_text("".join(p["text"] for p in value))
        raise ValueError('must be a string or a list of {"type": "text", "text": "..."} parts')


class ChatBody(GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        return super().unsupported()

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None


# Fields of vLLM's and OpenAI's APIs that this server does not implement (and does not declare), with
# the values that ask for nothing: a body that sets one otherwise is refused rather than served as
# if the field were not there. Other unknown fields are ignored, as OpenAI's clients send some.
NOT_IMPLEMENTED: dict[str, tuple] = {
    "use_beam_search": (False,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "audio": (None,),
}
NOT_IMPLEMENTED_BY_BODY: dict[type, dict[str, tuple]] = {
    CompletionBody: {"add_special_tokens": (True,), "prompt_embeds": (None,)},
    ChatBody: {
        "add_special_tokens": (False,),
        "add_generation_prompt": (True,),
        "continue_final_message": (False,),
        "chat_template": (None,),
        "chat_template_kwargs": (None, {}),
        "documents": (None, []),
        "tool_choice": (None, "none", "auto"),
    },
}


def not_implemented(data: dict, body_class: type) -> str | None:
    """The first field of NOT_IMPLEMENTED (or body_class's own) that data sets to something."""
    if body_class not in NOT_IMPLEMENTED_BY_BODY:
        return None
    for name, idle in (NOT_IMPLEMENTED | NOT_IMPLEMENTED_BY_BODY[body_class]).items():
        if name in data and not any(type(data[name]) is type(v) and data[name] == v for v in idle):
            return name
    return None


def parse_body(raw: bytes, body_class: type[GenerationBody]) -> GenerationBody:
    """The request body checked against body_class; ApiError 400 naming the culprit otherwise."""
    try:
        data = json.loads(raw)
    except ValueError as e:  # bad UTF-8, bad JSON, or an integer of over 4,300 digits
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        body = body_class.model_validate(data)
    except ValidationError as e:
        error = e.errors()[0]
        param = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {message}", param=param, code="invalid_type") from None
    field = body.unsupported()
    if field == "tools":
        raise ApiError(
            400,
            "tools: tool calling is not supported by this server; send the request without tools",
            param=field,
            code="unsupported",
        )
    if field is not None:
        raise ApiError(
            400, f"{field}={getattr(body, field)!r} is not supported by this server", param=field, code="unsupported"
        )
    field = not_implemented(data, body_class)
    if field is not None:
        raise ApiError(400, f"{field}={data[field]!r} is not supported by this server", param=field, code="unsupported")
    return body


def check_model(body: GenerationBody, model: ServedModel) -> None:
    """A body naming another model than the one served: 404 model_not_found, as OpenAI answers."""
    if body.model is not None and body.model != model.name:
        raise model_not_found(body.model, model)


def model_not_found(name: str, model: ServedModel) -> ApiError:
    return ApiError(
        404, f"the model {name!r} does not exist: this server serves {model.name!r}", "model", "model_not_found"
    )


def completion_token_ids(body: CompletionBody, model: ServedModel) -> list[list[int]]:
    """The prompts of a completions body, as token ids (one list per prompt)."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    for text in prompt:
        if isinstance(text, str):
            refuse_text_longer_than_the_context(text, model, "prompt")
    prompts = [model.tokenizer.encode(p) if isinstance(p, str) else p for p in prompt]
    for i, token_ids in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not token_ids:
            raise ApiError(400, f"{where} is empty: give at least one token", "prompt", "empty_prompt")
        if min(token_ids) < 0 or max(token_ids) >= model.vocab_size:
            bad = [t for t in token_ids if not 0 <= t < model.vocab_size][:10]
            raise ApiError(
                400, f"{where}: token ids {bad} are outside the vocabulary [0, {model.vocab_size})", "prompt"
            )
    return prompts


def chat_token_ids(
    body: ChatBody,
    model: ServedModel,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """The conversation (body.messages) through the tokenizer's chat template, ending in the
    assistant's turn (or, with continue_final_message, inside the last message)."""
    tokenizer = model.tokenizer
    if not body.messages:
        raise ApiError(400, "messages is empty: give at least one message", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, f"model {model.name!r} has no chat template: use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.content} for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
        )
    except Exception as e:  # the template's own checks (roles in order, ...)
        raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None
    refuse_text_longer_than_the_context(text, model, "messages")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def engine_prompts(
    body: GenerationBody, prompts: list[list[int]], model: ServedModel, max_tokens: int | None
) -> list[Prompt]:
    """One engine Prompt per token list, with the body's sampling settings. max_tokens None: as
    many as fit in max_model_len and the KV cache. Each prompt plus its max_tokens must fit
    max_model_len."""
    limit = model.max_model_len
    n = generated(body)
    name = "n" if n == (body.n or 1) else "best_of"
    if not 1 <= n <= model.max_n:
        raise ApiError(400, f"{name} must be in [1, {model.max_n}] (serve.max_n), got {n}", name, "invalid_value")
    # The last token is sampled, never cached: a request fits the cache with one token more than it holds.
    room = min(limit, model.num_cache_tokens + 1)
    result = []
    for token_ids in prompts:
        num_tokens = max_tokens if max_tokens is not None else max(1, room - len(token_ids))
        if max_tokens is None and n > 1:  # what fits, shared by the n choices
            num_tokens = max(1, min(num_tokens, (model.num_cache_tokens - len(token_ids)) // n))
        if n > 1 and len(token_ids) + n * num_tokens > model.num_cache_tokens:
            raise ApiError(
                400,
                f"{name}: {n} choices of up to {num_tokens} tokens each after a {len(token_ids)}-token prompt need "
                f"{len(token_ids) + n * num_tokens} tokens of KV cache, more than its {model.num_cache_tokens}; "
                f"lower {name} or max_tokens",
                name,
                "invalid_value",
            )
        if len(token_ids) >= limit or len(token_ids) + num_tokens > limit:
            raise ApiError(
                400,
                f"this model's maximum context length is {limit} tokens; the request has {len(token_ids)} prompt "
                f"tokens and asks for up to {num_tokens if max_tokens is not None else 'at least 1'} more",
                "max_tokens" if max_tokens is not None and len(token_ids) < limit else "prompt",
                "context_length_exceeded",
            )
        result.append(Prompt(token_ids, sampling_params(body, num_tokens, model), body.priority, body.metadata))
    return result


def sampling_params(body: GenerationBody, max_tokens: int, model: ServedModel) -> SamplingParams:
    num_logprobs = body.num_logprobs()
    field = "top_logprobs" if isinstance(body, ChatBody) else "logprobs"
    if num_logprobs is not None and not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"{field} must be in [0, {MAX_LOGPROBS}], got {num_logprobs}", field, "invalid_value")
    echo = isinstance(body, CompletionBody) and body.echo
    settings = {
        "n": generated(body),
        # best_of ranks the completions by their mean logprob
        "logprobs": 0 if num_logprobs is None and generated(body) != (body.n or 1) else num_logprobs,
        "prompt_logprobs": num_logprobs if echo else None,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "logit_bias": logit_bias(body.logit_bias, model.vocab_size),
        "min_tokens": body.min_tokens or 0,
        "structured_outputs": structured(body),
        "max_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": -1 if body.top_k is None else body.top_k,
        "min_p": 0.0 if body.min_p is None else body.min_p,
        "seed": body.seed,
        "ignore_eos": body.ignore_eos,
        "stop": [] if body.stop is None else body.stop,
        "stop_token_ids": body.stop_token_ids or [],
    }
    try:
        return SamplingParams(**settings)
    except ValueError as e:  # SamplingParams' messages start with the field's name
        field = str(e).split()[0].split("[")[0]
        raise ApiError(400, str(e), field if field in settings else None, "invalid_value") from None


def generated(body: GenerationBody) -> int:
    """Completions generated per prompt (n, or a completions body's best_of)."""
    return body.num_generated() if isinstance(body, CompletionBody) else (1 if body.n is None else body.n)


def structured(body: GenerationBody):
    try:
        return structured_outputs(body)
    except FieldError as e:
        raise ApiError(400, str(e), e.param, "invalid_value") from None


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}) with its ids checked against the vocabulary."""
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias: key {key!r} is not a token id", "logit_bias", "invalid_value") from None
        if not 0 <= token_id < vocab_size:
            raise ApiError(
                400,
                f"logit_bias: token id {token_id} is outside the vocabulary [0, {vocab_size})",
                "logit_bias",
                "invalid_value",
            )
        parsed[token_id] = value
    return parsed
