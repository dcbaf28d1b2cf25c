"""``manage.py reap_agent_runs``: the agent runs' cron maintenance (SPEC section 12): lapsed run
leases reclaimed, ``timeout_at`` and approval deadlines; with the core's overlap guard
(``services/runlock.py``), bounded batches, summary line and exit codes (see ``reap_deliveries``)."""

from __future__ import annotations

from typing import Any

from buzz_delivery.agents.services.maintenance import reap_agent_runs
from buzz_delivery.management.commands.reap_deliveries import MaintenanceCommand


class Command(MaintenanceCommand):
    help = (
        "Reclaim lapsed agent-run leases, end runs past timeout_at and expire agent approvals past "
        "their deadline, walking communities in bounded batches. Safe from cron: a run that finds "
        "another active prints outcome=busy and exits 0. Summary: reclaimed, exhausted, timed_out, unwinding, "
        "approvals_expired, skipped_busy, batches, dry_run, duration_ms. Exit codes: 0 done or busy, "
        "1 failed, 2 bad arguments or settings, 3 lease lost mid-run."
    )
    job = "reap_agent_runs"
    supports_loop = True
    snapshot_counts = ("skipped_busy",)

    def empty_counts(self) -> dict[str, int]:
        return {
            "reclaimed": 0,
            "exhausted": 0,
            "timed_out": 0,
            "unwinding": 0,
            "approvals_expired": 0,
            "skipped_busy": 0,
        }

    def run_chunk(self, options: dict[str, Any], max_batches: int | None, dry_run: bool) -> tuple[dict[str, int], int]:
        result = reap_agent_runs(batch_size=options["batch_size"], max_batches=max_batches, dry_run=dry_run)
        counts = {key: getattr(result, key) for key in self.empty_counts()}
        return counts, result.batches
