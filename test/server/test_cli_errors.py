"""What the launcher says to settings it cannot serve with: argparse's usage, one line with the
reason, exit 2; never a traceback. Flag values are fuzzed: each parses into the configs or is
refused that way."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from marconi.launch_server import PROG, free_port, make_parser, parse_args

#: every flag that takes a value (derived from the parser, so a new flag is fuzzed too)
VALUED = [
    a.option_strings[0] for a in make_parser()._actions if a.option_strings and a.nargs is None
]
VALUES = (
    st.sampled_from(["0", "-1", "1", "0.5", "1e9", "2GB", "512MiB", "nan", "inf", "-inf", "auto"])
    | st.integers(-(2**40), 2**40).map(str)
    | st.floats(allow_nan=True).map(str)
    | st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\0"), max_size=12)
)


@settings(max_examples=300, deadline=None)
@given(flags=st.lists(st.tuples(st.sampled_from(VALUED), VALUES), min_size=1, max_size=3))
def test_every_flag_value_is_taken_or_refused_with_its_reason(flags) -> None:
    argv = [f"{flag}={value}" for flag, value in flags]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            engine, server, limits = parse_args(argv)
    except SystemExit as e:
        text = err.getvalue()
        assert e.code == 2, text
        assert text.splitlines()[-1].startswith(f"{PROG}: error: "), text
        assert "Traceback" not in text
        return
    # what is taken can be served: a budget, a port, positive bounds
    assert engine.cache_bytes > 0 and engine.max_running_requests >= 1
    assert engine.chunked_prefill_size >= 1 and (engine.queue_timeout or 1) > 0
    assert engine.device == "cpu" or engine.device.startswith("cuda")
    assert 0 < server.port < 65536 and server.drain_timeout >= 0 and server.burst_wait_ms >= 0
    assert limits.max_request_bytes >= 1 and limits.body_timeout > 0 and limits.retry_after >= 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--model", "/nonexistent"], "/nonexistent: not a directory and not one of"),
        (["--cache-memory", "10KB"], "--cache-memory 10KB is too small for tiny"),
        (["--cache-memory", "100TB"], "--cache-memory 100TB (93132.3 GiB) is more than"),
    ],
)
def test_the_server_refuses_what_it_cannot_serve_in_one_line(argv: list[str], says: str) -> None:
    """Found when starting the server by hand: each was a traceback (an IndexError for a
    budget below one state, the allocator's enforce failure for one above the RAM)."""
    cmd = [sys.executable, "-m", "marconi.launch_server", *argv, "--port", str(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(f"{PROG}: error: {says}")
    assert "Traceback" not in proc.stderr
