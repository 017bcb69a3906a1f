"""Integrations of Marconi's cache policies into other serving engines (SGLang)."""
