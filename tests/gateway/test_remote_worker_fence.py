"""the work client settles each handler's result under the lease that handler ran
under, not under whatever lease of that delivery id the worker holds now (no database)."""

from __future__ import annotations

from buzz_delivery.gateway.client import PermanentFailure, RemoteClaim, RemoteLease, RemoteOutcome, RemoteWorker


class Recording:
    def __init__(self):
        self.batches: list[list[tuple]] = []

    def settle_many(self, settles):
        self.batches.append([(x.lease.delivery_id, x.lease.lease_generation, x.outcome) for x in settles])
        return [RemoteOutcome("lease_lost") for _ in settles]


def lease(generation: int) -> RemoteLease:
    return RemoteLease("c", "d", generation, "2026-01-01T00:00:00+00:00")


def test_a_stale_run_s_result_is_settled_under_its_own_generation_not_the_reclaimed_one():
    """A run of generation 1 outlives its lease (renewals failed); the reaper and a new claim
    by this same worker make it generation 3, whose run is still in its handler. The stale run's
    failure must be sent fenced by generation 1 (the gateway answers lease_lost), never as
    generation 3's settle: that would end the new run's delivery with the old run's result."""

    def handler(delivery):
        raise PermanentFailure("the stale run's failure")

    client = Recording()
    worker = RemoteWorker(client, handler)  # type: ignore[arg-type]
    worker._held["d"] = lease(3)  # the same delivery, claimed again (the claim loop overwrote it)
    worker._handling = 1
    worker._work(RemoteClaim({"id": "d"}, lease(1)))  # the stale run ends
    worker._settle([worker._results.get_nowait()])
    assert client.batches == [[("d", 1, "failed")]]
