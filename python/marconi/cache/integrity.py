"""``check_integrity``: the tree's structural invariants and exact slot accounting."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from marconi.cache.node import Node
    from marconi.cache.prefix_cache import PrefixCache


class IntegrityError(AssertionError):
    """The cache's bookkeeping is inconsistent: a bug, never a user error."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise IntegrityError(msg)


def _check_node(tree_page: int, node: Node) -> tuple[int, int]:
    """Structural checks of one non-root node; returns (kv slots, states) it holds."""
    parent = node.parent
    _require(parent is not None, f"{node} detached but still listed")
    assert parent is not None
    _require(len(node.key) > 0 and len(node.key) % tree_page == 0, f"{node}: bad edge length")
    _require(node.start == parent.end, f"{node}: start {node.start} != parent end {parent.end}")
    first = int(node.key[0]) if tree_page == 1 else node.key[:tree_page].tobytes()
    _require(parent.children.get(first) is node, f"{node}: not its parent's child")
    kv = 0
    if node.kv is not None:
        kv = len(node.kv)
        _require(kv == len(node.key) // tree_page, f"{node}: {kv} KV slots for its edge")
    child_locks = sum(c.lock for c in node.children.values())
    _require(node.ref >= 0 and node.lock == node.ref + child_locks, f"{node}: lock count")
    return kv, int(node.state is not None)


def check_cache(cache: PrefixCache, deep: bool = False) -> None:
    tree, pools = cache.tree, cache.pools
    seen: set[int] = set()
    kv_total = states_total = 0
    stack = list(tree.root.children.values())
    root_locks = sum(c.lock for c in tree.root.children.values())
    _require(tree.root.lock == 1 + tree.root.ref + root_locks, "root lock count")
    while stack:
        node = stack.pop()
        _require(node.id not in seen, f"{node} reached twice")
        seen.add(node.id)
        kv, st = _check_node(tree.page_size, node)
        memo = cache.index.memo(node)
        if memo is not None:
            _require(memo == cache.index.info(node), f"{node}: stale eviction info")
        kv_total += kv
        states_total += st
        stack.extend(node.children.values())
    _require(seen == set(tree.nodes), "node registry differs from the nodes reachable from root")
    _require(kv_total == tree.kv_slots, f"tree holds {kv_total} KV slots, counts {tree.kv_slots}")
    _require(states_total == tree.state_slots, "tree state count")
    if pools.kv is not None:
        used = pools.kv.num_used
        _require(
            used == tree.kv_slots + cache.kv_in_flight,
            f"KV: {used} used != {tree.kv_slots} cached + {cache.kv_in_flight} in flight",
        )
    if pools.state is not None:
        used = pools.state.num_used
        _require(
            used == tree.state_slots + cache.states_in_flight,
            f"states: {used} used != {tree.state_slots} cached"
            f" + {cache.states_in_flight} in flight",
        )
    for meter in pools.meters:
        charged = sum(
            p.num_used * p.slot_bytes for p in (pools.kv, pools.state) if p and p.meter is meter
        )
        _require(meter.used == charged, f"meter says {meter.used} B, pools hold {charged} B")
        _require(meter.peak <= meter.capacity, f"peak {meter.peak} B over budget {meter.capacity}")
    if deep:
        _check_slot_ids(cache)


def _check_slot_ids(cache: PrefixCache) -> None:
    tree, pools = cache.tree, cache.pools
    if pools.kv is not None:
        held = [n.kv for n in tree.iter_nodes() if n.kv is not None and len(n.kv)]
        cached = np.concatenate(held) if held else np.empty(0, dtype=np.int64)
        _require(len(np.unique(cached)) == len(cached), "a KV slot is cached twice")
        _require(not pools.kv.count_free_among(cached), "a KV slot is both cached and free")
    if pools.state is not None:
        states = [n.state for n in tree.iter_nodes() if n.state is not None]
        _require(len(set(states)) == len(states), "a state slot is cached twice")
        in_use = np.array(states, dtype=np.int64)
        _require(not pools.state.count_free_among(in_use), "a state slot is both cached and free")
