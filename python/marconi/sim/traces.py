"""Request traces for the simulator: loaders for the shared real traces and two JSONL formats.

Every loader returns a ``Trace``: ``Request`` records sorted by arrival (stable on ties). Token ids
are int64 and read-only; the chat loaders (ShareGPT, SWE) return views into one shared buffer per
trace, since each prompt of a session is a prefix of that session's token stream.
See docs/traces.md for the replay rules and the file formats.
"""

from __future__ import annotations

import json
import lzma
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from tqdm import tqdm

from marconi.sim.tokenize import (
    ChatEncoder,
    PackedTrace,
    SessionStream,
    Tokenizer,
    cache_path,
    get_tokenizer,
    load_packed,
    pack_sessions,
    save_packed,
)

BLOCK_TOKENS = 512  # Mooncake hash-id block size
THINK_WORDS_PER_MINUTE = 90.0
TRACE_FILES = {
    "mooncake": "mooncake_conversation_trace.jsonl.xz",
    "sharegpt": "sharegpt_multiturn.jsonl.xz",
    "swe": "swe_agent_sessions.jsonl.xz",
}


def _readonly(x: Any) -> np.ndarray:
    arr = np.asarray(x, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.flags.writeable:
        arr = arr.view()  # freeze a view, not the caller's array
        arr.flags.writeable = False
    return arr


@dataclass(frozen=True, slots=True)
class Request:
    """One LLM call: its prompt, the tokens it generates and when it arrives."""

    session_id: str
    turn: int
    arrival: float  # seconds from trace start
    input_ids: np.ndarray  # int64 1-D, read-only
    output_ids: np.ndarray  # int64 1-D, read-only

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", _readonly(self.input_ids))
        object.__setattr__(self, "output_ids", _readonly(self.output_ids))

    @property
    def num_input_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_output_tokens(self) -> int:
        return int(self.output_ids.shape[0])

    @property
    def fed_ids(self) -> np.ndarray:
        """The tokens the model computes KV and states for: input + output[:-1] (the last
        output token is sampled, never fed)."""
        out = self.output_ids
        return np.concatenate([self.input_ids, out[:-1]]) if len(out) > 1 else self.input_ids


Trace = list[Request]


def _sorted(requests: Iterable[Request]) -> Trace:
    return sorted(requests, key=lambda r: r.arrival)  # sorted() is stable


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def default_trace_dir() -> Path:
    """``$MARCONI_TRACES``, else ``<repo root>/../shared/traces``, else ``./../shared/traces``."""
    env = os.environ.get("MARCONI_TRACES")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[3] / ".." / "shared" / "traces"
    cwd = Path.cwd() / ".." / "shared" / "traces"
    return here if here.is_dir() or not cwd.is_dir() else cwd


def _source(path: str | os.PathLike[str] | None, kind: str) -> Path:
    p = Path(path) if path is not None else default_trace_dir() / TRACE_FILES[kind]
    if not p.is_file():
        raise FileNotFoundError(
            f"{kind} trace not found at {p}; set MARCONI_TRACES to the directory holding "
            f"{TRACE_FILES.get(kind, 'the traces')} (default: <repo root>/../shared/traces)"
        )
    return p


def _open(path: str | os.PathLike[str], mode: str = "r") -> IO[str]:
    if str(path).endswith(".xz"):
        return lzma.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _json_lines(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Parsed JSON objects of a JSONL file, lazily; blank and malformed lines are skipped."""
    with _open(path) as f:
        for line in f:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                yield obj


def _resolve_tokenizer(tokenizer: Tokenizer | str | None) -> Tokenizer:
    if tokenizer is None or isinstance(tokenizer, str):
        return get_tokenizer(*(() if tokenizer is None else (tokenizer,)))
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Mooncake
# ---------------------------------------------------------------------------------------------


def load_mooncake(path: str | os.PathLike[str] | None = None, limit: int | None = None) -> Trace:
    """The Mooncake conversation trace with 512 synthetic token ids per hash id.

    Block ``h`` expands to ``h*512 + [0, 512)``; the last block is cut to ``input_length``.
    Outputs get unique negative ids, so they never match an input or another output.
    ``arrival = timestamp / 1000``, ``session_id = str(line index)``, ``turn = 0``.
    """
    src = _source(path, "mooncake")
    block = np.arange(BLOCK_TOKENS, dtype=np.int64)
    out_next = -1  # next unused output id; counts down
    requests: Trace = []
    for rec in _json_lines(src):
        if limit is not None and len(requests) >= limit:
            break
        hashes = np.asarray(rec["hash_ids"], dtype=np.int64)
        n_in, n_out = int(rec["input_length"]), int(rec["output_length"])
        if not BLOCK_TOKENS * (len(hashes) - 1) < n_in <= BLOCK_TOKENS * len(hashes):
            raise ValueError(f"{src}: input_length {n_in} does not fit {len(hashes)} blocks")
        inputs = (hashes[:, None] * BLOCK_TOKENS + block).reshape(-1)[:n_in]
        outputs = np.arange(out_next, out_next - n_out, -1, dtype=np.int64)
        out_next -= n_out
        idx = str(len(requests))
        requests.append(Request(idx, 0, float(rec["timestamp"]) / 1000.0, inputs, outputs))
    return _sorted(requests)


# ---------------------------------------------------------------------------------------------
# Chat traces (ShareGPT, SWE agent): per-session token streams packed into one buffer
# ---------------------------------------------------------------------------------------------


def _unpack(p: PackedTrace) -> Trace:
    tokens = _readonly(p.tokens)
    order = np.argsort(p.arrivals, kind="stable")
    return [
        Request(
            str(p.session_ids[i]),
            int(p.turns[i]),
            float(p.arrivals[i]),
            tokens[p.in_start[i] : p.in_end[i]],
            tokens[p.out_start[i] : p.out_end[i]],
        )
        for i in order
    ]


def _cached(
    loader: str,
    src: Path,
    args: dict[str, Any],
    tokenizer: Tokenizer,
    build: Callable[[], PackedTrace],
) -> Trace:
    path = cache_path(loader, src, args, tokenizer)
    packed = load_packed(path)
    if packed is None:
        packed = build()
        if path is not None:
            save_packed(path, packed)
    return _unpack(packed)


_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def _sharegpt_messages(conv: Any) -> list[tuple[str, str]]:
    """(role, text) of a conversation: optional system first, then user/assistant alternating.

    Unknown roles and non-text values are dropped, as are answers before the first question and
    later system turns; the conversation is cut at the first break in the alternation.
    """
    out: list[tuple[str, str]] = []
    for m in conv if isinstance(conv, list) else []:
        role = _SHAREGPT_ROLES.get(m.get("from")) if isinstance(m, dict) else None
        text = m.get("value") if role else None
        if not isinstance(text, str):
            continue
        last = out[-1][0] if out else None
        if role == "system":
            if last is None:
                out.append((role, text))
        elif (role == "user") != (last == "user"):  # alternation holds
            out.append((role, text))
        elif last is not None and last != "system":
            break
    return out


def load_sharegpt(
    path: str | os.PathLike[str] | None = None,
    num_sessions: int | None = 100,
    session_rate: float = 1.0,
    max_input_len: int = 32768,
    tokenizer: Tokenizer | str | None = None,
    seed: int = 0,
) -> Trace:
    """Multi-turn ShareGPT replayed as chat sessions.

    Turn k's prompt is the history through user message k, its output the recorded answer, so
    each prompt extends the previous prompt + output exactly. Session i starts at
    ``i / session_rate`` s; turn k+1 arrives ``words(user message k+1) / 90`` minutes after turn
    k (service time is not modelled here). A session ends before the first prompt longer than
    ``max_input_len``. ``seed=0`` takes the first ``num_sessions`` usable conversations (reading
    lazily); another seed takes them in a seeded random order. ``None`` takes all.
    """
    src = _source(path, "sharegpt")
    tok = _resolve_tokenizer(tokenizer)
    args = {"num_sessions": num_sessions, "session_rate": session_rate}
    args |= {"max_input_len": max_input_len, "seed": seed}

    def build() -> PackedTrace:
        chat = ChatEncoder(tok)
        convs: Iterable[dict[str, Any]] = _json_lines(src)
        if seed:
            convs = list(convs)
            random.Random(seed).shuffle(convs)
        sessions: list[SessionStream] = []
        with tqdm(total=num_sessions, desc="sharegpt", unit="session", disable=None) as bar:
            for conv in convs:
                if num_sessions is not None and len(sessions) >= num_sessions:
                    break
                s = SessionStream(chat, str(conv.get("id", len(sessions))))
                t = len(sessions) / session_rate
                for role, text in _sharegpt_messages(conv.get("conversations")):
                    if role == "assistant":
                        if s.prompt_len() > max_input_len:
                            break
                        s.answer(text, t)
                    else:
                        if role == "user" and s.rows:
                            t += len(text.split()) / THINK_WORDS_PER_MINUTE * 60.0
                        s.add(role, text)
                if s.rows:
                    sessions.append(s)
                    bar.update()
        return pack_sessions(sessions)

    return _cached("sharegpt", src, args, tok, build)


def load_swe(
    path: str | os.PathLike[str] | None = None,
    num_sessions: int | None = None,
    tokenizer: Tokenizer | str | None = None,
) -> Trace:
    """SWE-agent sessions: each assistant message is one request.

    Its prompt is all messages before it, its output its content; ``arrival = created -
    min(created)`` over the loaded sessions. Takes the first ``num_sessions`` sessions (all if
    None). Messages without text content are skipped; answers without ``created`` stay in the
    history but issue no request.
    """
    src = _source(path, "swe")
    tok = _resolve_tokenizer(tokenizer)

    def build() -> PackedTrace:
        chat = ChatEncoder(tok)
        sessions: list[SessionStream] = []
        with tqdm(total=num_sessions, desc="swe", unit="session", disable=None) as bar:
            for rec in _json_lines(src):
                if num_sessions is not None and len(sessions) >= num_sessions:
                    break
                s = SessionStream(chat, str(rec.get("session", len(sessions))))
                msgs = rec.get("messages")
                for m in msgs if isinstance(msgs, list) else []:
                    m = m if isinstance(m, dict) else {}
                    role, text, created = m.get("role"), m.get("content"), m.get("created")
                    if not (isinstance(role, str) and isinstance(text, str)):
                        continue
                    if role == "assistant" and isinstance(created, (int, float)):
                        s.answer(text, float(created))
                    else:
                        s.add(role, text)
                if s.rows:
                    sessions.append(s)
                    bar.update()
        packed = pack_sessions(sessions)
        t0 = packed.arrivals.min() if len(packed.arrivals) else 0.0
        return packed._replace(arrivals=packed.arrivals - t0)

    return _cached("swe", src, {"num_sessions": num_sessions}, tok, build)


# ---------------------------------------------------------------------------------------------
# JSONL formats: our own and the public Marconi reference simulator's
# ---------------------------------------------------------------------------------------------


def write_jsonl(path: str | os.PathLike[str], requests: Iterable[Request]) -> None:
    """One request a line: ``session_id, turn, arrival, input_ids, output_ids``; .xz compresses."""
    with _open(path, "w") as f:
        for r in requests:
            rec = {"session_id": r.session_id, "turn": r.turn, "arrival": r.arrival}
            rec |= {"input_ids": r.input_ids.tolist(), "output_ids": r.output_ids.tolist()}
            f.write(json.dumps(rec) + "\n")


def load_jsonl(path: str | os.PathLike[str]) -> Trace:
    """A trace written by ``write_jsonl``."""
    return _sorted(
        Request(
            str(d["session_id"]),
            int(d["turn"]),
            float(d["arrival"]),
            d["input_ids"],
            d["output_ids"],
        )
        for d in _json_lines(_source(path, "jsonl"))
    )


def write_reference_jsonl(path: str | os.PathLike[str], requests: Iterable[Request]) -> None:
    """The reference simulator's format; numeric session ids are written as integers."""
    with _open(path, "w") as f:
        for r in requests:
            canonical_int = r.session_id.isdecimal() and str(int(r.session_id)) == r.session_id
            sid: int | str = int(r.session_id) if canonical_int else r.session_id
            rec = {"session_id": sid, "turn_id": r.turn, "ts": r.arrival}
            rec |= {
                "num_input_tokens": r.num_input_tokens,
                "num_output_tokens": r.num_output_tokens,
            }
            rec |= {"input_tokens": r.input_ids.tolist(), "output_tokens": r.output_ids.tolist()}
            f.write(json.dumps(rec) + "\n")


def load_reference_jsonl(path: str | os.PathLike[str]) -> Trace:
    """A trace in the reference simulator's format: ``session_id, turn_id, ts, input_tokens``..."""
    requests = []
    for d in _json_lines(_source(path, "reference jsonl")):
        r = Request(
            str(d["session_id"]),
            int(d["turn_id"]),
            float(d["ts"]),
            d["input_tokens"],
            d["output_tokens"],
        )
        counts = (r.num_input_tokens, r.num_output_tokens)
        if counts != (d.get("num_input_tokens", counts[0]), d.get("num_output_tokens", counts[1])):
            raise ValueError(f"{path}: token counts disagree with token lists in {r.session_id}")
        requests.append(r)
    return _sorted(requests)


# A file's format, from a key of its first record.
_FORMAT_BY_KEY: dict[str, Callable[..., Trace]] = {
    "input_ids": load_jsonl,
    "input_tokens": load_reference_jsonl,
    "hash_ids": load_mooncake,
    "conversations": load_sharegpt,
    "messages": load_swe,
}
LOADERS: dict[str, Callable[..., Trace]] = {
    "mooncake": load_mooncake,
    "sharegpt": load_sharegpt,
    "swe": load_swe,
}


def load_trace(spec: str | os.PathLike[str], **kw: Any) -> Trace:
    """Load a trace by name (``mooncake``, ``sharegpt``, ``swe``) or from a (.jsonl[.xz]) path.

    For a path the format is told from the first record's keys: our JSONL, the reference
    simulator's JSONL, or a raw Mooncake/ShareGPT/SWE file. ``kw`` goes to the loader.
    """
    if isinstance(spec, str) and spec in LOADERS:
        return LOADERS[spec](**kw)
    src = _source(spec, "trace")
    first = next(_json_lines(src), None)
    loader = next((_FORMAT_BY_KEY[k] for k in (first or {}) if k in _FORMAT_BY_KEY), None)
    if loader is None:
        raise ValueError(f"{src}: unknown trace format (first record keys: {sorted(first or {})})")
    return loader(src, **kw)
