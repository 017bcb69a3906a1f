"""The OpenAI-compatible API against real servers on loopback ports, with the ``openai`` client."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from marconi.engine.heap import HeapTrimmer
from marconi.launch_server import ServerHandle, free_port, parse_args

from .conftest import ASCII_ONLY, start_server, stop_server, wait_idle

SYSTEM = "You are a terse assistant. Answer every question in a few words."
SESSIONS = {
    "a": ["Name a colour.", "Another?", "And a third?"],
    "b": ["What is 2+2?", "Why?"],
    "c": ["Hello!", "Tell me more."],
}


def client(srv: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)


def chat_replay(srv: ServerHandle) -> dict[tuple[str, int], tuple[str, int, int]]:
    """Sessions interleaved turn by turn; returns (reply, prompt tokens, cached tokens)."""
    cli = client(srv)
    history = {s: [{"role": "system", "content": SYSTEM}] for s in SESSIONS}
    out = {}
    for turn in range(3):
        for sid, questions in SESSIONS.items():
            if turn >= len(questions):
                continue
            history[sid].append({"role": "user", "content": questions[turn]})
            kw = dict(
                model=srv.model_name,
                messages=history[sid],
                max_tokens=6,
                temperature=0,
                logit_bias=ASCII_ONLY,
            )
            if sid == "b":  # one session streams: usage comes in the last chunk
                chunks = list(
                    cli.chat.completions.create(
                        **kw, stream=True, stream_options={"include_usage": True}
                    )
                )
                reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = chunks[-1].usage
            else:
                resp = cli.chat.completions.create(**kw)
                reply, usage = resp.choices[0].message.content, resp.usage
            cached = usage.prompt_tokens_details.cached_tokens
            out[sid, turn] = (reply, usage.prompt_tokens, cached)
            history[sid].append({"role": "assistant", "content": reply})
    return out


def test_chat_replay_identical_with_and_without_cache_and_reports_hits(
    marconi_server: ServerHandle, plain_server: ServerHandle
) -> None:
    ref = chat_replay(plain_server)
    got = chat_replay(marconi_server)
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in ref.items()}
    assert all(v[2] == 0 for v in ref.values())
    # continuation hits: the state after the previous turn's last fed token
    for sid, turn in (("a", 1), ("a", 2), ("b", 1), ("c", 1)):
        prev_reply, prev_prompt, _ = got[sid, turn - 1]
        assert got[sid, turn][2] == prev_prompt + len(prev_reply) - 1, (sid, turn)
    # branch point: b's first turn split a's sequence after the shared system prompt; c hits it
    assert got["b", 0][2] == 0
    assert got["c", 0][2] >= len(SYSTEM)
    metrics = httpx.get(f"{marconi_server.url}/metrics").text
    cached = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("marconi_cached_tokens_total")
    )
    assert cached == sum(v[2] for v in got.values())
    for name in ("marconi_time_to_first_token_seconds_count", "marconi_kv_bytes_in_use"):
        assert name in metrics
    wait_idle(marconi_server.url)
    wait_idle(plain_server.url)


def test_completions_stream_and_models(marconi_server: ServerHandle) -> None:
    cli = client(marconi_server)
    assert [m.id for m in cli.models.list()] == ["tiny"]
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
    full = cli.completions.create(**kw)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 5
    text = "".join(c.choices[0].text for c in cli.completions.create(**kw, stream=True))
    assert text == full.choices[0].text
    ids = cli.completions.create(model="tiny", prompt=[72, 105, 33], max_tokens=2)
    assert ids.usage.prompt_tokens == 3
    assert httpx.get(f"{marconi_server.url}/health").status_code == 200
    wait_idle(marconi_server.url)


BAD = [
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, "invalid_utf8"),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', 400, "invalid_utf8"),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "5"}', 400, "invalid_type"),
    ("/v1/completions", b'{"prompt": 5}', 400, "invalid_type"),
    ("/v1/completions", b'{"prompt": "hi", "bogus": 1}', 400, "unrecognized_argument"),
    ("/v1/completions", b'{"model": "gpt-9", "prompt": "hi"}', 404, "model_not_found"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "invalid_value"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -3}', 400, "invalid_value"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000}', 400, None),
    ("/v1/completions", b'{"prompt": "", "max_tokens": 2}', 400, "empty_prompt"),
    ("/v1/completions", b'{"prompt": "hi", "n": 2}', 400, "unsupported_value"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 3}', 400, "invalid_value"),
    ("/v1/completions", b'{"max_tokens": 2}', 400, "missing"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "empty_messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, None),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "invalid_type"),
    ("/v1/nope", b"{}", 404, "not_found"),
]


@pytest.mark.parametrize(("path", "body", "status", "code"), BAD)
def test_bad_requests_get_openai_errors(
    marconi_server: ServerHandle, path: str, body: bytes, status: int, code: str | None
) -> None:
    r = httpx.post(f"{marconi_server.url}{path}", content=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if code is not None:
        assert err["code"] == code, err


def test_prompt_longer_than_context_is_rejected_and_server_keeps_serving(
    marconi_server: ServerHandle,
) -> None:
    cli = client(marconi_server)
    with pytest.raises(openai.BadRequestError) as e:
        cli.completions.create(model="tiny", prompt="x" * 3000, max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        cli.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    ok = cli.completions.create(model="tiny", prompt="still here", max_tokens=1)
    assert ok.usage.completion_tokens == 1
    wait_idle(marconi_server.url)


def test_client_disconnect_frees_the_request(marconi_server: ServerHandle) -> None:
    url = marconi_server.url
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # first token arrived; now hang up mid-stream
    wait_idle(url)
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(f"{url}/v1/completions", json=body, timeout=1.0)
    wait_idle(url)
    metrics = httpx.get(f"{url}/metrics").text
    assert 'marconi_requests_total{finish_reason="abort"} 2.0' in metrics


def test_debug_memory_reports_the_heap_and_the_idle_trim(marconi_server: ServerHandle) -> None:
    url, engine = marconi_server.url, marconi_server.engine
    default = engine.trimmer
    assert default is not None and default.interval == 10.0  # --heap-trim-interval's default
    engine.trimmer = HeapTrimmer(0.01)  # the engine thread reads it on every pass
    try:
        httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        wait_idle(url)
        deadline = time.monotonic() + 10
        while (body := httpx.get(f"{url}/debug/memory").json())["trimmer"]["trims"] < 1:
            assert time.monotonic() < deadline, body  # idle after serving: trimmed once
            time.sleep(0.05)
    finally:
        engine.trimmer = default
    assert body["rss"] > 100 and body["trimmer"]["interval_s"] == 0.01
    if body["in_use"] is not None:  # glibc
        assert 0 < body["in_use"] < body["arena"] + body["mmapped"]


def test_a_server_freezes_what_lives_as_long_as_it_until_stopped() -> None:
    """Full collections would walk the model's and imports' objects (70-110 ms pauses of the
    engine thread measured with `small`); the server freezes them once started."""
    srv = start_server()
    try:
        assert gc.get_freeze_count() > 10_000
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        stop_server(srv)
    assert gc.get_freeze_count() == 0  # thawed: a stopped server's objects can be collected


def test_launch_server_cli_starts_logs_and_serves() -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "marconi.launch_server", "--port", str(port)]
    cmd += ["--cache-memory", "32MB", "--num-threads", "1", "--prefix-cache", "sglang+"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "marconi serving" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            line = proc.stderr.readline()
        assert "prefix cache sglang+" in line and f"127.0.0.1:{port}" in line
        cli = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        resp = cli.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert resp.usage.completion_tokens == 2
    finally:
        proc.terminate()
        proc.wait(30)


def test_flags_mirror_sglang() -> None:
    eng, srv, _ = parse_args(["--model-path", "tiny", "--disable-radix-cache", "--port", "1234"])
    assert eng.model == "tiny" and eng.prefix_cache == "none" and srv.port == 1234
    eng, _, _ = parse_args(["--prefix-cache", "vllm+", "--alpha", "0.5", "--cache-memory", "0.1"])
    assert eng.prefix_cache == "vllm+" and eng.alpha == "0.5" and eng.cache_bytes > 0
    with pytest.raises(SystemExit):
        parse_args(["--prefix-cache", "lru-magic"])
