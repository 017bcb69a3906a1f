"""The engine's side of the request lifecycle: ``marconi.cache.lease.Leases`` plus the tensor
copies it asks for.

The lifecycle (match rule, locking, allocation, admission planning, insertion) is the cache
core's ``Leases``, the same one the simulator, the oracle and the alpha tuners run; this class
only moves state data in ``HybridMemory`` where a lease says so (restoring the matched state
into the working slot, copying the working state into a decode capture) and maps token
positions to KV slots: page ``g`` covers token slots ``[g * page_size, (g + 1) * page_size)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from marconi.cache.lease import Lease, Leases
    from marconi.cache.node import SizeInfo


class StateCopier(Protocol):
    """What the manager needs from the model's memory (``HybridMemory``; tests pass a fake)."""

    def copy_state(self, src: int, dst: int) -> None: ...


class CacheManager:
    """Drives ``leases`` (one ``PrefixCache``) with the state data in ``memory``."""

    def __init__(self, leases: Leases, memory: StateCopier) -> None:
        pools = leases.cache.pools
        if pools.kv is None or pools.state is None:
            raise NotImplementedError("the engine serves hybrid models (attention + SSM) only")
        self.leases = leases
        self.memory = memory
        self.page_size = leases.cache.page_size

    # ------------------------------------------------------------------ lifecycle
    def fits_empty(self, num_tokens: int) -> bool:
        """See ``Leases.fits_empty``."""
        return self.leases.fits_empty(num_tokens)

    def peek(self, tokens: np.ndarray) -> int:
        """See ``Leases.peek`` (read-only)."""
        return self.leases.peek(tokens)

    def admit(self, tokens: np.ndarray, max_fed: int) -> Lease | None:
        """``Leases.begin``, then the working slot restored from the matched state."""
        lease = self.leases.begin(tokens, max_fed)
        if lease is not None and lease.restore_from is not None:
            assert lease.working is not None
            try:
                self.memory.copy_state(lease.restore_from, lease.working)
            except BaseException:  # issue 12: a failed copy holds nothing
                self.leases.abort(lease)
                raise
        return lease

    def before_decode(self, lease: Lease, fed: int) -> None:
        """``Leases.capture``, then the working state copied into the new capture slot."""
        slot = self.leases.capture(lease, fed)
        if slot is not None:
            assert lease.working is not None
            self.memory.copy_state(lease.working, slot)

    def finish(self, lease: Lease, fed_tokens: np.ndarray) -> None:
        """See ``Leases.finish`` (no data moves: the tree adopts the slots as they are)."""
        self.leases.finish(lease, fed_tokens)

    def abort(self, lease: Lease) -> None:
        self.leases.abort(lease)

    # ------------------------------------------------------------------ slots for the model
    def token_slots(self, lease: Lease, start: int, end: int) -> np.ndarray:
        """KV slots of token positions ``[start, end)``."""
        assert lease.pages is not None
        pos = np.arange(start, end, dtype=np.int64)
        p = self.page_size
        return lease.pages[pos // p] * p + pos % p

    def prefill_captures(self, lease: Lease, start: int, end: int) -> dict[int, int]:
        """Planned captures a prefill chunk over positions ``(start, end]`` must write."""
        return {p: s for p, s in lease.captures.items() if start < p <= end}

    # ------------------------------------------------------------------ inspection
    def size_info(self) -> SizeInfo:
        return self.leases.cache.size_info()

    def check_integrity(self, idle: bool = False) -> None:
        """Deep cache check; with ``idle`` also that no request holds anything."""
        cache = self.leases.cache
        cache.check_integrity(deep=True)
        if idle:
            info = cache.size_info()
            assert info.kv_in_flight == 0 and info.state_in_flight == 0, info
            assert info.kv_locked == 0 and info.state_locked == 0, info
