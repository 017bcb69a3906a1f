"""CUDA variant of the runtime's acceptance checks (run by check_runtime.sh on a lent GPU).

Runs the HF-equivalence cases and the resume check with model and memory on CUDA, in fp32
(tolerances as on CPU) and bf16 (loose, reported only).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "models"))

import test_equivalence_hf as eq
from marconi.models import load_model
from model_helpers import greedy_decode, prefill


def main() -> int:
    dev, failures = torch.device("cuda"), 0
    for make in (eq._nemotron_h, eq._granite, eq._bamba, eq._jamba):
        torch.manual_seed(0)
        hf = make().eval()
        eq._randomize(hf, 1)
        folder = Path(tempfile.mkdtemp())
        hf.save_pretrained(folder)
        ids = torch.randint(
            0, eq.VOCAB, (eq.PROMPT,), generator=torch.Generator().manual_seed(2)
        ).tolist()
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, None)):
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
            print(f"{make.__name__[1:]:12s} {dtype!s:15s} {err:.2e} {'ok' if ok else 'FAIL'}")
    ours = load_model("tiny", device=dev)
    mem = ours.allocate_memory(1024, 4)
    ids = list(range(200))
    full = prefill(ours, mem, ids, range(200), 0, captures={150: 1})
    mem.copy_state(1, 2)
    rest = prefill(ours, mem, ids[150:], [*range(150), *range(512, 562)], 2)
    err = (rest - full[150:]).abs().max().item()
    failures += err > 1e-4
    print(f"resume tiny cuda max|diff| {err:.2e}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
