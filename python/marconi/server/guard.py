"""The server's boundary: what a request must pass before any route code runs.

- ``BearerAuth``: with ``--api-key``, every path under ``/v1`` and ``/debug`` needs
  ``Authorization: Bearer <key>`` (401 otherwise, OpenAI-style); ``/health`` and ``/metrics``
  stay open.
- ``read_json``: the body, bounded in size (413) and in the time a client may take to send it
  (408), decoded as strict JSON (no ``NaN``/``Infinity``; nesting too deep for the parser and
  integers beyond Python's digit limit are 400s, not 500s). A client that hangs up part-way
  through its body gets nothing (``ClientGone``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from marconi.server.protocol import APIError

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send


@dataclass(frozen=True)
class Limits:
    """Server-side bounds (``ServerArgs`` fills them from the flags).

    - ``api_key``: the bearer token ``/v1/*`` and ``/debug/*`` require (None: open).
    - ``max_queued_requests``: submitted, not yet admitted requests beyond which a new one gets
      503 + ``Retry-After`` (None: unbounded).
    - ``max_request_bytes``: the largest body (413 beyond).
    - ``body_timeout``: seconds a client may take to send its body (408 beyond).
    - ``retry_after``: the ``Retry-After`` seconds of a 503.
    """

    api_key: str | None = None
    max_queued_requests: int | None = None
    max_request_bytes: int = 8 * 2**20
    body_timeout: float = 30.0
    retry_after: int = 1

    def __post_init__(self) -> None:
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be >= 1")
        if not self.body_timeout > 0:
            raise ValueError("body_timeout must be > 0 seconds")
        if self.retry_after < 0:
            raise ValueError("retry_after must be >= 0 seconds")


class ClientGone(Exception):
    """The client disconnected before its request was read or answered."""


#: Paths that ``--api-key`` protects (the rest, ``/health`` and ``/metrics``, stay open).
PROTECTED = ("/v1", "/debug")


class BearerAuth:
    """ASGI middleware: 401 for a protected path without the right bearer token. Compares in
    constant time; never logs the key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _protected(scope["path"]) and not self._ok(scope):
            err = APIError(
                "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'",
                401,
                "invalid_api_key",
            )
            resp = JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _ok(self, scope: Scope) -> bool:
        got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(got, self.expected)


def _protected(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PROTECTED)


async def read_json(request: Request, limits: Limits) -> Any:
    """The decoded body (see the module docstring). Raises ``APIError`` or ``ClientGone``."""
    too_big = APIError(
        f"the request body is larger than {limits.max_request_bytes} bytes",
        413,
        "request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_request_bytes:
        raise too_big

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_request_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        raw = await asyncio.wait_for(read(), limits.body_timeout)
    except TimeoutError:
        raise APIError(
            f"the request body took longer than {limits.body_timeout:g} s to arrive",
            408,
            "request_timeout",
        ) from None
    except ClientDisconnect:
        raise ClientGone from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError("the request body is not valid UTF-8", code="invalid_utf8") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise APIError("the JSON body is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, integers over 4300 digits
        raise APIError(f"malformed JSON: {e}", code="invalid_json") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
