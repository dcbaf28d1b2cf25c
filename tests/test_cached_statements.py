"""The plan-cached lease statements (``buzz_delivery.services.cached``, issue 16): the functions
in the database run today's statements, the services call them, and their cached plans stay
with the backend that made them (so a pooler in between changes nothing)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from django.db import connection

from buzz_delivery import models, services
from buzz_delivery.services import cached, sql
from buzz_delivery.services.db import SERVER_BOUND
from buzz_delivery.testing import random32
from tests.citus_support import CITUS_MODE
from tests.plan_support import database_function as _function

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("statement", cached.ALL, ids=lambda s: s.function)
def test_the_database_function_runs_todays_statement(statement):
    """A statement of services/sql.py changed without a migration re-creating its function
    fails here: add one that runs ``cached.<NAME>.create_sql()`` (frozen, as 0017 does)."""
    body, arguments, config = _function(statement.function)
    assert body == statement.body, f"{statement.function} is stale: write a migration with its create_sql()"
    with connection.cursor() as cursor:  # the catalog prints each type's canonical name
        cursor.execute("SELECT " + ", ".join(f"'{kind}'::regtype::text" for _, kind in statement.params))
        kinds = cursor.fetchone()
    assert arguments == ", ".join(f"p_{name} {kind}" for (name, _), kind in zip(statement.params, kinds, strict=True))
    if not CITUS_MODE:
        assert config == ["plan_cache_mode=force_generic_plan"]
        return
    # On Citus (manage.py distribute_tables): planned per call, on the worker its call is
    # delegated to, whose community its first argument names.
    assert config == ["plan_cache_mode=force_custom_plan"]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT distribution_argument_index, force_delegation FROM pg_dist_object"
            " WHERE classid = 'pg_proc'::regclass AND objid = %s::regprocedure",
            [f"{statement.function}({', '.join(kind for _, kind in statement.params)})"],
        )
        assert cursor.fetchall() == [(0, True)]


@pytest.mark.parametrize("statement", cached.ALL, ids=lambda s: s.function)
def test_the_services_send_the_calls_bound_on_the_server(statement):
    assert statement.call in SERVER_BOUND


def test_the_claim_and_both_settles_go_through_the_functions(community, message_event, make_binding):
    """The statements the services send, seen with Django's query log: each names its function."""
    from django.test.utils import CaptureQueriesContext

    target = random32()
    services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=target) for _ in range(6)])
    with CaptureQueriesContext(connection) as queries:
        one = services.claim_delivery(community.id, target)
        assert isinstance(services.finish_delivery(one.lease, "finished"), services.Settled)
        rest = services.claim_deliveries(community.id, target, limit=5)
        assert {type(o) for o in services.finish_deliveries([c.lease for c in rest])} == {services.Settled}
    sent = " ".join(q["sql"] for q in queries.captured_queries)
    assert sent.count(cached.CLAIM.function + "(") == 2
    assert sent.count(cached.FINISH.function + "(") == 1
    assert sent.count(cached.FINISH_MANY.function + "(") == 1


def test_a_statement_whose_parameters_do_not_match_its_declaration_is_refused():
    with pytest.raises(ValueError, match="declared"):
        cached.CachedStatement("f", "SELECT %(a)s, %(b)s", (("a", "int"),), "TABLE(x int)", "d.x")


def test_a_hinted_claim_goes_through_its_function(community, message_event, make_binding):
    """A wake hint's claim (``claim_delivery(..., delivery_id=...)``, the worker's wake path) is
    the plan-cached ``buzz_delivery_claim_hinted`` call and claims the named delivery only."""
    from django.test.utils import CaptureQueriesContext

    target = random32()
    ids = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target) for _ in range(3)]
    )
    with CaptureQueriesContext(connection) as queries:
        claim = services.claim_delivery(community.id, target, delivery_id=ids[1], holder="hinted")
    assert claim is not None and claim.lease.delivery_id == ids[1]
    assert claim.delivery.claimed_by == "hinted" and claim.delivery.status == "claimed"
    assert services.claim_delivery(community.id, target, delivery_id=ids[1]) is None  # claimed already
    sent = " ".join(q["sql"] for q in queries.captured_queries)
    assert sent.count(cached.CLAIM_HINTED.function + "(") == 1
    assert cached.CLAIM.function not in sent


def test_the_hinted_claims_cached_plan_reads_the_named_row_by_its_key(community, message_event, make_binding):
    """The hinted claim's generic plan (what its function caches) reaches the named row through
    the primary key, in the candidate CTE and in the UPDATE, not through a scan of the pending."""
    from tests.plan_support import generic_explain

    ids = services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=random32())])
    # The cached plan as a busy table's statistics make it: a backlog of pending rows on one
    # target and settled ones (in the test's transaction), analyzed.
    from tests.test_claim_plan_stale_stats import clone

    seed_step = models.WorkflowAgentDelivery.objects.get(id=ids[0]).step_id
    clone(seed_step, "p", 3_000, "pending", 1)
    clone(seed_step, "f", 3_000, "finished", 1)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE buzz_delivery_delivery_record")
        cursor.execute(f"ANALYZE {sql.QUEUE}")
    params = {
        "community_id": community.id,
        "target_pubkey": bytes(32),  # the backlog's target
        "delivery_id": ids[0],
        "limit": 1,
        "lease_seconds": 30,
        "holder": "plan",
    }
    plan = "\n".join(row[0] for row in generic_explain(cached.CLAIM_HINTED, params))
    indexes = {
        name for name in re.findall(r"Index Scan (?:using|on) (\w+)", plan) if name.startswith("buzz_delivery_delivery")
    }
    # The queue row by its key (the claim), then its record by its key (the claimed columns).
    assert indexes == {f"{sql.QUEUE}_pkey", "buzz_delivery_delivery_pkey"}, plan
    assert "Seq Scan on buzz_delivery_delivery" not in plan, plan


def test_the_batch_settles_run_locks_reach_the_rows_by_their_keys(community, message_event, make_binding):
    """The lock of the batch's runs that the batch settle takes first (in run order, issue 31)
    reads the named deliveries and their runs through the primary keys in its generic plan, and
    locks the runs after sorting them, not a scan of either table."""
    from tests.plan_support import generic_explain

    ids = services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=random32())])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE buzz_delivery_workflow_run")
    # The plan as a busy table's statistics make it (on a fresh table the planner may reach the
    # rows through another index of the community's): a backlog, analyzed.
    from tests.test_claim_plan_stale_stats import clone

    seed_step = models.WorkflowAgentDelivery.objects.get(id=ids[0]).step_id
    clone(seed_step, "p", 3_000, "pending", 1)
    clone(seed_step, "f", 3_000, "finished", 1)
    with connection.cursor() as cursor:
        # Busy runs too: ANALYZE writes a table's size outside the transaction, so an earlier
        # test that analyzed a nearly empty run table would otherwise leave a plan that scans it.
        cursor.execute(
            """INSERT INTO buzz_delivery_workflow_run (id, community_id, workflow_id, created_at)
               SELECT gen_random_uuid(), r.community_id, r.workflow_id, r.created_at
               FROM buzz_delivery_workflow_run r, generate_series(1, 3000)
               WHERE r.community_id = %s""",
            [community.id],
        )
        cursor.execute("ANALYZE buzz_delivery_delivery_record")
        cursor.execute("ANALYZE buzz_delivery_workflow_run")
    query = re.sub(r"\bp_(community_id|delivery_ids)\b", r"%(\1)s", sql.LOCK_RUNS_OF_DELIVERIES)
    statement = cached.CachedStatement(
        function="lock_runs",
        statement=query.replace("PERFORM", "SELECT", 1).strip().rstrip(";"),
        params=(("community_id", "uuid"), ("delivery_ids", "uuid[]")),
        returns="",
        columns="",
    )
    plan = "\n".join(row[0] for row in generic_explain(statement, {"community_id": community.id, "delivery_ids": ids}))
    assert "Seq Scan" not in plan, plan
    # An index scan or, with many ids, a bitmap scan of the same key.
    assert set(re.findall(r"Index Scan (?:using|on) (\w+)", plan)) == {
        "buzz_delivery_delivery_pkey",
        "buzz_delivery_workflow_run_pkey",
    }, plan
    assert plan.index("LockRows") < plan.index("Sort"), plan  # the lock above the sort: taken in run order


# The batch renewal is a plain statement, not a plan-cached function, but psycopg prepares it on a
# holder's connection after five runs and PostgreSQL may then plan it generically as well.
RENEW_MANY = SimpleNamespace(
    function="renew_many_prepared_by_psycopg",
    statement=sql.RENEW_MANY_IF_CURRENT_GENERATION,
    params=(("community_id", "uuid"), ("delivery_ids", "uuid[]"), ("lease_generations", "bigint[]"),
            ("target_pubkeys", "bytea[]"), ("lease_seconds", "double precision")),
)  # fmt: skip


@pytest.mark.skipif(CITUS_MODE, reason="on Citus the functions plan each call (force_custom_plan)")
@pytest.mark.parametrize("analyzed_with", [2_000, 200, 0], ids=lambda n: f"analyzed_with_{n}_claimed")
@pytest.mark.parametrize("statement", [cached.FINISH_MANY, cached.SETTLE_MANY, RENEW_MANY], ids=lambda s: s.function)
def test_the_batch_settles_cached_plan_reads_the_batch_by_its_key(
    community, message_event, make_binding, statement, analyzed_with
):
    """The batch settle's generic plan (what its function caches; the batch renewal's once psycopg
    has prepared it) reaches the batch's rows
    through the primary key, not through every row claimed in the community
    (delivery_claimed_lease_idx), with ~2,000 claimed in it (a fleet of workers claiming ahead),
    whatever an ANALYZE saw claimed: claimed rows are transient, so the statistics hold what was
    claimed at that moment (bench/results/worker-k4.md: 0.80 ms against 0.25 ms by key)."""
    from tests.plan_support import generic_explain
    from tests.test_claim_plan_stale_stats import clone

    binding = make_binding(target_pubkey=random32())
    services.commit_deliveries(community.id, message_event, [binding])
    clone(binding.step_id, "p", 20_000, "pending", 20)  # a backlog
    seed = services.claim_delivery(community.id, binding.target_pubkey)
    assert seed is not None
    clone(binding.step_id, "a", analyzed_with, "claimed", 20)  # claimed rows copy the seed's lease
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE buzz_delivery_delivery_record")
        cursor.execute(f"ANALYZE {sql.QUEUE}")
    clone(binding.step_id, "c", 2_000 - analyzed_with, "claimed", 20)  # claimed since
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id, lease_generation, target_pubkey FROM buzz_delivery_delivery"
            " WHERE community_id = %s AND status = 'claimed' LIMIT 50",
            [community.id],
        )
        ids, generations, targets = (list(column) for column in zip(*cursor.fetchall(), strict=True))
    n = len(ids)
    values = {
        "community_id": community.id,
        "delivery_ids": ids,
        "lease_generations": generations,
        "target_pubkeys": targets,
        "status": "finished",
        "failure_code": None,
        "failure_message": None,
        "outcomes": ["finished"] * n,
        "failure_codes": [None] * n,
        "failure_messages": [None] * n,
        "jitters": [1.0] * n,
        "retry_afters": [0.0] * n,
        "backoff_base": 1.0,
        "backoff_cap": 60.0,
        "lease_seconds": 30.0,
    }
    rows = generic_explain(statement, {name: values[name] for name, _ in statement.params}, "ANALYZE")
    plan = "\n".join(row[0] for row in rows)
    assert "delivery_claimed_lease_idx" not in plan, plan
    assert "Seq Scan on buzz_delivery_delivery" not in plan, plan
    # Issue 31, stage 2: the lease rows are the queue's (a renewal updates them, a settle deletes
    # them and updates their records, each by its key).
    indexes = set(re.findall(rf"Index Scan using (\w+) on {sql.QUEUE} d(?:_\d+)?\b", plan))  # d_1: in a CTE
    assert indexes == {f"{sql.QUEUE}_pkey"}, plan
    assert re.search(rf"(Update|Delete) on {sql.QUEUE} d(?:_\d+)? .*\(actual .* rows=50 ", plan), plan  # all 50 settled
    if statement is not RENEW_MANY:
        indexes = set(re.findall(r"Index Scan using (\w+) on buzz_delivery_delivery_record r\b", plan))
        assert indexes == {"buzz_delivery_delivery_pkey"}, plan
        assert re.search(r"Update on buzz_delivery_delivery_record r .*\(actual .* rows=50 ", plan), plan
