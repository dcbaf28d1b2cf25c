"""The tombstone guard for the gateway's community-scoped table: a community may become
``tombstone`` only once its enrollments are gone (purge_community deletes them, the gateway
being in the deletion catalog through its AppConfig)."""

from django.db import migrations

TOMBSTONE_GUARD = """
CREATE FUNCTION buzz_gateway_refuse_tombstone() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM buzz_gateway_enrollment WHERE community_id = OLD.id) THEN
        RAISE EXCEPTION USING ERRCODE = 'BD002',
            MESSAGE = format('buzz_delivery: community %s still holds gateway enrollments; '
                             'purge it before it becomes tombstone', OLD.id);
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER buzz_gateway_tombstone_guard
BEFORE UPDATE OF deletion_state ON buzz_delivery_community
FOR EACH ROW WHEN (NEW.deletion_state = 'tombstone' AND OLD.deletion_state IS DISTINCT FROM 'tombstone')
EXECUTE FUNCTION buzz_gateway_refuse_tombstone();
"""
DROP_TOMBSTONE_GUARD = """
DROP TRIGGER buzz_gateway_tombstone_guard ON buzz_delivery_community;
DROP FUNCTION buzz_gateway_refuse_tombstone();
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_gateway", "0001_enrollment_and_replay_store")]

    operations = [migrations.RunSQL(sql=TOMBSTONE_GUARD, reverse_sql=DROP_TOMBSTONE_GUARD)]
