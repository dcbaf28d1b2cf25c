"""A delivery references its run and its workflow through ONE key, and loses ``delivery_workflow_idx``
(issue 31; ``bench/results/index-diet.md``).

No claim or settle is a HOT update, so each of them adds an entry to every unconditional index of
``buzz_delivery_delivery_record``. ``delivery_workflow_idx`` (community, workflow) existed only
for the cascade of ``delivery_workflow_same_community`` (a deleted workflow's deliveries). A
delivery's workflow is always its run's (the engine binds ``run.workflow_id``, the tasks backend
its own workflow's run, the inbox producer's callers a run of the workflow they name): the two
keys (community, workflow) -> workflow and (community, run) -> run become one,
``delivery_run_workflow_same_community`` (community, workflow, run) -> the run's (community,
workflow, id), ON DELETE CASCADE, which the new UNIQUE ``workflow_run_workflow_run_key`` (community,
workflow, id) of the run table serves (it replaces ``workflow_run_workflow_idx`` (community,
workflow), whose prefix it keeps for the run's own cascade from its workflow). Then:

- deleting a run deletes its deliveries through the new key, found by the identity key's
  (community, run) prefix, as before;
- deleting a workflow deletes its runs (``workflow_run_workflow_same_community``, through the
  run key's (community, workflow) prefix) and through them their deliveries;
- the new key also refuses what the two did not: a delivery whose workflow is not its run's.

The key's columns never change on a claim or settle: its check does not run there.

Locks: the swap is one transaction of short statements (the run key's build takes SHARE on the
run table, which only new runs wait for); the new key is added ``NOT VALID``, so that
transaction does not read the record. Existing rows are validated afterwards, in a transaction
of their own (``VALIDATE CONSTRAINT``: SHARE UPDATE EXCLUSIVE on the record, which claims,
settles and commits do not wait for). Validated inside the swap, the scan held SHARE ROW
EXCLUSIVE on the record to the commit: every write of the record waited, 0.7 s for 2,000,000
deliveries (``bench/results/index-diet.md``, "The migration's locks"). A delivery whose workflow
is not its run's stops the validation, named by the violated key; the swap stays (the key
refuses such rows from then on), and ``migrate`` again, once the rows are put right, validates
and records the migration (the swap is not made twice). Backwards: the two keys (``NOT VALID``,
then validated the same way) and both indexes again, the record's built ``CONCURRENTLY``.

On Citus the tables are co-located by ``community_id``, which every key and the unique index
include; each statement is one command (Citus propagates it with its text, ``NOT VALID`` and
``VALIDATE CONSTRAINT`` included)."""

from typing import Any

from django.db import migrations, models

RECORD = "buzz_delivery_delivery_record"
RUN = "buzz_delivery_workflow_run"
ONE_KEY = "delivery_run_workflow_same_community"

ADD_ONE_KEY = (
    f"ALTER TABLE {RECORD} ADD CONSTRAINT {ONE_KEY}"
    f" FOREIGN KEY (community_id, workflow_id, run_id) REFERENCES {RUN} (community_id, workflow_id, id)"
    " ON DELETE CASCADE NOT VALID"
)
VALIDATE_ONE_KEY = f"ALTER TABLE {RECORD} VALIDATE CONSTRAINT {ONE_KEY}"
# Core migration 0002's keys (the table was then named buzz_delivery_delivery).
OLD_KEYS = {
    "delivery_workflow_same_community": "(community_id, workflow_id) REFERENCES buzz_delivery_workflow (community_id, id)",
    "delivery_run_same_community": f"(community_id, run_id) REFERENCES {RUN} (community_id, id)",
}

SWAP = [
    f"ALTER TABLE {RUN} ADD CONSTRAINT workflow_run_workflow_run_key UNIQUE (community_id, workflow_id, id)",
    ADD_ONE_KEY,
    *(f"ALTER TABLE {RECORD} DROP CONSTRAINT {name}" for name in OLD_KEYS),
    "DROP INDEX delivery_workflow_idx",
    "DROP INDEX workflow_run_workflow_idx",
]
UNSWAP = [
    f"CREATE INDEX workflow_run_workflow_idx ON {RUN} (community_id, workflow_id)",
    *(
        f"ALTER TABLE {RECORD} ADD CONSTRAINT {name} FOREIGN KEY {key} ON DELETE CASCADE NOT VALID"
        for name, key in OLD_KEYS.items()
    ),
    f"ALTER TABLE {RECORD} DROP CONSTRAINT {ONE_KEY}",
    f"ALTER TABLE {RUN} DROP CONSTRAINT workflow_run_workflow_run_key",
]


def _swapped(schema_editor: Any) -> bool:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = %s::regclass AND conname = %s)",
            [RECORD, ONE_KEY],
        )
        return bool(cursor.fetchone()[0])


def swap(apps: Any, schema_editor: Any) -> None:
    """One transaction of short statements; skipped when an earlier ``migrate`` made it and the
    validation stopped it there (a delivery whose workflow was not its run's)."""
    if not _swapped(schema_editor):
        for statement in SWAP:
            schema_editor.execute(statement)


def unswap(apps: Any, schema_editor: Any) -> None:
    if _swapped(schema_editor):
        for statement in UNSWAP:
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    # The validations run in transactions of their own, after the swap's (module docstring).
    atomic = False

    dependencies = [("buzz_delivery", "0035_history_push_without_jsonpath")]

    operations = [
        # Backwards only, so last, once the swap back committed: the record's workflow index
        # built CONCURRENTLY and the old keys' validations (none of them stops the record's writes).
        migrations.RunSQL(
            sql=migrations.RunSQL.noop,
            reverse_sql=[
                f"CREATE INDEX CONCURRENTLY IF NOT EXISTS delivery_workflow_idx ON {RECORD} (community_id, workflow_id)",
                *(f"ALTER TABLE {RECORD} VALIDATE CONSTRAINT {name}" for name in OLD_KEYS),
            ],
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddConstraint(
                    model_name="workflowrun",
                    constraint=models.UniqueConstraint(
                        fields=("community", "workflow", "id"), name="workflow_run_workflow_run_key"
                    ),
                ),
                migrations.RemoveIndex(model_name="deliveryrecord", name="delivery_workflow_idx"),
                migrations.RemoveIndex(model_name="workflowrun", name="workflow_run_workflow_idx"),
            ],
            database_operations=[migrations.RunPython(swap, unswap, atomic=True, elidable=False)],
        ),
        migrations.RunSQL(sql=VALIDATE_ONE_KEY, reverse_sql=migrations.RunSQL.noop),
    ]
