"""The remote run worker keeps its runs in step (issue 29): the batcher waits (up to its linger)
for the runs it just answered or the claimer just handed out, by run id, so the runs of a worker
do not split into cohorts that each send their own request of every step; and the claimer
claims once for the slots of the runs that ended together. The gateway client here is a
stand-in that records each request; the routes themselves are tested against a real gateway in
``test_batch_runs.py`` and ``test_batch_steps.py``."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from buzz_delivery.gateway.client import RemoteRunClaim, RunOutcome
from buzz_delivery.gateway.remote_runs import RemoteRunWorker, RunBatcher

SEQ = {"seq": 1, "idempotency_key": "k"}  # a journaled call's answer (the others ignore it)
ANSWER = {"calls": "journaled", "results": "recorded", "complete": "finished", "fail": "finished"}


@dataclass(frozen=True)
class Lease:
    run_id: str
    community_id: str = "c"
    worker_id: str = "w"
    lease_generation: int = 1
    lease_until: str = "2100-01-01T00:00:00+00:00"


class Recording:
    """Answers every batch in full and records its runs; the first request waits at ``gate``."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.gated = threading.Event()
        self.lock = threading.Lock()

    def _answer(self, kind: str, items) -> list[RunOutcome]:
        with self.lock:
            first = not self.batches
            self.batches.append([lease.run_id for lease, _ in items])
        if first:
            self.gated.set()
            assert self.gate.wait(10)
        return [RunOutcome(ANSWER[kind], SEQ) for _ in items]

    def run_batch(self, action, items):
        return self._answer(action, items)

    def run_steps(self, items):
        pairs = [pair for kind_items in items.values() for pair in kind_items]
        with self.lock:
            self.batches.append([lease.run_id for lease, _ in pairs])
        return {kind: [RunOutcome(ANSWER[kind], SEQ) for _ in kind_items] for kind, kind_items in items.items()}


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + 60  # generous: a loaded CI is slow, never wrong
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_a_flush_waits_for_the_runs_the_last_one_answered_though_other_runs_sent_meanwhile():
    # Run a is in flight; b and c queue behind it. When a is answered and sends its next step at
    # once, the next request carries a, b and c: the sends of b and c must not count as a's.
    client = Recording()
    batcher = RunBatcher(client, linger=600.0, expected_for=900.0)
    done: list[object] = []

    def run_a() -> None:
        batcher.send("calls", Lease("a"), {})
        done.append(batcher.send("results", Lease("a"), {}))

    def other(run_id: str) -> None:
        done.append(batcher.send("calls", Lease(run_id), {}))

    try:
        threading.Thread(target=run_a, daemon=True).start()
        assert client.gated.wait(10)
        for run_id in ("b", "c"):
            threading.Thread(target=other, args=(run_id,), daemon=True).start()
        _wait(lambda: batcher._queue.qsize() >= 2, "b and c queued")
        started = time.monotonic()
        client.gate.set()
        _wait(lambda: len(done) == 3, "every run answered")
        waited = time.monotonic() - started
    finally:
        batcher.close()
    assert client.batches == [["a"], ["b", "c", "a"]]
    # A flush that counted b's and c's sends as a's would linger its whole 600 s for a: answered
    # at once, the three take a few thread switches, not 60 s even on a loaded machine.
    assert waited < 60, f"the flush waited {waited:.2f}s: a had sent, nothing more was expected"


def test_runs_just_claimed_send_their_first_steps_in_one_request():
    client = Recording()
    client.gate.set()
    batcher = RunBatcher(client, linger=20.0, expected_for=30.0)
    done: list[object] = []
    try:
        batcher.expect(["r1", "r2", "r3"])
        for i, run_id in enumerate(("r1", "r2", "r3")):
            threading.Thread(
                target=lambda r=run_id: done.append(batcher.send("calls", Lease(r), {})), daemon=True
            ).start()
            time.sleep(0.02 * (i + 1))
        _wait(lambda: len(done) == 3, "every run answered")
    finally:
        batcher.close()
    assert [sorted(batch) for batch in client.batches] == [["r1", "r2", "r3"]]


def test_a_run_that_left_is_not_waited_for():
    client = Recording()
    client.gate.set()
    batcher = RunBatcher(client, linger=600.0, expected_for=900.0)
    done: list[object] = []
    try:
        batcher.expect(["r1", "r2"])
        threading.Thread(target=lambda: done.append(batcher.send("calls", Lease("r1"), {})), daemon=True).start()
        _wait(lambda: batcher._queue.qsize() == 0 and not done and len(batcher._awaited) == 1, "r1 taken")
        started = time.monotonic()
        batcher.leave("r2")
        _wait(lambda: done, "r1 answered")
        waited = time.monotonic() - started
    finally:
        batcher.close()
    # Waiting for r2 would be the whole 600 s linger: 60 s leaves a loaded machine room.
    assert waited < 60, f"r1 waited {waited:.2f}s for r2, which had left"
    assert client.batches == [["r1"]]


class Claims(Recording):
    """Also a gateway with ``total`` pending runs to claim; records each claim's limit."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self.gate.set()
        self.total, self.limits, self.claimed = total, [], 0

    def claim_runs(self, limit, *, wait_seconds=0, lease_seconds=None, worker_id=None):
        with self.lock:
            self.limits.append(limit)
            n = min(limit, self.total - self.claimed)
            ids = [f"run{self.claimed + i}" for i in range(n)]
            self.claimed += n
        if not ids:
            time.sleep(0.05)
        run = {"input": {}, "unwinding": False, "tool_calls_used": 0, "output_chunks": 0}
        return [RemoteRunClaim(run, Lease(run_id)) for run_id in ids]

    def heartbeat_runs(self, leases, lease_seconds=None):
        return [RunOutcome("renewed", {}, lease=lease) for lease in leases]


def _two_calls(ctx):
    for i in range(2):
        ctx.call("noop", lambda args, key: {"ok": True}, {"i": i})
    return {"done": True}


def test_the_claimer_claims_once_for_the_slots_of_runs_that_ended_together():
    client = Claims(total=12)
    worker = RemoteRunWorker(client, _two_calls, concurrency=4, wait_seconds=0, idle_exit=0.3, accept=False,
                             linger=5.0)  # fmt: skip
    summary = worker.run()
    assert summary["completed"] == 12, summary
    assert client.limits[:3] == [4, 4, 4], client.limits
    assert all(len(batch) == 4 for batch in client.batches), client.batches
