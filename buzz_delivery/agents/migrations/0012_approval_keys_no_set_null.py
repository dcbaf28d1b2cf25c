"""The agent run's and the journal's keys to their engine approval lose ``ON DELETE SET NULL
(approval_id)``: Citus refuses SET NULL (or SET DEFAULT) on a foreign key that includes the
distribution column (``community_id``), so ``distribute_tables`` stopped at them (issue 30).

Nothing relied on it: an agent's approval has no engine run (``run_id`` NULL), so no cascade
reaches it, and a purge deletes the agent tables before the engine's (the deletion catalog), so
an approval is never deleted while a run or journal entry still points at it. The keys are now
the default ``NO ACTION``, still checked at commit (DEFERRABLE): deleting an approval that is
still referenced is refused instead of silently forgetting the link. The static rule test
refuses ``SET NULL``/``SET DEFAULT`` on any key of a community-scoped table.
"""

from django.db import migrations

KEYS = [
    ("buzz_agents_run", "ag_run_approval_same_community"),
    ("buzz_agents_journal", "ag_journal_approval_same_community"),
]
REFERENCE = "FOREIGN KEY (community_id, approval_id) REFERENCES buzz_workflows_approval (community_id, id)"


def _rekey(table: str, name: str) -> migrations.RunSQL:
    # Two statements: on a Citus cluster already distributed, Citus refuses ADD CONSTRAINT
    # together with another subcommand.
    return migrations.RunSQL(
        sql=[
            f"ALTER TABLE {table} DROP CONSTRAINT {name}",
            f"ALTER TABLE {table} ADD CONSTRAINT {name} {REFERENCE} DEFERRABLE INITIALLY DEFERRED",
        ],
        reverse_sql=[
            f"ALTER TABLE {table} DROP CONSTRAINT {name}",
            f"ALTER TABLE {table} ADD CONSTRAINT {name} {REFERENCE} ON DELETE SET NULL (approval_id)"
            " DEFERRABLE INITIALLY DEFERRED",
        ],
    )


class Migration(migrations.Migration):
    dependencies = [("buzz_agents", "0011_approval_index")]

    operations = [_rekey(table, name) for table, name in KEYS]
