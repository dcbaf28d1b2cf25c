"""Built-in acceptance for the gateway's remote agent-run worker (``work-runs``, issue 29): the
deliveries addressed to the key are claimed in batches (``POST /deliveries/claim``, long-poll)
and each is accepted into an agent run (``POST .../deliveries/{d}/accept``: the delivery settled
``finished`` and its run created in one transaction on the server), so a workflow whose
``send_message`` step awaits agent runs completes with ``work-runs`` alone on the agent's side.

Needs no Django. Do not also run ``work`` (the remote delivery worker) with the same key: both
would claim its deliveries. ``work-runs --no-accept`` turns this off.

One delivery never stops the worker: an error accepting it (past the resends of a 503 or 429 of
the gateway's own, :data:`ACCEPT_AGAIN`) is logged and counted, the delivery is settled
``retry`` (its backoff and attempt cap apply; if that fails too, its lease lapses and the
server's reaper reclaims it), and the loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from buzz_delivery import backoff
from buzz_delivery.gateway.client import (
    CLAIM_RETRY_BASE,
    CLAIM_RETRY_MOST,
    GatewayClient,
    GatewayHTTPError,
    RemoteClaim,
    RunOutcome,
    claim_retry_wait,
    describe,
)

logger = logging.getLogger("buzz_delivery.gateway.remote_runs")

DEFAULT_BATCH = 50
# An accept the gateway itself refused for load (429: before any write) or answered 503
# ``unavailable`` (its one transaction could not commit: nothing kept; a deadlock's victim, a
# lock or statement timeout, a terminated backend) is sent again, signed anew, this many times
# in all, backing off from ACCEPT_BACKOFF seconds (at most ACCEPT_MOST, whatever a Retry-After
# asks: the delivery's lease keeps running). Settling ``retry`` at once spent one of the
# delivery's attempts for a passing error: on its last, the delivery ended
# ``failed``/``attempts_exhausted``, no run created. A repeat of an accept that did commit is
# answered ``already_terminal`` (the holder's own retry): nothing is done twice.
ACCEPT_AGAIN = ((429, "too_many_requests"), (503, "unavailable"))
ACCEPT_TRIES = 4
ACCEPT_BACKOFF = 0.2
ACCEPT_MOST = 5.0


def _accept(client: GatewayClient, claim: RemoteClaim) -> RunOutcome:
    for attempt in range(ACCEPT_TRIES):
        try:
            return client.accept(claim.lease)
        except GatewayHTTPError as exc:
            if (exc.status, exc.code) not in ACCEPT_AGAIN or attempt == ACCEPT_TRIES - 1:
                raise
            logger.warning("accept_again delivery=%s attempt=%d: %s", claim.lease.delivery_id, attempt + 1, exc)
            time.sleep(backoff.again_delay(ACCEPT_BACKOFF, attempt, exc.retry_after, most=ACCEPT_MOST))
    raise AssertionError("unreachable")


def accept_remote_claim(client: GatewayClient, claim: RemoteClaim) -> str:
    """Accept one claimed delivery: ``accepted``, ``run_ended``, ``missed`` or ``errors``."""
    try:
        outcome = _accept(client, claim)
    except Exception as exc:  # the gateway refused it or went away: retry it later
        logger.warning("accept_error delivery=%s: %s", claim.lease.delivery_id, describe(exc))
        try:
            client.finish(claim.lease, "retry", failure_message=f"accept_error: {describe(exc)}"[:10_000])
        except Exception as again:
            logger.warning("accept_retry_error delivery=%s: %s", claim.lease.delivery_id, describe(again))
        return "errors"
    if outcome.outcome == "accepted":
        logger.info("accepted delivery=%s run=%s", claim.lease.delivery_id, outcome.data.get("run_id"))
        return "accepted"
    return "run_ended" if outcome.outcome == "run_ended" else "missed"


class RemoteAcceptor(threading.Thread):
    """Claims up to ``batch`` of the key's deliveries (long-poll ``wait_seconds``) and accepts
    each, until ``stop`` is set; ``on_work()`` is called after each batch that created runs.
    :attr:`counts` holds ``claimed``, ``accepted``, ``run_ended``, ``missed``, ``errors`` (deliveries
    whose accept failed) and ``claim_errors`` (claim requests that failed: no delivery)."""

    def __init__(
        self,
        client: GatewayClient,
        *,
        stop: threading.Event,
        batch: int = DEFAULT_BATCH,
        wait_seconds: float = 5.0,
        lease_seconds: float | None = None,
        on_work: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name="run-acceptor", daemon=True)
        self.client, self.stop_event, self.batch = client, stop, batch
        self.wait_seconds, self.lease_seconds, self.on_work = wait_seconds, lease_seconds, on_work
        self.counts: Counter[str] = Counter()

    def run(self) -> None:
        retrying = backoff.Retrying(CLAIM_RETRY_BASE, CLAIM_RETRY_MOST)
        while not self.stop_event.is_set():
            try:
                claims = self.client.claim(self.batch, wait_seconds=self.wait_seconds, lease_seconds=self.lease_seconds)
            except Exception as exc:  # unreachable or refused: try again later (backoff, as the runs' claims)
                logger.warning("accept_claim_error: %s", describe(exc))
                self.counts["claim_errors"] += 1  # no delivery was claimed: not an accept error
                self.stop_event.wait(claim_retry_wait(retrying, exc, None))
                continue
            retrying.reset()
            self.counts["claimed"] += len(claims)
            for claim in claims:
                self.counts[accept_remote_claim(self.client, claim)] += 1
            if claims and self.on_work is not None:
                self.on_work()
