"""The claim under the operator's concurrency limits (``services/flow.py``: the plan-cached
``buzz_delivery_claim_limited`` and the hinted and expected forms of ``flow.LIMITED_CLAIMS``)
reaches the rows it admitted by primary key in its generic plan, whatever the planner estimates
of the community, as the plain claims do (``tests/test_claim_plan_stale_stats.py``, core 0031).

Its UPDATE reached its rows by joining the ``admitted`` CTE alone (``d.id = admitted.id``):
when the statistics gave a community few rows (a fleet of small communities: the table's rows
over the distinct communities) the generic plan of the batch and expected forms read every row
of the claiming community through delivery_message_event_idx's community prefix, and with the
table's own statistics of one target's 20,000 pending it hashed a sequential scan of the
community, on every claim, instead of probing the primary key per admitted row (the statistics
of a drain, almost nothing pending, and the hinted form, which names its row, kept the key: they
stay here as guards). The UPDATE now joins the candidates, the admitted and their ids as an
array (``flow.ADMITTED_FROM``), as the engine's claims under limits do. Generic plans are
what the plan-cached function runs and what psycopg's prepared statements run after
``prepare_threshold`` executions; the plain statements are prepared here as those are.

Only the plan of the UPDATE's own scan of the delivery table is checked (not the candidates').
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from buzz_delivery import models, services
from buzz_delivery.services import cached, flow
from buzz_delivery.services.cached import CachedStatement
from tests.citus_support import CITUS_MODE
from tests.plan_support import generic_explain
from tests.test_claim_plan_stale_stats import assert_updates_by_primary_key, clone
from tests.test_engine_claim_plan_fleet_stats import _plain, fleet_statistics
from tests.test_flow_limits import limits

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(CITUS_MODE, reason="on Citus the functions plan each call (force_custom_plan)"),
]

DELIVERY = models.DeliveryRecord._meta.db_table
ROWS = 20_000

_CLAIM = (("community_id", "uuid"), ("target_pubkey", "bytea"))
_LEASE = (("limit", "bigint"), ("lease_seconds", "float8"), ("holder", "text"))
_EXPECTED = (
    ("workflow_id", "uuid"),
    ("run_id", "uuid"),
    ("step_id", "varchar"),
    ("definition_event_id", "bytea"),
    ("message_event_id", "bytea"),
    ("cause_kind", "varchar"),
    ("cause_event_id", "bytea"),
    ("cause_scheduled_for", "timestamptz"),
    ("cause_webhook_invocation_id", "uuid"),
)


def limited_claim(form: str, declared: dict[str, int]) -> CachedStatement:
    """The claim under ``declared`` limits that the services send for ``form``
    (``services/leases.py``): the plan-cached function for a batch, a plain statement of
    ``flow.LIMITED_CLAIMS`` (prepared with the types its parameters have) for a hinted or an
    expected delivery."""
    if form == "batch":
        return cached.CLAIM_LIMITED
    kinds = tuple(declared)
    caps = tuple((f"cap_{kind}", "integer") for kind in kinds)
    if form == "hinted":
        statement = flow.LIMITED_CLAIMS[(kinds, True, False)]
        return _plain(statement, (*_CLAIM, ("delivery_id", "uuid"), *_LEASE, *caps))
    statement = flow.LIMITED_CLAIMS[(kinds, False, True)]
    return _plain(statement, (*_CLAIM, *_LEASE, *_EXPECTED, *caps))


@pytest.mark.parametrize(
    "declared", [{"community": 100}, {"community": 100, "target": 4, "workflow": 10}], ids=["community", "every_kind"]
)
@pytest.mark.parametrize("targets", [20, 1], ids=["20_targets", "one_target"])
@pytest.mark.parametrize("statistics", ["fleet", "own", "drained"])
@pytest.mark.parametrize("form", ["batch", "hinted", "expected"])
def test_a_claim_under_limits_updates_through_the_primary_key(
    community, make_binding, form, statistics, targets, declared
):
    """``fleet``: the statistics of 4,000 communities (set before any row is written), then
    20,000 pending deliveries of one community, analysed. ``own``: the table's own statistics
    of those. ``drained``: analysed after a drain (30,000 finished), then the 20,000 pending."""
    if statistics == "fleet":
        fleet_statistics(DELIVERY)
    binding = make_binding(target_pubkey=bytes(32))  # the clones' first target
    ev = models.Event.objects.get(community_id=community.id, event_id=binding.message_event_id)
    (hinted,) = services.commit_deliveries(community.id, ev, [binding])
    if statistics == "drained":
        clone(binding.step_id, "f", 30_000, "finished", targets)
        with connection.cursor() as cur:
            cur.execute(f"ANALYZE {DELIVERY}")
        clone(binding.step_id, "p", ROWS, "pending", targets)
    else:
        clone(binding.step_id, "p", ROWS, "pending", targets)
        with connection.cursor() as cur:
            cur.execute(f"ANALYZE {DELIVERY}")
    with limits(**declared):
        caps = flow.all_caps(flow.declared_limits(), flow.KINDS)
    params: dict[str, Any] = {
        "community_id": community.id,
        "target_pubkey": binding.target_pubkey,
        "delivery_id": hinted,
        "limit": 1 if form == "hinted" else 50,
        "lease_seconds": 30,
        "holder": "limplan",
        "workflow_id": binding.workflow_id,
        "run_id": binding.run_id,
        "step_id": binding.step_id,
        "definition_event_id": binding.definition_event_id,
        "message_event_id": binding.message_event_id,
        "cause_kind": binding.cause.kind,
        "cause_event_id": binding.cause.event_id,
        "cause_scheduled_for": binding.cause.scheduled_for,
        "cause_webhook_invocation_id": binding.cause.webhook_invocation_id,
        **caps,
    }
    statement = limited_claim(form, declared)
    ((plans,),) = generic_explain(statement, {name: params[name] for name, _ in statement.params}, "FORMAT JSON")
    (plan,) = plans
    assert_updates_by_primary_key(plan, "the community's rows, not the admitted")
