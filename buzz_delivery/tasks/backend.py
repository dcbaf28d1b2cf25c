"""``DeliveryBackend``: Django's Tasks framework on the delivery inbox.

Settings::

    TASKS = {
        "default": {
            "BACKEND": "buzz_delivery.tasks.DeliveryBackend",
            "QUEUES": ["default", "emails"],          # Django's own; [] = any name
            "OPTIONS": {
                "COMMUNITY": "0190c6f1-...",          # required: the tenant the tasks belong to
                "TARGETS": {"emails": "ab12...64 hex"},  # optional: a queue's target key
                "MODULES": ["myapp.jobs"],            # optional: more modules defining tasks
            },
        }
    }

``enqueue`` commits a delivery and its result row (:mod:`buzz_delivery.tasks.services`);
``manage.py run_task_worker`` runs them. Priority is validated (-100..100) and stored with the
task, and it orders the claims: the task's delivery gets a tenth of it (-10..10, rounded, halves
away from zero: :func:`buzz_delivery.tasks.services.delivery_priority`), and claims take higher
delivery priorities first, oldest first within one (docs/flow-control.md).
"""

from __future__ import annotations

import datetime
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured, ValidationError

from buzz_delivery.exceptions import CommunityNotFound
from buzz_delivery.tasks import compat, registry


@dataclass(frozen=True, slots=True, kw_only=True)
class SafeTaskError(compat.TaskError):  # type: ignore[misc,valid-type]
    """A ``TaskError`` whose ``exception_class`` never imports the stored path: it is found
    only among modules this process has already imported (builtins included), else ``ValueError``."""

    @property
    def exception_class(self) -> type[BaseException]:
        module_name, _, name = self.exception_class_path.rpartition(".")
        module = sys.modules.get(module_name or "builtins")
        found = getattr(module, name, None) if module is not None else None
        if not isinstance(found, type) or not issubclass(found, BaseException):
            raise ValueError(f"{self.exception_class_path!r} does not name an exception class this process knows")
        return found


STATUS_OF_DELIVERY = {
    "pending": compat.TaskResultStatus.READY,
    "claimed": compat.TaskResultStatus.RUNNING,
    "finished": compat.TaskResultStatus.SUCCESSFUL,
    "failed": compat.TaskResultStatus.FAILED,
    "expired": compat.TaskResultStatus.FAILED,
}


class TaskNotRegistered(LookupError):
    """The stored task path names no task this process registered (it is never imported)."""


class DeliveryBackend(compat.BaseTaskBackend):  # type: ignore[misc,valid-type]
    """A ``django.tasks`` backend whose tasks are deliveries of the inbox (see the module doc)."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True  # validated, stored, and the claims' order (the delivery's priority)

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self._community: uuid.UUID | None = None
        self._targets: dict[str, bytes] | None = None

    # --- configuration -------------------------------------------------------------------

    @property
    def community_id(self) -> uuid.UUID:
        """``OPTIONS["COMMUNITY"]`` as a UUID (``ImproperlyConfigured`` if missing or bad)."""
        if self._community is None:
            raw = self.options.get("COMMUNITY")
            try:
                self._community = uuid.UUID(str(raw))
            except ValueError as exc:
                raise ImproperlyConfigured(
                    f"TASKS[{self.alias!r}]['OPTIONS']['COMMUNITY'] must be a community UUID, got {raw!r}"
                ) from exc
        return self._community

    def no_such_community(self) -> str:
        """What an enqueue, the worker's start and the database check say of a ``COMMUNITY``
        that names no community."""
        return (
            f"TASKS[{self.alias!r}]['OPTIONS']['COMMUNITY'] names no community: {self.community_id} does not "
            "exist; create it, or set the id of one that does (docs/tasks.md)"
        )

    def target_for(self, queue_name: str) -> bytes:
        """The 32-byte target key of ``queue_name``: ``OPTIONS["TARGETS"][queue]`` (64 hex
        characters) or a key derived from the queue's name."""
        from buzz_delivery.tasks.services import queue_target

        if self._targets is None:
            targets = {}
            for queue, key in (self.options.get("TARGETS") or {}).items():
                try:
                    value = bytes.fromhex(key)
                except (TypeError, ValueError):
                    value = b""
                if len(value) != 32:
                    raise ImproperlyConfigured(
                        f"TASKS[{self.alias!r}]['OPTIONS']['TARGETS'][{queue!r}] must be 64 hex characters"
                    )
                targets[queue] = value
            self._targets = targets
        return self._targets.get(queue_name) or queue_target(queue_name)

    def worker_queues(self) -> list[str]:
        """The queues a worker serves when none is named: ``QUEUES``, else ``["default"]``."""
        return sorted(self.queues) or [compat.DEFAULT_TASK_QUEUE_NAME]

    def _may_enqueue_to(self, queue: str) -> bool:
        return not self.queues or queue in self.queues

    def shared_targets(self) -> list[str]:
        """Each queue of this backend whose target (community, key) another ``DeliveryBackend``
        of ``TASKS`` also enqueues to. A worker claims by target alone and fails a task of
        another backend (``NotATask``): two such backends would fail each other's tasks."""
        found = []
        for other in _delivery_backends():
            if other is self or other.community_id != self.community_id:
                continue
            names = {compat.DEFAULT_TASK_QUEUE_NAME, *self.queues, *other.queues}
            names |= set(self.options.get("TARGETS") or ()) | set(other.options.get("TARGETS") or ())
            for mine in sorted(n for n in names if self._may_enqueue_to(n)):
                theirs = [n for n in sorted(names) if other._may_enqueue_to(n)]
                clash = [n for n in theirs if other.target_for(n) == self.target_for(mine)]
                if clash:
                    found.append(
                        f"TASKS[{self.alias!r}] queue {mine!r} has the target of TASKS[{other.alias!r}] queue "
                        f"{clash[0]!r} in the same community: a worker of either would fail the other's "
                        f"tasks; give one of them its own key in OPTIONS['TARGETS']"
                    )
        return found

    def configuration_errors(self) -> list[checks.CheckMessage]:
        """``buzz_delivery.E101`` (``OPTIONS`` unusable) and ``E102`` (:meth:`shared_targets`).
        Reported by this app's own system check (:mod:`buzz_delivery.tasks.checks`), not by
        :meth:`check`: the framework's check of the backends runs only where ``django.tasks``
        (or, on Django 5.2, the ``django_tasks`` app, which this app does not need) is loaded."""
        try:
            _ = self.community_id
            for queue in self.worker_queues():
                self.target_for(queue)
        except ImproperlyConfigured as exc:
            return [checks.Error(str(exc), id="buzz_delivery.E101")]
        return [checks.Error(text, id="buzz_delivery.E102") for text in self.shared_targets()]

    # --- enqueue -------------------------------------------------------------------------

    def validate_task(self, task: Any) -> None:
        """Django's checks, then the task joins this process's registry: the only tasks a
        worker will run (:mod:`buzz_delivery.tasks.registry`)."""
        if task.run_after is not None and not isinstance(task.run_after, datetime.datetime):
            # Django's own check calls timezone.is_aware() on it: an AttributeError for a string.
            raise compat.InvalidTask(f"run_after must be an aware datetime, not {type(task.run_after).__name__}")
        super().validate_task(task)
        registry.register(task)

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        from buzz_delivery.tasks import services

        self.validate_task(task)
        json_args = _normalized(args, "args", list)
        json_kwargs = _normalized(kwargs, "kwargs", dict)
        try:
            done = services.enqueue_task(
                self.community_id,
                backend=self.alias,
                queue_name=task.queue_name,
                target_pubkey=self.target_for(task.queue_name),
                task_path=task.module_path,
                priority=task.priority,
                takes_context=task.takes_context,
                args=json_args,
                kwargs=json_kwargs,
                run_after=task.run_after,
                trace_context=_trace_context(),
            )
        except ValidationError as exc:
            raise compat.InvalidTask(f"cannot enqueue {task.module_path}: {exc}") from exc
        except CommunityNotFound as exc:  # nothing was written
            raise ImproperlyConfigured(self.no_such_community()) from exc
        result = self._result(
            task,
            id=done.result_id,
            status=compat.TaskResultStatus.READY,
            enqueued_at=done.enqueued_at,
            args=list(args),
            kwargs=dict(kwargs),
        )
        compat.task_enqueued.send(type(self), task_result=result)
        return result

    async def aenqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        return await sync_to_async(self.enqueue, thread_sensitive=True)(task, args, kwargs)

    # --- results -------------------------------------------------------------------------

    def get_result(self, result_id: Any) -> Any:
        from buzz_delivery.tasks import services

        stored = services.read_task(self.community_id, result_id)
        if stored is None or stored.backend != self.alias:
            raise compat.TaskResultDoesNotExist(result_id)
        return self.result_of(stored)

    async def aget_result(self, result_id: Any) -> Any:
        return await sync_to_async(self.get_result, thread_sensitive=True)(result_id)

    def task_of(self, stored: Any) -> Any:
        """The ``Task`` of a stored row: the registered one with the row's options. Raises
        :class:`TaskNotRegistered` when no task of that path was registered in this process."""
        task = registry.registered(stored.task_path)
        if task is None:
            registry.discover(self.options.get("MODULES") or ())
            task = registry.registered(stored.task_path)
        if task is None:
            raise TaskNotRegistered(stored.task_path)
        return task.using(
            priority=stored.priority, queue_name=stored.queue_name, run_after=stored.run_after, backend=self.alias
        )

    def result_of(self, stored: Any, *, status: Any = None, return_value: Any = None, errors: Any = None) -> Any:
        """Django's ``TaskResult`` of a stored row (``status``... override what was read)."""
        claims = stored.claims
        result = self._result(
            self.task_of(stored),
            id=stored.id,
            status=status or STATUS_OF_DELIVERY[stored.status],
            enqueued_at=stored.enqueued_at,
            started_at=claims[0][0] if claims else None,
            last_attempted_at=claims[-1][0] if claims else None,
            finished_at=stored.finished_at,
            args=stored.args,
            kwargs=stored.kwargs,
            errors=[
                # The stored error also keeps how the delivery failed and the lease generation
                # that recorded it (the runner's, see services.read_task_of_delivery): not Django's.
                SafeTaskError(exception_class_path=e["exception_class_path"], traceback=e["traceback"])
                for e in (stored.errors if errors is None else errors)
            ],
            worker_ids=[holder for _at, holder in claims],
        )
        value = stored.return_value if return_value is None else return_value
        object.__setattr__(result, "_return_value", value)
        return result

    def _result(self, task: Any, **fields: Any) -> Any:
        defaults: dict[str, Any] = {
            "started_at": None,
            "finished_at": None,
            "last_attempted_at": None,
            "errors": [],
            "worker_ids": [],
            "backend": self.alias,
        }
        defaults.update(fields)
        defaults["id"] = str(defaults["id"])
        return compat.TaskResult(task=task, **defaults)


def _delivery_backends() -> list[DeliveryBackend]:
    """Every ``DeliveryBackend`` of ``TASKS`` whose own ``OPTIONS`` are usable (a backend that
    cannot be built, or whose community or targets are bad, has its own error elsewhere)."""
    found = []
    for alias in getattr(settings, "TASKS", None) or {}:
        try:
            backend = compat.task_backends[alias]
            if isinstance(backend, DeliveryBackend):
                _ = backend.community_id
                for queue in [*backend.queues, *(backend.options.get("TARGETS") or ())]:
                    backend.target_for(queue)
                found.append(backend)
        except Exception:  # reported by that backend's own check
            continue
    return found


def _normalized(value: Any, name: str, kind: type) -> Any:
    """``value`` in the JSON form Django's results hold, or ``InvalidTask`` naming ``name``
    (``args`` a list or tuple, ``kwargs`` a dict: a string is not a list of its characters)."""
    if not isinstance(value, list | tuple if kind is list else dict):
        raise compat.InvalidTask(f"{name}: must be a {'list' if kind is list else 'dict'}, not {type(value).__name__}")
    try:
        return compat.normalize_json(kind(value))
    except (TypeError, ValueError, RecursionError) as exc:
        raise compat.InvalidTask(f"{name}: must be JSON-serialisable: {exc}") from None


def _trace_context() -> dict[str, str] | None:
    """The current trace context to store with the task (None without tracing)."""
    from buzz_delivery import tracing

    return tracing.inject()
