"""A step batch the gateway answers 503 or 429 is sent again (issue 29): such a request ran in one
transaction with its event id and kept nothing (docs/gateway.md, "Replay"), so its runs are not
failed and their leases not left to lapse for a passing database error. Other batches (``fail``,
compensations: not one transaction) are not sent again. The gateway client is a stand-in."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from buzz_delivery.gateway import remote_runs
from buzz_delivery.gateway.client import GatewayHTTPError, RunOutcome
from buzz_delivery.gateway.remote_runs import RunBatcher

ANSWER = {"calls": "journaled", "results": "recorded", "complete": "finished", "fail": "finished"}


@dataclass(frozen=True)
class Lease:
    run_id: str
    community_id: str = "c"
    worker_id: str = "w"
    lease_generation: int = 1


class Flaky:
    """Refuses the first ``refusals`` requests with ``status``, then answers every item."""

    def __init__(self, status: int, refusals: int, code: str | None = None) -> None:
        self.status, self.refusals, self.requests = status, refusals, []
        self.code = code or {429: "too_many_requests", 503: "unavailable"}[status]

    def _refuse(self, route: str) -> None:
        self.requests.append(route)
        if len(self.requests) <= self.refusals:
            raise GatewayHTTPError(self.status, self.code, "retry later")

    def run_batch(self, action, items):
        self._refuse(action)
        return [RunOutcome(ANSWER[action], {}) for _ in items]

    def run_steps(self, items):
        self._refuse("steps")
        return {kind: [RunOutcome(ANSWER[kind], {}) for _ in pairs] for kind, pairs in items.items()}


def _send_all(batcher: RunBatcher, sends: list[tuple[str, str]]) -> list[object]:
    boxes: list[list[object]] = [[] for _ in sends]

    def one(box: list[object], action: str, run_id: str) -> None:
        try:
            box.append(batcher.send(action, Lease(run_id), {}))
        except Exception as exc:
            box.append(exc)

    threads = [threading.Thread(target=one, args=(box, *s), daemon=True) for box, s in zip(boxes, sends, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return [box[0] if box else None for box in boxes]


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch):
    monkeypatch.setattr(remote_runs, "AGAIN_BACKOFF", 0.001)


@pytest.mark.parametrize("status", [503, 429])
def test_a_step_batch_answered_503_or_429_is_sent_again_and_its_runs_get_their_answers(status):
    client = Flaky(status, refusals=2)
    batcher = RunBatcher(client, linger=0.5)
    try:
        batcher.expect(["r1", "r2"])
        answers = _send_all(batcher, [("calls", "r1"), ("results", "r2")])
    finally:
        batcher.close()
    assert [getattr(a, "outcome", a) for a in answers] == ["journaled", "recorded"]
    assert client.requests == ["steps", "steps", "steps"]


def test_a_step_batch_still_refused_after_the_retries_raises_in_its_runs():
    client = Flaky(503, refusals=10)
    batcher = RunBatcher(client)
    try:
        (answer,) = _send_all(batcher, [("complete", "r1")])
    finally:
        batcher.close()
    assert isinstance(answer, GatewayHTTPError) and answer.status == 503
    assert client.requests == ["complete"] * (1 + remote_runs.AGAIN_TIMES)


def test_a_fail_batch_answered_503_is_not_sent_again():
    client = Flaky(503, refusals=1)
    batcher = RunBatcher(client)
    try:
        (answer,) = _send_all(batcher, [("fail", "r1")])
    finally:
        batcher.close()
    assert isinstance(answer, GatewayHTTPError) and answer.status == 503
    assert client.requests == ["fail"]


def test_a_step_batch_answered_503_by_a_proxy_is_not_sent_again():
    # Not the gateway's JSON: a proxy's page (Envoy answers 503 for an upstream reset before the
    # headers, which may come after the gateway committed the batch): sending it again could
    # journal its calls twice.
    client = Flaky(503, refusals=1, code="not_json")
    batcher = RunBatcher(client)
    try:
        (answer,) = _send_all(batcher, [("calls", "r1")])
    finally:
        batcher.close()
    assert isinstance(answer, GatewayHTTPError) and answer.status == 503
    assert client.requests == ["calls"]
