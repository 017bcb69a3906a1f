"""Marconi as an SGLang plugin (``pip install "marconi[sglang]"``).

- ``policy``: Marconi's decisions on SGLang tree nodes (no SGLang import; pure Python).
- ``backend``: the ``marconi`` radix-cache backend (SGLang's ``UnifiedRadixCache`` with Marconi
  components) and its factory for ``register_radix_cache_backend``.
- ``plugin``: the ``sglang.srt.plugins`` entry point; adds ``--prefix-cache``, registers Jamba.
- ``jamba_config``: ``JambaConfig`` (transformers' + the hybrid-cache properties SGLang reads)
  and its registration with ``AutoConfig`` and SGLang's linear-attention registry.
- ``jamba_mixer``: SGLang's Mamba-1 mixer with Jamba's learned dt/B/C RMSNorms.
- ``models``: the external-model package SGLang's ``ModelRegistry`` loads
  (``models/jamba.py``: ``JambaForCausalLM`` from SGLang's layers; forward checked on GPU only).
"""
