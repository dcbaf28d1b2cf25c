"""A run that ends other than ``succeeded`` cancels its open steps inside
``buzz_workflows_end_run`` (migration 0004); that UPDATE now appends each step's history entry
(``cancel``, status ``canceled``, the bumped generation, actor ``engine``, the reason
``run_<state>``) in its own SET list, as every lease statement does (issue 17, core 0008).
An operator's ``cancel_run`` goes through it, so the cancel shows on each open step."""

import importlib

from django.db import migrations

_0004 = importlib.import_module("buzz_delivery.workflows.migrations.0004_run_delivery_cleanup")

_CANCEL_SET = """UPDATE buzz_workflows_step SET state = 'canceled', lease_generation = lease_generation + 1,
            lease_until = NULL, claimed_at = NULL, wait_deadline = NULL, skip_reason = reason,
            finished_at = buzz_delivery_now()
"""
_CANCEL_SET_WITH_HISTORY = """UPDATE buzz_workflows_step SET state = 'canceled', lease_generation = lease_generation + 1,
            lease_until = NULL, claimed_at = NULL, wait_deadline = NULL, skip_reason = reason,
            finished_at = buzz_delivery_now(),
            history = buzz_delivery_history_push(history, jsonb_build_object(
                'event', 'cancel', 'status', 'canceled', 'generation', lease_generation + 1,
                'actor', 'engine', 'at', buzz_delivery_now(), 'renewals', renewals, 'reason', reason))
"""
assert _0004.END_RUN.count(_CANCEL_SET) == 1
END_RUN = _0004.END_RUN.replace(_CANCEL_SET, _CANCEL_SET_WITH_HISTORY)


class Migration(migrations.Migration):
    dependencies = [
        ("buzz_workflows", "0006_step_holder_and_history"),
    ]

    operations = [migrations.RunSQL(sql=END_RUN, reverse_sql=_0004.END_RUN)]
