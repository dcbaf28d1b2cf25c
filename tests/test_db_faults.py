"""Database faults: a server restart under a running fleet, statement timeouts inside the services,
and a long-running transaction holding an old snapshot (SPEC sections 4 and 6).

The restart test never touches the shared server: it starts a private PostgreSQL of its own
(:class:`tests.chaos.PrivatePostgres`) on another port and restarts that one.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from django.db import OperationalError, connection

from buzz_delivery import services
from buzz_delivery.testing import BindingFactory, CommunityFactory, EventFactory, WorkflowRunFactory, random32
from tests.chaos import (
    REPO,
    Fleet,
    PrivatePostgres,
    audit,
    fetch_rows,
    private_workdir,
    read_log,
    subprocess_env,
)

# --- a restart under a running worker fleet and reaper --------------------------------------


def _open_count(pg: PrivatePostgres, name: str) -> int | None:
    try:
        with pg.connect(name) as conn:
            return conn.execute(
                "SELECT count(*) FROM buzz_delivery_delivery WHERE status NOT IN ('finished', 'failed', 'expired')"
            ).fetchone()[0]
    except psycopg.OperationalError:
        return None  # the server is restarting


def test_workers_and_reaper_survive_server_restarts_and_lose_nothing():
    with private_workdir("buzz-db-faults-") as workdir:
        _restart_under_a_running_fleet(workdir)


def _restart_under_a_running_fleet(workdir: Path) -> None:
    pg = PrivatePostgres()
    fleet = None
    try:
        pg.start()
        settings_dict = pg.create_database("buzz_faults")
        setup_env = subprocess_env(settings_dict, "setup")
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=REPO,
            env=setup_env,
            check=True,
            timeout=300,
        )
        addresses_file = workdir / "seeded.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.chaos.member",
                "seed",
                "--deliveries",
                "400",
                "--addresses",
                str(addresses_file),
            ],
            cwd=REPO,
            env=setup_env,
            check=True,
            timeout=300,
        )
        addresses = [tuple(a) for a in json.loads(addresses_file.read_text())]
        fleet = Fleet(workdir, settings_dict, addresses, seed=11, workers=3, prefix="faults")
        fleet.start()
        time.sleep(3.0)
        restarts = []
        for mode in ("fast", "immediate", "fast"):
            assert _open_count(pg, "buzz_faults"), "the fleet finished before the restarts; commit more deliveries"
            started = time.time()
            pg.restart(mode)
            restarts.append((mode, started, time.time()))
            time.sleep(2.0)
        deadline = time.monotonic() + 120
        while _open_count(pg, "buzz_faults") != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        alive = {m.app: m.process.poll() for m in fleet.members.values()}
        fleet.stop()
        with pg.connect("buzz_faults") as conn:
            rows = fetch_rows(conn.cursor())
    finally:
        if fleet is not None:
            fleet.kill_all()
        pg.stop()

    # The same processes carried on: none died, each logged a database error and kept working after it.
    assert all(code is None for code in alive.values()), alive
    last_restart = restarts[-1][2]
    errors = 0
    for log in fleet.worker_logs():
        records = read_log(log)
        errors += sum(1 for r in records if r["kind"].endswith("_error"))
        assert any(r["t"] > last_restart and r["kind"] in ("claim", "settle", "stop") for r in records), log.name
    reaper_log = read_log(fleet.members[("reaper", 0)].log)
    assert any(r["kind"] == "reap_error" for r in reaper_log)
    assert reaper_log[-1]["kind"] == "stop"

    report = audit(fleet.worker_logs(), fleet.killed_logs, [], rows, active_communities={addresses[0][0]})
    print(
        f"\nserver restarts {[(m, round(b - a, 2)) for m, a, b in restarts]}; worker database errors {errors}\n"
        f"  {report.summary()}"
    )
    assert errors > 0
    assert report.violations == []
    assert len(rows) == 400
    assert report.terminal_rows_by_status() == report.accounted_by_status()
    assert sum(report.terminal_rows_by_status().values()) == 400


# --- statement timeouts -------------------------------------------------------------------


def _other_connection() -> psycopg.Connection:
    s = connection.settings_dict
    return psycopg.connect(
        host=s["HOST"] or "127.0.0.1",
        port=s["PORT"] or 5432,
        user=s["USER"] or "postgres",
        password=s["PASSWORD"] or None,
        dbname=s["NAME"],
        autocommit=False,
    )


def _rows() -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM buzz_delivery_delivery ORDER BY id")
        return cursor.fetchall()


@pytest.fixture
def committed_deliveries():
    """Three committed deliveries for one target, and one of them claimed (a current lease)."""
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    target = random32()
    services.commit_deliveries(
        community.id, event, [BindingFactory(run=run, message_event=event, target_pubkey=target) for _ in range(3)]
    )
    claim = services.claim_delivery(community.id, target, lease_seconds=60)
    return community, target, claim.lease


OPERATIONS = {
    "claim": lambda c, t, lease: services.claim_delivery(c.id, t, lease_seconds=60),
    "claim batch": lambda c, t, lease: services.claim_deliveries(c.id, t, limit=2, lease_seconds=60),
    "renew": lambda c, t, lease: services.renew_delivery(lease, 60),
    "finish": lambda c, t, lease: services.finish_delivery(lease, "finished"),
    "retry": lambda c, t, lease: services.finish_delivery(lease, "retry"),
    "reap": lambda c, t, lease: services.reap(),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("operation", OPERATIONS)
def test_a_statement_timeout_raises_clearly_and_leaves_nothing_half_done(committed_deliveries, operation):
    community, target, lease = committed_deliveries
    call = OPERATIONS[operation]
    before = _rows()
    blocker = _other_connection()
    try:
        # The record and the live queue (stage 2: claims, renewals and the reap back to pending write it alone).
        blocker.execute(
            "LOCK TABLE buzz_delivery_delivery_record, buzz_delivery_delivery_queue IN ACCESS EXCLUSIVE MODE"
        )
        with connection.cursor() as cursor:
            cursor.execute("SET statement_timeout = '300ms'")
        try:
            with pytest.raises(OperationalError, match="statement timeout"):
                call(community, target, lease)
        finally:
            blocker.rollback()
            with connection.cursor() as cursor:
                cursor.execute("RESET statement_timeout")
    finally:
        blocker.close()
    assert _rows() == before
    # The same connection works afterwards and the operation succeeds.
    outcome = call(community, target, lease)
    assert not isinstance(outcome, services.LeaseLost) and outcome not in (None, [])
    assert _rows() != before or operation == "reap"


# --- a long-running transaction holding an old snapshot ------------------------------------


def _drain_with_latencies(community, target, count: int) -> tuple[list[float], set]:
    latencies, seen = [], set()
    for _ in range(count):
        started = time.perf_counter()
        claim = services.claim_delivery(community.id, target, lease_seconds=60)
        latencies.append(time.perf_counter() - started)
        assert claim is not None
        assert claim.lease.delivery_id not in seen
        seen.add(claim.lease.delivery_id)
        assert services.finish_delivery(claim.lease, "finished") == services.Settled("finished")
    return latencies, seen


def _ms(values: list[float]) -> str:
    values = sorted(values)
    p95 = values[int(len(values) * 0.95) - 1]
    return f"median {statistics.median(values) * 1000:.2f} ms, p95 {p95 * 1000:.2f} ms"


def _claim_under_old_snapshot(total: int) -> None:
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    target = random32()
    for start in range(0, total, 5000):
        services.commit_deliveries(
            community.id,
            event,
            [
                BindingFactory(run=run, message_event=event, target_pubkey=target, step_id=f"s{i}")
                for i in range(start, min(total, start + 5000))
            ],
        )
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE buzz_delivery_delivery_record")
    baseline_count = total // 10
    before, seen = _drain_with_latencies(community, target, baseline_count)

    old = _other_connection()
    try:
        old.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        pending_then = old.execute("SELECT count(*) FROM buzz_delivery_delivery WHERE status = 'pending'").fetchone()[0]
        during, seen_during = _drain_with_latencies(community, target, total - baseline_count)
        still_seen = old.execute("SELECT count(*) FROM buzz_delivery_delivery WHERE status = 'pending'").fetchone()[0]
        assert still_seen == pending_then == total - baseline_count  # the old snapshot was held throughout
    finally:
        old.rollback()
        old.close()
    assert services.claim_delivery(community.id, target, lease_seconds=60) is None
    assert len(seen | seen_during) == total
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE status = 'finished'), count(*) FROM buzz_delivery_delivery"
            " WHERE community_id = %s",
            [community.id],
        )
        assert cursor.fetchone() == (total, total)
    tenth = max(1, len(during) // 10)
    print(
        f"\nclaim latency, {total} deliveries: before the old snapshot {_ms(before)};"
        f" under it, first tenth {_ms(during[:tenth])}, last tenth {_ms(during[-tenth:])}"
    )


@pytest.mark.django_db(transaction=True)
def test_claims_stay_correct_while_a_long_transaction_holds_an_old_snapshot():
    _claim_under_old_snapshot(3000)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_claims_stay_correct_while_a_long_transaction_holds_an_old_snapshot_20k():
    _claim_under_old_snapshot(20_000)
