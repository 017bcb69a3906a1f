"""The only place where the engine talks to ``marconi.cache``.

One ``CacheHandle`` per running request records everything the request holds. The protocol
(the same as ``test/conftest.py``'s ``start/finish/abort``):

1. ``admit``: match ``tokens[:-1]`` (a request prefills at least one token), lock the matched
   node, allocate KV pages for the whole request (prompt + every token it may decode, so a
   running request never runs short), a working state slot restored from the matched state,
   and one slot per capture position the admission policy plans (speculative insertion gives
   the branch point). ``None`` if it does not fit even after evicting unlocked entries.
2. ``before_decode``: keeps a copy of the working state where the policy may want a decode-time
   checkpoint (positions are only final when the request finishes).
3. ``finish``: insert the fed sequence with the captured states and the final working state;
   the tree adopts what it keeps and frees the rest; unlock. ``abort``: free everything; unlock.

KV slots handed to the model are token slots: page ``g`` covers token slots
``[g * page_size, (g + 1) * page_size)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from marconi.cache.node import MatchResult, SizeInfo
    from marconi.cache.prefix_cache import PrefixCache
    from marconi.cache.tuning import AlphaTuner
    from marconi.models.memory import HybridMemory

_NO_KV = np.empty(0, dtype=np.int64)


@dataclass
class CacheHandle:
    """What one request holds. Ownership while running:

    | field                 | owner                                          |
    |-----------------------|------------------------------------------------|
    | ``match.node``        | the tree (locked by this request)              |
    | ``pages[:n_prefix]``  | the tree (the matched prefix, pinned by lock)  |
    | ``pages[n_prefix:]``  | this request (in flight)                       |
    | ``working``           | this request: states after ``fed`` tokens      |
    | ``captures``          | this request: position -> checkpoint slot      |
    """

    match: MatchResult
    pages: np.ndarray
    n_prefix: int
    working: int
    origin_len: int  # the input length the admission policy planned for
    captures: dict[int, int] = field(default_factory=dict)

    @property
    def prefix_len(self) -> int:
        """Tokens the request resumes from (their KV and the state after them are cached)."""
        return self.match.usable_len


class CacheManager:
    """Drives one ``PrefixCache`` whose state pool stores into ``memory``.

    With ``enabled=False`` (``--prefix-cache none``) it allocates from the same pools but never
    matches nor inserts: every request starts from scratch and frees everything at the end.
    """

    def __init__(
        self,
        cache: PrefixCache,
        memory: HybridMemory,
        enabled: bool = True,
        tuner: AlphaTuner | None = None,
    ) -> None:
        if cache.pools.kv is None or cache.pools.state is None:
            raise NotImplementedError("the engine serves hybrid models (attention + SSM) only")
        self.cache = cache
        self.memory = memory
        self.enabled = enabled
        self.tuner = tuner  # fed every finished request: (input ids, fed tokens)
        self.page_size = cache.page_size

    # ------------------------------------------------------------------ sizing
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def fits_empty(self, num_tokens: int) -> bool:
        """Whether a request feeding ``num_tokens`` tokens fits in an empty cache (KV + working
        slot); requests that do not can never run."""
        kv, st = self.cache.pools.kv, self.cache.pools.state
        assert kv is not None and st is not None
        pages = self.pages_for(num_tokens)
        if pages > kv.num_slots or st.num_slots < 1:
            return False
        if kv.meter is st.meter:
            return pages * kv.slot_bytes + st.slot_bytes <= kv.meter.capacity
        return pages * kv.slot_bytes <= kv.meter.capacity

    # ------------------------------------------------------------------ protocol
    def peek(self, tokens: np.ndarray) -> int:
        """Tokens ``admit(tokens, ...)`` would resume from now (read-only: no lock, no access
        time; ``tokens[:-1]`` as in ``admit``, since a request prefills at least one token)."""
        return self.cache.usable_len(tokens[:-1]) if self.enabled else 0

    def admit(self, tokens: np.ndarray, max_fed: int) -> CacheHandle | None:
        """Reserve memory for a request whose model input is ``tokens`` and which will feed at
        most ``max_fed`` tokens in all. None (and nothing held) if it does not fit now."""
        cache = self.cache
        # without a cache, match nothing: the root, a miss that changes nothing
        match = cache.match(tokens[:-1] if self.enabled else tokens[:0])
        cache.lock(match.node)
        prefix = match.kv if match.kv is not None else _NO_KV
        own = cache.alloc_kv(self.pages_for(max_fed) - len(prefix))
        if own is None:
            cache.unlock(match.node)
            return None
        working = cache.alloc_state()
        if working is None:
            cache.free_kv(own)
            cache.unlock(match.node)
            return None
        if match.usable_len > 0:
            assert match.state is not None
            self.memory.copy_state(match.state, working)  # never run in place on a tree slot
        pages = np.concatenate([prefix, own]).astype(np.int64)
        handle = CacheHandle(match, pages, len(prefix), working, len(tokens))
        if self.enabled:
            for pos in cache.plan_prefill(tokens, match):
                slot = cache.alloc_state()
                if slot is not None:  # a checkpoint is optional: skip it when memory is short
                    handle.captures[pos] = slot
        return handle

    def token_slots(self, handle: CacheHandle, start: int, end: int) -> np.ndarray:
        """KV slots of token positions ``[start, end)``."""
        pos = np.arange(start, end, dtype=np.int64)
        p = self.page_size
        return handle.pages[pos // p] * p + pos % p

    def prefill_captures(self, handle: CacheHandle, start: int, end: int) -> dict[int, int]:
        """Planned captures a prefill chunk over positions ``(start, end]`` must write."""
        return {p: s for p, s in handle.captures.items() if start < p <= end}

    def before_decode(self, handle: CacheHandle, fed: int) -> None:
        """Called before a decode step moves the working state from ``fed`` to ``fed + 1``
        tokens: copy the working state out if the policy may keep a checkpoint at ``fed``, and
        drop copies it no longer wants. Assumes a position dropped from ``decode_positions``
        never comes back as the sequence grows (true of every registered policy)."""
        if not self.enabled:
            return
        wanted = set(self.cache.plan_decode(handle.origin_len, fed + 1))
        for pos in [p for p in handle.captures if p > handle.origin_len and p not in wanted]:
            self.cache.free_state(handle.captures.pop(pos))
        if fed in wanted and fed not in handle.captures:
            slot = self.cache.alloc_state()
            if slot is not None:
                self.memory.copy_state(handle.working, slot)
                handle.captures[fed] = slot

    def finish(self, handle: CacheHandle, fed_tokens: np.ndarray) -> None:
        """The request is done; ``fed_tokens`` (prompt + outputs but the last) are the tokens
        whose KV is in ``handle.pages`` and whose final state is in ``handle.working``."""
        if not self.enabled:
            self.abort(handle)
            return
        cache, seq_len = self.cache, len(fed_tokens)
        final = set(cache.plan_decode(handle.origin_len, seq_len))
        states: dict[int, int] = {}
        # | slot                          | goes to                                    |
        # | prefill capture (<= origin)   | insert (the tree keeps or frees it)        |
        # | decode capture in final plan  | insert                                     |
        # | decode capture not in plan    | freed here                                 |
        # | working, seq_len in plan      | insert at seq_len (no copy)                |
        # | working otherwise             | freed here                                 |
        for pos, slot in handle.captures.items():
            if pos <= handle.origin_len or pos in final:
                states[pos] = slot
            else:
                cache.free_state(slot)
        if seq_len in final and seq_len not in states:
            states[seq_len] = handle.working
        else:
            cache.free_state(handle.working)
        cache.insert(fed_tokens, handle.pages, states)  # frees pages past seq_len
        cache.unlock(handle.match.node)
        handle.captures.clear()
        if self.tuner is not None:
            self.tuner.observe((fed_tokens[: handle.origin_len], fed_tokens))

    def abort(self, handle: CacheHandle) -> None:
        """Give back everything the request holds (its own pages and every state slot)."""
        self.cache.free_kv(handle.pages[handle.n_prefix :])
        self.cache.free_state(handle.working)
        for slot in handle.captures.values():
            self.cache.free_state(slot)
        handle.captures.clear()
        self.cache.unlock(handle.match.node)

    # ------------------------------------------------------------------ inspection
    def size_info(self) -> SizeInfo:
        return self.cache.size_info()

    def check_integrity(self, idle: bool = False) -> None:
        """Deep cache check; with ``idle`` also that no request holds anything."""
        self.cache.check_integrity(deep=True)
        if idle:
            info = self.cache.size_info()
            assert info.kv_in_flight == 0 and info.state_in_flight == 0, info
            assert info.kv_locked == 0 and info.state_locked == 0, info
