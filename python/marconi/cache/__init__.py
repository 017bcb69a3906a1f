"""Prefix cache core: radix tree, pools, cost model, admission/eviction policies, tuning."""
