"""``async def`` delivery handlers (issue 29): ``run_delivery_worker`` awaits them as tasks on one
event loop thread, so ``--concurrency`` counts deliveries in flight (up to 10,000), not threads,
and the worker's database connections stay four (dispatcher, settler, renewer, listener)
however many handlers are waiting. Real worker processes against the test database."""

from __future__ import annotations

import json
import threading
import time

import psycopg
import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.db import connection

from buzz_delivery import services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import BindingFactory, EventFactory, WorkflowRunFactory, random32
from buzz_delivery.worker import WorkerConfig
from buzz_delivery.worker.runtime import is_async_handler
from project.database_url import database_url
from tests import worker_handlers

pytestmark = pytest.mark.django_db(transaction=True)

ASYNC = "tests.worker_handlers:async_waits"


def commit(community, target: bytes, n: int, **script) -> list:
    """Commit ``n`` deliveries to ``target`` (500 a statement); returns the new ones' ids."""
    run, event = WorkflowRunFactory(community=community), EventFactory(community=community)
    mine = WorkflowAgentDelivery.objects.filter(community_id=community.id, target_pubkey=target)
    before = set(mine.values_list("id", flat=True))
    for start in range(0, n, 500):
        bindings = [
            BindingFactory.build(run=run, message_event=event, target_pubkey=target) for _ in range(min(500, n - start))
        ]
        services.commit_deliveries(community.id, event, bindings, trigger_context=script or None)
    ids = [i for i in mine.values_list("id", flat=True) if i not in before]
    assert len(ids) == n
    return ids


def peak_overlap(log_path) -> int:
    """The most handlers that had started and not yet ended at once, from the handler log."""
    marks = []
    for line in log_path.read_text().splitlines():
        event = json.loads(line)
        marks.append((event["time"], 1 if event["event"] == "start" else -1))
    peak = current = 0
    for _, step in sorted(marks, key=lambda m: (m[0], m[1])):
        current += step
        peak = max(peak, current)
    return peak


class ConnectionSampler(threading.Thread):
    """Counts, every 50 ms, the backends of the test database whose application is the worker's."""

    def __init__(self, application_name: str) -> None:
        super().__init__(daemon=True)
        self.url = database_url(connection.settings_dict)
        self.application_name = application_name
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stop.is_set():
                (n,) = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND application_name = %s",
                    [self.application_name],
                ).fetchone()
                self.peak = max(self.peak, n)
                time.sleep(0.05)


def test_a_thousand_waiting_async_handlers_run_at_once_on_the_worker_s_four_connections(community, start_worker):
    target = random32()
    ids = commit(community, target, 1000, sleep=2)
    sampler = ConnectionSampler("buzz-async-worker")
    sampler.start()
    worker = start_worker(
        target, "--concurrency", "1000", "--max-deliveries", "1000", "--lease-seconds", "30", handler=ASYNC,
        PGAPPNAME="buzz-async-worker",
    )  # fmt: skip
    try:
        assert worker.wait(timeout=120) == 0, worker.log()[-3000:]
    finally:
        sampler.stop.set()
        sampler.join()
    assert set(WorkflowAgentDelivery.objects.filter(id__in=ids).values_list("status", flat=True)) == {"finished"}
    summary = worker.summary()
    assert summary["claimed"] == summary["finished"] == 1000
    # Each handler waits 2 s: one at a time (or 256 threads) would hold them back; here most
    # of the thousand were waiting at the same moment.
    assert peak_overlap(worker.handler_log) >= 900
    assert 1 <= sampler.peak <= 4, sampler.peak  # dispatcher, settler, renewer, listener


def test_an_async_handler_s_outcomes_settle_as_a_plain_handler_s_and_one_bad_delivery_stops_nothing(
    community, start_worker
):
    target = random32()
    outcomes = {}
    for what in ("permanent", "ordinary", "base", "cancelled", None):
        (outcomes[what],) = commit(community, target, 1, **({"raise": what} if what else {}))
    worker = start_worker(target, "--concurrency", "8", "--max-deliveries", "5", handler=ASYNC)
    assert worker.wait(timeout=60) == 0, worker.log()[-3000:]
    rows = {
        what: WorkflowAgentDelivery.objects.values("status", "failure_code").get(id=i) for what, i in outcomes.items()
    }
    assert rows["permanent"] == {"status": "failed", "failure_code": "BadPayload"}
    assert rows["ordinary"]["status"] == "pending"  # a retry, waiting out its backoff
    assert rows["base"] == {"status": "failed", "failure_code": "SystemExit"}
    assert rows["cancelled"] == {"status": "failed", "failure_code": "CancelledError"}
    assert rows[None]["status"] == "finished"
    summary = worker.summary()
    assert (summary["finished"], summary["failed"], summary["retried"]) == (1, 3, 1)


def test_more_than_256_in_flight_needs_an_async_handler(community):
    assert is_async_handler(worker_handlers.async_waits) and not is_async_handler(worker_handlers.scripted)
    with pytest.raises(ValidationError, match="concurrency"):
        WorkerConfig(
            community_id=community.id, target_pubkey=random32(), handler=worker_handlers.scripted, concurrency=257
        )
    WorkerConfig(
        community_id=community.id, target_pubkey=random32(), handler=worker_handlers.async_waits, concurrency=5000
    )
    with pytest.raises(CommandError, match="--concurrency: 300 handler threads is too many") as refused:
        call_command(
            "run_delivery_worker", "--community", str(community.id), "--target", random32().hex(),
            "--handler", "tests.worker_handlers:scripted", "--concurrency", "300",
        )  # fmt: skip
    assert refused.value.returncode == 2
    assert not WorkflowAgentDelivery.objects.exists()


def test_claims_ahead_of_an_async_handler_wait_for_a_free_slot_of_its_concurrency(community, start_worker):
    """``--concurrency`` bounds the async handlers in flight at once (docs/inbox.md: "``--concurrency``
    tasks on one event loop thread"). The claim-ahead (claims beyond the free handlers, up to a
    batch, once recent run times are known) handed each claim to the loop as a task at once: a
    worker with ``--concurrency 2`` ran its claimed-ahead deliveries too, up to 2 + a batch
    handlers at once. Claims ahead now wait on the loop for a slot, as they wait in the queue of
    a thread pool (found in the review of issue 31's claim gate)."""
    target = random32()
    ids = commit(community, target, 120, sleep=0.05)
    worker = start_worker(
        target, "--concurrency", "2", "--batch-size", "20", "--max-deliveries", "120", "--lease-seconds", "30",
        handler=ASYNC,
    )  # fmt: skip
    assert worker.wait(timeout=120) == 0, worker.log()[-3000:]
    assert set(WorkflowAgentDelivery.objects.filter(id__in=ids).values_list("status", flat=True)) == {"finished"}
    assert peak_overlap(worker.handler_log) <= 2
