"""``fanout.lock_delivery_identities`` keeps what ``lock_delivery_identity`` guarantees for one
(run, step): it needs the caller's READ COMMITTED transaction (under REPEATABLE READ or
SERIALIZABLE the snapshot predates the locks, so the statements after them could miss a
producer that committed while the batch waited), and bad input is a ValidationError naming
the field, before any SQL."""

from __future__ import annotations

import uuid

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, transaction

from buzz_delivery.exceptions import NotInTransaction
from buzz_delivery.services import fanout


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_the_identity_locks_refuse_a_transaction_whose_snapshot_predates_them(community, level):
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
        with pytest.raises(NotInTransaction, match="READ COMMITTED"):
            fanout.lock_delivery_identities(community.id, [(uuid.uuid4(), "send")])


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("identities", "field"),
    [
        (None, "identities"),
        ("send", "identities"),
        ([("not-a-uuid", "send")], "identities[0].run_id"),
        ([(uuid.uuid4(), "send", "extra")], "identities[0]"),
        ([uuid.uuid4()], "identities[0]"),
    ],
)
def test_bad_identities_are_a_validation_error_naming_the_field(community, identities, field):
    with transaction.atomic(), pytest.raises(ValidationError) as raised:
        fanout.lock_delivery_identities(community.id, identities)
    assert field in raised.value.message_dict, raised.value.message_dict


@pytest.mark.django_db
def test_the_identity_locks_are_taken_in_read_committed(community):
    with transaction.atomic():
        fanout.lock_delivery_identities(community.id, [(uuid.uuid4(), "a"), (uuid.uuid4(), "b")])
