"""Start and stop real ``python -m sglang.launch_server`` processes (tests and benchmarks).

``SGLangServer(model_path, ["--prefix-cache", "marconi"])`` runs the user's command in a
subprocess (with this interpreter, so the plugin is whatever is installed beside it), waits for
``/health``, and on exit stops the whole process group (SGLang forks a scheduler and a
detokenizer). The server log is kept in ``log_path`` and its tail is raised with any start-up
failure.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

#: small pools: a CPU test or benchmark must not reserve most of the machine's memory
CPU_POOL_ARGS = ("--max-total-tokens", "65536", "--max-mamba-cache-size", "64")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SGLangServer:
    """One SGLang server on a loopback port; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        model_path: str | Path,
        args: Sequence[str] = (),
        *,
        device: str = "cpu",
        port: int | None = None,
        log_path: str | Path | None = None,
        timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="sglang-", suffix=".log")[1])
        self.command = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
            "--device", device, "--host", "127.0.0.1", "--port", str(self.port), *args,
        ]  # fmt: skip
        self.timeout_s = timeout_s
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SGLangServer:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        return self

    def wait_ready(self) -> SGLangServer:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"SGLang exited during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"SGLang not healthy after {self.timeout_s:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> SGLangServer:
        return self.start().wait_ready()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
