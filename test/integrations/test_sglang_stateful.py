"""A hypothesis state machine over the real SGLang 0.5.23 cache classes with the ``marconi``
backend (issue 12): requests start (match + lock + allocate), decode, finish (insert), or abort
(SGLang's own ``release_kv_cache`` without a checkpoint); other clients match and pin nodes
(lock/unlock) and the scheduler evicts, in random orders. After every step SGLang's
``sanity_check`` runs and every KV and Mamba slot is accounted for exactly: free + evictable +
protected + held by running requests == total.

Runs in the SGLang virtualenv only (``make test-sglang``); skipped elsewhere.
"""

from __future__ import annotations

import sys
from array import array
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="sglang is not installed (run `make test-sglang`)")

sys.path.insert(0, str(Path(__file__).parent))

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.plugins import load_plugins
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang_fixture import Session, build
from test_sglang_backend import check

MAX_RUNNING = 4
#: prompts share prefixes: a common head, then a few branches of small token values
prompts = st.builds(
    lambda head, tail: [*range(100, 100 + head), *tail],
    st.sampled_from([0, 8, 20]),
    st.lists(st.integers(1, 6), min_size=1, max_size=12),
)


class SGLangCacheMachine(RuleBasedStateMachine):
    running = Bundle("running")
    pins = Bundle("pins")

    def __init__(self) -> None:
        super().__init__()
        load_plugins()
        self.fx = build(kv_size=256, mamba_size=10)
        self.session = Session(self.fx)
        self.live: list[Req] = []
        self.decoded: dict[str, int] = {}

    @precondition(lambda self: len(self.live) < MAX_RUNNING)
    @rule(target=running, prompt=prompts)
    def start(self, prompt: list[int]) -> Req:
        req = self.session.start(prompt)
        assert req.prefix_len <= len(prompt) - 1 or req.prefix_len == len(prompt)
        self.live.append(req)
        self.decoded[req.rid] = 0
        return req

    @rule(req=running, n=st.integers(1, 3))
    def decode(self, req: Req, n: int) -> None:
        if req in self.live and self.decoded[req.rid] + n <= 8:
            self.session.decode(req, [200 + i for i in range(n)])
            self.decoded[req.rid] += n

    @rule(req=consumes(running))
    def finish(self, req: Req) -> None:
        if req in self.live:
            if not len(req.output_ids):
                self.session.decode(req, [250])
            self.session.finish(req)
            self.live.remove(req)

    @rule(req=consumes(running))
    def abort(self, req: Req) -> None:
        """What the scheduler does for an aborted request: give the row back, no insert."""
        if req in self.live:
            release_kv_cache(req, self.fx.cache, checkpoint=False)
            self.live.remove(req)

    @rule(target=pins, prompt=prompts)
    def match_and_pin(self, prompt: list[int]) -> object:
        """Another client's match: pins the matched node without allocating anything."""
        probe = Req(
            rid="probe",
            origin_input_text="",
            origin_input_ids=array("q", prompt),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )
        probe.init_next_round_input(self.fx.cache)
        return self.fx.cache.lock(probe.last_node)

    @rule(pin=consumes(pins))
    def unpin(self, pin: object) -> None:
        self.fx.cache.unlock(pin)

    @rule(tokens=st.integers(0, 64), states=st.integers(0, 4))
    def evict(self, tokens: int, states: int) -> None:
        self.fx.cache.evict(EvictParams(num_tokens=tokens, mamba_num=states))

    @invariant()
    def accounted(self) -> None:
        kv = sum(r.kv.kv_committed_len - r.kv.cache_protected_len for r in self.live)
        check(self.fx, in_flight_kv=kv, in_flight_states=len(self.live))

    def teardown(self) -> None:
        for req in list(self.live):
            release_kv_cache(req, self.fx.cache, checkpoint=False)
        self.live.clear()


SGLangCacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
test_sglang_cache_state_machine = SGLangCacheMachine.TestCase
