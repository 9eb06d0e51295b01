"""The OpenAI-compatible HTTP front of a ServingEngine (FastAPI; ``python -m apps.serve``).

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (where the tokenizer
carries a chat template), both streamed by server-sent events with ``stream``,
``/health`` and ``/metrics`` (Prometheus text). Every request becomes one engine request
per prompt and choice, submitted through the one :class:`EngineLoop` that drives the
engine; the handler then waits for its events. A client that disconnects cancels its
requests, which frees their KV blocks before the next step.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with one
line of message: 400 for a bad request (malformed JSON included), 404 for an unknown model
or route, 405 for a wrong method, 413 for a body over the limit (refused before it is read
whole), 429 when the queue is full, 500 when the chat template fails, 503 once the engine
has stopped. Prompts are tokenized (and chats rendered) on a worker thread, so a long one
does not hold up the other requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from apps.serving import responses
from apps.serving.driver import EngineLoop, ServerMetrics
from apps.serving.engine import ServingEngine
from apps.serving.protocol import BadRequest, ChatBody, CompletionBody
from apps.serving.requests import Refused
from apps.serving.requests import Request as EngineRequest
from apps.serving.responses import Choice
from apps.serving.text import TemplateFailed, TextCodec

STATUS = {"queue_full": 429, "unavailable": 503, "model_not_found": 404}  # other codes: 400
DISCONNECT_POLL_S = 0.1  # how often a waiting non-streamed request checks its client
MAX_BODY_BYTES = 16 * 2**20  # the default request body limit (--max-body-mb 16)
ROUTES = "/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics"
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


class ApiError(Exception):
    """An error answer: HTTP status, one-line message, OpenAI error code."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _error(status: int, message: str, code: str, headers=None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    # A lone surrogate echoed from the request (a field's name) cannot be encoded as UTF-8.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _one_line(err: RequestValidationError) -> str:
    """The first validation error as ``field: what is wrong``."""
    first = err.errors()[0]
    if first.get("type") == "json_invalid":  # loc: ("body", the offset)
        where = first.get("loc", (None, "?"))[-1]
        why = (first.get("ctx") or {}).get("error", first.get("msg"))
        return f"the body is not valid JSON: {why} (at character {where})"
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 before it is read whole.

    A Content-Length over the limit is refused without reading any of the body (the
    server never hands an app more than the Content-Length). A body without one (chunked)
    is read here up to the limit, refused as soon as it passes it, and otherwise handed on
    as one message."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, size: int | None) -> JSONResponse:
        limit = f"the limit of {self.max_bytes} bytes (--max-body-mb)"
        said = "passes" if size is None else f"is {size} bytes, over"
        return _error(413, f"the request body {said} {limit}", "body_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lengths = [v for k, v in scope.get("headers", ()) if k.lower() == b"content-length"]
        if lengths:
            with contextlib.suppress(ValueError):
                if int(lengths[0]) > self.max_bytes:
                    await self._too_large(int(lengths[0]))(scope, receive, send)
                    return
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: nobody to answer
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(None)(scope, receive, send)
                return
            more = message.get("more_body", False)
        body = b"".join(chunks)
        handed = False

        async def replay():
            nonlocal handed
            if handed:
                return await receive()  # after the body: the disconnect, when it comes
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class Server:
    """The routes' state: the engine loop, the text codec and the served model's name."""

    def __init__(self, engine: ServingEngine, codec: TextCodec, model_name: str) -> None:
        self.engine, self.codec, self.model_name = engine, codec, model_name
        self.metrics = ServerMetrics(engine.cache.num_blocks)
        self.loop: EngineLoop | None = None  # made in the server's event loop (lifespan)

    def check_model(self, name: str) -> None:
        """404 unless ``name`` is the served model."""
        if name != self.model_name:
            raise ApiError(
                404,
                f"model {name!r} is not served here (only {self.model_name!r})",
                "model_not_found",
            )

    def room(self, prompt: list[int]) -> int:
        """New tokens a prompt can have: up to the context and what the whole cache holds."""
        cache, positions = self.engine.cache, self.engine.model.cfg.max_positions
        room = min(positions, cache.num_blocks * cache.block_size + 1) - len(prompt)
        if room <= 0:
            raise BadRequest(f"the prompt has {len(prompt)} tokens: no room left in {positions}")
        return room

    async def submit(self, prompts, limit, body, *, prompt_logprobs=False, top=0):
        """Submit every (prompt, choice) pair: the choices, in order, and their queue."""
        self.check_queue(prompts, limit, body.n, prompt_logprobs)
        samplings = body.samplings(len(prompts))
        stops = frozenset() if body.ignore_eos else self.codec.eos_ids
        requests, choices = [], []
        for k, ids in enumerate(prompts):
            max_tokens = self.room(ids) if limit is None else limit
            for sampling in samplings[k * body.n : (k + 1) * body.n]:
                request = EngineRequest(
                    ids,
                    max_tokens,
                    sampling,
                    stop_token_ids=stops,
                    top_logprobs=top,
                    prompt_logprobs=prompt_logprobs,
                )
                requests.append(request)
                choices.append(Choice(len(choices), ids, self.codec, body.stops))
        try:
            rids, queue = await self.loop.submit(requests)
        except Refused as refused:
            raise ApiError(STATUS.get(refused.code, 400), refused.reason, refused.code) from None
        for choice, rid in zip(choices, rids, strict=True):
            choice.request_id = rid
        return choices, queue

    def check_queue(self, prompts, limit, n: int, prompt_logprobs: bool) -> None:
        """400 when the request's sequences could never all wait at once: the queue takes
        a request's sequences all or none, so retrying (a 429) would never succeed."""
        # What the engine queues: all but max_tokens 0 without prompt scores (it ends them
        # at once, ServingEngine.submit).
        sequences = len(prompts) * n if (limit != 0 or prompt_logprobs) else 0
        most = self.engine.max_waiting
        if sequences > most:
            raise ApiError(
                400,
                f"this request is {len(prompts)} prompt(s) × n {n} = {sequences} sequences, "
                f"more than --max-waiting {most} lets wait at once: send at most {most} "
                f"(fewer prompts or a smaller n), or start the server with --max-waiting "
                f"{sequences} or more",
                "too_many_sequences",
            )

    async def events(self, choices: list[Choice], queue: asyncio.Queue) -> AsyncIterator:
        """``(choice, new text, new tokens)`` as events arrive, until every choice ends;
        whatever ends it early (a disconnect, an error) cancels the choices still running."""
        by_id = {c.request_id: c for c in choices}
        try:
            while any(c.finish_reason is None for c in choices):
                event = await queue.get()
                if isinstance(event, BaseException):
                    raise ApiError(503, f"the engine stopped: {event}", "unavailable")
                choice = by_id[event.request_id]
                if choice.finish_reason is None:
                    text, tokens = choice.take(event)
                    if choice.finish_reason == "stop" and event.finish_reason is None:
                        self.loop.cancel(choice.request_id)  # a stop string: free it now
                    yield choice, text, tokens
        finally:
            for choice in choices:
                if choice.finish_reason is None:
                    self.loop.cancel(choice.request_id)


async def _until_disconnect(request: Request, work):
    """Await ``work`` unless the client goes away first (then cancel it: None)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
    return task.result()


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def lines():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except ApiError as err:  # after the headers: the error goes in the stream
            yield f"data: {json.dumps({'error': {'message': err.message, 'code': err.code}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def build_app(
    engine: ServingEngine,
    codec: TextCodec,
    model_name: str,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI application serving ``engine`` as ``model_name``; a request body over
    ``max_body_bytes`` gets 413 (:class:`BodyLimit`)."""
    server = Server(engine, codec, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop = EngineLoop(engine, server.metrics)
        task = asyncio.create_task(server.loop.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    app = FastAPI(title="meshtron", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request, err: ApiError):
        return _error(err.status, err.message, err.code)

    @app.exception_handler(BadRequest)
    async def bad_request(request, err: BadRequest):
        return _error(400, str(err), "invalid_request")

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err: RequestValidationError):
        return _error(400, _one_line(err), "invalid_request")

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        """The router's 404 and 405, and FastAPI's 400 for a body it could not read."""
        where = f"{request.method} {request.url.path}"
        if err.status_code == 404:
            message = f"{where}: no such route (the routes: {ROUTES})"
        elif err.status_code == 405:
            allowed = (err.headers or {}).get("Allow", "")
            message = f"{where}: method not allowed (allowed: {allowed or 'none'})"
        elif err.status_code == 400 and err.__cause__ is not None:
            cause = err.__cause__
            message = f"the body could not be read as JSON: {type(cause).__name__}: {cause}"
        else:
            message = str(err.detail)
        code = HTTP_CODES.get(err.status_code, "invalid_request")
        return _error(err.status_code, " ".join(message.split()), code, err.headers)

    @app.exception_handler(TemplateFailed)
    async def template_failed(request, err: TemplateFailed):
        return _error(500, str(err), "chat_template_error")

    @app.exception_handler(Exception)
    async def internal(request, err: Exception):
        """Anything else (a bug): still the error shape, not a plain-text 500."""
        message = " ".join(f"internal error: {type(err).__name__}: {err}".split())
        return _error(500, message, "internal_error")

    @app.get("/health")
    async def health():
        failure = server.loop.failure if server.loop else "not started"
        if failure is not None:
            return _error(503, f"the engine stopped: {failure}", "unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return responses.model_list(model_name, engine.model.cfg.max_positions)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        server.check_model(body.model)
        body.check_unsupported()
        prompts = await asyncio.to_thread(body.prompts, codec.encode)
        echo_scores = body.echo and body.logprobs is not None
        top = body.logprobs or 0
        choices, queue = await server.submit(
            prompts, body.max_tokens, body, prompt_logprobs=echo_scores, top=top
        )
        shape = responses.CompletionShape(body, model_name, prompts)
        if body.stream:
            return _sse(shape.chunks(choices, server.events(choices, queue)))
        done = await _until_disconnect(request, _drain(server.events(choices, queue)))
        return shape.response(choices) if done else Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        server.check_model(body.model)
        body.check_unsupported()
        prompt = await asyncio.to_thread(_chat_prompt, codec, body)
        top = body.top_logprobs or 0 if body.logprobs else 0
        choices, queue = await server.submit([prompt], body.limit, body, top=top)
        shape = responses.ChatShape(body, model_name, prompt)
        if body.stream:
            return _sse(shape.chunks(choices, server.events(choices, queue)))
        done = await _until_disconnect(request, _drain(server.events(choices, queue)))
        return shape.response(choices) if done else Response(status_code=499)

    return app


def _chat_prompt(codec: TextCodec, body: ChatBody) -> list[int]:
    """The chat's prompt ids: its messages rendered by the template, then encoded."""
    messages = body.template_input()
    try:
        return codec.encode(codec.render_chat(messages), special_tokens=False)
    except ValueError as err:
        raise BadRequest(str(err)) from None


async def _drain(events: AsyncIterator) -> bool:
    async for _ in events:
        pass
    return True
