"""Marconi: prefix caching for hybrid (Attention + SSM) LLMs."""

from __future__ import annotations

__version__ = "0.1.0"
