"""A hypothesis state machine over the real SGLang 0.5.23 cache classes with the ``marconi``
backend (issue 12): requests start (match + lock + allocate + prefill), publish their prefill
(``checkpoint_kv_cache``, as the scheduler does before decoding), decode, finish (insert), or
abort (SGLang's own ``release_kv_cache`` without a checkpoint); other clients match and pin
nodes (lock/unlock) and the scheduler evicts, in random orders. After every step SGLang's
``sanity_check`` runs and every KV and Mamba slot is accounted for exactly: free + evictable +
protected + held by running requests == total.

Twice: page size 1 (SGLang's ``no_buffer`` Mamba mode) and page size 4 (``extra_buffer``, the
only mode SGLang allows with pages > 1: paged KV allocator, two tracking slots per request,
states tracked at prefill-grid positions, branch points and every 8 decoded tokens; see
``sglang_fixture``). 60 examples of up to 40 steps each.

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
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.plugins import load_plugins
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang_fixture import Session, build
from test_sglang_backend import check

MAX_RUNNING = 4
MAX_DECODE = 16  # tokens per request: past 8-token track boundaries (extra_buffer)
MAX_PROBES = 2  # pinned matches at once (each may hold a state slot: the pools stay large enough)
#: prompts share prefixes: a common head, then a few branches of small token values
prompts = st.builds(
    lambda head, tail: [*range(100, 100 + head), *tail],
    st.sampled_from([0, 8, 20]),
    st.lists(st.integers(1, 6), min_size=1, max_size=12),
)


class SGLangCacheMachine(RuleBasedStateMachine):
    running = Bundle("running")
    pins = Bundle("pins")
    PAGE_SIZE = 1
    MAMBA_SIZE = 10  # no_buffer: one state slot per running request

    def __init__(self) -> None:
        super().__init__()
        load_plugins()
        self.fx = build(kv_size=256, mamba_size=self.MAMBA_SIZE, page_size=self.PAGE_SIZE)
        self.session = Session(self.fx)
        self.live: list[Req] = []
        self.decoded: dict[str, int] = {}
        self.published: set[str] = set()
        self.probes: list[Req] = []  # matched, pinned, never run
        self.history: list[list[int]] = []  # finished requests' prompt + output

    @precondition(lambda self: len(self.live) < MAX_RUNNING and self.history)
    @rule(target=running, pick=st.integers(0, 7), tail=st.lists(st.integers(1, 6), max_size=6))
    def follow_up(self, pick: int, tail: list[int]) -> Req:
        """The next turn of a finished conversation: its prompt and reply, then new tokens."""
        return self.start([*self.history[pick % len(self.history)], *tail, 7])

    @precondition(lambda self: len(self.live) < MAX_RUNNING)
    @rule(target=running, prompt=prompts)
    def start(self, prompt: list[int]) -> Req:
        req = self.session.start(prompt)
        assert req.prefix_len <= len(prompt) - 1 or req.prefix_len == len(prompt)
        self.live.append(req)
        self.decoded[req.rid] = 0
        return req

    @rule(req=running)
    def publish_prefill(self, req: Req) -> None:
        """What the scheduler does after a prefill that did not finish the request: insert what
        it computed (``checkpoint_kv_cache``, the tree's non-finished insert: a copied state
        at page size 1, the tracked ping-pong state, swapped for a fresh slot, at 4)."""
        if req in self.live and not len(req.output_ids) and req.rid not in self.published:
            checkpoint_kv_cache(req, self.fx.cache)
            self.published.add(req.rid)

    @rule(req=running, n=st.integers(1, 8))
    def decode(self, req: Req, n: int) -> None:
        if req in self.live and self.decoded[req.rid] + n <= MAX_DECODE:
            self.session.decode(req, [200 + i for i in range(n)])
            self.decoded[req.rid] += n

    @rule(req=consumes(running))
    def finish(self, req: Req) -> None:
        if req in self.live:
            if not len(req.output_ids):
                self.session.decode(req, [250])
            self.session.finish(req)
            self.live.remove(req)
            self.history.append([*req.origin_input_ids, *req.output_ids])

    @rule(req=consumes(running))
    def abort(self, req: Req) -> None:
        """What the scheduler does for an aborted request: give the row back, no insert."""
        if req in self.live:
            release_kv_cache(req, self.fx.cache, checkpoint=False)
            self.live.remove(req)

    @precondition(lambda self: len(self.probes) < MAX_PROBES)
    @rule(target=pins, prompt=prompts)
    def match_and_pin(self, prompt: list[int]) -> tuple[Req, object]:
        """Another client's match: pins the matched node without allocating KV. (In
        ``extra_buffer`` mode SGLang's match already copies the matched state into a working
        slot of the request's own: the probe holds it until it is released.)"""
        probe = Req(
            rid="probe",
            origin_input_text="",
            origin_input_ids=array("q", prompt),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )
        probe.init_next_round_input(self.fx.cache)
        self.probes.append(probe)
        return probe, self.fx.cache.lock(probe.last_node)

    @rule(pin=consumes(pins))
    def unpin(self, pin: tuple[Req, object]) -> None:
        """The client goes away before its prefill: unlock, and give back what it held
        (``release_kv_cache`` of a request without KV frees its state slot)."""
        probe, lock = pin
        self.fx.cache.unlock(lock)
        release_kv_cache(probe, self.fx.cache, checkpoint=False)
        self.probes.remove(probe)

    @rule(tokens=st.integers(0, 64), states=st.integers(0, 4))
    def evict(self, tokens: int, states: int) -> None:
        self.fx.cache.evict(EvictParams(num_tokens=tokens, mamba_num=states))

    @rule(states=st.integers(1, 3))
    def evict_states(self, states: int) -> None:
        """States only (the scheduler before a state allocation): Marconi's state walk, which
        also tombstones internal states, without a KV walk deleting leaves first."""
        self.fx.cache.evict(EvictParams(num_tokens=0, mamba_num=states))

    @invariant()
    def accounted(self) -> None:
        kv = sum(self.fx.held_kv(r) for r in self.live)
        states = sum(self.fx.held_states(r) for r in self.live)
        assert states == len(self.live) * (3 if self.fx.extra_buffer else 1)
        probes = sum(self.fx.held_states(r) for r in self.probes)
        assert self.fx.extra_buffer or probes == 0  # no_buffer: a match allocates nothing
        check(self.fx, in_flight_kv=kv, in_flight_states=states + probes)

    def teardown(self) -> None:
        for req in [*self.live, *self.probes]:
            release_kv_cache(req, self.fx.cache, checkpoint=False)
        self.live.clear()


class PagedSGLangCacheMachine(SGLangCacheMachine):
    PAGE_SIZE = 4
    MAMBA_SIZE = 18  # extra_buffer: 3 per running request (working + 2 tracking) + 1 per probe


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
SGLangCacheMachine.TestCase.settings = SETTINGS
PagedSGLangCacheMachine.TestCase.settings = SETTINGS
test_sglang_cache_state_machine = SGLangCacheMachine.TestCase
test_sglang_cache_state_machine_page_4 = PagedSGLangCacheMachine.TestCase
