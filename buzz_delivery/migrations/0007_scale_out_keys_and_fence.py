"""Citus's router form for the core tables (SPEC section 15), on plain PostgreSQL too.

- Primary keys include ``community_id``: ``(id, community_id)`` on workflow, workflow run,
  event and delivery, which Citus requires of a table distributed by ``community_id``. The
  ``UNIQUE (community_id, id)`` keys the composite foreign keys used are now the primary keys,
  so those keys are dropped and the foreign keys re-pointed. ``id`` comes first so that a
  lookup by id alone (Django's, the admin's) stays a primary-key probe without a second index
  on the hot path; lookups by ``(community_id, id)`` use it as well. Django still sees ``id``
  as the primary key.
- The maintenance indexes lead with ``community_id``: the reaper and pruner walk communities.
- ``buzz_delivery_when`` and ``buzz_delivery_plus_seconds``: IMMUTABLE helpers that keep time
  out of CASE and column arithmetic out of STABLE operators in SET, which Citus refuses.
- The lifecycle trigger takes the fence lock exclusively itself, so a move meets the writers
  on the node that owns the community (the write fence, SPEC sections 5 and 15).
"""

import importlib

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

_0002 = importlib.import_module("buzz_delivery.migrations.0002_tenant_keys_and_write_fence")
KEYED_TABLES = ("buzz_delivery_workflow", "buzz_delivery_workflow_run", "buzz_delivery_event", "buzz_delivery_delivery")

_0005 = importlib.import_module("buzz_delivery.migrations.0005_delivery_history_guards")
# A move no longer locks the community row FOR UPDATE before its UPDATE (its trigger takes the
# fence lock instead), and a non-key UPDATE does not conflict with FOR KEY SHARE: a writer whose
# REPEATABLE READ snapshot predates the move must lock the row FOR SHARE to get its 40001.
FENCE_FUNCTION = _0005.FENCE_FUNCTION_SNAPSHOT_SAFE.replace(
    "WHERE id = cid FOR KEY SHARE;", "WHERE id = cid FOR SHARE;"
)
assert FENCE_FUNCTION != _0005.FENCE_FUNCTION_SNAPSHOT_SAFE

# PL/pgSQL, not SQL: a SQL function would be inlined back into the CASE Citus refuses.
HELPERS = """
CREATE OR REPLACE FUNCTION buzz_delivery_when(cond boolean, value anyelement) RETURNS anyelement
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    IF cond THEN
        RETURN value;
    END IF;
    RETURN NULL;
END;
$$;
-- Seconds only (no days or months), so the sum does not depend on the time zone: IMMUTABLE.
CREATE OR REPLACE FUNCTION buzz_delivery_plus_seconds(ts timestamptz, secs double precision) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    RETURN ts + make_interval(secs => secs);
END;
$$;
"""
DROP_HELPERS = """
DROP FUNCTION buzz_delivery_when(boolean, anyelement);
DROP FUNCTION buzz_delivery_plus_seconds(timestamptz, double precision);
"""


def _drop_fks() -> str:
    return "\n".join(f"ALTER TABLE {t} DROP CONSTRAINT {n};" for t, n, _c, _r in _0002.COMPOSITE_KEYS)


def _add_fks() -> str:
    return "\n".join(
        f"ALTER TABLE {t} ADD CONSTRAINT {n} FOREIGN KEY {c} REFERENCES {r} ON DELETE CASCADE;"
        for t, n, c, r in _0002.COMPOSITE_KEYS
    )


def _primary_keys(columns: str) -> str:
    return "\n".join(
        f"ALTER TABLE {t} DROP CONSTRAINT {t}_pkey; ALTER TABLE {t} ADD CONSTRAINT {t}_pkey PRIMARY KEY ({columns});"
        for t in KEYED_TABLES
    )


class Migration(migrations.Migration):
    dependencies = [
        ("buzz_delivery", "0006_database_clock"),
    ]

    operations = [
        migrations.RunSQL(sql=HELPERS, reverse_sql=DROP_HELPERS),
        migrations.RunSQL(sql=FENCE_FUNCTION, reverse_sql=_0005.FENCE_FUNCTION_SNAPSHOT_SAFE),
        # Foreign keys first (they depend on the unique keys), then the keys, then back.
        migrations.RunSQL(sql=_drop_fks(), reverse_sql=_add_fks()),
        pgtrigger.migrations.RemoveTrigger(
            model_name="community",
            name="community_lifecycle_forward_only",
        ),
        migrations.RemoveConstraint(
            model_name="workflow",
            name="workflow_community_id_key",
        ),
        migrations.RemoveConstraint(
            model_name="workflowrun",
            name="workflow_run_community_id_key",
        ),
        migrations.RunSQL(sql=_primary_keys("id, community_id"), reverse_sql=_primary_keys("id")),
        migrations.RunSQL(sql=_add_fks(), reverse_sql=_drop_fks()),
        migrations.RemoveIndex(
            model_name="workflowagentdelivery",
            name="delivery_claimed_lease_idx",
        ),
        migrations.RemoveIndex(
            model_name="workflowagentdelivery",
            name="delivery_pending_expiry_idx",
        ),
        migrations.RemoveIndex(
            model_name="workflowagentdelivery",
            name="delivery_terminal_age_idx",
        ),
        migrations.AddIndex(
            model_name="workflowagentdelivery",
            index=models.Index(
                condition=models.Q(("status", "claimed")),
                fields=["community", "lease_until"],
                name="delivery_claimed_lease_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="workflowagentdelivery",
            index=models.Index(
                condition=models.Q(("expires_at__isnull", False), ("status", "pending")),
                fields=["community", "expires_at"],
                name="delivery_pending_expiry_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="workflowagentdelivery",
            index=models.Index(
                condition=models.Q(("status__in", ["finished", "failed", "expired"])),
                fields=["community", "finished_at"],
                name="delivery_terminal_age_idx",
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="community",
            trigger=pgtrigger.compiler.Trigger(
                name="community_lifecycle_forward_only",
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    declare="DECLARE old_rank int; new_rank int;",
                    func="\n            IF NEW.id IS DISTINCT FROM OLD.id THEN\n                RAISE EXCEPTION USING ERRCODE = 'BD002',\n                    MESSAGE = 'buzz_delivery: a community id never changes';\n            END IF;\n            IF NEW.deletion_state IS DISTINCT FROM OLD.deletion_state THEN\n                -- The write fence's other side: writers hold this lock shared until they\n                -- commit; taken here, on the node that owns the community row, it waits for\n                -- them and queues later writers behind this move (SPEC sections 5, 15).\n                PERFORM pg_advisory_xact_lock(1111752705, hashtext(OLD.id::text));\n                old_rank := array_position(ARRAY['active','quiescing','fenced','tombstone'], OLD.deletion_state);\n                new_rank := array_position(ARRAY['active','quiescing','fenced','tombstone'], NEW.deletion_state);\n                IF new_rank IS DISTINCT FROM old_rank + 1 THEN\n                    RAISE EXCEPTION USING ERRCODE = 'BD002',\n                        MESSAGE = format('buzz_delivery: community %s cannot move from %s to %s '\n                                         '(states move forward one step at a time)',\n                                         OLD.id, OLD.deletion_state, NEW.deletion_state);\n                END IF;\n                IF NEW.deletion_state = 'tombstone' AND (EXISTS (SELECT 1 FROM buzz_delivery_delivery WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_workflow_run WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_event WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_workflow WHERE community_id = OLD.id)) THEN\n                    RAISE EXCEPTION USING ERRCODE = 'BD002',\n                        MESSAGE = format('buzz_delivery: community %s still holds rows; '\n                                         'purge it before it becomes tombstone', OLD.id);\n                END IF;\n                NEW.fence_generation := OLD.fence_generation + 1;\n                NEW.state_changed_at := now();\n            ELSIF NEW.fence_generation IS DISTINCT FROM OLD.fence_generation THEN\n                RAISE EXCEPTION USING ERRCODE = 'BD002',\n                    MESSAGE = 'buzz_delivery: fence_generation changes only with a lifecycle move';\n            END IF;\n            RETURN NEW;\n        ",
                    hash="b48cd3024528c47e25486bf19f3c3c2cc6bd0b11",
                    operation="UPDATE",
                    pgid="pgtrigger_community_lifecycle_forward_only_9a308",
                    table="buzz_delivery_community",
                    when="BEFORE",
                ),
            ),
        ),
    ]
