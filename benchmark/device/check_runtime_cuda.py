"""The runtime's acceptance checks on a device (run by check_runtime.sh; CUDA on a lent GPU).

Runs the HF-equivalence cases and the resume check with model and memory on ``DEVICE``
(default: cuda if torch sees one, else cpu, so the script runs here too), in fp32 (TF32 off:
the tolerances of the CPU tests), fp32 with torch's TF32 defaults and bf16 (both reported only).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "models"))

import test_equivalence_hf as eq
from marconi.models import load_model
from model_helpers import greedy_decode, prefill


def device() -> torch.device:
    """``$DEVICE``, else cuda where torch sees one, else the CPU."""
    return torch.device(os.environ.get("DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))


def set_tf32(matmul: bool, cudnn: bool) -> None:
    """Whether CUDA matmuls / cuDNN convolutions may round fp32 inputs to TF32."""
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def hf_cases() -> Iterator[tuple[str, torch.nn.Module, Path, list[int]]]:
    """(name, randomized transformers model on the CPU, its saved folder, prompt ids) for each
    config of the CPU equivalence test, built as that test builds them."""
    for make in (eq._nemotron_h, eq._granite, eq._bamba, eq._jamba):
        torch.manual_seed(0)
        hf = make().eval()
        eq._randomize(hf, 1)
        folder = Path(tempfile.mkdtemp())
        hf.save_pretrained(folder)
        gen = torch.Generator().manual_seed(2)
        yield (
            make.__name__[1:],
            hf,
            folder,
            torch.randint(0, eq.VOCAB, (eq.PROMPT,), generator=gen).tolist(),
        )


def main() -> int:
    dev, failures = device(), 0
    torch_default = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    for name, hf, folder, ids in hf_cases():
        ieee = (False, False)
        cases = [("fp32", torch.float32, 1e-4, ieee), ("bf16", torch.bfloat16, None, ieee)]
        if dev.type == "cuda":  # torch's own default lets cuDNN convolve fp32 in TF32
            cases.insert(1, ("fp32+tf32", torch.float32, None, torch_default))
        for label, dtype, tol, (mm, cudnn) in cases:
            set_tf32(mm, cudnn)
            ours = load_model(folder, dtype=dtype, device=dev)
            mem = ours.allocate_memory(eq.PROMPT + eq.STEPS + 1, 2)
            logits = prefill(ours, mem, ids, range(eq.PROMPT), 0)
            toks, dec = greedy_decode(ours, mem, int(logits[-1].argmax()), eq.PROMPT, eq.STEPS, 0)
            with torch.no_grad():
                ref = hf(torch.tensor([ids + toks[: eq.STEPS]])).logits[0].float()
            err = max((logits.cpu() - ref[: eq.PROMPT]).abs().max().item(),
                      (dec.cpu() - ref[eq.PROMPT :]).abs().max().item())  # fmt: skip
            ok = tol is None or err <= tol
            failures += not ok
            verdict = "reported" if tol is None else ("ok" if ok else "FAIL")
            print(f"{name:12s} {label:10s} {err:.2e} {verdict}")
    ours = load_model("tiny", device=dev)
    mem = ours.allocate_memory(1024, 4)
    ids = list(range(200))
    full = prefill(ours, mem, ids, range(200), 0, captures={150: 1})
    mem.copy_state(1, 2)
    rest = prefill(ours, mem, ids[150:], [*range(150), *range(512, 562)], 2)
    err = (rest - full[150:]).abs().max().item()
    failures += err > 1e-4
    print(f"resume tiny {dev} max|diff| {err:.2e}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
