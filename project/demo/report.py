"""The demo's report and its exactly-once check, computed from the database and the workers'
own summary lines.

How the check can tell who settled what: the demo's audit trigger records every status or
generation change of its deliveries (old and new values) with the session's
``application_name``, and every worker runs with its own (``buzz-demo-<worker>``). A claim
bumps the generation, a settle keeps it, a reap bumps it again; so each settle names one lease
(delivery, generation) and the session that claimed it. The report checks that the settler is
that claimer, that the handler's recorded outcome (:class:`HandlerCall`) matches, and, worker by
worker, that the settles the database recorded equal the settles the worker says it was told
about (its summary line).
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from django.db import connection
from django.db.models import Count

from buzz_delivery.models import TERMINAL_STATUSES, Community, WorkflowAgentDelivery
from buzz_delivery.services import ReapResult
from project.demo.models import HandlerCall, StatusChange

STATUSES = ("pending", "claimed", "finished", "failed", "expired")
TERMINAL = tuple(str(s) for s in TERMINAL_STATUSES)
# What a handler call's outcome becomes when its holder settles.
SETTLED_AS = {"finished": {"finished"}, "failed": {"failed"}, "retry": {"pending", "failed"}}


@dataclass
class ReaperTally:
    """The sum of the demo's reaper runs (:class:`~buzz_delivery.services.ReapResult`)."""

    runs: int = 0
    reclaimed: int = 0
    exhausted: int = 0
    expired: int = 0
    skipped_fenced: int = 0

    def add(self, result: ReapResult) -> None:
        self.runs += 1
        self.reclaimed += result.reclaimed
        self.exhausted += result.exhausted
        self.expired += result.expired
        self.skipped_fenced = result.skipped_fenced  # a gauge: lapsed leases left alone right now


@dataclass
class WorkerOutcome:
    """How one worker process ended: ``summary`` is its JSON line (None if killed)."""

    name: str
    application_name: str
    pid: int
    killed: bool
    returncode: int | None
    summary: dict[str, int] | None


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


@dataclass
class RunFacts:
    """Everything the report needs besides the database."""

    run_id: uuid.UUID
    community_ids: list[uuid.UUID]
    committed_by_community: dict[uuid.UUID, int]
    committed: int
    runs: int
    deduplicated: int
    fenced_id: uuid.UUID | None
    workers: list[WorkerOutcome]
    reaper: ReaperTally
    seconds: float
    producer_error: str | None = None
    notes: list[str] = field(default_factory=list)


def _latency_ms(community_ids: list[uuid.UUID], *, first_attempt_only: bool = False) -> dict[str, float | None]:
    """p50 and p99 of ``finished_at - created_at`` (database clock) over terminal deliveries,
    in milliseconds; ``first_attempt_only`` leaves out those that were retried or reclaimed."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP "
            "(ORDER BY extract(epoch FROM finished_at - created_at)) "
            "FROM buzz_delivery_delivery WHERE community_id = ANY(%s) AND finished_at IS NOT NULL"
            + (" AND attempt = 1" if first_attempt_only else ""),
            [community_ids],
        )
        row = cursor.fetchone()
    values = row[0] if row and row[0] else [None, None]
    return {
        "p50": round(float(values[0]) * 1000, 1) if values[0] is not None else None,
        "p99": round(float(values[1]) * 1000, 1) if values[1] is not None else None,
    }


CITUS_SESSION = "citus_internal"


def _session(application_name: str, holder: str, workers: list[WorkerOutcome]) -> str:
    """Who made a change: the session's ``application_name`` (each worker has its own); on a
    Citus cluster, where the audit trigger runs on a shard and sees Citus's own session name,
    the worker whose process holds the lease (``claimed_by`` is ``host:pid:name``). There a
    settle is attributed to its lease's holder, so the settler-is-the-claimer check cannot fail
    and the write fence's tests on the cluster show it instead; the per-worker counts still
    compare the database with what each worker was told."""
    if not application_name.startswith(CITUS_SESSION):
        return application_name
    parts = holder.rsplit(":", 2)
    pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
    for worker in workers:
        if worker.pid == pid:
            return worker.application_name
    return holder or application_name


def build_report(facts: RunFacts) -> dict[str, Any]:
    """Compute the report (a JSON-ready dict) and its checks; ``report["passed"]`` says whether
    every check passed."""
    ids = facts.community_ids
    communities = {c.id: c for c in Community.objects.filter(id__in=ids)}
    active = {cid for cid, c in communities.items() if c.deletion_state == "active"}
    rows = WorkflowAgentDelivery.objects.filter(community_id__in=ids)
    per_community: dict[uuid.UUID, Counter[str]] = defaultdict(Counter)
    for row in rows.values("community_id", "status").annotate(n=Count("id")):
        per_community[row["community_id"]][row["status"]] = row["n"]
    totals: Counter[str] = sum(per_community.values(), Counter())
    terminal_ids = set(rows.filter(status__in=TERMINAL).values_list("id", flat=True))

    calls: dict[tuple[uuid.UUID, int], list[str]] = defaultdict(list)
    for delivery_id, generation, outcome in HandlerCall.objects.filter(run_id=facts.run_id).values_list(
        "delivery_id", "lease_generation", "outcome"
    ):
        calls[(delivery_id, generation)].append(outcome)
    changes = [
        (*row[:5], _session(row[5], row[6], facts.workers))
        for row in StatusChange.objects.filter(run_id=facts.run_id).values_list(
            "delivery_id", "old_status", "new_status", "old_generation", "new_generation", "application_name", "holder"
        )
    ]
    claimer = {(c[0], c[4]): c[5] for c in changes if c[1] == "pending" and c[2] == "claimed"}
    # A holder's settle: out of ``claimed`` with the generation kept. A reap bumps it.
    settles = [c for c in changes if c[1] == "claimed" and c[3] == c[4]]
    reaped = {(c[0], c[3]) for c in changes if c[1] == "claimed" and c[4] == c[3] + 1}
    into_terminal: Counter[uuid.UUID] = Counter(c[0] for c in changes if c[2] in TERMINAL and c[1] not in TERMINAL)

    checks: list[Check] = []

    unsettled = sum(n for cid in active for status, n in per_community[cid].items() if status not in TERMINAL)
    checks.append(
        Check("every delivery of an active community is terminal", unsettled == 0, f"{unsettled} not terminal")
    )

    twice = [d for d, n in into_terminal.items() if n > 1]
    silent = [d for d in terminal_ids if into_terminal[d] == 0]
    checks.append(
        Check(
            "each terminal delivery became terminal exactly once",
            not twice and not silent,
            f"{len(twice)} settled more than once, {len(silent)} terminal with no recorded settle",
        )
    )

    by_worker: dict[str, Counter[str]] = defaultdict(Counter)
    foreign = mismatched = unrecorded = 0
    for delivery_id, _old, new, generation, _new_generation, settler in settles:
        if claimer.get((delivery_id, generation)) != settler:
            foreign += 1
        by_worker[settler]["retried" if new == "pending" else new] += 1
        outcomes = calls.get((delivery_id, generation), [])
        if not outcomes:
            unrecorded += 1  # the handler raised before it could record (e.g. no database connection)
        elif len(outcomes) > 1 or new not in SETTLED_AS.get(outcomes[0], set()):
            mismatched += 1
    checks.append(
        Check(
            "every settle was made by the worker holding that lease (same generation it claimed)",
            foreign == 0,
            f"{len(settles)} settles, {foreign} by another session than the lease's claimer",
        )
    )
    checks.append(
        Check(
            "every settle records what the handler did under that lease",
            mismatched == 0,
            f"{mismatched} with another outcome than the handler's; "
            f"{unrecorded} retries whose handler failed before recording",
        )
    )

    disagreements = []
    for worker in facts.workers:
        seen = by_worker.get(worker.application_name, Counter())
        if worker.killed:
            if sum(seen.values()):
                disagreements.append(f"{worker.name} was killed but {sum(seen.values())} settles name it")
            continue
        told = worker.summary or {}
        for key in ("finished", "failed", "retried"):
            if told.get(key, -1) != seen[key]:
                disagreements.append(f"{worker.name} {key}: told {told.get(key)}, database {seen[key]}")
    checks.append(
        Check(
            "each worker's own counts match the settles the database recorded for its leases",
            not disagreements,
            "; ".join(disagreements[:5]) or "all workers agree",
        )
    )

    worker_terminal = sum(
        (w.summary or {}).get("finished", 0) + (w.summary or {}).get("failed", 0) for w in facts.workers
    )
    reaper_terminal = facts.reaper.exhausted + facts.reaper.expired
    checks.append(
        Check(
            "workers' finished + failed + the reaper's terminal moves = terminal deliveries",
            worker_terminal + reaper_terminal == len(terminal_ids),
            f"{worker_terminal} + {reaper_terminal} vs {len(terminal_ids)}",
        )
    )

    killed = [w for w in facts.workers if w.killed]
    killed_names = {w.application_name for w in killed}
    settled_leases = {(c[0], c[3]) for c in settles}
    held = [lease for lease, name in claimer.items() if name in killed_names and lease not in settled_leases]
    not_reclaimed = [lease for lease in held if lease not in reaped]
    checks.append(
        Check(
            "the killed worker held leases, and the reaper reclaimed every one",
            bool(held) and not not_reclaimed,
            f"held {len(held)}, reclaimed {len(held) - len(not_reclaimed)}",
        )
    )

    bad_exits = [
        f"{w.name} exited {w.returncode}"
        for w in facts.workers
        if not w.killed and (w.returncode != 0 or w.summary is None)
    ]
    checks.append(
        Check(
            "every other worker stopped cleanly on SIGTERM (exit 0, summary printed)",
            not bad_exits,
            "; ".join(bad_exits) or f"{len(facts.workers) - len(killed)} workers",
        )
    )
    if facts.producer_error:
        checks.append(Check("the producer ran without error", False, facts.producer_error))

    lease_lost = sum((w.summary or {}).get("lease_lost", 0) for w in facts.workers)
    report: dict[str, Any] = {
        "run": str(facts.run_id),
        "seconds": round(facts.seconds, 1),
        "committed": facts.committed,
        "workflow_runs": facts.runs,
        "producer_retries_deduplicated": facts.deduplicated,
        "status": {s: totals[s] for s in STATUSES},
        "communities": [
            {
                "id": str(cid),
                "name": communities[cid].name,
                "state": communities[cid].deletion_state,
                "committed": facts.committed_by_community.get(cid, 0),
                "status": {s: per_community[cid][s] for s in STATUSES},
            }
            for cid in ids
        ],
        "reaper": vars(facts.reaper),
        "reclaimed_from_dead_holders": len(held) - len(not_reclaimed),
        "stale_settles_refused": lease_lost,
        "settles_recorded": len(settles),
        "handler_calls_unrecorded": unrecorded,
        "latency_ms": _latency_ms(ids),
        "latency_ms_first_attempt": _latency_ms(ids, first_attempt_only=True),
        "workers": [vars(w) for w in facts.workers],
        "checks": [vars(c) for c in checks],
        "passed": all(c.passed for c in checks),
        "notes": facts.notes,
    }
    report["status"]["total"] = sum(totals.values())
    return report
