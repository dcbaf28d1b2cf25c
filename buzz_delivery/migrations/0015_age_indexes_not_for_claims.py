"""The two age indexes on created_at can no longer serve a claim, on any PostgreSQL (issue 16).

- ``delivery_created_idx`` (the admin's list by age) was a plain index on created_at. With
  statistics taken while most rows were pending, the planner walked it for the claim, past every
  settled row, and sorted: in a worker's drain of 20,000 a claim of 50 took 9 ms, 6 of them in
  that walk, against 2.4 ms on the polling index.
- ``delivery_pending_age_idx`` said ``created_at IS NOT NULL`` (migration 0013) for the same
  purpose; PostgreSQL 17 and later drop that condition from its readers' queries (the column is
  NOT NULL), so they could no longer use it.

Both now say ``created_at > '1970-01-01'`` (``models.CREATED_FLOOR``), which the claim's WHERE
does not imply and their readers state.

Built ``CONCURRENTLY`` (so outside a transaction): a plain DROP and CREATE INDEX would hold an
ACCESS EXCLUSIVE lock on the delivery table, stopping claims and settles, for the whole build of
an index over every row. Between the drop and the build of each, the admin's list by age and
the oldest-pending probe read the table instead.
"""

import datetime
from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ('buzz_delivery', '0014_write_fence_runs_one_shared_function'),
    ]

    operations = [
        RemoveIndexConcurrently(
            model_name='workflowagentdelivery',
            name='delivery_created_idx',
        ),
        RemoveIndexConcurrently(
            model_name='workflowagentdelivery',
            name='delivery_pending_age_idx',
        ),
        AddIndexConcurrently(
            model_name='workflowagentdelivery',
            index=models.Index(models.Func(models.Value('UTC'), models.F('created_at'), function='timezone', output_field=models.DateTimeField()), condition=models.Q(('created_at__gt', datetime.datetime(1970, 1, 1, 0, 0, tzinfo=datetime.timezone.utc)), ('status', 'pending')), name='delivery_pending_age_idx'),
        ),
        AddIndexConcurrently(
            model_name='workflowagentdelivery',
            index=models.Index(condition=models.Q(('created_at__gt', datetime.datetime(1970, 1, 1, 0, 0, tzinfo=datetime.timezone.utc))), fields=['created_at'], name='delivery_created_idx'),
        ),
    ]
