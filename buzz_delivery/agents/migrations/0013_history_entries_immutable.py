"""The two trigger functions that move agent runs (approval resume, workflow cancel) append their
history entry with IMMUTABLE operations over the run's columns, as the services' statements do
(``buzz_delivery.services.sql.history_object``): Citus refuses the STABLE ``jsonb_build_object``
applied to a column in a SET list, so on a cluster every approval decision and every workflow
cancel failed (issue 30). The same entries as before."""

import importlib

from django.db import migrations

_0004 = importlib.import_module("buzz_delivery.agents.migrations.0004_approval_and_cancel_in_history")
_0006 = importlib.import_module("buzz_delivery.agents.migrations.0006_workflow_cancel_expires_approvals")


def _entry(event: str, status: str, generation: str, actor: str) -> tuple[str, str]:
    """(0004's entry, the same entry built immutably)."""
    old = (
        f"history = buzz_delivery_history_push(r.history, jsonb_build_object("
        f"'event', '{event}', 'status', '{status}', 'generation', {generation}, 'actor', {actor}, "
        f"'at', buzz_delivery_now(), 'renewals', r.renewals))"
    )
    new = (
        f"history = buzz_delivery_history_push(r.history, jsonb_build_object('at', buzz_delivery_now())"
        f" || jsonb_object(ARRAY['event', '{event}', 'status', '{status}', 'actor', ({actor})::text])"
        f" || ('{{\"generation\": ' || ({generation})::text || ', \"renewals\": ' || (r.renewals)::text || '}}')::jsonb)"
    )
    return old, new


def _rewrite(source: str, *entries: tuple[str, str]) -> str:
    for old, new in entries:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return source


RESUME = _rewrite(
    _0004.RESUME,
    _entry("approval", "pending", "r.lease_generation", "coalesce(NEW.decided_by, 'expired')"),
    _entry("approval", "pending", "r.lease_generation", "NEW.decided_by"),
)
# The cancel trigger as 0006 left it (it also expires the approvals the cancelled runs waited for).
CANCELED = _rewrite(_0006.CANCELED, _entry("cancel", "cancelled", "r.lease_generation + 1", "'engine'"))


class Migration(migrations.Migration):
    dependencies = [("buzz_agents", "0012_approval_keys_no_set_null")]

    operations = [
        migrations.RunSQL(sql=RESUME, reverse_sql=_0004.RESUME),
        migrations.RunSQL(sql=CANCELED, reverse_sql=_0006.CANCELED),
    ]
