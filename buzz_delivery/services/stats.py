"""Read-only figures for operators: what a stopping worker leaves waiting (SPEC section 7), and
rows per state of a table that may hold millions (the metrics endpoint, the dashboard).

Nothing here changes state; every statement is a bounded index read, a catalog read or an
``EXPLAIN``."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable

from django.db import connection
from django.db.models import Count, Model

from buzz_delivery.models import DeliveryRecord, WorkflowAgentDelivery
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all
from buzz_delivery.services.sql import DB_NOW, QUEUE
from buzz_delivery.services.tenancy import fleet_scoped, tenant_scoped

# Up to this many rows a table's states are counted exactly; above it they are estimated.
EXACT_CAP = 100_000

# The pending rows of one community and target whose retry backoff has not passed yet: the
# live queue's (stage 2), through its poll index (community, target, ...).
COUNT_PENDING_RETRY = f"""
SELECT count(*) FROM {QUEUE} AS d
WHERE d.community_id = %(community_id)s AND d.target_pubkey = %(target_pubkey)s
  AND d.status = 'pending' AND d.next_attempt_at > {DB_NOW}
"""


@tenant_scoped
def count_pending_retry(community_id: uuid.UUID, target_pubkey: bytes) -> int:
    """How many deliveries of ``community_id`` and ``target_pubkey`` are ``pending`` and still
    waiting out a retry backoff (``next_attempt_at`` in the future, database clock)."""
    params = {
        "community_id": v.uuid_value(community_id, "community_id"),
        "target_pubkey": v.bytes32(target_pubkey, "target_pubkey"),
    }
    return int(fetch_all(COUNT_PENDING_RETRY, params)[0][0])


# The table's own size, and whether this is a Citus coordinator (one statement on PostgreSQL).
_LOCAL_ESTIMATE = """
SELECT reltuples::bigint, to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL
FROM pg_class WHERE oid = to_regclass(%(table)s)
"""
# On a Citus coordinator a distributed table's own pg_class row is an empty shell: its size is
# the sum over its shards (SPEC section 15). Whether it is distributed, and that sum, in one.
_SHARDED_ESTIMATE = """
SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = to_regclass(%(table)s)),
       (SELECT sum(s.result::bigint)::bigint FROM pg_dist_partition AS p
        CROSS JOIN LATERAL run_command_on_shards(
            p.logicalrelid, $cmd$ SELECT reltuples::bigint FROM pg_class WHERE oid = '%%s'::regclass $cmd$) AS s
        WHERE p.logicalrelid = to_regclass(%(table)s) AND s.success AND s.result::bigint >= 0)
"""


def physical_table(model: type[Model]) -> str:
    """The table holding ``model``'s rows: its own, or, for the delivery view
    (:class:`~buzz_delivery.models.WorkflowAgentDelivery`), the record's (a view has no
    ``reltuples`` and no shards)."""
    if model is WorkflowAgentDelivery:
        return DeliveryRecord._meta.db_table
    return model._meta.db_table


def table_row_estimate(model: type[Model]) -> int | None:
    """``pg_class.reltuples`` of the model's table (:func:`physical_table`; summed over its
    shards on a Citus coordinator), or None when the table was never analysed. One catalog read
    on PostgreSQL, two on a Citus coordinator."""
    params = {"table": connection.ops.quote_name(physical_table(model))}
    with connection.cursor() as cursor:
        cursor.execute(_LOCAL_ESTIMATE, params)
        row = cursor.fetchone()
        if row is not None and row[1]:
            cursor.execute(_SHARDED_ESTIMATE, params)
            distributed, shards = cursor.fetchone()
            if distributed:
                row = (shards,)
    if row is None or row[0] is None or row[0] < 0:
        return None
    return int(row[0])


def _planner_rows(model: type[Model], field: str, value: str) -> int:
    """The planner's estimate of the rows with ``field = value`` (``EXPLAIN``, nothing run)."""
    plan = json.loads(model._base_manager.filter(**{field: value}).order_by().explain(format="json"))
    return int(plan[0]["Plan"]["Plan Rows"])


@fleet_scoped
def counts_by(
    model: type[Model], field: str, values: Iterable[str], *, cap: int = EXACT_CAP
) -> tuple[dict[str, int], bool]:
    """Rows of ``model`` per value of ``field`` (every one of ``values``, 0 when absent), and
    whether they are estimates: exact for a table of at most ``cap`` rows (by
    ``pg_class.reltuples``, summed over the shards on a Citus coordinator, or a count that stops
    past ``cap`` when the table was never analysed), the planner's estimates (``EXPLAIN``,
    nothing read) above. At most two cheap statements for a small table (three on a Citus
    coordinator), one plus one ``EXPLAIN`` per value for a big one."""
    values = list(values)
    size = table_row_estimate(model)
    if size is None:  # never analysed: count, but stop past the cap
        size = model._base_manager.order_by().values("pk")[: cap + 1].count()
    if size > cap:
        return {value: _planner_rows(model, field, value) for value in values}, True
    counts = dict.fromkeys(values, 0)
    rows = model._base_manager.order_by().values_list(field).annotate(n=Count("pk"))
    counts.update({str(value): n for value, n in rows})
    return counts, False
