"""The hybrid radix tree: token edges own KV slots, nodes may own one SSM-state slot.

Edges store tokens and KV slots as numpy arrays (never one Python object per token). With
``page_size > 1`` every edge is a whole number of pages, matches and inserts stop at page
boundaries, and ``kv`` holds one slot per page.

The tree frees memory in exactly two places, each with its ownership table: ``insert`` (slots a
request computed that the tree already had) and ``evict_node``. It never allocates: requests
allocate through ``PrefixCache``, which evicts first, so the budget holds at every instant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np

from marconi.cache.node import InsertResult, MatchResult, Node
from marconi.cache.pools import SLOT_DTYPE, Pools

_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY_KV = np.empty(0, dtype=SLOT_DTYPE)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = a[:n] != b[:n]
    i = int(neq.argmax())
    return i if neq[i] else n


def _state_depth(path: list[Node]) -> int:
    """Index in ``path`` of the deepest node holding a state, -1 if none: where a hybrid
    model's usable prefix ends (shared by ``match`` and ``usable_len``)."""
    return max((i for i, n in enumerate(path) if n.state is not None), default=-1)


class RadixTree:
    """Structure, matching, insertion, locking and per-node eviction; no policy decisions.

    ``on_change(node)`` is called whenever a node's eviction candidacy or priority inputs may have
    changed (access time, children, state, lock); the eviction index listens to it.
    ``on_hit(node)`` is called when ``match`` is about to use ``node`` (before its access time is
    refreshed); learning eviction policies count hits by the node's age with it.
    """

    def __init__(
        self,
        pools: Pools,
        *,
        page_size: int = 1,
        has_ssm: bool = True,
        on_change: Callable[[Node], None] | None = None,
    ) -> None:
        self.pools = pools
        self.page_size = page_size
        self.has_ssm = has_ssm
        self.on_change = on_change or (lambda node: None)
        self.on_hit: Callable[[Node], None] = lambda node: None
        self.root = Node(None, _EMPTY, _EMPTY_KV if pools.kv is not None else None, 0, 0)
        self.root.lock = 1  # the root is never evicted
        self.nodes: dict[int, Node] = {}
        self.clock = 0
        self.kv_slots = 0  # KV slots owned by the tree
        self.state_slots = 0  # state slots owned by the tree

    # ------------------------------------------------------------------ keys and walking
    def _child_key(self, tokens: np.ndarray, pos: int) -> object:
        if self.page_size == 1:
            return int(tokens[pos])
        return tokens[pos : pos + self.page_size].tobytes()

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _walk(self, tokens: np.ndarray) -> tuple[list[Node], Node | None, int]:
        """Fully matched path (root excluded), the partially matched child (or None), and the
        matched length. Read-only."""
        end = self._aligned(len(tokens))
        path: list[Node] = []
        node, pos = self.root, 0
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            n = self._aligned(common_prefix_len(child.key, tokens[pos:end]))
            if n < len(child.key):
                return path, child, pos + n
            path.append(child)
            node, pos = child, child.end
        return path, None, pos

    def iter_nodes(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    # ------------------------------------------------------------------ match
    def match(self, tokens: np.ndarray) -> MatchResult:
        """Longest cached and usable prefixes of ``tokens``. Mutates only the used node's access
        time and hit count; never reports a length that is not a true prefix of ``tokens``."""
        self.clock += 1
        path, partial, cached = self._walk(tokens)
        if self.has_ssm:
            used = path[: _state_depth(path) + 1]
            handle = used[-1] if used else self.root
            usable, cut = handle.end, 0
        else:
            used = path
            handle = path[-1] if path else self.root
            usable, cut = cached, 0
            if partial is not None and cached > handle.end:
                handle, cut = partial, (cached - partial.start) // self.page_size
        kv = None
        if self.pools.kv is not None:
            parts = [n.kv for n in used]
            if cut:
                parts.append(handle.kv[:cut])
            kv = np.concatenate(parts) if parts else _EMPTY_KV
        if handle is not self.root:
            self.on_hit(handle)
            handle.last_access = self.clock
            handle.hits += 1
            self.on_change(handle)
        return MatchResult(cached, usable, handle, kv, handle.state)

    def usable_len(self, tokens: np.ndarray) -> int:
        """``match(tokens).usable_len`` without touching anything (no access time, no hit count,
        no clock): what a scheduler may ask about queued requests."""
        path, _, cached = self._walk(tokens)
        if self.has_ssm:
            depth = _state_depth(path)
            return path[depth].end if depth >= 0 else 0
        return cached

    def branch_point(self, tokens: np.ndarray) -> int | None:
        """Speculative insertion (read-only): the position where inserting ``tokens`` would
        branch off the tree, i.e. split an edge or add a child to a state-less inner node, so
        the caller can checkpoint the state there during prefill. None if there is no such
        position, or a state already sits there."""
        path, partial, pos = self._walk(tokens)
        if pos == 0:
            return None
        if partial is not None:
            return pos  # an edge would be split at pos
        node = path[-1]
        if node.state is None and node.children and pos < len(tokens):
            return pos  # a new branch off an inner node that holds no state yet
        return None

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        tokens: np.ndarray,
        kv: np.ndarray | None,
        states: Mapping[int, int] | None = None,
    ) -> InsertResult:
        """Insert a sequence whose KV the caller holds in ``kv`` (one slot per token or page,
        covering ``tokens``), with the states it captured (``position -> state slot``).

        Ownership afterwards — the caller holds none of ``kv`` nor of ``states`` any more:

        The slots of ``kv`` that already were the tree's (the request's matched prefix) are
        counted in ``InsertResult.kv_reused``; all others were the request's own.

        | request's slots                          | goes to                 |
        |------------------------------------------|-------------------------|
        | kv where the tree already had that slot  | the tree (same slot)    |
        | kv where the tree had another slot       | freed here (duplicate)  |
        | kv of tokens new to the tree             | the tree (new edges)    |
        | kv of a trailing partial page            | freed here              |
        | state at a node that has no state yet    | the tree                |
        | state where one exists / not aligned     | freed here (declined)   |
        """
        self.clock += 1
        p = self.page_size
        states = dict(states or {})
        end = self._aligned(len(tokens))
        declined = [
            states.pop(pos) for pos in list(states) if not (0 < pos <= end and pos % p == 0)
        ]
        stops = sorted({*states, end})
        node, pos, new_tokens, admitted, reused, stop_i = self.root, 0, 0, 0, 0, 0
        while pos < end:
            while stops[stop_i] <= pos:
                stop_i += 1
            stop = stops[stop_i]
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                child = self._add_child(node, tokens[pos:stop], kv, pos)
                new_tokens += stop - pos
            else:
                n = self._aligned(common_prefix_len(child.key, tokens[pos:stop]))
                if n < len(child.key):
                    child = self._split(child, n)
                if kv is not None:
                    mine = kv[pos // p : child.end // p]
                    dup = mine != child.kv
                    reused += len(mine) - int(dup.sum())
                    self._free_kv(mine[dup])
            node, pos = child, child.end
            slot = states.pop(pos, None)
            if slot is not None:
                if node.state is None:
                    node.state = slot
                    self.state_slots += 1
                    admitted += 1
                    node.last_access = self.clock
                    self.on_change(node)
                else:
                    declined.append(slot)
        if kv is not None:
            self._free_kv(kv[end // p :])
        for slot in declined:
            self._free_state(slot)
        if node is not self.root:
            node.last_access = self.clock
            self.on_change(node)
        return InsertResult(node, new_tokens, admitted, len(declined), reused)

    def _add_child(self, parent: Node, key: np.ndarray, kv: np.ndarray | None, pos: int) -> Node:
        p = self.page_size
        edge_kv = None if kv is None else kv[pos // p : (pos + len(key)) // p].copy()
        child = Node(parent, np.array(key, dtype=np.int64), edge_kv, pos, self.clock)
        parent.children[self._child_key(child.key, 0)] = child
        self.nodes[child.id] = child
        if edge_kv is not None:
            self.kv_slots += len(edge_kv)
        if len(parent.children) == 1:
            self.on_change(parent)  # it stopped being a leaf
        self.on_change(child)
        return child

    def _split(self, child: Node, n: int) -> Node:
        """Split ``child``'s edge after ``n`` tokens; returns the new upper node."""
        p = self.page_size
        parent = child.parent
        assert parent is not None
        mid_kv = None if child.kv is None else child.kv[: n // p]
        mid = Node(parent, child.key[:n], mid_kv, child.start, child.last_access)
        mid.lock = child.lock
        parent.children[self._child_key(mid.key, 0)] = mid
        child.key = child.key[n:]
        if child.kv is not None:
            child.kv = child.kv[n // p :]
        child.start += n
        child.parent = mid
        mid.children[self._child_key(child.key, 0)] = child
        self.nodes[mid.id] = mid
        self.on_change(child)
        self.on_change(mid)
        return mid

    # ------------------------------------------------------------------ locking
    def lock(self, node: Node) -> None:
        """Pin ``node``'s state and the KV of its path to the root."""
        node.ref += 1
        n: Node | None = node
        while n is not None:
            n.lock += 1
            n = n.parent
        if node.ref == 1:
            self.on_change(node)

    def unlock(self, node: Node) -> None:
        if node.ref <= 0:
            raise AssertionError(f"unlock of an unlocked node {node}")
        node.ref -= 1
        n: Node | None = node
        while n is not None:
            n.lock -= 1
            n = n.parent
        if node.ref == 0 and node is not self.root and not self._maybe_merge(node):
            self.on_change(node)

    # ------------------------------------------------------------------ eviction
    @staticmethod
    def is_candidate(node: Node, single_child: bool) -> bool:
        """Evictable now: an unlocked leaf, or (if ``single_child``) a single-child node holding
        a state nobody resumes from."""
        if node.parent is None:
            return False
        if not node.children:
            return node.lock == 0
        return single_child and len(node.children) == 1 and node.state is not None and node.ref == 0

    def evict_node(self, node: Node) -> tuple[int, int, int]:
        """Evict one candidate: a leaf loses everything; a single-child node gives up only its
        state (its KV merges into the child). Returns (kv slots, states, nodes) freed.

        | held by node | leaf          | single-child       |
        |--------------|---------------|--------------------|
        | edge KV      | freed here    | kept, merged down  |
        | state        | freed here    | freed here         |
        """
        assert node.parent is not None and node.ref == 0
        kv_freed = states_freed = 0
        if node.state is not None:
            self._free_state(node.state)
            self.state_slots -= 1
            node.state = None
            states_freed = 1
        if node.children:
            merged = self._maybe_merge(node)
            if not merged:
                self.on_change(node)
            return 0, states_freed, int(merged)
        assert node.lock == 0
        parent = node.parent
        if node.kv is not None:
            kv_freed = len(node.kv)
            self.kv_slots -= kv_freed
            self._free_kv(node.kv)
        del parent.children[self._child_key(node.key, 0)]
        del self.nodes[node.id]
        node.parent = None
        node.version += 1
        if parent is not self.root and not self._maybe_merge(parent):
            self.on_change(parent)
        return kv_freed, states_freed, 1

    def _maybe_merge(self, node: Node) -> bool:
        """Fold a state-less, unreferenced single-child node into its child."""
        if node.parent is None or node.state is not None or node.ref or len(node.children) != 1:
            return False
        (child,) = node.children.values()
        parent = node.parent
        child.key = np.concatenate([node.key, child.key])
        if child.kv is not None and node.kv is not None:
            child.kv = np.concatenate([node.kv, child.kv])
        child.start = node.start
        child.parent = parent
        parent.children[self._child_key(child.key, 0)] = child
        del self.nodes[node.id]
        node.parent = None
        node.version += 1
        self.on_change(child)
        return True

    # ------------------------------------------------------------------ memory
    def _free_kv(self, slots: np.ndarray) -> None:
        if len(slots) and self.pools.kv is not None:
            self.pools.kv.free(slots)

    def _free_state(self, slot: int) -> None:
        if self.pools.state is not None:
            self.pools.state.free_one(slot)
