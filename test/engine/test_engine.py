"""Engine tests on the embedded tiny model: cache hits never change greedy outputs; memory is
always given back (integrity + every slot free of requests after each test)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from marconi.engine import LLM, RequestError, SamplingParams, StepTimes

torch.set_num_threads(1)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SYSTEM = list(b"<|system|>\nYou are a terse assistant that answers in one line.\n<|user|>\n")


def user(text: str) -> list[int]:
    return list(f"{text}\n<|assistant|>\n".encode())


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    return {
        "none": LLM("tiny", "none", cache_memory="64MB"),
        "marconi": LLM("tiny", "marconi", cache_memory="64MB", chunked_prefill_size=48),
        "vllm+": LLM("tiny", "vllm+", cache_memory="64MB", chunked_prefill_size=40),
    }


@pytest.fixture(autouse=True)
def _all_memory_back(engines: dict[str, LLM]):
    yield
    for llm in engines.values():
        assert not llm.engine.has_unfinished()
        llm.check_integrity()  # deep check + nothing in flight or locked


def replay(llm: LLM, rounds: list[list[tuple[str, str]]]) -> dict[tuple[str, int], tuple]:
    """Multi-turn chat replay on token ids: each round runs one turn of several sessions
    together; a session's next prompt is its last prompt + reply + a new user message."""
    history: dict[str, list[int]] = {}
    turn: dict[str, int] = {}
    results = {}
    for rnd in rounds:
        prompts = []
        for sid, text in rnd:
            prev = history.get(sid, SYSTEM)
            prompts.append(
                prev + ([] if sid not in history else list(b"\n<|user|>\n")) + user(text)
            )
        outs = llm.generate(prompts, GREEDY)
        for (sid, _), prompt, out in zip(rnd, prompts, outs, strict=True):
            history[sid] = prompt + list(out.token_ids)
            turn[sid] = turn.get(sid, 0) + 1
            results[sid, turn[sid]] = (tuple(prompt), out.token_ids, out.cached_tokens)
    return results


ROUNDS = [
    [("a", "Name a colour.")],
    [("a", "Another one?"), ("b", "What is two plus two?")],
    [("a", "And a third?"), ("b", "Why?"), ("c", "Hello!")],
    [("c", "Tell me more, at length, about anything you like."), ("d", "Zebra facts?")],
]


def common_prefix(a: tuple, b: tuple) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_greedy_outputs_identical_with_and_without_prefix_cache(engines: dict[str, LLM]) -> None:
    ref = replay(engines["none"], ROUNDS)
    assert all(cached == 0 for _, _, cached in ref.values())
    for name in ("marconi", "vllm+"):
        got = replay(engines[name], ROUNDS)
        assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in ref.items()}, name
    got = replay(engines["marconi"], [[("x", "warm")]])  # reuse the tree of the replay above
    assert got["x", 1][2] > 0


def test_marconi_hits_branch_points_and_continuations(engines: dict[str, LLM]) -> None:
    llm = LLM("tiny", "marconi", cache_memory="64MB", chunked_prefill_size=48)
    res = replay(llm, ROUNDS)
    # continuation: the state after the last decoded token of the previous turn
    for sid, t in (("a", 2), ("a", 3), ("b", 2), ("c", 2)):
        prev_prompt, prev_out, _ = res[sid, t - 1]
        assert res[sid, t][2] == len(prev_prompt) + len(prev_out) - 1, (sid, t)
    # branch point: b's first prompt split a's edge at the shared system prompt; c and d hit it
    shared = common_prefix(res["a", 1][0], res["b", 1][0])
    assert shared >= len(SYSTEM)
    assert res["b", 1][2] == 0
    assert res["c", 1][2] == shared
    assert res["d", 1][2] == shared
    # one state after the last decoded token per request (8), plus b's branch point, plus the
    # learned admission's prior for the first request (one token before its prompt end; from
    # the second request on, the ghosts show that only the decoded state is reused)
    stats = llm.engine.cache.stats
    assert (stats.states_admitted, stats.states_declined, stats.evicted_states) == (10, 0, 0)
    llm.check_integrity()


def test_eviction_under_memory_pressure_keeps_outputs_and_accounting(
    engines: dict[str, LLM],
) -> None:
    small = LLM("tiny", "marconi", cache_memory="16MB", check_integrity=True)
    prompts = [SYSTEM + user(f"question number {i} " * (1 + i % 3)) for i in range(10)]
    got = small.generate(prompts, GREEDY)
    ref = engines["none"].generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    cache = small.engine.cache
    assert cache.stats.evicted_states > 0
    # every admitted state is in the tree or was evicted, exactly
    assert cache.stats.states_admitted - cache.stats.evicted_states == cache.tree.state_slots
    small.check_integrity()


def test_abort_frees_running_and_waiting_requests(engines: dict[str, LLM]) -> None:
    eng = engines["marconi"].engine
    reqs = [
        eng.make_request(SYSTEM + user("x" * 100 * (i + 1)), SamplingParams(max_tokens=50))
        for i in range(3)
    ]
    for r in reqs:
        eng.add_request(r)
    eng.step()
    eng.step()
    assert eng.scheduler.running
    for r in reqs:
        out = eng.abort(r.rid)
        assert out is not None and out.finished and out.finish_reason == "abort"
    assert eng.abort(reqs[0].rid) is None
    assert not eng.has_unfinished()


PROMPT = SYSTEM + user("Count.")


@pytest.fixture(scope="module")
def free_run(engines: dict[str, LLM]):
    """The greedy 12-token completion of ``PROMPT`` (what the next tests cut short)."""
    free = engines["marconi"].generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0))
    assert free[0].finish_reason == "length" and len(free[0].token_ids) == 12
    return free[0]


def test_stop_string_ends_the_completion_right_before_it(engines: dict[str, LLM], free_run) -> None:
    text = free_run.text
    assert len(text) >= 3  # the tiny model's greedy text is long enough to cut
    stop = text[1:3]
    cut = engines["marconi"].generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0, stop=(stop,))
    )[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]


def test_stop_token_id_ends_the_completion_on_it(engines: dict[str, LLM], free_run) -> None:
    tok = free_run.token_ids[2]
    eos = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(tok,))
    out = engines["marconi"].generate([PROMPT], eos)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free_run.token_ids[: free_run.token_ids.index(tok) + 1]


def test_seeded_sampling_is_reproducible(engines: dict[str, LLM]) -> None:
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    a, b = engines["marconi"].generate([PROMPT, PROMPT], seeded)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8


def test_logit_bias_bans_tokens(engines: dict[str, LLM]) -> None:
    banned = SamplingParams(
        max_tokens=8, temperature=1.0, logit_bias=tuple((t, -100.0) for t in range(128, 260))
    )
    out = engines["marconi"].generate([PROMPT], banned)[0]
    assert len(out.token_ids) == 8 and all(t < 128 for t in out.token_ids)


def test_invalid_requests_are_rejected_before_queueing(engines: dict[str, LLM]) -> None:
    eng = engines["none"].engine
    with pytest.raises(RequestError, match="empty"):
        eng.make_request([], SamplingParams())
    with pytest.raises(RequestError) as e:
        eng.make_request(np.zeros(eng.context_length, dtype=np.int64), SamplingParams())
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestError, match="cache memory"):
        eng.make_request([1, 2, 3], SamplingParams(max_tokens=60_000))
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    assert not eng.has_unfinished()


def test_alpha_auto_runs_the_shadow_tuner_on_finished_requests(engines: dict[str, LLM]) -> None:
    from marconi.cache.tuning import ShadowTuner

    engine = engines["marconi"].engine
    assert isinstance(engine.tuner, ShadowTuner)
    assert engines["none"].engine.tuner is None
    before = engine.tuner.seen
    engines["marconi"].generate([SYSTEM + user("Say hi.")], GREEDY)
    assert engine.tuner.seen == before + 1
    for shadow in engine.tuner.shadows:  # own pools (slot ids only: pools hold no tensors)
        assert shadow.pools.state is not engine.cache.pools.state
        shadow.check_integrity()


#: fp32 bound on |logits(cache hit) - logits(no cache)| for every sampled token; resuming from a
#: stored state only reorders fp32 sums (measured: 2.3e-6 on this replay)
LOGITS_ATOL = 1e-4


def test_logits_with_cache_hits_match_no_cache_within_fp32_tolerance(
    engines: dict[str, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every sampled token's logits (prefill end and each decode step) with ``marconi`` match
    ``none`` within LOGITS_ATOL, on a replay whose later turns resume from cached states."""
    recorded: dict[str, dict[tuple, torch.Tensor]] = {}
    for name in ("none", "marconi"):
        runner, seen = engines[name].engine.runner, {}
        recorded[name] = seen
        real_sample = runner.sample

        def spy(logits, reqs, real_sample=real_sample, seen=seen):  # records, then samples
            for row, req in zip(logits, reqs, strict=True):
                seen[tuple(int(t) for t in req.prompt_ids), len(req.output_ids)] = row.clone()
            return real_sample(logits, reqs)

        monkeypatch.setattr(runner, "sample", spy)
        results = replay(engines[name], ROUNDS)
        if name == "marconi":
            assert sum(cached for _, _, cached in results.values()) > 0
    assert recorded["none"].keys() == recorded["marconi"].keys()
    worst = max(
        float((recorded["marconi"][k] - recorded["none"][k]).abs().max()) for k in recorded["none"]
    )
    assert worst <= LOGITS_ATOL


def _run_in_order(llm: LLM, prompts: dict[str, list[int]]) -> tuple[list[str], dict, dict]:
    """Queue ``prompts`` at once (dict order = arrival order): finishing order, outputs and
    cached tokens per request."""
    engine = llm.engine
    for rid, ids in prompts.items():
        engine.add_request(engine.make_request(ids, GREEDY, rid=rid))
    order, outputs, cached = [], {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.rid] = outputs.get(out.rid, ()) + out.token_ids
            if out.finished:
                order.append(out.rid)
                cached[out.rid] = out.cached_tokens
    return order, outputs, cached


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "spf", "srpf"])
def test_lpm_admits_the_longest_cached_prefix_first_without_changing_outputs(policy: str) -> None:
    # one request at a time, so the finishing order is the admission order
    llm = LLM("tiny", "marconi", cache_memory="64MB", max_running_requests=1,
              schedule_policy=policy)  # fmt: skip
    doc = SYSTEM + list(b"A long shared document. " * 8)
    llm.generate([doc + user("Summarise it.")], GREEDY)
    llm.generate([doc + user("And the title?")], GREEDY)  # checkpoints its branch point: the doc
    prompts = {
        "cold-1": list(b"A prompt that shares nothing with the cache, and is long.\n"),
        "cold-2": list(b"Another prompt with no cache.\n"),
        "warm": doc + user("Who wrote it?"),
    }
    order, outputs, cached = _run_in_order(llm, prompts)
    assert cached["warm"] >= len(doc) and cached["cold-1"] == cached["cold-2"] == 0
    want = {"lpm": ["warm", "cold-1", "cold-2"], "spf": ["warm", "cold-2", "cold-1"]}
    want["srpf"] = want["spf"]
    assert order == want.get(policy, list(prompts))  # warm: the fewest tokens left to prefill
    uncached = LLM("tiny", "none", cache_memory="64MB").generate(list(prompts.values()), GREEDY)
    assert outputs == {rid: out.token_ids for rid, out in zip(prompts, uncached, strict=True)}
    llm.check_integrity()


def test_unknown_schedule_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="choose one of fcfs, lpm, spf, srpf"):
        LLM("tiny", "marconi", schedule_policy="random")


def test_onednn_keeps_a_primitive_per_row_count_of_a_long_running_server() -> None:
    """After ``import marconi.engine``, oneDNN's cache keeps more than its default 1,024
    primitives: a packed ``Linear`` run at 1,100 row counts finds the first one's primitive
    again (``ONEDNN_VERBOSE`` logs each creation as a cache hit or miss)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEDNN_")}
    code = (
        "import marconi.engine, torch; from marconi.layers.linear import Linear; "
        "torch.set_grad_enabled(False); lin = Linear(16, 8); "
        "[lin(torch.zeros(m, 16)) for m in [*range(20, 1120), 20]]"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env | {"ONEDNN_VERBOSE": "all"},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    log = out.stdout + out.stderr
    assert log.count("create:cache_miss,cpu,inner_product") == 1100  # one per row count
    assert log.count("create:cache_hit,cpu,inner_product") == 1  # the first one's, kept


def test_onednn_cache_grows_with_the_step_size_unless_the_user_chose(monkeypatch, caplog) -> None:
    """``size_onednn_cache`` raises the capacity to every (weight kind, packed row count) pair
    a step can hold, in multiples of 1,024, keeps the 4,096 default when that is enough, and
    keeps (with a warning) a capacity the user set."""
    import logging

    from marconi.engine import runner
    from marconi.layers.linear import PACKED_MIN_ROWS, SKINNY, SKINNY_ROWS, Linear

    model = torch.nn.Sequential(Linear(16, 8), Linear(16, 8), Linear(8, 16, bias=False))
    low = SKINNY_ROWS[1] + 1 if SKINNY.get() is not None else PACKED_MIN_ROWS
    name = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
    monkeypatch.setattr(runner, "ONEDNN_CAPACITY_SET_BY_USER", False)
    for rows, want in ((288, 4096), (4000, -(-2 * (4000 - low + 1) // 1024) * 1024)):
        monkeypatch.setenv(name, "4096")
        assert runner.size_onednn_cache(model, rows) == 2 * (rows - low + 1)  # 2 weight kinds
        assert int(os.environ[name]) == want
    monkeypatch.setattr(runner, "ONEDNN_CAPACITY_SET_BY_USER", True)
    monkeypatch.setenv(name, "2048")
    with caplog.at_level(logging.WARNING, logger=runner.__name__):
        runner.size_onednn_cache(model, 4000)
    assert os.environ[name] == "2048" and "lower --chunked-prefill-size" in caplog.text


@pytest.mark.parametrize(
    ("preset", "want"),
    [
        ({}, "ACTIVE 300000"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "PASSIVE -"),
        ({"GOMP_SPINCOUNT": "1000"}, "- 1000"),
    ],
)
def test_openmp_threads_spin_briefly_unless_the_user_chose(preset, want) -> None:
    """``import marconi.engine`` (the server's first import) sets a bounded OpenMP spin before
    torch loads libgomp, and leaves a user's own setting alone (``docs/performance_log.md``)."""
    import os
    import subprocess
    import sys

    names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    env = {k: v for k, v in os.environ.items() if k not in names} | preset
    code = (
        "import marconi.engine, os, sys; "
        f"print(*(os.environ.get(k, '-') for k in {names!r}), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == [*want.split(), "True"], out.stderr


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}, False),  # the default
        ({"OMP_WAIT_POLICY": "PASSIVE"}, True),
        ({"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "3000"}, False),
        ({"OMP_WAIT_POLICY": "PASSIVE", "MARCONI_SMALL_M_KERNEL": "0"}, False),
        ({"OMP_WAIT_POLICY": "ACTIVE", "MARCONI_SMALL_M_KERNEL": "1"}, True),
    ],
)
def test_decode_rows_take_the_c_kernel_only_where_openmp_threads_sleep(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], want: bool
) -> None:
    from marconi.engine.runner import decode_kernel_wanted

    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MARCONI_SMALL_M_KERNEL"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert decode_kernel_wanted() is want


@pytest.mark.parametrize("policy", ["spf", "srpf"])
def test_srpf_lets_a_short_arrival_go_before_a_long_prefill_remainder(policy: str) -> None:
    # a 4-chunk prompt starts alone; a 1-chunk one arrives after its first chunk
    llm = LLM("tiny", "marconi", cache_memory="64MB", chunked_prefill_size=16,
              schedule_policy=policy)  # fmt: skip
    engine = llm.engine
    long_ids, short_ids = list(b"x" * 60 + b"\n"), list(b"short\n")
    engine.add_request(engine.make_request(long_ids, GREEDY, rid="long"))
    assert engine.step() == []  # the long one's first chunk: no token yet
    engine.add_request(engine.make_request(short_ids, GREEDY, rid="short"))
    first: dict[str, int] = {}
    outputs: dict[str, tuple[int, ...]] = {}
    step = 1
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            first.setdefault(out.rid, step)
            outputs[out.rid] = outputs.get(out.rid, ()) + out.token_ids
        llm.check_integrity()
    if policy == "srpf":  # the short prompt's one chunk runs next; the long one resumes after
        assert first == {"short": 2, "long": 5}
    else:  # the long remainder keeps the budget: 3 more chunks, the short one shares the last
        assert first == {"long": 4, "short": 5}
    uncached = LLM("tiny", "none", cache_memory="64MB").generate([long_ids, short_ids], GREEDY)
    assert outputs == {"long": uncached[0].token_ids, "short": uncached[1].token_ids}


def test_srpf_lets_at_most_half_a_long_prefill_go_ahead_of_it() -> None:
    # a 4-chunk prompt (64 uncached tokens) starts alone; after its first chunk, three 15-token
    # prompts arrive: two (30 tokens <= 32, half of 64) go ahead of it, the third waits for it
    llm = LLM("tiny", "marconi", cache_memory="64MB", chunked_prefill_size=16)
    engine = llm.engine
    engine.add_request(engine.make_request(list(b"x" * 63 + b"\n"), GREEDY, rid="long"))
    assert engine.step() == []
    for i in range(3):
        engine.add_request(engine.make_request(list(b"short %d ......\n" % i), GREEDY, rid=f"s{i}"))
    first: dict[str, int] = {}
    step = 1
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            first.setdefault(out.rid, step)
        llm.check_integrity()
    # s0 and s1 go first (s1 starts on step 2's last token); s2 waits for the long remainder
    # (unbounded, as before the share: s2 on step 4 and the long one on step 7)
    assert first == {"s0": 2, "s1": 3, "long": 6, "s2": 7}


def test_step_times_split_the_engine_threads_time_by_phase(engines: dict[str, LLM]) -> None:
    llm = engines["marconi"]
    before, steps = llm.engine.stats().step_times, llm.engine.steps
    t0 = time.perf_counter()
    llm.generate([SYSTEM + user("how long does a step take?")], GREEDY)
    wall = time.perf_counter() - t0
    after = llm.engine.stats().step_times
    spent = {k: after[i] - before[i] for i, k in enumerate(StepTimes._fields)}
    assert llm.engine.steps > steps
    # every phase ran, and the phases are disjoint intervals inside the call's wall time
    assert all(v > 0 for v in spent.values()), spent
    assert sum(spent.values()) <= wall
