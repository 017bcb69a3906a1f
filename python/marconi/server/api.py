"""HTTP routes: the OpenAI-compatible API over an ``AsyncEngine``.

Every error is an OpenAI-style ``{"error": {...}}`` body with a 4xx status (5xx only for engine
failures); the server keeps serving after any bad request. A client that disconnects (mid-stream
or while waiting for a non-streamed answer) gets its request aborted, which frees its memory
and pins in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from marconi.engine.chat import ChatTemplate, Message
from marconi.engine.engine import RequestError
from marconi.server import protocol as P
from marconi.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from marconi.engine.async_engine import AsyncEngine
    from marconi.engine.request import Req, StepOutput

log = logging.getLogger("marconi.server")
_POLL_S = 0.5  # how often a non-streamed request checks whether its client is still there


@dataclass
class _Ctx:
    engine: AsyncEngine
    model_name: str
    template: ChatTemplate
    metrics: ServerMetrics


def create_app(engine: AsyncEngine, model_name: str, template: ChatTemplate) -> FastAPI:
    """The FastAPI app; the caller starts and stops ``engine`` (see ``launch_server``)."""
    app = FastAPI(title="marconi", docs_url=None, redoc_url=None)
    ctx = _Ctx(engine, model_name, template, ServerMetrics())

    @app.exception_handler(P.APIError)
    async def _api_error(_: Request, e: P.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

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
        """Cache sizes and a deep integrity check (run between engine steps)."""

        def check(e: Any) -> dict[str, Any]:
            try:
                e.check_integrity()
                ok, error = True, None
            except AssertionError as err:
                ok, error = False, str(err)
            s = e.stats()
            return {"ok": ok, "error": error, "running": s.running, "waiting": s.waiting}

        out = await engine.call(check)
        out["size"] = (await engine.call(lambda e: e.stats().size))._asdict()
        return JSONResponse(out, status_code=200 if out["ok"] else 500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = P.parse(P.CompletionRequest, await _json(request))
        _check_model(ctx, req.model)
        prompt = req.single_prompt()
        ids = _encode(ctx, prompt) if isinstance(prompt, str) else list(prompt)
        return await _serve(ctx, request, req, ids, req.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = P.parse(P.ChatCompletionRequest, await _json(request))
        _check_model(ctx, req.model)
        if not req.messages:
            raise P.APIError("messages must not be empty", param="messages", code="empty_messages")
        msgs = [Message(m.role, m.text()) for m in req.messages]
        ids = _encode(ctx, ctx.template.render(msgs))
        return await _serve(ctx, request, req, ids, req.effective_max_tokens(), chat=True)

    return app


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise P.APIError("the request body is not valid UTF-8", code="invalid_utf8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise P.APIError(f"malformed JSON: {e}", code="invalid_json") from None


def _check_model(ctx: _Ctx, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise P.APIError(
            f"the model {model!r} does not exist; this server serves {ctx.model_name!r}",
            404,
            "model_not_found",
            "model",
        )


def _encode(ctx: _Ctx, text: str) -> list[int]:
    try:
        return ctx.engine.engine.tokenizer.encode(text)
    except UnicodeEncodeError:  # lone surrogates from \\ud800-style JSON escapes
        raise P.APIError("the text is not valid Unicode", code="invalid_utf8") from None


async def _serve(
    ctx: _Ctx, request: Request, body: Any, ids: list[int], max_tokens: int | None, chat: bool
) -> Response:
    params = body.sampling_params(max_tokens)
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    try:
        req = ctx.engine.engine.make_request(ids, params, rid)
    except RequestError as e:
        raise P.APIError(str(e), code=e.code, param=e.param) from None
    start = time.perf_counter()
    queue = ctx.engine.submit(req)
    ctx.metrics.started()
    if body.stream:
        gen = _stream(ctx, req, queue, start, chat, body.include_usage)
        return StreamingResponse(gen, media_type="text/event-stream")
    return await _collect(ctx, request, req, queue, start, chat)


async def _collect(
    ctx: _Ctx, request: Request, req: Req, queue: asyncio.Queue, start: float, chat: bool
) -> Response:
    text: list[str] = []
    timer = _Timer(ctx.metrics, start)
    next_check = time.perf_counter() + _POLL_S
    while True:
        try:
            out: StepOutput | None = await asyncio.wait_for(queue.get(), _POLL_S)
        except TimeoutError:
            out = None
        if time.perf_counter() >= next_check:  # tokens may keep coming: check by the clock
            next_check = time.perf_counter() + _POLL_S
            if await request.is_disconnected():
                ctx.engine.abort(req.rid)
                ctx.metrics.finished("abort", None)
                log.debug("%s: client went away; aborted", req.rid)
                return Response(status_code=499)
        if out is None:
            continue
        timer.token(out)
        text.append(out.text)
        if out.finished:
            break
    ctx.metrics.finished(out.finish_reason, time.perf_counter() - start)
    if out.finish_reason in ("error", "abort"):
        err = P.APIError("the engine failed this request", 500, "engine_error", type="server_error")
        return JSONResponse(err.body(), status_code=500)
    use = P.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
    choice = P.choice("".join(text), out.finish_reason, chat, chunk=False)
    return JSONResponse(P.completion_body(req.rid, ctx.model_name, choice, chat, False, use))


async def _stream(
    ctx: _Ctx,
    req: Req,
    queue: asyncio.Queue,
    start: float,
    chat: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE events; if the client goes away, Starlette cancels this generator and the
    ``finally`` aborts the request."""
    name, rid, done = ctx.model_name, req.rid, False
    timer = _Timer(ctx.metrics, start)

    def event(choice: dict, use: dict | None = None) -> str:
        return f"data: {json.dumps(P.completion_body(rid, name, choice, chat, True, use))}\n\n"

    try:
        if chat:
            yield event(P.choice("", None, chat, chunk=True, role=True))
        while True:
            out: StepOutput = await queue.get()
            timer.token(out)
            if out.finished:
                done = True
                if out.finish_reason in ("error", "abort"):
                    err = P.APIError("the engine failed this request", 500, "engine_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                else:
                    yield event(P.choice(out.text, out.finish_reason, chat, chunk=True))
                    if include_usage:
                        use = P.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
                        yield event({}, use)
                ctx.metrics.finished(out.finish_reason, time.perf_counter() - start)
                break
            if out.text:
                yield event(P.choice(out.text, None, chat, chunk=True))
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            ctx.engine.abort(rid)
            ctx.metrics.finished("abort", None)
            log.debug("%s: client went away; aborted", rid)


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
