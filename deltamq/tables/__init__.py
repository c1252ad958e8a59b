"""Warehouse, table registry, init, and typed read/write helpers."""

from deltamq.tables.warehouse import Warehouse

__all__ = ["Warehouse"]
