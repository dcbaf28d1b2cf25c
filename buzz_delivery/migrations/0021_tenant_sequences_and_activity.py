"""What the tenant role may see beyond its community's rows (issue 27):

- sequences: it had ``USAGE, SELECT`` on every sequence of the schema, the host project's
  (``auth_user_id_seq``, ``django_admin_log_id_seq``) included, and could read the fleet-wide
  event sequence. Now only ``USAGE`` (``nextval``) on the sequences of the apps' own tables; the
  maintenance role ``USAGE, SELECT`` on those (``isolation.sequence_sql``);
- other sessions' statements: every role could read ``pg_stat_activity.query`` of the sessions
  of its own login, literals included, and the documented tenant login is one login for every
  community. ``EXECUTE`` on the functions behind it is revoked from ``PUBLIC`` (kept by
  superusers and ``pg_read_all_stats``, i.e. ``pg_monitor``), when the migrating user is a
  superuser; otherwise it warns and ``manage.py tenant_isolation sql`` prints the statements.
"""

from django.db import migrations

from buzz_delivery import isolation


def forward(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        names = isolation.roles()
        if not isolation.ensure_roles(cursor, names):
            for statement in isolation.sequence_sql(names):
                cursor.execute(statement)
        isolation.hide_activity(cursor)


def backward(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        names = isolation.roles()
        cursor.execute("SELECT array_agg(rolname) FROM pg_roles WHERE rolname = ANY(%s)", [[names.tenant, names.maintenance]])
        present = cursor.fetchone()[0] or []
        if present:
            roles = ", ".join(isolation._ident(name) for name in present)
            cursor.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {roles}")
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        if cursor.fetchone()[0]:
            for view in isolation.ACTIVITY_VIEWS:
                cursor.execute(f"GRANT SELECT ON {view} TO PUBLIC")
            for function in isolation.ACTIVITY_FUNCTIONS:
                cursor.execute(f"GRANT EXECUTE ON FUNCTION {function} TO PUBLIC")


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0020_write_fence_meets_moves_on_the_community_row")]

    operations = [migrations.RunPython(forward, backward, elidable=False)]
