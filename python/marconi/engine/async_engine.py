"""``AsyncEngine``: the engine on a background thread, driven from an asyncio server.

The engine thread is the only one that touches the engine; other threads send it commands
(add, abort, call) through a queue and get results through per-request ``asyncio.Queue``s.
When idle it blocks on the command queue (no busy loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from marconi.engine.request import StepOutput

if TYPE_CHECKING:
    from marconi.engine.engine import Engine
    from marconi.engine.request import Req

log = logging.getLogger("marconi.engine")
T = TypeVar("T")


class AsyncEngine:
    """Thread-safe front of an ``Engine``: ``submit`` a request and read its ``StepOutput``s
    from the returned queue until one has ``finished``; ``abort`` frees a request wherever it
    is; ``call(fn)`` runs ``fn(engine)`` between steps (consistent snapshots, checks)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cmds: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="marconi-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake", None))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ callers' side
    def submit(self, req: Req) -> asyncio.Queue[StepOutput]:
        """Queue ``req``; call from a running event loop."""
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._cmds.put(("add", (req, asyncio.get_running_loop(), q)))
        return q

    def abort(self, rid: str) -> None:
        self._cmds.put(("abort", rid))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._cmds.put(("call", (fn, fut)))
        return await asyncio.wrap_future(fut)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            try:
                self._handle(*self._cmds.get(block=idle, timeout=1.0 if idle else None))
                while True:
                    self._handle(*self._cmds.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                outs = self.engine.step()
            except Exception:
                log.exception("engine step failed; failing every request in flight")
                outs = self._fail_all()
            for out in outs:
                self._deliver(out)

    def _handle(self, kind: str, arg: Any) -> None:
        if kind == "add":
            req, loop, q = arg
            self._streams[req.rid] = (loop, q)
            self.engine.add_request(req)
        elif kind == "abort":
            out = self.engine.abort(arg)
            if out is not None:
                self._deliver(out)
        elif kind == "call":
            fn, fut = arg
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:
                fut.set_exception(e)

    def _deliver(self, out: StepOutput) -> None:
        target = self._streams.pop(out.rid, None) if out.finished else self._streams.get(out.rid)
        if target is None:
            return
        loop, q = target
        with contextlib.suppress(RuntimeError):  # the caller's loop is gone
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _fail_all(self) -> list[StepOutput]:
        sched = self.engine.scheduler
        outs = []
        for req in [*sched.running, *sched.waiting]:
            out = self.engine.abort(req.rid)
            if out is not None:
                outs.append(StepOutput(**{**out.__dict__, "finish_reason": "error"}))
        return outs
