"""Trace-driven cache simulator: traces, replay and policy sweeps."""
