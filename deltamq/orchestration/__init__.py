"""Tick runner, leases, CLI helpers and metrics."""
