"""The SGLang backend and the simulator's ``Replayer`` make the same decisions.

The same request sequences go through SGLang's real cache (``UnifiedRadixCache`` with the
``marconi`` backend over real pools on CPU, driven as the scheduler drives it: match, plan,
prefill chunks ending at the planned positions, prefill-end checkpoint, decode, finish) and
through ``Replayer`` on a ``PrefixCache`` of the same preset, with pools large enough that
nothing is evicted. Every request must resume from the same number of tokens, the trees must
hold states at the same depths, and the learned admission must end with the same kinds enabled.
(Follows ``test/cache/test_lifecycle.py``'s engine-vs-replayer cross-check.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sglang", reason="sglang is not installed (run `make test-sglang`)")

sys.path.insert(0, str(Path(__file__).parent))

from marconi.cache.pools import MemoryBudget
from marconi.cache.prefix_cache import PrefixCache
from marconi.cache.presets import preset_config
from marconi.integrations.sglang import plugin
from marconi.sim.replay import Replayer
from marconi.sim.traces import Request
from sglang.srt.plugins import load_plugins
from sglang_fixture import Session, build
from test_sglang_backend import state_depths

Turn = tuple[list[int], list[int]]  # (input ids, output ids; the last output is never fed)


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1, 250, size=n).tolist()


def _workloads() -> dict[str, list[Turn]]:
    rng = np.random.default_rng(7)
    systems = [_ids(rng, 24), _ids(rng, 24)]
    # SGLang's generated-shared-prefix multi-turn: turn k+1 = turn k's prompt + a question
    gsp: list[Turn] = []
    prompts = {c: systems[c % 2] + _ids(rng, 6) for c in range(4)}
    for _turn in range(3):
        for c in range(4):
            gsp.append((prompts[c], _ids(rng, 4)))
            prompts[c] = prompts[c] + _ids(rng, 6)
    # a chat: turn k+1 = turn k's fed tokens + its last output + a question (the paper's bet)
    chat: list[Turn] = []
    history = {c: systems[0] + _ids(rng, 5) for c in range(3)}
    for _turn in range(3):
        for c in range(3):
            out = _ids(rng, 5)
            chat.append((history[c], out))
            history[c] = history[c] + out + _ids(rng, 4)
    # the same prompts sent again (regenerate, retries)
    resend: list[Turn] = []
    for p in [systems[1] + _ids(rng, 8) for _ in range(3)]:
        resend += [(p, _ids(rng, 3)), (p, _ids(rng, 3))]
    # block-granular (Mooncake): the next request repeats this one's input up to its last
    # 512-token boundary, then a new block and a fresh tail
    blocks: list[Turn] = []
    chains = {c: _ids(rng, 512) for c in range(2)}
    for _turn in range(3):
        for c in range(2):
            blocks.append((chains[c] + _ids(rng, 40), _ids(rng, 3)))
            chains[c] = chains[c] + _ids(rng, 512)
    return {
        "gsp-multi-turn": gsp,
        "chat": chat,
        "resend": resend,
        "mixed": gsp + chat + resend,
        "blocks": blocks,
    }


@pytest.fixture(autouse=True)
def _registered(monkeypatch: pytest.MonkeyPatch) -> None:
    load_plugins()
    monkeypatch.delenv(plugin.ALPHA_ENV, raising=False)


def _sim_states(cache: PrefixCache) -> list[int]:
    return sorted(n.end for n in cache.tree.iter_nodes() if n.state is not None)


@pytest.mark.parametrize("preset", ["marconi", "marconi-paper"])
@pytest.mark.parametrize("workload", list(_workloads()))
def test_sglang_backend_and_replayer_agree(
    workload: str, preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(plugin.PRESET_ENV, preset)
    monkeypatch.setenv(plugin.ALPHA_ENV, "0")  # fixed: no tuner (no eviction happens anyway)
    # grid 1: branch points exact, as ours; contexts up to 2,048 tokens for "blocks"
    fx = build(kv_size=4096, mamba_size=160, chunk=1, max_context_len=2048)
    policy = fx.cache.marconi
    sim = PrefixCache(policy.cost, MemoryBudget.shared(1 << 40), preset_config(preset, alpha=0.0))
    s, rp = Session(fx), Replayer(sim)
    hits_sglang, hits_sim = [], []
    for i, (inp, out) in enumerate(_workloads()[workload]):
        req = s.serve(inp, out)
        hits_sglang.append(req.marconi_match[0])  # usable prefix at its plan
        record = rp.serve(Request(f"s{i}", 0, float(i), np.array(inp), np.array(out)))
        hits_sim.append(record.hit_len)
        assert state_depths(fx) == _sim_states(sim), (i, hits_sglang, hits_sim)
    assert hits_sglang == hits_sim
    assert sum(hits_sim) > 0
    assert fx.cache.marconi.stats.hit_tokens == sum(hits_sim)
    assert getattr(policy.admission, "enabled", None) == getattr(sim.admission, "enabled", None)
    if preset == "marconi":  # the same ghosts (each insert fingerprinted from its plan's memo)
        assert policy.admission.ghosts.entries == sim.admission.ghosts.entries
    assert policy.eviction.alpha_hold == sim.eviction.alpha_hold
    if preset == "marconi":  # what the eviction follows: block-granular reuse or not
        assert policy.eviction.block_granular == (workload == "blocks")
    if preset == "marconi" and workload == "gsp-multi-turn":
        # the next turn keeps the previous prompt, not the reply: the prompt end is learned
        from marconi.cache.admission_learned import Kind

        assert Kind.PROMPT_END in policy.admission.enabled
    sim.check_integrity(deep=True)
    fx.cache.sanity_check()
