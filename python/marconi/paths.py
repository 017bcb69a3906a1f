"""Where marconi keeps files it builds on first use (embedded models, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$MARCONI_CACHE_DIR` or `~/.cache/marconi`."""
    return Path(os.environ.get("MARCONI_CACHE_DIR") or Path.home() / ".cache" / "marconi")
