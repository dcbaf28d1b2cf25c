"""Models of the demo (``manage.py demo``): the record it keeps to check its own run.

None of them points at a buzz_delivery model with a foreign key: they are the demo's audit
trail, not community data, so the deletion catalog does not list them.
"""

from __future__ import annotations

import uuid

from django.db import models


class DemoRun(models.Model):
    """One run of ``manage.py demo``: its options, the ids it created and, at the end, its report."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    options = models.JSONField(default=dict)
    passed = models.BooleanField(null=True)
    report = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return f"demo run {self.started_at:%Y-%m-%d %H:%M:%S}"


class HandlerCall(models.Model):
    """One call of a demo handler inside a worker: which lease it worked under, and what it did.

    ``outcome``: ``finished`` (returned), ``retry`` (raised an ordinary exception), ``failed``
    (raised ``PermanentFailure``) or ``hang`` (the stuck worker that gets killed). Written by the
    handler before it returns, so it exists before the worker settles.
    """

    run = models.ForeignKey(DemoRun, on_delete=models.CASCADE, related_name="handler_calls")
    delivery_id = models.UUIDField()
    community_id = models.UUIDField()
    lease_generation = models.BigIntegerField()
    attempt = models.IntegerField()
    worker_pid = models.IntegerField()
    outcome = models.CharField(max_length=16)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["run", "delivery_id", "lease_generation"], name="demo_call_lease_idx")]

    def __str__(self) -> str:
        return f"{self.delivery_id} generation {self.lease_generation}: {self.outcome}"


class StatusChange(models.Model):
    """One change of a delivery's status or lease generation, written by a database trigger the
    demo installs for its run (``project.demo.audit``). Old and new values side by side, so a
    settle (generation kept), a claim and a reap (generation + 1) can be told apart;
    ``application_name`` is the session's, which names the worker (or the demo's reaper)."""

    # No database key to the run: on Citus this table is distributed by community_id (audit.py).
    run = models.ForeignKey(DemoRun, on_delete=models.CASCADE, related_name="status_changes", db_constraint=False)
    delivery_id = models.UUIDField()
    community_id = models.UUIDField()
    old_status = models.CharField(max_length=16)
    new_status = models.CharField(max_length=16)
    old_generation = models.BigIntegerField()
    new_generation = models.BigIntegerField()
    attempt = models.IntegerField()
    failure_code = models.CharField(max_length=64, blank=True, default="")
    application_name = models.CharField(max_length=64, blank=True, default="")
    # The lease's holder (claimed_by) after the change: names the worker where the session's
    # application_name is Citus's own (a trigger on a shard).
    holder = models.CharField(max_length=200, blank=True, default="")
    at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["run", "delivery_id"], name="demo_change_delivery_idx")]

    def __str__(self) -> str:
        return f"{self.delivery_id}: {self.old_status} -> {self.new_status} ({self.application_name})"


class ToolEffect(models.Model):
    """One side effect of a demo agent's tool, written by the tool itself (``kind`` ``call``)
    or by its compensation (``compensate``), keyed by the idempotency key the runtime handed
    it (``<agent run>:<seq>`` / ``<agent run>:<seq>:compensate``). The report counts them per
    key: a journaled call must have made its effect at most once, a compensation once."""

    run = models.ForeignKey(DemoRun, on_delete=models.CASCADE, related_name="tool_effects")
    key = models.CharField(max_length=120)
    kind = models.CharField(max_length=16)
    tool = models.CharField(max_length=64)
    worker_pid = models.IntegerField()
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["run", "key"], name="demo_effect_key_idx")]

    def __str__(self) -> str:
        return f"{self.kind} {self.tool} {self.key}"


class StateChange(models.Model):
    """One change of state of a workflow step, an agent run or an approval of the demo's second
    act, written by a trigger the demo installs for its run (``project.demo.audit``), whoever
    makes it (a worker, a trigger, the maintenance, the operator): the report counts each row's
    moves into a terminal state."""

    run = models.ForeignKey(DemoRun, on_delete=models.CASCADE, related_name="state_changes", db_constraint=False)
    table = models.CharField(max_length=64)
    row_id = models.UUIDField()
    community_id = models.UUIDField()
    old_state = models.CharField(max_length=20)
    new_state = models.CharField(max_length=20)
    application_name = models.CharField(max_length=64, blank=True, default="")
    at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["run", "table", "row_id"], name="demo_state_row_idx")]

    def __str__(self) -> str:
        return f"{self.table} {self.row_id}: {self.old_state} -> {self.new_state}"
