"""Probes of settle_deliveries (issue 29)."""

from __future__ import annotations

import pytest

from buzz_delivery import backoff, services
from buzz_delivery.services.types import Settle
from buzz_delivery.testing import frozen_db_clock
from tests.test_settle_batch import claimed, row

pytestmark = pytest.mark.django_db

AWKWARD = ["NULL", '"{}\\,', "a,b", "{x}", " NULL ", "é\u2028", "\\"]


def test_awkward_failure_texts_reach_the_row_as_finish_delivery_writes_them(
    community, message_event, make_binding, monkeypatch
):
    monkeypatch.setattr(backoff, "jitter", lambda: 0.75)
    with frozen_db_clock():
        singles = [claimed(community, message_event, make_binding, max_attempts=1) for _ in AWKWARD * 2]
        batch = [claimed(community, message_event, make_binding, max_attempts=1) for _ in AWKWARD * 2]
        args = [{"outcome": "failed", "failure_code": t[:64], "failure_message": t} for t in AWKWARD] + [
            {"outcome": "retry", "failure_message": t, "retry_after": backoff.MAX_RETRY_AFTER_SECONDS} for t in AWKWARD
        ]
        expected = [services.finish_delivery(x, **a) for x, a in zip(singles, args, strict=True)]
        got = services.settle_deliveries([Settle(x, **a) for x, a in zip(batch, args, strict=True)])
        assert got == expected
        for s, b in zip(singles, batch, strict=True):
            assert row(b.delivery_id) == row(s.delivery_id)
