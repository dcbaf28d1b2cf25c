"""Not collected (no ``test_`` prefix): run by path to time the batch settle's generic plan before
(``d.status = 'claimed'``) and after (``sql.CLAIMED_BY_KEY``) core 0030, with 2,000 claimed in
one community (analyzed when ``ANALYZED_WITH`` were), interleaved, each settle rolled back.
``pytest -s -p no:cacheprovider tests/measure_settle_plan.py`` (bench/results/settle-plan.md)."""

from __future__ import annotations

import os
import re
import statistics

import pytest
from django.db import connection

from buzz_delivery import services
from buzz_delivery.services import cached, sql
from buzz_delivery.testing import random32
from tests.plan_support import generic_explain
from tests.test_claim_plan_stale_stats import clone

pytestmark = pytest.mark.django_db
ANALYZED_WITH = int(os.environ.get("ANALYZED_WITH", "200"))
ROUNDS = int(os.environ.get("ROUNDS", "15"))


def test_measure(community, message_event, make_binding):
    binding = make_binding(target_pubkey=random32())
    services.commit_deliveries(community.id, message_event, [binding])
    clone(binding.step_id, "p", 20_000, "pending", 20)
    services.claim_delivery(community.id, binding.target_pubkey)
    clone(binding.step_id, "a", ANALYZED_WITH, "claimed", 20)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE buzz_delivery_delivery_record")
    clone(binding.step_id, "c", 2_000 - ANALYZED_WITH, "claimed", 20)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id, lease_generation, target_pubkey FROM buzz_delivery_delivery"
            " WHERE community_id = %s AND status = 'claimed' ORDER BY random() LIMIT 50",
            [community.id],
        )
        ids, generations, targets = (list(c) for c in zip(*cursor.fetchall(), strict=True))
    params = {
        "community_id": community.id,
        "delivery_ids": ids,
        "lease_generations": generations,
        "target_pubkeys": targets,
        "status": "finished",
        "failure_code": None,
        "failure_message": None,
    }
    new = cached.FINISH_MANY
    old = cached.CachedStatement(
        function="old",
        statement=new.statement.replace(sql.CLAIMED_BY_KEY, "d.status = 'claimed'"),
        params=new.params,
        returns=new.returns,
        columns=new.columns,
    )
    times: dict[str, list[float]] = {"before": [], "after": []}
    buffers: dict[str, set[str]] = {"before": set(), "after": set()}
    for _ in range(ROUNDS):
        for name, statement in (("before", old), ("after", new)):
            with connection.cursor() as cursor:
                cursor.execute("SAVEPOINT measure")
            plan = "\n".join(r[0] for r in generic_explain(statement, params, "ANALYZE, BUFFERS"))
            with connection.cursor() as cursor:
                cursor.execute("ROLLBACK TO SAVEPOINT measure")
            assert re.search(r"Update on buzz_delivery_delivery_record d .*rows=50 ", plan), plan
            # The UPDATE's read of the batch (its join, under the Update node), without the triggers.
            join = re.search(r"\n  ->  .*actual time=[\d.]+\.\.([\d.]+) rows=50", plan)
            assert join, plan
            times[name].append(float(join.group(1)))
            buffers[name].add(re.search(r"Buffers: shared hit=(\d+)", plan.split("\n  ->", 1)[1]).group(1))
            if len(times[name]) == 1:
                print(f"--- {name}\n{plan}")
    for name in times:
        print(name, "join ms median", statistics.median(times[name]), sorted(times[name]), "buffers", buffers[name])
