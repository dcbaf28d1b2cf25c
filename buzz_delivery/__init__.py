"""buzz_delivery: a durable, tenant-scoped inbox of workflow deliveries for agents.

The public API lives in :mod:`buzz_delivery.services` (SPEC section 9).
"""

__version__ = "0.1.0"
