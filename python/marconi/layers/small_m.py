"""The small-M linear kernel for decode (``csrc/small_m_linear.c``), built on first use.

Decode batches multiply a handful of rows by every weight matrix, so their speed is how fast
the weights stream from memory. On this project's CPU (one core) torch's sgemm reads a
row-major fp32 weight at ~11 GB/s for 1 row; the C kernel, which walks the weight once, row by
row, against all (<= 4) input rows, reads it at ~20-28 GB/s for one row, ~13 GB/s for four
(``docs/performance.md``). From about five rows on, with two threads, sgemm catches up.

The C file is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``) into
``$MARCONI_CACHE_DIR/kernels/`` under a name that hashes the source, the flags and the CPU's
feature flags (``-march=native``), and loaded with ``ctypes``: no torch extension build, about
a second the first time, nothing afterwards. If no compiler is found or the build fails, or
``MARCONI_SMALL_M_KERNEL=0``, ``small_m_linear`` is None and callers keep ``F.linear``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from marconi.paths import cache_dir

log = logging.getLogger(__name__)

#: most input rows the kernel takes (its register tile); larger batches use sgemm
MAX_ROWS = 4

_SOURCE = Path(__file__).with_name("csrc") / "small_m_linear.c"
_FLAGS = ["-O3", "-march=native", "-funroll-loops", "-shared", "-fPIC"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def compile_kernel(cc: str, out: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the C source into the shared library ``out`` (atomically: concurrent builders
    each publish a whole file). Raises ``subprocess.CalledProcessError`` with the compiler's
    output on failure."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    try:
        cmd = [cc, *_FLAGS, *extra_flags, str(_SOURCE), "-o", tmp]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load_kernel(path: Path) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """``small_m_linear(x, w, bias, y, m, n, k)`` from a library built by ``compile_kernel``."""
    fn = ctypes.CDLL(str(path)).small_m_linear
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    fn.restype = None
    return fn


@cache
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if os.environ.get("MARCONI_SMALL_M_KERNEL", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        log.info("no C compiler found: decode linears use torch's sgemm")
        return None
    key = hashlib.sha256(
        b"\0".join([_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"small_m_linear-{key}.so"
    try:
        return load_kernel(path if path.is_file() else compile_kernel(cc, path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("small-M linear kernel unavailable (%s): using torch's sgemm", detail)
        return None


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _kernel() is not None


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: ctypes._CFuncPtr | None = None,  # type: ignore[name-defined]
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for contiguous fp32 CPU tensors with 1 <= rows <= MAX_ROWS
    (the caller checks; ``Linear.forward`` does), with ``kernel`` or the built one (then
    ``available()`` must be true)."""
    fn = kernel or _kernel()
    assert fn is not None, "small_m_linear called without the kernel (check available())"
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:  # the C kernel's register tile holds MAX_ROWS rows
        raise ValueError(f"small_m_linear takes 1-{MAX_ROWS} rows, got {m}")
    y = torch.empty(m, n, dtype=torch.float32)
    b = None if bias is None else bias.data_ptr()
    fn(x.data_ptr(), weight.data_ptr(), b, y.data_ptr(), m, n, k)
    return y
