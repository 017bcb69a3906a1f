"""Where our runtime on DEVICE departs from itself on the CPU: the first modules, in execution
order, whose outputs differ (run by check_runtime.sh before the equivalence check).

For each HF config of the equivalence test, our model is loaded on the CPU and on ``DEVICE``
(default cuda, else cpu) from the same folder; one prefill of the same ids, then three decode
steps of the CPU's greedy tokens, run on both with a forward hook on every module, and each
module's output is compared (max |diff| over max |cpu|), TF32 off. Printed per config and step:
the logits' difference, the first module past ``--tol`` and the worst five. A layer kind that
is wrong on the device shows up as the first entry. A diagnostic: it prints, it never fails.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "models"))

import test_equivalence_hf as eq
from check_runtime_cuda import device, hf_cases, set_tf32
from marconi.models import load_model
from model_helpers import greedy_decode, prefill

Outputs = list[tuple[str, torch.Tensor]]


def outputs(model: torch.nn.Module, run: Callable[[], torch.Tensor]) -> tuple[Outputs, Any]:
    """(module name, first output tensor on the CPU) in execution order, and run()'s result."""
    seen: Outputs = []
    hooks = []
    for name, mod in model.named_modules():

        def hook(_m, _i, out, name=name) -> None:
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                seen.append((name or "<model>", t.detach().float().cpu().clone()))

        hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            result = run()
    finally:
        for h in hooks:
            h.remove()
    return seen, result


def report(model: str, label: str, ref: Outputs, got: Outputs, a: Any, b: Any, tol: float):
    """Print the logits' max |diff|, the first module past ``tol`` and the worst five."""
    rel = []
    for (name, x), (_, y) in zip(ref, got, strict=False):
        scale = max(x.abs().max().item(), 1e-12)
        rel.append((name, (x - y).abs().max().item() / scale if x.shape == y.shape else 1e9))
    first = next(((n, f"{d:.1e}") for n, d in rel if d > tol), None)
    worst = sorted(rel, key=lambda x: -x[1])[:5]
    err = (a.cpu() - b.cpu()).abs().max().item()
    print(f"{model:11s} {label}: logits max|diff| {err:.2e}; {len(ref)}/{len(got)} modules; "
          f"first past {tol:g}: {first}")  # fmt: skip
    print("    worst: " + ", ".join(f"{n} {d:.1e}" for n, d in worst))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tol", type=float, default=1e-5, help="relative to the module's max |out|")
    args = ap.parse_args()
    default = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    dev = device()
    print(f"device {dev}; torch defaults: matmul tf32 {default[0]}, cudnn tf32 {default[1]}, "
          f"float32 matmul precision {torch.get_float32_matmul_precision()}; compared with "
          "TF32 off (it made no difference on an H200, session 27)")  # fmt: skip
    set_tf32(False, False)
    for name, _hf, folder, ids in hf_cases():
        runs = {}
        for key, where in (("ref", torch.device("cpu")), ("dev", dev)):
            model = load_model(folder, device=where)
            runs[key] = model, model.allocate_memory(eq.PROMPT + 4, 2)
        prefill_args = (ids, range(eq.PROMPT), 0)
        (ref, ref_logits), (got, logits) = (
            outputs(m, partial(prefill, m, k, *prefill_args)) for m, k in runs.values()
        )
        report(name, "prefill", ref, got, ref_logits, logits, args.tol)
        # decode: the CPU's greedy tokens, fed to both (a near tie cannot fork them)
        tok = int(ref_logits[-1].argmax())
        for step in range(3):
            pos = eq.PROMPT + step
            steps = [
                outputs(m, partial(greedy_decode, m, k, tok, pos, 1, 0)) for m, k in runs.values()
            ]
            (ref_d, (_, ref_dec)), (got_d, (_, dec)) = steps
            report(name, f"decode {step}", ref_d, got_d, ref_dec, dec, args.tol)
            tok = int(ref_dec[-1].argmax())
        set_tf32(*default)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
