"""Backoff that listens, in the gateway's client (issue 29): a refused request's ``Retry-After``
is read from the response and the client's resends (a settle batch of ``work``, a step batch of
``work-runs``) wait at least that long, capped below the leases they serve; without one they
back off exponentially with jitter, as every other layer does (``buzz_delivery.backoff``)."""

from __future__ import annotations

import time

import pytest

from buzz_delivery import backoff
from buzz_delivery.gateway import client as client_module
from buzz_delivery.gateway import remote_runs
from buzz_delivery.gateway.client import GatewayClient, GatewayHTTPError, RemoteLease, RemoteOutcome, RemoteWorker
from buzz_delivery.gateway.remote_runs import RunBatcher
from tests.gateway.fake_server import Reply, fake_gateway

FAR = "2999-01-01T00:00:00+00:00"


class Sleeps:
    """A stand-in for a module's ``time``: records ``sleep`` (and sleeps a millisecond), the rest is ``time``'s."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def __getattr__(self, name: str):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        time.sleep(0.001)


@pytest.fixture
def refusing_server():
    """A real HTTP server answering every request 429 with the Retry-After the test sets (None: no header)."""
    state: dict[str, str | None] = {"retry_after": None}

    def answer(path: str) -> Reply:
        headers = {} if state["retry_after"] is None else {"Retry-After": state["retry_after"]}
        return 429, {"code": "too_many_requests", "message": "slow down"}, headers

    with fake_gateway(get=answer) as url:
        yield url, state


@pytest.mark.parametrize(
    ("header", "expected"),
    [("3", 3.0), (" 0.5 ", 0.5), ("Wed, 21 Oct 2037 07:28:00 GMT", None), ("-1", None), ("nan", None), (None, None)],
)
def test_a_refusal_carries_the_responses_retry_after_when_it_is_a_usable_number_of_seconds(
    refusing_server, header, expected
):
    url, state = refusing_server
    state["retry_after"] = header
    client = GatewayClient(url, bytes(range(1, 33)))
    try:
        with pytest.raises(GatewayHTTPError) as raised:
            client.me()
    finally:
        client.close()
    assert (raised.value.status, raised.value.code, raised.value.retry_after) == (429, "too_many_requests", expected)


def test_the_resend_delay_is_jittered_exponential_and_a_longer_retry_after_wins_up_to_the_cap():
    for attempt in range(4):
        delays = [backoff.again_delay(0.2, attempt, most=60) for _ in range(200)]
        assert all(0.1 * 2**attempt <= d <= 0.2 * 2**attempt for d in delays)
        assert len(set(delays)) > 1  # jittered, not one fixed value
    assert backoff.again_delay(0.2, 0, 3.0, most=60) == 3.0
    assert backoff.again_delay(0.2, 0, 30.0, most=5) == 5
    assert 0.1 <= backoff.again_delay(0.2, 0, 0.01, most=60) <= 0.2  # a shorter one does not shorten the backoff


def test_a_settle_batch_refused_with_retry_after_is_sent_again_no_sooner(monkeypatch):
    sleeps = Sleeps()
    monkeypatch.setattr(client_module, "time", sleeps)

    class Refusing:
        def __init__(self) -> None:
            self.sent = 0

        def settle_many(self, settles):
            self.sent += 1
            if self.sent == 1:
                raise GatewayHTTPError(429, "too_many_requests", "slow down", retry_after=2.5)
            return [RemoteOutcome("settled", status="finished") for _ in settles]

    gateway = Refusing()
    worker = RemoteWorker(gateway, lambda d: None)  # type: ignore[arg-type]
    lease = RemoteLease("c1", "d1", 1, FAR)
    worker._held[lease.delivery_id] = lease
    worker._settle([client_module._Result(lease, "finished", None, None, None)])
    assert gateway.sent == 2 and worker._counts["finished"] == 1
    assert sleeps.slept == [2.5]


def test_a_step_batch_refused_with_retry_after_is_sent_again_no_sooner_and_never_past_the_cap(monkeypatch):
    sleeps = Sleeps()
    monkeypatch.setattr(remote_runs, "time", sleeps)
    answers = [
        GatewayHTTPError(429, "too_many_requests", "", retry_after=1.5),
        GatewayHTTPError(429, "too_many_requests", "", retry_after=600.0),
        GatewayHTTPError(503, "unavailable", ""),
    ]

    class Refusing:
        def __init__(self) -> None:
            self.sent = 0

        def run_batch(self, action, items):
            self.sent += 1
            if answers:
                raise answers.pop(0)
            return [remote_runs.RunOutcome("finished", {}) for _ in items]

    gateway = Refusing()
    batcher = RunBatcher(gateway)  # type: ignore[arg-type]
    try:
        lease = client_module.RemoteRunLease("c1", "r1", 1, FAR, "w")
        outcome = batcher.send("complete", lease, {"output": None})
    finally:
        batcher.close()
    assert outcome.outcome == "finished" and gateway.sent == 4
    assert sleeps.slept[:2] == [1.5, remote_runs.AGAIN_MOST]
    assert remote_runs.AGAIN_BACKOFF * 2 * backoff.JITTER_LOW <= sleeps.slept[2] <= remote_runs.AGAIN_BACKOFF * 4
