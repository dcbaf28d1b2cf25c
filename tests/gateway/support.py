"""A real gateway server for the tests: gunicorn (gthread) as a subprocess on a local port,
against the test database, plus helpers to make agents and their deliveries.

Tests that use it are ``transaction=True``: the server's connections see only committed rows.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from django.db import connection

from buzz_delivery.gateway import services as gateway
from buzz_delivery.gateway.client import GatewayClient, GatewayHTTPError
from buzz_delivery.gateway.models import Enrollment, SeenEvent
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import DeliveryFactory, EventFactory, WorkflowRunFactory
from project.database_url import database_url

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base: str  # e.g. http://127.0.0.1:PORT/gateway/v1
    proc: subprocess.Popen
    log: Path


def server_command(port: int, threads: int = 16, workers: int = 1) -> list[str]:
    """The documented serving command (docs/gateway.md), on a local port."""
    return [
        sys.executable, "-m", "gunicorn", "project.wsgi:application",
        "--worker-class", "gthread", "--workers", str(workers), "--threads", str(threads),
        "--bind", f"127.0.0.1:{port}", "--timeout", "60", "--graceful-timeout", "5",
        "--chdir", str(ROOT), "--no-control-socket",
    ]  # fmt: skip


def start_server(log: Path, env_extra: dict[str, str] | None = None, **kwargs: int) -> Server:
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict, application_name="buzz-gateway-test"),
        "BUZZ_MIN_LEASE_SECONDS": "1",
        "BUZZ_GATEWAY_POLL_SECONDS": "0.5",
        "BUZZ_GATEWAY_MAX_WAIT_SECONDS": "10",
        "LOG_LEVEL": "INFO",
        "PYTHONPATH": str(ROOT),
        **(env_extra or {}),
    }
    out = open(log, "w")  # noqa: SIM115 (kept open for the server's life)
    proc = subprocess.Popen(server_command(port, **kwargs), cwd=ROOT, env=env, stdout=out, stderr=out)
    base = f"http://127.0.0.1:{port}/gateway/v1"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gunicorn exited {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(base + "/openapi.json", timeout=1).status_code == 200:
                return Server(base, proc, log)
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"gunicorn did not answer within 30 s:\n{log.read_text()}")


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


@pytest.fixture(scope="session")
def gateway_server(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Server]:
    """One gunicorn for the session's gateway tests (stopped before the test database is dropped)."""
    with django_db_blocker.unblock():
        server = start_server(tmp_path_factory.mktemp("gateway") / "gunicorn.log")
    yield server
    stop_server(server)


@pytest.fixture
def impatient_gateway(tmp_path) -> Iterator[Server]:
    """A gateway of its own whose statements wait on a lock at most 300 ms (then 503 ``unavailable``)."""
    server = start_server(tmp_path / "gunicorn.log", {"PGOPTIONS": "-c lock_timeout=300"}, threads=4)
    yield server
    stop_server(server)


@pytest.fixture
def one_request_per_key(tmp_path) -> Iterator[Server]:
    """A gateway of its own with one request in flight per key (a second one is refused 429)."""
    server = start_server(tmp_path / "gunicorn.log", {"BUZZ_GATEWAY_MAX_REQUESTS_PER_KEY": "1"}, threads=4)
    yield server
    stop_server(server)


class TableLock:
    """The test's own connection, to hold a table locked until a true refusal came back: the
    gateway's statement waits on it past an ``impatient_gateway``'s lock_timeout (503
    ``unavailable``), or a request of a key waits on it holding the key's one slot of a
    ``one_request_per_key`` gateway (a second one: 429)."""

    def __init__(self) -> None:
        self.conn = psycopg.connect(database_url(connection.settings_dict, application_name="test-blocker"))

    def hold(self, table: str) -> None:
        with self.conn.cursor() as cur:
            cur.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")

    def release(self) -> None:
        self.conn.rollback()

    def close(self) -> None:
        self.conn.close()


class ReleasingClient(GatewayClient):
    """A client whose ``watched`` method's first answer (a refusal or not) calls ``release`` (lets
    the test's lock go); records that method's answers: a refusal's ``(status, code)``, else
    ``answered(result)``."""

    def __init__(
        self, *args: Any, release: Callable[[], None], watched: str,
        answered: Callable[[Any], object] = lambda result: result.outcome, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.release, self.answers = release, []
        method = getattr(self, watched)

        def spy(*args: Any, **kwargs: Any) -> Any:
            try:
                result = method(*args, **kwargs)
            except GatewayHTTPError as exc:
                self.answers.append((exc.status, exc.code))
                raise
            finally:
                if len(self.answers) <= 1:
                    self.release()
            self.answers.append(answered(result))
            return result

        setattr(self, watched, spy)


def new_agent(server: Server) -> GatewayClient:
    return GatewayClient(server.base, os.urandom(32))


def enroll(agent: GatewayClient, community) -> None:
    gateway.enroll(community.id, agent.pubkey, enrolled_by="test")


def deliver(community, target: bytes, n: int = 1, **kwargs) -> list[WorkflowAgentDelivery]:
    """``n`` committed deliveries for ``target`` in ``community`` (one run, one message)."""
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    return [DeliveryFactory(binding__run=run, binding__message_event=event, binding__target_pubkey=target, **kwargs)
            for _ in range(n)]  # fmt: skip


def row_counts() -> dict[str, int]:
    """Rows per table the gateway could write, for nothing-written checks (SeenEvent apart)."""
    return {
        "enrollments": Enrollment.objects.count(),
        "seen": SeenEvent.objects.count(),
        "deliveries": WorkflowAgentDelivery.objects.count(),
    }


def delivery_state() -> list[tuple]:
    """Every delivery's mutable state, to compare before and after a refusal."""
    return list(
        WorkflowAgentDelivery.objects.order_by("id").values_list(
            "id", "status", "lease_generation", "lease_until", "attempt", "finished_at", "failure_code"
        )
    )


# The opening columns of the delivery claim and of the run claim, within the 1 kB of text
# pg_stat_activity keeps (after the tenant's set_config when tenant isolation is on).
DELIVERY_CLAIM_OPENING = "SELECT d.community_id, d.id, d.workflow_id, "
RUN_CLAIM_OPENING = "WITH candidate AS MATERIALIZED (\n    SELECT r.id FROM "

# A server for the wake-up tests: it polls every 600 s and lets a long-poll wait 600 s; their
# long-polls wait LONG_WAIT s. A long-poll that returns what was committed while it waited within
# WOKEN_WITHIN s (generous for a loaded CI) was woken by the commit's hint: neither a poll nor the
# end of its wait comes that soon.
WAKE_TEST_ENV = {"BUZZ_GATEWAY_POLL_SECONDS": "600", "BUZZ_GATEWAY_MAX_WAIT_SECONDS": "600"}
LONG_WAIT = 300
WOKEN_WITHIN = 60


def long_polls_waiting(claim_opening: str = DELIVERY_CLAIM_OPENING) -> int:
    """How many claims the test gateway is holding in a long-poll: its backends idle after a
    claim statement (a long-poll's first claim round, run inside its slots and before its wait;
    a request's connection closes when it ends). Known by the claim's opening columns
    (``claim_opening``: :data:`DELIVERY_CLAIM_OPENING`, or :data:`RUN_CLAIM_OPENING` for the
    run claims), which come within the 1 kB of text pg_stat_activity keeps (after the tenant's
    set_config when tenant isolation is on; the rest, the function's name on PostgreSQL, may be
    cut off)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'buzz-gateway-test'"
            " AND state = 'idle' AND strpos(query, %s) > 0",
            [claim_opening],
        )
        return cursor.fetchone()[0]


def wait_for_long_polls(server: Server, n: int, claim_opening: str = DELIVERY_CLAIM_OPENING) -> None:
    """Wait until the gateway's wake listener LISTENs (it starts with the first long-poll) and
    ``n`` long-polls wait (their first claim found nothing): from here only a hint (or the
    600 s poll of a :data:`WAKE_TEST_ENV` server) wakes them."""
    wait_for(lambda: "gateway listening" in server.log.read_text(), "the gateway's wake listener to LISTEN")
    wait_for(lambda: long_polls_waiting(claim_opening) == n, f"{n} long-poll(s) to wait")


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll ``condition`` until it holds (a generous bound: a loaded CI is slow, never wrong)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.05)


def long_poll_in_background(agent: GatewayClient, wait_seconds: float) -> tuple[threading.Thread, list]:
    """A thread long-polling ``agent``'s claim; the list receives its claims when it returns."""
    got: list = []
    waiter = threading.Thread(target=lambda: got.extend(agent.claim(wait_seconds=wait_seconds)))
    waiter.start()
    return waiter, got


def assert_woken_by_a_commit(community, agent: GatewayClient, waiter: threading.Thread, got: list) -> None:
    """Commit a delivery to ``agent`` and assert the waiting long-poll (of LONG_WAIT s, on a
    :data:`WAKE_TEST_ENV` server) returns it within WOKEN_WITHIN s: only a wake hint can do that."""
    (delivery,) = deliver(community, agent.pubkey)
    waiter.join(WOKEN_WITHIN)
    assert not waiter.is_alive(), (
        f"the long-poll was not woken by the wake hint within {WOKEN_WITHIN} s (its next poll is 600 s away)"
    )
    assert [c.lease.delivery_id for c in got] == [str(delivery.id)]
