"""``buzz_workflows_end_run`` appends each canceled step's history entry with IMMUTABLE operations
over the step's columns, as the services' statements do
(``buzz_delivery.services.sql.history_object``): Citus refuses the STABLE ``jsonb_build_object``
applied to a column in a SET list, so on a cluster every cancel and every failed run stopped
(issue 30). The same entries as before."""

import importlib

from django.db import migrations

_0007 = importlib.import_module("buzz_delivery.workflows.migrations.0007_canceled_steps_in_history")

_ENTRY = """history = buzz_delivery_history_push(history, jsonb_build_object(
                'event', 'cancel', 'status', 'canceled', 'generation', lease_generation + 1,
                'actor', 'engine', 'at', buzz_delivery_now(), 'renewals', renewals, 'reason', reason))"""
_IMMUTABLE_ENTRY = """history = buzz_delivery_history_push(history, jsonb_build_object('at', buzz_delivery_now())
                || jsonb_object(ARRAY['event', 'cancel', 'status', 'canceled', 'actor', 'engine', 'reason', reason])
                || ('{"generation": ' || (lease_generation + 1)::text || ', "renewals": ' || renewals::text || '}')::jsonb)"""
assert _0007.END_RUN.count(_ENTRY) == 1
END_RUN = _0007.END_RUN.replace(_ENTRY, _IMMUTABLE_ENTRY)


class Migration(migrations.Migration):
    dependencies = [("buzz_workflows", "0017_run_tags_and_search")]

    operations = [migrations.RunSQL(sql=END_RUN, reverse_sql=_0007.END_RUN)]
