"""Property-based API fuzzing (issue 12) against a real server on loopback: for every route, any
generated request gets a 2xx or a documented 4xx, never a 5xx (and no streamed error event);
afterwards a normal request works and the deep integrity check passes with nothing in flight.

Bodies come from a registry of per-field strategies (valid values, edge values and wrong types
for every field of the request models: a new field without a strategy fails
``test_every_model_field_has_a_strategy``), plus arbitrary JSON and arbitrary bytes. Hypothesis
runs derandomized (the same examples on every run, so CI is reproducible);
``MARCONI_FUZZ_EXAMPLES`` scales the example counts (default 1 = the CI size, docs/serving.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from marconi.launch_server import ServerHandle
from marconi.server.guard import Limits
from marconi.server.protocol import ChatCompletionRequest, CompletionRequest

from .conftest import start_server, stop_server, wait_idle

SCALE = int(os.environ.get("MARCONI_FUZZ_EXAMPLES", "1"))
#: every status a route documents (docs/serving.md); 5xx never
DOCUMENTED = {200, 400, 404, 405, 413}

json_scalar = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
any_json = st.recursive(
    json_scalar,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
huge = st.sampled_from([2**31, 2**63, 2**64, 2**70, -(2**63) - 1, 10**30])
small_count = st.integers(-2, 8)
token_ids = st.lists(st.integers(-1, 300) | huge, min_size=0, max_size=12)
text = st.text(max_size=40) | st.sampled_from(["\ud800", "a\udfff b"])  # lone surrogates


def _or_junk(s: st.SearchStrategy) -> st.SearchStrategy:
    """Valid-ish values, or a value of any JSON type."""
    return st.one_of(s, st.none(), any_json)


message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]),
        "content": st.one_of(
            text,
            st.none(),
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3),
            any_json,
        ),
    },
    optional={"name": _or_junk(text)},
)

#: field -> strategy, for every field of the request models
FIELDS: dict[str, st.SearchStrategy] = {
    "model": _or_junk(st.sampled_from(["tiny", "gpt-4o", ""])),
    "max_tokens": _or_junk(small_count | huge),
    "max_completion_tokens": _or_junk(small_count | huge),
    "temperature": _or_junk(st.floats(-1, 3) | st.sampled_from([0, 1, 2])),
    "top_p": _or_junk(st.floats(-0.5, 1.5) | st.sampled_from([0, 1])),
    "n": _or_junk(st.integers(-1, 3) | huge),
    "stream": _or_junk(st.booleans()),
    "stream_options": _or_junk(st.fixed_dictionaries({"include_usage": _or_junk(st.booleans())})),
    "stop": _or_junk(text | st.lists(text, max_size=6)),
    "seed": _or_junk(st.integers(-(2**63), 2**63 - 1) | huge),
    "logit_bias": _or_junk(
        st.dictionaries(
            st.integers(0, 300).map(str) | text, st.floats(-150, 150) | st.integers(), max_size=6
        )
    ),
    "user": _or_junk(text),
    "presence_penalty": _or_junk(st.floats(-2, 2) | st.just(0)),
    "frequency_penalty": _or_junk(st.floats(-2, 2) | st.just(0)),
    "ignore_eos": _or_junk(st.booleans()),
    "stop_token_ids": _or_junk(token_ids),
    "prompt": _or_junk(
        text | token_ids | st.lists(text, max_size=2) | st.lists(token_ids, max_size=2)
    ),
    "messages": _or_junk(st.lists(message, max_size=4)),
}
EXTRA = st.dictionaries(st.sampled_from(["bogus", "tools", "logprobs"]), any_json, max_size=1)


def bodies(model: type) -> st.SearchStrategy[dict]:
    required = {k: FIELDS[k] for k, f in model.model_fields.items() if f.is_required()}
    optional = {k: FIELDS[k] for k, f in model.model_fields.items() if not f.is_required()}
    return st.builds(
        lambda base, extra: {**base, **extra},
        st.fixed_dictionaries(required, optional=optional),
        EXTRA,
    )


ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
GET_ROUTES = ("/health", "/v1/models", "/metrics", "/debug/cache", "/debug/memory")
FUZZ = settings(
    max_examples=100 * SCALE,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerHandle]:
    limits = Limits(max_request_bytes=4096)
    srv = start_server(limits, prefix_cache="marconi", context_length=256, default_max_tokens=8)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(fuzz_server: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as cli:
        yield cli


def check(r: httpx.Response) -> None:
    assert r.status_code in DOCUMENTED, (r.status_code, r.text[:300])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [x[6:] for x in r.text.split("\n\n") if x.startswith("data: ")]
        assert events[-1] == "[DONE]", r.text[-300:]
        assert not any('"error"' in e[:10] for e in events), r.text[-300:]


def test_every_model_field_has_a_strategy() -> None:
    for model in ROUTES.values():
        assert set(model.model_fields) <= set(FIELDS), set(model.model_fields) - set(FIELDS)


def test_every_route_is_fuzzed(fuzz_server: ServerHandle) -> None:
    app = fuzz_server.server.config.app
    paths = {r.path for r in app.routes if not r.path.startswith(("/openapi", "/docs"))}
    assert paths == set(ROUTES) | set(GET_ROUTES), paths


@pytest.mark.parametrize("path", list(ROUTES))
def test_model_shaped_bodies_never_5xx(http: httpx.Client, path: str) -> None:
    @FUZZ
    @given(body=bodies(ROUTES[path]))
    def run(body: dict) -> None:
        check(http.post(path, content=json.dumps(body).encode()))

    run()


@pytest.mark.parametrize("path", list(ROUTES))
def test_any_json_or_bytes_never_5xx(http: httpx.Client, path: str) -> None:
    @settings(FUZZ, max_examples=40 * SCALE)
    @given(body=any_json.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64))
    def run(body: bytes) -> None:
        check(http.post(path, content=body))

    run()


def test_other_methods_and_queries_never_5xx(http: httpx.Client) -> None:
    @settings(FUZZ, max_examples=40 * SCALE)
    @given(
        path=st.sampled_from([*ROUTES, *GET_ROUTES, "/v1", "/v1/nope", "/"]),
        method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
        query=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
        body=st.binary(max_size=32),
    )
    def run(path: str, method: str, query: dict, body: bytes) -> None:
        r = http.request(method, path, params=query, content=body)
        if method == "GET" and path in GET_ROUTES:
            assert r.status_code == 200, r.text
        else:
            check(r)

    run()


def test_after_the_fuzz_the_server_serves_and_nothing_leaked(
    fuzz_server: ServerHandle, http: httpx.Client
) -> None:
    ok = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    wait_idle(fuzz_server.url)
