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


def chat_sessions(
    sessions: int = 8, turns: int = 6, seed: int = 2, prompt: int = 300, reply: int = 40
) -> list[Request]:
    """Interleaved multi-turn chats: turn k+1's prompt is turn k's prompt + its reply + a new
    user message, so the next turn extends exactly the tokens turn k fed. Each round of turns
    visits the sessions in a fresh random order."""
    rng = np.random.default_rng(seed)
    history = {s: _ids(rng, prompt, 0) for s in range(sessions)}
    out = []
    for t in range(turns):
        for s in rng.permutation(sessions).tolist():
            answer = _ids(rng, reply, 0)
            out.append(Request(f"c{s}", t, float(len(out)), history[s], answer))
            history[s] = np.concatenate([history[s], answer, _ids(rng, 30, 0)])
    return out


def small_cache(
    tokens: int, states: int, admission: str, eviction: str = "lru", **admission_args: object
):
    """A paper-7b cache whose shared budget holds ``tokens`` tokens of KV + ``states`` states
    (test/sim cannot import the top-level conftest in a whole-suite run)."""
    from marconi.cache.cost import load_cost_model
    from marconi.cache.pools import MemoryBudget
    from marconi.cache.prefix_cache import CacheConfig, PrefixCache

    cost = load_cost_model("paper-7b")
    budget = MemoryBudget.shared(tokens * cost.kv_bytes_per_token + states * cost.state_bytes)
    return PrefixCache(cost, budget, CacheConfig(admission, admission_args, eviction))


def block_chains(chains: int = 6, turns: int = 6, block: int = 512, seed: int = 3) -> list[Request]:
    """Block-granular reuse, as in Mooncake: every request is its own session, and the next
    request of a chain repeats this one's input up to its last block boundary, then adds a new
    block and a fresh partial block. The shared prefix ends at a block-aligned input position,
    never where a request's input or output ended."""
    rng = np.random.default_rng(seed)
    blocks = {c: _ids(rng, block, 0) for c in range(chains)}
    out = []
    for t in range(turns):
        for c in rng.permutation(chains).tolist():
            tail = _ids(rng, int(rng.integers(50, block - 50)), 0)
            out.append(Request(f"b{c}-{t}", 0, float(len(out)), np.concatenate([blocks[c], tail]),
                               _ids(rng, 8, 0)))  # fmt: skip
            blocks[c] = np.concatenate([blocks[c], _ids(rng, block, 0)])
    return out


def ending_chats(
    sessions: int = 8, requests: int = 400, seed: int = 4, end_len: int = 700
) -> list[Request]:
    """``chat_sessions`` whose conversations end once their history passes ``end_len``
    tokens (as ShareGPT's, split near a length limit), a new one starting in its place: a
    short conversation's tip is always resumed, one past ``end_len`` never."""
    rng = np.random.default_rng(seed)
    history = {s: _ids(rng, 300, 0) for s in range(sessions)}
    session = list(range(sessions))  # the conversation each slot holds, and its turn
    turn = [0] * sessions
    out: list[Request] = []
    while len(out) < requests:
        for s in rng.permutation(sessions).tolist():
            answer = _ids(rng, 40, 0)
            out.append(Request(f"e{session[s]}", turn[s], float(len(out)), history[s], answer))
            history[s] = np.concatenate([history[s], answer, _ids(rng, 30, 0)])
            turn[s] += 1
            if len(history[s]) > end_len:  # this conversation ended: another starts
                history[s], session[s], turn[s] = _ids(rng, 300, 0), max(session) + 1, 0
    return out
