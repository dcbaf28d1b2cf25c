"""The reaper's overlap guard and the worker behind PgBouncer in transaction pooling mode (SPEC
sections 7 and 8).

Every ``manage.py`` process here reaches the test database only through a private pgbouncer
(``pool_mode = transaction``, :mod:`tests.pgbouncer_support`), so consecutive statements of one
process may run on different server connections: nothing session-scoped (an advisory lock, a
``SET``, a prepared statement) may carry a guarantee. Each process has its own
``application_name`` (pgbouncer forwards it to the server connection it lends), and a trigger the
test installs records every UPDATE of a live delivery (its queue row) with who ran it, the maintenance lease holder at
that moment and ``clock_timestamp()``: the reaping intervals of different runs must not overlap.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from buzz_delivery import services
from buzz_delivery.models import DeliveryQueue, WorkflowAgentDelivery
from buzz_delivery.testing import (
    BindingFactory,
    CommunityFactory,
    EventFactory,
    Expr,
    WorkflowRunFactory,
    random32,
    set_delivery_state,
)
from tests.pgbouncer_support import PgBouncer, pgbouncer  # noqa: F401  (the fixture)
from tests.worker_support import DELIVERY_CLAIM_OPENING

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent
LEASE_TABLE = "buzz_delivery_maintenance_lease"
# A trigger goes on a table, not on the view: the queue, which holds the live state and which a
# reap back to pending now writes alone (the record is untouched until a terminal).
DELIVERY_TABLE = DeliveryQueue._meta.db_table


@dataclass
class Managed:
    """A ``manage.py`` subprocess connected through pgbouncer as ``name`` (its application_name)."""

    name: str
    proc: subprocess.Popen
    stdout: Path
    stderr: Path

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            pytest.fail(f"{self.name} did not exit within {timeout}s; stderr:\n{self.stderr.read_text()[-4000:]}")

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stdout.read_text().splitlines() if line.strip()]

    def describe(self) -> str:
        return (
            f"{self.name} (pid {self.proc.pid}, exit {self.proc.returncode}): stderr\n{self.stderr.read_text()[-3000:]}"
        )


@pytest.fixture
def manage(pgbouncer: PgBouncer, tmp_path: Path) -> Iterator[Any]:  # noqa: F811
    """Start ``manage.py <args>`` with DATABASE_URL through pgbouncer; kills leftovers at teardown."""
    started: list[Managed] = []

    def start(name: str, *args: str, **extra_env: str) -> Managed:
        env = {
            **os.environ,
            "DATABASE_URL": pgbouncer.url(application_name=name),
            "BUZZ_MIN_LEASE_SECONDS": "1",
            "LOG_LEVEL": "INFO",
            **extra_env,
        }
        run = Managed(name, None, tmp_path / f"{name}.out", tmp_path / f"{name}.err")  # type: ignore[arg-type]
        with open(run.stdout, "w") as out, open(run.stderr, "w") as err:
            run.proc = subprocess.Popen([sys.executable, "manage.py", *args], cwd=ROOT, env=env, stdout=out, stderr=err)
        started.append(run)
        return run

    yield start
    for run in started:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait(timeout=10)


@pytest.fixture
def update_audit() -> Iterator[None]:
    """Record every UPDATE of a delivery: who (application_name, backend pid), the reaper's run
    lease holder at that moment, the row's status and generation before and after, and the time
    (``clock_timestamp()``, not the transaction's start)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            CREATE TABLE test_delivery_update_audit (
                seq bigserial PRIMARY KEY,
                delivery_id uuid NOT NULL,
                old_status text NOT NULL,
                new_status text NOT NULL,
                old_generation bigint NOT NULL,
                new_generation bigint NOT NULL,
                app text NOT NULL,
                backend_pid int NOT NULL,
                lease_holder text,
                at timestamptz NOT NULL
            );
            CREATE FUNCTION test_delivery_update_audit() RETURNS trigger LANGUAGE plpgsql
                SECURITY DEFINER SET search_path = pg_catalog, public AS $$
            BEGIN
                INSERT INTO test_delivery_update_audit (delivery_id, old_status, new_status, old_generation,
                    new_generation, app, backend_pid, lease_holder, at)
                VALUES (NEW.id, OLD.status, NEW.status, OLD.lease_generation, NEW.lease_generation,
                    current_setting('application_name'), pg_backend_pid(),
                    (SELECT holder FROM {LEASE_TABLE} WHERE name = 'reap_deliveries'), clock_timestamp());
                RETURN NULL;
            END $$;
            CREATE TRIGGER test_delivery_update_audit AFTER UPDATE ON {DELIVERY_TABLE}
                FOR EACH ROW EXECUTE FUNCTION test_delivery_update_audit();
            """
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                f"DROP TRIGGER IF EXISTS test_delivery_update_audit ON {DELIVERY_TABLE};"
                " DROP FUNCTION IF EXISTS test_delivery_update_audit();"
                " DROP TABLE IF EXISTS test_delivery_update_audit;"
            )


def audit_rows(apps: set[str]) -> list[dict[str, Any]]:
    """The audited updates made by the processes named ``apps``, in time order. Fails if any
    update came from a session that is neither one of them nor this test's own."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (own_pid,) = cursor.fetchone()
        cursor.execute(
            "SELECT delivery_id, old_status, new_status, old_generation, new_generation, app, backend_pid,"
            " lease_holder, at FROM test_delivery_update_audit ORDER BY at, seq"
        )
        names = [c.name for c in cursor.description]
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    strangers = [r for r in rows if r["app"] not in apps and r["backend_pid"] != own_pid]
    assert not strangers, f"updates by an unnamed session (application_name not forwarded?): {strangers[:3]}"
    return [r for r in rows if r["app"] in apps]


def lapsed_deliveries(n: int) -> list:
    """``n`` deliveries of a fresh target, claimed once (generation 1) and then backdated: their
    leases ran out an hour ago. Three statements, however many rows."""
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    target = random32()
    bindings = [BindingFactory(run=run, message_event=event, target_pubkey=target) for _ in range(n)]
    ids = services.commit_deliveries(community.id, event, bindings)
    claimed = []
    while len(claimed) < n:
        claimed += services.claim_deliveries(community.id, target, limit=min(1000, n - len(claimed)))
    assert sorted(c.delivery.id for c in claimed) == sorted(ids)
    set_delivery_state(
        list(ids),
        lease_until=Expr("now() - interval '1 hour'"),
        claimed_at=Expr("buzz_delivery_plus_seconds(claimed_at, -3600)"),
    )
    return ids


@contextmanager
def run_lease_acquisition_held_back() -> Iterator[None]:
    """While inside, every attempt to take the run lease waits (an EXCLUSIVE lock on the lease
    table, on a direct connection); on exit all waiting attempts race at the same instant."""
    with psycopg.connect(**connection.get_connection_params()) as blocker:
        blocker.execute(f"LOCK TABLE {LEASE_TABLE} IN EXCLUSIVE MODE")
        try:
            yield
        finally:
            blocker.rollback()


def wait_until_waiting_on_the_lease_table(runs: list[Managed], timeout: float = 30) -> None:
    """Until every run's session (named by its application_name, as pgbouncer forwarded it) waits
    on the lease table's lock: all of them are inside their attempt to take the run lease."""
    names = {run.name for run in runs}
    deadline = time.monotonic() + timeout
    while True:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND application_name = ANY(%s)",
                [sorted(names)],
            )
            waiting = {row[0] for row in cursor.fetchall()}
        if waiting == names:
            return
        for run in runs:
            if run.proc.poll() is not None:
                pytest.fail(f"exited before taking the run lease: {run.describe()}")
        if time.monotonic() > deadline:
            pytest.fail(f"only {sorted(waiting)} of {sorted(names)} reached the run lease within {timeout}s")
        time.sleep(0.05)


def holder_pid(holder: str) -> int:
    """The pid in a run lease holder token (``host:pid:random``)."""
    return int(holder.rsplit(":", 2)[1])


def check_reaps(runs: list[Managed], lapsed: list) -> dict[str, list[dict[str, Any]]]:
    """Judge every audited update of the runs; return them grouped by run lease holder (one
    group per pass that did work).

    - each lapsed delivery was reaped exactly once: claimed -> pending, generation + 1;
    - every reaping update was made while its own process held the run lease (the holder
      token's pid is the pid of the process whose application_name made the update);
    - the reaping intervals of different passes do not overlap in time.
    """
    pid_of = {run.name: run.proc.pid for run in runs}
    rows = audit_rows(set(pid_of))
    assert Counter(r["delivery_id"] for r in rows) == Counter(lapsed), "each lapsed delivery reaped exactly once"
    assert all(r["old_status"] == "claimed" and r["new_status"] == "pending" for r in rows)
    assert all(r["new_generation"] == r["old_generation"] + 1 == 2 for r in rows)
    after = WorkflowAgentDelivery.objects.filter(id__in=lapsed)
    assert Counter((d.status, d.lease_generation, d.attempt) for d in after) == {("pending", 2, 1): len(lapsed)}

    by_holder: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        assert row["lease_holder"] is not None, f"reaped with no run lease held: {row}"
        by_holder[row["lease_holder"]].append(row)
    for holder, group in by_holder.items():
        assert {r["app"] for r in group} == {group[0]["app"]}, f"lease {holder} held while several runs reaped"
        assert holder_pid(holder) == pid_of[group[0]["app"]], f"{group[0]['app']} reaped under another's lease"
    passes = sorted(by_holder.values(), key=lambda group: group[0]["at"])
    for earlier, later in itertools.pairwise(passes):
        assert earlier[-1]["at"] < later[0]["at"], (
            f"two runs reaped at once: {earlier[0]['app']} until {earlier[-1]['at']},"
            f" {later[0]['app']} from {later[0]['at']}"
        )
    return by_holder


def test_two_concurrent_reap_runs_through_pgbouncer_never_both_run(manage, update_audit):
    lapsed = lapsed_deliveries(2000)  # about 2 s of one-row batches
    # Four one-shot runs, each held back inside its attempt to take the run lease until all four
    # are there, then released at one instant: the tightest race the guard can face.
    with run_lease_acquisition_held_back():
        runs = [manage(f"reap-{i}", "reap_deliveries", "--json", "--batch-size", "1") for i in range(4)]
        wait_until_waiting_on_the_lease_table(runs)
    started = time.monotonic()
    codes = [run.wait(timeout=60) for run in runs]
    took = time.monotonic() - started

    assert codes == [0] * len(runs), "\n".join(run.describe() for run in runs)
    summaries = {}
    for run in runs:
        lines = run.lines()
        assert len(lines) == 1, f"{run.name} printed {lines!r}"
        summaries[run.name] = lines[0]
    by_holder = check_reaps(runs, lapsed)
    assert len(by_holder) == 1, f"several runs reaped: {sorted({g[0]['app'] for g in by_holder.values()})}"
    ((holder, reaped),) = by_holder.items()
    winner = reaped[0]["app"]
    assert summaries[winner]["outcome"] == "ok" and summaries[winner]["reclaimed"] == len(lapsed)
    for name, summary in summaries.items():
        if name != winner:  # refused while the winner held the lease, and said by whom
            assert (summary["outcome"], summary["reason"], summary["holder"]) == ("busy", "another_run_active", holder)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {LEASE_TABLE}")
        assert cursor.fetchone()[0] == 0, "the winner released its run lease"
    reap_seconds = (reaped[-1]["at"] - reaped[0]["at"]).total_seconds()
    assert reap_seconds > 1.0, (
        f"the reap took only {reap_seconds:.2f}s: too short to show an overlap (took {took:.1f}s)"
    )


def test_looping_reapers_through_pgbouncer_take_turns_and_stop_on_sigterm(manage, update_audit):
    lapsed = lapsed_deliveries(300)
    with run_lease_acquisition_held_back():
        runs = [
            manage(f"reap-loop-{i}", "reap_deliveries", "--json", "--batch-size", "1", "--loop", "--interval", "0.1")
            for i in range(3)
        ]
        wait_until_waiting_on_the_lease_table(runs)
    # More leases lapse while the loops run: a fresh target each time, so rows already reaped
    # back to pending are not claimed again. At least 4 s of it, and on until two of the runs
    # have each reaped some (on a loaded machine one loop can win the lease for seconds on end;
    # the hand-over is what this test is about), for 30 s at most.
    names = {run.name for run in runs}
    started = time.monotonic()
    while time.monotonic() < started + 4 or (
        len({r["app"] for r in audit_rows(names)} & names) < 2 and time.monotonic() < started + 30
    ):
        lapsed += lapsed_deliveries(20)
        time.sleep(0.25)
    limit = time.monotonic() + 20
    while WorkflowAgentDelivery.objects.filter(id__in=lapsed, status="claimed").exists():
        assert time.monotonic() < limit, "the looping reapers left lapsed leases behind"
        assert all(run.proc.poll() is None for run in runs), "\n".join(run.describe() for run in runs)
        time.sleep(0.1)
    for run in runs:
        run.proc.send_signal(signal.SIGTERM)
    codes = [run.wait(timeout=20) for run in runs]

    assert codes == [0] * len(runs), "\n".join(run.describe() for run in runs)
    by_holder = check_reaps(runs, lapsed)
    reaped_by_app = Counter(r["app"] for group in by_holder.values() for r in group)
    working_passes = Counter(group[0]["app"] for group in by_holder.values())
    busy = 0
    for run in runs:
        lines = run.lines()
        assert lines, f"{run.name} printed nothing"
        assert {line["outcome"] for line in lines} <= {"ok", "busy", "stopped"}, lines
        busy += sum(line["outcome"] == "busy" for line in lines)
        done = [line for line in lines if line["outcome"] != "busy" and line["reclaimed"]]
        # what each run says it did is what the database saw it do, pass by pass
        assert sum(line["reclaimed"] for line in done) == reaped_by_app[run.name], run.name
        assert len(done) == working_passes[run.name], run.name
    assert busy >= len(runs) - 1, "the runs held back together: all but one found the lease taken"
    assert len(working_passes) >= 2, f"only {set(working_passes)} ever took the lease: no hand-over was tested"


def test_workers_through_pgbouncer_settle_each_delivery_once(manage, community):
    target = random32()
    event = EventFactory(community=community)
    run = WorkflowRunFactory(community=community)

    def commit(n: int) -> list:
        bindings = [BindingFactory(run=run, message_event=event, target_pubkey=target) for _ in range(n)]
        return services.commit_deliveries(community.id, event, bindings)

    ids = commit(300)
    worker_args = [
        "run_delivery_worker", "--community", str(community.id), "--target", target.hex(),
        "--handler", "tests.worker_handlers:finish", "--concurrency", "4", "--idle-exit", "2",
        "--poll-interval", "0.2", "--lease-seconds", "2",
    ]  # fmt: skip
    workers = [manage(f"worker-{i}", *worker_args) for i in range(3)]
    reaper = manage("reaper", "reap_deliveries", "--json", "--loop", "--interval", "0.2")
    for _ in range(10):  # more deliveries while the workers run (their NOTIFY hints go out at commit)
        ids += commit(10)
        time.sleep(0.1)
    codes = [worker.wait(timeout=45) for worker in workers]
    reaper.proc.send_signal(signal.SIGTERM)
    reaper_code = reaper.wait(timeout=20)

    assert codes == [0, 0, 0] and reaper_code == 0, "\n".join(r.describe() for r in [*workers, reaper])
    rows = WorkflowAgentDelivery.objects.filter(id__in=ids)
    assert Counter((d.status, d.attempt, d.lease_generation) for d in rows) == {("finished", 1, 1): len(ids)}
    summaries = []
    for worker in workers:
        lines = worker.lines()
        assert len(lines) == 1, f"{worker.name} printed {lines!r}"
        summaries.append(lines[0])
    totals = Counter()
    for summary in summaries:
        totals.update({key: summary[key] for key in ("claimed", "finished", "failed", "retried", "lease_lost")})
    assert totals["claimed"] == totals["finished"] == len(ids), summaries
    assert totals["failed"] == totals["retried"] == totals["lease_lost"] == 0, summaries
    passes = reaper.lines()
    assert passes and all(p["outcome"] in ("ok", "stopped") for p in passes), passes
    assert sum(p.get("reclaimed", 0) + p.get("exhausted", 0) + p.get("expired", 0) for p in passes) == 0, passes


def claimed_since_listening(log: str) -> bool:
    """Whether the worker whose log is ``log`` has claimed since it logged that it LISTENs (the
    poll its listener asks for then): a backend idle after a delivery claim that began after that
    line's time. Read from the log, not from a LISTENing backend: through pgbouncer the LISTEN's
    server connection goes back to the pool and runs other clients' statements."""
    stamps = re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+ listening channel=", log, re.MULTILINE)
    if not stamps:
        return False
    since = dt.datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S,%f").astimezone()  # the log's local time
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle'"
            " AND strpos(query, %s) > 0 AND query_start >= %s)",
            [DELIVERY_CLAIM_OPENING, since],
        )
        return cursor.fetchone()[0]


@pytest.mark.parametrize("direct_listen", [False, True], ids=["listen-through-pgbouncer", "listen-direct"])
def test_a_worker_behind_pgbouncer_hears_wake_hints_only_on_a_direct_listen_connection(
    manage, community, direct_listen
):
    """Through a transaction pooler a LISTEN hears nothing; BUZZ_DELIVERY['LISTEN_DATABASE']
    (here the project's BUZZ_LISTEN_DATABASE_URL) gives the listener a direct connection."""
    from project.database_url import database_url

    target = random32()
    event = EventFactory(community=community)
    run = WorkflowRunFactory(community=community)
    extra = {"BUZZ_LISTEN_DATABASE_URL": database_url(connection.settings_dict)} if direct_listen else {}
    worker = manage(
        "listener",
        "run_delivery_worker", "--community", str(community.id), "--target", target.hex(),
        "--handler", "tests.worker_handlers:finish", "--poll-interval", "600", "--lease-seconds", "5",
        **extra,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not claimed_since_listening(worker.stderr.read_text()):
        assert time.monotonic() < deadline and worker.proc.poll() is None, worker.describe()
        time.sleep(0.05)
    # Past the poll its listener asked for: from here only a hint wakes it before 600 s.

    (delivery_id,) = services.commit_deliveries(
        community.id, event, [BindingFactory(run=run, message_event=event, target_pubkey=target)]
    )
    # Heard: within 60 s (generous for a loaded CI). Not heard: nothing claims it for 600 s, and
    # 5 s show it (a hint would take a fraction of a second).
    deadline = time.monotonic() + (60 if direct_listen else 5)
    while WorkflowAgentDelivery.objects.get(id=delivery_id).status != "finished" and time.monotonic() < deadline:
        time.sleep(0.05)
    heard = WorkflowAgentDelivery.objects.get(id=delivery_id).status == "finished"
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0, worker.describe()
    assert heard is direct_listen, worker.describe()
