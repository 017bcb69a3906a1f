"""C kernels in ``csrc/``, each built on first use with the system compiler.

A kernel's C file is compiled with ``$CC`` (else ``cc``/``gcc``/``clang``) into
``$MARCONI_CACHE_DIR/kernels/`` under a name that hashes the source, the headers of
``csrc/``, the flags and the CPU's feature flags (``-march=native``): no torch extension
build, about a second the first time, nothing afterwards. If no compiler is found, the build
fails, or the kernel's switch variable is ``0``, ``CKernel.get()`` is None and callers keep
their torch path.

Where Python's headers exist the library is also a Python extension module (``csrc/pyext.h``:
``-DMARCONI_PYEXT``) and ``get()`` returns its METH_FASTCALL function, which takes the same
arguments as the ctypes one but costs well under a microsecond a call instead of ~10 us (a decode
step makes ~100 kernel calls). Otherwise, or with ``MARCONI_KERNEL_FFI=ctypes``, the plain
library is loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from marconi.paths import cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-funroll-loops", "-shared", "-fPIC")


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


#: file suffix of a kernel library built as a Python extension module
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def python_ext_flags() -> tuple[str, ...]:
    """Compiler flags that make a kernel a Python extension too, or () (no headers, or
    ``MARCONI_KERNEL_FFI=ctypes``)."""
    include = sysconfig.get_paths().get("include")
    if os.environ.get("MARCONI_KERNEL_FFI") == "ctypes" or not include:
        return ()
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return ()
    return ("-DMARCONI_PYEXT", f"-I{include}")


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


@dataclass(frozen=True)
class CKernel:
    """The C function ``symbol`` of ``csrc/<source>`` with ctypes ``argtypes`` (returns void);
    the environment variable ``switch=0`` turns it off."""

    source: str
    symbol: str
    argtypes: tuple[Any, ...]
    switch: str
    libs: tuple[str, ...] = ()  # linker arguments after the source, e.g. ("-lm",)
    cflags: tuple[str, ...] = ()  # compiler flags of this kernel alone, e.g. ("-fopenmp",)

    @property
    def path(self) -> Path:
        return CSRC / self.source

    def compile(self, cc: str, out: Path, extra_flags: tuple[str, ...] = ()) -> Path:
        """Compile into the shared library ``out`` (atomically: concurrent builders each publish
        a whole file). If the kernel's own ``cflags`` fail (a compiler without OpenMP), it is
        built without them (its pragmas then run serially). Raises
        ``subprocess.CalledProcessError`` with the compiler's output."""
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
        os.close(fd)
        try:
            cmd = [cc, *FLAGS, *extra_flags, str(self.path), *self.libs, "-o", tmp]
            try:
                subprocess.run([*cmd[:1], *self.cflags, *cmd[1:]], check=True, capture_output=True)
            except subprocess.CalledProcessError as e:
                if not self.cflags:
                    raise
                log.info("%s: %s failed (%s); building without", self.source, self.cflags, e)
                subprocess.run(cmd, check=True, capture_output=True, text=True)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return out

    def load(self, path: Path) -> Any:
        """The function from a library built by ``compile``: the extension module's if it is
        one (see the module docstring), else through ctypes."""
        if path.name.endswith(EXT_SUFFIX):
            loader = importlib.machinery.ExtensionFileLoader(self.path.stem, str(path))
            spec = importlib.util.spec_from_loader(self.path.stem, loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            self.__dict__["_module"] = module  # for companion()
            return getattr(module, self.symbol)
        fn = getattr(ctypes.CDLL(str(path)), self.symbol)
        fn.argtypes = list(self.argtypes)
        fn.restype = None
        return fn

    def get(self) -> Any | None:
        """The built function (built on the first call), or None (see the module docstring).
        Called per layer per step: the first result is kept on the instance."""
        return self._built

    def companion(self, symbol: str, argtypes: tuple[Any, ...], restype: Any = None) -> Any | None:
        """Another function of the same library (same globals as ``get()``'s): the extension
        module's where it exports ``symbol``, else through ctypes; None when the kernel is
        unavailable."""
        if self.get() is None:
            return None
        module = self.__dict__.get("_module")
        if module is not None and hasattr(module, symbol):
            return getattr(module, symbol)
        fn = getattr(ctypes.CDLL(str(self.__dict__["_library"])), symbol)
        fn.argtypes, fn.restype = list(argtypes), restype
        return fn

    @cached_property
    def _built(self) -> Any | None:
        return _build(self)


def _build(kernel: CKernel) -> Any | None:
    if os.environ.get(kernel.switch, "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        log.info("no C compiler found: %s uses its torch path", kernel.symbol)
        return None
    extra = python_ext_flags()
    headers = [h.read_bytes() for h in sorted(CSRC.glob("*.h"))]  # any may be included
    flags = FLAGS + kernel.cflags + extra + kernel.libs
    parts = [kernel.path.read_bytes(), *headers, " ".join(flags).encode(), cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"{kernel.symbol}-{key}{EXT_SUFFIX if extra else '.so'}"
    try:
        fn = kernel.load(path if path.is_file() else kernel.compile(cc, path, extra))
        kernel.__dict__["_library"] = path  # for companion()
        return fn
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("C kernel %s unavailable (%s): using its torch path", kernel.symbol, detail)
        return None
