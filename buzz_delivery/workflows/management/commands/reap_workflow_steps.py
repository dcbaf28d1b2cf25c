"""``manage.py reap_workflow_steps``: the engine's cron maintenance (SPEC section 11): lapsed
step leases reclaimed, step and wait timeouts, approval deadlines; with the core's overlap
guard, bounded batches, summary line and exit codes (see ``reap_deliveries``)."""

from __future__ import annotations

from typing import Any

from buzz_delivery.management.commands.reap_deliveries import MaintenanceCommand
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps


class Command(MaintenanceCommand):
    help = (
        "Start the runs of due schedules, reclaim lapsed workflow step leases and end overrun steps, "
        "waits, approvals and runs, expire the pending deliveries of ended runs, walking communities "
        "in bounded batches. Safe from cron: a run that finds another active prints outcome=busy and "
        "exits 0. Summary: reclaimed, exhausted, timed_out, wait_timed_out, approvals_expired, "
        "runs_timed_out, runs_scheduled, slots_missed, deliveries_expired, skipped_busy, batches, "
        "dry_run, duration_ms. Exit codes: 0 done or busy, 1 failed, 2 bad arguments or settings, "
        "3 lease lost mid-run."
    )
    job = "reap_workflow_steps"
    supports_loop = True
    snapshot_counts = ("skipped_busy",)

    def empty_counts(self) -> dict[str, int]:
        return {
            "reclaimed": 0,
            "exhausted": 0,
            "timed_out": 0,
            "wait_timed_out": 0,
            "approvals_expired": 0,
            "runs_timed_out": 0,
            "runs_scheduled": 0,
            "slots_missed": 0,
            "deliveries_expired": 0,
            "skipped_busy": 0,
        }

    def run_chunk(self, options: dict[str, Any], max_batches: int | None, dry_run: bool) -> tuple[dict[str, int], int]:
        result = reap_workflow_steps(batch_size=options["batch_size"], max_batches=max_batches, dry_run=dry_run)
        counts = {key: getattr(result, key) for key in self.empty_counts()}
        return counts, result.batches
