"""The result of a task enqueued through :class:`buzz_delivery.tasks.DeliveryBackend`.

A task is a delivery (its lease, settle, reaper, tenant scope and admin are the inbox's); this
row holds what Django's ``TaskResult`` needs that a delivery does not: the task's path, its
arguments, priority and queue, and once it ran, its return value or its errors. It is
community-scoped: PRIMARY KEY (community_id, id) in the database (migration 0001), a composite
foreign key to its delivery (community_id, delivery_id) that cascades when the delivery is
pruned or purged, the core write fence, row-level security, the deletion catalog.

The task's status is the delivery's (pending = READY, claimed = RUNNING, finished = SUCCESSFUL,
failed or expired = FAILED), read with it in one statement; nothing here repeats it, nor the
times and holders of its attempts (the delivery's history of claims).
Rows change only through :mod:`buzz_delivery.tasks.services`.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Length, Now
from django.db.models.lookups import LessThanOrEqual

from buzz_delivery import triggers
from buzz_delivery.models import CommunityScoped, new_uuid7

TASK_PATH_MAX_CHARS = 1000
NAME_MAX_CHARS = 200


class TaskResult(CommunityScoped):
    """One enqueued task: ``id`` is Django's result id (and its delivery's ``step_id``)."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    # The delivery carrying the task: (community_id, delivery_id) references it in the database.
    delivery_id = models.UUIDField()
    backend = models.CharField(max_length=NAME_MAX_CHARS)
    queue_name = models.CharField(max_length=NAME_MAX_CHARS)
    # ``module.qualname`` of the task function: looked up among the tasks this process
    # registered, never imported (buzz_delivery.tasks.registry).
    task_path = models.TextField()
    priority = models.SmallIntegerField(default=0)
    takes_context = models.BooleanField(default=False)
    args = models.JSONField(default=list)
    kwargs = models.JSONField(default=dict)
    run_after = models.DateTimeField(null=True, blank=True)
    enqueued_at = models.DateTimeField(db_default=Now(), editable=False)
    # Written by the current lease holder only (a statement fenced by the delivery's lease,
    # buzz_delivery.tasks.services.record_task_outcome), just before it settles the delivery.
    # When the task started, its attempts and its workers are the delivery's own (its history
    # of claims), not repeated here.
    return_value = models.JSONField(null=True, blank=True)
    # [{"exception_class_path", "traceback", "failure_code", "lease_generation", "requeues"}]: the
    # last three (how the delivery failed, which lease recorded it, in which requeue epoch of the
    # delivery) tell the next holder of a delivery whose settle never committed how to settle it
    # without running the task again, and that an operator's requeue since asks for another run
    # (read_task_of_delivery).
    errors = models.JSONField(default=list)

    class Meta:
        db_table = "buzz_tasks_result"
        constraints = [
            models.UniqueConstraint(fields=["community", "delivery_id"], name="task_result_one_per_delivery"),
            models.CheckConstraint(
                condition=Q(priority__gte=-100) & Q(priority__lte=100), name="task_result_priority_in_range"
            ),
            models.CheckConstraint(
                condition=LessThanOrEqual(Length("task_path"), TASK_PATH_MAX_CHARS), name="task_result_path_length"
            ),
        ]
        indexes = [models.Index(fields=["id"], name="task_result_id_idx")]  # get_result by id alone
        triggers = [*triggers.write_fence()]

    def __str__(self) -> str:
        return f"{self.task_path} {self.id}"
