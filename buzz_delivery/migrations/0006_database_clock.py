"""The database clock of the lease statements as one SQL function, ``buzz_delivery_now()``.

It returns ``statement_timestamp()``: the start of the current statement, so a lease call made
inside a caller's long transaction judges and grants leases by the time it runs (``now()`` is
the transaction's start). A one-expression STABLE SQL function is inlined by the planner, so it
costs what ``statement_timestamp()`` costs. Tests may replace it inside their own transaction
(``buzz_delivery.testing.frozen_db_clock``) to make time stand still.
"""

from django.db import migrations

CREATE_CLOCK = """
CREATE OR REPLACE FUNCTION buzz_delivery_now() RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS 'SELECT statement_timestamp()';
"""
DROP_CLOCK = "DROP FUNCTION IF EXISTS buzz_delivery_now();"


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_delivery', '0005_delivery_history_guards'),
    ]

    operations = [
        migrations.RunSQL(sql=CREATE_CLOCK, reverse_sql=DROP_CLOCK),
    ]
