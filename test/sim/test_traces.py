"""Trace loaders: token-prefix structure, arrival rules, file formats and the tokenisation cache."""

from __future__ import annotations

import json
import lzma
import sys
from collections import defaultdict
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest

try:
    import marconi  # noqa: F401
except ImportError:  # not installed: run from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from marconi.sim import tokenize
from marconi.sim.traces import (
    TRACE_FILES,
    Request,
    default_trace_dir,
    load_jsonl,
    load_mooncake,
    load_reference_jsonl,
    load_sharegpt,
    load_swe,
    load_trace,
    write_jsonl,
    write_reference_jsonl,
)

TRACES = default_trace_dir()
needs_traces = pytest.mark.skipif(
    not all((TRACES / f).is_file() for f in TRACE_FILES.values()),
    reason=f"shared traces not found in {TRACES} (set MARCONI_TRACES)",
)


@pytest.fixture(scope="module", autouse=True)
def _cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("trace_cache")
        mp.setenv("MARCONI_CACHE_DIR", str(path))
        yield path


def raw_lines(name: str, n: int) -> list[dict[str, Any]]:
    with lzma.open(TRACES / TRACE_FILES[name], "rt", encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


def by_session(trace: list[Request]) -> dict[str, list[Request]]:
    sessions: dict[str, list[Request]] = defaultdict(list)
    for r in trace:
        sessions[r.session_id].append(r)
    return sessions


def assert_turns_extend_prefix(trace: list[Request]) -> None:
    for reqs in by_session(trace).values():
        assert [r.turn for r in reqs] == list(range(len(reqs)))
        assert all(a.arrival <= b.arrival for a, b in pairwise(reqs))
        for prev, nxt in pairwise(reqs):
            ctx = np.concatenate([prev.input_ids, prev.output_ids])
            assert nxt.num_input_tokens > len(ctx)
            np.testing.assert_array_equal(nxt.input_ids[: len(ctx)], ctx)


def make_request(sid: str, turn: int, arrival: float, n_in: int, n_out: int) -> Request:
    return Request(sid, turn, arrival, np.arange(n_in), 1000 + np.arange(n_out))


# --- Request -----------------------------------------------------------------------------------


def test_request_arrays_are_int64_readonly_views_leaving_caller_array_writeable() -> None:
    ids = np.arange(5, dtype=np.int32)
    r = Request("s", 0, 0.0, ids, [7, 8])
    assert r.input_ids.dtype == np.int64 and r.output_ids.dtype == np.int64
    assert not r.input_ids.flags.writeable and not r.output_ids.flags.writeable
    assert (r.num_input_tokens, r.num_output_tokens) == (5, 2)
    own = np.arange(3, dtype=np.int64)
    Request("s", 0, 0.0, own, own)
    assert own.flags.writeable
    with pytest.raises(ValueError):
        Request("s", 0, 0.0, np.zeros((2, 2)), own)


def test_fed_tokens_are_the_input_and_every_output_but_the_last() -> None:
    for out in ([], [7], [7, 8, 9]):
        r = Request("s", 0, 0.0, np.arange(5), out)
        assert r.fed_ids.tolist() == [*range(5), *out[:-1]]
        assert r.num_fed_tokens == len(r.fed_ids)


# --- Mooncake ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mooncake() -> list[Request]:
    return load_mooncake(limit=200)


@needs_traces
def test_mooncake_lengths_and_partial_last_block_match_the_file(mooncake: list[Request]) -> None:
    raw = raw_lines("mooncake", 200)
    trace = sorted(mooncake, key=lambda r: int(r.session_id))
    for rec, r in zip(raw, trace, strict=True):
        hashes, n = rec["hash_ids"], rec["input_length"]
        assert r.num_input_tokens == n and r.num_output_tokens == rec["output_length"]
        assert r.arrival == rec["timestamp"] / 1000
        tail = n - 512 * (len(hashes) - 1)
        np.testing.assert_array_equal(r.input_ids[-tail:], hashes[-1] * 512 + np.arange(tail))


@needs_traces
def test_mooncake_equal_hash_prefixes_give_equal_token_prefixes(mooncake: list[Request]) -> None:
    raw = {str(i): rec["hash_ids"] for i, rec in enumerate(raw_lines("mooncake", 200))}
    checked = 0
    for a, b in pairwise(mooncake):
        ha, hb = raw[a.session_id], raw[b.session_id]
        k = next((i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y), None)
        if k is None or k == 0:
            continue
        np.testing.assert_array_equal(a.input_ids[: 512 * k], b.input_ids[: 512 * k])
        assert a.input_ids[512 * k] != b.input_ids[512 * k]
        checked += 1
    assert checked > 0


@needs_traces
def test_mooncake_outputs_never_collide_with_inputs_or_each_other(mooncake: list[Request]) -> None:
    outs = np.concatenate([r.output_ids for r in mooncake])
    assert len(np.unique(outs)) == len(outs)
    assert outs.max() < 0 <= min(int(r.input_ids.min()) for r in mooncake)
    assert all(a.arrival <= b.arrival for a, b in pairwise(mooncake))


# --- ShareGPT ----------------------------------------------------------------------------------


@needs_traces
def test_sharegpt_turns_extend_previous_input_plus_output() -> None:
    trace = load_sharegpt(num_sessions=5, session_rate=2.0)
    sessions = by_session(trace)
    assert len(sessions) == 5 and any(len(s) > 1 for s in sessions.values())
    assert_turns_extend_prefix(trace)
    starts = sorted(s[0].arrival for s in sessions.values())
    assert starts == [i / 2.0 for i in range(5)]


@needs_traces
def test_sharegpt_think_time_is_words_of_next_user_message_at_90_wpm() -> None:
    conv = raw_lines("sharegpt", 1)[0]["conversations"]
    assert [m["from"] for m in conv[:3]] == ["human", "gpt", "human"]
    t0, t1 = (r.arrival for r in load_sharegpt(num_sessions=1)[:2])
    assert t1 - t0 == pytest.approx(len(conv[2]["value"].split()) / 90 * 60)


@needs_traces
def test_sharegpt_cap_ends_session_before_first_long_prompt() -> None:
    full = by_session(load_sharegpt(num_sessions=5, max_input_len=1 << 30))
    capped = load_sharegpt(num_sessions=5, max_input_len=1500)
    assert capped and max(r.num_input_tokens for r in capped) <= 1500
    for sid, reqs in by_session(capped).items():
        kept = [r for r in full[sid] if r.num_input_tokens <= 1500]
        assert len(reqs) <= len(kept)
        first_long = next((r.turn for r in full[sid] if r.num_input_tokens > 1500), None)
        assert first_long is None or len(reqs) == first_long


# --- SWE agent ---------------------------------------------------------------------------------


@needs_traces
def test_swe_prompts_extend_within_session_and_arrivals_come_from_created() -> None:
    trace = load_swe(num_sessions=2)
    assert_turns_extend_prefix(trace)
    raw = raw_lines("swe", 2)
    created = {
        rec["session"]: [m["created"] for m in rec["messages"] if m["role"] == "assistant"]
        for rec in raw
    }
    t0 = min(min(c) for c in created.values())
    for sid, reqs in by_session(trace).items():
        assert [r.arrival for r in reqs] == [c - t0 for c in created[sid]]
    assert trace[0].arrival == 0.0


# --- JSONL formats and dispatch ----------------------------------------------------------------

SMALL = [make_request("0", 0, 0.0, 4, 2), make_request("a-b", 1, 0.5, 6, 3)]


def assert_same(a: list[Request], b: list[Request]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.session_id, x.turn, x.arrival) == (y.session_id, y.turn, y.arrival)
        np.testing.assert_array_equal(x.input_ids, y.input_ids)
        np.testing.assert_array_equal(x.output_ids, y.output_ids)


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.xz"])
def test_own_and_reference_jsonl_round_trip(tmp_path: Path, name: str) -> None:
    write_jsonl(tmp_path / name, SMALL)
    assert_same(load_jsonl(tmp_path / name), SMALL)
    assert_same(load_trace(str(tmp_path / name)), SMALL)
    ref = tmp_path / f"ref-{name}"
    write_reference_jsonl(ref, SMALL)
    with lzma.open(ref, "rt") if name.endswith("xz") else ref.open() as f:
        first = json.loads(f.readline())
    assert first["session_id"] == 0 and first["num_input_tokens"] == 4 and first["ts"] == 0.0
    assert_same(load_reference_jsonl(ref), SMALL)
    assert_same(load_trace(ref), SMALL)


def test_reference_jsonl_rejects_counts_that_disagree_with_tokens(tmp_path: Path) -> None:
    rec = {"session_id": 0, "turn_id": 0, "ts": 0.0, "num_input_tokens": 3, "num_output_tokens": 0}
    rec |= {"input_tokens": [1, 2], "output_tokens": []}
    (tmp_path / "bad.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match="disagree"):
        load_reference_jsonl(tmp_path / "bad.jsonl")


def test_load_trace_errors_name_the_trace_names_or_the_format(tmp_path: Path) -> None:
    # a path that is not there may be a misspelt name: the names are listed
    with pytest.raises(FileNotFoundError, match=r"no such trace file.*mooncake, sharegpt, swe"):
        load_trace(str(tmp_path / "missing.jsonl"))
    # a loader given a path that is not there says so (MARCONI_TRACES is not where it looked)
    with pytest.raises(FileNotFoundError, match=r"^sharegpt trace file .*missing.json does not"):
        load_sharegpt(path=tmp_path / "missing.json")
    (tmp_path / "odd.jsonl").write_text('{"foo": 1}\n')
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(tmp_path / "odd.jsonl")


def test_missing_trace_dir_raises_helpful_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MARCONI_TRACES", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="MARCONI_TRACES"):
        load_trace("mooncake")


@needs_traces
def test_load_trace_dispatches_names_and_raw_files() -> None:
    assert_same(load_trace("mooncake", limit=5), load_mooncake(limit=5))
    assert_same(load_trace(TRACES / TRACE_FILES["mooncake"], limit=5), load_mooncake(limit=5))
    assert_same(load_trace("sharegpt", num_sessions=2), load_sharegpt(num_sessions=2))


# --- Tokenisation and cache --------------------------------------------------------------------


class CountingTokenizer:
    """The real encoding, counting calls; ``name`` makes its output cacheable."""

    def __init__(self, name: str | None) -> None:
        self.inner = tokenize.get_tokenizer()
        self.name = name
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return self.inner.encode_ordinary(text)


@needs_traces
def test_second_load_hits_the_cache_and_returns_equal_arrays(_cache_in_tmp: Path) -> None:
    first_tok, second_tok = CountingTokenizer("cl100k_base"), CountingTokenizer("cl100k_base")
    first = load_sharegpt(num_sessions=3, session_rate=0.25, tokenizer=first_tok)
    assert first_tok.calls > 0 and list(_cache_in_tmp.glob("sharegpt-*.npz"))
    second = load_sharegpt(num_sessions=3, session_rate=0.25, tokenizer=second_tok)
    assert second_tok.calls == 0
    assert_same(first, second)
    assert not second[0].input_ids.flags.writeable


@needs_traces
def test_unnamed_tokenizer_is_not_cached(_cache_in_tmp: Path) -> None:
    before = set(_cache_in_tmp.iterdir())
    load_swe(num_sessions=1, tokenizer=CountingTokenizer(None))
    assert set(_cache_in_tmp.iterdir()) == before


def test_long_texts_are_encoded_in_chunks() -> None:
    tok = tokenize.get_tokenizer()
    text = "line of some text\n" * 20_000  # 360k characters, over one chunk
    ids = tokenize.encode(tok, text)
    assert ids.dtype == np.int64 and len(ids) > 20_000
    assert tok.decode(ids.tolist()) == text
