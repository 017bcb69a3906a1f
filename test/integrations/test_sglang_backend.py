"""The ``marconi`` SGLang backend against the real ``sglang==0.5.23`` package, on CPU.

Runs in the SGLang virtualenv (``make test-sglang``); skipped where ``sglang`` is not installed.
Every cache here is SGLang's own ``UnifiedRadixCache`` machinery (built through SGLang's registry)
over real ``HybridReqToTokenPool``/``MambaPool``/KV pools on ``device="cpu"``; requests go through
``Req.init_next_round_input`` (match), ``checkpoint`` (insert), ``lock``/``unlock`` and ``evict``.
After every step SGLang's own ``sanity_check`` runs and every slot is accounted for.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="sglang is not installed (run `make test-sglang`)")

sys.path.insert(0, str(Path(__file__).parent))

from marconi.cache.admission_learned import GhostAdmission
from marconi.cache.eviction import FlopAware
from marconi.cache.eviction_learned import HitDensity
from marconi.integrations.sglang import plugin
from marconi.integrations.sglang.backend import (
    MarconiFullComponent,
    MarconiMambaComponent,
    MarconiRadixCache,
)
from marconi.integrations.sglang.policy import node_depth
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.plugins import load_plugins
from sglang_fixture import Fixture, Session, build

SYSTEM = list(range(100, 120))  # a 20-token shared prefix; branch point 20 (multiple of CHUNK)
MAMBA = ComponentType.MAMBA


@pytest.fixture(autouse=True)
def _registered(monkeypatch: pytest.MonkeyPatch) -> None:
    load_plugins()  # SGLang's own loader: runs our entry point, then applies its hooks
    monkeypatch.delenv(plugin.ALPHA_ENV, raising=False)
    monkeypatch.delenv(plugin.PRESET_ENV, raising=False)


def state_depths(fx: Fixture) -> list[int]:
    """Depths (prefix lengths) of every node holding a Mamba state, sorted."""
    tc = fx.cache.tree_core
    nodes = tc._collect_all_nodes()
    return sorted(
        node_depth(n)
        for n in nodes
        if n is not tc.root_node and n.component_data[MAMBA].value is not None
    )


def check(fx: Fixture, in_flight_kv: int = 0, in_flight_states: int = 0) -> None:
    """SGLang's tree invariants + exact slot accounting for both pools:
    free + cached (evictable) + locked (protected) + held by running requests == total."""
    cache = fx.cache
    cache.sanity_check()
    kv = fx.allocator.available_size() + cache.full_evictable_size() + cache.full_protected_size()
    assert kv + in_flight_kv == fx.kv_size
    mamba_free = fx.pool.mamba_allocator.available_size()
    states = mamba_free + cache.mamba_evictable_size() + cache.mamba_protected_size()
    assert states + in_flight_states == fx.mamba_size


# ---------------------------------------------------------------- construction + CLI
def test_registry_builds_marconi_cache_for_hybrid_model() -> None:
    fx = build()
    assert isinstance(fx.cache, MarconiRadixCache) and isinstance(fx.cache, UnifiedRadixCache)
    assert isinstance(fx.cache.components[ComponentType.FULL], MarconiFullComponent)
    assert isinstance(fx.cache.components[MAMBA], MarconiMambaComponent)
    # the default preset is ``marconi``: learned admission, hit-density eviction
    assert isinstance(fx.cache.marconi.admission, GhostAdmission)
    assert isinstance(fx.cache.marconi.eviction, HitDensity)
    cost = fx.cache.marconi.cost  # from the HF config: 2 attention + 6 Mamba-2 layers
    assert (cost.layers.attention, cost.layers.ssm) == (2, 6)
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 32 * 2
    # state bytes are the Mamba pool's own slot bytes (conv keeps d_conv - 1 columns there)
    mc = fx.pool.mamba_pool.mamba_cache
    slot = sum(t[:, 0].nbytes for t in [*mc.conv, mc.temporal])
    assert cost.state_bytes == slot == cost.conv_state_bytes + cost.ssm_state_bytes
    assert cost.ssm_state_bytes == mc.temporal[:, 0].nbytes
    check(fx)


def test_alpha_comes_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.ALPHA_ENV, "3.5")
    assert build().cache.marconi.eviction.alpha == 3.5


def test_prefix_cache_flag_maps_to_radix_cache_backend() -> None:
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "m", "--prefix-cache", "marconi"])
    assert args.radix_cache_backend == "marconi"
    args = prepare_server_args(["--model-path", "m", "--prefix-cache", "lru"])
    assert args.radix_cache_backend is None
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "m", "--prefix-cache", "fifo"])


def test_marconi_preset_flag_reaches_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setenv(plugin.PRESET_ENV, "")  # restored after the test
    args = ["--model-path", "m", "--prefix-cache", "marconi", "--marconi-preset", "marconi-paper"]
    prepare_server_args(args)
    assert isinstance(build().cache.marconi.eviction, FlopAware)
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "m", "--marconi-preset", "sglang+"])


def test_launch_server_help_lists_prefix_cache_marconi() -> None:
    """The real entry point: ``python -m sglang.launch_server --help`` loads the installed
    plugin through the ``sglang.srt.plugins`` entry-point group."""
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "--prefix-cache {lru,marconi}" in out
    assert "--marconi-alpha" in out


# ---------------------------------------------------------------- admission
def test_finished_request_admits_only_the_state_after_its_last_decoded_token() -> None:
    fx = build()
    s = Session(fx)
    req = s.start([*SYSTEM, 1, 2, 3])
    check(fx, in_flight_kv=23, in_flight_states=1)
    s.decode(req, [7, 8])
    s.finish(req)
    assert state_depths(fx) == [25]
    st = fx.cache.marconi.stats
    assert (st.states_admitted, st.decode_states, st.branch_states) == (1, 1, 0)
    check(fx)


def test_chunk_checkpoints_admit_only_the_branch_point() -> None:
    fx = build()
    s = Session(fx)
    s.run([*SYSTEM, 1, 2, 3], [7])
    req = s.start([*SYSTEM, 4, 5, 6, 9, 9, 9])
    assert req.prefix_len == 0 and req.mamba_branching_seqlen == 20  # KV hit, no state yet
    s.checkpoint(req, up_to=12)  # a chunk boundary that is not a branch point: declined
    assert state_depths(fx) == [24]
    s.checkpoint(req, up_to=20)  # the chunk ending at the branch point: admitted
    assert state_depths(fx) == [20, 24]
    s.decode(req, [8])
    s.finish(req)
    assert state_depths(fx) == [20, 24, 27]
    st = fx.cache.marconi.stats
    assert (st.branch_states, st.decode_states, st.states_declined) == (1, 2, 1)
    check(fx)
    # the next request resumes from the branch-point state
    nxt = s.start([*SYSTEM, 42, 43])
    assert nxt.prefix_len == 20
    assert fx.cache.marconi.stats.states_reused == 1
    s.finish(nxt)
    check(fx)


def test_sglang_default_admits_every_chunk_checkpoint() -> None:
    """The same requests under ``--prefix-cache lru`` (SGLang's default cache) keep the
    non-branch chunk state too: the difference Marconi's admission makes."""
    fx = build(backend=None)
    assert type(fx.cache) is UnifiedRadixCache
    s = Session(fx)
    s.run([*SYSTEM, 1, 2, 3], [7])
    req = s.start([*SYSTEM, 4, 5, 6, 9, 9, 9])
    s.checkpoint(req, up_to=12)
    s.checkpoint(req, up_to=20)
    s.decode(req, [8])
    s.finish(req)
    assert state_depths(fx) == [12, 20, 24, 27]
    check(fx)


# ---------------------------------------------------------------- eviction
def _two_leaves(alpha: float, monkeypatch: pytest.MonkeyPatch) -> tuple[Fixture, int, int]:
    """An old leaf with a long edge (high FLOPs per byte) and a newer one with a 2-token edge
    (its bytes are almost all state: low FLOPs per byte)."""
    monkeypatch.setenv(plugin.ALPHA_ENV, str(alpha))
    monkeypatch.setenv(plugin.PRESET_ENV, "marconi-paper")
    fx = build()
    assert isinstance(fx.cache.marconi.eviction, FlopAware)
    s = Session(fx)
    s.run(list(range(200, 260)), [1])  # old, 61 tokens
    s.run(SYSTEM, [2])  # newer, 21 tokens
    return fx, 61, 21


def test_mamba_eviction_alpha_zero_is_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    fx, _old, new = _two_leaves(0.0, monkeypatch)
    fx.cache.evict(EvictParams(mamba_num=1))
    assert state_depths(fx) == [new]
    check(fx)


def test_mamba_eviction_flop_aware_keeps_the_efficient_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fx, old, _new = _two_leaves(10.0, monkeypatch)
    fx.cache.evict(EvictParams(mamba_num=1))
    assert state_depths(fx) == [old]
    assert fx.cache.marconi.stats.state_evictions == 1
    check(fx)


def test_kv_eviction_flop_aware_order(monkeypatch: pytest.MonkeyPatch) -> None:
    fx, old, _new = _two_leaves(10.0, monkeypatch)
    fx.cache.evict(EvictParams(num_tokens=1))  # one leaf goes, whole
    assert state_depths(fx) == [old]  # the short leaf went first, with its state
    assert fx.cache.marconi.stats.kv_evictions == 1
    check(fx)


def test_locked_request_survives_eviction_pressure() -> None:
    fx = build()
    s = Session(fx)
    s.run([*SYSTEM, 1], [2])
    running = s.start([*SYSTEM, 1, 2, 5])  # resumes from depth 22, holds a lock on it
    assert running.prefix_len == 22
    fx.cache.evict(EvictParams(num_tokens=10_000, mamba_num=10_000))
    assert state_depths(fx) == [22]  # the locked state and its path stay
    check(fx, in_flight_kv=1, in_flight_states=1)
    s.decode(running, [6])
    s.finish(running)
    check(fx)
    fx.cache.evict(EvictParams(num_tokens=10_000, mamba_num=10_000))
    assert state_depths(fx) == []
    check(fx)


def test_many_sessions_under_pressure_keep_sglang_invariants() -> None:
    """A multi-turn workload in a small cache: every step passes SGLang's sanity check and
    the slot accounting, and hits only resume from admitted states."""
    fx = build(kv_size=160, mamba_size=6)
    s = Session(fx)
    history: dict[int, list[int]] = {}
    for turn in range(4):
        for user in range(3):
            prompt = SYSTEM + history.get(user, []) + [300 + 10 * user + turn]
            cached = set(state_depths(fx))
            req = s.start(prompt)
            assert req.prefix_len == 0 or req.prefix_len in cached  # resumes at a state
            s.decode(req, [400 + user])
            s.finish(req)
            history[user] = [*prompt[len(SYSTEM) :], 400 + user]
            check(fx)
    st = fx.cache.marconi.stats
    assert st.hit_tokens > 0 and st.states_reused > 0
    assert st.states_admitted <= 2 * 12  # at most two states per request
