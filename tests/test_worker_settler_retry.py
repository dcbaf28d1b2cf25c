"""The settler tries a settle again after a lost connection, for up to one lease length.

The settle is called once directly (a tenacity ``Retrying`` built for every batch cost about a
microsecond a delivery); only a lost connection hands the rest of the attempts to a ``Retrying``
with the same policy: these pin what it must do. A settle that lost its
connection is tried again (its connection closed first) and its outcomes are the successful
try's; a lock wait past its bound is not tried again (the settler keeps those results for
later); a connection that stays lost is given up after one lease length (the results' leases
lapse, nothing is settled twice).
"""

from __future__ import annotations

import datetime as dt
import uuid

import psycopg
import pytest
from django.db import OperationalError

from buzz_delivery.services import Lease, Settled
from buzz_delivery.worker import settler as settler_module
from buzz_delivery.worker.handlers import FINISHED
from buzz_delivery.worker.settler import BUSY, SettleJob, Settler

UNTIL = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits between tries, recorded instead of slept."""
    waits: list[float] = []
    monkeypatch.setattr(settler_module.time, "sleep", waits.append)
    return waits


def _jobs(n: int) -> list[SettleJob]:
    community = uuid.uuid4()
    return [SettleJob(Lease.from_database(community, uuid.uuid4(), b"t" * 32, 1, UNTIL), FINISHED) for _ in range(n)]


def _settler(lease_seconds: float = 30.0) -> Settler:
    return Settler(max_batch=10, linger=0.0, lease_seconds=lease_seconds, count=lambda *_: None, done=lambda _: None)


def _lost() -> OperationalError:
    error = OperationalError("the connection is lost")
    error.__cause__ = psycopg.OperationalError("server closed the connection unexpectedly")
    return error


def _lock_wait() -> OperationalError:
    error = OperationalError("canceling statement due to lock timeout")
    error.__cause__ = psycopg.errors.LockNotAvailable("canceling statement due to lock timeout")
    return error


def test_a_batch_settle_that_lost_its_connection_is_tried_again_and_settles(no_sleep, monkeypatch, caplog) -> None:
    closed: list[int] = []
    monkeypatch.setattr(settler_module, "close_old_connections", lambda: closed.append(1))
    jobs = _jobs(3)
    tries: list[int] = []

    def settle(leases: list[Lease]) -> list[Settled]:
        tries.append(len(leases))
        if len(tries) < 3:
            raise _lost()
        return [Settled("finished")] * len(leases)

    results, statements = _settler()._call_many(jobs, settle, [job.lease for job in jobs])

    assert tries == [3, 3, 3]
    assert results == [(job, Settled("finished")) for job in jobs]
    assert statements == 1
    assert len(closed) == 2  # the connection closed before each new try
    assert no_sleep == [0.2, 0.4]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("db_unavailable role=settle")]
    assert [m.split(" error=")[0] for m in logged] == [
        "db_unavailable role=settle attempt=1",
        "db_unavailable role=settle attempt=2",
    ]


def test_a_single_settle_that_lost_its_connection_is_tried_again(no_sleep, monkeypatch) -> None:
    monkeypatch.setattr(settler_module, "close_old_connections", lambda: None)
    tries: list[uuid.UUID] = []

    def finish_delivery(lease: Lease, outcome: str, **kwargs: object) -> Settled:
        tries.append(lease.delivery_id)
        if len(tries) == 1:
            raise _lost()
        return Settled(outcome)

    monkeypatch.setattr(settler_module.services, "finish_delivery", finish_delivery)
    (job,) = _jobs(1)

    assert _settler()._settle_one(job) == (Settled("finished"), 1)
    assert tries == [job.lease.delivery_id] * 2


def test_a_lock_wait_past_its_bound_is_not_tried_again(no_sleep) -> None:
    jobs = _jobs(2)
    tries: list[int] = []

    def settle(leases: list[Lease]) -> list[Settled]:
        tries.append(1)
        raise _lock_wait()

    assert _settler()._call_many(jobs, settle, [job.lease for job in jobs]) == (BUSY, 1)
    assert tries == [1]
    assert no_sleep == []


def test_a_connection_that_stays_lost_is_given_up_after_one_lease_length(no_sleep, monkeypatch) -> None:
    monkeypatch.setattr(settler_module, "close_old_connections", lambda: None)
    clock = [1000.0]
    monkeypatch.setattr(settler_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(
        settler_module.time,
        "sleep",
        lambda seconds: (no_sleep.append(seconds), clock.__setitem__(0, clock[0] + seconds)),
    )
    jobs = _jobs(2)
    tries: list[int] = []

    def settle(leases: list[Lease]) -> list[Settled]:
        tries.append(1)
        raise _lost()

    assert _settler(lease_seconds=5.0)._call_many(jobs, settle, [job.lease for job in jobs]) == ([], 1)
    # Waits 0.2, 0.4, 0.8, 1.6, 2.0 (capped): 5.0 s after the first try the next failure is final.
    assert no_sleep == [0.2, 0.4, 0.8, 1.6, 2.0]
    assert len(tries) == 6
