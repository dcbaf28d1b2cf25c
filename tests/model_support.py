"""What the model-based tests share: how a state machine runs against the real database."""

from __future__ import annotations

from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test


def run_machine(machine: type[RuleBasedStateMachine], examples: int, steps: int) -> None:
    """Run ``machine`` for ``examples`` examples of up to ``steps`` steps: no deadline (real
    PostgreSQL round trips), no example database (every run starts fresh), the failing blob
    printed, and the function-scoped fixtures the machines use allowed."""
    run_state_machine_as_test(
        machine,
        settings=hsettings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )
