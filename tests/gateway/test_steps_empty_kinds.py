"""A steps request's kinds with no items cost the database nothing (issue 29): the request's
chain of round trips is its latency, and a K = 1 remote worker waits on it at every step."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from buzz_delivery.gateway.runs import STEP_KINDS, _execute
from buzz_delivery.testing import CommunityFactory

pytestmark = pytest.mark.django_db


def test_an_empty_kind_of_a_steps_request_sends_no_statement_not_even_a_savepoint():
    community = CommunityFactory()
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        answers = {name: _execute(kind, community.id, [], set()) for name, kind in STEP_KINDS}
    assert answers == {name: [] for name, _ in STEP_KINDS}
    assert [q["sql"] for q in queries.captured_queries] == []
