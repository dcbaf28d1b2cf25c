"""The batched claim's UPDATE finds its rows through the primary key even when the table's
statistics say there is (almost) nothing pending (issue 16).

The state is ordinary: the table was last analyzed after a drain (every row terminal), then a
burst of deliveries arrived (autovacuum re-analyzes only after ~10% of the table changed). The
planner then estimates one pending row for a community. With a ``status = 'pending'`` test in
the UPDATE's own WHERE the pending partial indexes became usable there, and the planner
preferred scanning every pending row of the community (delivery_pending_poll_idx on its
community prefix, across all targets) or of the fleet (delivery_pending_age_idx), filtering
``id = ANY``, over the primary-key probes: one claim of 50 read all 200,000 pending rows (1.1 s
against 16 ms, EXPLAIN ANALYZE on PostgreSQL 15).

Only the plan of the UPDATE's own scan is checked (the candidate CTE is out of scope here).
"""

from __future__ import annotations

import json

import pytest
from django.db import connection

from buzz_delivery import models, services
from buzz_delivery.services import cached, sql
from buzz_delivery.testing import insert_delivery_rows, random32
from tests.citus_support import CITUS_MODE
from tests.plan_support import generic_explain

pytestmark = pytest.mark.django_db

COLUMNS = (
    "definition_event_id, message_event_id, cause_kind, cause_event_id, cause_scheduled_for, "
    "cause_webhook_invocation_id, lease_generation, lease_until, claimed_at, attempt, max_attempts, "
    "next_attempt_at, expires_at, failure_code, failure_message, execution_trace, trigger_context, "
    "community_id, workflow_id, run_id, claimed_by, history, renewals"
)


def clone(seed_step: str, prefix: str, n: int, status: str, targets: int) -> None:
    """``n`` copies of the seed delivery, spread over ``targets`` targets, in ``status``."""
    finished_at = "now()" if status == "finished" else "NULL"
    insert_delivery_rows(
        ["id", "step_id", "target_pubkey", "status", "finished_at", "created_at", *COLUMNS.split(", ")],
        f"""SELECT gen_random_uuid(), %s || g, decode(lpad(to_hex(g %% %s), 64, '0'), 'hex'),
                   %s, {finished_at}, d.created_at + g * interval '1 ms', {COLUMNS}
            FROM buzz_delivery_delivery d, generate_series(1, %s) g
            WHERE d.step_id = %s""",
        [prefix, targets, status, n, seed_step],
    )


def update_scan(plan: dict) -> dict:
    """The node under the claim's Update of the queue (issue 31, stage 2: inside the statement's
    ``claimed`` CTE) that scans the queue (not the candidate CTE)."""
    nodes, updates = [plan["Plan"]], []
    while nodes:
        node = nodes.pop()
        if node["Node Type"] == "ModifyTable" and node.get("Relation Name") == sql.QUEUE:
            updates.append(node)
        nodes += node.get("Plans", [])
    (update,) = updates
    stack = [p for p in update.get("Plans", []) if p.get("Parent Relationship") == "Outer"]
    while stack:
        node = stack.pop()
        if node.get("Relation Name") == sql.QUEUE:
            return node
        stack += [p for p in node.get("Plans", []) if p.get("Parent Relationship") != "InitPlan"]
    raise AssertionError(f"no scan of the queue under the Update: {json.dumps(plan)[:2000]}")


def assert_updates_by_primary_key(plan: dict, otherwise: str) -> None:
    """The UPDATE of ``plan`` reaches the delivery table through its primary key only (the scan
    and, for a bitmap heap scan, its bitmap index scans); ``otherwise``: what it read instead."""
    scan = update_scan(plan)
    nodes, indexes = [scan], []
    while nodes:
        node = nodes.pop()
        if "Index Name" in node:
            indexes.append(node["Index Name"])
        nodes += node.get("Plans", [])
    assert indexes and set(indexes) == {f"{sql.QUEUE}_pkey"}, (
        f"the UPDATE scans {scan['Node Type']} on {indexes} "
        f"(cond {scan.get('Index Cond') or scan.get('Recheck Cond')}, filter {scan.get('Filter')}): {otherwise}"
    )


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_the_batched_claim_updates_through_the_primary_key_with_stale_statistics(community, make_binding, generic):
    binding = make_binding(target_pubkey=random32())
    ev = models.Event.objects.get(community_id=community.id, event_id=binding.message_event_id)
    services.commit_deliveries(community.id, ev, [binding])
    seed_step = binding.step_id
    # All in the test's transaction: autovacuum never sees these rows, the statistics stay stale.
    clone(seed_step, "f", 30_000, "finished", 20)
    with connection.cursor() as cur:
        cur.execute("ANALYZE buzz_delivery_delivery_record")  # after the drain: nothing pending
        cur.execute(f"ANALYZE {sql.QUEUE}")
    clone(seed_step, "p", 20_000, "pending", 20)  # the burst since

    statement = sql.claim_oldest_pending(by_id=False, by_binding=False)
    params = {
        "community_id": community.id,
        "target_pubkey": bytes.fromhex("00" * 31 + "01"),
        "limit": 50,
        "lease_seconds": 30,
        "delivery_id": None,
        "holder": "review16",
    }
    if generic:  # the plan the claim's PL/pgSQL function caches (services.cached)
        ((plans,),) = generic_explain(cached.CLAIM, params, "FORMAT JSON")
        (plan,) = plans
    else:
        with connection.cursor() as cur:
            cur.execute("EXPLAIN (FORMAT JSON) " + statement, params)
            (plan,) = cur.fetchone()[0]
    assert_updates_by_primary_key(plan, "every pending row, not the candidates")


@pytest.mark.skipif(CITUS_MODE, reason="on Citus the functions plan each call (force_custom_plan)")
@pytest.mark.parametrize("targets", [20, 1], ids=["20_targets", "one_target"])
@pytest.mark.parametrize("communities", [4_000, None], ids=["fleet_statistics", "own_statistics"])
@pytest.mark.parametrize("statement", [cached.CLAIM, cached.CLAIM_HINTED], ids=lambda s: s.function)
def test_a_claim_in_a_large_community_among_many_small_ones_updates_through_the_primary_key(
    community, make_binding, statement, communities, targets
):
    """Many communities make the planner's estimate of one community's rows small (the table's
    rows over the distinct communities): the generic plan then reached the claimed rows through
    every row of the claiming community (delivery_identity_key on its community prefix, filtering
    ``id = ANY``), cheap for a small community and a read of all of a large one on every claim:
    a hinted claim's time grew with the community (bench.run --only wake). With the table's own
    statistics (one community, 20,000 pending, freshly analysed) as well."""
    if communities:  # the statistics of a fleet: 4,000 communities of ~5 deliveries
        with connection.cursor() as cur:
            cur.execute(
                f"ALTER TABLE buzz_delivery_delivery_record ALTER COLUMN community_id SET (n_distinct = {communities})"
            )
            cur.execute(f"ALTER TABLE {sql.QUEUE} ALTER COLUMN community_id SET (n_distinct = {communities})")
    binding = make_binding(target_pubkey=random32())
    ev = models.Event.objects.get(community_id=community.id, event_id=binding.message_event_id)
    (hinted,) = services.commit_deliveries(community.id, ev, [binding])
    clone(binding.step_id, "p", 20_000, "pending", targets)
    with connection.cursor() as cur:
        cur.execute("ANALYZE buzz_delivery_delivery_record")
        cur.execute(f"ANALYZE {sql.QUEUE}")
    params = {
        "community_id": community.id,
        "target_pubkey": binding.target_pubkey,
        "limit": 50 if statement is cached.CLAIM else 1,
        "lease_seconds": 30,
        "delivery_id": hinted,
        "holder": "review31",
    }
    ((plans,),) = generic_explain(statement, {name: params[name] for name, _ in statement.params}, "FORMAT JSON")
    (plan,) = plans
    assert_updates_by_primary_key(plan, "the community's rows")
