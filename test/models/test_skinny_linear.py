"""The skinny decode linear kernel (``csrc/skinny_linear.c``) against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from marconi.layers import linear, small_m
from marconi.layers.linear import SKINNY, SKINNY_ROWS, Linear, skinny_linear
from model_helpers import portable_build


def test_kernel_builds_where_a_c_compiler_exists() -> None:
    assert SKINNY.get() is not None


@pytest.fixture(scope="module", params=["native", "avx2", "portable"])
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The kernel as built for this CPU, its AVX2 tiles, and its plain C path."""
    if request.param == "native":
        return SKINNY.get()
    return portable_build(SKINNY, tmp_path_factory.mktemp("kernel"), request.param)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 20),
    n=st.integers(1, 70),
    k=st.integers(1, 80),
    bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    big=st.booleans(),
)
def test_matches_f_linear(kernel, m: int, n: int, k: int, bias: bool, threads: int, big: bool):
    """Any rows (tiles of 4, 2 with AVX2, and their remainders), weight rows not a multiple
    of the block, inputs not a multiple of the lanes; ``big`` weights run on the OpenMP
    threads."""
    if big:
        n, k = n * 37, k + 1800
    g = torch.Generator().manual_seed(m * 1000 + n * 7 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = torch.full((m, n), float("nan"))
    kernel(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
           m, n, k, threads)  # fmt: skip
    # fp32 sums against a float64 reference: error grows like sqrt(k) * |x| |w|
    want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=2e-6 * k**0.5)


def test_linear_routes_decode_batches_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    lin = Linear(96, 40)
    calls: list[int] = []

    def counted(x, w, b):
        calls.append(x.shape[0])
        return skinny_linear(x, w, b)

    monkeypatch.setattr(linear, "skinny_linear", counted)
    monkeypatch.setattr(small_m, "_enabled", False)  # as the engine runs (spinning OpenMP)
    lo, hi = SKINNY_ROWS
    with torch.no_grad():
        for rows in (lo - 1, lo, hi, hi + 1):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5,
                                       atol=1e-5)  # fmt: skip
    assert calls == [lo, hi]


def test_row_range_and_its_override() -> None:
    """1-16 rows, or the top the user sets with ``MARCONI_SKINNY_MAX_ROWS``; read in a fresh
    interpreter, as at import."""
    import os
    import subprocess
    import sys

    code = "from marconi.layers.linear import SKINNY_ROWS; print(*SKINNY_ROWS)"
    want = int(os.environ.get("MARCONI_SKINNY_MAX_ROWS", "16"))
    assert SKINNY_ROWS[0] == 1 and SKINNY_ROWS[1] == want
    env = {**os.environ, "MARCONI_SKINNY_MAX_ROWS": "7"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["1", "7"], out.stderr
