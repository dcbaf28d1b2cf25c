"""One member of a chaos fleet, run as a process on a real PostgreSQL (``DATABASE_URL``)::

    python -m tests.chaos.member worker --log W.jsonl --stop STOP --addresses A.json --seed 7 --lease 1
    python -m tests.chaos.member reaper --log R.jsonl --stop STOP
    python -m tests.chaos.member seed --deliveries 400 --addresses A.json

The ``?application_name=`` query of ``DATABASE_URL`` names the process to ``pg_stat_activity``
so a driver can terminate its backend. A worker loops claim / (renew) / settle through
:mod:`buzz_delivery.services` with short leases and appends every claim, renew and settle
attempt to its JSONL log, flushed and fsynced before and after each settle call, so a SIGKILL
leaves at most one settle in doubt. The reaper loops ``services.reap``. ``seed`` commits the
deliveries of the database-fault run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from tests.chaos.audit import TERMINAL, WORKER_MESSAGE


class JsonlLog:
    """Append-only JSON lines, each flushed and fsynced before the call returns."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed at process exit

    def write(self, **record: Any) -> None:
        record.setdefault("t", time.time())
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())


def _setup_django(lease: float) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.test import override_settings

    override_settings(
        BUZZ_DELIVERY={
            **settings.BUZZ_DELIVERY,
            "LEASE_SECONDS": lease,
            "RETRY_BACKOFF_BASE_SECONDS": 0.1,
            "RETRY_BACKOFF_CAP_SECONDS": 0.4,
        }
    ).enable()


def _drop_connection() -> None:
    """After a database error: drop the (possibly dead) connection; the next query reconnects."""
    from django.db import Error, connection

    try:
        connection.close()
    except Error:  # closing a dead socket may fail; dropping it is what matters
        connection.connection = None


class Worker:
    """One agent: claim, work (sleep), maybe renew, settle; everything logged."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.log = JsonlLog(args.log)
        self.stop = Path(args.stop)
        self.rng = random.Random(args.seed)
        self.lease_seconds = args.lease
        self.addresses = [(c, bytes.fromhex(t)) for c, t in json.loads(Path(args.addresses).read_text())]
        self.seq = 0

    def run(self) -> None:
        from django.db import Error as DatabaseError

        from buzz_delivery import services

        self.log.write(kind="start", pid=os.getpid())
        while not self.stop.exists():
            community, target = self.rng.choice(self.addresses)
            try:
                if self.rng.random() < 0.2:
                    claims = services.claim_deliveries(community, target, limit=3, lease_seconds=self.lease_seconds)
                else:
                    claim = services.claim_delivery(community, target, lease_seconds=self.lease_seconds)
                    claims = [claim] if claim else []
            except DatabaseError as exc:
                self.log.write(kind="claim_error", error=type(exc).__name__)
                _drop_connection()
                time.sleep(0.05)
                continue
            if not claims:
                time.sleep(0.02)
                continue
            for claim in claims:
                lease = claim.lease
                self.log.write(
                    kind="claim",
                    id=str(lease.delivery_id),
                    gen=lease.lease_generation,
                    lease_until=lease.lease_until.timestamp(),
                )
            for claim in claims:
                self.handle(claim.lease)
        self.log.write(kind="stop")

    def handle(self, lease: Any) -> None:
        plan = self.rng.random()
        if plan < 0.02:  # outlive the lease without renewing: the settle must be refused
            time.sleep(self.lease_seconds * 1.3)
        elif plan < 0.06:  # work longer than the lease, renewed half way
            time.sleep(self.lease_seconds * 0.6)
            lease = self.renew(lease)
            time.sleep(self.lease_seconds * 0.6)
        else:
            time.sleep(self.rng.uniform(0.01, 0.06))
        roll = self.rng.random()
        outcome = "finished" if roll < 0.8 else "failed" if roll < 0.9 else "retry"
        result = self.settle(lease, outcome)
        if result is not None and result[0] == "Settled" and result[1] in TERMINAL and self.rng.random() < 0.05:
            self.settle(lease, outcome, kind="resettle")  # an idempotent retry by the same holder

    def renew(self, lease: Any) -> Any:
        from django.db import Error as DatabaseError

        from buzz_delivery import services

        started = time.time()
        try:
            outcome = services.renew_delivery(lease, self.lease_seconds)
        except DatabaseError as exc:
            self.log.write(
                kind="renew",
                id=str(lease.delivery_id),
                gen=lease.lease_generation,
                result="error",
                error=type(exc).__name__,
            )
            _drop_connection()
            return lease
        self.log.write(
            kind="renew",
            id=str(lease.delivery_id),
            gen=lease.lease_generation,
            result=type(outcome).__name__,
            t_before=started,
            lease_until=lease.lease_until.timestamp(),
        )
        return outcome.lease if isinstance(outcome, services.Renewed) else lease

    def settle(self, lease: Any, outcome: str, kind: str = "settle") -> tuple[str, str | None] | None:
        """Log the intent, call finish_delivery (again after a connection error, same lease), log the result."""
        from django.db import Error as DatabaseError

        from buzz_delivery import services

        self.seq += 1
        record = {
            "id": str(lease.delivery_id),
            "gen": lease.lease_generation,
            "outcome": outcome,
            "seq": self.seq,
            "lease_until": lease.lease_until.timestamp(),
            "pid": os.getpid(),
        }
        kwargs: dict[str, Any] = {}
        if outcome == "failed":
            kwargs = {"failure_code": "chaos_failed", "failure_message": f"{WORKER_MESSAGE} handler failed"}
        elif outcome == "retry":
            kwargs = {"failure_message": f"{WORKER_MESSAGE} retry"}
        started = time.time()
        self.log.write(kind=f"{kind}_intent", t_before=started, **record)
        errors = 0
        while True:
            try:
                result = services.finish_delivery(lease, outcome, **kwargs)
                break
            except DatabaseError as exc:
                # The connection died (backend terminated, server restarted): the settle may or may
                # not have committed. Call again with the same lease until the database answers.
                errors += 1
                self.log.write(kind="settle_error", error=type(exc).__name__, **record)
                _drop_connection()
                if time.time() - started > 120:
                    return None
                time.sleep(0.1)
        status = getattr(result, "status", None)
        self.log.write(
            kind=kind, t_before=started, result=type(result).__name__, status=status, errors=errors, **record
        )
        return type(result).__name__, status


def reaper_main(args: argparse.Namespace) -> None:
    """Loop ``services.reap`` until the stop file appears, surviving lost connections."""
    from django.db import Error as DatabaseError

    from buzz_delivery import services

    log = JsonlLog(args.log)
    stop = Path(args.stop)
    log.write(kind="start", pid=os.getpid())
    while not stop.exists():
        try:
            result = services.reap(batch_size=50)
            if result.total:
                log.write(kind="reap", reclaimed=result.reclaimed, exhausted=result.exhausted, expired=result.expired)
        except DatabaseError as exc:
            log.write(kind="reap_error", error=type(exc).__name__)
            _drop_connection()
        time.sleep(0.1)
    log.write(kind="stop")


def seed_main(args: argparse.Namespace) -> None:
    """Create one community, two targets and ``--deliveries`` deliveries; write the addresses file."""
    from buzz_delivery import services
    from buzz_delivery.testing import BindingFactory, CommunityFactory, EventFactory, WorkflowRunFactory, random32

    community = CommunityFactory(name="db-faults")
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    targets = [random32(), random32()]
    bindings = [
        BindingFactory(run=run, message_event=event, step_id=f"step-{i}", target_pubkey=targets[i % 2])
        for i in range(args.deliveries)
    ]
    for start in range(0, len(bindings), 1000):
        services.commit_deliveries(community.id, event, bindings[start : start + 1000])
    Path(args.addresses).write_text(json.dumps([(str(community.id), t.hex()) for t in targets]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", choices=["worker", "reaper", "seed"])
    parser.add_argument("--deliveries", type=int, default=100, help="seed: how many deliveries to commit")
    parser.add_argument("--log", help="worker, reaper: the JSONL log to append to")
    parser.add_argument("--stop", help="worker, reaper: exit once this file exists")
    parser.add_argument("--addresses", help="JSON file: [[community_id, target_hex], ...] (seed writes it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lease", type=float, default=1.0, help="lease length, seconds")
    args = parser.parse_args(argv)
    _setup_django(args.lease)
    if args.role == "worker":
        Worker(args).run()
    elif args.role == "seed":
        seed_main(args)
    else:
        reaper_main(args)


if __name__ == "__main__":
    main()
