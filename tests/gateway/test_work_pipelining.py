"""Issue 29: ``work`` keeps a second claim in flight while the first is answered, so its handlers
never idle for a claim's round trip; the second never long-polls and is sent only while the
queue has more (the claim before it came back full). The claim loop against a scripted gateway
(the HTTP side of claims is tested against gunicorn in test_remote_worker)."""

from __future__ import annotations

import contextlib
import faulthandler
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from buzz_delivery.gateway.client import CLAIM_LIMIT, RemoteClaim, RemoteLease, RemoteOutcome, RemoteWorker

FAR = (datetime.now(UTC) + timedelta(hours=1)).isoformat()


@pytest.fixture(autouse=True)
def stacks_of_a_stalled_drain():
    """Twice, under load, a drain here held finished deliveries unsettled through the whole
    30 s shutdown grace (counted ``abandoned``): a settler's timed SimpleQueue wait that became an
    endless one (see the test of it below). Kept as a guard: past 20 s every thread's stack goes
    to stderr, so another stall would show where."""
    faulthandler.dump_traceback_later(20)
    yield
    faulthandler.cancel_dump_traceback_later()


class ScriptedGateway:
    """Serves ``total`` deliveries. The second claim request is answered only once a third one
    is in flight beside it (10 s at most: the worker without a second claim in flight)."""

    timeout = 10.0

    def __init__(self, total: int) -> None:
        self.left = total
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0
        self.calls: list[tuple[int, float, int]] = []  # (limit, wait_seconds, in flight beside it)
        self.beside = threading.Event()
        self.settled: list[str] = []

    def claim(self, limit: int, *, wait_seconds: float = 0, lease_seconds: float | None = None) -> list[RemoteClaim]:
        with self.lock:
            number = len(self.calls)
            self.calls.append((limit, wait_seconds, self.in_flight))
            if self.in_flight:
                self.beside.set()
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if number == 1:
                self.beside.wait(10)
            with self.lock:
                n = min(limit, self.left)
                first = self.left
                self.left -= n
            return [
                RemoteClaim({"id": str(i), "step_id": "ok"}, RemoteLease("c1", str(i), 1, FAR))
                for i in range(first - n, first)
            ]
        finally:
            with self.lock:
                self.in_flight -= 1

    def settle_many(self, settles) -> list[RemoteOutcome]:
        with self.lock:
            self.settled += [x.lease.delivery_id for x in settles]
        return [RemoteOutcome("settled", status="finished") for _ in settles]

    def renew_many(self, leases, lease_seconds=None) -> list[RemoteOutcome]:
        return [RemoteOutcome("renewed", lease=x) for x in leases]


class SteadyAhead(RemoteWorker):
    """Its claim-ahead budget whole from the start. The budget follows the handlers' measured
    pace, and on a loaded machine (CI's, 2 cores, the Citus suite beside) a no-op handler
    descheduled mid-call measured tenths of a second: the budget fell under the
    ``CLAIM_MIN_SECOND`` a second claim needs, and none was sent beside the first. This test is
    about the second claim's rule, not about the pace's."""

    def _ahead(self) -> int:
        return self.claim_ahead


def test_a_second_claim_is_in_flight_while_the_first_is_answered_and_it_never_long_polls():
    gateway = ScriptedGateway(total=1000)
    worker = SteadyAhead(gateway, lambda d: None, concurrency=8, wait_seconds=5, idle_exit=0.5)  # type: ignore[arg-type]
    summary = worker.run()
    assert gateway.most_in_flight == 2, gateway.calls
    beside = [(limit, wait) for limit, wait, others in gateway.calls if others]
    assert beside and all(wait == 0 for _, wait in beside), gateway.calls
    assert all(1 <= limit <= CLAIM_LIMIT for limit, _, _ in gateway.calls)
    counts = (summary["claimed"], summary["finished"], summary["abandoned"], summary["settle_errors"])
    assert counts == (1000, 1000, 0, 0)
    assert sorted(gateway.settled, key=int) == [str(i) for i in range(1000)]


def test_an_empty_inbox_costs_one_long_poll_at_a_time():
    """A claim that comes back short (the queue is drained) sends no second claim beside the
    next long-poll: an idle worker holds one of the server's long-poll slots, not two."""
    gateway = ScriptedGateway(total=0)
    gateway.beside.set()  # nothing to wait for
    worker = RemoteWorker(gateway, lambda d: None, concurrency=8, wait_seconds=0.05, idle_exit=0.5)  # type: ignore[arg-type]
    summary = worker.run()
    assert summary["reason"] == "idle_exit" and summary["claimed"] == 0
    assert len(gateway.calls) >= 2 and gateway.most_in_flight == 1, gateway.calls


def test_a_settle_batch_without_an_answer_or_refused_for_load_is_sent_again_not_left_to_lapse(monkeypatch):
    """Issue 29: two drains of 90,000 ended 100 and 62 short. A settle batch that got no answer
    (a timeout, a dropped connection) or a 429/503 used to count as ``settle_errors`` and leave
    its leases to lapse: with the workers gone idle, nobody settled those deliveries. It is now
    sent again (a repeat of one that took effect is answered ``already_terminal``); a refusal
    that is not transient (a 409, a 500) is not."""
    import httpx

    from buzz_delivery.gateway import client as module
    from buzz_delivery.gateway.client import GatewayHTTPError, _Result

    monkeypatch.setattr(module, "SETTLE_RETRY_DELAY", 0.0, raising=False)
    for failures, settled in (
        ([GatewayHTTPError(503, "unavailable", "retry later")], 3),
        ([httpx.ReadTimeout("no answer"), GatewayHTTPError(429, "too_many_requests", "")], 3),
        ([GatewayHTTPError(500, "internal", "")], 0),
    ):

        class Flaky:
            def __init__(self, failures: list[Exception]) -> None:
                self.sent, self.failures = 0, failures

            def settle_many(self, settles):
                self.sent += 1
                if self.failures:
                    raise self.failures.pop(0)
                return [RemoteOutcome("settled", status="finished") for _ in settles]

        client = Flaky(list(failures))
        worker = RemoteWorker(client, lambda d: None)  # type: ignore[arg-type]
        leases = [RemoteLease("c1", d, 1, FAR) for d in "abc"]
        for lease in leases:
            worker._held[lease.delivery_id] = lease
        worker._settle([_Result(lease, "finished", None, None, None) for lease in leases])
        assert (worker._counts["finished"], worker._counts["settle_errors"]) == (settled, 3 - settled), failures
        assert client.sent == (len(failures) + 1 if settled else 1)
        assert worker._held == {}


class SlowFirstSettle(ScriptedGateway):
    """The first settle batch is answered only once a second one is in flight beside it (10 s
    at most: the worker with one settle in flight at a time)."""

    def __init__(self, total: int) -> None:
        super().__init__(total)
        self.beside.set()  # claims are answered at once
        self.settles_in_flight = 0
        self.most_settles_in_flight = 0
        self.settle_beside = threading.Event()
        self.batches = 0

    def settle_many(self, settles) -> list[RemoteOutcome]:
        with self.lock:
            first = self.batches == 0
            self.batches += 1
            if self.settles_in_flight:
                self.settle_beside.set()
            self.settles_in_flight += 1
            self.most_settles_in_flight = max(self.most_settles_in_flight, self.settles_in_flight)
        try:
            if first:
                self.settle_beside.wait(10)
            return super().settle_many(settles)
        finally:
            with self.lock:
                self.settles_in_flight -= 1


def test_a_second_settle_batch_is_sent_while_the_first_is_answered():
    gateway = SlowFirstSettle(total=600)
    worker = RemoteWorker(gateway, lambda d: None, concurrency=8, wait_seconds=0.2, idle_exit=0.5)  # type: ignore[arg-type]
    summary = worker.run()
    assert gateway.most_settles_in_flight == 2
    assert (summary["finished"], summary["settle_errors"], summary["abandoned"]) == (600, 0, 0)
    assert sorted(gateway.settled, key=int) == [str(i) for i in range(600)]


def test_a_claim_answered_after_the_claimers_join_is_worked_and_settled_not_held_through_the_grace(monkeypatch):
    """A claim still in flight when the stop's join of the claimers gives up (its long-poll, a
    resend) used to come back to a shut-down handler pool: ``pool.submit`` raised, its claims
    stayed held, neither worked nor released, and ``run()`` waited the whole ``shutdown_grace``
    before counting them ``abandoned`` (an internal error besides). The pool now outlives the
    drain: the late claim is worked and settled, and the stop ends as soon as it is."""
    from buzz_delivery.gateway import client as module

    draining = threading.Event()  # run()'s join of the claimers gave up: it drains

    class Pool(module.ThreadPoolExecutor):
        def shutdown(self, wait=True, *, cancel_futures=False):
            draining.set()
            super().shutdown(wait, cancel_futures=cancel_futures)

    class Clock:
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds: float) -> None:
            draining.set()
            time.sleep(seconds)

    monkeypatch.setattr(module, "time", Clock)
    monkeypatch.setattr(module, "ThreadPoolExecutor", Pool)

    class LateClaim(ScriptedGateway):
        timeout = 0.0  # the join waits wait_seconds + timeout + 5 s

        def claim(self, limit, *, wait_seconds=0, lease_seconds=None):
            with self.lock:
                self.calls.append((limit, wait_seconds, self.in_flight))
                if len(self.calls) > 1:
                    return []
            worker.request_stop("SIGTERM")  # a stop while this claim is answered
            assert draining.wait(30)
            return [RemoteClaim({"id": "d1", "step_id": "ok"}, RemoteLease("c1", "d1", 1, FAR))]

    gateway = LateClaim(total=0)
    worker = RemoteWorker(gateway, lambda d: None, wait_seconds=0, shutdown_grace=600)  # type: ignore[arg-type]
    began = time.monotonic()
    summary = worker.run()
    assert (summary["claimed"], summary["finished"], summary["abandoned"]) == (1, 1, 0), summary
    assert (summary["reason"], summary["exit_code"]) == ("SIGTERM", 0), summary
    assert gateway.settled == ["d1"]
    # Not the 600 s grace: 60 s leaves a loaded machine room.
    assert time.monotonic() - began < 60, "the stop waited the shutdown grace out"


def test_run_left_by_an_exception_stops_its_claimers_and_returns_without_waiting_the_grace():
    """``run()`` left by an exception before any stop (a ``KeyboardInterrupt`` where no signal
    handler is installed, a claimer that cannot start): the drain waits while a claimer is alive
    (8bd20c4), so it must stop them first, or they go on claiming through the whole
    ``shutdown_grace`` (and past it, into a pool already shut down)."""

    class Interrupted(threading.Event):
        def wait(self, timeout=None):
            if threading.current_thread() is threading.main_thread():
                raise KeyboardInterrupt
            return super().wait(timeout)

    gateway = ScriptedGateway(total=0)
    gateway.beside.set()  # nothing to wait for
    worker = RemoteWorker(gateway, lambda d: None, wait_seconds=0.05, shutdown_grace=600)  # type: ignore[arg-type]
    worker.stop = Interrupted()
    began = time.monotonic()
    with contextlib.suppress(KeyboardInterrupt):
        worker.run()
    # Not the 600 s grace: 60 s leaves a loaded machine room.
    assert time.monotonic() - began < 60, "the drain waited the shutdown grace for claimers never told to stop"
    assert worker.stop.is_set()
    calls = len(gateway.calls)
    time.sleep(0.3)
    assert len(gateway.calls) == calls, "a claimer still claims after run() returned"


def test_a_lingering_settler_whose_wake_another_settler_took_sends_its_batch_at_its_deadline(monkeypatch):
    """The stall this module met twice in CI under load: a drain held finished deliveries through
    the whole 30 s grace (``abandoned``) and they were settled only when the settlers were told
    to end. A settler lingering for more results waited in ``SimpleQueue.get(timeout=...)``; in
    CPython 3.12 and before a put wakes that wait by releasing the queue's lock, and when the other
    settler took the item before the woken one got the GIL, the woken one found the queue empty,
    its deadline past, and waited again with a negative timeout: forever, until the next put. With
    the last result queued, its batch stayed unsent until the drain's end-of-settles markers.
    Here the other settler is the test: the switch interval keeps the GIL with whoever holds it
    until it blocks, so the interleaving is certain."""
    from buzz_delivery.gateway import client as module
    from buzz_delivery.gateway.client import _Result

    monkeypatch.setattr(module, "SETTLE_LINGER", 0.3)
    gateway = ScriptedGateway(total=0)
    worker = RemoteWorker(gateway, lambda d: None)  # type: ignore[arg-type]
    leases = {d: RemoteLease("c1", d, 1, FAR) for d in ("a", "b")}
    worker._held.update(leases)
    results = worker._results

    class Watched:
        """The worker's queue, telling when a settler begins to linger in it."""

        lingering = threading.Event()

        def put(self, item):
            results.put(item)

        def get(self, block=True, timeout=None):
            if timeout is not None:
                self.lingering.set()  # the next thing this thread does is wait in the queue
            return results.get(block, timeout)

    watched = Watched()
    worker._results = watched  # type: ignore[assignment]
    settler = threading.Thread(target=worker._settle_loop, name="test-settler", daemon=True)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(100)  # a thread keeps the GIL until it blocks
    try:
        settler.start()
        watched.put(_Result(leases["a"], "finished", None, None, None))
        assert watched.lingering.wait(10)  # returns once the settler waits in the queue (GIL free)
        watched.put(_Result(leases["b"], "finished", None, None, None))  # wakes it: it waits for the GIL
        until = time.monotonic() + 0.5
        while time.monotonic() < until:  # past the settler's linger, the GIL held
            pass
        taken = results.get_nowait()  # the other settler takes "b" first
    finally:
        sys.setswitchinterval(switch)
    assert taken.lease.delivery_id == "b"
    began = time.monotonic()
    while gateway.settled != ["a"] and time.monotonic() - began < 5:
        time.sleep(0.01)
    settled_in_time = list(gateway.settled)
    watched.put(None)  # what the drain does at the end of its grace
    settler.join(5)
    assert settled_in_time == ["a"], "the lingering settler held its batch until the next put"
    assert "a" not in worker._held
