"""Handlers for ``run_delivery_worker`` in the benchmarks."""

from __future__ import annotations

from typing import Any


def noop(delivery: Any) -> None:
    """Do nothing: the delivery settles ``finished`` (measures the runtime, not the handler)."""
    return None
