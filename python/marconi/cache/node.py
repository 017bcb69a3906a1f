"""Radix tree nodes and the typed results of tree operations."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from marconi.cache.eviction import CandidateInfo

_ids = itertools.count()


class Node:
    """One radix-tree node: the edge from its parent (tokens + their KV slots) and, optionally, an
    SSM checkpoint (a state-pool slot) holding the state after the edge's last token.

    Lock rule (SGLang's hybrid rule): a handle pins its node's state and the KV of the whole path
    to the root. ``ref`` counts handles on this node; ``lock`` counts handles on this node or
    below, so ``lock >= ref`` and ``lock == ref + sum(child.lock)``. A node with ``lock > 0``
    keeps its KV; a node with ``ref > 0`` keeps its state.
    """

    __slots__ = (
        "children",
        "hits",
        "id",
        "info",
        "key",
        "kv",
        "last_access",
        "lock",
        "parent",
        "ref",
        "start",
        "state",
        "version",
    )

    def __init__(
        self,
        parent: Node | None,
        key: np.ndarray,
        kv: np.ndarray | None,
        start: int,
        now: int,
    ) -> None:
        self.id = next(_ids)
        self.parent = parent
        self.children: dict[object, Node] = {}
        self.key = key
        self.kv = kv
        self.state: int | None = None
        self.start = start
        self.last_access = now
        self.ref = 0
        self.lock = 0
        self.hits = 0
        self.version = 0
        #: ``(version, CandidateInfo)``: the eviction index's memo of this node's info
        #: (``EvictionIndex.info_of``), valid while ``version`` is the node's
        self.info: tuple[int, CandidateInfo] | None = None

    @property
    def end(self) -> int:
        """Prefix length at the end of this node's edge."""
        return self.start + len(self.key)

    def __repr__(self) -> str:
        st = "" if self.state is None else f" state={self.state}"
        return f"Node(#{self.id} [{self.start},{self.end}){st} ref={self.ref} lock={self.lock})"


class MatchResult(NamedTuple):
    """What the cache holds for a prefix of the input.

    ``kv_len``: longest prefix whose KV is cached (may end inside an edge).
    ``usable_len``: longest prefix a request can resume from (for a model with SSM layers, the
    end of the deepest matched node holding a state; for attention-only, ``kv_len``).
    ``node``: the handle to lock while the request uses the prefix (covers ``usable_len``).
    ``kv``: KV slots of ``[0, usable_len)`` (pages when paged), or None without a KV pool.
    ``state``: the state slot at ``usable_len``, or None (fresh start / attention-only).
    """

    kv_len: int
    usable_len: int
    node: Node
    kv: np.ndarray | None
    state: int | None


class InsertResult(NamedTuple):
    """Outcome of inserting a sequence: tokens newly cached, states admitted and declined
    (declined = a state already sat there, or the position is not page-aligned), and how many
    of the given KV slots already were the tree's (the prefix the request resumed from)."""

    node: Node
    new_tokens: int
    states_admitted: int
    states_declined: int
    kv_reused: int


class EvictResult(NamedTuple):
    """What one ``evict`` call freed, and whether the requested room is now available."""

    kv_slots_freed: int
    states_freed: int
    nodes_removed: int
    fits: bool


class SizeInfo(NamedTuple):
    """Slot counts; for each pool ``free + cached + locked + in_flight == total``."""

    kv_total: int
    kv_free: int
    kv_cached: int
    kv_locked: int
    kv_in_flight: int
    state_total: int
    state_free: int
    state_cached: int
    state_locked: int
    state_in_flight: int
    used_bytes: int
    capacity_bytes: int
    nodes: int
