"""Bad input (SPEC sections 2, 4 and 9): every bad value raises a ValidationError whose
``message_dict`` key names the field, before any SQL, and nothing is written."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from django.core.exceptions import ValidationError

from buzz_delivery import services
from buzz_delivery.services import Binding, Cause, Lease
from buzz_delivery.testing import random32

pytestmark = pytest.mark.django_db

AWARE = dt.datetime(2030, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
NAIVE = dt.datetime(2030, 1, 1, 12, 0, 0)


@pytest.fixture(autouse=True)
def lease_bounds(settings):
    """Pin the lease bounds to the documented defaults, whatever the environment says."""
    settings.BUZZ_DELIVERY = {"LEASE_SECONDS": 60, "MIN_LEASE_SECONDS": 15, "MAX_LEASE_SECONDS": 300}


@pytest.fixture
def binding_fields(run, message_event) -> dict[str, Any]:
    return {
        "community_id": run.community_id,
        "workflow_id": run.workflow_id,
        "run_id": run.id,
        "step_id": "send_message",
        "target_pubkey": random32(),
        "definition_event_id": random32(),
        "message_event_id": bytes(message_event.event_id),
        "cause": Cause.webhook(uuid.uuid4()),
    }


@pytest.fixture
def pending(community, message_event, binding_fields) -> Binding:
    binding = Binding(**binding_fields)
    services.commit_deliveries(community.id, message_event, [binding])
    return binding


@pytest.fixture
def lease(community, pending) -> Lease:
    return services.claim_delivery(community.id, pending.target_pubkey).lease


def refused(call, key: str, assert_num_queries) -> ValidationError:
    """Run ``call`` and check it raised a ValidationError keyed ``key`` without touching the database."""
    with assert_num_queries(0), pytest.raises(ValidationError) as info:
        call()
    assert list(info.value.message_dict) == [key]
    return info.value


BAD_BYTES = {
    "31 bytes": b"\x01" * 31,
    "33 bytes": b"\x01" * 33,
    "empty": b"",
    "64 hex characters": "ab" * 32,
}


@pytest.mark.parametrize("value", BAD_BYTES.values(), ids=BAD_BYTES.keys())
@pytest.mark.parametrize("field", ["target_pubkey", "definition_event_id", "message_event_id"])
def test_a_binding_with_a_wrong_length_32_byte_field_is_refused(
    binding_fields, field, value, django_assert_num_queries
):
    refused(lambda: Binding(**{**binding_fields, field: value}), field, django_assert_num_queries)


@pytest.mark.parametrize("value", BAD_BYTES.values(), ids=BAD_BYTES.keys())
def test_an_event_cause_with_a_wrong_length_id_is_refused(value, django_assert_num_queries):
    refused(lambda: Cause.event(value), "cause.event_id", django_assert_num_queries)


def test_a_binding_accepts_32_byte_values_as_bytearray_or_memoryview(binding_fields):
    binding = Binding(
        **{
            **binding_fields,
            "target_pubkey": bytearray(b"\x02" * 32),
            "definition_event_id": memoryview(b"\x03" * 32),
        }
    )

    assert binding.target_pubkey == b"\x02" * 32
    assert binding.definition_event_id == b"\x03" * 32


STEP_IDS = {"empty": "", "blank": "   ", "tabs and newlines": "\t\n", "65 characters": "s" * 65, "not a str": 7}


@pytest.mark.parametrize("value", STEP_IDS.values(), ids=STEP_IDS.keys())
def test_a_binding_with_a_bad_step_id_is_refused(binding_fields, value, django_assert_num_queries):
    refused(lambda: Binding(**{**binding_fields, "step_id": value}), "step_id", django_assert_num_queries)


def test_a_step_id_of_64_characters_is_accepted_and_stored(community, message_event, binding_fields):
    binding = Binding(**{**binding_fields, "step_id": "s" * 64})

    (created,) = services.commit_deliveries(community.id, message_event, [binding])

    assert services.get_delivery(community.id, created).step_id == "s" * 64


@pytest.mark.parametrize("value", STEP_IDS.values(), ids=STEP_IDS.keys())
def test_lock_delivery_identity_refuses_a_bad_step_id(community, run, value, django_assert_num_queries):
    refused(lambda: services.lock_delivery_identity(community.id, run.id, value), "step_id", django_assert_num_queries)


@pytest.mark.parametrize("field", ["community_id", "workflow_id", "run_id"])
def test_a_binding_with_an_id_that_is_not_a_uuid_is_refused(binding_fields, field, django_assert_num_queries):
    refused(lambda: Binding(**{**binding_fields, field: "not-a-uuid"}), field, django_assert_num_queries)


def test_a_binding_with_a_cause_that_is_not_a_cause_is_refused(binding_fields, django_assert_num_queries):
    refused(lambda: Binding(**{**binding_fields, "cause": "webhook"}), "cause", django_assert_num_queries)


def test_a_naive_schedule_cause_is_refused(django_assert_num_queries):
    refused(lambda: Cause.schedule(NAIVE), "cause.scheduled_for", django_assert_num_queries)


def test_a_schedule_cause_with_a_sub_second_part_is_refused(django_assert_num_queries):
    refused(lambda: Cause.schedule(AWARE.replace(microsecond=1)), "cause.scheduled_for", django_assert_num_queries)


def test_a_cause_carrying_two_identities_is_refused(django_assert_num_queries):
    refused(
        lambda: Cause(kind="event", event_id=random32(), webhook_invocation_id=uuid.uuid4()),
        "cause",
        django_assert_num_queries,
    )


def test_a_naive_expires_at_refuses_the_commit_and_writes_nothing(
    community, message_event, binding_fields, table_snapshot, django_assert_num_queries
):
    binding = Binding(**binding_fields)
    before = table_snapshot()

    refused(
        lambda: services.commit_deliveries(community.id, message_event, [binding], expires_at=NAIVE),
        "expires_at",
        django_assert_num_queries,
    )

    assert table_snapshot() == before


def test_an_empty_list_of_bindings_is_refused(community, message_event, django_assert_num_queries):
    refused(lambda: services.commit_deliveries(community.id, message_event, []), "bindings", django_assert_num_queries)


LEASE_SECONDS = {
    "zero": 0,
    "negative": -5,
    "below the minimum": 14.9,
    "above the maximum": 300.5,
    "NaN": float("nan"),
    "not a number": "60",
}


@pytest.mark.parametrize("seconds", LEASE_SECONDS.values(), ids=LEASE_SECONDS.keys())
def test_a_claim_with_a_bad_lease_length_is_refused_and_claims_nothing(
    community, pending, seconds, table_snapshot, django_assert_num_queries
):
    before = table_snapshot()

    refused(
        lambda: services.claim_delivery(community.id, pending.target_pubkey, lease_seconds=seconds),
        "lease_seconds",
        django_assert_num_queries,
    )
    refused(
        lambda: services.claim_deliveries(community.id, pending.target_pubkey, limit=5, lease_seconds=seconds),
        "lease_seconds",
        django_assert_num_queries,
    )

    assert table_snapshot() == before


@pytest.mark.parametrize("seconds", LEASE_SECONDS.values(), ids=LEASE_SECONDS.keys())
def test_a_renew_with_a_bad_lease_length_is_refused_and_changes_nothing(
    lease, seconds, table_snapshot, django_assert_num_queries
):
    before = table_snapshot()

    refused(lambda: services.renew_delivery(lease, lease_seconds=seconds), "lease_seconds", django_assert_num_queries)

    assert table_snapshot() == before


@pytest.mark.parametrize("seconds", [15, 300])
def test_lease_lengths_at_the_bounds_are_accepted(community, pending, seconds):
    claim = services.claim_delivery(community.id, pending.target_pubkey, lease_seconds=seconds)

    assert claim is not None
    assert isinstance(services.renew_delivery(claim.lease, lease_seconds=seconds), services.Renewed)


def test_the_configured_minimum_lease_length_is_honoured(community, pending, settings, django_assert_num_queries):
    settings.BUZZ_DELIVERY = {"MIN_LEASE_SECONDS": 30, "MAX_LEASE_SECONDS": 120, "LEASE_SECONDS": 60}

    refused(
        lambda: services.claim_delivery(community.id, pending.target_pubkey, lease_seconds=20),
        "lease_seconds",
        django_assert_num_queries,
    )
    refused(
        lambda: services.claim_delivery(community.id, pending.target_pubkey, lease_seconds=121),
        "lease_seconds",
        django_assert_num_queries,
    )
    assert services.claim_delivery(community.id, pending.target_pubkey, lease_seconds=30) is not None


def test_a_claim_for_a_wrong_length_target_is_refused(community, django_assert_num_queries):
    refused(lambda: services.claim_delivery(community.id, b"\x01" * 31), "target_pubkey", django_assert_num_queries)


def test_a_claim_with_a_delivery_id_that_is_not_a_uuid_is_refused(community, pending, django_assert_num_queries):
    refused(
        lambda: services.claim_delivery(community.id, pending.target_pubkey, delivery_id="7"),
        "delivery_id",
        django_assert_num_queries,
    )


@pytest.mark.parametrize("limit", [0, -1, 1001, True])
def test_a_batch_claim_with_a_bad_limit_is_refused(community, pending, limit, django_assert_num_queries):
    refused(
        lambda: services.claim_deliveries(community.id, pending.target_pubkey, limit=limit),
        "limit",
        django_assert_num_queries,
    )


LEASE_FIELDS = {
    "lease.target_pubkey": ("target_pubkey", b"\x01" * 31),
    "lease.lease_until": ("lease_until", NAIVE),
    "lease.lease_generation": ("lease_generation", 0),
    "lease.delivery_id": ("delivery_id", "nope"),
}


@pytest.mark.parametrize(("key", "change"), LEASE_FIELDS.items(), ids=LEASE_FIELDS.keys())
def test_a_lease_rebuilt_from_bad_fields_is_refused(key, change, django_assert_num_queries):
    fields = {
        "community_id": uuid.uuid4(),
        "delivery_id": uuid.uuid4(),
        "target_pubkey": random32(),
        "lease_generation": 1,
        "lease_until": AWARE,
    }
    name, value = change
    refused(lambda: Lease(**{**fields, name: value}), key, django_assert_num_queries)


FINISH_CASES = {
    "unknown outcome": ({"outcome": "done"}, "outcome"),
    "failure_code over 64 characters": ({"outcome": "failed", "failure_code": "c" * 65}, "failure_code"),
    "failure_code on finished": ({"outcome": "finished", "failure_code": "boom"}, "failure_code"),
    "failure_message on finished": ({"outcome": "finished", "failure_message": "boom"}, "failure_message"),
}


@pytest.mark.parametrize(("kwargs", "key"), FINISH_CASES.values(), ids=FINISH_CASES.keys())
def test_a_finish_with_bad_arguments_is_refused_and_settles_nothing(
    lease, kwargs, key, table_snapshot, django_assert_num_queries
):
    before = table_snapshot()

    refused(lambda: services.finish_delivery(lease, **kwargs), key, django_assert_num_queries)

    assert table_snapshot() == before


def test_a_finish_with_something_that_is_not_a_lease_is_refused(django_assert_num_queries):
    refused(lambda: services.finish_delivery({"delivery_id": 1}, "finished"), "lease", django_assert_num_queries)
