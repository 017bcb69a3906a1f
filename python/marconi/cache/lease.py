"""The request lifecycle, once: what a request may resume from, what it holds, what it gives back.

Every user of the cache core drives requests through ``Leases`` (torch-free): the engine's
``CacheManager`` (which adds only the tensor copies the lease asks for), the simulator's
``Replayer``, the oracle, the alpha tuners' what-if replays (``Leases.replay``) and the tests.

1. ``begin(tokens, max_fed)``: match ``rule.key(tokens)`` (the match rule: which prefix of the
   input a request may resume from), lock the matched node, allocate KV pages for ``max_fed``
   tokens (prompt + every token it may decode, so a running request never runs short), a working
   state slot (restored from ``Lease.restore_from`` by whoever owns the tensors), and one slot per
   prefill capture the admission policy plans on the tree as matched (skipped when memory is
   short). ``None`` (and
   nothing held) if it does not fit even after evicting every unlocked entry.
2. ``capture(lease, fed)``: before a decode step moves the working state past ``fed`` tokens; at a
   capture point (``PrefixCache.capture_points``) it frees decode captures the policy no longer
   wants and returns a new slot for a copy of the working state. Elsewhere it does nothing, so a
   replay that calls it only at the capture points does exactly what a step-by-step engine does.
3. ``finish(lease, fed_tokens)``: insert the fed sequence with the captures and the working state
   the final plan keeps; the tree adopts what it keeps and frees the rest; unlock.
   ``abort(lease)``: free everything; unlock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from marconi.cache.admission import PrefillPlan
from marconi.registry import Registry

if TYPE_CHECKING:
    from marconi.cache.node import MatchResult
    from marconi.cache.prefix_cache import PrefixCache

_NO_KV = np.empty(0, dtype=np.int64)

#: finish observer: (input ids, fed tokens) of every finished request (the alpha tuner)
FinishObserver = Callable[[np.ndarray, np.ndarray], None]


class MatchRule(ABC):
    """Which prefix of a request's input it may resume from (the key it is matched with)."""

    name: ClassVar[str]

    @abstractmethod
    def key(self, tokens: np.ndarray) -> np.ndarray:
        """The tokens to match; a prefix of ``tokens``. Pure."""


MATCH_RULES: Registry[MatchRule] = Registry("match rule")


@MATCH_RULES.register("last-token")
class LastTokenRule(MatchRule):
    """A request prefills at least its last input token (its logits pick the first output
    token): match ``tokens[:-1]``. Our engine's rule, and SGLang's (``Req._compute_max_prefix_len``:
    ``max_prefix_len = input_len - 1``)."""

    name = "last-token"

    def key(self, tokens: np.ndarray) -> np.ndarray:
        return tokens[:-1]


@MATCH_RULES.register("full")
class FullInputRule(MatchRule):
    """The whole input may be a hit (the paper's simulator): an upper bound no server reaches."""

    name = "full"

    def key(self, tokens: np.ndarray) -> np.ndarray:
        return tokens


@dataclass
class Lease:
    """What one request holds. Ownership while it runs:

    | field                 | owner                                          |
    |-----------------------|------------------------------------------------|
    | ``match.node``        | the tree (locked by this request)              |
    | ``pages[:n_prefix]``  | the tree (the matched prefix, pinned by lock)  |
    | ``pages[n_prefix:]``  | this request (in flight)                       |
    | ``working``           | this request: states after ``fed`` tokens      |
    | ``captures``          | this request: position -> checkpoint slot      |

    ``pages`` is None without a KV pool (pure SSM), ``working`` None without a state pool.
    """

    match: MatchResult
    input_len: int  # the input length the admission policy planned for
    pages: np.ndarray | None
    n_prefix: int
    working: int | None
    captures: dict[int, int] = field(default_factory=dict)
    decoded: int = 0  # decode steps before this one have been through ``capture``
    memo: object = None  # the admission's, from ``plan_prefill`` to ``insert``

    @property
    def prefix_len(self) -> int:
        """Tokens the request resumes from (their KV and the state after them are cached)."""
        return self.match.usable_len

    @property
    def restore_from(self) -> int | None:
        """The tree's state slot the working slot must be a copy of before prefill (None: start
        from zeros). A request never runs in place on a tree slot."""
        if self.working is None or self.prefix_len == 0:
            return None
        return self.match.state


class Leases:
    """The lifecycle protocol over one ``PrefixCache``; see the module docstring."""

    reuses: ClassVar[bool] = True  # False: the null protocol (no match, no plan, no insert)

    def __init__(self, cache: PrefixCache, on_finish: FinishObserver | None = None) -> None:
        self.cache = cache
        self.rule = MATCH_RULES.create(cache.config.match_rule)
        self.on_finish = on_finish

    # ------------------------------------------------------------------ sizing
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.cache.page_size)

    def fits_empty(self, num_tokens: int) -> bool:
        """Whether a request feeding ``num_tokens`` tokens fits in an empty cache (KV + working
        slot); requests that do not can never run."""
        kv, st = self.cache.pools.kv, self.cache.pools.state
        pages = self.pages_for(num_tokens) if kv is not None else 0
        if (kv is not None and pages > kv.num_slots) or (st is not None and st.num_slots < 1):
            return False
        need: dict[int, int] = {}  # bytes per meter (KV and states may share one)
        for pool, n in ((kv, pages), (st, 1)):
            if pool is not None:
                need[id(pool.meter)] = need.get(id(pool.meter), 0) + n * pool.slot_bytes
        return all(need.get(id(m), 0) <= m.capacity for m in self.cache.pools.meters)

    # ------------------------------------------------------------------ protocol
    def peek(self, tokens: np.ndarray) -> int:
        """Tokens ``begin(tokens, ...)`` would resume from now (read-only: no lock, no access
        time)."""
        return self.cache.usable_len(self.rule.key(tokens)) if self.reuses else 0

    def begin(self, tokens: np.ndarray, max_fed: int) -> Lease | None:
        """Reserve memory for a request whose input is ``tokens`` and which will feed at most
        ``max_fed`` tokens in all. None (and nothing held) if it does not fit now; a request
        that cannot fit even in the empty cache is refused before it evicts anything."""
        cache = self.cache
        if not self.fits_empty(max_fed):
            return None
        key = self.rule.key(tokens) if self.reuses else tokens[:0]
        match = cache.match(key)
        cache.lock(match.node)
        # planned on the tree as matched (as SGLang's match computes its branching seqlen),
        # before this request's own allocations evict anything
        plan = cache.plan_prefill(tokens, match, key) if self.reuses else PrefillPlan(())
        pages = None
        if cache.pools.kv is not None:
            prefix = match.kv if match.kv is not None else _NO_KV
            own = cache.alloc_kv(self.pages_for(max_fed) - len(prefix))
            if own is None:
                cache.unlock(match.node)
                return None
            pages = np.concatenate([prefix, own]).astype(np.int64, copy=False)
        working = None
        if cache.pools.state is not None:
            working = cache.alloc_state()
            if working is None:
                if pages is not None:
                    cache.free_kv(pages[len(match.kv) :])
                cache.unlock(match.node)
                return None
        n_prefix = 0 if match.kv is None else len(match.kv)
        lease = Lease(match, len(tokens), pages, n_prefix, working, memo=plan.memo)
        for pos in plan.positions:
            slot = cache.alloc_state()
            if slot is not None:  # a checkpoint is optional: skip it when memory is short
                lease.captures[pos] = slot
        return lease

    def capture(self, lease: Lease, fed: int) -> int | None:
        """Called before a decode step moves the working state from ``fed`` to ``fed + 1``
        tokens. At a capture point: free the decode captures the policy no longer plans and
        return a new slot that must receive a copy of the working state (None if memory is
        short). Elsewhere: nothing. Assumes a position dropped from ``plan_decode`` never
        comes back as the sequence grows (true of every registered policy)."""
        cache = self.cache
        lease.decoded = fed + 1
        if not self.reuses or lease.working is None:
            return None
        if not cache.capture_points(lease.input_len, fed, fed + 1):
            return None
        wanted = set(cache.plan_decode(lease.input_len, fed + 1))
        for pos in [p for p in lease.captures if p > lease.input_len and p not in wanted]:
            cache.free_state(lease.captures.pop(pos))
        slot = cache.alloc_state()
        if slot is not None:
            lease.captures[fed] = slot
        return slot

    def finish(self, lease: Lease, fed_tokens: np.ndarray) -> None:
        """The request is done; ``fed_tokens`` (prompt + outputs but the last) are the tokens
        whose KV is in ``lease.pages`` and whose final state is in ``lease.working``."""
        if not self.reuses:
            self.abort(lease)
            return
        cache, seq_len = self.cache, len(fed_tokens)
        final = set(cache.plan_decode(lease.input_len, seq_len))
        states: dict[int, int] = {}
        # | slot                          | goes to                                    |
        # | prefill capture (<= input)    | insert (the tree keeps or frees it)        |
        # | decode capture in final plan  | insert                                     |
        # | decode capture not in plan    | freed here                                 |
        # | working, seq_len in plan      | insert at seq_len (no copy)                |
        # | working otherwise             | freed here                                 |
        for pos, slot in lease.captures.items():
            if pos <= lease.input_len or pos in final:
                states[pos] = slot
            else:
                cache.free_state(slot)
        if lease.working is not None:
            if seq_len in final and seq_len not in states:
                states[seq_len] = lease.working
            else:
                cache.free_state(lease.working)
        if lease.pages is not None or states:  # a pure-SSM sequence without states adds nothing
            # frees pages past seq_len; input_len lets a learning admission see the decoded part
            cache.insert(fed_tokens, lease.pages, states, lease.input_len, lease.memo)
        cache.unlock(lease.match.node)
        lease.captures.clear()
        if self.on_finish is not None:
            self.on_finish(fed_tokens[: lease.input_len], fed_tokens)

    def abort(self, lease: Lease) -> None:
        """Give back everything the request holds (its own pages and every state slot)."""
        cache = self.cache
        if lease.pages is not None:
            cache.free_kv(lease.pages[lease.n_prefix :])
        if lease.working is not None:
            cache.free_state(lease.working)
        for slot in lease.captures.values():
            cache.free_state(slot)
        lease.captures.clear()
        cache.unlock(lease.match.node)

    # ------------------------------------------------------------------ replays (no tensors)
    def decode(self, lease: Lease, seq_len: int) -> None:
        """Every ``capture`` a step-by-step decode from where the lease is (``decoded``, at
        least the input) to ``seq_len`` fed tokens makes, in order (only the capture points:
        the other steps do nothing)."""
        start = max(lease.decoded, lease.input_len)
        for fed in self.cache.capture_points(lease.input_len, start, seq_len):
            self.capture(lease, fed)
        lease.decoded = max(lease.decoded, seq_len)

    def replay(self, input_ids: np.ndarray, fed_tokens: np.ndarray) -> Lease | None:
        """One whole request at once (begin, decode, finish): what the engine does for a request
        with this input that fed ``fed_tokens``. None if it did not fit (nothing held)."""
        lease = self.begin(input_ids, len(fed_tokens))
        if lease is not None:
            self.decode(lease, len(fed_tokens))
            self.finish(lease, fed_tokens)
        return lease


class NoReuse(Leases):
    """The null protocol (``--prefix-cache none``): the same pools and working memory, but it
    never matches, plans nor inserts; every request starts from scratch and frees everything."""

    reuses = False
