"""``python -m marconi.launch_server --model tiny --prefix-cache marconi --port 30000``.

Flags are generated from the frozen config dataclasses (``EngineConfig``, ``ServerArgs`` below
and the server's ``Limits``): defaults and help come from the fields, choices from the preset
registry. Names follow SGLang's ``launch_server`` where the meaning is the same
(``--model-path`` = ``--model``, ``--disable-radix-cache`` = ``--prefix-cache none``,
``--api-key``, ``--max-queued-requests``). ``--api-key`` may also come from ``MARCONI_API_KEY``.

SIGTERM or SIGINT drains: the server stops accepting connections, in-flight requests have
``--drain-timeout`` seconds to finish, the rest end with a 503 ``shutting_down``; then the cache
is checked (nothing may be left in flight) and the process exits 0 (1 if the check fails).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from marconi.engine.async_engine import BURST_WAIT_LIMIT
from marconi.engine.config import NO_CACHE, ConfigError, EngineConfig, prefix_cache_choices
from marconi.engine.schedule_policy import SCHEDULE_POLICIES
from marconi.models.loader import ModelLoadError
from marconi.server.guard import Limits

log = logging.getLogger("marconi.server")
API_KEY_ENV = "MARCONI_API_KEY"
PROG = "python -m marconi.launch_server"

_HELP = {
    "model": "embedded model (tiny, tiny-jamba, small) or a local HF model folder",
    "prefix_cache": "prefix-cache policy preset, or none",
    "cache_memory": "KV + SSM-state budget: 2GB, 512MiB, or a fraction of device memory (0.2)",
    "alpha": "FLOP-aware eviction weight: auto or a float >= 0",
    "max_running_requests": "most requests running at once",
    "chunked_prefill_size": "prefill token budget per step (longer prompts are chunked)",
    "schedule_policy": "admission order: srpf (shortest remaining prefill first: a shorter "
    "arrival goes before a long prompt's remaining chunks, up to half of them), spf (shortest "
    "prefill first), fcfs, or lpm (longest cached prefix first)",
    "context_length": "longest prompt + completion (None: the model's)",
    "default_max_tokens": "completion cap when a chat request sets no max_tokens",
    "queue_timeout": "seconds a request may wait for admission, then 503 (None: no limit)",
    "dtype": "model and KV dtype",
    "device": "cpu or cuda[:N]",
    "seed": "seed of unseeded sampling",
    "check_integrity": "deep-check the cache after every step (slow; for debugging)",
    "host": "address to listen on",
    "port": "port to listen on",
    "served_model_name": "model name in the API (default: --model)",
    "log_level": "debug, info, warning or error",
    "num_threads": "torch CPU threads (default: torch's choice)",
    "drain_timeout": "seconds in-flight requests get to finish after SIGTERM/SIGINT",
    "heap_trim_interval": "when idle after serving, give freed heap back to the OS "
    "(malloc_trim) at most this often, seconds (0: never)",
    "burst_wait_ms": "when a request wakes the idle engine, wait until none has arrived for "
    f"this long (at most {BURST_WAIT_LIMIT}x in all) before the first step, so that "
    "simultaneous requests are scheduled together (0: step at once)",
    "pin_threads": "pin the engine's OpenMP threads to one CPU each, as vLLM's "
    "VLLM_CPU_OMP_THREADS_BIND does (default: when they are as many as the CPUs the process "
    "may use; --no-pin-threads: never)",
    "api_key": f"require 'Authorization: Bearer KEY' on /v1/* and /debug/* (or set ${API_KEY_ENV})",
    "max_queued_requests": "requests waiting for admission beyond which a new one gets 503",
    "max_request_bytes": "largest request body (413 beyond)",
    "body_timeout": "seconds a client may take to send its body (408 beyond)",
    "retry_after": "Retry-After seconds of a 503",
}
_CHOICES = {
    "prefix_cache": prefix_cache_choices(),
    "schedule_policy": SCHEDULE_POLICIES.supported_names(),
    "dtype": ["float32", "bfloat16", "float16"],
    "log_level": ["debug", "info", "warning", "error"],
}


@dataclass(frozen=True)
class ServerArgs:
    """HTTP-side settings."""

    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    log_level: str = "info"
    num_threads: int | None = None
    drain_timeout: float = 30.0
    heap_trim_interval: float = 10.0
    burst_wait_ms: float = 8.0
    pin_threads: bool | None = None  # None: auto (affinity.should_pin)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        for name in ("drain_timeout", "heap_trim_interval", "burst_wait_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")


def _add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if kind.startswith("bool"):  # bool: a switch; bool | None: --x / --no-x / auto
            action = "store_true" if kind == "bool" else argparse.BooleanOptionalAction
            parser.add_argument(flag, action=action, default=default, help=_HELP.get(f.name))
            continue
        conv = {"int": int, "float": float}.get(kind.split(" ")[0], str)
        names = [flag, "--model-path"] if f.name == "model" else [flag]
        parser.add_argument(
            *names,
            dest=f.name,
            type=conv,
            default=default,
            choices=_CHOICES.get(f.name),
            help=f"{_HELP.get(f.name, '')} (default: {default})",
            metavar=f.name.upper() if f.name == "api_key" else None,
        )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="OpenAI-compatible server for hybrid LLMs with the Marconi prefix cache.",
    )
    _add_fields(parser, EngineConfig)
    _add_fields(parser, ServerArgs)
    _add_fields(parser, Limits)
    parser.add_argument(
        "--disable-radix-cache", action="store_true", help="same as --prefix-cache none"
    )
    return parser


def parse_args(
    argv: Sequence[str] | None = None,
) -> tuple[EngineConfig, ServerArgs, Limits]:
    """The three configs; a value they reject exits as argparse does (usage, the reason, 2)."""
    parser = make_parser()
    ns = vars(parser.parse_args(argv))
    if ns.pop("disable_radix_cache"):
        ns["prefix_cache"] = NO_CACHE
    ns["api_key"] = ns["api_key"] or os.environ.get(API_KEY_ENV) or None

    def pick(cls: type) -> dict:
        return {f.name: ns[f.name] for f in dataclasses.fields(cls)}

    try:
        return (
            EngineConfig(**pick(EngineConfig)),
            ServerArgs(**pick(ServerArgs)),
            Limits(**pick(Limits)),
        )
    except ValueError as e:
        parser.error(str(e))


class ServerHandle:
    """A running server (uvicorn on a thread); ``stop()`` drains it and shuts the engine down."""

    def __init__(
        self, engine_config: EngineConfig, args: ServerArgs, limits: Limits | None = None
    ) -> None:
        import uvicorn

        from marconi.engine.async_engine import AsyncEngine
        from marconi.engine.chat import ChatTemplate
        from marconi.engine.engine import Engine
        from marconi.engine.heap import HeapTrimmer
        from marconi.server.api import create_app

        t0 = time.perf_counter()
        interval = args.heap_trim_interval
        trimmer = HeapTrimmer(interval) if interval > 0 else None
        wait = args.burst_wait_ms / 1e3

        def build() -> Engine:  # on the engine thread, which then steps it
            if args.pin_threads is not False:
                from marconi.engine.affinity import pin_threads

                if cpus := pin_threads(args.pin_threads):
                    log.info("engine OpenMP threads pinned to CPUs %s", cpus)
            return Engine(engine_config)

        self.engine = AsyncEngine(build, trimmer, burst_wait=wait)
        self.engine.start()  # builds the engine on its own thread (async_engine's docstring)
        engine = self.engine.engine
        name = args.served_model_name or engine_config.model
        self.limits = limits or Limits()
        template = ChatTemplate.for_model(engine.model_path)
        app = create_app(self.engine, name, template, self.limits)
        self.url = f"http://{args.host}:{args.port}"
        self.model_name, self.args = name, args
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
            timeout_graceful_shutdown=int(args.drain_timeout) + 10,  # backstop of stop()'s
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                self.engine.shutdown()
                raise RuntimeError(f"server failed to start on {self.url}")
            time.sleep(0.02)
        # The model, tokenizer, app and imports (~290k objects for `small`) live as long as the
        # server: a full collection walked them in 70-110 ms, stalling the engine thread (5 in a
        # 3-round replay); frozen, collections see only what serving allocates. stop() thaws,
        # process-wide: two servers in one process (tests) share one frozen generation.
        gc.collect()
        gc.freeze()
        log.info(
            "marconi serving %s on %s (ready in %.1f s)",
            engine.describe(),
            self.url,
            time.perf_counter() - t0,
        )

    def wait(self) -> None:
        while self._thread.is_alive():
            self._thread.join(0.5)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, drain: float | None = None) -> str | None:
        """Drain (module docstring; ``drain`` defaults to ``--drain-timeout``) and stop; returns
        None if the cache is intact with nothing in flight afterwards, else what is wrong."""
        drain = self.args.drain_timeout if drain is None else drain
        self.server.should_exit = True  # stop accepting; uvicorn waits for open responses
        self._thread.join(drain)
        if self._thread.is_alive():
            log.warning("drain timeout (%.0f s): failing the requests still in flight", drain)
            self.engine.fail_all("shutdown")
            self._thread.join(15)
        problem = self.engine.shutdown()
        gc.unfreeze()  # what this server held can be collected again
        return problem


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main(argv: Sequence[str] | None = None) -> None:
    engine_config, args, limits = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        handle = ServerHandle(engine_config, args, limits)
    except (ModelLoadError, ConfigError) as e:  # what cannot be served: say why, no traceback
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    while handle.is_alive() and not stopping.wait(0.5):
        pass
    log.info("shutting down: draining for up to %.0f s", args.drain_timeout)
    problem = handle.stop()
    if problem:
        log.error("shutdown: cache check failed: %s", problem)
        sys.exit(1)
    log.info("shutdown: cache integrity OK, nothing in flight")


if __name__ == "__main__":
    main()
