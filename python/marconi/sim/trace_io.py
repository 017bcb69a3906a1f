"""Trace records and files: ``Request``, where the shared traces live, and our two JSONL formats
(ours and the public Marconi reference simulator's). The loaders are in ``marconi.sim.traces``."""

from __future__ import annotations

import json
import lzma
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

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
    def num_fed_tokens(self) -> int:
        """``len(self.fed_ids)``, without building it."""
        return self.num_input_tokens + max(self.num_output_tokens - 1, 0)

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
    """``path``, or the ``kind`` trace's file in ``default_trace_dir()``; FileNotFoundError
    if it is not there (naming ``MARCONI_TRACES`` only where that directory was looked in)."""
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{kind} trace file {path} does not exist")
        return Path(path)
    p = default_trace_dir() / TRACE_FILES[kind]
    if not p.is_file():
        raise FileNotFoundError(
            f"{kind} trace not found at {p}; set MARCONI_TRACES to the directory holding "
            f"{TRACE_FILES[kind]} (default: <repo root>/../shared/traces)"
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
