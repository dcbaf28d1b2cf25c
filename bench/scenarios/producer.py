"""Figure 4: the producer rate of ``services.commit_deliveries`` (one commit per workflow step,
1 or 50 targets per step) in one process, next to one raw ``INSERT ... SELECT unnest ... ON
CONFLICT DO NOTHING`` with one ``pg_notify`` per created row.

Each timed step builds its bindings (validated on construction) and commits them; every step
is a new ``step_id`` on the same run and message event.
"""

from __future__ import annotations

import itertools
import time
import uuid

from bench import baseline, data
from bench.context import Bench
from bench.report import Figure

_steps = itertools.count()


def _ours(bench: Bench, tenant: data.Tenant, targets: list[bytes]) -> float:
    from buzz_delivery import models, services

    event = models.Event.objects.get(pk=tenant.event_pk)
    data.clear_deliveries(bench.conn)
    created = 0
    started = time.perf_counter()
    deadline = started + bench.duration
    while time.perf_counter() < deadline:
        step = f"p{next(_steps)}"
        bindings = [
            services.Binding(
                community_id=tenant.community_id,
                workflow_id=tenant.workflow_id,
                run_id=tenant.run_id,
                step_id=step,
                target_pubkey=target,
                definition_event_id=data.DEFINITION_EVENT_ID,
                message_event_id=tenant.event_id,
                cause=services.Cause.webhook(uuid.uuid4()),
            )
            for target in targets
        ]
        created += len(services.commit_deliveries(tenant.community_id, event, bindings))
    return created / (time.perf_counter() - started)


def _raw(bench: Bench, conn: object, tenant: data.Tenant, targets: list[bytes]) -> float:
    data.clear_deliveries(bench.conn)
    created = 0
    started = time.perf_counter()
    deadline = started + bench.duration
    while time.perf_counter() < deadline:
        step = f"p{next(_steps)}"
        params = {
            "community_id": tenant.community_id,
            "workflow_id": tenant.workflow_id,
            "run_id": tenant.run_id,
            "definition_event_id": data.DEFINITION_EVENT_ID,
            "message_event_id": tenant.event_id,
            "ids": [uuid.uuid4() for _ in targets],
            "step_ids": [step] * len(targets),
            "targets": targets,
            "invocations": [uuid.uuid4() for _ in targets],
        }
        created += len(conn.execute(baseline.INSERT, params).fetchall())  # type: ignore[attr-defined]
    return created / (time.perf_counter() - started)


def run(bench: Bench) -> None:
    data.reset(bench.conn)
    (tenant,) = data.create_tenants(1)
    raw_conn = baseline.RawClient(bench.url, tenant.community_id, data.target(0)).conn
    for n in (1, 50):
        targets = [data.target(k) for k in range(n)]
        ours: list[float] = []
        raw: list[float] = []
        for repeat in range(bench.repeats):
            if repeat % 2 == 0:
                ours.append(_ours(bench, tenant, targets))
                raw.append(_raw(bench, raw_conn, tenant, targets))
            else:
                raw.append(_raw(bench, raw_conn, tenant, targets))
                ours.append(_ours(bench, tenant, targets))
        label = "1 target per step" if n == 1 else f"{n} targets per step"
        bench.report.add(
            Figure(
                f"4. commit_deliveries producer, {label}",
                "1 proc",
                "deliveries/s",
                ours,
                raw,
                note=f"commits/s = deliveries/s / {n}" if n > 1 else "one commit per delivery",
            )
        )
    raw_conn.close()
