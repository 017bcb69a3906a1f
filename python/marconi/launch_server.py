"""``python -m marconi.launch_server --model tiny --prefix-cache marconi --port 30000``.

Flags are generated from the frozen config dataclasses (``EngineConfig`` here, ``ServerArgs``
below): defaults and help come from the fields, choices from the preset registry. Names follow
SGLang's ``launch_server`` where the meaning is the same (``--model-path`` = ``--model``,
``--disable-radix-cache`` = ``--prefix-cache none``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from marconi.engine.config import NO_CACHE, EngineConfig, prefix_cache_choices
from marconi.engine.schedule_policy import SCHEDULE_POLICIES

log = logging.getLogger("marconi.server")

_HELP = {
    "model": "embedded model (tiny, tiny-jamba, small) or a local HF model folder",
    "prefix_cache": "prefix-cache policy preset, or none",
    "cache_memory": "KV + SSM-state budget: 2GB, 512MiB, or a fraction of device memory (0.2)",
    "alpha": "FLOP-aware eviction weight: auto or a float >= 0",
    "max_running_requests": "most requests running at once",
    "chunked_prefill_size": "prefill token budget per step (longer prompts are chunked)",
    "schedule_policy": "admission order: fcfs, or lpm (longest cached prefix first)",
    "context_length": "longest prompt + completion (None: the model's)",
    "default_max_tokens": "completion cap when a chat request sets no max_tokens",
    "dtype": "model and KV dtype",
    "device": "cpu or cuda[:N]",
    "seed": "seed of unseeded sampling",
    "check_integrity": "deep-check the cache after every step (slow; for debugging)",
    "host": "address to listen on",
    "port": "port to listen on",
    "served_model_name": "model name in the API (default: --model)",
    "log_level": "debug, info, warning or error",
    "num_threads": "torch CPU threads (default: torch's choice)",
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


def _add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if kind == "bool":
            parser.add_argument(flag, action="store_true", help=_HELP.get(f.name))
            continue
        conv = int if kind.startswith("int") else str
        names = [flag, "--model-path"] if f.name == "model" else [flag]
        parser.add_argument(
            *names,
            dest=f.name,
            type=conv,
            default=default,
            choices=_CHOICES.get(f.name),
            help=f"{_HELP.get(f.name, '')} (default: {default})",
        )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m marconi.launch_server",
        description="OpenAI-compatible server for hybrid LLMs with the Marconi prefix cache.",
    )
    _add_fields(parser, EngineConfig)
    _add_fields(parser, ServerArgs)
    parser.add_argument(
        "--disable-radix-cache", action="store_true", help="same as --prefix-cache none"
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[EngineConfig, ServerArgs]:
    ns = vars(make_parser().parse_args(argv))
    if ns.pop("disable_radix_cache"):
        ns["prefix_cache"] = NO_CACHE
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    engine = EngineConfig(**{k: v for k, v in ns.items() if k in names})
    server = ServerArgs(**{k: v for k, v in ns.items() if k not in names})
    return engine, server


class ServerHandle:
    """A running server (uvicorn on a thread); ``stop()`` shuts it and the engine down."""

    def __init__(self, engine_config: EngineConfig, args: ServerArgs) -> None:
        import uvicorn

        from marconi.engine.async_engine import AsyncEngine
        from marconi.engine.chat import ChatTemplate
        from marconi.engine.engine import Engine
        from marconi.server.api import create_app

        t0 = time.perf_counter()
        engine = Engine(engine_config)
        self.engine = AsyncEngine(engine)
        name = args.served_model_name or engine_config.model
        app = create_app(self.engine, name, ChatTemplate.for_model(engine.model_path))
        self.url = f"http://{args.host}:{args.port}"
        self.model_name = name
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level, access_log=False
        )
        self.server = uvicorn.Server(config)
        self.engine.start()
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                self.engine.shutdown()
                raise RuntimeError(f"server failed to start on {self.url}")
            time.sleep(0.02)
        log.info(
            "marconi serving %s on %s (ready in %.1f s)",
            engine.describe(),
            self.url,
            time.perf_counter() - t0,
        )

    def wait(self) -> None:
        while self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self.engine.shutdown()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main(argv: Sequence[str] | None = None) -> None:
    engine_config, args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    handle = ServerHandle(engine_config, args)
    try:
        handle.wait()
    except KeyboardInterrupt:
        pass
    finally:
        handle.stop()


if __name__ == "__main__":
    main()
