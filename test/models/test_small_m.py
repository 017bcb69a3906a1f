"""The decode linear kernel (``marconi.layers.small_m``) against ``F.linear``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from marconi.layers import small_m
from marconi.layers.linear import Linear
from model_helpers import portable_build


def test_kernel_builds_where_a_c_compiler_exists() -> None:
    assert shutil.which("cc") or shutil.which("gcc"), "CI machines have a C compiler"
    assert small_m.available()


@pytest.fixture(scope="module", params=["native", "portable"])
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The kernel as built for this CPU, and its portable C path (no AVX-512 intrinsics)."""
    if request.param == "native":
        assert small_m.available()
        return None  # small_m_linear's own build
    return portable_build(small_m.KERNEL, tmp_path_factory.mktemp("kernel"))


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 15), (33, 17), (130, 384), (64, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(kernel, m: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = small_m.small_m_linear(x, w, b, kernel)
    # fp32, only the summation order differs: error grows like sqrt(k) * |x| |w|
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=2e-6 * k**0.5)


def test_linear_routes_decode_rows_to_the_kernel_and_the_rest_to_torch() -> None:
    lin = Linear(96, 40)
    with torch.no_grad():
        for rows in (1, small_m.MAX_ROWS, small_m.MAX_ROWS + 1, 300):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5,
                                       atol=1e-5)  # fmt: skip
        x_t = torch.randn(96, 3).t()  # non-contiguous input
        torch.testing.assert_close(lin(x_t), F.linear(x_t, lin.weight, lin.bias))
    x = torch.randn(2, 96, requires_grad=True)  # autograd still works (torch path)
    lin(x).sum().backward()
    assert x.grad is not None


def test_env_switch_turns_the_kernel_off() -> None:
    code = "from marconi.layers import small_m; print(small_m.available())"
    env = {**os.environ, "MARCONI_SMALL_M_KERNEL": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_more_rows_than_the_tile_are_refused() -> None:
    x, w = torch.randn(small_m.MAX_ROWS + 1, 16), torch.randn(4, 16)
    with pytest.raises(ValueError, match="rows"):
        small_m.small_m_linear(x, w, None)


def test_two_threads_match_f_linear_and_share_the_work() -> None:
    """The helper thread's chunks land in the right rows, across many back-to-back calls (the
    helper spins between them) and from two caller threads at once (one of them then runs
    alone): the output equals F.linear's, every time."""
    import threading

    assert small_m.set_threads(2) == 2
    try:
        g = torch.Generator().manual_seed(7)
        shapes = [(130, 384), (1536, 384), (384, 1536), (260, 384), (4097, 64)]
        weights = [(torch.randn(n, k, generator=g), torch.randn(n, generator=g)) for n, k in shapes]
        before = small_m.stats()
        errors: list[str] = []

        def hammer(seed: int) -> None:
            gen = torch.Generator().manual_seed(seed)
            for it in range(300):
                w, b = weights[it % len(weights)]
                x = torch.randn(1 + it % small_m.MAX_ROWS, w.shape[1], generator=gen)
                got, want = small_m.small_m_linear(x, w, b), F.linear(x, w, b)
                if not torch.allclose(got, want, rtol=1e-5, atol=2e-6 * w.shape[1] ** 0.5):
                    errors.append(f"call {it}: max err {(got - want).abs().max():.3g}")

        hammer(0)
        pair = [threading.Thread(target=hammer, args=(s,)) for s in (1, 2)]
        for t in pair:
            t.start()
        for t in pair:
            t.join()
        assert not errors, errors[:5]
        after = small_m.stats()
        assert after["calls"] > before["calls"]  # the two-thread path ran
    finally:
        assert small_m.set_threads(1) == 1


def test_kernels_load_as_python_extensions_with_a_ctypes_fallback() -> None:
    """Where Python's headers exist (dev and CI) the kernels are METH_FASTCALL functions that
    check their arguments; ``MARCONI_KERNEL_FFI=ctypes`` builds and loads the plain library."""
    import types

    from marconi.layers import ckernel, norm, ssm_step

    assert ckernel.python_ext_flags()
    for kernel in (small_m.KERNEL, ssm_step.KERNEL, ssm_step.PREFILL, norm.KERNEL):
        assert isinstance(kernel.get(), types.BuiltinFunctionType), kernel.symbol
    assert isinstance(ssm_step.fused_kernel(), types.BuiltinFunctionType)  # a companion
    with pytest.raises(TypeError, match="takes 7 arguments"):
        small_m.KERNEL.get()(0, 0, None, 0, 1, 1)
    code = (
        "import torch, torch.nn.functional as F; from marconi.layers import small_m; "
        "x, w = torch.randn(3, 40), torch.randn(150, 40); "
        "ok = torch.allclose(small_m.small_m_linear(x, w, None), F.linear(x, w), atol=1e-4); "
        "print(type(small_m.KERNEL.get()).__name__, ok)"
    )
    env = {**os.environ, "MARCONI_KERNEL_FFI": "ctypes"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["_FuncPtr", "True"], out.stderr
