"""The record's index swap of core 0039 (issue 31), built and dropped ``CONCURRENTLY``: the pruner's
``delivery_community_created_idx (community_id, created_at)`` first, then
``delivery_terminal_age_idx`` goes (the last index naming a column the terminal writes but the
failure code's). Inside 0039's transaction a plain ``DROP INDEX`` took ACCESS EXCLUSIVE on the
record and the plain build SHARE, both to the commit: every settle and every read of the record
waited for the build over every row (core 0015 and 0036 build the record's indexes this way for
that reason, bench/results/index-diet.md). Between the two the pruner may read either index.

Backwards: the terminal-age index built again, then the created index dropped, both
``CONCURRENTLY``."""

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("buzz_delivery", "0039_settle_tally_and_hot_record")]

    operations = [
        AddIndexConcurrently(
            model_name="deliveryrecord",
            index=models.Index(fields=["community", "created_at"], name="delivery_community_created_idx"),
        ),
        RemoveIndexConcurrently(
            model_name="deliveryrecord",
            name="delivery_terminal_age_idx",
        ),
    ]
