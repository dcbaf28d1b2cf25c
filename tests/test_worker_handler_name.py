"""The worker's ``started`` line names its handler, a callable object too (run_task_worker's)."""

from __future__ import annotations

from buzz_delivery.tasks.runner import TaskRunner
from buzz_delivery.worker.runtime import _handler_name


def handle(delivery: object) -> None:
    return None


def test_a_function_is_named_by_its_module_and_qualname():
    assert _handler_name(handle) == f"{__name__}:handle"


def test_a_callable_object_is_named_by_its_class_not_its_repr():
    name = _handler_name(TaskRunner(backend=None))  # type: ignore[arg-type]

    assert name == "buzz_delivery.tasks.runner:TaskRunner instance"
    assert " at 0x" not in name
