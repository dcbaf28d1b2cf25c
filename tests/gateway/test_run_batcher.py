"""The remote run worker's batcher (``RunBatcher``) never leaves a run thread waiting: whatever a
batch's answer is, every run of it gets a result or an error, and the batcher goes on serving
the next batches. The gateway client here is a stand-in that answers one outcome short once
(a proxy or a version mismatch); the requests themselves are tested against a real gateway in
``test_batch_runs.py``."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from buzz_delivery.gateway.client import RunOutcome
from buzz_delivery.gateway.remote_runs import RunBatcher


@dataclass
class Lease:
    run_id: str
    community_id: str = "c"
    worker_id: str = "w"
    lease_generation: int = 1


class ShortOnce:
    """Answers the first batch with one outcome fewer than it has runs, later ones in full."""

    def __init__(self) -> None:
        self.batches = 0

    def run_batch(self, action, items):
        self.batches += 1
        n = len(items) - 1 if self.batches == 1 else len(items)
        return [RunOutcome("journaled", {}) for _ in range(n)]


def _send(batcher: RunBatcher, run_id: str) -> list[object]:
    """``send`` of one run in a thread of its own: its answer or error, or nothing if it never
    returned within 10 s (a run thread left waiting)."""
    box: list[object] = []

    def run() -> None:
        try:
            box.append(batcher.send("calls", Lease(run_id), {}))
        except Exception as exc:
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    return box


def test_a_batch_answered_with_the_wrong_number_of_outcomes_fails_its_runs_and_the_batcher_goes_on():
    batcher = RunBatcher(ShortOnce())
    try:
        (first,) = _send(batcher, "r1") or [None]
        assert isinstance(first, RuntimeError), f"the first run's send: {first!r} (None: it never returned)"
        assert "0 outcomes to a batch of 1" in str(first)
        (second,) = _send(batcher, "r2") or [None]
        assert isinstance(second, RunOutcome) and second.outcome == "journaled", second
    finally:
        batcher.close(timeout=1)


class OlderGateway:
    """A gateway without the batch route of ``fail``: its read route answers 405 (a one-run
    batch included); the one-run route answers."""

    def __init__(self) -> None:
        self.singles: list[tuple[str, str]] = []

    def run_batch(self, action, items):
        from buzz_delivery.gateway.client import GatewayHTTPError

        raise GatewayHTTPError(405, "method_not_allowed", "use GET for this route")

    def _run_post(self, lease, action, **body):
        self.singles.append((lease.run_id, action))
        return RunOutcome("finished", {"state": "failed"})


def test_a_batch_route_the_gateway_lacks_is_sent_again_one_run_per_request():
    client = OlderGateway()
    batcher = RunBatcher(client)
    try:
        box: list[object] = []
        thread = threading.Thread(target=lambda: box.append(batcher.send("fail", Lease("r1"), {"failure_code": "x"})))
        thread.start()
        thread.join(10)
        (outcome,) = box
        assert isinstance(outcome, RunOutcome) and outcome.outcome == "finished", outcome
        assert client.singles == [("r1", "fail")]
    finally:
        batcher.close()


class NoStepsGateway:
    """A gateway older than the steps route (its read route answers 405); the per-kind batch
    routes answer."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.gate = threading.Event()

    def run_steps(self, items):
        from buzz_delivery.gateway.client import GatewayHTTPError

        self.requests.append("steps")
        raise GatewayHTTPError(405, "method_not_allowed", "use GET for this route")

    def run_batch(self, action, items):
        self.requests.append(action)
        if len(self.requests) == 1:
            assert self.gate.wait(10)
        return [RunOutcome({"calls": "journaled", "results": "recorded"}[action], {}) for _ in items]


def _mixed_flush(batcher: RunBatcher, client: NoStepsGateway, first: str) -> list[list[object]]:
    """A ``calls`` and a ``results`` of two runs flushed together: queued behind run ``first``'s
    ``calls``, held at the client's gate."""
    boxes: list[list[object]] = []

    def send(action: str, run_id: str) -> None:
        box: list[object] = []
        boxes.append(box)
        threading.Thread(target=lambda: box.append(batcher.send(action, Lease(run_id), {})), daemon=True).start()

    deadline = time.monotonic() + 10
    send("calls", first)
    while not client.requests:  # held at the gate
        assert time.monotonic() < deadline
        time.sleep(0.001)
    send("calls", f"{first}-a")
    send("results", f"{first}-b")
    while batcher._queue.qsize() < 2:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    client.gate.set()
    while not all(boxes) and time.monotonic() < deadline:
        time.sleep(0.001)
    return boxes


def test_a_gateway_without_the_steps_route_gets_the_per_kind_requests_and_is_not_asked_again():
    client = NoStepsGateway()
    batcher = RunBatcher(client)
    try:
        boxes = _mixed_flush(batcher, client, "r0")
        assert [box[0].outcome for box in boxes] == ["journaled", "journaled", "recorded"], boxes
        assert client.requests == ["calls", "steps", "calls", "results"]
        assert batcher.steps is False
        client.requests.clear()
        client.gate.clear()
        boxes = _mixed_flush(batcher, client, "r1")
        assert [box[0].outcome for box in boxes] == ["journaled", "journaled", "recorded"], boxes
        assert client.requests == ["calls", "calls", "results"]  # no steps request again
    finally:
        batcher.close()
