"""The services agree with a pure-Python model of SPEC sections 4-6 under random operation sequences.

Hypothesis drives the same random sequence of commit / claim / claim batch / renew / finish
(finished, failed, retry) / reap (dry run, then for real) / clock advance / lifecycle move and
purge / operator requeue and force-fail / stale and forged lease use through both the model and
the real services on PostgreSQL, and compares every outcome and every row after each step.

Time: every example runs inside one transaction (a savepoint of the test's), so PostgreSQL's
``now()`` stands still at ``T0``, and ``frozen_db_clock`` makes the services' statement clock
stand still there too. Time passing is modelled by moving every stored deadline
(``lease_until``, ``next_attempt_at``, ``expires_at``) of the example's rows back with raw SQL; the
model keeps those deadlines as seconds relative to ``now`` and subtracts the same amount. The raw
shift also reaches communities behind the write fence (time passes for them too), so it runs with
``session_replication_role = replica`` for that one statement.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from buzz_delivery import backoff, exceptions, services
from buzz_delivery.testing import (
    CommunityFactory,
    EventFactory,
    Expr,
    WorkflowRunFactory,
    frozen_db_clock,
    random32,
    set_delivery_state,
)
from tests.model_support import run_machine

pytestmark = pytest.mark.django_db

BACKOFF_BASE = 5
BACKOFF_CAP = 40
LEASES = (15, 30)
CLOCK_STEPS = (1, 4, 5, 10, 14, 15, 16, 20, 29, 30, 31, 60, 301)
TTLS = (None, 5, 15, 20, 31, 100)
TERMINAL = ("finished", "failed", "expired")
LIFECYCLE_NEXT = {"active": "quiescing", "quiescing": "fenced"}

STATS = {"examples": 0, "steps": 0}
SEEN: Counter[str] = Counter()


def event(label: str) -> None:
    """Tally an outcome kind, printed at the end (pytest -s) to show what the runs covered."""
    SEEN[label] += 1


# --- the model (SPEC sections 4-6) ---------------------------------------------------------


@dataclass
class Row:
    """One delivery as the SPEC says it should be. Deadlines: seconds relative to now, or None."""

    id: uuid.UUID
    community: int
    target: int
    order: tuple[dt.datetime, uuid.UUID]  # (created_at, id): "oldest" for claims
    binding: services.Binding
    max_attempts: int | None
    expires_at: float | None
    status: str = "pending"
    generation: int = 0
    attempt: int = 0
    lease_until: float | None = None
    next_attempt_at: float | None = None
    failure_code: str | None = None

    def observed(self) -> tuple[Any, ...]:
        return (
            self.status,
            self.generation,
            self.attempt,
            self.lease_until,
            self.next_attempt_at,
            self.expires_at,
            self.failure_code,
        )


class SpecModel:
    """Statuses, generation, attempt/max_attempts, retry gate, TTL and write fence, no database."""

    def __init__(self, community_ids: list[uuid.UUID], targets: list[bytes]) -> None:
        self.community_ids = community_ids
        self.targets = targets
        self.states = ["active"] * len(community_ids)
        self.rows: dict[uuid.UUID, Row] = {}

    def active(self, community: int) -> bool:
        return self.states[community] == "active"

    def claimable(self, row: Row) -> bool:
        return (
            row.status == "pending"
            and (row.next_attempt_at is None or row.next_attempt_at <= 0)
            and (row.expires_at is None or row.expires_at > 0)
            and (row.max_attempts is None or row.attempt < row.max_attempts)
            and self.active(row.community)
        )

    @staticmethod
    def lease_end(row: Row, seconds: float) -> float:
        return seconds if row.expires_at is None else min(seconds, row.expires_at)

    def claim(
        self,
        community: int,
        target: int,
        seconds: float,
        limit: int = 1,
        only: uuid.UUID | None = None,
        expected: services.Binding | None = None,
    ) -> list[Row]:
        if expected is not None and (
            expected.community_id != self.community_ids[community] or expected.target_pubkey != self.targets[target]
        ):
            return []
        candidates = sorted(
            (
                r
                for r in self.rows.values()
                if r.community == community
                and r.target == target
                and self.claimable(r)
                and (only is None or r.id == only)
                and (expected is None or r.binding == expected)
            ),
            key=lambda r: r.order,
        )[:limit]
        for row in candidates:
            row.status = "claimed"
            row.generation += 1
            row.attempt += 1
            row.lease_until = self.lease_end(row, seconds)
            row.next_attempt_at = None
        return candidates

    def current(self, lease: services.Lease) -> Row | None:
        row = self.rows.get(lease.delivery_id)
        if (
            row is not None
            and self.community_ids[row.community] == lease.community_id
            and self.targets[row.target] == lease.target_pubkey
            and row.generation == lease.lease_generation
            and row.status == "claimed"
            and row.lease_until is not None
            and row.lease_until >= 0
            and self.active(row.community)
        ):
            return row
        return None

    def renew(self, lease: services.Lease, seconds: float) -> tuple[str, float | None]:
        row = self.current(lease)
        if row is None:
            return ("LeaseLost", None)
        row.lease_until = self.lease_end(row, seconds)
        return ("Renewed", row.lease_until)

    def finish(self, lease: services.Lease, outcome: str, failure_code: str | None) -> tuple[str, str | None]:
        row = self.current(lease)
        if row is not None:
            row.lease_until = None
            if outcome == "retry":
                if row.max_attempts is not None and row.attempt >= row.max_attempts:
                    row.status, row.failure_code = "failed", "attempts_exhausted"
                else:
                    row.status = "pending"
                    row.next_attempt_at = min(BACKOFF_BASE * 2 ** max(row.attempt - 1, 0), BACKOFF_CAP)
            else:
                row.status = outcome
                row.failure_code = failure_code if outcome == "failed" else None
            return ("Settled", row.status)
        row = self.rows.get(lease.delivery_id)
        if (
            row is not None
            and self.community_ids[row.community] == lease.community_id
            and self.targets[row.target] == lease.target_pubkey
            and row.generation == lease.lease_generation
        ):
            if row.status in TERMINAL:
                return ("AlreadyTerminal", row.status)
            if row.status == "pending" and outcome == "retry":
                # Only this holder's own retry leaves the row pending at its generation: a
                # repeated retry is idempotent (the code's reading; SPEC 4.5 says LeaseLost).
                return ("Settled", "pending")
        return ("LeaseLost", None)

    def reap(self, dry_run: bool) -> tuple[int, int, int, int]:
        """(reclaimed, exhausted, expired, skipped_fenced), applied unless ``dry_run``."""
        reclaimed = exhausted = expired = 0
        moves: list[tuple[Row, str, str | None]] = []
        for row in self.rows.values():
            lapsed = row.status == "claimed" and row.lease_until is not None and row.lease_until < 0
            past_ttl = row.expires_at is not None and row.expires_at <= 0
            if not self.active(row.community):
                continue
            if lapsed:
                if past_ttl:
                    moves.append((row, "expired", "delivery_expired"))
                    expired += 1
                elif row.max_attempts is not None and row.attempt >= row.max_attempts:
                    moves.append((row, "failed", "attempts_exhausted"))
                    exhausted += 1
                else:
                    moves.append((row, "pending", None))
                    reclaimed += 1
            elif row.status == "pending" and past_ttl:
                moves.append((row, "expired", "delivery_expired"))
                expired += 1
        skipped = sum(
            1
            for r in self.rows.values()
            if r.status == "claimed"
            and r.lease_until is not None
            and r.lease_until < 0
            and not self.active(r.community)
        )
        if not dry_run:
            for row, status, code in moves:
                row.status, row.failure_code = status, code
                row.generation += 1
                row.lease_until = None
                row.next_attempt_at = None
        return (reclaimed, exhausted, expired, skipped)

    def advance_clock(self, seconds: float) -> None:
        for row in self.rows.values():
            if row.lease_until is not None:
                row.lease_until -= seconds
            if row.next_attempt_at is not None:
                row.next_attempt_at -= seconds
            if row.expires_at is not None:
                row.expires_at -= seconds

    def requeue(self, community: int, delivery_id: uuid.UUID) -> bool:
        row = self.rows.get(delivery_id)
        if row is None or row.community != community or row.status not in ("failed", "expired"):
            return False
        if not self.active(community):
            return False
        row.status, row.failure_code = "pending", None
        row.attempt = 0
        row.next_attempt_at = None
        if row.expires_at is not None and row.expires_at <= 0:
            row.expires_at = None
        row.generation += 1
        return True

    def force_fail(self, community: int, delivery_id: uuid.UUID) -> bool:
        row = self.rows.get(delivery_id)
        if row is None or row.community != community or row.status != "claimed" or not self.active(community):
            return False
        row.status, row.failure_code = "failed", "operator_force_failed"
        row.lease_until = None
        row.generation += 1
        return True


# --- the machine ---------------------------------------------------------------------------


def _seconds_from(t0: dt.datetime, value: dt.datetime | None) -> float | None:
    return None if value is None else (value - t0).total_seconds()


def _policy(max_attempts: int | None) -> override_settings:
    return override_settings(
        BUZZ_DELIVERY={
            **settings.BUZZ_DELIVERY,
            "MIN_LEASE_SECONDS": 15,
            "MAX_LEASE_SECONDS": 300,
            "MAX_ATTEMPTS": max_attempts,
            "RETRY_BACKOFF_BASE_SECONDS": BACKOFF_BASE,
            "RETRY_BACKOFF_CAP_SECONDS": BACKOFF_CAP,
        }
    )


pick = st.integers(min_value=0, max_value=10_000)
community_index = st.integers(min_value=0, max_value=1)
target_index = st.integers(min_value=0, max_value=1)
lease_variant = st.sampled_from(
    ["as granted", "as granted", "as granted", "next generation", "other target", "other community"]
)


class DeliveryMachine(RuleBasedStateMachine):
    """Two communities sharing two target public keys; every example in its own savepoint."""

    def __init__(self) -> None:
        super().__init__()
        STATS["examples"] += 1
        self._atomic = transaction.atomic()
        self._atomic.__enter__()
        self._clock = frozen_db_clock()  # the services' clock stands still at now() too
        self._clock.__enter__()
        self._policy = _policy(3)
        self._policy.enable()
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            self.t0: dt.datetime = cursor.fetchone()[0]
        self.communities = [CommunityFactory(), CommunityFactory()]
        self.runs = [WorkflowRunFactory(community=c) for c in self.communities]
        self.events = [EventFactory(community=c) for c in self.communities]
        self.targets = [random32(), random32()]
        self.model = SpecModel([c.id for c in self.communities], self.targets)
        self.leases: list[services.Lease] = []
        self.commits: list[tuple[int, list[services.Binding]]] = []
        self.steps = 0

    def teardown(self) -> None:
        self._policy.disable()
        self._clock.__exit__(None, None, None)
        transaction.set_rollback(True)
        self._atomic.__exit__(None, None, None)

    # helpers
    def _lease(self, index: int, variant: str) -> services.Lease:
        lease = self.leases[index % len(self.leases)]
        if variant == "next generation":
            return replace(lease, lease_generation=lease.lease_generation + 1)
        if variant == "other target":
            other = self.targets[1] if lease.target_pubkey == self.targets[0] else self.targets[0]
            return replace(lease, target_pubkey=other)
        if variant == "other community":
            ids = self.model.community_ids
            return replace(lease, community_id=ids[1] if lease.community_id == ids[0] else ids[0])
        return lease

    def _any_delivery_id(self, index: int) -> uuid.UUID:
        ids = sorted(self.model.rows)
        return ids[index % len(ids)] if ids else uuid.uuid4()

    def _check_claims(self, claims: list[services.Claim], expected: list[Row]) -> None:
        event(f"claim -> {len(expected)}")
        assert [c.lease.delivery_id for c in claims] == [r.id for r in expected]
        for c, r in zip(claims, expected, strict=True):
            assert c.lease.lease_generation == r.generation
            assert _seconds_from(self.t0, c.lease.lease_until) == r.lease_until
            assert c.delivery.status == "claimed" and c.delivery.attempt == r.attempt
            self.leases.append(c.lease)

    # rules
    @initialize(
        first=st.lists(
            st.tuples(
                community_index,
                st.sampled_from([(0,), (1,), (0, 1)]),
                st.sampled_from(TTLS),
                st.sampled_from([1, 2, 3, None]),
            ),
            min_size=1,
            max_size=3,
        )
    )
    def first_commits(self, first: list[tuple[int, tuple[int, ...], int | None, int | None]]) -> None:
        for args in first:
            self.commit(*args)

    @rule(
        community=community_index,
        addressed=st.sampled_from([(0,), (1,), (0, 1), (1, 0)]),
        ttl=st.sampled_from(TTLS),
        max_attempts=st.sampled_from([1, 2, 3, None]),
    )
    def commit(self, community: int, addressed: tuple[int, ...], ttl: int | None, max_attempts: int | None) -> None:
        c = self.communities[community]
        bindings = [
            services.Binding(
                community_id=c.id,
                workflow_id=self.runs[community].workflow_id,
                run_id=self.runs[community].id,
                step_id=f"step-{len(self.commits)}",
                target_pubkey=self.targets[t],
                definition_event_id=random32(),
                message_event_id=bytes(self.events[community].event_id),
                cause=services.Cause.webhook(uuid.uuid4()),
            )
            for t in addressed
        ]
        expires_at = None if ttl is None else self.t0 + dt.timedelta(seconds=ttl)
        with _policy(max_attempts):
            if not self.model.active(community):
                with pytest.raises(exceptions.CommunityNotWritable):
                    services.commit_deliveries(c.id, self.events[community], bindings, expires_at=expires_at)
                return
            created = services.commit_deliveries(c.id, self.events[community], bindings, expires_at=expires_at)
        assert len(created) == len(bindings)
        self.commits.append((community, bindings))
        with connection.cursor() as cursor:
            cursor.execute("SELECT id, created_at FROM buzz_delivery_delivery WHERE id = ANY(%s)", [created])
            created_at = dict(cursor.fetchall())
        for delivery_id, binding, t in zip(created, bindings, addressed, strict=True):
            self.model.rows[delivery_id] = Row(
                id=delivery_id,
                community=community,
                target=t,
                order=(created_at[delivery_id], delivery_id),
                binding=binding,
                max_attempts=max_attempts,
                expires_at=ttl,
            )

    @precondition(lambda self: self.commits)
    @rule(index=pick)
    def commit_again(self, index: int) -> None:
        """A producer retry: the same bindings again create nothing."""
        community, bindings = self.commits[index % len(self.commits)]
        c = self.communities[community]
        if not self.model.active(community):
            with pytest.raises(exceptions.CommunityNotWritable):
                services.commit_deliveries(c.id, self.events[community], bindings)
            return
        assert services.commit_deliveries(c.id, self.events[community], bindings) == []

    def _address(self, index: int, anywhere: int) -> tuple[int, int]:
        """Mostly the (community, target) of a known delivery; sometimes any of the four."""
        if self.model.rows and anywhere:
            row = self.model.rows[self._any_delivery_id(index)]
            return row.community, row.target
        return index % 2, (index // 2) % 2

    @rule(index=pick, anywhere=st.integers(0, 3), seconds=st.sampled_from(LEASES))
    def claim_oldest(self, index: int, anywhere: int, seconds: int) -> None:
        community, agent = self._address(index, anywhere)
        claim = services.claim_delivery(self.communities[community].id, self.targets[agent], lease_seconds=seconds)
        self._check_claims([claim] if claim else [], self.model.claim(community, agent, seconds))

    @rule(index=pick, anywhere=st.integers(0, 3), hint=pick, seconds=st.sampled_from(LEASES))
    def claim_by_id(self, index: int, anywhere: int, hint: int, seconds: int) -> None:
        """A wake hint: any known id (maybe another community's or target's), or an unknown one."""
        community, agent = self._address(index, anywhere)
        wanted = self._any_delivery_id(hint)
        claim = services.claim_delivery(
            self.communities[community].id, self.targets[agent], delivery_id=wanted, lease_seconds=seconds
        )
        self._check_claims([claim] if claim else [], self.model.claim(community, agent, seconds, only=wanted))

    @precondition(lambda self: self.model.rows)
    @rule(index=pick, anywhere=st.integers(0, 3), hint=pick, forged=st.booleans())
    def claim_expected(self, index: int, anywhere: int, hint: int, forged: bool) -> None:
        """Claim with an ``expected`` binding: a real one, or one with a forged definition event id."""
        community, agent = self._address(index, anywhere)
        expected = self.model.rows[self._any_delivery_id(hint)].binding
        if forged:
            expected = replace(expected, definition_event_id=random32())
        claim = services.claim_delivery(
            self.communities[community].id, self.targets[agent], expected=expected, lease_seconds=30
        )
        self._check_claims([claim] if claim else [], self.model.claim(community, agent, 30, expected=expected))

    @rule(index=pick, anywhere=st.integers(0, 3), limit=st.integers(1, 3), seconds=st.sampled_from(LEASES))
    def claim_batch(self, index: int, anywhere: int, limit: int, seconds: int) -> None:
        community, agent = self._address(index, anywhere)
        claims = services.claim_deliveries(
            self.communities[community].id, self.targets[agent], limit=limit, lease_seconds=seconds
        )
        self._check_claims(claims, self.model.claim(community, agent, seconds, limit=limit))

    @precondition(lambda self: self.leases)
    @rule(index=pick, variant=lease_variant, seconds=st.sampled_from(LEASES))
    def renew(self, index: int, variant: str, seconds: int) -> None:
        lease = self._lease(index, variant)
        outcome = services.renew_delivery(lease, seconds)
        expected = self.model.renew(lease, seconds)
        event(f"renew ({variant}) -> {expected[0]}")
        if expected[0] == "Renewed":
            assert isinstance(outcome, services.Renewed), outcome
            assert _seconds_from(self.t0, outcome.lease_until) == expected[1]
            assert outcome.lease.lease_generation == lease.lease_generation
            self.leases.append(outcome.lease)
        else:
            assert isinstance(outcome, services.LeaseLost), outcome

    @precondition(lambda self: self.leases)
    @rule(
        index=pick,
        variant=lease_variant,
        outcome=st.sampled_from(["finished", "failed", "retry"]),
        failure_code=st.sampled_from([None, "handler_error"]),
    )
    def finish(self, index: int, variant: str, outcome: str, failure_code: str | None) -> None:
        lease = self._lease(index, variant)
        code = failure_code if outcome == "failed" else None
        result = services.finish_delivery(lease, outcome, failure_code=code)
        kind, status = self.model.finish(lease, outcome, code)
        event(f"finish {outcome} ({variant}) -> {kind} {status}")
        if kind == "Settled":
            assert result == services.Settled(status)
        elif kind == "AlreadyTerminal":
            assert result == services.AlreadyTerminal(status)
        else:
            assert isinstance(result, services.LeaseLost), result

    @rule()
    def reap(self) -> None:
        reclaimed, exhausted, expired, skipped = self.model.reap(dry_run=True)
        event(
            f"reap -> reclaimed {bool(reclaimed)} exhausted {bool(exhausted)} expired {bool(expired)}"
            f" skipped {bool(skipped)}"
        )
        preview = services.reap(dry_run=True)
        assert (preview.reclaimed, preview.exhausted, preview.expired, preview.skipped_fenced) == (
            reclaimed,
            exhausted,
            expired,
            skipped,
        )
        result = services.reap(batch_size=2)
        assert (result.reclaimed, result.exhausted, result.expired, result.skipped_fenced) == self.model.reap(
            dry_run=False
        )

    @rule(seconds=st.sampled_from(CLOCK_STEPS), then_reap=st.booleans())
    def advance_clock(self, seconds: int, then_reap: bool) -> None:
        """Time passes for every row of the example (fenced ones too): raw SQL, triggers off."""
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL session_replication_role = replica")
            # (the IMMUTABLE helper: timestamptz - interval over a column is STABLE, SPEC 15)
            set_delivery_state(
                Expr("community_id = ANY(%s)", [[c.id for c in self.communities]]),
                lease_until=Expr("buzz_delivery_plus_seconds(lease_until, -%s)", [seconds]),
                next_attempt_at=Expr("buzz_delivery_plus_seconds(next_attempt_at, -%s)", [seconds]),
                expires_at=Expr("buzz_delivery_plus_seconds(expires_at, -%s)", [seconds]),
            )
            cursor.execute("SET LOCAL session_replication_role = DEFAULT")
        self.model.advance_clock(seconds)
        if then_reap:
            self.reap()

    @precondition(lambda self: self.model.rows)
    @rule(community=community_index, roll=st.integers(0, 3))
    def move_lifecycle_forward(self, community: int, roll: int) -> None:
        """active -> quiescing -> fenced -> purged (tombstone); one roll in four, so most examples
        keep both communities active for longer."""
        if roll:
            return
        state = self.model.states[community]
        c = self.communities[community]
        event(f"lifecycle move from {state}")
        if state in LIFECYCLE_NEXT:
            services.advance_community(c.id, LIFECYCLE_NEXT[state])
            self.model.states[community] = LIFECYCLE_NEXT[state]
        elif state == "fenced":
            result = services.purge_community(c.id)
            gone = [i for i, r in self.model.rows.items() if r.community == community]
            assert result.tombstoned and result.deleted["buzz_delivery.DeliveryRecord"] == len(gone)
            for delivery_id in gone:
                del self.model.rows[delivery_id]
            self.model.states[community] = "tombstone"

    @precondition(lambda self: self.model.rows)
    @rule(index=pick, anywhere=st.integers(0, 3))
    def operator_requeue(self, index: int, anywhere: int) -> None:
        delivery_id = self._any_delivery_id(index)
        community = self.model.rows[delivery_id].community if anywhere else index % 2
        outcome = services.requeue_delivery(self.communities[community].id, delivery_id)
        expected = self.model.requeue(community, delivery_id)
        event(f"requeue -> {expected}")
        assert outcome.done == expected

    @precondition(lambda self: self.model.rows)
    @rule(index=pick, anywhere=st.integers(0, 3))
    def operator_force_fail(self, index: int, anywhere: int) -> None:
        delivery_id = self._any_delivery_id(index)
        community = self.model.rows[delivery_id].community if anywhere else index % 2
        outcome = services.force_fail_delivery(self.communities[community].id, delivery_id)
        expected = self.model.force_fail(community, delivery_id)
        event(f"force-fail -> {expected}")
        assert outcome.done == expected

    @invariant()
    def rows_match_the_model(self) -> None:
        STATS["steps"] += 1
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT id, status, lease_generation, attempt, lease_until, next_attempt_at, expires_at, failure_code"
                " FROM buzz_delivery_delivery WHERE community_id = ANY(%s)",
                [[c.id for c in self.communities]],
            )
            actual = {
                row[0]: (
                    row[1],
                    row[2],
                    row[3],
                    _seconds_from(self.t0, row[4]),
                    _seconds_from(self.t0, row[5]),
                    _seconds_from(self.t0, row[6]),
                    row[7],
                )
                for row in cursor.fetchall()
            }
        assert actual == {i: r.observed() for i, r in self.model.rows.items()}


def _run(examples: int, steps: int) -> None:
    STATS.update(examples=0, steps=0)
    SEEN.clear()
    started = time.monotonic()
    run_machine(DeliveryMachine, examples, steps)
    print(
        f"\nmodel-based: {STATS['examples']} examples, {STATS['steps']} checked states, "
        f"{time.monotonic() - started:.1f} s"
    )
    for label, count in sorted(SEEN.items()):
        print(f"  {count:6d}  {label}")
    assert STATS["examples"] >= examples


@pytest.fixture(autouse=True)
def no_jitter(monkeypatch):
    """The model keeps exact times: the retry backoff's jitter (buzz_delivery.backoff, bounds
    tested in tests/test_backoff.py) is pinned at its top, the un-jittered delay."""
    monkeypatch.setattr(backoff, "jitter", lambda: 1.0)


def test_services_agree_with_the_spec_model_on_random_operation_sequences():
    _run(examples=200, steps=20)


@pytest.mark.slow
def test_services_agree_with_the_spec_model_on_long_random_operation_sequences():
    _run(examples=2000, steps=40)
