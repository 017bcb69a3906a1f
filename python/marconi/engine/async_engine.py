"""``AsyncEngine``: the engine on a background thread, driven from an asyncio server.

The engine thread is the only one that touches the engine; other threads send it commands
(add, abort, call) through a queue and get results through per-request ``asyncio.Queue``s.
When idle it blocks on the command queue (no busy loop).

The engine thread also *builds* the engine (``start`` waits for it), so that it is the only
thread of the server that runs parallel torch ops. GNU OpenMP keeps a pool of worker threads
for every thread that ever ran a parallel region, and once it manages more threads than there
are CPUs it spins ~1,000 times instead of ``GOMP_SPINCOUNT`` at a barrier (its "throttled"
spin), so every parallel region wakes sleeping workers. Loading the model on the main thread
and stepping on this one did exactly that on a 2-core machine: 4-row decode steps of the
``small`` model 47-48 ms vs 37-40 ms, 256-token prefill steps 360 vs 305 ms
(docs/performance_log.md).

Faults: the engine fails a faulty request alone (``Engine.step``); should a step still raise,
every request in flight fails with ``finish_reason="error"`` and the thread keeps serving.
``num_queued()`` (requests submitted but not yet admitted) is what the server bounds with
``--max-queued-requests``. With a ``HeapTrimmer`` the thread also gives glibc's free heap
back to the OS when it goes idle (``marconi.engine.heap``; ``--heap-trim-interval``).

Bursts: a request that wakes the idle thread is not stepped at once when ``burst_wait`` > 0;
the thread keeps taking requests until none has come for ``burst_wait`` seconds (at most
``BURST_WAIT_LIMIT`` times that in all). Simultaneous requests reach the engine over several
milliseconds (each is parsed and tokenized on the event loop, which also competes for the CPUs
with a step once one runs; on new connections 1-7 ms apart, the first gap the longest, which
the server's default of 8 ms covers: docs/serving.md); without the wait the first one's
prefill runs alone, whatever its length, and the rest queue behind it, out of the schedule
policy's order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from marconi.engine.request import StepOutput

if TYPE_CHECKING:
    from marconi.engine.engine import Engine
    from marconi.engine.heap import HeapTrimmer
    from marconi.engine.request import Req

log = logging.getLogger("marconi.engine")
T = TypeVar("T")
#: a burst is taken for at most this many ``burst_wait`` periods in all
BURST_WAIT_LIMIT = 5


class AsyncEngine:
    """Thread-safe front of an ``Engine``: ``submit`` a request and read its ``StepOutput``s
    from the returned queue until one has ``finished``; ``abort`` frees a request wherever it
    is; ``call(fn)`` runs ``fn(engine)`` between steps (consistent snapshots, checks)."""

    def __init__(
        self,
        build: Callable[[], Engine],
        trimmer: HeapTrimmer | None = None,
        burst_wait: float = 0.0,
    ) -> None:
        self._build = build
        self.burst_wait = burst_wait
        self._built: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        self.engine: Engine  # built on the engine thread; set by start()
        self.trimmer = trimmer
        self._cmds: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="marconi-engine", daemon=True)
        self._lock = threading.Lock()
        self._unfinished = 0  # submitted, final output not yet delivered
        self._running = 0  # admitted, as of the last step (published by the engine thread)

    def start(self) -> None:
        """Start the engine thread and wait until it has built the engine; re-raises what the
        build raised."""
        self._thread.start()
        self._built.result()

    def shutdown(self, timeout: float = 10.0) -> str | None:
        """Stop the engine thread, end whatever is still in flight (``"shutdown"``), and check
        the cache: None if it is intact with nothing in flight, else what is wrong."""
        self._stop.set()
        self._cmds.put(("wake", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            return "the engine thread did not stop"
        for out in self._fail_all("shutdown"):  # the thread is gone: this one owns the engine
            self._deliver(out)
        try:
            self.engine.check_integrity()
        except AssertionError as e:
            return str(e) or "integrity check failed"
        return None

    # ------------------------------------------------------------------ callers' side
    def submit(self, req: Req) -> asyncio.Queue[StepOutput]:
        """Queue ``req``; call from a running event loop."""
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        with self._lock:
            self._unfinished += 1
        self._cmds.put(("add", (req, asyncio.get_running_loop(), q)))
        return q

    def abort(self, rid: str) -> None:
        self._cmds.put(("abort", rid))

    def fail_all(self, reason: str) -> None:
        """End every request in flight with ``finish_reason=reason`` (the shutdown drain)."""
        self._cmds.put(("fail_all", reason))

    def num_queued(self) -> int:
        """Requests submitted and not yet admitted (an upper bound: admissions count from the
        end of the step that made them)."""
        with self._lock:
            return max(0, self._unfinished - self._running)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._cmds.put(("call", (fn, fut)))
        return await asyncio.wrap_future(fut)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self.engine = self._build()
            self._built.set_result(self.engine)
        except BaseException as e:
            self._built.set_exception(e)
            return
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            if self.trimmer is not None:
                self.trimmer.tick(busy=not idle)
            try:
                self._handle(*self._cmds.get(block=idle, timeout=1.0 if idle else None))
                while True:
                    self._handle(*self._cmds.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            if idle and self.burst_wait > 0:
                self._take_burst()
            try:
                outs = self.engine.step()
            except Exception:
                log.exception("engine step failed; failing every request in flight")
                outs = self._fail_all("error")
            self._running = len(self.engine.scheduler.running)
            for out in outs:
                self._deliver(out)

    def _take_burst(self) -> None:
        """Take commands until none has come for ``burst_wait`` s (module docstring)."""
        deadline = time.monotonic() + BURST_WAIT_LIMIT * self.burst_wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._handle(*self._cmds.get(timeout=min(self.burst_wait, left)))
            except queue.Empty:
                return

    def _handle(self, kind: str, arg: Any) -> None:
        if kind == "add":
            req, loop, q = arg
            self._streams[req.rid] = (loop, q)
            self.engine.add_request(req)
        elif kind == "abort":
            out = self.engine.abort(arg)
            if out is not None:
                self._deliver(out)
        elif kind == "fail_all":
            for out in self._fail_all(arg):
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
        if out.finished:
            with self._lock:
                self._unfinished -= 1
        loop, q = target
        with contextlib.suppress(RuntimeError):  # the caller's loop is gone
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _fail_all(self, reason: str) -> list[StepOutput]:
        sched = self.engine.scheduler
        outs = [self.engine.abort(r.rid, reason) for r in [*sched.running, *sched.waiting]]
        self._running = len(sched.running)
        return [o for o in outs if o is not None]
