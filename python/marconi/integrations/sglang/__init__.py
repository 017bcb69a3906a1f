"""Marconi as an SGLang plugin (``pip install "marconi[sglang]"``).

- ``policy``: Marconi's decisions on SGLang tree nodes (no SGLang import; pure Python).
- ``backend``: the ``marconi`` radix-cache backend (SGLang's ``UnifiedRadixCache`` with Marconi
  components) and its factory for ``register_radix_cache_backend``.
- ``plugin``: the ``sglang.srt.plugins`` entry point; adds ``--prefix-cache``.
- ``jamba``: ``JambaForCausalLM`` for SGLang (GPU only, untested on CPU).
"""
