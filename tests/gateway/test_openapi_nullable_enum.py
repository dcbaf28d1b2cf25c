"""The document accepts what the batch finish route accepts (outcome null)."""

from __future__ import annotations

from buzz_delivery.gateway.openapi import document
from buzz_delivery.gateway.schema import BATCH_FINISH
from tests.gateway.test_openapi import validator

D = "0193a5a0-0000-7000-8000-00000000000d"


def test_a_null_outcome_the_route_accepts_validates_against_the_document():
    for body in (
        {"deliveries": [{"delivery_id": D, "lease_generation": 1, "outcome": "retry"}], "outcome": None},
        {"deliveries": [{"delivery_id": D, "lease_generation": 1, "outcome": None}], "outcome": "finished"},
    ):
        BATCH_FINISH.clean(body)  # the route takes it
        errors = [e.message for e in validator(document(), "BatchFinishRequest").iter_errors(body)]
        assert errors == [], (body, errors)
