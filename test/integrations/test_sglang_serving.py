"""The user's command, run for real: ``python -m sglang.launch_server --model-path FOLDER
--prefix-cache marconi --device cpu`` on the embedded ``tiny`` (Mamba-2) and ``tiny-jamba``
(Mamba-1) folders, driven by the ``openai`` client and SGLang's native ``/generate``.

Per model, two real SGLang servers start side by side (the Marconi backend and
``--disable-radix-cache``, the no-cache reference); nothing is mocked. Checks: branch-point
hits for a shared system prompt (SGLang's ``no_buffer`` mode, through the plugin's split
prefill), growing ``cached_tokens`` in a 3-turn chat, greedy outputs equal to the no-cache
server's, logprobs equal to marconi's own fp32 forward pass, an aborted stream that leaves the
server serving, and no leak reported by SGLang's idle self-check.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("sglang")
openai = pytest.importorskip("openai")

from marconi.integrations.sglang.launcher import CPU_POOL_ARGS, SGLangServer  # noqa: E402

pytestmark = pytest.mark.timeout(900)

SYSTEM = "You are a terse assistant. Answer in one short line, no more. " * 3  # 186 bytes
#: Mamba state grid of each folder (SGLang's branch points are multiples of it)
GRID = {"tiny": 64, "tiny-jamba": 16}
#: keep the random model's replies printable ASCII, so they re-tokenise to the same ids and a
#: conversation's next turn can continue from the state after the last decoded token
ASCII_ONLY = {str(i): -100 for i in [*range(0, 32), *range(127, 260)]}


@pytest.fixture(scope="module", params=["tiny", "tiny-jamba"])
def servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, SGLangServer, SGLangServer]]:
    from marconi.models.tiny import ensure_tiny

    name = request.param
    folder = ensure_tiny(name)
    logs = tmp_path_factory.mktemp(f"sglang-{name}")
    common = [*CPU_POOL_ARGS, "--enable-cache-report", "--log-level", "info"]
    marconi = SGLangServer(folder, ["--prefix-cache", "marconi", *common], log_path=logs / "m.log")
    nocache = SGLangServer(folder, ["--disable-radix-cache", *common], log_path=logs / "n.log")
    try:
        for s in (marconi, nocache):
            s.start()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(SGLangServer.wait_ready, (marconi, nocache)))
        yield name, folder, marconi, nocache
    finally:
        marconi.stop()
        nocache.stop()


def _client(server: SGLangServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _chat(server: SGLangServer, messages: list[dict[str, str]], **kw: object) -> tuple[str, int]:
    r = _client(server).chat.completions.create(
        model="default", messages=messages, max_tokens=8, temperature=0, **kw
    )
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content or "", details.cached_tokens if details else 0


def test_cpu_settings_are_chosen_and_logged(servers: tuple) -> None:
    _, _, marconi, _ = servers
    log = marconi.log_text()
    assert "marconi: serving on CPU with SGLang (Mamba kernels: marconi's CPU kernels)" in log
    assert "chose attention_backend='torch_native', disable_overlap_schedule=True" in log
    assert "'mamba_radix_cache_strategy': 'no_buffer'" in log and "impl=MarconiRadixCache" in log


def test_shared_system_prompt_hits_at_the_branch_point(servers: tuple) -> None:
    name, _, marconi, nocache = servers
    questions = [
        "Name a colour.",
        "Name a fruit.",
        "Name a planet.",
        "Name a river.",
        "Name a bird.",
    ]
    sys_msg = {"role": "system", "content": SYSTEM}
    shared = len(f"<|system|>\n{SYSTEM}\n<|user|>\nName a ")
    cached, outs = [], []
    for q in questions:
        out, hit = _chat(marconi, [sys_msg, {"role": "user", "content": q}])
        cached.append(hit)
        outs.append(out)
    # the first request caches its sequence; the second finds the branch point by speculative
    # insertion and its prefill ends a chunk there; every later one resumes from that state
    assert cached[:2] == [0, 0]
    for hit in cached[2:]:
        assert shared - GRID[name] <= hit <= shared, cached
    assert outs == [_chat(nocache, [sys_msg, {"role": "user", "content": q}])[0] for q in questions]


def test_three_turn_chat_grows_cached_tokens_with_the_no_cache_outputs(servers: tuple) -> None:
    _, _, marconi, nocache = servers
    history = [{"role": "system", "content": "Be brief. " * 10}]
    reference = list(history)
    cached = []
    for q in ["Hi there, how are you today?", "Tell me more about it.", "And then what?"]:
        history.append({"role": "user", "content": q})
        reference.append({"role": "user", "content": q})
        out, hit = _chat(marconi, history, logit_bias=ASCII_ONLY)
        ref, _ = _chat(nocache, reference, logit_bias=ASCII_ONLY)
        assert out == ref and out.isascii()
        cached.append(hit)
        history.append({"role": "assistant", "content": out})
        reference.append({"role": "assistant", "content": ref})
    assert cached[0] == 0 and cached[0] < cached[1] < cached[2], cached


def _generate(server: SGLangServer, ids: list[int], n: int) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    r = httpx.post(f"{server.url}/generate", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


def test_logprobs_match_marconi_fp32_forward_with_and_without_hits(servers: tuple) -> None:
    """SGLang (our CPU kernels, fp32) vs marconi's own model on the same folder: every greedy
    token's logprob within 1e-4, on a cold prompt and on the same prompt resumed from a hit."""
    import torch
    from marconi.models import ForwardBatch, HybridMemory, SequenceInput, load_model

    _, folder, marconi, _ = servers
    ids = [(37 * i + 11) % 256 for i in range(300)]
    cold = _generate(marconi, ids, 6)
    _generate(marconi, [*ids[:200], 1, 2, 3], 1)  # a branch at ids[:200]'s grid point
    warm = _generate(marconi, [*ids[:200], *ids[200:]], 6)
    assert warm["meta_info"]["cached_tokens"] > 0
    model = load_model(folder)
    for res in (cold, warm):
        out = [int(t) for _, t, _ in res["meta_info"]["output_token_logprobs"]]
        seq = ids + out
        mem = HybridMemory(model.config, num_kv_slots=len(seq), num_state_slots=1)
        batch = ForwardBatch(
            (SequenceInput(seq, list(range(len(seq))), 0),), return_all_logits=True
        )
        with torch.no_grad():
            logits = model(batch, mem).all_logits[0].float()
        ours = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
        assert out == ours.argmax(-1).tolist()
        theirs = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        picked = ours.gather(1, torch.tensor(out).unsqueeze(1))[:, 0]
        assert torch.allclose(theirs, picked, atol=1e-4), (theirs - picked).abs().max()


def test_aborted_stream_leaves_the_server_serving(servers: tuple) -> None:
    _, _, marconi, nocache = servers
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Count slowly to a thousand."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{marconi.url}/v1/chat/completions", json=body, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data:")
            if chunks >= 3:
                break  # closing the connection aborts the request inside SGLang
    msgs = [{"role": "user", "content": "Still there?"}]
    assert _chat(marconi, msgs)[0] == _chat(nocache, msgs)[0]


def test_no_leak_and_both_servers_alive_after_the_run(servers: tuple) -> None:
    _, _, marconi, nocache = servers
    for s in (marconi, nocache):
        assert s.alive(), s.log_tail()
        health = httpx.get(f"{s.url}/health", timeout=30)
        assert health.status_code == 200
        log = s.log_text().lower()
        assert "leak" not in log and "traceback" not in log, s.log_tail()
    info = httpx.get(f"{marconi.url}/get_server_info", timeout=30).json()
    assert json.dumps(info).find("marconi") >= 0
