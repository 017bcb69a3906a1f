"""External SGLang models (``SGLANG_EXTERNAL_MODEL_PACKAGE`` / ``ModelRegistry.register``).

SGLang's registry imports every module of this package and registers each module's
``EntryClass``, so only model modules belong here:

- ``jamba``: ``JambaForCausalLM`` (AI21 Jamba / Jamba-1.5) from SGLang's own layers.
"""
