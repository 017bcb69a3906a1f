"""Small synthetic traces whose best eviction alpha is known by construction."""

from __future__ import annotations

import numpy as np
from marconi.sim.traces import Request


def _ids(rng: np.random.Generator, n: int, base: int) -> np.ndarray:
    return base + rng.integers(0, 1_000_000, size=n)


def recurring_docs(n: int = 300, seed: int = 0, t0: float = 0.0, base: int = 0) -> list[Request]:
    """Long documents asked about again and again, among many short one-off prompts.
    Keeping the long documents' states (high FLOPs per byte) wins: the best alpha is > 0."""
    rng = np.random.default_rng(seed)
    docs = [_ids(rng, 3000, base) for _ in range(3)]
    out = []
    for i in range(n):
        if i % 6 == 0:
            doc = docs[(i // 6) % len(docs)]
            inp = np.concatenate([doc, _ids(rng, 20, base)])
        else:
            inp = _ids(rng, 200, base)
        out.append(Request(f"r{base}-{i}", 0, t0 + i, inp, _ids(rng, 4, base)))
    return out


def one_off_docs_and_chats(
    n: int = 300, seed: int = 1, t0: float = 0.0, base: int = 0
) -> list[Request]:
    """Long one-off documents (high FLOPs per byte, never reused) among short chats that keep
    continuing. Recency wins: the best alpha is 0."""
    rng = np.random.default_rng(seed)
    chats = {k: _ids(rng, 150, base) for k in range(6)}
    out = []
    for i in range(n):
        if i % 4 == 0:
            inp, sid = _ids(rng, 3000, base), f"doc{base}-{i}"
            outp = _ids(rng, 4, base)
        else:
            k = int(rng.integers(0, len(chats)))
            inp, sid = np.concatenate([chats[k], _ids(rng, 10, base)]), f"chat{base}-{k}"
            outp = _ids(rng, 20, base)
            chats[k] = np.concatenate([inp, outp[:-1]])
        out.append(Request(sid, i, t0 + i, inp, outp))
    return out
