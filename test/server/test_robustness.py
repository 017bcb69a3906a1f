"""Issue 12's findings against real servers on loopback: each was a 500, a crash of every request
in flight, or a missing bound, and is now a 4xx/503 that leaves other requests untouched."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from marconi.launch_server import ServerHandle, parse_args
from marconi.server.guard import Limits

from .conftest import start_server, stop_server, wait_idle

KEY = "sk-test-issue12"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": "Tell me a long story.", "max_tokens": 20000, "ignore_eos": True}


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerHandle]:
    limits = Limits(api_key=KEY, max_request_bytes=65536, body_timeout=1.0)
    srv = start_server(limits, prefix_cache="marconi")
    yield srv
    stop_server(srv)


def post(srv: ServerHandle, path: str, body: bytes | dict, **kw: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{srv.url}{path}", content=content, headers=AUTH, timeout=30, **kw)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


FINDINGS = [
    # (what, path, body, status, code)
    ("5000-level nested body", "/v1/completions", nested(5000).encode(), 400, "invalid_json"),
    (
        "5000-level nested prompt",
        "/v1/completions",
        f'{{"prompt": {nested(5000)}}}'.encode(),
        400,
        "invalid_json",
    ),
    (
        "200-level nested field",
        "/v1/chat/completions",
        f'{{"messages": [{{"role": "user", "content": {nested(200)}}}]}}'.encode(),
        400,
        "invalid_value",
    ),
    (
        "null user content",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": null}]}',
        400,
        "invalid_type",
    ),
    (
        "seed 2^70",
        "/v1/completions",
        b'{"prompt": "hi", "seed": 1180591620717411303424}',
        400,
        "invalid_value",
    ),
    (
        "5000-digit integer",
        "/v1/completions",
        b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}",
        400,
        "invalid_json",
    ),
    (
        "NaN temperature",
        "/v1/completions",
        b'{"prompt": "hi", "temperature": NaN}',
        400,
        "invalid_json",
    ),
    ("1e999 top_p", "/v1/completions", b'{"prompt": "hi", "top_p": 1e999}', 400, "invalid_value"),
    (
        "token id 2^70",
        "/v1/completions",
        b'{"prompt": [1180591620717411303424]}',
        400,
        "invalid_value",
    ),
    ("negative token id", "/v1/completions", b'{"prompt": [-1]}', 400, "invalid_value"),
    (
        "logit_bias key",
        "/v1/completions",
        b'{"prompt": "hi", "logit_bias": {"x": 1}}',
        400,
        "invalid_value",
    ),
    (
        "logit_bias value",
        "/v1/completions",
        b'{"prompt": "hi", "logit_bias": {"1": 101}}',
        400,
        "invalid_value",
    ),
    (
        "five stops",
        "/v1/completions",
        b'{"prompt": "hi", "stop": ["a","b","c","d","e"]}',
        400,
        "invalid_value",
    ),
    ("empty stop", "/v1/completions", b'{"prompt": "hi", "stop": ""}', 400, "invalid_value"),
    (
        "max_tokens 2^40",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 1099511627776}',
        400,
        "invalid_value",
    ),
    ("top_p 0", "/v1/completions", b'{"prompt": "hi", "top_p": 0}', 400, "invalid_value"),
    (
        "body over the limit",
        "/v1/completions",
        b'{"prompt": "' + b"x" * 70000 + b'"}',
        413,
        "request_too_large",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "code"), [f[1:] for f in FINDINGS], ids=[f[0] for f in FINDINGS]
)
def test_bad_input_is_a_4xx(
    guarded: ServerHandle, path: str, body: bytes, status: int, code: str
) -> None:
    r = post(guarded, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.json()


def test_one_bad_request_never_hurts_one_in_flight(guarded: ServerHandle) -> None:
    """The finding: a 2^70 seed used to fail every request in flight."""
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "seed": 3}
    body |= {"temperature": 0.7, "stream": True}
    with httpx.stream("POST", f"{guarded.url}/v1/completions", json=body, headers=AUTH) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")  # running
        bad = post(guarded, "/v1/completions", {"prompt": "x", "seed": 2**70, "temperature": 1})
        assert bad.status_code == 400
        events = [json.loads(x[5:]) for x in lines if x.startswith("data:") and "[DONE]" not in x]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    wait_idle(guarded.url, headers=AUTH)


def test_api_key_guards_v1_and_debug_only(guarded: ServerHandle) -> None:
    url = guarded.url
    for path in ("/v1/models", "/debug/cache", "/debug/memory"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.get(f"{url}{path}", headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    cli = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert cli.completions.create(model="tiny", prompt="hi", max_tokens=2).usage
    wait_idle(url, headers=AUTH)


def test_api_key_flag_and_env_and_default_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MARCONI_API_KEY", raising=False)
    _, args, limits = parse_args([])
    assert limits.api_key is None and args.host == "127.0.0.1"
    assert parse_args(["--api-key", "k1"])[2].api_key == "k1"
    monkeypatch.setenv("MARCONI_API_KEY", "k2")
    assert parse_args([])[2].api_key == "k2"
    assert parse_args(["--api-key", "k1"])[2].api_key == "k1"  # the flag wins
    limits = parse_args(["--max-queued-requests", "4", "--queue-timeout", "2.5"])
    assert limits[2].max_queued_requests == 4 and limits[0].queue_timeout == 2.5


def raw_request(srv: ServerHandle, body: bytes, declared: int) -> socket.socket:
    """A socket that sent headers declaring ``declared`` body bytes and then ``body``."""
    host, port = srv.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def read_reply(sock: socket.socket) -> str:
    """The whole response: headers, then ``content-length`` body bytes (``recv`` may return the
    headers alone: they and the body can come in separate segments)."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode()


def _length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode().lower()
    return next(
        (int(h.split(":")[1]) for h in head.split("\r\n") if h.startswith("content-length")), 0
    )


def test_half_sent_bodies(guarded: ServerHandle) -> None:
    # the client hangs up half-way through its body: nothing is queued, nothing leaks
    for _ in range(20):
        raw_request(guarded, b'{"prompt": "hel', 200).close()
    # the client stalls half-way: 408 after --body-timeout
    sock = raw_request(guarded, b'{"prompt": "hel', 200)
    reply = read_reply(sock)
    sock.close()
    assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply, reply
    # the declared size alone is over the limit: 413 without reading the body
    sock = raw_request(guarded, b"", 10**9)
    assert read_reply(sock).startswith("HTTP/1.1 413")
    sock.close()
    ok = post(guarded, "/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200
    wait_idle(guarded.url, headers=AUTH)


@pytest.fixture(scope="module")
def small() -> Iterator[ServerHandle]:
    """One request runs at a time; two may wait, for at most 1.5 s."""
    limits = Limits(max_queued_requests=2, retry_after=2)
    srv = start_server(limits, prefix_cache="marconi", max_running_requests=1, queue_timeout=1.5)
    yield srv
    stop_server(srv)


def metric(url: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return next(float(x.split()[-1]) for x in lines if x.startswith(name + " "))


def test_overload_gets_503_with_retry_after_and_waiting_requests_time_out(
    small: ServerHandle,
) -> None:
    url = small.url
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as long:
        events = long.iter_lines()  # kept: dropping the iterator would close the stream
        assert next(events).startswith("data:")  # running: the only slot is taken
        waiting: list[httpx.Response] = []

        def wait_one(stream: bool) -> None:
            body = {"prompt": "queued", "max_tokens": 4, "stream": stream}
            waiting.append(httpx.post(f"{url}/v1/completions", json=body, timeout=30))

        threads = [threading.Thread(target=wait_one, args=(s,)) for s in (False, True)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while metric(url, "marconi_num_requests_waiting") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        over = httpx.post(f"{url}/v1/completions", json={"prompt": "one too many"})
        assert over.status_code == 503 and over.headers["retry-after"] == "2"
        assert over.json()["error"]["code"] == "server_overloaded"
        for t in threads:
            t.join(30)
    for r in waiting:  # streamed or not: a 503 status, since no token was ever sent
        assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
        assert r.json()["error"]["code"] == "queue_timeout"
    assert metric(url, 'marconi_requests_rejected_total{reason="queue_full"}') == 1
    assert metric(url, "marconi_requests_timed_out_total") == 2
    wait_idle(url)
    cli = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    assert cli.completions.create(model="tiny", prompt="after", max_tokens=2).usage
