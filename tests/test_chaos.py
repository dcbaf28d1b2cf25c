"""Chaos: worker processes claim, renew and settle thousands of deliveries while a driver SIGKILLs
them, terminates their database backends, pauses them past their lease and runs the reaper, and
nothing is lost or settled twice (SPEC sections 1, 4-6).

Real processes (``python -m tests.chaos.member worker``) on the real PostgreSQL test database,
with 1-second leases. Each worker logs every settle attempt (delivery id, generation, outcome,
result, status) to its own JSONL file, fsynced before and after the call. At the end the logs
are audited against the rows (:func:`tests.chaos.audit.audit`):

- every delivery of an active community is terminal;
- each terminal row a worker ended has exactly one accepted settle in the logs (``Settled`` with
  that terminal status, or ``AlreadyTerminal`` when the holder's first call lost its connection
  after the commit), under exactly the row's final ``lease_generation``, with the row's status.
  A worker SIGKILLed inside the call leaves one settle "in doubt": then the row may be ended by
  that settle, under its generation, and by nothing else;
- rows the reaper ended (attempts exhausted, deadline passed) have no accepted worker settle;
- no lease generation of a delivery is settled twice, and no settle or renew that started after
  its lease deadline was accepted (a stale holder always gets ``LeaseLost``); the paused workers'
  late settles are observed and refused;
- counts agree exactly: terminal rows per status == accepted worker settles + reaper endings;
- a community fenced mid-run keeps exactly the rows it had when it was fenced.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from buzz_delivery import services
from buzz_delivery.testing import BindingFactory, CommunityFactory, EventFactory, WorkflowRunFactory, random32
from tests.chaos import Audit, Fleet, audit, fetch_rows, private_workdir

LEASE_SECONDS = 1.0


@pytest.fixture
def workdir():
    with private_workdir() as folder:
        yield folder


def commit_many(community, targets: list[bytes], count: int, *, max_attempts=3, expires_in: float | None = None):
    """Commit ``count`` deliveries spread over ``targets`` through the producer service."""
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    expires_at = None if expires_in is None else dt.datetime.now(dt.UTC) + dt.timedelta(seconds=expires_in)
    bindings = [
        BindingFactory(run=run, message_event=event, step_id=f"step-{i}", target_pubkey=targets[i % len(targets)])
        for i in range(count)
    ]
    with override_settings(BUZZ_DELIVERY={**settings.BUZZ_DELIVERY, "MAX_ATTEMPTS": max_attempts}):
        for start in range(0, count, 1000):
            services.commit_deliveries(community.id, event, bindings[start : start + 1000], expires_at=expires_at)


def snapshot_of(community_id) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM buzz_delivery_delivery WHERE community_id = %s ORDER BY id", [community_id])
        return cursor.fetchall()


def run_chaos(workdir: Path, seed: int, deliveries: int, workers: int, chaos_seconds: float) -> tuple[Audit, Fleet]:
    rng = random.Random(seed)
    main, fenced = CommunityFactory(name="chaos-main"), CommunityFactory(name="chaos-fenced-mid-run")
    targets = [random32(), random32()]
    in_main = deliveries * 5 // 6
    commit_many(main, targets, in_main - in_main // 10 - in_main // 20)
    commit_many(main, targets, in_main // 10, max_attempts=1)  # every retry or lapse ends them
    commit_many(main, targets, in_main // 20, expires_in=chaos_seconds / 3)  # some run out of time
    commit_many(fenced, targets[:1], deliveries - in_main)
    addresses = [(str(main.id), t.hex()) for t in targets] + [(str(fenced.id), targets[0].hex())]

    fleet = Fleet(
        workdir,
        connection.settings_dict,
        addresses,
        seed=seed,
        workers=workers,
        lease=LEASE_SECONDS,
        prefix=f"chaos{seed}",
    )
    fenced_rows: list[tuple] | None = None
    try:
        fleet.start()
        time.sleep(2.0)  # let the processes start and take work
        # The chaos lasts chaos_seconds from here: the fleet's start is not part of it (on a loaded
        # one-machine Citus cluster the members took most of 15 s to start, and no act of chaos was
        # left in the time).
        started = time.monotonic()
        action = "pause"  # the first action lands while every worker is busy
        while time.monotonic() - started < chaos_seconds and _open_in(main.id) > 0:
            if fenced_rows is None and time.monotonic() - started > chaos_seconds / 3:
                services.advance_community(fenced.id, "quiescing")
                fenced_rows = snapshot_of(fenced.id)
            inflict(fleet, action, rng)
            time.sleep(rng.uniform(0.2, 0.8))
            action = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
        if fenced_rows is None:
            services.advance_community(fenced.id, "quiescing")
            fenced_rows = snapshot_of(fenced.id)
        chaos_ended = time.monotonic()
        deadline = chaos_ended + 120
        while _open_in(main.id) and time.monotonic() < deadline:
            time.sleep(0.5)
        fleet.stop()
    finally:
        fleet.kill_all()

    with connection.cursor() as cursor:
        rows = fetch_rows(cursor)
    report = audit(fleet.worker_logs(), fleet.killed_logs, fleet.pauses, rows, active_communities={str(main.id)})
    print(
        f"\nchaos seed {seed}: {len(rows)} deliveries, {workers} workers, chaos {chaos_ended - started:.1f} s,"
        f" drain {time.monotonic() - chaos_ended:.1f} s; actions {dict(fleet.actions)}\n  {report.summary()}"
    )
    assert snapshot_of(fenced.id) == fenced_rows, "a fenced community's rows changed"
    assert fleet.stderr_of_clean_exits() == ""
    return report, fleet


# What the driver does to the fleet, with its relative weight.
ACTIONS = {"sigkill worker": 3, "terminate worker": 3, "pause": 2, "sigkill reaper": 1, "terminate reaper": 1}


def inflict(fleet: Fleet, action: str, rng: random.Random) -> None:
    """One act of chaos on a random worker (or the reaper)."""
    slot = rng.randrange(fleet.workers)
    with connection.cursor() as cursor:
        if action == "sigkill worker":
            fleet.sigkill_and_respawn("worker", slot)
        elif action == "terminate worker":
            fleet.terminate_backend(cursor, "worker", slot)
        elif action == "pause":
            fleet.pause_past_lease(slot, LEASE_SECONDS * 1.5 + rng.uniform(0, 0.5))
        elif action == "sigkill reaper":
            fleet.sigkill_and_respawn("reaper", 0)
        else:
            fleet.terminate_backend(cursor, "reaper", 0)


def _open_in(community_id) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM buzz_delivery_delivery WHERE community_id = %s"
            " AND status NOT IN ('finished', 'failed', 'expired')",
            [community_id],
        )
        return cursor.fetchone()[0]


def assert_nothing_lost(report: Audit) -> None:
    assert report.violations == []
    assert report.terminal_rows_by_status() == report.accounted_by_status()
    # The paused workers woke up holding a lapsed lease; their settles were refused.
    assert report.late_after_pause["LeaseLost"] >= 1
    assert set(report.late_after_pause) == {"LeaseLost"}


@pytest.mark.django_db(transaction=True)
def test_chaos_loses_nothing_and_settles_nothing_twice(workdir):
    report, fleet = run_chaos(workdir, seed=20_260_601, deliveries=600, workers=4, chaos_seconds=15)
    assert_nothing_lost(report)
    assert fleet.actions["SIGKILL worker"] + fleet.actions["terminate backend worker"] >= 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_long_chaos_loses_nothing_and_settles_nothing_twice(workdir, seed):
    report, fleet = run_chaos(workdir, seed=seed, deliveries=3000, workers=6, chaos_seconds=90)
    assert_nothing_lost(report)
    assert fleet.actions["SIGKILL worker"] >= 1 and fleet.actions["pause past lease"] >= 1


def _write_log(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _settle(seq: int, delivery: str, gen: int, result: str, status: str | None, *, late: bool = False, errors=0):
    lease_until = 1000.0
    return {
        "kind": "settle",
        "seq": seq,
        "id": delivery,
        "gen": gen,
        "outcome": "finished",
        "result": result,
        "status": status,
        "errors": errors,
        "lease_until": lease_until,
        "t_before": lease_until + (1 if late else -0.5),
        "t": lease_until,
    }


def test_the_audit_flags_double_settles_stale_settles_and_lost_deliveries(tmp_path):
    """The chaos verdict can fail: each planted fault is reported, and a clean history is not."""
    row = {"id": "d1", "community": "c", "status": "finished", "gen": 2, "failure_message": None}
    clean = _write_log(tmp_path / "clean.jsonl", _settle(1, "d1", 2, "Settled", "finished"))
    assert audit([clean], set(), [], [row], {"c"}).violations == []

    twice = _write_log(tmp_path / "twice.jsonl", _settle(2, "d1", 1, "Settled", "finished"))
    assert any("2 holders" in v for v in audit([clean, twice], set(), [], [row], {"c"}).violations)

    stale = _write_log(tmp_path / "stale.jsonl", _settle(1, "d1", 2, "Settled", "finished", late=True))
    assert any("stale holder" in v for v in audit([stale], set(), [], [row], {"c"}).violations)

    lost = {**row, "id": "d2", "status": "pending"}
    assert any("ended pending" in v for v in audit([clean], set(), [], [row, lost], {"c"}).violations)

    unlogged = {**row, "id": "d3"}
    assert any("no settle" in v for v in audit([clean], set(), [], [row, unlogged], {"c"}).violations)

    intent = {**_settle(5, "d3", 2, "", None), "kind": "settle_intent"}
    in_doubt = _write_log(tmp_path / "killed.jsonl", intent)
    assert audit([clean, in_doubt], {in_doubt}, [], [row, unlogged], {"c"}).violations == []
    assert audit([clean, in_doubt], set(), [], [row, unlogged], {"c"}).violations != []  # not killed: a lost result
