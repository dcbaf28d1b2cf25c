"""The renewer's count of handlers past their deadline (``timed_out_count``, read by the
dispatcher on every round, issue 31) is kept as leases time out and are released, not counted
over every held lease under the renewer's lock: the dispatcher never waits for that lock (the
renewer holds it while it scans its leases) and a round no longer costs a pass over a batch of
claims held ahead."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

from buzz_delivery.services import Lease
from buzz_delivery.worker.renewer import LeaseRenewer

UNTIL = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def _lease(generation: int = 1) -> Lease:
    return Lease.from_database(uuid.uuid4(), uuid.uuid4(), b"\x01" * 32, generation, UNTIL)


def _renewer(timed_out: list[Lease]) -> LeaseRenewer:
    return LeaseRenewer(
        lease_seconds=60,
        every=20,
        on_renewed=lambda: None,
        on_timed_out=lambda held: timed_out.append(held.lease),
        bound_lock_waits=False,
    )


def _wait_for(condition, seconds: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    give_up = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.01)


def test_the_count_follows_deadlines_passing_and_releases():
    timed_out: list[Lease] = []
    renewer = _renewer(timed_out)
    renewer.start()
    try:
        late, later, fine = _lease(), _lease(), _lease()
        renewer.hold_many([late, later, fine])
        assert renewer.timed_out_count() == 0 and renewer.timed_out_delivery_ids() == set()
        renewer.set_deadline(late, time.monotonic() + 0.05)
        renewer.set_deadline(later, time.monotonic() + 0.1)
        renewer.set_deadline(fine, time.monotonic() + 3600)
        _wait_for(lambda: len(timed_out) == 2)
        assert renewer.timed_out_count() == 2
        assert renewer.timed_out_delivery_ids() == {late.delivery_id, later.delivery_id}
        held = renewer.release(late)
        assert held is not None and held.timed_out
        assert renewer.timed_out_count() == 1 and renewer.timed_out_delivery_ids() == {later.delivery_id}
        assert renewer.release(late) is None and renewer.timed_out_count() == 1  # released twice: no change
        renewer.release(fine)  # a lease that did not time out leaves the count alone
        assert renewer.timed_out_count() == 1
        renewer.release(later)
        assert renewer.timed_out_count() == 0 and renewer.timed_out_delivery_ids() == set()
    finally:
        renewer.shutdown()


def test_another_generation_of_a_hung_delivery_is_not_hung():
    timed_out: list[Lease] = []
    renewer = _renewer(timed_out)
    renewer.start()
    try:
        old = _lease(1)
        renewer.hold_many([old])
        renewer.set_deadline(old, time.monotonic())
        _wait_for(lambda: timed_out == [old])
        newer = Lease.from_database(old.community_id, old.delivery_id, old.target_pubkey, 2, UNTIL)
        renewer.hold_many([newer])
        renewer.release(newer)  # the newer lease's handler ends: the old one still hangs
        assert renewer.timed_out_count() == 1 and renewer.timed_out_delivery_ids() == {old.delivery_id}
    finally:
        renewer.shutdown()


def test_the_dispatchers_count_does_not_wait_for_the_renewers_lock():
    renewer = _renewer([])
    renewer.hold_many([_lease() for _ in range(50)])
    counts: list[int] = []
    with renewer._lock:  # the renewer scanning its leases, say
        reader = threading.Thread(target=lambda: counts.append(renewer.timed_out_count()), daemon=True)
        reader.start()
        reader.join(2)
        done = not reader.is_alive()
    reader.join()
    assert done, "timed_out_count waited for the renewer's lock"
    assert counts == [0]
