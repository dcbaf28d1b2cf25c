"""Agent runs (SPEC section 12): a fenced run state machine, a write-ahead tool-call journal
with compensation (SAGA), approvals through the workflow engine's, and idempotent intake.
Install it as ``buzz_delivery.agents`` after ``buzz_delivery.workflows`` in ``INSTALLED_APPS``.
Public API: :mod:`buzz_delivery.agents.services`; runtime: :mod:`buzz_delivery.agents.runtime`.
See ``docs/agents.md``."""
