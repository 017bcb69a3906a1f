"""Request traces for the simulator: loaders for the shared real traces and ``load_trace``.

Every loader returns a ``Trace``: ``Request`` records sorted by arrival (stable on ties). Token ids
are int64 and read-only; the chat loaders (ShareGPT, SWE) return views into one shared buffer per
trace, since each prompt of a session is a prefix of that session's token stream.
See docs/traces.md for the replay rules and the file formats. ``Request`` and the JSONL formats
live in ``marconi.sim.trace_io`` (re-exported here).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

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
from marconi.sim.trace_io import (
    TRACE_FILES,
    Request,
    Trace,
    _json_lines,
    _readonly,
    _sorted,
    _source,
    default_trace_dir,
    load_jsonl,
    load_reference_jsonl,
    write_jsonl,
    write_reference_jsonl,
)

__all__ = [  # the trace API, wherever it is defined
    "LOADERS", "TRACE_FILES", "Request", "Trace", "default_trace_dir", "load_jsonl",
    "load_mooncake", "load_reference_jsonl", "load_sharegpt", "load_swe", "load_trace",
    "write_jsonl", "write_reference_jsonl",
]  # fmt: skip

BLOCK_TOKENS = 512  # Mooncake hash-id block size
THINK_WORDS_PER_MINUTE = 90.0


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
    src = Path(spec)
    if not src.is_file():
        raise FileNotFoundError(
            f"{spec}: no such trace file, and not a trace name ({', '.join(sorted(LOADERS))};"
            " a name may take a variant, e.g. sharegpt+reasoning)"
        )
    first = next(_json_lines(src), None)
    loader = next((_FORMAT_BY_KEY[k] for k in (first or {}) if k in _FORMAT_BY_KEY), None)
    if loader is None:
        raise ValueError(f"{src}: unknown trace format (first record keys: {sorted(first or {})})")
    return loader(src, **kw)
