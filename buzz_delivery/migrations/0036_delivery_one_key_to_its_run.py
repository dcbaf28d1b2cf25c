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

The key's columns never change on a claim or settle: its check does not run there. Existing rows
are validated when it is added (a delivery whose workflow is not its run's stops the migration,
named by the violated key). Backwards: the two keys and both indexes again.

On Citus the tables are co-located by ``community_id``, which every key and the unique index
include; each statement is one command (Citus propagates it with its text)."""

from django.db import migrations, models

RECORD = "buzz_delivery_delivery_record"
RUN = "buzz_delivery_workflow_run"

ADD_ONE_KEY = (
    f"ALTER TABLE {RECORD} ADD CONSTRAINT delivery_run_workflow_same_community"
    f" FOREIGN KEY (community_id, workflow_id, run_id) REFERENCES {RUN} (community_id, workflow_id, id)"
    " ON DELETE CASCADE"
)
DROP_ONE_KEY = f"ALTER TABLE {RECORD} DROP CONSTRAINT delivery_run_workflow_same_community"
# Core migration 0002's keys (the table was then named buzz_delivery_delivery).
OLD_KEYS = {
    "delivery_workflow_same_community": "(community_id, workflow_id) REFERENCES buzz_delivery_workflow (community_id, id)",
    "delivery_run_same_community": f"(community_id, run_id) REFERENCES {RUN} (community_id, id)",
}


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0035_history_push_without_jsonpath")]

    operations = [
        migrations.AddConstraint(
            model_name="workflowrun",
            constraint=models.UniqueConstraint(
                fields=("community", "workflow", "id"), name="workflow_run_workflow_run_key"
            ),
        ),
        migrations.RunSQL(sql=ADD_ONE_KEY, reverse_sql=DROP_ONE_KEY),
        *(
            migrations.RunSQL(
                sql=f"ALTER TABLE {RECORD} DROP CONSTRAINT {name}",
                reverse_sql=f"ALTER TABLE {RECORD} ADD CONSTRAINT {name} FOREIGN KEY {key} ON DELETE CASCADE",
            )
            for name, key in OLD_KEYS.items()
        ),
        migrations.RemoveIndex(model_name="deliveryrecord", name="delivery_workflow_idx"),
        migrations.RemoveIndex(model_name="workflowrun", name="workflow_run_workflow_idx"),
    ]
