"""The HTTP endpoints: OpenAI's completions and chat completions (streamed as server-sent events
or whole), the model cards, vLLM's tokenize and detokenize, health, version, Prometheus metrics
and FastAPI's OpenAPI schema and docs. Handlers parse and check a request, tokenize it, and hand
its prompts to the engine loop; the text comes back as the loop's steps produce tokens.
docs/serving.md describes the fields, errors and metrics."""

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException

import inferlab
from inferlab.core.text import TextStream, text_decoder
from inferlab.server.engine_loop import ACCEPTED, EngineLoop, Finish, Prompt, RequestStream
from inferlab.server.logprobs import LogprobsFormatter
from inferlab.server.metrics import ServerMetrics
from inferlab.server.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ApiError,
    ChatBody,
    CompletionBody,
    GenerationBody,
    ServedModel,
    chat_token_ids,
    check_model,
    completion_token_ids,
    engine_prompts,
    model_not_found,
    parse_body,
)
from inferlab.server.tokenization import DetokenizeBody, TokenizeBody, detokenize, tokenize


class Delta:
    """What one choice gained in one update: its new text and token ids, how it finished, and
    the logprobs of those tokens and of the prompt (when asked for, else None)."""

    __slots__ = ("index", "text", "token_ids", "finish", "logprobs", "prompt_logprobs")

    def __init__(
        self, index: int, text: str, token_ids: list[int], finish: Finish | None, logprobs=None, prompt_logprobs=None
    ):
        self.index = index
        self.text = text
        self.token_ids = token_ids
        self.finish = finish
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs


def per_choice(updates: list) -> list:
    """The loop's (index, token ids, finish) updates joined into one per choice, in the order the
    choices first appear: when the event loop falls behind the engine, the updates of several
    steps arrive together, and each choice then costs one detokenization and one chunk for all of
    them instead of one per step, so the loop catches up instead of falling further behind."""
    if len(updates) == 1:
        return updates
    joined: dict[int, list] = {}
    for index, token_ids, finish, logprobs, prompt_logprobs in updates:
        update = joined.get(index)
        if update is None:
            joined[index] = [
                index,
                list(token_ids),
                finish,
                None if logprobs is None else list(logprobs),
                prompt_logprobs,
            ]
        else:
            update[1] += token_ids
            update[2] = finish  # a choice's finish comes with its last update
            if logprobs is not None:
                update[3] = (update[3] or []) + logprobs
            update[4] = update[4] or prompt_logprobs
    return list(joined.values())


class Generation:
    """One HTTP request's prompts in the engine, as text: start() queues them (ApiError when the
    engine refuses them), iterating yields each batch of updates as Deltas, close() aborts what
    has not finished."""

    def __init__(self, loop: EngineLoop, prompts: list[Prompt], tokenizer, received: float | None = None):
        """received: when the HTTP server received the request (perf_counter), where the
        metrics' TTFT and e2e start (None: when the Generation is made)."""
        self.loop = loop
        self.metrics = loop.metrics
        self.received = time.perf_counter() if received is None else received
        self.stream = RequestStream()
        self.prompts = prompts
        self.choices = [p for p in prompts for _ in range(p.params.n)]  # the prompt of each choice index
        decode = text_decoder(tokenizer)
        self.texts = [TextStream(decode, p.token_ids, p.params.stop) for p in self.choices]
        self.num_output_tokens = [0] * len(self.choices)
        self.finishes: list[Finish | None] = [None] * len(self.choices)
        self.num_open = len(self.choices)
        self.backlog: list = []

    async def start(self) -> None:
        self.loop.submit(self.stream, self.prompts)
        try:
            items = await self.stream.get()
        except BaseException:  # cancelled: the prompts may be added after all, so abort them
            self.loop.abort(self.stream)
            raise
        first, self.backlog = items[0], items[1:]
        if first is not ACCEPTED:
            self.num_open = 0
            error = first.error
            if isinstance(error, (ValueError, TypeError)):
                raise ApiError(400, str(error), code="invalid_request")
            raise ApiError(503, str(error), code="unavailable")

    async def __aiter__(self) -> AsyncIterator[list[Delta]]:
        while self.num_open:
            items, self.backlog = self.backlog or await self.stream.get(), []
            deltas = [delta for item in per_choice(items) if (delta := self._delta(*item)) is not None]
            if deltas:
                yield deltas

    def _delta(
        self, index: int, token_ids: list[int], finish: Finish | None, logprobs, prompt_logprobs
    ) -> Delta | None:
        if self.finishes[index] is not None:  # ended by a stop string before the engine saw it
            return None
        metrics = self.metrics
        if metrics is not None and token_ids and not self.num_output_tokens[index]:
            # here, as where vLLM's frontend processes the engine's output: what the client waits for
            metrics.observe_first_token(len(self.choices[index].token_ids), time.perf_counter() - self.received)
        self.num_output_tokens[index] += len(token_ids)
        text, stopped = self.texts[index].push(token_ids, last=finish is not None)
        if stopped:
            if finish is None:
                self.loop.abort(self.stream, index, reason="stop")
                finish = Finish("stop")
            elif finish.reason == "length":
                finish.reason = "stop"
        if finish is not None:
            self.finishes[index] = finish
            self.num_open -= 1
            if metrics is not None:
                metrics.observe_e2e(time.perf_counter() - self.received)
        return Delta(index, text, token_ids, finish, logprobs, prompt_logprobs)

    def close(self) -> None:
        if self.num_open:
            self.num_open = 0
            self.loop.abort(self.stream)

    def usage(self) -> dict:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)  # once a prompt, whatever its n
        completion_tokens = sum(self.num_output_tokens)
        cached = sum(f.num_cached_tokens for f in self.finishes if f is not None)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def finish_stats(finish: Finish) -> dict:
    """The engine's figures for a finished choice (an extension field, "stats")."""
    return {
        "queue_s": finish.queue_s,
        "num_cached_tokens": finish.num_cached_tokens,
        "num_preemptions": finish.num_preemptions,
    }


def error_of(finish: Finish) -> ApiError:
    """The error a failed choice is answered with: 400 when the request's own fields made the
    scheduler policy fail (PolicyError), 500 when the engine failed."""
    message = finish.error or "the request failed"
    if message.startswith("PolicyError"):
        return ApiError(400, message, "metadata", "policy_error")
    return ApiError(500, message, code="engine_error")


class EventStream(StreamingResponse):
    """Server-sent events that stop, and close their source, the moment the client disconnects:
    the source's cleanup (aborting the engine requests) runs then, not when a later send fails."""

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tasks:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    finally:
                        tasks.cancel_scope.cancel()

                tasks.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tasks.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()  # runs the source's cleanup now, whatever ended the stream


async def disconnected(receive) -> None:
    """Returns once the client has gone (after the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# Tokenizing takes time in proportion to the text and releases the GIL: past this many characters a
# request is tokenized on a worker thread, so that one huge prompt does not stall every other
# stream for seconds; below it the hand-over to a thread would cost more than the work.
TOKENIZE_ON_THREAD_CHARS = 8192
# Likewise a body of this many bytes or more is parsed (JSON, then the fields' checks) on a worker thread.
PARSE_ON_THREAD_BYTES = 65536


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; ApiError 413 when it is larger than limit, before it is read when its
    Content-Length says so, else as soon as that many bytes have come."""
    try:
        declared = int(request.headers.get("content-length", "0"))
    except ValueError:
        declared = 0
    if declared > limit:
        raise body_too_large(declared, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(size, limit, at_least=True)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(size: int, limit: int, at_least: bool = False) -> ApiError:
    return ApiError(
        413,
        f"the request body has {'more than ' if at_least else ''}{size - at_least} bytes, more than "
        f"serve.max_body_bytes={limit}",
        code="body_too_large",
        headers={"connection": "close"},  # the rest of it is never read
    )


async def parsed(raw: bytes, body_class):
    """parse_body, on a worker thread for a large body (a 38 MB one took the event loop 6 s)."""
    if len(raw) < PARSE_ON_THREAD_BYTES:
        return parse_body(raw, body_class)
    return await anyio.to_thread.run_sync(parse_body, raw, body_class)


async def tokenized(num_chars: int, prepare: Callable[[], list[Prompt]]) -> list[Prompt]:
    """prepare() (which tokenizes and checks a request's prompts) on this thread, or on a worker
    thread for a request of num_chars characters or more."""
    if num_chars < TOKENIZE_ON_THREAD_CHARS:
        return prepare()
    return await anyio.to_thread.run_sync(prepare)


def mean_logprob(entries: list) -> float:
    """The mean logprob of a completion's tokens (best_of's ranking); -inf for none."""
    return sum(entry[0] for entry in entries) / len(entries) if entries else float("-inf")


def prompt_text(tokenizer, prompt: Prompt) -> str:
    """A completion prompt's text, as echo returns it."""
    return tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Responder:
    """Turns a Generation into OpenAI's response for one endpoint (completions or chat)."""

    def __init__(self, body: GenerationBody, model: ServedModel, chat: bool):
        self.body = body
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model.name
        self.object = "chat.completion" if chat else "text_completion"
        self.tokenizer = model.tokenizer
        self.echo = not chat and body.echo
        self.formatter = LogprobsFormatter(model.tokenizer) if body.num_logprobs() is not None else None
        self.n = body.n or 1
        generated = self.n if chat else body.num_generated()
        self.best_of = generated if generated != self.n else None  # then the best n of each prompt's are returned
        self.text_offsets: dict[int, int] = {}  # a streamed completion choice's text offset so far
        self.echoed: set[int] = set()  # streamed choices whose prompt was sent

    def _logprobs(self, delta: Delta, prompt: Prompt | None):
        """The choice's logprobs object for the delta's tokens (and the prompt's, when echoed)."""
        if self.formatter is None or delta.logprobs is None:
            return None
        if self.chat:
            return {"content": self.formatter.chat(delta.token_ids, delta.logprobs)}
        token_ids, entries = delta.token_ids, delta.logprobs
        if prompt is not None:
            prompt_entries = delta.prompt_logprobs or [None] * len(prompt.token_ids)
            token_ids, entries = prompt.token_ids + token_ids, prompt_entries + entries
        body, self.text_offsets[delta.index] = self.formatter.completion(
            token_ids, entries, self.text_offsets.get(delta.index, 0)
        )
        return body

    def _choice(self, delta: Delta, stream: bool, prompt: Prompt | None = None) -> dict:
        """One choice of a chunk or of the whole response; prompt: the choice's prompt, to echo."""
        finish = delta.finish
        reason = None if finish is None else finish.reason
        logprobs = self._logprobs(delta, prompt)
        if not self.chat:
            text = delta.text if prompt is None else prompt_text(self.tokenizer, prompt) + delta.text
            choice = {"index": delta.index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        elif stream:
            content = {"content": delta.text} if delta.text or finish is None else {}
            choice = {"index": delta.index, "delta": content, "logprobs": logprobs, "finish_reason": reason}
        else:
            message = {"role": "assistant", "content": delta.text}
            choice = {"index": delta.index, "message": message, "logprobs": logprobs, "finish_reason": reason}
        if self.body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        if finish is not None:
            choice["stats"] = finish_stats(finish)
        return choice

    def _chunk(self, choices: list[dict], **extra) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    async def stream(self, generation: Generation) -> AsyncIterator[str]:
        """The server-sent events: a chunk per choice per update (empty text skipped unless token
        ids were asked for), the usage when stream_options.include_usage, then [DONE]."""
        options = self.body.stream_options
        continuous = options is not None and options.continuous_usage_stats

        def chunk(choice: dict) -> str:
            return sse(self._chunk([choice], usage=generation.usage()) if continuous else self._chunk([choice]))

        try:
            if self.chat:
                for index in range(len(generation.choices)):
                    first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                    yield chunk({**first, "finish_reason": None})
            want_ids = self.body.return_token_ids
            async for deltas in generation:
                for delta in deltas:
                    if delta.finish is not None and delta.finish.reason == "error":
                        yield sse(error_of(delta.finish).body())
                    elif (
                        delta.text
                        or delta.finish is not None
                        or (want_ids and delta.token_ids)
                        or delta.logprobs
                        or (self.echo and delta.index not in self.echoed)
                    ):
                        prompt = None
                        if self.echo and delta.index not in self.echoed:
                            self.echoed.add(delta.index)
                            prompt = generation.choices[delta.index]
                        yield chunk(self._choice(delta, stream=True, prompt=prompt))
            if options is not None and options.include_usage:
                yield sse(self._chunk([], usage=generation.usage()))
            yield "data: [DONE]\n\n"
        finally:
            generation.close()

    async def whole(self, generation: Generation) -> dict:
        """The complete response, once every choice has finished."""
        num_choices = len(generation.choices)
        texts = [[] for _ in range(num_choices)]
        token_ids = [[] for _ in range(num_choices)]
        wanted = self.formatter is not None or self.best_of is not None
        logprobs = [[] if wanted else None for _ in range(num_choices)]
        prompt_logprobs = [None] * num_choices
        finishes: list[Finish | None] = [None] * num_choices
        async for deltas in generation:
            for delta in deltas:
                texts[delta.index].append(delta.text)
                token_ids[delta.index] += delta.token_ids
                finishes[delta.index] = delta.finish
                if delta.logprobs is not None and logprobs[delta.index] is not None:
                    logprobs[delta.index] += delta.logprobs
                prompt_logprobs[delta.index] = prompt_logprobs[delta.index] or delta.prompt_logprobs
        for finish in finishes:
            if finish is not None and finish.reason == "error":
                raise error_of(finish)
        order = list(range(num_choices))
        if self.best_of is not None:  # each prompt's n completions of highest mean logprob, best first
            order = [
                i
                for start in range(0, num_choices, self.best_of)
                for i in sorted(range(start, start + self.best_of), key=lambda i: -mean_logprob(logprobs[i]))[: self.n]
            ]
        choices = [
            self._choice(
                Delta(
                    index,
                    "".join(texts[i]),
                    token_ids[i],
                    finishes[i],
                    logprobs[i] if self.formatter is not None else None,
                    prompt_logprobs[i],
                ),
                stream=False,
                prompt=generation.choices[i] if self.echo else None,
            )
            for index, i in enumerate(order)
        ]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": generation.usage()}  # fmt: skip


# Seconds a client refused with 429 is told to wait (Retry-After): about a batch's worth of decode
# steps, time enough for some running requests to finish and waiting ones to be admitted.
RETRY_AFTER_S = 1

# The request bodies the POST endpoints read themselves (to answer bad input with OpenAI's errors),
# declared for the OpenAPI schema, which cannot see them in the handlers' signatures.
REQUEST_BODIES: tuple[type[BaseModel], ...] = (CompletionBody, ChatBody, TokenizeBody, DetokenizeBody)


def body_schema(body_class: type[BaseModel]) -> dict:
    """openapi_extra for a route whose handler reads body_class (one of REQUEST_BODIES) itself."""
    schema = {"$ref": f"#/components/schemas/{body_class.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def add_body_schemas(app: FastAPI) -> None:
    """Puts the JSON schemas of REQUEST_BODIES (and the models they use) among the OpenAPI
    document's components, where the routes' openapi_extra refers to them."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for body_class in REQUEST_BODIES:
            schema = body_class.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[body_class.__name__] = schema
        return document

    app.openapi = openapi


def model_card(model: ServedModel) -> dict:
    return {
        "id": model.name,
        "object": "model",
        "created": 0,
        "owned_by": "inferlab",
        "max_model_len": model.max_model_len,
        "vocab_size": model.vocab_size,
        "plugins": model.plugins,
    }


def build_app(
    loop: EngineLoop,
    model: ServedModel,
    metrics: ServerMetrics,
    *,
    api_key: str | None,
    max_queued_requests: int | None,
    draining: Callable[[], bool],
    max_body_bytes: int = 2**26,
    lifespan=None,
) -> FastAPI:
    """The FastAPI application over an engine loop. api_key: the bearer token /v1/ requires
    (None: none); max_queued_requests: past it, 429; draining: whether the server is shutting
    down (then 503 for new work); max_body_bytes: past it, 413."""
    app = FastAPI(title="inferlab", version=inferlab.__version__, lifespan=lifespan)
    expected = None if api_key is None else f"Bearer {api_key}".encode()

    def authorize(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise ApiError(
                401, "a valid API key is required: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        metrics.count_http_error(error.status)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's own errors: 404 for an unknown path, 405 for a method no route of the path
        takes (Allow lists those of every route of the path: Starlette's names only its first's)."""
        headers = error.headers
        if error.status_code == 405:
            path = request.url.path
            methods = {m for r in app.routes if isinstance(r, APIRoute) and r.path_regex.match(path) for m in r.methods}
            allow = ", ".join(sorted(methods))
            message = f"{request.method} is not allowed on {path}; allowed: {allow}"
            return await api_error(request, ApiError(405, message, headers={**(headers or {}), "Allow": allow}))
        return await api_error(request, ApiError(error.status_code, str(error.detail), headers=headers))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        return await api_error(request, ApiError(500, f"internal error: {type(error).__name__}: {error}"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if draining():
            return JSONResponse({"status": "shutting down"}, status_code=503, headers={"connection": "close"})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    # HEAD as well: monitors and load testers (aiperf) probe with it first. A route of its own, kept
    # out of the schema, where one route of two methods would give both operations one id.
    for path, handler in (("/health", health), ("/metrics", prometheus_metrics)):
        app.add_api_route(path, handler, methods=["HEAD"], include_in_schema=False)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": inferlab.__version__})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card(model)]})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
        authorize(request)
        if model_id != model.name:
            raise model_not_found(model_id, model)
        return JSONResponse(model_card(model))

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeBody))
    async def tokenize_endpoint(request: Request) -> JSONResponse:
        body = await parsed(await read_body(request, max_body_bytes), TokenizeBody)
        check_model(body, model)
        num_chars = len(body.prompt or "") + sum(len(message.content) for message in body.messages or ())
        return JSONResponse(await tokenized(num_chars, lambda: tokenize(body, model)))

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeBody))
    async def detokenize_endpoint(request: Request) -> JSONResponse:
        body = await parsed(await read_body(request, max_body_bytes), DetokenizeBody)
        check_model(body, model)
        return JSONResponse(detokenize(body, model))

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionBody))
    async def completions(request: Request) -> Response:
        received = time.perf_counter()  # TTFT and e2e start here, before the body is read and tokenized
        authorize(request)
        refuse_when_draining()
        body = await parsed(await read_body(request, max_body_bytes), CompletionBody)
        check_model(body, model)
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        num_chars = sum(len(text) for text in texts if isinstance(text, str))
        prompts = await tokenized(
            num_chars, lambda: engine_prompts(body, completion_token_ids(body, model), model, max_tokens)
        )
        return await respond(request, Responder(body, model, chat=False), prompts, received)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatBody))
    async def chat_completions(request: Request) -> Response:
        received = time.perf_counter()
        authorize(request)
        refuse_when_draining()
        body = await parsed(await read_body(request, max_body_bytes), ChatBody)
        check_model(body, model)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        num_chars = sum(len(message.content) for message in body.messages)
        prompts = await tokenized(
            num_chars, lambda: engine_prompts(body, [chat_token_ids(body, model)], model, max_tokens)
        )
        return await respond(request, Responder(body, model, chat=True), prompts, received)

    def refuse_when_draining() -> None:
        if draining():
            raise ApiError(503, "the server is shutting down", code="unavailable", headers={"connection": "close"})

    async def respond(request: Request, responder: Responder, prompts: list[Prompt], received: float) -> Response:
        refuse_when_draining()
        if max_queued_requests is not None and len(prompts) > max_queued_requests:
            raise ApiError(
                400,
                f"prompt: {len(prompts)} prompts in one request, more than may wait for admission at once "
                f"(serve.max_queued_requests={max_queued_requests}); send at most that many a request",
                "prompt",
                "too_many_prompts",
            )
        if max_queued_requests is not None and loop.num_queued() + len(prompts) > max_queued_requests:
            raise ApiError(
                429,
                f"too many requests are waiting (serve.max_queued_requests={max_queued_requests}); retry later",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        generation = Generation(loop, prompts, model.tokenizer, received)
        await generation.start()
        if responder.body.stream:
            return EventStream(responder.stream(generation))
        whole = asyncio.ensure_future(responder.whole(generation))
        gone = asyncio.ensure_future(disconnected(request.receive))
        try:
            await asyncio.wait((whole, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not whole.done():  # the client left (or this handler was cancelled): free the engine's work
                whole.cancel()
                generation.close()
        if not whole.done() or whole.cancelled():
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(whole.result())

    add_body_schemas(app)
    return app
