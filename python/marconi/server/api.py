"""HTTP routes: the OpenAI-compatible API over an ``AsyncEngine``.

Every error is an OpenAI-style ``{"error": {...}}`` body with a 4xx status (5xx only for a fault
while serving a request, which fails that request alone, and for overload: 503 + ``Retry-After``
when more than ``--max-queued-requests`` wait, when a request waited past ``--queue-timeout``, or
while shutting down); the server keeps serving after any bad request. A client that disconnects
(mid-stream, while queued, or while waiting for a non-streamed answer) gets its request aborted,
which frees its memory and pins in the engine.

A request's HTTP status is only sent once its first output is there (a token, or its end), so a
streamed request that times out or fails before its first token still gets a proper status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from marconi.engine.chat import ChatTemplate, Message
from marconi.engine.engine import RequestError
from marconi.engine.heap import heap_stats
from marconi.server import protocol as P
from marconi.server.guard import BearerAuth, ClientGone, Limits, read_json
from marconi.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from marconi.engine.async_engine import AsyncEngine
    from marconi.engine.request import StepOutput

log = logging.getLogger("marconi.server")
_POLL_S = 0.5  # how often a waiting request checks whether its client is still there


class _Failure(NamedTuple):
    status: int
    code: str
    message: str


#: How a request that ended without an answer is reported (``StepOutput.finish_reason``).
_FAILURES = {
    "error": _Failure(500, "engine_error", "the engine failed while serving this request"),
    "timeout": _Failure(503, "queue_timeout", "the request waited too long to be scheduled"),
    "shutdown": _Failure(503, "shutting_down", "the server is shutting down"),
    "abort": _Failure(503, "aborted", "the request was aborted"),
}


@dataclass
class _Ctx:
    engine: AsyncEngine
    model_name: str
    template: ChatTemplate
    metrics: ServerMetrics
    limits: Limits


def create_app(
    engine: AsyncEngine, model_name: str, template: ChatTemplate, limits: Limits | None = None
) -> FastAPI:
    """The FastAPI app; the caller starts and stops ``engine`` (see ``launch_server``)."""
    app = FastAPI(title="marconi", docs_url=None, redoc_url=None)
    ctx = _Ctx(engine, model_name, template, ServerMetrics(), limits or Limits())
    if ctx.limits.api_key:
        app.add_middleware(BearerAuth, api_key=ctx.limits.api_key)

    @app.exception_handler(P.APIError)
    async def _api_error(_: Request, e: P.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(404)
    async def _not_found(request: Request, _: Exception) -> JSONResponse:
        err = P.APIError(f"no route {request.url.path}", 404, "not_found")
        return JSONResponse(err.body(), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(request: Request, _: Exception) -> JSONResponse:
        err = P.APIError(f"method {request.method} not allowed", 405, "method_not_allowed")
        return JSONResponse(err.body(), status_code=405)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "marconi"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await engine.call(lambda e: e.stats())
        return PlainTextResponse(ctx.metrics.render(stats), media_type=ctx.metrics.content_type)

    @app.get("/debug/cache")
    async def debug_cache() -> JSONResponse:
        """Cache sizes, a deep integrity check (run between engine steps) and what a learning
        admission has learned (the candidate kinds it admits, credited tokens per proposal)."""

        def check(e: Any) -> dict[str, Any]:
            try:
                e.check_integrity()
                ok, error = True, None
            except AssertionError as err:
                ok, error = False, str(err)
            s = e.stats()
            return {
                "ok": ok,
                "error": error,
                "running": s.running,
                "waiting": s.waiting,
                "admission": e.cache.admission.learned(),
            }

        out = await engine.call(check)
        out["size"] = (await engine.call(lambda e: e.stats().size))._asdict()
        return JSONResponse(out, status_code=200 if out["ok"] else 500)

    @app.get("/debug/memory")
    async def debug_memory() -> dict[str, Any]:
        """RSS and glibc's heap figures (MB), and what the heap trimmer gave back."""
        trimmer = engine.trimmer
        return {**heap_stats()._asdict(), "trimmer": trimmer and trimmer.report()}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = P.parse(P.CompletionRequest, await read_json(request, ctx.limits))
        _check_model(ctx, req.model)
        prompt = req.single_prompt()
        ids = _encode(ctx, prompt) if isinstance(prompt, str) else list(prompt)
        return await _serve(ctx, request, req, ids, req.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = P.parse(P.ChatCompletionRequest, await read_json(request, ctx.limits))
        _check_model(ctx, req.model)
        if not req.messages:
            raise P.APIError("messages must not be empty", param="messages", code="empty_messages")
        msgs = [Message(m.role, m.text()) for m in req.messages]
        ids = _encode(ctx, ctx.template.render(msgs))
        return await _serve(ctx, request, req, ids, req.effective_max_tokens(), chat=True)

    return app


def _check_model(ctx: _Ctx, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise P.APIError(
            f"the model {model!r} does not exist; this server serves {ctx.model_name!r}",
            404,
            "model_not_found",
            "model",
        )


def _encode(ctx: _Ctx, text: str) -> list[int]:
    try:  # lone surrogates from \\ud800-style JSON escapes: checked here, since tokenizers
        text.encode("utf-8")  # differ in how they fail on them (UnicodeEncodeError, TypeError)
    except UnicodeEncodeError:
        raise P.APIError("the text is not valid Unicode", code="invalid_utf8") from None
    return ctx.engine.engine.tokenizer.encode(text)


async def _serve(
    ctx: _Ctx, request: Request, body: Any, ids: list[int], max_tokens: int | None, chat: bool
) -> Response:
    params = body.sampling_params(max_tokens)
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    try:
        req = ctx.engine.engine.make_request(ids, params, rid)
    except RequestError as e:
        raise P.APIError(str(e), code=e.code, param=e.param) from None
    _admit(ctx)
    reader = _Reader(ctx, request, rid, ctx.engine.submit(req))
    ctx.metrics.started()
    first = await reader.next()
    if first is None:
        return Response(status_code=499)  # the client went away (nobody reads this)
    if first.finished and first.finish_reason in _FAILURES:
        ctx.metrics.finished(first.finish_reason, time.perf_counter() - reader.start)
        return _failure_response(ctx, first)
    if body.stream:
        gen = _stream(ctx, reader, first, chat, body.include_usage)
        return StreamingResponse(gen, media_type="text/event-stream")
    return await _collect(ctx, reader, first, chat)


def _admit(ctx: _Ctx) -> None:
    """503 + ``Retry-After`` when ``max_queued_requests`` requests already wait."""
    cap = ctx.limits.max_queued_requests
    if cap is not None and ctx.engine.num_queued() >= cap:
        ctx.metrics.rejected.labels("queue_full").inc()
        raise P.APIError(
            f"the server is overloaded ({cap} requests queued); retry later",
            503,
            "server_overloaded",
            type="server_error",
            headers={"Retry-After": str(ctx.limits.retry_after)},
        )


def _failure(ctx: _Ctx, out: StepOutput) -> P.APIError:
    f = _FAILURES[out.finish_reason or "error"]
    if out.finish_reason == "timeout":
        ctx.metrics.timed_out.inc()
    msg = f.message + (f" ({out.error}); other requests were not affected" if out.error else "")
    headers = {"Retry-After": str(ctx.limits.retry_after)} if f.status == 503 else None
    return P.APIError(msg, f.status, f.code, type="server_error", headers=headers)


def _failure_response(ctx: _Ctx, out: StepOutput) -> JSONResponse:
    err = _failure(ctx, out)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _Reader:
    """A request's outputs as its handler reads them, with the client checked by the clock
    (every ``_POLL_S``, also while tokens keep coming) and TTFT/ITL observed."""

    def __init__(self, ctx: _Ctx, request: Request, rid: str, queue: asyncio.Queue) -> None:
        self.ctx, self.request, self.rid, self.queue = ctx, request, rid, queue
        self.start = time.perf_counter()
        self.timer = _Timer(ctx.metrics, self.start)
        self.next_check = self.start + _POLL_S

    async def next(self) -> StepOutput | None:
        """The next output; None (and the request aborted) if the client went away."""
        while True:
            try:
                out: StepOutput | None = await asyncio.wait_for(self.queue.get(), _POLL_S)
            except TimeoutError:
                out = None
            if time.perf_counter() >= self.next_check:
                self.next_check = time.perf_counter() + _POLL_S
                if await self.request.is_disconnected():
                    _client_gone(self.ctx, self.rid)
                    return None
            if out is not None:
                self.timer.token(out)
                return out


def _client_gone(ctx: _Ctx, rid: str) -> None:
    ctx.engine.abort(rid)
    ctx.metrics.finished("abort", None)
    log.debug("%s: client went away; aborted", rid)


async def _collect(ctx: _Ctx, reader: _Reader, out: StepOutput, chat: bool) -> Response:
    text = [out.text]
    while not out.finished:
        nxt = await reader.next()
        if nxt is None:
            return Response(status_code=499)
        out = nxt
        text.append(out.text)
    ctx.metrics.finished(out.finish_reason, time.perf_counter() - reader.start)
    if out.finish_reason in _FAILURES:
        return _failure_response(ctx, out)
    use = P.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
    choice = P.choice("".join(text), out.finish_reason, chat, chunk=False)
    return JSONResponse(P.completion_body(reader.rid, ctx.model_name, choice, chat, False, use))


async def _stream(
    ctx: _Ctx, reader: _Reader, out: StepOutput, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    """SSE events from the first output ``out`` on; if the client goes away, Starlette cancels
    this generator and the ``finally`` aborts the request."""
    name, rid, done = ctx.model_name, reader.rid, False

    def event(choice: dict, use: dict | None = None) -> str:
        return f"data: {json.dumps(P.completion_body(rid, name, choice, chat, True, use))}\n\n"

    try:
        if chat:
            yield event(P.choice("", None, chat, chunk=True, role=True))
        while True:
            if out.finished:
                done = True
                ctx.metrics.finished(out.finish_reason, time.perf_counter() - reader.start)
                if out.finish_reason in _FAILURES:
                    yield f"data: {json.dumps(_failure(ctx, out).body())}\n\n"
                else:
                    yield event(P.choice(out.text, out.finish_reason, chat, chunk=True))
                    if include_usage:
                        use = P.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
                        yield event({}, use)
                break
            if out.text:
                yield event(P.choice(out.text, None, chat, chunk=True))
            out = await reader.queue.get()
            reader.timer.token(out)
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            _client_gone(ctx, rid)


class _Timer:
    """TTFT and inter-token latency as the client sees them (arrival -> token events)."""

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self.metrics, self.last, self.first = metrics, start, True

    def token(self, out: StepOutput) -> None:
        if not out.token_ids:
            return
        now = time.perf_counter()
        if self.first:
            self.metrics.ttft.observe(now - self.last)
        else:
            self.metrics.itl.observe(now - self.last)
        self.first, self.last = False, now
