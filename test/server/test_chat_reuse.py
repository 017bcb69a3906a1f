"""A new user's 3-turn chat (long system prompt, greedy, replies as the model writes them, so
they need not re-tokenise to the ids it generated): every turn after the first reuses more."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import start_server

SYSTEM = (
    "You are a helpful assistant for a small bakery. Answer questions about opening hours, "
    "bread, cakes, allergens and orders. Keep answers short and friendly. "
) * 8  # ~1,160 characters, as in the report of issue 10
QUESTIONS = ("What time do you open?", "Do you have rye bread?", "Can I order a cake?")


def three_turns(prefix_cache: str) -> tuple[list[tuple[str, int]], dict | None]:
    """(reply, cached tokens) per turn, and what the admission learned (``/debug/cache``)."""
    srv = start_server(prefix_cache=prefix_cache, context_length=2048, chunked_prefill_size=64)
    try:
        cli = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "system", "content": SYSTEM}]
        out = []
        for q in QUESTIONS:
            messages.append({"role": "user", "content": q})
            resp = cli.chat.completions.create(
                model=srv.model_name, messages=messages, max_tokens=12, temperature=0
            )
            reply = resp.choices[0].message.content
            out.append((reply, resp.usage.prompt_tokens_details.cached_tokens))
            messages.append({"role": "assistant", "content": reply})
        return out, httpx.get(f"{srv.url}/debug/cache", timeout=10).json()["admission"]
    finally:
        srv.stop()


@pytest.mark.timeout(300)
def test_every_turn_after_the_first_reuses_more_with_unchanged_outputs() -> None:
    ref, unlearned = three_turns("none")
    got, learned = three_turns("marconi")
    assert [r for r, _ in got] == [r for r, _ in ref]
    cached = [c for _, c in got]
    assert cached[0] == 0 and 0 < cached[1] < cached[2], cached
    assert cached[1] >= len(SYSTEM)  # at least the first prompt (one byte per character)
    # what the admission learned: later turns resumed from ghosts, and the best kind is admitted
    assert unlearned is None and learned is not None
    best = max(learned["yields"], key=learned["yields"].get)
    assert learned["yields"][best] > 0 and best in learned["admitted"], learned
