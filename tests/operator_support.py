"""Helpers for the operator-surface tests (commands, admin, browser): deliveries in a given
state, made through the services, with time passing simulated by back-dating columns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from django.db import connection

from buzz_delivery import models, services
from buzz_delivery.testing import (
    BindingFactory,
    DeliveryFactory,
    EventFactory,
    Expr,
    WorkflowRunFactory,
    set_delivery_state,
)
from tests.conftest import backdate_lease

ROOT = Path(__file__).resolve().parent.parent


def pending(community: models.Community, **binding: object) -> models.WorkflowAgentDelivery:
    """A pending delivery of ``community`` on a fresh run and message event."""
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    return DeliveryFactory(binding=BindingFactory(run=run, message_event=event, **binding))


def claimed(community: models.Community, **binding: object) -> tuple[models.WorkflowAgentDelivery, services.Lease]:
    """A claimed delivery and its lease."""
    delivery = pending(community, **binding)
    claim = services.claim_delivery(community.pk, bytes(delivery.target_pubkey), delivery_id=delivery.pk)
    assert claim is not None
    delivery.refresh_from_db()
    return delivery, claim.lease


def lapsed(community: models.Community, **binding: object) -> models.WorkflowAgentDelivery:
    """A claimed delivery whose lease ran out an hour ago (not yet reaped)."""
    delivery, _ = claimed(community, **binding)
    backdate_lease(delivery.pk, 3600)
    delivery.refresh_from_db()
    return delivery


def settled(
    community: models.Community, outcome: str = "finished", *, age_seconds: float = 0
) -> models.WorkflowAgentDelivery:
    """A delivery settled with ``outcome`` (``finished`` / ``failed``) ``age_seconds`` ago."""
    delivery, lease = claimed(community)
    assert isinstance(services.finish_delivery(lease, outcome), services.Settled)
    if age_seconds:
        backdate_finished(delivery.pk, age_seconds)
    delivery.refresh_from_db()
    return delivery


# The settle tally's row of a delivery's settling statement: the trigger stamps it with that
# statement's clock, the delivery's finished_at (core migration 0039).
_BACKDATE_TALLY = f"""
UPDATE {models.SETTLE_TALLY_TABLE} AS t SET at = buzz_delivery_plus_seconds(t.at, -%s)
FROM {models.DELIVERY_RECORD_TABLE} AS d
WHERE d.id = %s AND t.community_id = d.community_id AND t.status = d.status AND t.at = d.finished_at
"""


def backdate_finished(delivery_id: object, seconds: float) -> None:
    """Stand-in for time passing: ``finished_at`` moves ``seconds`` into the past (``created_at`` with
    it, and the settle tally's row its settle wrote)."""
    with connection.cursor() as cursor:
        cursor.execute(_BACKDATE_TALLY, [seconds, delivery_id])
    set_delivery_state(
        delivery_id,
        finished_at=Expr("now() - make_interval(secs => %s)", [seconds]),
        created_at=Expr("buzz_delivery_plus_seconds(created_at, -%s)", [seconds]),
    )


def lease_rows() -> list[tuple[str, str]]:
    """Every row of the maintenance lease table: (name, holder)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT name, holder FROM buzz_delivery_maintenance_lease ORDER BY name")
        return cursor.fetchall()


def parse_kv(line: str) -> dict[str, str]:
    """``"a=1 b=x"`` -> ``{"a": "1", "b": "x"}`` (values as printed)."""
    return dict(part.split("=", 1) for part in line.split())


def database_url() -> str:
    """A DATABASE_URL for the test database the current connection uses (for subprocesses)."""
    from project.database_url import database_url as url_for

    return url_for(connection.settings_dict)


def manage(*args: str, database: str | None = None, **kwargs: object) -> subprocess.Popen:
    """Start ``manage.py <args>`` as a real process on the test database."""
    env = {**os.environ, "DATABASE_URL": database or database_url(), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )
