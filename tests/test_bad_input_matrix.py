"""Bad input to every public service argument is refused, named, and writes nothing (SPEC sections 2, 4, 9).

Each case calls one public entry point with one wrong argument and expects either a
``ValidationError`` whose ``message_dict`` names that argument, or the documented domain
outcome (a miss, ``LeaseLost``, ``CommunityNotFound``...). Every case then compares a
snapshot of every buzz_delivery table taken before the call with one taken after.
"""

from __future__ import annotations

import argparse
import datetime as dt
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.db import connection, transaction

from buzz_delivery import exceptions, models, services
from buzz_delivery.management import options
from buzz_delivery.testing import (
    BindingFactory,
    CommunityFactory,
    EventFactory,
    WorkflowRunFactory,
    advance_to,
    random32,
)

pytestmark = pytest.mark.django_db

NAIVE = dt.datetime(2030, 1, 1, 12, 0, 0)
AWARE = dt.datetime(2030, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
HUGE_LEASE = 10**12
INT64_OVERFLOW = 2**63
LONG_TEXT = "x" * 10_000
HUGE_INT = 10**400  # too large for a float: float() raises OverflowError
ENORMOUS_INT = 10**5000  # longer than Python's 4,300-digit limit: str() and f-strings raise ValueError
LONE_HIGH = "\ud800"  # a lone surrogate: UTF-8 cannot encode it; json.dumps writes "\ud800", jsonb refuses that
LONE_LOW = "\udfff"
SPLIT_PAIR = "\ud83d\ude00"  # a surrogate pair as two code points: not text; json.dumps passes it off as an emoji
ASTRAL = "\U0001f600"  # one real code point beyond the BMP: fine everywhere
MICRO_OFFSET = dt.timezone(dt.timedelta(hours=1, microseconds=500))
SECONDS_MICRO_OFFSET = dt.timezone(dt.timedelta(hours=-5, seconds=7, microseconds=1))
EAST = dt.timezone(dt.timedelta(hours=1))
WEST = dt.timezone(dt.timedelta(hours=-1))
MIN_EAST = dt.datetime.min.replace(tzinfo=EAST)  # before year 1 in UTC
MAX_WEST = dt.datetime.max.replace(microsecond=0, tzinfo=WEST)  # after year 9999 in UTC
RETENTION = {"finished": dt.timedelta(days=30)}


@dataclass
class World:
    """Rows every case can aim at: community ``a`` (active) and ``b`` (active), ``quiet`` (quiescing)."""

    a: models.Community
    b: models.Community
    quiet: models.Community
    quiet_event: models.Event
    quiet_binding: services.Binding  # valid, uncommitted, of ``quiet``
    run: models.WorkflowRun
    event: models.Event
    binding: services.Binding  # a fresh, valid, not yet committed binding of ``a``
    pending_id: uuid.UUID  # pending in ``a``
    pending_binding: services.Binding
    pending_event: models.Event
    lease: services.Lease  # a current lease in ``a``
    b_lease: services.Lease  # a current lease in ``b``
    b_failed_id: uuid.UUID  # failed in ``b``
    b_run: models.WorkflowRun
    b_event: models.Event
    b_workflow: models.Workflow

    def binding_fields(self, **overrides: Any) -> dict[str, Any]:
        b = self.binding
        fields = {
            "community_id": b.community_id,
            "workflow_id": b.workflow_id,
            "run_id": b.run_id,
            "step_id": b.step_id,
            "target_pubkey": b.target_pubkey,
            "definition_event_id": b.definition_event_id,
            "message_event_id": b.message_event_id,
            "cause": b.cause,
        }
        fields.update(overrides)
        return fields

    def lease_fields(self, **overrides: Any) -> dict[str, Any]:
        lease = self.lease
        fields = {
            "community_id": lease.community_id,
            "delivery_id": lease.delivery_id,
            "target_pubkey": lease.target_pubkey,
            "lease_generation": lease.lease_generation,
            "lease_until": lease.lease_until,
        }
        fields.update(overrides)
        return fields


def _commit_one(community: models.Community) -> tuple[services.Binding, uuid.UUID, models.Event]:
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    binding = BindingFactory(run=run, message_event=event)
    (created,) = services.commit_deliveries(community.id, event, [binding])
    return binding, created, event


def _claim(community: models.Community) -> services.Lease:
    binding, _, _ = _commit_one(community)
    claim = services.claim_delivery(community.id, binding.target_pubkey, lease_seconds=60)
    assert claim is not None
    return claim.lease


@pytest.fixture
def world() -> World:
    a, b = CommunityFactory(), CommunityFactory()
    quiet = CommunityFactory()
    _, _, quiet_event = _commit_one(quiet)
    quiet_binding = BindingFactory(run=WorkflowRunFactory(community=quiet), message_event=quiet_event)
    advance_to(quiet, "quiescing")
    run = WorkflowRunFactory(community=a)
    event = EventFactory(community=a)
    pending_binding, pending_id, pending_event = _commit_one(a)
    b_failed = _claim(b)
    assert services.finish_delivery(b_failed, "failed") == services.Settled("failed")
    b_run = WorkflowRunFactory(community=b)
    return World(
        a=a,
        b=b,
        quiet=quiet,
        quiet_event=quiet_event,
        quiet_binding=quiet_binding,
        run=run,
        event=event,
        binding=BindingFactory(run=run, message_event=event),
        pending_id=pending_id,
        pending_binding=pending_binding,
        pending_event=pending_event,
        lease=_claim(a),
        b_lease=_claim(b),
        b_failed_id=b_failed.delivery_id,
        b_run=b_run,
        b_event=EventFactory(community=b),
        b_workflow=b_run.workflow,
    )


def commit(w: World, bindings: Any = None, **kwargs: Any) -> Any:
    kwargs.setdefault("community_id", w.a.id)
    kwargs.setdefault("message_event", w.event)
    return services.commit_deliveries(
        kwargs.pop("community_id"), kwargs.pop("message_event"), [w.binding] if bindings is None else bindings, **kwargs
    )


def target_of(w: World) -> bytes:
    return w.binding.target_pubkey


def run_lease_of(name: str = "bad-input-matrix", holder: str = "matrix:1:x") -> services.RunLease:
    """A run lease as a caller may rebuild one (no row needed: a refused call never reaches SQL)."""
    return services.RunLease(name=name, holder=holder, lease_until=AWARE)


def enter_run_lease(name: Any, ttl_seconds: Any) -> None:
    with services.run_lease(name, ttl_seconds):
        pass


Call = Callable[[World], Any]


def _params(table: list[tuple[str, Call, Any]]) -> list[Any]:
    return [pytest.param(c, k, id=i) for i, c, k in table]


# (case id, call, argument key the ValidationError must name)
REFUSED: list[tuple[str, Call, str]] = [
    # commit_deliveries
    ("commit community_id int", lambda w: commit(w, community_id=5), "community_id"),
    ("commit community_id not a uuid", lambda w: commit(w, community_id="nope"), "community_id"),
    ("commit community_id unknown", lambda w: commit(w, community_id=uuid.uuid4()), "message_event"),
    ("commit message_event None", lambda w: commit(w, message_event=None), "message_event"),
    ("commit message_event unsaved", lambda w: commit(w, message_event=models.Event(community=w.a)), "message_event"),
    ("commit message_event of another community", lambda w: commit(w, message_event=w.b_event), "message_event"),
    ("commit bindings empty list", lambda w: commit(w, []), "bindings"),
    ("commit bindings a str", lambda w: commit(w, "bindings"), "bindings"),
    ("commit bindings a dict", lambda w: commit(w, {"a": w.binding}), "bindings"),
    ("commit bindings None-like set", lambda w: commit(w, {w.binding}), "bindings"),
    ("commit bindings too many", lambda w: commit(w, [w.binding] * 10_001), "bindings"),
    ("commit bindings element not a Binding", lambda w: commit(w, [w.binding, object()]), "bindings[1]"),
    ("commit bindings duplicate identity in one batch", lambda w: commit(w, [w.binding, w.binding]), "bindings[1]"),
    (
        "commit bindings of another community",
        lambda w: commit(w, [services.Binding(**w.binding_fields(community_id=w.b.id))]),
        "bindings[0].community_id",
    ),
    (
        "commit bindings message_event_id differs",
        lambda w: commit(w, [services.Binding(**w.binding_fields(message_event_id=random32()))]),
        "bindings[0].message_event_id",
    ),
    (
        "commit binding run of another community",
        lambda w: commit(w, [services.Binding(**w.binding_fields(run_id=w.b_run.id))]),
        "bindings.run_id",
    ),
    (
        "commit binding run unknown",
        lambda w: commit(w, [services.Binding(**w.binding_fields(run_id=uuid.uuid4()))]),
        "bindings.run_id",
    ),
    (
        "commit binding workflow of another community",
        lambda w: commit(w, [services.Binding(**w.binding_fields(workflow_id=w.b_workflow.id))]),
        "bindings.workflow_id",
    ),
    (  # one key judges the pair (core migration 0036): the workflow must be the run's
        "commit binding workflow not the run's",
        lambda w: commit(w, [services.Binding(**w.binding_fields(workflow_id=w.pending_binding.workflow_id))]),
        "bindings.workflow_id",
    ),
    ("commit expires_at naive", lambda w: commit(w, expires_at=NAIVE), "expires_at"),
    ("commit expires_at a str", lambda w: commit(w, expires_at="2030-01-01T00:00:00Z"), "expires_at"),
    ("commit expires_at a number", lambda w: commit(w, expires_at=1_900_000_000), "expires_at"),
    ("commit execution_trace not JSON", lambda w: commit(w, execution_trace={"x": object()}), "execution_trace"),
    ("commit execution_trace too big", lambda w: commit(w, execution_trace="x" * 1_000_001), "execution_trace"),
    ("commit trigger_context not JSON", lambda w: commit(w, trigger_context={1, 2}), "trigger_context"),
    ("commit trigger_context too big", lambda w: commit(w, trigger_context=["y" * 1000] * 1001), "trigger_context"),
    # Binding and Cause constructors
    ("Binding community_id bad", lambda w: services.Binding(**w.binding_fields(community_id="x")), "community_id"),
    ("Binding workflow_id int", lambda w: services.Binding(**w.binding_fields(workflow_id=7)), "workflow_id"),
    ("Binding run_id bytes", lambda w: services.Binding(**w.binding_fields(run_id=b"\x00" * 16)), "run_id"),
    ("Binding step_id empty", lambda w: services.Binding(**w.binding_fields(step_id="")), "step_id"),
    ("Binding step_id blank", lambda w: services.Binding(**w.binding_fields(step_id=" \t\n")), "step_id"),
    ("Binding step_id 65 chars", lambda w: services.Binding(**w.binding_fields(step_id="s" * 65)), "step_id"),
    ("Binding step_id 10k chars", lambda w: services.Binding(**w.binding_fields(step_id=LONG_TEXT)), "step_id"),
    ("Binding step_id NUL", lambda w: services.Binding(**w.binding_fields(step_id="a\x00b")), "step_id"),
    ("Binding step_id int", lambda w: services.Binding(**w.binding_fields(step_id=12)), "step_id"),
    (
        "Binding target 31 bytes",
        lambda w: services.Binding(**w.binding_fields(target_pubkey=b"t" * 31)),
        "target_pubkey",
    ),
    (
        "Binding target 33 bytes",
        lambda w: services.Binding(**w.binding_fields(target_pubkey=b"t" * 33)),
        "target_pubkey",
    ),
    (
        "Binding target hex text",
        lambda w: services.Binding(**w.binding_fields(target_pubkey="ab" * 32)),
        "target_pubkey",
    ),
    ("Binding target None", lambda w: services.Binding(**w.binding_fields(target_pubkey=None)), "target_pubkey"),
    (
        "Binding definition_event_id empty",
        lambda w: services.Binding(**w.binding_fields(definition_event_id=b"")),
        "definition_event_id",
    ),
    (
        "Binding message_event_id 64 bytes",
        lambda w: services.Binding(**w.binding_fields(message_event_id=b"m" * 64)),
        "message_event_id",
    ),
    ("Binding cause a str", lambda w: services.Binding(**w.binding_fields(cause="event")), "cause"),
    ("Cause.event 31 bytes", lambda w: services.Cause.event(b"e" * 31), "cause.event_id"),
    ("Cause.event text", lambda w: services.Cause.event("e" * 32), "cause.event_id"),
    ("Cause.schedule naive", lambda w: services.Cause.schedule(NAIVE), "cause.scheduled_for"),
    (
        "Cause.schedule sub-second",
        lambda w: services.Cause.schedule(AWARE.replace(microsecond=5)),
        "cause.scheduled_for",
    ),
    ("Cause.schedule a date", lambda w: services.Cause.schedule(dt.date(2030, 1, 1)), "cause.scheduled_for"),
    ("Cause.webhook not a uuid", lambda w: services.Cause.webhook("hook-1"), "cause.webhook_invocation_id"),
    ("Cause.webhook int", lambda w: services.Cause.webhook(123), "cause.webhook_invocation_id"),
    ("Cause unknown kind", lambda w: services.Cause(kind="cron", event_id=b"e" * 32), "cause"),
    (
        "Cause two identities",
        lambda w: services.Cause(kind="event", event_id=b"e" * 32, webhook_invocation_id=uuid.uuid4()),
        "cause",
    ),
    ("Cause no identity", lambda w: services.Cause(kind="webhook"), "cause"),
    # Lease constructor
    ("Lease community_id bad", lambda w: services.Lease(**w.lease_fields(community_id="?")), "lease.community_id"),
    ("Lease delivery_id int", lambda w: services.Lease(**w.lease_fields(delivery_id=1)), "lease.delivery_id"),
    (
        "Lease target 16 bytes",
        lambda w: services.Lease(**w.lease_fields(target_pubkey=b"x" * 16)),
        "lease.target_pubkey",
    ),
    ("Lease generation 0", lambda w: services.Lease(**w.lease_fields(lease_generation=0)), "lease.lease_generation"),
    (
        "Lease generation negative",
        lambda w: services.Lease(**w.lease_fields(lease_generation=-1)),
        "lease.lease_generation",
    ),
    (
        "Lease generation 64-bit overflow",
        lambda w: services.Lease(**w.lease_fields(lease_generation=INT64_OVERFLOW)),
        "lease.lease_generation",
    ),
    (
        "Lease generation a str",
        lambda w: services.Lease(**w.lease_fields(lease_generation="1")),
        "lease.lease_generation",
    ),
    (
        "Lease generation a bool",
        lambda w: services.Lease(**w.lease_fields(lease_generation=True)),
        "lease.lease_generation",
    ),
    (
        "Lease generation a float",
        lambda w: services.Lease(**w.lease_fields(lease_generation=1.0)),
        "lease.lease_generation",
    ),
    ("Lease lease_until naive", lambda w: services.Lease(**w.lease_fields(lease_until=NAIVE)), "lease.lease_until"),
    ("Lease lease_until a str", lambda w: services.Lease(**w.lease_fields(lease_until="soon")), "lease.lease_until"),
    # claim_delivery
    ("claim community_id bad", lambda w: services.claim_delivery("x", target_of(w)), "community_id"),
    ("claim community_id None", lambda w: services.claim_delivery(None, target_of(w)), "community_id"),
    ("claim target 31 bytes", lambda w: services.claim_delivery(w.a.id, b"t" * 31), "target_pubkey"),
    ("claim target hex", lambda w: services.claim_delivery(w.a.id, target_of(w).hex()), "target_pubkey"),
    ("claim delivery_id bad", lambda w: services.claim_delivery(w.a.id, target_of(w), delivery_id="d"), "delivery_id"),
    (
        "claim delivery_id int",
        lambda w: services.claim_delivery(w.a.id, target_of(w), delivery_id=10**40),
        "delivery_id",
    ),
    (
        "claim expected not a Binding",
        lambda w: services.claim_delivery(w.a.id, target_of(w), expected={"x": 1}),
        "expected",
    ),
    ("claim lease 0", lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds=0), "lease_seconds"),
    (
        "claim lease negative",
        lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds=-30),
        "lease_seconds",
    ),
    (
        "claim lease below min",
        lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds=1),
        "lease_seconds",
    ),
    (
        "claim lease 10**12",
        lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds=HUGE_LEASE),
        "lease_seconds",
    ),
    (
        "claim lease inf",
        lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds=float("inf")),
        "lease_seconds",
    ),
    (
        "claim lease nan",
        lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds=float("nan")),
        "lease_seconds",
    ),
    ("claim lease a str", lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds="30"), "lease_seconds"),
    (
        "claim lease a bool",
        lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds=True),
        "lease_seconds",
    ),
    (
        "claim lease a timedelta",
        lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds=dt.timedelta(seconds=30)),
        "lease_seconds",
    ),
    # claim_deliveries
    ("claim batch limit 0", lambda w: services.claim_deliveries(w.a.id, target_of(w), limit=0), "limit"),
    ("claim batch limit negative", lambda w: services.claim_deliveries(w.a.id, target_of(w), limit=-5), "limit"),
    ("claim batch limit 10**9", lambda w: services.claim_deliveries(w.a.id, target_of(w), limit=10**9), "limit"),
    ("claim batch limit a float", lambda w: services.claim_deliveries(w.a.id, target_of(w), limit=2.0), "limit"),
    ("claim batch limit a str", lambda w: services.claim_deliveries(w.a.id, target_of(w), limit="5"), "limit"),
    ("claim batch limit None", lambda w: services.claim_deliveries(w.a.id, target_of(w), limit=None), "limit"),
    (
        "claim batch lease 10**12",
        lambda w: services.claim_deliveries(w.a.id, target_of(w), limit=5, lease_seconds=HUGE_LEASE),
        "lease_seconds",
    ),
    ("claim batch community bad", lambda w: services.claim_deliveries(b"", target_of(w), limit=5), "community_id"),
    ("claim batch target empty", lambda w: services.claim_deliveries(w.a.id, b"", limit=5), "target_pubkey"),
    # renew_delivery
    ("renew lease a dict", lambda w: services.renew_delivery(w.lease_fields()), "lease"),
    ("renew lease None", lambda w: services.renew_delivery(None), "lease"),
    ("renew lease 10**12", lambda w: services.renew_delivery(w.lease, HUGE_LEASE), "lease_seconds"),
    ("renew lease 0", lambda w: services.renew_delivery(w.lease, 0), "lease_seconds"),
    ("renew lease a str", lambda w: services.renew_delivery(w.lease, "60"), "lease_seconds"),
    # finish_delivery
    ("finish lease a tuple", lambda w: services.finish_delivery(tuple(w.lease_fields().values()), "finished"), "lease"),
    ("finish outcome unknown", lambda w: services.finish_delivery(w.lease, "done"), "outcome"),
    ("finish outcome None", lambda w: services.finish_delivery(w.lease, None), "outcome"),
    ("finish outcome upper case", lambda w: services.finish_delivery(w.lease, "FINISHED"), "outcome"),
    (
        "finish failure_code 65 chars",
        lambda w: services.finish_delivery(w.lease, "failed", failure_code="c" * 65),
        "failure_code",
    ),
    (
        "finish failure_code an int",
        lambda w: services.finish_delivery(w.lease, "failed", failure_code=500),
        "failure_code",
    ),
    (
        "finish failure_code with finished",
        lambda w: services.finish_delivery(w.lease, "finished", failure_code="x"),
        "failure_code",
    ),
    (
        "finish failure_code with retry",
        lambda w: services.finish_delivery(w.lease, "retry", failure_code="x"),
        "failure_code",
    ),
    (
        "finish failure_message 10001 chars",
        lambda w: services.finish_delivery(w.lease, "failed", failure_message="m" * 10_001),
        "failure_message",
    ),
    (
        "finish failure_message with finished",
        lambda w: services.finish_delivery(w.lease, "finished", failure_message="m"),
        "failure_message",
    ),
    (
        "finish failure_message bytes",
        lambda w: services.finish_delivery(w.lease, "failed", failure_message=b"m"),
        "failure_message",
    ),
    # reap / reap_expired_deliveries
    ("reap batch_size 0", lambda w: services.reap(batch_size=0), "batch_size"),
    ("reap batch_size 10**9", lambda w: services.reap(batch_size=10**9), "batch_size"),
    ("reap batch_size a str", lambda w: services.reap(batch_size="100"), "batch_size"),
    ("reap max_batches 0", lambda w: services.reap(max_batches=0), "max_batches"),
    ("reap max_batches negative", lambda w: services.reap(max_batches=-1), "max_batches"),
    ("reap max_batches a float", lambda w: services.reap(max_batches=1.5), "max_batches"),
    ("reap_expired batch_size negative", lambda w: services.reap_expired_deliveries(batch_size=-1), "batch_size"),
    ("reap_expired batch_size a bool", lambda w: services.reap_expired_deliveries(batch_size=True), "batch_size"),
    (
        "reap_expired max_batches 64-bit overflow",
        lambda w: services.reap_expired_deliveries(max_batches=INT64_OVERFLOW),
        "max_batches",
    ),
    # get_delivery
    ("get community_id bad", lambda w: services.get_delivery("x", w.pending_id), "community_id"),
    ("get delivery_id bad", lambda w: services.get_delivery(w.a.id, "y"), "delivery_id"),
    ("get delivery_id None", lambda w: services.get_delivery(w.a.id, None), "delivery_id"),
    # advance_community / purge_community
    ("advance community_id bad", lambda w: services.advance_community("x", "quiescing"), "community_id"),
    ("advance state unknown", lambda w: services.advance_community(w.a.id, "deleted"), "state"),
    ("advance state None", lambda w: services.advance_community(w.a.id, None), "state"),
    ("advance state upper case", lambda w: services.advance_community(w.a.id, "QUIESCING"), "state"),
    ("purge community_id bad", lambda w: services.purge_community(12), "community_id"),
    ("purge batch_size 0", lambda w: services.purge_community(w.quiet.id, batch_size=0), "batch_size"),
    ("purge batch_size 10**9", lambda w: services.purge_community(w.quiet.id, batch_size=10**9), "batch_size"),
    # lock_delivery_identity (inside the test's transaction)
    ("lock community_id bad", lambda w: services.lock_delivery_identity("x", w.run.id, "s"), "community_id"),
    ("lock run_id bad", lambda w: services.lock_delivery_identity(w.a.id, "r", "s"), "run_id"),
    ("lock step_id blank", lambda w: services.lock_delivery_identity(w.a.id, w.run.id, "  "), "step_id"),
    ("lock step_id 10k chars", lambda w: services.lock_delivery_identity(w.a.id, w.run.id, LONG_TEXT), "step_id"),
    ("lock step_id None", lambda w: services.lock_delivery_identity(w.a.id, w.run.id, None), "step_id"),
    # operator actions
    ("requeue community_id bad", lambda w: services.requeue_delivery("x", w.b_failed_id), "community_id"),
    ("requeue delivery_id bad", lambda w: services.requeue_delivery(w.b.id, 3), "delivery_id"),
    ("force-fail delivery_id bad", lambda w: services.force_fail_delivery(w.a.id, "z"), "delivery_id"),
    (
        "force-fail failure_message 10001 chars",
        lambda w: services.force_fail_delivery(w.a.id, w.lease.delivery_id, failure_message="m" * 10_001),
        "failure_message",
    ),
    # --- values that pass the type checks, then fail in Python before any SQL (OverflowError from
    # float(), ValueError from printing an int of more than 4,300 digits) or are wrongly accepted ---
    # lone surrogates in text: UTF-8 cannot encode them, so the driver would fail on them later
    (
        "Binding step_id lone surrogate",
        lambda w: services.Binding(**w.binding_fields(step_id="s" + LONE_HIGH)),
        "step_id",
    ),
    (
        "Binding step_id split surrogate pair",
        lambda w: services.Binding(**w.binding_fields(step_id=SPLIT_PAIR)),
        "step_id",
    ),
    # datetimes: the instant must be whole seconds in UTC, and representable in UTC
    (
        "Cause.schedule offset with microseconds",
        lambda w: services.Cause.schedule(AWARE.replace(tzinfo=MICRO_OFFSET)),
        "cause.scheduled_for",
    ),
    (
        "Cause.schedule offset with seconds and microseconds",
        lambda w: services.Cause.schedule(AWARE.replace(tzinfo=SECONDS_MICRO_OFFSET)),
        "cause.scheduled_for",
    ),
    ("Cause.schedule datetime.min east of UTC", lambda w: services.Cause.schedule(MIN_EAST), "cause.scheduled_for"),
    ("Cause.schedule datetime.max west of UTC", lambda w: services.Cause.schedule(MAX_WEST), "cause.scheduled_for"),
    (
        "Lease lease_until datetime.min east of UTC",
        lambda w: services.Lease(**w.lease_fields(lease_until=MIN_EAST)),
        "lease.lease_until",
    ),
    (
        "Lease lease_until datetime.max west of UTC",
        lambda w: services.Lease(**w.lease_fields(lease_until=MAX_WEST)),
        "lease.lease_until",
    ),
    # ints no float can hold, ints no str() can print
    (
        "Lease generation 5001 digits",
        lambda w: services.Lease(**w.lease_fields(lease_generation=ENORMOUS_INT)),
        "lease.lease_generation",
    ),
    (
        "Lease generation minus 5001 digits",
        lambda w: services.Lease(**w.lease_fields(lease_generation=-ENORMOUS_INT)),
        "lease.lease_generation",
    ),
    (
        "claim lease 10**400",
        lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds=HUGE_INT),
        "lease_seconds",
    ),
    (
        "claim lease -10**400",
        lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds=-HUGE_INT),
        "lease_seconds",
    ),
    (
        "claim lease 5001 digits",
        lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds=ENORMOUS_INT),
        "lease_seconds",
    ),
    (
        "claim lease a Fraction too large for a float",
        lambda w: services.claim_delivery(w.a.id, target_of(w), lease_seconds=Fraction(HUGE_INT, 3)),
        "lease_seconds",
    ),
    (
        "claim batch lease 10**400",
        lambda w: services.claim_deliveries(w.a.id, target_of(w), limit=5, lease_seconds=HUGE_INT),
        "lease_seconds",
    ),
    (
        "claim batch limit 5001 digits",
        lambda w: services.claim_deliveries(w.a.id, target_of(w), limit=ENORMOUS_INT),
        "limit",
    ),
    ("renew lease 10**400", lambda w: services.renew_delivery(w.lease, HUGE_INT), "lease_seconds"),
    ("renew lease -10**400", lambda w: services.renew_delivery(w.lease, -HUGE_INT), "lease_seconds"),
    ("reap batch_size 5001 digits", lambda w: services.reap(batch_size=ENORMOUS_INT), "batch_size"),
    ("reap max_batches 5001 digits", lambda w: services.reap(max_batches=ENORMOUS_INT), "max_batches"),
    (
        "reap_expired batch_size 5001 digits",
        lambda w: services.reap_expired_deliveries(batch_size=ENORMOUS_INT),
        "batch_size",
    ),
    (
        "purge batch_size 5001 digits",
        lambda w: services.purge_community(w.quiet.id, batch_size=ENORMOUS_INT),
        "batch_size",
    ),
    (
        "prune batch_size 5001 digits",
        lambda w: services.prune_deliveries(RETENTION, batch_size=ENORMOUS_INT),
        "batch_size",
    ),
    (
        "prune max_batches minus 5001 digits",
        lambda w: services.prune_deliveries(RETENTION, max_batches=-ENORMOUS_INT),
        "max_batches",
    ),
    ("acquire run lease ttl 10**400", lambda w: services.acquire_run_lease("matrix", HUGE_INT), "ttl_seconds"),
    ("acquire run lease ttl -10**400", lambda w: services.acquire_run_lease("matrix", -HUGE_INT), "ttl_seconds"),
    (
        "acquire run lease ttl a Fraction too large for a float",
        lambda w: services.acquire_run_lease("matrix", Fraction(HUGE_INT, 7)),
        "ttl_seconds",
    ),
    ("renew run lease ttl 10**400", lambda w: services.renew_run_lease(run_lease_of(), HUGE_INT), "ttl_seconds"),
    ("run_lease ttl 10**400", lambda w: enter_run_lease("matrix", HUGE_INT), "ttl_seconds"),
    # not the type expected at all
    ("renew run lease a str", lambda w: services.renew_run_lease("matrix", 60), "lease"),
    ("release run lease None", lambda w: services.release_run_lease(None), "lease"),
    ("acquire run lease ttl a str", lambda w: services.acquire_run_lease("matrix", "60"), "ttl_seconds"),
    ("acquire run lease name an int", lambda w: services.acquire_run_lease(7, 60), "name"),
    ("prune retention a list", lambda w: services.prune_deliveries([("finished", dt.timedelta(days=1))]), "retention"),
    (
        "prune retention age a number of seconds",
        lambda w: services.prune_deliveries({"finished": 86_400}),
        "retention",
    ),
]


@pytest.mark.parametrize(("call", "key"), _params(REFUSED))
def test_bad_argument_is_refused_by_name_and_writes_nothing(world, call, key):
    before = _every_app_table()
    with pytest.raises(ValidationError) as raised:
        call(world)
    assert key in raised.value.message_dict, raised.value.message_dict
    assert _every_app_table() == before


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# Regressions: values PostgreSQL or the driver cannot take (NaN/Infinity in jsonb; NUL or surrogate
# code points in text or jsonb; datetimes UTC cannot represent; retention ages beyond interval
# arithmetic) and a snapshot nested too deep for json.dumps used to fail with DataError,
# UnicodeEncodeError or RecursionError (or be stored altered) instead of a ValidationError naming
# the argument. Each is refused before any SQL runs.
UNCHECKED_BEFORE_SQL: list[tuple[str, Call, str]] = [
    ("commit execution_trace NaN", lambda w: commit(w, execution_trace={"x": float("nan")}), "execution_trace"),
    ("commit execution_trace Infinity", lambda w: commit(w, execution_trace=[float("inf")]), "execution_trace"),
    ("commit execution_trace NUL in a string", lambda w: commit(w, execution_trace={"x": "a\x00b"}), "execution_trace"),
    ("commit trigger_context NUL in a key", lambda w: commit(w, trigger_context={"a\x00": 1}), "trigger_context"),
    ("commit execution_trace nested 5000 deep", lambda w: commit(w, execution_trace=_nested(5000)), "execution_trace"),
    # Deep enough that a reader whose stack is already deep (a view, the admin) cannot load it
    # back, shallow enough that json.dumps here passed it (issue 27): bounded at 100 levels.
    ("commit execution_trace nested 200 deep", lambda w: commit(w, execution_trace=_nested(200)), "execution_trace"),
    ("commit trigger_context nested 101 deep", lambda w: commit(w, trigger_context=_nested(101)), "trigger_context"),
    (
        "finish failure_message NUL",
        lambda w: services.finish_delivery(w.lease, "failed", failure_message="a\x00b"),
        "failure_message",
    ),
    (
        "finish failure_code NUL",
        lambda w: services.finish_delivery(w.lease, "failed", failure_code="x\x00"),
        "failure_code",
    ),
    (
        "retry failure_message NUL",
        lambda w: services.finish_delivery(w.lease, "retry", failure_message="\x00"),
        "failure_message",
    ),
    (
        "force-fail failure_message NUL",
        lambda w: services.force_fail_delivery(w.a.id, w.lease.delivery_id, failure_message="\x00"),
        "failure_message",
    ),
    # lone surrogates: the driver cannot encode them as UTF-8, and jsonb refuses the "\ud800" escape
    # json.dumps writes for one (the pair of escapes it writes for a real astral character is fine)
    (
        "commit execution_trace lone surrogate in a string",
        lambda w: commit(w, execution_trace={"x": "a" + LONE_HIGH}),
        "execution_trace",
    ),
    (
        "commit execution_trace lone low surrogate in a list",
        lambda w: commit(w, execution_trace=[LONE_LOW]),
        "execution_trace",
    ),
    (
        "commit trigger_context lone surrogate in a key",
        lambda w: commit(w, trigger_context={LONE_HIGH: 1}),
        "trigger_context",
    ),
    (
        "commit trigger_context lone surrogate nested deep",
        lambda w: commit(w, trigger_context={"a": [{"b": ["c", LONE_LOW]}]}),
        "trigger_context",
    ),
    (
        "commit trigger_context lone surrogate before text that looks like its pair",
        lambda w: commit(w, trigger_context={"x": LONE_HIGH + "\\udc00"}),
        "trigger_context",
    ),
    # two surrogate code points: json.dumps writes the escapes of an astral character, so jsonb would
    # silently store another string than the one given
    (
        "commit execution_trace split surrogate pair",
        lambda w: commit(w, execution_trace=[SPLIT_PAIR]),
        "execution_trace",
    ),
    (
        "lock step_id lone surrogate",
        lambda w: services.lock_delivery_identity(w.a.id, w.run.id, "step-" + LONE_HIGH),
        "step_id",
    ),
    (
        "finish failure_message lone surrogate",
        lambda w: services.finish_delivery(w.lease, "failed", failure_message="boom " + LONE_HIGH),
        "failure_message",
    ),
    (
        "finish failure_message split surrogate pair",
        lambda w: services.finish_delivery(w.lease, "failed", failure_message=SPLIT_PAIR),
        "failure_message",
    ),
    (
        "finish failure_code lone surrogate",
        lambda w: services.finish_delivery(w.lease, "failed", failure_code=LONE_LOW),
        "failure_code",
    ),
    (
        "retry failure_message lone surrogate",
        lambda w: services.finish_delivery(w.lease, "retry", failure_message=LONE_HIGH),
        "failure_message",
    ),
    (
        "finish batch failure_message lone surrogate",
        lambda w: services.finish_deliveries([w.lease], "failed", failure_message=LONE_HIGH),
        "failure_message",
    ),
    (
        "finish batch failure_code lone surrogate",
        lambda w: services.finish_deliveries([w.lease], "failed", failure_code="code" + LONE_LOW),
        "failure_code",
    ),
    (
        "settle batch failure_message lone surrogate",
        lambda w: services.settle_deliveries([services.Settle(w.lease, "retry", failure_message=LONE_HIGH)]),
        "settles[0].failure_message",
    ),
    (
        "settle batch failure_code lone surrogate",
        lambda w: services.settle_deliveries([services.Settle(w.lease, "failed", failure_code="code" + LONE_LOW)]),
        "settles[0].failure_code",
    ),
    (
        "force-fail failure_message lone surrogate",
        lambda w: services.force_fail_delivery(w.a.id, w.lease.delivery_id, failure_message=LONE_HIGH),
        "failure_message",
    ),
    ("acquire run lease name lone surrogate", lambda w: services.acquire_run_lease("job" + LONE_HIGH, 60), "name"),
    ("run_lease name lone surrogate", lambda w: enter_run_lease(LONE_LOW, 60), "name"),
    (
        "acquire run lease holder lone surrogate",
        lambda w: services.acquire_run_lease("job", 60, holder=LONE_HIGH),
        "holder",
    ),
    ("acquire run lease holder an int", lambda w: services.acquire_run_lease("job", 60, holder=42), "holder"),
    ("acquire run lease holder bytes", lambda w: services.acquire_run_lease("job", 60, holder=b"me"), "holder"),
    ("acquire run lease holder NUL", lambda w: services.acquire_run_lease("job", 60, holder="a\x00b"), "holder"),
    (
        "renew run lease name lone surrogate",
        lambda w: services.renew_run_lease(run_lease_of(name=LONE_HIGH), 60),
        "lease.name",
    ),
    (
        "release run lease holder lone surrogate",
        lambda w: services.release_run_lease(run_lease_of(holder=LONE_LOW)),
        "lease.holder",
    ),
    # datetimes UTC cannot represent in Python: PostgreSQL stores them, nothing can read them back
    ("commit expires_at datetime.min east of UTC", lambda w: commit(w, expires_at=MIN_EAST), "expires_at"),
    ("commit expires_at datetime.max west of UTC", lambda w: commit(w, expires_at=MAX_WEST), "expires_at"),
    # retention ages PostgreSQL's interval or timestamp arithmetic cannot take
    (
        "prune retention timedelta.max",
        lambda w: services.prune_deliveries({"failed": dt.timedelta.max}),
        "retention",
    ),
    (
        "prune retention 3,000,000 days",
        lambda w: services.prune_deliveries({"finished": dt.timedelta(days=3_000_000)}),
        "retention",
    ),
]


@pytest.mark.parametrize(("call", "key"), _params(UNCHECKED_BEFORE_SQL))
def test_text_and_json_postgresql_cannot_store_are_refused_by_name(world, call, key, django_assert_num_queries):
    before = _every_app_table()
    # The savepoint keeps a regression's DataError from breaking the test's transaction.
    with transaction.atomic(), django_assert_num_queries(0), pytest.raises(ValidationError) as raised:
        call(world)
    assert key in raised.value.message_dict, raised.value.message_dict
    assert _every_app_table() == before


def _lease_in_b_named_as_a(w: World) -> services.Lease:
    return replace(w.b_lease, community_id=w.a.id)


# Unknown ids, ids of another community, forged and stale values: the documented outcome, nothing written.
DOMAIN_OUTCOMES: list[tuple[str, Call, Callable[[Any], bool]]] = [
    (
        "claim in an unknown community is a miss",
        lambda w: services.claim_delivery(uuid.uuid4(), target_of(w)),
        lambda r: r is None,
    ),
    (
        "claim of an unknown delivery id is a miss",
        lambda w: services.claim_delivery(w.a.id, target_of(w), delivery_id=uuid.uuid4()),
        lambda r: r is None,
    ),
    (
        "claim of another community's delivery id is a miss",
        lambda w: services.claim_delivery(w.a.id, w.b_lease.target_pubkey, delivery_id=w.b_failed_id),
        lambda r: r is None,
    ),
    (
        "claim with an expected binding of another community is a miss",
        lambda w: services.claim_delivery(
            w.a.id, target_of(w), expected=services.Binding(**w.binding_fields(community_id=w.b.id))
        ),
        lambda r: r is None,
    ),
    (
        "claim in a quiescing community is a miss",
        lambda w: services.claim_deliveries(w.quiet.id, target_of(w), limit=1000),
        lambda r: r == [],
    ),
    (
        "claim batch in an unknown community is empty",
        lambda w: services.claim_deliveries(uuid.uuid4(), target_of(w), limit=1000),
        lambda r: r == [],
    ),
    (
        "renew of an unknown delivery is LeaseLost",
        lambda w: services.renew_delivery(replace(w.lease, delivery_id=uuid.uuid4())),
        lambda r: isinstance(r, services.LeaseLost),
    ),
    (
        "renew with the highest int64 generation is LeaseLost",
        lambda w: services.renew_delivery(replace(w.lease, lease_generation=2**63 - 1)),
        lambda r: isinstance(r, services.LeaseLost),
    ),
    (
        "renew of another community's lease under this community is LeaseLost",
        lambda w: services.renew_delivery(_lease_in_b_named_as_a(w)),
        lambda r: isinstance(r, services.LeaseLost),
    ),
    (
        "finish with another target is LeaseLost",
        lambda w: services.finish_delivery(replace(w.lease, target_pubkey=random32()), "finished"),
        lambda r: isinstance(r, services.LeaseLost),
    ),
    (
        "finish of another community's lease under this community is LeaseLost",
        lambda w: services.finish_delivery(_lease_in_b_named_as_a(w), "finished"),
        lambda r: isinstance(r, services.LeaseLost),
    ),
    (
        "finish with the next generation is LeaseLost",
        lambda w: services.finish_delivery(replace(w.lease, lease_generation=w.lease.lease_generation + 1), "failed"),
        lambda r: isinstance(r, services.LeaseLost),
    ),
    (
        "get of another community's delivery is None",
        lambda w: services.get_delivery(w.a.id, w.b_failed_id),
        lambda r: r is None,
    ),
    ("get of an unknown delivery is None", lambda w: services.get_delivery(w.a.id, uuid.uuid4()), lambda r: r is None),
    (
        "requeue of another community's delivery is skipped",
        lambda w: services.requeue_delivery(w.a.id, w.b_failed_id),
        lambda r: r.done is False,
    ),
    (
        "force-fail of another community's delivery is skipped",
        lambda w: services.force_fail_delivery(w.a.id, w.b_lease.delivery_id),
        lambda r: r.done is False,
    ),
    (
        "commit of an existing identity is an empty list",
        lambda w: services.commit_deliveries(w.a.id, w.pending_event, [w.pending_binding]),
        lambda r: r == [],
    ),
]


@pytest.mark.parametrize(("call", "expected"), [pytest.param(c, e, id=i) for i, c, e in DOMAIN_OUTCOMES])
def test_unknown_foreign_or_forged_ids_get_the_documented_outcome_and_write_nothing(
    world, table_snapshot, call, expected
):
    before = table_snapshot()
    assert expected(call(world))
    assert table_snapshot() == before


DOMAIN_ERRORS: list[tuple[str, Call, type[Exception]]] = [
    (
        "commit into a quiescing community",
        lambda w: services.commit_deliveries(w.quiet.id, w.quiet_event, [w.quiet_binding]),
        exceptions.CommunityNotWritable,
    ),
    (
        "advance an unknown community",
        lambda w: services.advance_community(uuid.uuid4(), "quiescing"),
        exceptions.CommunityNotFound,
    ),
    ("advance backward", lambda w: services.advance_community(w.quiet.id, "active"), exceptions.LifecycleError),
    ("advance to the same state", lambda w: services.advance_community(w.a.id, "active"), exceptions.LifecycleError),
    ("advance skipping a state", lambda w: services.advance_community(w.a.id, "fenced"), exceptions.LifecycleError),
    (
        "advance to tombstone without purge",
        lambda w: services.advance_community(w.a.id, "tombstone"),
        exceptions.LifecycleError,
    ),
    ("purge an unknown community", lambda w: services.purge_community(uuid.uuid4()), exceptions.CommunityNotFound),
    ("purge an active community", lambda w: services.purge_community(w.a.id), exceptions.LifecycleError),
    ("purge a quiescing community", lambda w: services.purge_community(w.quiet.id), exceptions.LifecycleError),
]


@pytest.mark.parametrize(("call", "error"), [pytest.param(c, e, id=i) for i, c, e in DOMAIN_ERRORS])
def test_domain_error_is_raised_and_nothing_is_written(world, table_snapshot, call, error):
    before = table_snapshot()
    with pytest.raises(error):
        call(world)
    assert table_snapshot() == before


# --- management command options ------------------------------------------------------------

COMMAND_OPTIONS: list[tuple[str, str, list[str]]] = [
    ("reap batch-size 0", "reap_deliveries", ["--batch-size=0"]),
    ("reap batch-size text", "reap_deliveries", ["--batch-size=ten"]),
    ("reap max-batches negative", "reap_deliveries", ["--max-batches=-1"]),
    ("reap lease-seconds 0", "reap_deliveries", ["--lease-seconds=0"]),
    ("reap lease-seconds text", "reap_deliveries", ["--lease-seconds=soon"]),
    ("reap interval 0", "reap_deliveries", ["--loop", "--interval=0"]),
    ("reap unknown option", "reap_deliveries", ["--frobnicate"]),
    ("prune without older-than", "prune_deliveries", []),
    ("prune older-than 0d", "prune_deliveries", ["--older-than=0d"]),
    ("prune older-than unknown unit", "prune_deliveries", ["--older-than=30y"]),
    ("prune older-than huge", "prune_deliveries", ["--older-than=99999999d"]),
    ("prune status not terminal", "prune_deliveries", ["--older-than=1d", "--status=claimed"]),
    ("prune retain without age", "prune_deliveries", ["--older-than=1d", "--retain=failed"]),
    ("prune retain unknown status", "prune_deliveries", ["--older-than=1d", "--retain=pending=1d"]),
    (
        "prune retain a status not pruned",
        "prune_deliveries",
        ["--older-than=1d", "--status=finished", "--retain=failed=90d"],
    ),
    ("prune batch-size 0", "prune_deliveries", ["--older-than=1d", "--batch-size=0"]),
    ("purge without id", "purge_community", ["--yes"]),
    ("purge id not a uuid", "purge_community", ["nope", "--yes"]),
    ("purge batch-size 0", "purge_community", ["{quiet}", "--yes", "--batch-size=0"]),
    ("purge batch-size 10**9", "purge_community", ["{quiet}", "--yes", "--batch-size=1000000000"]),
    ("purge unknown community", "purge_community", ["{unknown}", "--yes"]),
    ("purge an active community", "purge_community", ["{a}", "--yes"]),
    ("purge a quiescing community", "purge_community", ["{quiet}", "--yes"]),
    ("worker without community", "run_delivery_worker", ["--target={target}", "--handler={handler}"]),
    (
        "worker community not a uuid",
        "run_delivery_worker",
        ["--community=x", "--target={target}", "--handler={handler}"],
    ),
    ("worker target 63 hex", "run_delivery_worker", ["--community={a}", "--target={target63}", "--handler={handler}"]),
    (
        "worker target not hex",
        "run_delivery_worker",
        ["--community={a}", "--target=" + "zz" * 32, "--handler={handler}"],
    ),
    (
        "worker target 64 characters with spaces",
        "run_delivery_worker",
        ["--community={a}", "--target=00 " + "ab" * 30 + " ", "--handler={handler}"],
    ),
    ("worker handler missing", "run_delivery_worker", ["--community={a}", "--target={target}"]),
    (
        "worker handler not importable",
        "run_delivery_worker",
        ["--community={a}", "--target={target}", "--handler=no.such.module:handle"],
    ),
    (
        "worker concurrency 0",
        "run_delivery_worker",
        ["--community={a}", "--target={target}", "--handler={handler}", "--concurrency=0"],
    ),
    (
        "worker concurrency 257",
        "run_delivery_worker",
        ["--community={a}", "--target={target}", "--handler={handler}", "--concurrency=257"],
    ),
    (
        "worker lease-seconds 0",
        "run_delivery_worker",
        ["--community={a}", "--target={target}", "--handler={handler}", "--lease-seconds=0"],
    ),
    (
        "worker lease-seconds 10**12",
        "run_delivery_worker",
        ["--community={a}", "--target={target}", "--handler={handler}", "--lease-seconds=1000000000000"],
    ),
    (
        "worker batch-size 1001",
        "run_delivery_worker",
        ["--community={a}", "--target={target}", "--handler={handler}", "--batch-size=1001"],
    ),
    (
        "worker poll-interval negative",
        "run_delivery_worker",
        ["--community={a}", "--target={target}", "--handler={handler}", "--poll-interval=-1"],
    ),
    (
        "worker renew-fraction 1",
        "run_delivery_worker",
        ["--community={a}", "--target={target}", "--handler={handler}", "--renew-fraction=1"],
    ),
    (
        "worker max-deliveries 0",
        "run_delivery_worker",
        ["--community={a}", "--target={target}", "--handler={handler}", "--max-deliveries=0"],
    ),
    (
        "worker idle-exit inf",
        "run_delivery_worker",
        ["--community={a}", "--target={target}", "--handler={handler}", "--idle-exit=inf"],
    ),
]


def _every_app_table() -> dict[str, list[tuple]]:
    """Every table of the buzz_delivery app (the run-lease table of the commands included)."""
    from django.apps import apps

    out = {}
    with connection.cursor() as cursor:
        for model in apps.get_app_config("buzz_delivery").get_models():
            cursor.execute(f"SELECT * FROM {model._meta.db_table} ORDER BY 1")
            out[model._meta.db_table] = cursor.fetchall()
    return out


def _known_commands() -> set[str]:
    from django.core.management import get_commands

    return set(get_commands())


@pytest.mark.parametrize(("command", "argv"), [pytest.param(c, a, id=i) for i, c, a in COMMAND_OPTIONS])
def test_bad_command_option_raises_command_error_and_writes_nothing(world, command, argv, tmp_path):
    if command not in _known_commands():
        pytest.skip(f"{command} is not installed")
    values = {
        "a": w_id(world.a),
        "quiet": w_id(world.quiet),
        "unknown": str(uuid.uuid4()),
        "target": target_of(world).hex(),
        "target63": target_of(world).hex()[:63],
        "handler": "tests.test_bad_input_matrix:never_called",
    }
    args = [a.format(**values) for a in argv]
    # Safety net: should a case wrongly pass validation, the worker stops at once instead of running on.
    if command == "run_delivery_worker":
        args += ["--idle-exit=0.2", "--max-deliveries=1", "--poll-interval=0.1"]
    before = _every_app_table()
    with pytest.raises(CommandError):
        call_command(command, *args, stdout=(tmp_path / "out").open("w"), stderr=(tmp_path / "err").open("w"))
    assert _every_app_table() == before


def w_id(community: models.Community) -> str:
    return str(community.id)


def never_called(delivery: Any) -> None:
    raise AssertionError("the handler of a refused worker command must never run")


# --- argparse type= validators of buzz_delivery.management.options ---------------------------

HEX64 = "ab" * 32

# (case id, validator name in options, argument text): argparse.ArgumentTypeError expected
OPTION_REFUSED: list[tuple[str, str, str]] = [
    ("pubkey_hex a space inside", "pubkey_hex", "00 " + "ab" * 30 + " "),
    ("pubkey_hex leading spaces", "pubkey_hex", "  " + "ab" * 31),
    ("pubkey_hex a tab inside", "pubkey_hex", "ab" * 15 + "\t\t" + "ab" * 16),
    ("pubkey_hex a trailing newline", "pubkey_hex", "ab" * 31 + "a\n"),
    ("pubkey_hex 63 hex digits", "pubkey_hex", HEX64[:63]),
    ("pubkey_hex 65 hex digits", "pubkey_hex", HEX64 + "a"),
    ("pubkey_hex not hex", "pubkey_hex", "zz" * 32),
    ("pubkey_hex non-ASCII digits", "pubkey_hex", "\u0661" * 64),
    ("pubkey_hex a 0x prefix", "pubkey_hex", "0x" + "ab" * 31),
    ("pubkey_hex empty", "pubkey_hex", ""),
    ("lease_seconds_option 0", "lease_seconds_option", "0"),
    ("lease_seconds_option negative", "lease_seconds_option", "-60"),
    ("lease_seconds_option below the minimum", "lease_seconds_option", "14.9"),
    ("lease_seconds_option above the maximum", "lease_seconds_option", "300.5"),
    ("lease_seconds_option 10**12", "lease_seconds_option", "1000000000000"),
    ("lease_seconds_option inf", "lease_seconds_option", "inf"),
    ("lease_seconds_option -inf", "lease_seconds_option", "-inf"),
    ("lease_seconds_option nan", "lease_seconds_option", "nan"),
    ("lease_seconds_option 1e400", "lease_seconds_option", "1e400"),
    ("lease_seconds_option 400 digits", "lease_seconds_option", "9" * 400),
    ("lease_seconds_option 5000 digits", "lease_seconds_option", "9" * 5000),
    ("lease_seconds_option text", "lease_seconds_option", "soon"),
    ("lease_seconds_option with a unit", "lease_seconds_option", "60s"),
    ("lease_seconds_option empty", "lease_seconds_option", ""),
    ("run_lease_seconds 0", "run_lease_seconds", "0"),
    ("run_lease_seconds below 1", "run_lease_seconds", "0.5"),
    ("run_lease_seconds negative", "run_lease_seconds", "-1"),
    ("run_lease_seconds above a day", "run_lease_seconds", "86401"),
    ("run_lease_seconds inf", "run_lease_seconds", "inf"),
    ("run_lease_seconds nan", "run_lease_seconds", "nan"),
    ("run_lease_seconds 1e400", "run_lease_seconds", "1e400"),
    ("run_lease_seconds 400 digits", "run_lease_seconds", "9" * 400),
    ("run_lease_seconds text", "run_lease_seconds", "later"),
    ("run_lease_seconds empty", "run_lease_seconds", ""),
]


@pytest.mark.parametrize(("validator", "text"), [pytest.param(n, t, id=i) for i, n, t in OPTION_REFUSED])
def test_bad_option_text_is_refused_by_its_argparse_type(validator, text):
    with pytest.raises(argparse.ArgumentTypeError):
        getattr(options, validator)(text)


# (case id, validator name in options, argument text, the value it parses to)
OPTION_ACCEPTED: list[tuple[str, str, str, Any]] = [
    ("pubkey_hex lower case", "pubkey_hex", HEX64, bytes.fromhex(HEX64)),
    ("pubkey_hex upper case", "pubkey_hex", HEX64.upper(), bytes.fromhex(HEX64)),
    ("lease_seconds_option the minimum", "lease_seconds_option", "15", 15.0),
    ("lease_seconds_option the maximum", "lease_seconds_option", "300", 300.0),
    ("lease_seconds_option a fraction", "lease_seconds_option", "42.5", 42.5),
    ("run_lease_seconds 1", "run_lease_seconds", "1", 1.0),
    ("run_lease_seconds a day", "run_lease_seconds", "86400", 86_400.0),
    ("run_lease_seconds a fraction", "run_lease_seconds", "2.5", 2.5),
]


@pytest.mark.parametrize(
    ("validator", "text", "value"), [pytest.param(n, t, x, id=i) for i, n, t, x in OPTION_ACCEPTED]
)
def test_good_option_text_is_parsed_by_its_argparse_type(validator, text, value):
    parsed = getattr(options, validator)(text)
    assert parsed == value and type(parsed) is type(value)


def test_lease_seconds_option_reads_the_configured_bounds_when_it_parses(settings):
    settings.BUZZ_DELIVERY = {"MIN_LEASE_SECONDS": 1, "MAX_LEASE_SECONDS": 30, "LEASE_SECONDS": 10}
    assert options.lease_seconds_option("1") == 1.0
    with pytest.raises(argparse.ArgumentTypeError, match=r"1\.\.30"):
        options.lease_seconds_option("31")


# --- edge values that are fine: accepted, stored as given, datetimes normalised to UTC ---------


def test_real_astral_characters_are_accepted_in_text_and_json(world):
    trace = {ASTRAL: [ASTRAL, {"k": "x" + ASTRAL}]}
    binding = services.Binding(**world.binding_fields(step_id="step " + ASTRAL))
    (created,) = commit(world, [binding], execution_trace=trace, trigger_context=ASTRAL)
    delivery = services.get_delivery(world.a.id, created)
    assert (delivery.step_id, delivery.execution_trace, delivery.trigger_context) == ("step " + ASTRAL, trace, ASTRAL)
    assert services.finish_delivery(world.lease, "failed", failure_code=ASTRAL, failure_message=ASTRAL) == (
        services.Settled("failed")
    )
    settled = models.WorkflowAgentDelivery.objects.get(id=world.lease.delivery_id)
    assert (settled.failure_code, settled.failure_message) == (ASTRAL, ASTRAL)


def test_aware_datetimes_are_normalised_to_utc(world):
    india = dt.timezone(dt.timedelta(hours=5, minutes=30))
    odd = dt.timezone(dt.timedelta(hours=2, seconds=30))  # whole seconds, not whole minutes
    for given in (
        AWARE.astimezone(india),
        AWARE.replace(tzinfo=odd),
        AWARE.replace(tzinfo=MICRO_OFFSET, microsecond=500),
    ):
        cause = services.Cause.schedule(given)
        assert cause.scheduled_for == given and cause.scheduled_for.tzinfo is dt.UTC
    lease = services.Lease(**world.lease_fields(lease_until=AWARE.astimezone(india)))
    assert lease.lease_until == AWARE and lease.lease_until.tzinfo is dt.UTC

    expires = dt.datetime(2031, 5, 6, 7, 8, 9, 123, tzinfo=MICRO_OFFSET)
    scheduled = dt.datetime(2030, 1, 1, 13, 0, 0, tzinfo=odd)
    binding = services.Binding(**world.binding_fields(cause=services.Cause.schedule(scheduled)))
    (created,) = commit(world, [binding], expires_at=expires)
    delivery = services.get_delivery(world.a.id, created)
    assert (delivery.expires_at, delivery.cause_scheduled_for) == (expires, scheduled)
