"""Trace variants whose next turn does not extend the fed tokens exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from marconi.cache.tree import common_prefix_len
from marconi.sim.cli import main
from marconi.sim.trace_variants import parse_variant, reasoning, retokenized
from marconi.sim.traces import default_trace_dir
from synthetic import chat_sessions

HAVE_TRACES = (default_trace_dir() / "sharegpt_multiturn.jsonl.xz").exists()


def _fed(req) -> np.ndarray:
    return np.concatenate([req.input_ids, req.output_ids[:-1]])


def _next_turn_overlap(trace) -> list[tuple[int, int]]:
    """(shared prefix with the previous turn's fed tokens, previous prompt length) per turn."""
    last: dict[str, object] = {}
    out = []
    for r in trace:
        prev = last.get(r.session_id)
        if prev is not None:
            out.append((common_prefix_len(_fed(prev), r.input_ids), prev.num_input_tokens))
        last[r.session_id] = r
    return out


def test_reasoning_outputs_start_with_what_the_history_drops() -> None:
    base = chat_sessions(sessions=3, turns=4)
    var = reasoning(base, share=0.25)
    fresh = []
    for b, v in zip(base, var, strict=True):
        assert np.array_equal(b.input_ids, v.input_ids)
        extra = round(len(b.output_ids) / 3)  # 0.25 of the new output
        assert len(v.output_ids) == len(b.output_ids) + extra
        assert np.array_equal(v.output_ids[extra:], b.output_ids)
        fresh.extend(v.output_ids[:extra].tolist())
    assert len(fresh) == len(set(fresh)) and min(fresh) < 0 and max(fresh) < 0
    assert all(shared == prompt for shared, prompt in _next_turn_overlap(var))
    assert all(shared > prompt for shared, prompt in _next_turn_overlap(base))
    assert [len(r.output_ids) for r in reasoning(base, share=0.0)] == [
        len(r.output_ids) for r in base
    ]
    with pytest.raises(ValueError, match="share"):
        reasoning(base, share=1.0)


def test_retokenized_replies_diverge_inside_the_reply() -> None:
    base = chat_sessions(sessions=3, turns=4)
    var = retokenized(base, share=1.0, seed=7)
    assert [len(r.output_ids) for r in var] == [len(r.output_ids) + 1 for r in base]
    for shared, prompt in _next_turn_overlap(var):
        assert prompt <= shared < prompt + 40  # before the reply's end
    again = retokenized(base, share=1.0, seed=7)
    assert all(np.array_equal(a.output_ids, b.output_ids) for a, b in zip(var, again, strict=True))
    assert retokenized(base, share=0.0) == list(base)


def test_parse_variant() -> None:
    assert parse_variant("swe") == ("swe", None, {})
    assert parse_variant("sharegpt+reasoning:share=0.3") == (
        "sharegpt",
        "reasoning",
        {"share": 0.3},
    )
    with pytest.raises(ValueError, match="trace variant"):
        parse_variant("sharegpt+nope")


@pytest.mark.skipif(not HAVE_TRACES, reason="../shared/traces is missing")
def test_cli_runs_a_variant(capsys) -> None:
    args = ["run", "--trace", "sharegpt+reasoning:share=0.5", "--num-sessions", "10"]
    assert main([*args, "--capacity", "50GB", "--json"]) == 0
    learned = json.loads(capsys.readouterr().out)
    assert main([*args, "--capacity", "50GB", "--json", "--policy", "sglang+"]) == 0
    paper = json.loads(capsys.readouterr().out)
    assert learned["token_hit_rate"] > paper["token_hit_rate"]
