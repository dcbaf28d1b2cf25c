"""Invariants Django cannot declare: tenant-consistent composite foreign keys
(with ON DELETE CASCADE) and the write-fence function the triggers call.

A delivery can never point at another community's workflow, run or message
event, even through raw SQL: each reference includes ``community_id``.
"""

from django.db import migrations

FENCE_FUNCTION = """
CREATE OR REPLACE FUNCTION buzz_delivery_check_write_fence(cid uuid, op text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    st text;
    gen bigint;
BEGIN
    IF cid IS NULL THEN
        RETURN;  -- NOT NULL constraints report this row
    END IF;
    -- Shared with every other writer of this community; a lifecycle move takes it
    -- exclusively, so it waits for writers already inside a transaction and none slips past.
    PERFORM pg_advisory_xact_lock_shared(1111752705, hashtext(cid::text));
    SELECT deletion_state, fence_generation INTO st, gen FROM buzz_delivery_community WHERE id = cid;
    IF st IS NULL OR st = 'active' THEN
        RETURN;  -- unknown community: the foreign key reports it
    END IF;
    -- The purge executor's bypass: only deletes, only for a fenced community, and only for the
    -- community and fence generation it named with set_config(..., true) in its own transaction.
    IF st = 'fenced' AND op = 'DELETE'
       AND current_setting('buzz_delivery.purge_community', true) = cid::text
       AND current_setting('buzz_delivery.purge_fence_generation', true) = gen::text THEN
        RETURN;
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'BD001',
        MESSAGE = format('buzz_delivery: community %s is %s; its rows cannot be written (write fence)', cid, st),
        HINT = 'Only active communities accept writes; a fenced community is emptied by purge_community.';
END;
$$;
"""

COMPOSITE_KEYS = [
    ("buzz_delivery_workflow_run", "workflow_run_workflow_same_community",
     "(community_id, workflow_id)", "buzz_delivery_workflow (community_id, id)"),
    ("buzz_delivery_delivery", "delivery_workflow_same_community",
     "(community_id, workflow_id)", "buzz_delivery_workflow (community_id, id)"),
    ("buzz_delivery_delivery", "delivery_run_same_community",
     "(community_id, run_id)", "buzz_delivery_workflow_run (community_id, id)"),
    ("buzz_delivery_delivery", "delivery_message_event_same_community",
     "(community_id, message_event_id)", "buzz_delivery_event (community_id, event_id)"),
]


def _add_fk(table: str, name: str, cols: str, ref: str) -> migrations.RunSQL:
    return migrations.RunSQL(
        sql=f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY {cols} REFERENCES {ref} ON DELETE CASCADE;",
        reverse_sql=f"ALTER TABLE {table} DROP CONSTRAINT {name};",
    )


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0001_initial")]

    operations = [
        migrations.RunSQL(sql=FENCE_FUNCTION, reverse_sql="DROP FUNCTION buzz_delivery_check_write_fence(uuid, text);"),
        *[_add_fk(*spec) for spec in COMPOSITE_KEYS],
    ]
