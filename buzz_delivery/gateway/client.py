"""A small signing client of the gateway, and a remote delivery worker built on it.

Needs no Django: ``pip install buzz-delivery[gateway]`` on the agent's machine is enough.
HTTP goes through ``httpx`` (a pooled keep-alive client with per-request timeouts, which a
long-poll claim needs: its read timeout is the wait plus a margin).

``python -m buzz_delivery.gateway.client work --url URL --key-file FILE --handler pkg.mod:func``
behaves like ``manage.py run_delivery_worker`` over HTTP: it claims (long-poll) across every
community the key is enrolled in, runs the handler in ``--concurrency`` threads, renews held
leases in the background (in batches, below), settles by the handler's result, drains on
SIGTERM/SIGINT and prints one JSON summary line. The handler gets the delivery as the API's JSON
object (a dict); it returns -> ``finished``; raises an exception whose class has ``permanent = True`` (e.g.
:class:`PermanentFailure`), or a ``BaseException`` that is not an ``Exception`` (``SystemExit``,
``KeyboardInterrupt``) -> ``failed`` with the class name as ``failure_code``; raises anything
else -> ``retry``. The failure text is made storable (NUL and lone surrogates escaped, an
exception whose ``str()`` raises described); a settle the gateway refuses or cannot be sent
leaves that lease to lapse (``settle_errors``). Nothing about one delivery stops the worker;
an internal error does, with exit status 1.

Settles go in batches, whatever the result: two settler threads gather them (up to
``SETTLE_BATCH``, waiting at most ``SETTLE_LINGER`` seconds for more, ``SETTLE_LINGER_BESIDE``
beside a batch in flight) and each sends each
community's in one signed request (``POST /communities/{id}/deliveries/finish``), each lease
still fenced on its own and each with its own outcome, failure text and ``retry_after``; a batch
the gateway refuses as a whole (400/413, or 404/405 from a gateway without the route) is sent
again one delivery per request, as is a mixed batch a gateway older than per-delivery outcomes
refuses (400). A settled lease stays held, and renewed, until its batch is answered.

Renewals go in batches as well: every ``--renew-every`` seconds, one signed request per
community renews up to ``RENEW_BATCH`` held leases (``POST /communities/{id}/deliveries/renew``),
each fenced by its own generation; a batch refused as a whole is sent again one lease per request.

Claims go in batches too: one claim request asks for every free handler thread and, once
handlers have run, up to ``--claim-ahead`` more (default 100) that wait in a local queue, held and
renewed, only as many as the handlers' recent run times say start within a tenth of the lease
(at most a second), as ``run_delivery_worker`` does. A stop works and settles every claimed one.
"""

from __future__ import annotations

import argparse
import json
import logging
import pkgutil
import queue
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from buzz_delivery import backoff
from buzz_delivery.gateway import nip98
from buzz_delivery.tracing import http as tracing_http

logger = logging.getLogger("buzz_delivery.gateway.client")

SUMMARY_KEYS = (
    "claimed",
    "finished",
    "failed",
    "retried",
    "lease_lost",
    "renewed",
    "settle_errors",
    "errors",
    "abandoned",
)
# How long no claim must have got through before failed claims count as idle for --idle-exit
# (as run_agent_worker's polls of an unreachable database): a restart's gap is not a drained queue.
UNREACHABLE_IDLE_SECONDS = 5.0


# The longest a seconds option of ``work``/``work-runs`` may say (a day), as every worker's
# poll interval (services.validation.MAX_POLL_SECONDS; this module stays Django-free): 1e10 as
# ``--renew-every`` killed the renewer thread at its first wait (OverflowError), and NaN, 0 or a
# negative renewed in a busy loop, never exited (``--idle-exit``) or drained nothing.
MAX_OPTION_SECONDS = 86_400.0


def seconds_option(*, zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds > 0 (>= 0 with ``zero``), at most
    :data:`MAX_OPTION_SECONDS`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text[:80]!r}") from None
        low_ok = value >= 0 if zero else value > 0
        if not (low_ok and value <= MAX_OPTION_SECONDS):  # NaN fails this too
            low = ">= 0" if zero else "> 0"
            raise argparse.ArgumentTypeError(
                f"must be {low} and at most {MAX_OPTION_SECONDS:g} seconds, got {text[:80]}"
            )
        return value

    return parse


# The bounds the command line gives the workers' counts (``main``); a worker built in code is held
# to them too.
MAX_CONCURRENCY = 256
MAX_CLAIM_AHEAD = 1000
MAX_ACCEPT_BATCH = 1000


# A claim refused or left unanswered (a 429/503, the gateway down, the key not enrolled) is tried
# again after CLAIM_RETRY_BASE * 2**n seconds (n: failures in a row), at most CLAIM_RETRY_MOST,
# with equal jitter (backoff.Retrying), and never much past --idle-exit: before, every second,
# so a fleet of workers hammered a gateway that was shedding load or coming back up.
CLAIM_RETRY_BASE = 1.0
CLAIM_RETRY_MOST = 15.0


def claim_retry_wait(retrying: backoff.Retrying, exc: BaseException, idle_exit: float | None) -> float:
    """The wait before the next claim after ``exc``: :class:`backoff.Retrying`'s, honouring a
    Retry-After the refusal carried, and at most ``idle_exit`` (when set) so a worker that may
    stop (``--idle-exit``) is not held far past that moment by a long wait."""
    return retrying.delay(backoff.of(exc), most=idle_exit)


def checked_seconds(value: Any, name: str, *, zero: bool = False) -> float:
    """A worker's seconds parameter as its option is checked (:func:`seconds_option`): a real
    finite number > 0 (>= 0 with ``zero``) and at most :data:`MAX_OPTION_SECONDS`. Anything else
    raises ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    low_ok = seconds >= 0 if zero else seconds > 0
    if not (low_ok and seconds <= MAX_OPTION_SECONDS):  # NaN fails this too
        low = ">= 0" if zero else "> 0"
        raise ValueError(f"{name} must be {low} and at most {MAX_OPTION_SECONDS:g} seconds, got {value!r}")
    return seconds


def checked_count(value: Any, name: str, low: int, high: int | None = None) -> int:
    """A worker's count parameter: an int within ``low..high`` (no upper bound when None).
    Anything else raises ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bounds = f"within {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def checked_handler(handler: Any) -> None:
    """A worker's handler: callable, or ``ValueError`` naming ``handler``."""
    if not callable(handler):
        raise ValueError(f"handler must be callable, got {type(handler).__name__}")


def unreachable_for_long(reached: float) -> bool:
    """Whether no claim has got through since ``reached`` (monotonic) for :data:`UNREACHABLE_IDLE_SECONDS`."""
    return time.monotonic() - reached >= UNREACHABLE_IDLE_SECONDS


# Exit codes of ``work`` and ``work-runs``: a clean stop, an internal error (a thread that died,
# an error of the loop itself: see the summary's ``reason``), leases given up at the stop.
EXIT_OK, EXIT_ERROR, EXIT_ABANDONED = 0, 1, 3


class PermanentFailure(Exception):
    """Raise from a handler to settle ``failed`` instead of retrying (as in the core worker)."""

    permanent = True


class GatewayHTTPError(Exception):
    """The gateway refused a request: ``status``, the stable ``code``, ``field`` for a 400."""

    def __init__(
        self, status: int, code: str, message: str, field: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.field = status, code, field
        # The response's Retry-After (delay-seconds form) when it had a usable one: a 429's
        # "try again in n s", honoured by the client's resends (backoff.again_delay).
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class RemoteLease:
    """A lease held through the gateway: send it back to renew or finish."""

    community_id: str
    delivery_id: str
    lease_generation: int
    lease_until: str


@dataclass(frozen=True, slots=True)
class RemoteClaim:
    """A won claim: the delivery (the API's JSON object) and its lease."""

    delivery: dict[str, Any]
    lease: RemoteLease


@dataclass(frozen=True, slots=True)
class RemoteOutcome:
    """A renew or finish outcome: ``outcome`` is ``renewed``, ``settled``, ``already_terminal``
    or ``lease_lost``; ``status`` the recorded status of a settle; ``lease`` a renewed lease."""

    outcome: str
    status: str | None = None
    lease: RemoteLease | None = None


@dataclass(frozen=True, slots=True)
class RemoteSettle:
    """One settle of :meth:`GatewayClient.settle_many`: a lease and what ``finish`` would send."""

    lease: RemoteLease
    outcome: str
    failure_code: str | None = None
    failure_message: str | None = None
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class RemoteRunLease:
    """An agent-run lease held through the gateway (``worker_id`` is part of the fence)."""

    community_id: str
    run_id: str
    lease_generation: int
    lease_until: str
    worker_id: str


@dataclass(frozen=True, slots=True)
class RemoteRunClaim:
    """A won run claim: the run (the API's JSON object) and its lease."""

    run: dict[str, Any]
    lease: RemoteRunLease


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """An agent-run answer: ``outcome`` as the API names it (``lease_lost`` for a 409), the
    whole JSON body in ``data``, and a renewed ``lease`` for ``renewed``."""

    outcome: str
    data: dict[str, Any]
    lease: RemoteRunLease | None = None


def _run_lease(data: dict[str, Any]) -> RemoteRunLease:
    return RemoteRunLease(
        data["community_id"], data["run_id"], data["lease_generation"], data["lease_until"], data["worker_id"]
    )


def _lease(data: dict[str, Any]) -> RemoteLease:
    return RemoteLease(data["community_id"], data["delivery_id"], data["lease_generation"], data["lease_until"])


# Transport errors after which a request is sent again once, unchanged (see GatewayClient.request):
# the connection went away before an answer. Not a timeout: the gateway may still be working on it.
RESENT_ONCE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError)
# The resend's refusals that say nothing of the first copy: the id already used (the first reached
# the gateway), or refused before the gateway could tell (its database unavailable while it
# recorded the id, the event stale by now). Then the first's error stands, its outcome unknown:
# a 503 taken as the answer would have a step batch sent again signed anew, done twice.
NOT_AN_ANSWER = {(401, "auth_replayed"), (401, "auth_stale"), (503, "unavailable")}


def _error_code(response: httpx.Response) -> str | None:
    """The gateway's error ``code`` of ``response``, None when it is not the gateway's JSON."""
    try:
        data = response.json()
    except ValueError:
        return None
    return data.get("code") if isinstance(data, dict) else None


class GatewayClient:
    """Signs every request with ``private_key`` (32 bytes) as a fresh NIP-98 event.

    ``base_url``: the gateway's mount, e.g. ``http://127.0.0.1:8000/gateway/v1``. ``timeout``:
    seconds for every request except a long-poll claim, which waits its ``wait_seconds`` more.
    """

    def __init__(self, base_url: str, private_key: bytes, *, timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._key = private_key
        self.pubkey = nip98.public_key_of(private_key)
        self.timeout = timeout
        self._http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def request(self, method: str, path: str, payload: Any = None, *, extra_timeout: float = 0) -> httpx.Response:
        """Send one signed request (``payload`` as JSON, None = no body); returns the response as is."""
        body = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode("utf-8")
        url = self.base_url + path
        headers = {"Authorization": nip98.encode_header(nip98.sign_event(self._key, url, method, body))}
        if body:
            headers["Content-Type"] = "application/json"
        timeout = self.timeout + extra_timeout

        def send() -> httpx.Response:
            try:
                return self._http.request(method, url, content=body, headers=headers, timeout=timeout)
            except RESENT_ONCE as first:
                # A pooled keep-alive connection the server closed as it was reused (gunicorn
                # closes one idle for its --keep-alive, 2 s by default, and httpx does not send
                # again). The same signed bytes once more, on a fresh connection: the gateway
                # admits an event id once, so if the first reached it, this one is refused
                # ``auth_replayed`` and nothing is done twice; then (or on another refusal that
                # cannot tell, NOT_AN_ANSWER) the first's error stands (its outcome is unknown).
                logger.info("resending %s %s once: %s", method, path, describe(first))
                again = self._http.request(method, url, content=body, headers=headers, timeout=timeout)
                if again.status_code in (401, 503) and (again.status_code, _error_code(again)) in NOT_AN_ANSWER:
                    raise first
                return again

        # Tracing: a client span whose traceparent the headers carry; else send() itself.
        return tracing_http.client_request(method, path, headers, send)  # type: ignore[no-any-return]

    def _json(self, method: str, path: str, payload: Any = None, *, ok: tuple[int, ...] = (200,), **kw: Any) -> Any:
        response = self.request(method, path, payload, **kw)
        retry_after = backoff.header_seconds(response.headers.get("Retry-After"))
        try:
            data = response.json()
        except ValueError:  # not the gateway's JSON: a proxy's page, a route this server lacks
            # Say where it came from, on one line: the page's text alone (a 404 page's doctype,
            # over several log lines) did not tell a wrong --url from a proxy's error.
            text = " ".join(response.text[:200].split())
            raise GatewayHTTPError(
                response.status_code,
                "not_json",
                f"{method} {self.base_url + path} answered a {response.headers.get('Content-Type') or 'body'}"
                f" page, not the gateway's JSON (is the URL the gateway's mount, e.g. http://host:8000/gateway/v1?):"
                f" {text}",
                retry_after=retry_after,
            ) from None
        if response.status_code not in ok:
            raise GatewayHTTPError(
                response.status_code,
                data.get("code", "?"),
                data.get("message", ""),
                data.get("field"),
                retry_after=retry_after,
            )
        return data

    def me(self) -> dict[str, Any]:
        """``{"pubkey", "communities"}``: this key and where it is enrolled."""
        return self._json("GET", "/me")

    def claim(
        self, limit: int = 1, *, wait_seconds: float = 0, lease_seconds: float | None = None
    ) -> list[RemoteClaim]:
        """Claim up to ``limit`` deliveries, long-polling up to ``wait_seconds`` for the first."""
        data = self._json(
            "POST",
            "/deliveries/claim",
            {"limit": limit, "wait_seconds": wait_seconds, "lease_seconds": lease_seconds},
            extra_timeout=wait_seconds,
        )
        return [RemoteClaim(c["delivery"], _lease(c["lease"])) for c in data["claims"]]

    def send_event(self, community_id: str, name: str, key: str, payload: Any = None) -> dict[str, Any]:
        """Send a workflow event (``buzz_delivery.workflows`` installed): ``{"resumed", "kept_until"}``."""
        return self._json("POST", f"/communities/{community_id}/events", {"name": name, "key": key, "payload": payload})

    def read(self, community_id: str, delivery_id: str) -> dict[str, Any]:
        """One of this key's deliveries (raises ``GatewayHTTPError`` 404 otherwise)."""
        return self._json("GET", f"/communities/{community_id}/deliveries/{delivery_id}")["delivery"]

    def renew(self, lease: RemoteLease, lease_seconds: float | None = None) -> RemoteOutcome:
        """Extend the lease: ``renewed`` with the new lease, or ``lease_lost``."""
        path = f"/communities/{lease.community_id}/deliveries/{lease.delivery_id}/renew"
        data = self._json(
            "POST", path, {"lease_generation": lease.lease_generation, "lease_seconds": lease_seconds}, ok=(200, 409)
        )
        if "lease" in data:
            return RemoteOutcome("renewed", lease=_lease(data["lease"]))
        return RemoteOutcome("lease_lost")

    def renew_many(self, leases: list[RemoteLease], lease_seconds: float | None = None) -> list[RemoteOutcome]:
        """Extend many leases of one community in one request: one outcome per lease, in order
        (``renewed`` with the new ``lease``, ``lease_lost`` or ``not_found``)."""
        if not leases:
            return []
        community = leases[0].community_id
        if any(lease.community_id != community for lease in leases):
            raise ValueError("every lease of a batch must be of one community")
        body = {
            "deliveries": [{"delivery_id": x.delivery_id, "lease_generation": x.lease_generation} for x in leases],
            "lease_seconds": lease_seconds,
        }
        data = self._json("POST", f"/communities/{community}/deliveries/renew", body)
        if len(data["results"]) != len(leases):  # not the answer to this batch: no lease may take it
            raise ValueError(f"the gateway answered {len(data['results'])} outcomes to {len(leases)} leases")
        return [
            RemoteOutcome(r["outcome"], lease=_lease(r["lease"]) if r["outcome"] == "renewed" else None)
            for r in data["results"]
        ]

    def finish(
        self,
        lease: RemoteLease,
        outcome: str,
        *,
        failure_code: str | None = None,
        failure_message: str | None = None,
        retry_after: float | None = None,
    ) -> RemoteOutcome:
        """Settle once: ``settled`` / ``already_terminal`` with the recorded status, or
        ``lease_lost``. ``retry_after`` (with ``retry``): seconds before the next attempt at the
        earliest."""
        path = f"/communities/{lease.community_id}/deliveries/{lease.delivery_id}/finish"
        body: dict[str, Any] = {
            "lease_generation": lease.lease_generation,
            "outcome": outcome,
            "failure_code": failure_code,
            "failure_message": failure_message,
        }
        if retry_after is not None:
            body["retry_after"] = retry_after
        data = self._json("POST", path, body, ok=(200, 409))
        if data.get("code") == "lease_lost":
            return RemoteOutcome("lease_lost")
        return RemoteOutcome(data["outcome"], status=data["status"])

    def finish_many(
        self,
        leases: list[RemoteLease],
        outcome: str = "finished",
        *,
        failure_code: str | None = None,
        failure_message: str | None = None,
    ) -> list[RemoteOutcome]:
        """Settle many leases of one community in one request (``finished`` or ``failed``): one
        outcome per lease, in order (``settled``/``already_terminal`` with the status,
        ``lease_lost`` or ``not_found``)."""
        if not leases:
            return []
        path = f"/communities/{leases[0].community_id}/deliveries/finish"
        body = {
            "deliveries": [{"delivery_id": x.delivery_id, "lease_generation": x.lease_generation} for x in leases],
            "outcome": outcome,
            "failure_code": failure_code,
            "failure_message": failure_message,
        }
        data = self._json("POST", path, body)
        return [RemoteOutcome(r["outcome"], status=r.get("status")) for r in data["results"]]

    def settle_many(self, settles: list[RemoteSettle]) -> list[RemoteOutcome]:
        """Settle many leases of one community in one request, each with its own outcome
        (``finished``, ``failed`` or ``retry``), failure text and ``retry_after``: one outcome per
        settle, in order, as :meth:`finish_many` answers. The ``finished`` ones are sent as the
        request's outcome (a gateway older than per-delivery outcomes takes a batch of those and
        refuses any other with a 400)."""
        if not settles:
            return []
        community = settles[0].lease.community_id
        if any(x.lease.community_id != community for x in settles):
            raise ValueError("every lease of a batch must be of one community")
        items: list[dict[str, Any]] = []
        for x in settles:
            item: dict[str, Any] = {"delivery_id": x.lease.delivery_id, "lease_generation": x.lease.lease_generation}
            if x.outcome != "finished":
                item.update(outcome=x.outcome, failure_code=x.failure_code, failure_message=x.failure_message)
                if x.retry_after is not None:
                    item["retry_after"] = x.retry_after
            items.append(item)
        data = self._json(
            "POST", f"/communities/{community}/deliveries/finish", {"deliveries": items, "outcome": "finished"}
        )
        if len(data["results"]) != len(settles):  # not the answer to this batch: no lease may take it
            raise ValueError(f"the gateway answered {len(data['results'])} outcomes to {len(settles)} settles")
        return [RemoteOutcome(r["outcome"], status=r.get("status")) for r in data["results"]]

    # --- agent runs (served when buzz_delivery.agents is installed) ---------------------------

    def accept(self, lease: RemoteLease, **options: Any) -> RunOutcome:
        """Settle the held delivery and start its agent run: ``accepted`` (``data["run_id"]``),
        ``already_terminal`` or ``lease_lost``. ``options``: ``input``, ``shadow``,
        ``max_tool_calls``, ``max_cost``, ``max_attempts``, ``timeout_seconds``."""
        path = f"/communities/{lease.community_id}/deliveries/{lease.delivery_id}/accept"
        return self._run_outcome(path, {"lease_generation": lease.lease_generation, **options})

    def claim_runs(
        self,
        limit: int = 1,
        *,
        wait_seconds: float = 0,
        lease_seconds: float | None = None,
        worker_id: str | None = None,
    ) -> list[RemoteRunClaim]:
        """Claim up to ``limit`` of this key's pending agent runs across its communities,
        long-polling up to ``wait_seconds`` for the first."""
        body = {"limit": limit, "wait_seconds": wait_seconds, "lease_seconds": lease_seconds, "worker_id": worker_id}
        data = self._json("POST", "/runs/claim", body, extra_timeout=wait_seconds)
        return [RemoteRunClaim(c["run"], _run_lease(c["lease"])) for c in data["claims"]]

    def read_run(self, community_id: str, run_id: str) -> dict[str, Any]:
        """``{"run", "journal"}`` of one of this key's runs (``GatewayHTTPError`` 404 otherwise)."""
        return self._json("GET", f"/communities/{community_id}/runs/{run_id}")

    def emit(self, lease: RemoteRunLease, chunk: str) -> RunOutcome:
        """Append ``chunk`` to the run's output stream: ``emitted`` (``seq``), ``too_large``
        (nothing written), ``already_terminal`` or ``lease_lost``."""
        return self._run_post(lease, "emit", chunk=chunk)

    def read_output(
        self, community_id: str, run_id: str, *, after: int = 0, limit: int = 200, wait_seconds: float = 0
    ) -> dict[str, Any]:
        """The streamed output of one of this key's runs after seq ``after``, long-polling up to
        ``wait_seconds`` when there is none yet: ``{"chunks": [{"seq", "chunk"}], "after",
        "terminal", "done"}`` (``GatewayHTTPError`` 404 for a run that is not this key's)."""
        body = {"after": after, "limit": limit, "wait_seconds": wait_seconds}
        path = f"/communities/{community_id}/runs/{run_id}/output"
        return self._json("POST", path, body, extra_timeout=wait_seconds)

    def _run_outcome(self, path: str, body: dict[str, Any]) -> RunOutcome:
        data = self._json("POST", path, body, ok=(200, 409))
        if data.get("code") == "lease_lost":
            return RunOutcome("lease_lost", data)
        return RunOutcome(data["outcome"], data)

    def _run_post(self, lease: RemoteRunLease, action: str, **body: Any) -> RunOutcome:
        path = f"/communities/{lease.community_id}/runs/{lease.run_id}/{action}"
        return self._run_outcome(
            path, {"lease_generation": lease.lease_generation, "worker_id": lease.worker_id, **body}
        )

    def heartbeat(self, lease: RemoteRunLease, lease_seconds: float | None = None) -> RunOutcome:
        """Renew the run lease: ``renewed`` (``lease`` the new one), ``already_terminal`` or
        ``lease_lost`` (``data["reason"] == "cancelled"`` after a cancel)."""
        outcome = self._run_post(lease, "heartbeat", lease_seconds=lease_seconds)
        if outcome.outcome == "renewed":
            return RunOutcome("renewed", outcome.data, lease=_run_lease(outcome.data["lease"]))
        return outcome

    def journal_call(
        self,
        lease: RemoteRunLease,
        tool_name: str,
        args: Any,
        *,
        cost: int = 0,
        compensation: dict[str, Any] | None = None,
        destructive: bool = False,
        scope: str = "",
        index: int | None = None,
    ) -> RunOutcome:
        """Journal a call before making it: ``journaled`` (``seq``, ``idempotency_key``),
        ``blocked``, ``budget_exceeded``, ``already_terminal`` or ``lease_lost``. ``scope`` and
        ``index``: its replay key (call ``index`` of scope ``scope``)."""
        return self._run_post(
            lease,
            "calls",
            tool_name=tool_name,
            args=args,
            cost=cost,
            compensation=compensation,
            destructive=destructive,
            scope=scope,
            index=index,
        )

    def record_result(
        self,
        lease: RemoteRunLease,
        seq: int,
        *,
        ok: bool,
        output: Any = None,
        error: str | None = None,
        latency_ms: int | None = None,
        uncertain: bool = False,
    ) -> RunOutcome:
        """Answer journal entry ``seq``: ``recorded`` / ``already_recorded`` with the status."""
        return self._run_post(
            lease, "results", seq=seq, ok=ok, output=output, error=error, latency_ms=latency_ms, uncertain=uncertain
        )

    def request_approval(
        self,
        lease: RemoteRunLease,
        prompt: str = "",
        deadline_seconds: int = 86400,
        *,
        scope: str = "",
        index: int | None = None,
    ) -> RunOutcome:
        """Park the run on an approval: ``approval_requested`` (``approval_id``, ``seq``)."""
        return self._run_post(
            lease, "approval", prompt=prompt, deadline_seconds=deadline_seconds, scope=scope, index=index
        )

    def complete_run(self, lease: RemoteRunLease, output: Any) -> RunOutcome:
        """End the run ``completed``: ``finished``, ``already_terminal`` or ``lease_lost``."""
        return self._run_post(lease, "complete", output=output)

    def run_batch(self, action: str, items: list[tuple[RemoteRunLease, dict[str, Any]]]) -> list[RunOutcome]:
        """One transition of many runs of one community in one request (``action``: ``complete``,
        ``calls``, ``results`` or ``fail``; each body as the one-run endpoint's, without ``worker_id``),
        each under its own lease: one outcome per item, in order, what the one-run endpoint
        answers (``lease_lost`` for its 409) or ``not_found``. A bad item is a
        ``GatewayHTTPError`` 400 naming it (``runs[2].output``), and then nothing was written."""
        if not items:
            return []
        community = items[0][0].community_id
        if any(lease.community_id != community for lease, _ in items):
            raise ValueError("every lease of a batch must be of one community")
        workers = {lease.worker_id for lease, _ in items}
        if len(workers) > 1:
            raise ValueError("every lease of a batch must be held by one worker")
        runs = [{"run_id": lease.run_id, "lease_generation": lease.lease_generation, **body} for lease, body in items]
        data = self._json("POST", f"/communities/{community}/runs/{action}", {"runs": runs, "worker_id": workers.pop()})
        return [RunOutcome(r["outcome"], r) for r in data["results"]]

    def run_steps(self, items: dict[str, list[tuple[RemoteRunLease, dict[str, Any]]]]) -> dict[str, list[RunOutcome]]:
        """The steps of many runs of one community, of mixed kinds, in one request and one
        transaction (``POST .../runs/steps``, issue 29): ``items`` maps ``results``, ``calls`` and
        ``complete`` to ``(lease, body)`` pairs as :meth:`run_batch` takes them (no run twice in
        all); answers the same keys, each list in order, each outcome what that kind's batch
        answers. A bad item is a ``GatewayHTTPError`` 400 naming it (``calls[1].tool_name``), and
        then nothing was written; a gateway without the route answers 404 or 405."""
        pairs = [pair for kind_items in items.values() for pair in kind_items]
        if not pairs:
            return {kind: [] for kind in items}
        community = pairs[0][0].community_id
        workers = {lease.worker_id for lease, _ in pairs}
        if len(workers) > 1 or any(lease.community_id != community for lease, _ in pairs):
            raise ValueError("every lease of a batch must be of one community and one worker")
        body: dict[str, Any] = {
            kind: [{"run_id": lease.run_id, "lease_generation": lease.lease_generation, **one} for lease, one in pairs]
            for kind, pairs in items.items()
        }
        data = self._json("POST", f"/communities/{community}/runs/steps", {**body, "worker_id": workers.pop()})
        return {kind: [RunOutcome(r["outcome"], r) for r in data[kind]] for kind in items}

    def heartbeat_runs(self, leases: list[RemoteRunLease], lease_seconds: float | None = None) -> list[RunOutcome]:
        """Renew many run leases of one community in one request: one outcome per lease, in
        order, as :meth:`heartbeat` answers (``renewed`` with the new ``lease``) or ``not_found``."""
        if not leases:
            return []
        community = leases[0].community_id
        workers = {lease.worker_id for lease in leases}
        if len(workers) > 1 or any(lease.community_id != community for lease in leases):
            raise ValueError("every lease of a batch must be of one community and one worker")
        runs = [{"run_id": lease.run_id, "lease_generation": lease.lease_generation} for lease in leases]
        body = {"runs": runs, "worker_id": workers.pop(), "lease_seconds": lease_seconds}
        data = self._json("POST", f"/communities/{community}/runs/heartbeat", body)
        return [
            RunOutcome(r["outcome"], r, lease=_run_lease(r["lease"]) if r["outcome"] == "renewed" else None)
            for r in data["results"]
        ]

    def complete_runs(self, items: list[tuple[RemoteRunLease, Any]]) -> list[RunOutcome]:
        """End many runs of one community ``completed`` in one request (``run_batch``): one
        outcome per ``(lease, output)``: ``finished``, ``already_terminal``, ``lease_lost`` or
        ``not_found``."""
        return self.run_batch("complete", [(lease, {"output": output}) for lease, output in items])

    def fail_run(self, lease: RemoteRunLease, failure_code: str, failure_message: str | None = None) -> RunOutcome:
        """Fail the run: ``finished`` (state ``failed``), ``unwinding`` (``seqs`` to compensate),
        ``already_terminal`` or ``lease_lost``."""
        return self._run_post(lease, "fail", failure_code=failure_code, failure_message=failure_message)

    def fail_runs(self, items: list[tuple[RemoteRunLease, str, str | None]]) -> list[RunOutcome]:
        """Fail many runs of one community in one request (``run_batch``), each with its own
        ``(lease, failure_code, failure_message)``: one outcome per item, as :meth:`fail_run`
        answers (``finished``, ``unwinding`` with ``seqs``, ``already_terminal``, ``lease_lost``)
        or ``not_found``."""
        return self.run_batch(
            "fail", [(lease, {"failure_code": code, "failure_message": message}) for lease, code, message in items]
        )

    def begin_compensation(self, lease: RemoteRunLease, seq: int) -> RunOutcome:
        """``begun`` (``compensation``, ``args``, ``output``, ``key``) or ``not_next``."""
        return self._run_post(lease, "compensations/begin", seq=seq)

    def finish_compensation(self, lease: RemoteRunLease, seq: int, *, ok: bool, error: str | None = None) -> RunOutcome:
        """Record entry ``seq``'s compensation: ``recorded`` / ``already_recorded``."""
        return self._run_post(lease, "compensations/finish", seq=seq, ok=ok, error=error)


# --- the remote worker ------------------------------------------------------------------------


FAILURE_CODE_MAX_CHARS = 64
FAILURE_MESSAGE_MAX_CHARS = 10_000


def describe(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when the exception's own ``__str__`` raises."""
    try:
        return str(exc)
    except BaseException:
        return f"<unprintable {type(exc).__name__}>"


def storable(text: str, max_chars: int) -> str:
    """``text`` the server can store, bounded: NUL as ``\\x00``, a lone surrogate as its escape,
    cut to ``max_chars`` (as the core worker does with handler text)."""
    text = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    return text[:max_chars]


def failure_code(value: object, default: str) -> str:
    """A failure code the server accepts (1..64 storable characters), else ``default``."""
    code = storable(value, FAILURE_CODE_MAX_CHARS) if isinstance(value, str) else ""
    return code if code.strip() else default


def settle_args(exc: BaseException | None) -> tuple[str, str | None, str | None]:
    """(outcome, failure_code, failure_message) for a handler that returned (None) or raised.
    A ``BaseException`` that is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``)
    ends the delivery ``failed`` with its class name, as a permanent failure: the handler asked
    to stop, which is that delivery's end, never the worker's. The text is always storable."""
    if exc is None:
        return "finished", None, None
    message = storable(describe(exc), FAILURE_MESSAGE_MAX_CHARS) or None
    if getattr(type(exc), "permanent", False) is True or not isinstance(exc, Exception):
        return "failed", failure_code(type(exc).__name__, "PermanentFailure"), message
    return "retry", None, message


# Most deliveries one claim request asks for (the gateway's default MAX_CLAIM_LIMIT).
CLAIM_LIMIT = 100
# Claims beyond the free handler threads (``--claim-ahead``), as run_delivery_worker's rule:
# at most this many, and only as many as start within a tenth of the lease, at most a second
# (issue 29: two claims of CLAIM_LIMIT in flight, so the handlers never wait on a claim's round trip).
DEFAULT_CLAIM_AHEAD = 2 * CLAIM_LIMIT
# Claim requests in flight at once: while one is answered, the next is already on its way; the
# second asks for at least this many (or the whole room) and never long-polls.
CLAIMS_IN_FLIGHT = 2
CLAIM_MIN_SECOND = CLAIM_LIMIT // 4
CLAIM_AHEAD_LEASE_FRACTION = 0.1
CLAIM_AHEAD_MAX_WAIT = 1.0
RUN_TIME_WEIGHT = 0.2


def lease_length(lease_until: str) -> float:
    """Seconds from now to ``lease_until`` (ISO 8601) by this machine's clock, 0 if unreadable:
    only the claim-ahead budget uses it."""
    try:
        until = datetime.fromisoformat(lease_until.replace("Z", "+00:00"))
        return max(0.0, (until - datetime.now(UTC)).total_seconds())
    except (ValueError, TypeError):
        return 0.0


# Finished results per batch request (the batch route takes at most 100), and the seconds the
# settler waits for more (issue 29).
SETTLE_BATCH = 100


@dataclass(frozen=True, slots=True)
class _Result:
    """A handler's result awaiting its settle batch, with the lease its handler ran under: a
    result is settled under that lease's generation, never under a later claim of the same
    delivery (found in review)."""

    lease: RemoteLease
    outcome: str
    failure_code: str | None
    failure_message: str | None
    retry_after: float | None


SETTLE_LINGER = 0.005
# Settler threads, each gathering and sending its own batches: while one batch is answered the
# next is on its way (issue 29).
SETTLES_IN_FLIGHT = 2
SETTLE_LINGER_BESIDE = 0.02
# A settle batch that got no answer or a transient refusal (too many requests, the database
# unavailable, a proxy's 502/504) is sent again, at most this many tries in all, after 0.2, 0.4... s.
SETTLE_TRIES = 4
SETTLE_RETRY_DELAY = 0.2
# The longest wait before a resend, whatever a Retry-After asks: the batch's leases keep running.
SETTLE_RETRY_MOST = 5.0
TRANSIENT_STATUSES = (429, 502, 503, 504)
# Leases per renewal request (the batch route takes at most the gateway's claim limit, 100 by
# default): a renewal round is one request per community and this many held leases.
RENEW_BATCH = 100


class RemoteWorker:
    """The worker loop of ``work``: see the module docstring. ``run()`` returns the summary."""

    def __init__(
        self,
        client: GatewayClient,
        handler: Callable[[dict[str, Any]], object],
        *,
        concurrency: int = 1,
        lease_seconds: float | None = None,
        wait_seconds: float = 5.0,
        renew_every: float = 10.0,
        max_deliveries: int | None = None,
        idle_exit: float | None = None,
        shutdown_grace: float = 30.0,
        claim_ahead: int = DEFAULT_CLAIM_AHEAD,
    ) -> None:
        checked_handler(handler)
        concurrency = checked_count(concurrency, "concurrency", 1, MAX_CONCURRENCY)
        claim_ahead = checked_count(claim_ahead, "claim_ahead", 0, MAX_CLAIM_AHEAD)
        if max_deliveries is not None:
            max_deliveries = checked_count(max_deliveries, "max_deliveries", 1)
        if lease_seconds is not None:
            lease_seconds = checked_seconds(lease_seconds, "lease_seconds")
        wait_seconds = checked_seconds(wait_seconds, "wait_seconds", zero=True)
        renew_every = checked_seconds(renew_every, "renew_every")
        if idle_exit is not None:
            idle_exit = checked_seconds(idle_exit, "idle_exit")
        shutdown_grace = checked_seconds(shutdown_grace, "shutdown_grace", zero=True)
        self.client, self.handler, self.concurrency = client, handler, concurrency
        self.claim_ahead = claim_ahead
        self.lease_seconds, self.wait_seconds, self.renew_every = lease_seconds, wait_seconds, renew_every
        self.max_deliveries, self.idle_exit, self.shutdown_grace = max_deliveries, idle_exit, shutdown_grace
        self.stop = threading.Event()
        self.reason = "stopped"
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._held: dict[str, RemoteLease] = {}
        self._room_changed = threading.Condition(self._lock)
        self._handling = 0  # claimed and not yet through the handler (running or queued)
        self._settling = 0  # settle batches being gathered or sent
        self._claiming = 0  # asked for by the claims in flight
        self._claims_in_flight = 0
        self._last_full = False  # the last claim answered got all it asked for: the queue has more
        self._claimed = 0
        self._idle_since = time.monotonic()
        self._reached = time.monotonic()  # when a claim last got through (or the start)
        self._claim_retrying = backoff.Retrying(CLAIM_RETRY_BASE, CLAIM_RETRY_MOST)  # under _room_changed
        self.internal_error: str | None = None
        self.run_time: float | None = None  # moving average of handler run time, seconds
        self._lease_length: float | None = lease_seconds
        # Results to settle, None the end marker. A Queue, not a SimpleQueue: the settlers linger
        # in get(timeout=...), and CPython's lock-based SimpleQueue (3.11 here) can turn
        # that wait into an endless one. A put wakes the waiter by releasing the queue's lock; if
        # the other settler takes the item before the woken one gets the GIL, the woken one finds
        # the queue empty and its deadline past, and waits again with a negative timeout, which
        # is no timeout: until the next put. With the last result queued, its batch stayed unsent
        # through the stop's whole grace (test_work_pipelining).
        self._results: queue.Queue[_Result | None] = queue.Queue()
        self.settle_batch = min(SETTLE_BATCH, max(concurrency + claim_ahead, 1) * 2)

    def _add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def request_stop(self, reason: str) -> None:
        """Stop claiming; in-flight deliveries still settle (drain)."""
        if not self.stop.is_set():
            self.reason = reason
            self.stop.set()

    def _ahead(self) -> int:
        """How many claims may wait beyond the free handler threads (call with the lock held):
        as many as the threads start, at their recent pace, within a tenth of the lease (at most
        :data:`CLAIM_AHEAD_MAX_WAIT` seconds); at most ``claim_ahead``; 0 before any handler
        ran. The rule of ``run_delivery_worker``."""
        if self.run_time is None or not self.claim_ahead:
            return 0
        budget = min((self._lease_length or 0) * CLAIM_AHEAD_LEASE_FRACTION, CLAIM_AHEAD_MAX_WAIT)
        pace = self.concurrency / max(self.run_time, 1e-6)  # handler starts per second
        return max(0, min(self.claim_ahead, int(budget * pace)))

    def _room(self) -> int:
        """Deliveries the next claim may take (call with the lock held): the free handler
        threads and :meth:`_ahead`; results awaiting their settle batch count only past two
        batches (a stalled settle slows the claims down)."""
        return max(0, min(self._free(), CLAIM_LIMIT))

    def _free(self) -> int:
        """:meth:`_room` before the cap of one claim request (call with the lock held)."""
        capacity = self.concurrency + self._ahead()
        return min(capacity - self._handling, capacity + 2 * self.settle_batch - len(self._held))

    def _work(self, claim: RemoteClaim) -> None:
        delivery_id = claim.lease.delivery_id
        try:
            error: BaseException | None = None
            began = time.monotonic()
            try:
                self.handler(claim.delivery)
            except BaseException as exc:  # SystemExit, KeyboardInterrupt...: this delivery's end only
                error = exc
            seconds = time.monotonic() - began
            with self._room_changed:
                previous = self.run_time
                self.run_time = seconds if previous is None else previous + RUN_TIME_WEIGHT * (seconds - previous)
                self._handling -= 1
                self._room_changed.notify_all()
            outcome, code, message = settle_args(error)
            after = backoff.of(error) if outcome == "retry" else None
            # Settled in a batch, whatever the outcome; still held (and renewed) until then.
            self._results.put(_Result(claim.lease, outcome, code, message, after))
            delivery_id = ""  # not released below
        except BaseException:  # the loop's own error: counted; that lease lapses; the thread lives
            logger.exception("worker_error delivery=%s", delivery_id)
            self._add("errors")
        finally:
            if delivery_id:
                with self._lock:
                    self._release(claim.lease)

    def _settle_loop(self) -> None:
        """Settle the handlers' results in batches (see the module docstring) until told to stop."""
        while (first := self._results.get()) is not None:
            batch, stop = [first], False
            with self._lock:
                # Beside a batch in flight, wait longer for more: a second batch of a few would
                # cost a request for little.
                linger = SETTLE_LINGER_BESIDE if self._settling else SETTLE_LINGER
                self._settling += 1
            deadline = time.monotonic() + linger
            while len(batch) < self.settle_batch:
                try:
                    item = self._results.get(timeout=max(deadline - time.monotonic(), 0))
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            try:
                self._settle(batch)
            finally:
                with self._lock:
                    self._settling -= 1
            if stop:
                return

    def _settle(self, results: list[_Result]) -> None:
        with self._lock:
            # The held lease when it is still this run's (a renewal may have moved its end), else
            # the run's own: a stale run's result is fenced by its own generation (lease_lost).
            settles = [
                RemoteSettle(self._current(r.lease), r.outcome, r.failure_code, r.failure_message, r.retry_after)
                for r in results
            ]
        by_community: dict[str, list[RemoteSettle]] = {}
        for settle in settles:
            by_community.setdefault(settle.lease.community_id, []).append(settle)
        for group in by_community.values():
            try:
                answers = self._settle_many(group)
            except GatewayHTTPError as exc:
                # 404/405: a gateway older than the batch route; 400: one bad item, or a gateway
                # older than per-delivery outcomes (it takes a batch of finished ones only, and
                # refuses even one failed or retried delivery); 413: too large.
                if exc.status not in (400, 404, 405, 413):
                    logger.warning("settle_error n=%d error=%s", len(group), describe(exc))
                    self._add("settle_errors", len(group))
                    continue
                # Refused as a whole: each on its own request, so each lease gets the answer its
                # own settle would.
                logger.warning("settle_batch_refused n=%d error=%s: settling one by one", len(group), describe(exc))
                answers = []
                for x in group:
                    try:
                        answers.append(
                            self.client.finish(
                                x.lease,
                                x.outcome,
                                failure_code=x.failure_code,
                                failure_message=x.failure_message,
                                retry_after=x.retry_after,
                            )
                        )
                    except Exception as one:
                        logger.warning("settle_error delivery=%s error=%s", x.lease.delivery_id, describe(one))
                        answers.append(RemoteOutcome("settle_error"))
            except Exception as exc:  # unreachable: those leases lapse, the worker goes on
                logger.warning("settle_error n=%d error=%s", len(group), describe(exc))
                self._add("settle_errors", len(group))
                continue
            counted: Counter[str] = Counter()
            for x, answer in zip(group, answers, strict=True):
                if answer.outcome == "settle_error":
                    counted["settle_errors"] += 1
                    continue
                if answer.outcome in ("lease_lost", "not_found"):
                    counted["lease_lost"] += 1
                else:
                    counted[
                        {"finished": "finished", "failed": "failed", "pending": "retried"}.get(
                            answer.status or "", "failed"
                        )
                    ] += 1
                # One line per delivery only at DEBUG (issue 29: 6% of the client's CPU at INFO).
                logger.debug("settled delivery=%s outcome=%s result=%s", x.lease.delivery_id, x.outcome, answer.outcome)
            with self._lock:
                self._counts.update(counted)
            logger.info(
                "settled n=%d community=%s %s",
                len(group),
                group[0].lease.community_id,
                " ".join(f"{k}={v}" for k, v in sorted(counted.items())),
            )
        with self._lock:
            for r in results:
                self._release(r.lease)

    def _settle_many(self, group: list[RemoteSettle]) -> list[RemoteOutcome]:
        """``settle_many``, sent again (signed anew) after a transient failure: no answer (a
        timeout, a dropped connection) or a 429/502/503/504, at most :data:`SETTLE_TRIES` times
        while the leases may still hold. A repeat of a settle that took effect is answered
        ``already_terminal`` (the same holder's), so nothing settles twice; without it the
        batch's leases would lapse and their deliveries wait a lease for another worker (a drain
        ended 100 short: issue 29)."""
        for attempt in range(SETTLE_TRIES):
            try:
                return self.client.settle_many(group)
            except (httpx.TransportError, GatewayHTTPError) as exc:
                transient = not isinstance(exc, GatewayHTTPError) or exc.status in TRANSIENT_STATUSES
                if not transient or attempt == SETTLE_TRIES - 1:
                    raise
                logger.warning("settle_retry n=%d error=%s: sending it again", len(group), describe(exc))
                time.sleep(
                    backoff.again_delay(
                        SETTLE_RETRY_DELAY, attempt, getattr(exc, "retry_after", None), most=SETTLE_RETRY_MOST
                    )
                )
        raise AssertionError("unreachable")

    def _current(self, lease: RemoteLease) -> RemoteLease:
        """The held lease of ``lease``'s delivery if it is of the same generation, else ``lease``
        (call with the lock held)."""
        held = self._held.get(lease.delivery_id)
        return held if held is not None and held.lease_generation == lease.lease_generation else lease

    def _release(self, lease: RemoteLease) -> None:
        """Stop holding (renewing) ``lease``'s delivery, unless it is held under another
        generation now: a later claim of it (call with the lock held)."""
        held = self._held.get(lease.delivery_id)
        if held is not None and held.lease_generation == lease.lease_generation:
            del self._held[lease.delivery_id]

    def _renew_loop(self) -> None:
        """Every ``renew_every`` seconds, renew every held lease (claimed ahead, in a handler,
        or finished and awaiting its batch): one request per community and :data:`RENEW_BATCH`
        leases (``POST /communities/{id}/deliveries/renew``), each lease fenced on its own."""
        while not self._done.wait(self.renew_every):
            with self._lock:
                held = list(self._held.values())
            by_community: dict[str, list[RemoteLease]] = {}
            for lease in held:
                by_community.setdefault(lease.community_id, []).append(lease)
            for group in by_community.values():
                for start in range(0, len(group), RENEW_BATCH):
                    self._renew(group[start : start + RENEW_BATCH])

    def _renew(self, leases: list[RemoteLease]) -> None:
        try:
            results = self.client.renew_many(leases, self.lease_seconds)
        except GatewayHTTPError as exc:
            # 404/405: a gateway older than the batch route (no route, or its read route took the
            # path; the batch route itself answers no 404).
            if exc.status not in (404, 405) and (exc.status not in (400, 413) or len(leases) == 1):
                logger.warning("renew_error n=%d error=%s", len(leases), describe(exc))
                return
            # Refused as a whole: each lease on its own request gets the answer its renew would.
            logger.warning("renew_batch_refused n=%d error=%s: renewing one by one", len(leases), describe(exc))
            results = []
            for lease in leases:
                try:
                    results.append(self.client.renew(lease, self.lease_seconds))
                except Exception as one:
                    logger.warning("renew_error delivery=%s error=%s", lease.delivery_id, describe(one))
                    results.append(RemoteOutcome("renew_error"))
        except Exception as exc:  # never let the renewer die: every lease would lapse
            logger.warning("renew_error n=%d error=%s", len(leases), describe(exc))
            return
        with self._lock:
            for lease, result in zip(leases, results, strict=True):
                delivery_id = lease.delivery_id
                if result.lease is not None and delivery_id in self._held:
                    self._held[delivery_id] = result.lease
                    self._counts["renewed"] += 1
                elif result.outcome in ("lease_lost", "not_found"):
                    logger.info("lease_lost delivery=%s (renew)", delivery_id)

    def _claim_size(self) -> int:
        """How many the next claim asks for (call with the lock held), 0 when it must wait: the
        room less what the claims in flight asked for; a second claim in flight only once the
        one before came back full (the queue has more) and for at least :data:`CLAIM_MIN_SECOND`
        deliveries, so an empty inbox costs one long-poll, not two, and no claim is tiny."""
        free = self._free() - self._claiming
        want = min(free, CLAIM_LIMIT)
        if self.max_deliveries is not None:
            want = min(want, self.max_deliveries - self._claimed - self._claiming)
        if want <= 0 or self._claims_in_flight >= CLAIMS_IN_FLIGHT:
            return 0
        if self._claims_in_flight and (not self._last_full or want < CLAIM_MIN_SECOND):
            return 0
        return want

    def _claim_loop(self, pool: ThreadPoolExecutor) -> None:
        """One of the :data:`CLAIMS_IN_FLIGHT` claimers: claim as :meth:`_claim_size` says and hand
        the claims to the handler pool, until stopped. The first claim in flight long-polls; a
        second does not wait (it is sent only while the queue has more)."""
        try:
            while not self.stop.is_set():
                with self._room_changed:
                    if self.max_deliveries is not None and self._claimed >= self.max_deliveries:
                        self.request_stop("max_deliveries")
                        break
                    want = self._claim_size()
                    if want <= 0:
                        self._room_changed.wait(0.2)
                        continue
                    wait = self.wait_seconds if not self._claims_in_flight else 0.0
                    self._claiming += want
                    self._claims_in_flight += 1
                try:
                    claims = self.client.claim(want, wait_seconds=wait, lease_seconds=self.lease_seconds)
                except (httpx.HTTPError, GatewayHTTPError, ValueError) as exc:
                    logger.warning("claim_error error=%s", exc)
                    claims = []
                    with self._room_changed:
                        self._claiming -= want
                        self._claims_in_flight -= 1
                        self._last_full = False
                        self._counts["errors"] += 1
                        if self._handling:  # a handler still runs: not idle (work-runs' _busy)
                            self._idle_since = time.monotonic()
                        idle = time.monotonic() - self._idle_since
                        self._room_changed.notify_all()
                        # One backoff for both claimers (under the lock): the worker backs off.
                        pause = claim_retry_wait(self._claim_retrying, exc, self.idle_exit)
                    self.stop.wait(pause)
                    # No delivery could be claimed (the gateway unreachable, the key not enrolled):
                    # idle for --idle-exit, as an empty claim is, so a draining job ends; but only
                    # once no claim has got through for UNREACHABLE_IDLE_SECONDS (a gateway's
                    # restart is not the end of a backlog).
                    idle_long = self.idle_exit is not None and idle + pause >= self.idle_exit
                    if idle_long and unreachable_for_long(self._reached):
                        self.request_stop("idle_exit")
                    continue
                self._reached = time.monotonic()
                with self._room_changed:
                    self._claim_retrying.reset()
                    self._claiming -= want
                    self._claims_in_flight -= 1
                    self._last_full = len(claims) >= want
                    self._claimed += len(claims)
                    self._counts["claimed"] += len(claims)
                    self._handling += len(claims)
                    for claim in claims:
                        self._held[claim.lease.delivery_id] = claim.lease
                    if claims and self._lease_length is None:
                        self._lease_length = lease_length(claims[0].lease.lease_until)
                    if self._handling:  # claims handed out or a handler still running: not idle
                        self._idle_since = time.monotonic()
                    idle = time.monotonic() - self._idle_since
                    self._room_changed.notify_all()
                for claim in claims:
                    pool.submit(self._work, claim)
                if not claims and self.idle_exit is not None and idle >= self.idle_exit:
                    self.request_stop("idle_exit")
        except Exception as exc:  # the loop's own error: stop (exit 1), draining what is held
            logger.exception("worker_error: the claim loop stopped")
            self.internal_error = f"internal_error: {type(exc).__name__}"
            self.request_stop(self.internal_error)
            self.reason = self.internal_error

    def run(self) -> dict[str, Any]:
        """Claim and work until stopped (signal, ``max_deliveries``, ``idle_exit``), then drain."""
        self._done = threading.Event()
        renewer = threading.Thread(target=self._renew_loop, name="gateway-renewer", daemon=True)
        renewer.start()
        settlers = [
            threading.Thread(target=self._settle_loop, name=f"gateway-settler-{i}", daemon=True)
            for i in range(SETTLES_IN_FLIGHT)
        ]
        for settler in settlers:
            settler.start()
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="gateway-handler")
        self._idle_since = time.monotonic()
        self.internal_error = None
        claimers = [
            threading.Thread(target=self._claim_loop, args=(pool,), name=f"gateway-claimer-{i}", daemon=True)
            for i in range(CLAIMS_IN_FLIGHT)
        ]
        try:
            for claimer in claimers:
                claimer.start()
            while not self.stop.wait(0.2):  # a timed wait: signals are handled in this thread
                pass
            # A claim in flight at the stop still hands its claims to the pool: wait for it (its
            # long-poll and timeout bound it).
            deadline = time.monotonic() + self.wait_seconds + getattr(self.client, "timeout", 10.0) + 5
            for claimer in claimers:
                claimer.join(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # the loop's own error: stop (exit 1), draining what is held
            logger.exception("worker_error: the claim loop stopped")
            self.internal_error = f"internal_error: {type(exc).__name__}"
            self.reason = self.internal_error
        finally:
            # Left by an exception before any stop (a KeyboardInterrupt with no signal handler, a
            # claimer that could not start): the claimers are told to stop, as the drain waits
            # for them. The reason stays what it was (the internal error's).
            self.stop.set()
            # The pool outlives the drain: a claim answered after the join gave up on it (its
            # long-poll, a resend) is still worked and settled, not held unworked through the grace.
            deadline = time.monotonic() + self.shutdown_grace
            while time.monotonic() < deadline:
                with self._lock:
                    if not self._held and not any(claimer.is_alive() for claimer in claimers):
                        break
                time.sleep(0.05)
            pool.shutdown(wait=False)
            with self._lock:
                self._counts["abandoned"] += len(self._held)
            for _ in settlers:  # each settler ends once what it holds is sent
                self._results.put(None)
            deadline = time.monotonic() + 5
            for settler in settlers:
                settler.join(timeout=max(0.0, deadline - time.monotonic()))
            self._done.set()
        with self._lock:
            summary: dict[str, Any] = {key: self._counts[key] for key in SUMMARY_KEYS}
        summary["reason"] = self.reason
        summary["exit_code"] = exit_code(summary, self.internal_error is not None)
        return summary


def exit_code(summary: dict[str, Any], internal_error: bool) -> int:
    """:data:`EXIT_ERROR` after an internal error, :data:`EXIT_ABANDONED` when leases were
    given up, else :data:`EXIT_OK`."""
    if internal_error:
        return EXIT_ERROR
    return EXIT_ABANDONED if summary.get("abandoned") else EXIT_OK


def _load(path: str) -> Callable[[dict[str, Any]], object]:
    handler = pkgutil.resolve_name(path)
    if not callable(handler):
        raise ValueError(f"{path!r} is not callable")
    return handler  # type: ignore[no-any-return]


def read_key_file(path: str) -> bytes:
    """The 32-byte secret key in ``path``: 64 hex characters (surrounding whitespace ignored).
    ``ValueError`` naming the file otherwise (not ``fromhex``'s "non-hexadecimal number found",
    which named neither the file nor what it should hold)."""
    text = Path(path).read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ValueError(
            f"{path}: the key file must hold 64 hex characters (a 32-byte secret key), "
            "as `manage.py gateway_key new --out FILE` writes"
        )
    return key


# Libraries that log every HTTP request at INFO: quiet below verbosity 2.
HTTP_LOGGERS = ("httpx", "httpcore")


def configure_logging(verbosity: int) -> None:
    """Logging of the ``work`` commands: WARNING at 0, INFO at 1 and 2, DEBUG at 3; the HTTP
    libraries' per-request lines (``httpx`` logs each at INFO) only from 2 on."""
    level = {0: logging.WARNING, 1: logging.INFO, 2: logging.INFO}.get(verbosity, logging.DEBUG)
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(level if verbosity >= 2 else max(level, logging.WARNING))


def _worker_options(parser: argparse.ArgumentParser, *, handler: str, lease: str, renew: str) -> None:
    """The options ``work`` and ``work-runs`` share (their help names what each claims and renews)."""
    parser.add_argument("--url", required=True, help="the gateway's base URL, e.g. http://127.0.0.1:8000/gateway/v1")
    parser.add_argument("--key-file", required=True, help="file holding the agent's 32-byte secret key as hex")
    parser.add_argument("--handler", required=True, help=f"dotted path of {handler}")
    parser.add_argument("--concurrency", type=int, default=1, help="handler threads (default 1)")
    parser.add_argument("--lease-seconds", type=seconds_option(), default=None, help=f"{lease} (default: the server's)")
    parser.add_argument(
        "--wait-seconds", type=seconds_option(zero=True), default=5.0, help="long-poll per claim (default 5)"
    )
    parser.add_argument(
        "--renew-every", type=seconds_option(), default=10.0, help=f"seconds between {renew} (default 10)"
    )
    parser.add_argument("--idle-exit", type=seconds_option(), default=None, help="stop after this many idle seconds")
    parser.add_argument(
        "--shutdown-grace", type=seconds_option(zero=True), default=30.0, help="seconds to drain on stop (default 30)"
    )


def main(argv: list[str] | None = None) -> int:
    """``work``: run a remote delivery worker; ``work-runs``: a remote agent-run worker
    (:mod:`buzz_delivery.gateway.remote_runs`). Exit 0 on a clean stop, 1 after an internal error
    (a thread of the worker died, or its loop raised: the summary's ``reason`` says), 3 when
    leases were given up."""
    parser = argparse.ArgumentParser(prog="python -m buzz_delivery.gateway.client")
    sub = parser.add_subparsers(dest="command", required=True)
    work = sub.add_parser("work", help="claim and work deliveries through the gateway")
    _worker_options(work, handler="handler(delivery: dict)", lease="lease length", renew="renewals")
    work.add_argument("--max-deliveries", type=int, default=None, help="stop after claiming this many")
    work.add_argument(
        "--claim-ahead",
        type=int,
        default=DEFAULT_CLAIM_AHEAD,
        help="most deliveries claimed beyond the free handler threads, held (and renewed) in a local queue "
        "while the handlers' recent run times say they start within a tenth of the lease, at most a "
        f"second (default {DEFAULT_CLAIM_AHEAD}; 0: claim only for free threads)",
    )
    runs = sub.add_parser("work-runs", help="claim and run agent runs through the gateway (remote_runs)")
    _worker_options(runs, handler="handler(ctx) -> output", lease="run lease length", renew="heartbeats")
    runs.add_argument("--worker-id", default=None, help="the holder's name (default: the gateway's)")
    runs.add_argument("--max-runs", type=int, default=None, help="stop after claiming this many")
    runs.add_argument(
        "--no-accept",
        action="store_true",
        help="do not accept the key's deliveries into runs",
    )
    runs.add_argument("--accept-batch", type=int, default=50, help="most deliveries claimed per request (default 50)")
    for command in (work, runs):
        command.add_argument(
            "-v",
            "--verbosity",
            type=int,
            choices=[0, 1, 2, 3],
            default=1,
            help="0 warnings only, 1 the worker's own lines (default), 2 every HTTP request too, 3 debug",
        )
    args = parser.parse_args(argv)
    configure_logging(args.verbosity)
    try:
        handler = _load(args.handler)
    except (ValueError, ImportError, AttributeError) as exc:
        parser.error(f"--handler {args.handler}: cannot load it ({exc}); expected pkg.module:function")
    try:
        key = read_key_file(args.key_file)
    except (ValueError, OSError) as exc:
        parser.error(f"--key-file: {exc}")
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        parser.error(f"--concurrency must be within 1..{MAX_CONCURRENCY}")
    if args.command == "work" and not 0 <= args.claim_ahead <= MAX_CLAIM_AHEAD:
        parser.error(f"--claim-ahead must be within 0..{MAX_CLAIM_AHEAD}")
    if args.command == "work-runs" and not 1 <= args.accept_batch <= MAX_ACCEPT_BATCH:
        parser.error(f"--accept-batch must be within 1..{MAX_ACCEPT_BATCH}")
    for option in ("max_deliveries", "max_runs"):  # as a worker built in code is held to it
        if getattr(args, option, None) is not None and getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be >= 1")
    client = GatewayClient(args.url, key, timeout=10.0)
    if args.command == "work-runs":
        return _work_runs(client, handler, args)
    worker = RemoteWorker(
        client, handler, concurrency=args.concurrency, lease_seconds=args.lease_seconds,
        wait_seconds=args.wait_seconds, renew_every=args.renew_every, max_deliveries=args.max_deliveries,
        idle_exit=args.idle_exit, shutdown_grace=args.shutdown_grace, claim_ahead=args.claim_ahead,
    )  # fmt: skip
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: worker.request_stop(signal.Signals(signum).name))
    try:
        summary = worker.run()
    finally:
        client.close()
    print(json.dumps(summary), flush=True)
    return int(summary["exit_code"])


def _work_runs(client: GatewayClient, handler: Callable[..., Any], args: argparse.Namespace) -> int:
    from buzz_delivery.gateway.remote_runs import RemoteRunWorker

    worker = RemoteRunWorker(
        client, handler, concurrency=args.concurrency, lease_seconds=args.lease_seconds,
        wait_seconds=args.wait_seconds, renew_every=args.renew_every, worker_id=args.worker_id,
        max_runs=args.max_runs, idle_exit=args.idle_exit, shutdown_grace=args.shutdown_grace,
        accept=not args.no_accept, accept_batch=args.accept_batch,
    )  # fmt: skip
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: worker.request_stop(signal.Signals(signum).name))
    try:
        summary = worker.run()
    finally:
        client.close()
    print(json.dumps(summary), flush=True)
    return int(summary["exit_code"])


if __name__ == "__main__":
    # ``python -m buzz_delivery.gateway.client`` runs this file as ``__main__``, a second copy of
    # the module beside the one ``remote_runs`` imports: its errors (``GatewayHTTPError``) would be
    # classes ``remote_runs`` does not catch (a 503 then failed the handler's run). Run the one copy.
    from buzz_delivery.gateway import client as _client

    sys.exit(_client.main())
