"""Constants shared by the plugin entry point and the backend (no SGLang import, no cycle)."""

from __future__ import annotations

#: ``--radix-cache-backend`` name of the Marconi backend
BACKEND_NAME = "marconi"
#: environment variable carrying ``--marconi-alpha`` to the scheduler processes
ALPHA_ENV = "SGLANG_MARCONI_ALPHA"
#: environment variable carrying ``--marconi-preset`` to the scheduler processes
PRESET_ENV = "SGLANG_MARCONI_PRESET"
#: the ``marconi.cache`` presets the backend runs (the first is the default): their states are
#: all where SGLang offers one (prefill-chunk ends, the finished request's state)
SGLANG_PRESETS = ("marconi", "marconi-paper")
#: what an SGLang request may resume from, as a ``marconi.cache.lease.MATCH_RULES`` name:
#: SGLang matches ``fill_ids[:input_len - 1]`` (``Req._compute_max_prefix_len`` in
#: ``sglang/srt/managers/schedule_batch.py``, 0.5.23: "the matched length is at most 1 less
#: than the input length"), i.e. the last-token rule our engine and simulator run by default.
#: The backend's alpha tuner replays with it; ``SimSpec(match_rule=SGLANG_MATCH_RULE)`` too.
SGLANG_MATCH_RULE = "last-token"
