"""Rollout engines, one package each: an engine's client adapters, its in-engine receiver and its guards."""
