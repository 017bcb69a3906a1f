"""Alpha tuning in the ``marconi`` SGLang backend (``--marconi-alpha auto``), on real SGLang.

The backend's cache is built through SGLang's registry over real pools on ``device="cpu"``
(``sglang_fixture``); finished requests go through SGLang's ``checkpoint`` (the backend's
finished-request hook feeds ``marconi.cache.tuning.ShadowTuner``). The workload has the shape of
``test/sim/synthetic.py::recurring_docs``: long documents asked about again and again among
short one-off prompts, so keeping the documents' states (a large alpha) wins.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sglang", reason="sglang is not installed (run `make test-sglang`)")

sys.path.insert(0, str(Path(__file__).parent))

from marconi.integrations.sglang import plugin
from marconi.integrations.sglang.backend import alpha_from_env
from marconi.integrations.sglang.tuning import BackendAlphaTuner
from sglang.srt.plugins import load_plugins
from sglang_fixture import Fixture, Session, build

KV_SIZE, MAMBA_SIZE = 1000, 12  # SGLang's pools; the shadows get the same budget
DOC_LEN, SHORT_LEN, N_REQUESTS = 200, 40, 192  # 3 windows of 64 finished requests


@pytest.fixture(autouse=True)
def _registered(monkeypatch: pytest.MonkeyPatch) -> None:
    load_plugins()
    monkeypatch.delenv(plugin.ALPHA_ENV, raising=False)
    # the paper's design: the FLOP-aware weight over its grid (the documents' FLOPs win)
    monkeypatch.setenv(plugin.PRESET_ENV, "marconi-paper")


def test_the_marconi_preset_tunes_its_own_weight_on_shadows_of_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(plugin.PRESET_ENV, "marconi")
    fx = build(kv_size=KV_SIZE, mamba_size=MAMBA_SIZE)
    tuner = fx.cache.marconi_tuner
    assert isinstance(tuner, BackendAlphaTuner)
    ref = tuner.reference.config
    assert (ref.admission, ref.eviction, ref.match_rule) == ("learned", "hit-density", "last-token")
    assert tuner.tuner.grid == (0.0, 0.5, 1.0)  # HitDensity.alpha_grid
    alphas = serve(fx, recurring_docs())
    assert tuner.tuner.seen == N_REQUESTS
    assert set(alphas) <= set(tuner.tuner.grid)


def recurring_docs(n: int = N_REQUESTS, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) pairs: every 6th request is one of 3 long documents plus a short
    question, the rest are short one-off prompts."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1000, 10**6, DOC_LEN).tolist() for _ in range(3)]
    out = []
    for i in range(n):
        if i % 6 == 0:
            prompt = docs[(i // 6) % 3] + rng.integers(1000, 10**6, 4).tolist()
        else:
            prompt = rng.integers(1000, 10**6, SHORT_LEN).tolist()
        out.append((prompt, rng.integers(1000, 10**6, 2).tolist()))
    return out


def serve(fx: Fixture, workload: list[tuple[list[int], list[int]]]) -> list[float]:
    """Runs the workload through SGLang's cache; the backend's alpha after each request."""
    s, alphas = Session(fx), []
    for prompt, output in workload:
        req = s.start(prompt)
        branch = getattr(req, "mamba_branching_seqlen", None)
        if branch and branch > req.prefix_len:  # a prefill chunk ends at the branch point
            s.checkpoint(req, up_to=branch)
        s.decode(req, output)
        s.finish(req)
        fx.cache.sanity_check()
        alphas.append(fx.cache.marconi.alpha)
    return alphas


def test_auto_is_the_default_and_moves_alpha_above_zero() -> None:
    fx = build(kv_size=KV_SIZE, mamba_size=MAMBA_SIZE)
    tuner = fx.cache.marconi_tuner
    assert isinstance(tuner, BackendAlphaTuner)
    cost = fx.cache.marconi.cost
    assert tuner.budget_bytes == KV_SIZE * cost.kv_bytes_per_token + MAMBA_SIZE * cost.state_bytes
    assert fx.cache.marconi.alpha == 0.0  # auto starts at LRU order
    alphas = serve(fx, recurring_docs())
    assert tuner.tuner.seen == N_REQUESTS  # every finished request was fed
    assert alphas[-1] > 0.0
    assert tuner.history[-1] == (tuner.history[-1][0], alphas[-1])
    # the policy the components read follows the tuner, and the stats log it
    assert fx.cache.marconi.eviction.alpha == alphas[-1] == fx.cache.marconi.stats.alpha
    assert f"alpha={alphas[-1]:g}" in fx.cache.marconi.stats.summary()
    st = fx.cache.marconi.stats
    assert st.kv_evictions > 0 and st.branch_states > 0  # under pressure, with branch states


def test_fixed_alpha_never_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.ALPHA_ENV, "0.5")
    fx = build(kv_size=KV_SIZE, mamba_size=MAMBA_SIZE)
    assert fx.cache.marconi_tuner is None
    assert set(serve(fx, recurring_docs())) == {0.5}


def test_marconi_alpha_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setenv(plugin.ALPHA_ENV, "unset")  # restored after the test
    prepare_server_args(["--model-path", "m", "--marconi-alpha", "auto"])
    assert os.environ[plugin.ALPHA_ENV] == "auto" and alpha_from_env() is None
    prepare_server_args(["--model-path", "m", "--marconi-alpha", "2"])
    assert os.environ[plugin.ALPHA_ENV] == "2.0" and alpha_from_env() == 2.0
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "m", "--marconi-alpha", "-1"])
