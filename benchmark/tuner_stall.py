"""What the alpha tuner costs the engine thread per finished request.

The server's engine thread calls ``Engine.tuner.observe`` when a request finishes; whatever is
in flight waits for it. This builds the engine the server would (``--prefix-cache marconi``,
``--alpha auto``) and feeds its tuner synthetic multi-turn chat turns (``--sessions``
interleaved conversations whose prompts grow by a reply and a user message per turn, reset past
``--max-len`` tokens), timing each ``observe``; no model forward runs. Prints the distribution::

    .venv/bin/python benchmark/tuner_stall.py --model tiny --cache-memory 256MB

Before session 23 the tuner replayed a whole 64-request window at once: a 70-110 ms stall every
64th request on tiny (docs/performance_log.md, fourteenth pass).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from marconi.engine.config import EngineConfig
from marconi.engine.engine import Engine


def observe_ms(engine: Engine, requests: int, sessions: int, max_len: int, seed: int) -> np.ndarray:
    """Milliseconds of each ``engine.tuner.observe`` over ``requests`` synthetic chat turns."""
    assert engine.tuner is not None, "the preset does not tune alpha"
    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    history = [rng.integers(5, vocab, 150) for _ in range(sessions)]
    out = np.empty(requests)
    for i in range(requests):
        s = i % sessions
        prompt = np.concatenate([history[s], rng.integers(5, vocab, int(rng.integers(10, 120)))])
        if len(prompt) > max_len:
            prompt = prompt[:150]  # a new conversation on the same system prompt
        reply = rng.integers(5, vocab, 16)
        fed = np.concatenate([prompt, reply[:-1]])
        t0 = time.perf_counter()
        engine.tuner.observe((prompt, fed))
        out[i] = 1e3 * (time.perf_counter() - t0)
        history[s] = np.concatenate([prompt, reply])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--cache-memory", default="256MB")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--max-len", type=int, default=900)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=args.model, cache_memory=args.cache_memory))
    ms = observe_ms(engine, args.requests, args.sessions, args.max_len, args.seed)
    print(
        f"{args.requests} observe calls ({args.model}, {args.cache_memory}): mean {ms.mean():.2f} "
        f"ms, P50 {np.median(ms):.2f}, P99 {np.percentile(ms, 99):.2f}, max {ms.max():.1f}; "
        f"over 10 ms: {int((ms > 10).sum())}"
    )


if __name__ == "__main__":
    main()
