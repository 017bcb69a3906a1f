"""Slot pools for KV (one slot per token, or per page) and SSM states (one slot per checkpoint).

A pool hands out integer slots and charges their bytes to a ``ByteMeter``. Two pools may share one
meter (the paper's single cache budget) or have one each (separate KV and state pools, as SGLang
and real GPUs allocate). Allocation never goes past the meter: ``alloc`` returns ``None`` instead.

Pools know nothing about the tree nor about tensors: they hand out ids; the engine's
``HybridMemory`` stores the data behind them and copies it when a ``Lease`` asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

SLOT_DTYPE = np.int64


class ByteMeter:
    """A byte budget. ``used`` never exceeds ``capacity``: callers ask ``can_charge`` first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self.used = 0
        self.peak = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def can_charge(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.capacity

    def charge(self, nbytes: int) -> None:
        if not self.can_charge(nbytes):
            raise MemoryError(f"charge of {nbytes} B exceeds budget ({self.used}/{self.capacity})")
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def release(self, nbytes: int) -> None:
        if nbytes > self.used:
            raise AssertionError(f"release of {nbytes} B but only {self.used} B charged")
        self.used -= nbytes


class SlotPool:
    """Integer slots ``[0, num_slots)`` of ``slot_bytes`` each, charged to ``meter``.

    Free slots are a stack of recycled ids plus a never-used range, so memory is O(peak in use)
    even for pools with millions of slots (the simulator's large budgets).
    """

    def __init__(self, name: str, num_slots: int, slot_bytes: int, meter: ByteMeter) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"{name}: slot_bytes must be > 0, got {slot_bytes}")
        self.name = name
        self.num_slots = int(num_slots)
        self.slot_bytes = int(slot_bytes)
        self.meter = meter
        self._recycled = np.empty(0, dtype=SLOT_DTYPE)
        self._num_recycled = 0
        self._next_fresh = 0

    @property
    def num_free(self) -> int:
        return self._num_recycled + (self.num_slots - self._next_fresh)

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def can_alloc(self, n: int) -> bool:
        return n <= self.num_free and self.meter.can_charge(n * self.slot_bytes)

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` distinct free slots, or ``None`` (nothing changes) if slots or bytes run short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if not self.can_alloc(n):
            return None
        take = min(n, self._num_recycled)
        out = np.empty(n, dtype=SLOT_DTYPE)
        out[:take] = self._recycled[self._num_recycled - take : self._num_recycled]
        self._num_recycled -= take
        fresh = n - take
        out[take:] = np.arange(self._next_fresh, self._next_fresh + fresh, dtype=SLOT_DTYPE)
        self._next_fresh += fresh
        self.meter.charge(n * self.slot_bytes)
        return out

    def free(self, slots: np.ndarray) -> None:
        n = len(slots)
        if n == 0:
            return
        if n > self.num_used:
            raise AssertionError(f"{self.name}: freeing {n} slots but only {self.num_used} in use")
        need = self._num_recycled + n
        if need > len(self._recycled):
            grown = np.empty(max(need, 2 * len(self._recycled), 1024), dtype=SLOT_DTYPE)
            grown[: self._num_recycled] = self._recycled[: self._num_recycled]
            self._recycled = grown
        self._recycled[self._num_recycled : need] = slots
        self._num_recycled = need
        self.meter.release(n * self.slot_bytes)

    def count_free_among(self, slots: np.ndarray) -> int:
        """How many of ``slots`` are free (integrity checks; O(len(slots) + recycled))."""
        slots = np.asarray(slots, dtype=SLOT_DTYPE)
        recycled = self._recycled[: self._num_recycled]
        if len(np.unique(recycled)) != len(recycled):
            raise AssertionError(f"{self.name}: a slot is free twice")
        fresh = slots >= self._next_fresh
        return int(fresh.sum() + np.isin(slots[~fresh], recycled).sum())


class KVPool(SlotPool):
    """KV slots: one per token, or one per ``page_size`` tokens (a page)."""

    def __init__(self, num_slots: int, page_size: int, bytes_per_token: int, meter: ByteMeter):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        super().__init__("kv", num_slots, page_size * bytes_per_token, meter)
        self.page_size = page_size


class StatePool(SlotPool):
    """SSM checkpoint slots; each holds the conv + SSM state of every SSM layer."""

    def __init__(self, num_slots: int, state_bytes: int, meter: ByteMeter) -> None:
        super().__init__("state", num_slots, state_bytes, meter)

    def alloc_one(self) -> int | None:
        got = self.alloc(1)
        return None if got is None else int(got[0])

    def free_one(self, slot: int) -> None:
        self.free(np.array([slot], dtype=SLOT_DTYPE))


@dataclass(frozen=True)
class MemoryBudget:
    """One byte budget shared by KV and states (``shared``), or one per pool (``separate``)."""

    total_bytes: int | None = None
    kv_bytes: int | None = None
    state_bytes: int | None = None

    def __post_init__(self) -> None:
        shared = self.total_bytes is not None
        separate = self.kv_bytes is not None or self.state_bytes is not None
        if shared == separate:
            raise ValueError("give either total_bytes, or kv_bytes and state_bytes")

    @classmethod
    def shared(cls, total_bytes: int) -> MemoryBudget:
        return cls(total_bytes=int(total_bytes))

    @classmethod
    def separate(cls, kv_bytes: int, state_bytes: int) -> MemoryBudget:
        return cls(kv_bytes=int(kv_bytes), state_bytes=int(state_bytes))

    @property
    def is_shared(self) -> bool:
        return self.total_bytes is not None

    @property
    def capacity_bytes(self) -> int:
        if self.total_bytes is not None:
            return self.total_bytes
        return (self.kv_bytes or 0) + (self.state_bytes or 0)


class Pools(NamedTuple):
    kv: KVPool | None
    state: StatePool | None
    meters: tuple[ByteMeter, ...]

    def can_alloc(self, kv_slots: int, state_slots: int) -> bool:
        """True when both allocations fit at once (they may share a meter)."""
        if kv_slots and (self.kv is None or kv_slots > self.kv.num_free):
            return False
        if state_slots and (self.state is None or state_slots > self.state.num_free):
            return False
        charges: dict[int, int] = {}
        for pool, n in ((self.kv, kv_slots), (self.state, state_slots)):
            if pool is not None and n:
                key = id(pool.meter)
                charges[key] = charges.get(key, 0) + n * pool.slot_bytes
        return all(m.can_charge(charges.get(id(m), 0)) for m in self.meters)

    @property
    def used_bytes(self) -> int:
        return sum(m.used for m in self.meters)

    @property
    def peak_bytes(self) -> int:
        """Peak of the total (exact for a shared meter; sum of per-pool peaks otherwise)."""
        return sum(m.peak for m in self.meters)


def make_pools(
    budget: MemoryBudget,
    kv_bytes_per_token: int,
    state_bytes: int,
    page_size: int = 1,
) -> Pools:
    """Pools for a model with the given per-token KV bytes and per-checkpoint state bytes.

    A model without attention (``kv_bytes_per_token == 0``) gets no KV pool; one without SSM
    layers (``state_bytes == 0``) gets no state pool.
    """
    page_bytes = page_size * kv_bytes_per_token
    if budget.total_bytes is not None:
        meter = ByteMeter(budget.total_bytes)
        kv_meter = st_meter = meter
        meters: tuple[ByteMeter, ...] = (meter,)
    else:
        kv_meter = ByteMeter(budget.kv_bytes or 0)
        st_meter = ByteMeter(budget.state_bytes or 0)
        meters = (kv_meter, st_meter)
    kv = None
    if kv_bytes_per_token > 0:
        kv = KVPool(kv_meter.capacity // page_bytes, page_size, kv_bytes_per_token, kv_meter)
    state = None
    if state_bytes > 0:
        state = StatePool(st_meter.capacity // state_bytes, state_bytes, st_meter)
    return Pools(kv, state, meters)
