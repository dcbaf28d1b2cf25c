"""Two entry points the services call once per statement, instead of calling the engine's
functions once per row of a query (issue 30):

- ``buzz_workflows_release_roots(cid, rid)``: releases the run's root steps in definition order
  (``buzz_workflows_release`` of each; the ones with a ``when`` are the only ones left pending);
- ``buzz_workflows_end_run_if_active(cid, rid, st, code, msg)``: ``buzz_workflows_end_run`` when
  the community is ``active``; NULL (and nothing done) when it is not.

``SELECT buzz_workflows_release(s.community_id, s.id) FROM buzz_workflows_step s WHERE ...`` and
``SELECT buzz_workflows_end_run(...) FROM buzz_delivery_community c WHERE ...`` were pushed by
Citus to the shard that holds the rows, where the function's own queries are refused ("cannot
execute a distributed query from a query on a shard"). Called as ``SELECT f(<community>, ...)``,
with the community first, a function is delegated whole to the worker that holds the community
(``manage.py distribute_tables``, docs/scale-out.md), where its queries run on the local shards;
on PostgreSQL it is one call, as before."""

from django.db import migrations

ENTRY_POINTS = """
CREATE FUNCTION buzz_workflows_release_roots(cid uuid, rid uuid) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    sid uuid;
    n integer := 0;
BEGIN
    FOR sid IN SELECT s.id FROM buzz_workflows_step s
               WHERE s.community_id = cid AND s.run_id = rid AND s.deps_total = 0
               ORDER BY s.position LOOP
        PERFORM buzz_workflows_release(cid, sid);
        n := n + 1;
    END LOOP;
    RETURN n;
END;
$$;

CREATE FUNCTION buzz_workflows_end_run_if_active(cid uuid, rid uuid, st text, code text, msg text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = cid AND c.deletion_state = 'active') THEN
        RETURN NULL;
    END IF;
    RETURN buzz_workflows_end_run(cid, rid, st, code, msg);
END;
$$;
"""
DROP_ENTRY_POINTS = """
DROP FUNCTION buzz_workflows_end_run_if_active(uuid, uuid, text, text, text);
DROP FUNCTION buzz_workflows_release_roots(uuid, uuid);
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_workflows", "0018_history_entries_immutable")]

    operations = [migrations.RunSQL(sql=ENTRY_POINTS, reverse_sql=DROP_ENTRY_POINTS)]
