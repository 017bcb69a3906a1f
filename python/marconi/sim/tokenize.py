"""Offline BPE tokenisation of chat traces and the on-disk cache of tokenised traces.

A chat message is encoded as ``header(role) + content + "\\n"`` with ``header = "<|role|>\\n"``,
each message tokenised on its own, so a conversation's token stream only ever grows at the end:
every prompt is an exact token prefix of the next one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

DEFAULT_ENCODING = "cl100k_base"
# bpe_openai refuses texts of 1M characters or 200k tokens; split long texts at line breaks.
_CHUNK_CHARS = 100_000
# Bump when the loaders change what they produce, so stale cache files are not reused.
CACHE_VERSION = 1


class Tokenizer(Protocol):
    """What the loaders need: tiktoken-style ``encode`` (``encode_ordinary`` is preferred)."""

    def encode(self, text: str) -> list[int]: ...


@lru_cache(maxsize=4)
def get_tokenizer(name: str = DEFAULT_ENCODING) -> Tokenizer:
    """The offline BPE encoding ``name`` (tiktoken-compatible, from ``bpe_openai``)."""
    import bpe_openai

    return bpe_openai.get_encoding(name)


def tokenizer_name(tokenizer: Tokenizer) -> str | None:
    """A stable name for cache keys; None (nothing is cached) when the tokenizer has none."""
    name = getattr(tokenizer, "name", None)
    return name if isinstance(name, str) and name else None


def encode(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """Token ids of ``text`` as int64; special-token text is encoded as ordinary text."""
    enc = getattr(tokenizer, "encode_ordinary", None) or tokenizer.encode
    if len(text) <= _CHUNK_CHARS:
        return np.asarray(enc(text), dtype=np.int64)
    parts: list[np.ndarray] = []
    start = 0
    while start < len(text):
        end = min(start + _CHUNK_CHARS, len(text))
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        parts.append(np.asarray(enc(text[start:end]), dtype=np.int64))
        start = end
    return np.concatenate(parts)


class ChatEncoder:
    """Encodes chat messages with the role template; headers are tokenised once per role."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._headers: dict[str, np.ndarray] = {}
        self.sep = encode(tokenizer, "\n")

    def header(self, role: str) -> np.ndarray:
        """Token ids of ``"<|role|>\\n"``."""
        ids = self._headers.get(role)
        if ids is None:
            ids = self._headers[role] = encode(self.tokenizer, f"<|{role}|>\n")
        return ids

    def content(self, text: str) -> np.ndarray:
        """Token ids of a message body (no header, no separator)."""
        return encode(self.tokenizer, text)


class PackedTrace(NamedTuple):
    """A trace as columns; request i's tokens are slices of one shared ``tokens`` buffer.

    input = tokens[in_start[i]:in_end[i]], output = tokens[out_start[i]:out_end[i]].
    """

    tokens: np.ndarray
    in_start: np.ndarray
    in_end: np.ndarray
    out_start: np.ndarray
    out_end: np.ndarray
    session_ids: np.ndarray  # unicode strings
    turns: np.ndarray
    arrivals: np.ndarray


class SessionStream:
    """One chat session's growing token stream and its requests as (turn, arrival, spans) rows."""

    def __init__(self, chat: ChatEncoder, session_id: str) -> None:
        self.chat, self.session_id = chat, session_id
        self.parts: list[np.ndarray] = []
        self.n = 0
        self.rows: list[tuple[int, float, int, int, int]] = []  # turn, arrival, in_end, out span

    def add(self, role: str, text: str) -> None:
        for ids in (self.chat.header(role), self.chat.content(text), self.chat.sep):
            self.parts.append(ids)
            self.n += len(ids)

    def prompt_len(self) -> int:
        """Length of the prompt the next assistant message would answer."""
        return self.n + len(self.chat.header("assistant"))

    def answer(self, text: str, arrival: float) -> None:
        """Record a request whose prompt is the stream so far and whose output is ``text``."""
        in_end = self.prompt_len()
        self.add("assistant", text)
        self.rows.append((len(self.rows), arrival, in_end, in_end, self.n - len(self.chat.sep)))


def pack_sessions(sessions: list[SessionStream]) -> PackedTrace:
    """Concatenate the sessions' streams (cut after their last output) into one PackedTrace."""
    buffers: list[np.ndarray] = []
    spans: list[tuple[int, int, int, int, int]] = []  # in_start, in_end, out_start, out_end, turn
    arrivals: list[float] = []
    base = 0
    for s in sessions:
        used = max(row[4] for row in s.rows)
        buffers.append(np.concatenate(s.parts)[:used])
        for turn, arrival, in_end, out_start, out_end in s.rows:
            spans.append((base, base + in_end, base + out_start, base + out_end, turn))
            arrivals.append(arrival)
        base += used
    cols = np.asarray(spans, dtype=np.int64).reshape(-1, 5).T
    return PackedTrace(
        tokens=np.concatenate(buffers) if buffers else np.zeros(0, np.int64),
        in_start=cols[0],
        in_end=cols[1],
        out_start=cols[2],
        out_end=cols[3],
        session_ids=np.asarray([s.session_id for s in sessions for _ in s.rows], dtype=np.str_),
        turns=cols[4],
        arrivals=np.asarray(arrivals, dtype=np.float64),
    )


def cache_dir() -> Path:
    """``$MARCONI_CACHE_DIR``, else ``$XDG_CACHE_HOME/marconi/traces`` (``~/.cache`` default)."""
    env = os.environ.get("MARCONI_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "marconi" / "traces"


def cache_path(
    loader: str, source: Path, args: dict[str, Any], tokenizer: Tokenizer
) -> Path | None:
    """Cache file for ``loader(source, **args)``; keyed on the source's size and mtime.

    None when the tokenizer has no name (its output cannot be identified across runs).
    """
    name = tokenizer_name(tokenizer)
    if name is None:
        return None
    st = source.stat()
    key = {
        "loader": loader,
        "version": CACHE_VERSION,
        "source": str(source.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "args": args,
        "tokenizer": name,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"{loader}-{digest}.npz"


def save_packed(path: Path, packed: PackedTrace) -> None:
    """Write ``packed`` atomically; a failure (read-only disk...) only warns."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez_compressed(f, **packed._asdict())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        warnings.warn(f"could not write trace cache {path}: {exc}", stacklevel=2)


def load_packed(path: Path | None) -> PackedTrace | None:
    """The cached trace at ``path``, or None if absent or unreadable."""
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return PackedTrace(**{f: z[f] for f in PackedTrace._fields})
    except (OSError, ValueError, KeyError):
        return None
