"""The FastAPI app: OpenAI routes over one engine, plus /health and /metrics.

Every error leaves as OpenAI-style JSON `{"error": {message, type, param, code}}` with a 4xx
status for bad input (FastAPI's 422 validation errors become 400, as OpenAI answers them).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import traceback
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import Metrics
from .schemas import (MAX_STOP, MAX_STOP_CHARS, ApiError, ChatCompletionRequest, CompletionRequest,
                      GenerationRequest, chat_chunk, chat_response, completion_response, error_body, new_id, usage)
from .jobs import Done, Job, ServeConfig
from .worker import Worker

CHARS_PER_TOKEN_BOUND = 64  # a prompt longer than this many chars per allowed token is refused untokenised
ERROR_RESPONSES = {400: {"description": "bad request (OpenAI-style JSON error)"},
                   401: {"description": "missing or wrong API key"},
                   404: {"description": "unknown model"},
                   429: {"description": "too many queued requests"}}


class ClientGone(Exception):
    """The client disconnected while its request was waiting or generating."""


class BearerAuth:
    """Pure ASGI middleware: /v1/* needs `Authorization: Bearer <key>` (checked before the body)."""

    def __init__(self, app, key: str, metrics: Metrics):
        self.app, self.key, self.metrics = app, key.encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and not self._authorised(scope):
            self.metrics.record_error(401)
            body = error_body("invalid or missing API key (send 'Authorization: Bearer <key>')",
                              "invalid_request_error", None, "invalid_api_key")
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorised(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


def create_app(engine, config: ServeConfig) -> FastAPI:
    metrics = Metrics(config.model_name)
    worker = Worker(engine, config, metrics)
    max_context = engine.target.max_length

    @asynccontextmanager
    async def lifespan(_app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="treeflash", summary="OpenAI-compatible speculative decoding server",
                  lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.config = worker, metrics, config
    if config.api_key:
        app.add_middleware(BearerAuth, key=config.api_key, metrics=metrics)
    _add_error_handlers(app, metrics)

    # ---- building a job from a request ----
    def make_job(req: GenerationRequest, prompt, chat: bool, param: str) -> Job:
        if req.model is not None and req.model != config.model_name:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves {config.model_name!r}",
                           param="model", code="model_not_found")
        gen = req.generation_config(config.generation)
        if gen.max_new_tokens > config.max_tokens_limit:
            raise ApiError(400, f"max_tokens is {gen.max_new_tokens}; this server allows at most "
                           f"{config.max_tokens_limit}", param="max_tokens", code="max_tokens_too_large")
        if len(gen.stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in gen.stop):
            raise ApiError(400, f"at most {MAX_STOP} stop sequences of at most {MAX_STOP_CHARS} characters",
                           param="stop")
        _check_prompt_size(prompt, config.max_prompt_tokens or max_context, param)
        _check_unicode(prompt, param)
        _check_unicode(list(gen.stop), "stop")
        return Job(prompt=prompt, chat=chat, param=param, config=gen, loop=asyncio.get_running_loop())

    async def start(job: Job, request: Request):
        """Queue the job and wait for its first event; errors before the first token raise."""
        worker.submit(job)
        try:
            first = await next_event(job, request)
        except ClientGone:
            raise ApiError(499, "client closed the request") from None
        if first[0] == "error":
            raise first[1]
        return first

    # ---- routes ----
    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        messages = [m.as_template_dict() for m in body.messages]
        job = make_job(body, messages, chat=True, param="messages")
        rid, include_usage = new_id("chatcmpl"), bool(body.stream_options and body.stream_options.include_usage)
        first = await start(job, request)
        if body.stream:
            return sse(chat_events(rid, job, first, include_usage))
        text, done = await collect(job, request, first)
        return chat_response(rid, config.model_name, text, done.finish_reason, _usage(done))

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        prompt = _completion_prompt(body.prompt, engine.target.vocab_rows)
        job = make_job(body, prompt, chat=False, param="prompt")
        rid, include_usage = new_id("cmpl"), bool(body.stream_options and body.stream_options.include_usage)
        first = await start(job, request)
        if body.stream:
            return sse(completion_events(rid, job, first, include_usage))
        text, done = await collect(job, request, first)
        return completion_response(rid, config.model_name, text, done.finish_reason, _usage(done))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "treeflash", "max_model_len": max_context}]}

    @app.get("/health")
    async def health():
        if not worker.thread.is_alive():
            return JSONResponse({"status": "worker stopped"}, status_code=503)
        running, waiting = worker.load()
        return {"status": "ok", "model": config.model_name, "running": running, "waiting": waiting}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- streaming ----
    async def chat_events(rid: str, job: Job, first, include_usage: bool) -> AsyncIterator[dict]:
        model = config.model_name
        yield chat_chunk(rid, model, {"role": "assistant", "content": ""})
        async for kind, value in events_from(job, first):
            if kind == "text":
                yield chat_chunk(rid, model, {"content": value})
            else:
                yield chat_chunk(rid, model, {}, finish=value.finish_reason)
                if include_usage:
                    yield chat_chunk(rid, model, {}, use=_usage(value), empty=True)

    async def completion_events(rid: str, job: Job, first, include_usage: bool) -> AsyncIterator[dict]:
        model = config.model_name
        async for kind, value in events_from(job, first):
            if kind == "text":
                yield completion_response(rid, model, value, None, None)
            else:
                yield completion_response(rid, model, "", value.finish_reason, None)
                if include_usage:
                    yield completion_response(rid, model, "", None, _usage(value), empty=True)

    return app


# ---- helpers (no closures needed) ----
async def next_event(job: Job, request: Request, poll_s: float = 0.25):
    """The job's next event; cancels the job and raises ClientGone if the client disconnects.

    The connection is checked at least every `poll_s` seconds, also while events keep coming.
    """
    while True:
        now = time.monotonic()
        if now - job.checked_at >= poll_s:
            job.checked_at = now
            if await request.is_disconnected():
                job.cancel()
                raise ClientGone()
        try:
            return await asyncio.wait_for(job.events.get(), timeout=poll_s)
        except asyncio.TimeoutError:
            continue


async def collect(job: Job, request: Request, first) -> tuple[str, Done]:
    """Gather a whole answer (non-streamed requests)."""
    pieces, event = [], first
    try:
        while event[0] == "text":
            pieces.append(event[1])
            event = await next_event(job, request)
    except ClientGone:
        raise ApiError(499, "client closed the request") from None
    if event[0] == "error":
        raise event[1]
    return "".join(pieces), event[1]


async def events_from(job: Job, first) -> AsyncIterator[tuple]:
    """text events, then one `done` event; raises the job's ApiError if it fails mid-way.

    If the client disconnects, Starlette cancels the stream: `finally` stops the generation.
    """
    event = first
    try:
        while True:
            if event[0] == "error":
                raise event[1]
            yield event
            if event[0] == "done":
                return
            event = await job.events.get()
    finally:
        job.cancel()


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except ApiError as e:  # headers are sent already: report the error in-band
            yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _usage(done: Done) -> dict:
    return usage(done.prompt_tokens, done.completion_tokens, done.tau)


def _completion_prompt(prompt, vocab: int):
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, f"one prompt per request is supported, got {len(prompt)}", param="prompt")
        return prompt[0]
    if isinstance(prompt, list):
        if not prompt:
            raise ApiError(400, "empty prompt", param="prompt")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
    return prompt


def _check_prompt_size(prompt, max_tokens: int, param: str) -> None:
    """Refuse absurdly long prompts before tokenising them (the exact check runs in the worker)."""
    if isinstance(prompt, str):
        n = len(prompt)
    elif prompt and isinstance(prompt[0], dict):
        n = sum(len(m["content"]) for m in prompt)
    else:
        if len(prompt) > max_tokens:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; at most {max_tokens} are allowed",
                           param=param, code="context_length_exceeded")
        return
    if n > CHARS_PER_TOKEN_BOUND * max_tokens:
        raise ApiError(400, f"the prompt has {n} characters, far over the {max_tokens}-token limit",
                       param=param, code="context_length_exceeded")


def _check_unicode(value, param: str) -> None:
    """Lone surrogates (legal in JSON escapes, not in UTF-8) would break the tokenizer: refuse them."""
    texts = [value] if isinstance(value, str) else [m["content"] if isinstance(m, dict) else m for m in value]
    for text in texts:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, "text contains invalid Unicode (a lone surrogate escape)", param=param) from None


def _is_type_tag(part) -> bool:
    """pydantic names the union member in an error location ('str', 'list[int]', 'TextPart'): drop it."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "dict", "list"} or "[" in part
                                      or part[:1].isupper())


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    def answer(status: int, body: dict) -> JSONResponse:
        metrics.record_error(status)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        return answer(e.status, e.body())

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_type_tag(x)]
        where = ".".join(loc) if first.get("type") != "json_invalid" else ""
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        if first.get("type") == "json_invalid":
            message = f"request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more)"
        return answer(400, error_body(message, "invalid_request_error", where or None, first.get("type")))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return answer(e.status_code, error_body(str(e.detail), kind, None, None))

    @app.exception_handler(Exception)
    async def internal_error(_request, e: Exception):
        traceback.print_exception(e, file=sys.stderr)  # a bug: keep its trace in the server log
        return answer(500, error_body(f"internal error: {type(e).__name__}", "server_error", None, None))
