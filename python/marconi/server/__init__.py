"""OpenAI-compatible HTTP server over the engine: ``protocol`` (request models, errors),
``api`` (routes), ``metrics`` (Prometheus). Started by ``python -m marconi.launch_server``."""
