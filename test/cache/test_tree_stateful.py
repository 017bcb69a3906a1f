"""Property-based tests: random request lifecycles against a brute-force reference model.

Checked after every step: no false hits (every reported prefix is a true prefix of an inserted
sequence, every usable prefix ends at an admitted state), exact accounting
(``check_integrity(deep=True)``), the budget is never exceeded (meter peaks), and pinned entries
survive. With an unlimited budget the hit lengths must equal the reference's exactly.
"""

from __future__ import annotations

import numpy as np
from conftest import abort, finish, make_cache, start
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from marconi.cache.lease import Lease

SEQ = st.lists(st.integers(0, 3), min_size=1, max_size=24)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class CacheMachine(RuleBasedStateMachine):
    kind = "hybrid"
    tokens, states, page_size = 60, 4, 1
    admission, eviction, alpha = "every-n", "lru", 0.0
    unlimited = False

    def __init__(self) -> None:
        super().__init__()
        extra = {"n": 4} if self.admission == "every-n" else {}
        self.cache = make_cache(
            self.kind,
            tokens=self.tokens,
            states=self.states,
            admission=self.admission,
            eviction=self.eviction,
            alpha=self.alpha,
            page_size=self.page_size,
            shared=not self.unlimited,
            **extra,
        )
        self.running: list[tuple[tuple[int, ...], Lease]] = []
        self.inserted: list[tuple[int, ...]] = []
        self.state_prefixes: set[tuple[int, ...]] = set()

    @rule(seq=SEQ)
    def start_request(self, seq: list[int]) -> None:
        lease = start(self.cache, np.array(seq, dtype=np.int64), len(seq) + 3)
        if lease is not None:
            self.running.append((tuple(seq), lease))
            self._check_match(tuple(seq[:-1]), lease.match)  # the last-token rule

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), out=st.integers(0, 3))
    def finish_request(self, i: int, out: int) -> None:
        """Finish after feeding ``out`` decoded tokens (0 .. 3) past the input."""
        inp, lease = self.running.pop(i % len(self.running))
        seq = inp + tuple(range(10, 10 + out))
        offered = {pos for pos in lease.captures if pos <= len(inp)}
        offered.update(self.cache.plan_decode(len(inp), len(seq)))  # decode captures + working
        finish(self.cache, lease, np.array(seq, dtype=np.int64))
        self.inserted.append(seq)
        p = self.cache.page_size
        self.state_prefixes.update(
            seq[:pos] for pos in offered if pos % p == 0 and pos <= len(seq) - len(seq) % p
        )

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def abort_request(self, i: int) -> None:
        abort(self.cache, self.running.pop(i % len(self.running))[1])

    @rule(seq=SEQ)
    def match(self, seq: list[int]) -> None:
        tokens = np.array(seq, dtype=np.int64)
        tree = self.cache.tree
        before = (tree.clock, [(n.last_access, n.hits) for n in tree.iter_nodes()])
        peeked = self.cache.usable_len(tokens)  # the scheduler's read-only lookup
        assert (tree.clock, [(n.last_access, n.hits) for n in tree.iter_nodes()]) == before
        result = self.cache.match(tokens)
        assert peeked == result.usable_len
        self._check_match(tuple(seq), result)

    @rule(kv=st.integers(0, 80), states=st.integers(0, 5))
    def evict(self, kv: int, states: int) -> None:
        self.cache.evict(kv_slots=kv if self.cache.pools.kv else 0, state_slots=states)

    def _check_match(self, seq: tuple[int, ...], m) -> None:
        p = self.cache.page_size
        best = max((_common(seq, s) for s in self.inserted), default=0)
        best -= best % p
        assert m.usable_len <= m.kv_len <= best, "reported a prefix that was never cached"
        if self.kind != "attention" and m.usable_len:
            assert seq[: m.usable_len] in self.state_prefixes, "usable prefix without a state"
        if m.kv is not None:
            assert len(m.kv) == m.usable_len // p
        if self.unlimited:
            assert m.kv_len == best
            if self.kind != "attention":
                deepest = max(
                    (n for n in range(p, len(seq) + 1, p) if seq[:n] in self.state_prefixes),
                    default=0,
                )
                assert m.usable_len == deepest
            else:
                assert m.usable_len == best

    @invariant()
    def accounting_is_exact(self) -> None:
        self.cache.check_integrity(deep=True)
        for meter in self.cache.pools.meters:
            assert meter.peak <= meter.capacity

    @invariant()
    def pinned_entries_survive(self) -> None:
        for _, lease in self.running:
            node = lease.match.node
            assert node is self.cache.tree.root or node.parent is not None
            assert node.state == lease.match.state


def _machine(name: str, **attrs: object) -> type[CacheMachine]:
    cls = type(name, (CacheMachine,), attrs)
    cls.TestCase.settings = settings(
        max_examples=100,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    return cls


TestHybridLRU = _machine("HybridLRU").TestCase
TestHybridMarconiFlopAware = _machine(
    "HybridMarconi", admission="marconi", eviction="flop-aware", alpha=2.0
).TestCase
TestHybridPaged = _machine("HybridPaged", page_size=4, eviction="flop-aware", alpha=1.0).TestCase
TestHybridUnlimited = _machine(
    "HybridUnlimited", unlimited=True, tokens=10**6, states=10**4
).TestCase
TestAttentionUnlimited = _machine(
    "AttentionUnlimited", kind="attention", unlimited=True, tokens=10**6
).TestCase
TestAttentionBounded = _machine("AttentionBounded", kind="attention", tokens=40).TestCase
TestPureSSM = _machine("PureSSM", kind="ssm", admission="marconi", states=3).TestCase
