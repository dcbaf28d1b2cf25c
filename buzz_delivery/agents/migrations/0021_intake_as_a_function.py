"""``intake_event`` in one round trip (issue 29): the intake key, the policy read, the run and the
wake hint in one plan-cached PL/pgSQL function, ``buzz_agents_intake``, called as one statement.

Before, an intake was one transaction of six round trips (BEGIN, the key's INSERT, the policy's
read, the run's INSERT, the NOTIFY, COMMIT), each statement parsed and planned anew; with no-op
agent runs that was the rate of the whole loop. The function does the same, in the same order and
with the same guarantees:

- the key first, ``ON CONFLICT DO NOTHING`` judged by the row it returns: only its winner reads
  the policy, creates the run and sends the wake hint (``pg_notify``, delivered on commit of the
  caller's transaction, or of the statement's own when the caller has none);
- a loser reads the key that won (a statement of its own, so a new snapshot under READ COMMITTED:
  it sees a concurrent winner that committed while the INSERT waited on it) and returns it with
  ``created`` false; the caller tells a duplicate from a conflict by its payload hash;
- the policy is the two rows ``policy_of`` reads (the agent's, then the community's), over the
  ``BUZZ_AGENTS`` settings the caller passes (``p_default_*``); each budget is the smaller of what
  the caller asked for and the policy's (``least`` ignores a NULL ask), shadow when either says
  so, the policy's lease cap: what ``policy.bounded`` computes;
- the wake hint is sent in the function only when the caller passes ``p_notify`` (an intake in
  autocommit); inside a caller's transaction the service sends it from the caller's session
  instead, since on Citus the delegated function runs on the community's worker, and a
  transaction that also wrote on another node commits in two phases, which PostgreSQL refuses
  (``cannot PREPARE a transaction that has executed ... NOTIFY``) for a NOTIFY sent on a node;
- ``p_default_max_timeout_seconds`` is ``bigint``: ``BUZZ_AGENTS['MAX_TIMEOUT_SECONDS']`` has no
  upper bound, and a setting past ``integer`` must not refuse every intake;
- the write fence (a community not ``active``) refuses the key's INSERT in its trigger, as before.

Every statement names its community in its WHERE or VALUES (Citus router form); on Citus the call
is delegated whole to the worker holding the community (``AgentsConfig.buzz_delegated_functions``,
docs/scale-out.md), which plans it per call there. ``plan_cache_mode = force_generic_plan``: on
PostgreSQL each backend plans its statements once.
"""

from django.db import migrations

SIGNATURE = (
    "buzz_agents_intake(p_community_id uuid, p_channel_type text, p_provider_event_id text, "
    "p_agent_pubkey bytea, p_input jsonb, p_payload_hash bytea, p_input_hash bytea, p_id uuid, p_key_id uuid, "
    "p_shadow boolean, p_max_tool_calls integer, p_max_cost bigint, p_max_attempts integer, "
    "p_timeout_seconds integer, p_default_shadow boolean, p_default_max_tool_calls integer, "
    "p_default_max_cost bigint, p_default_max_attempts integer, p_default_max_timeout_seconds bigint, "
    "p_default_max_lease_seconds double precision, p_notify boolean)"
)

INTAKE = f"""
CREATE FUNCTION {SIGNATURE}
RETURNS TABLE(out_run_id uuid, out_payload_hash bytea, out_created boolean) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    won uuid;
    a buzz_agents_policy%ROWTYPE;
    c buzz_agents_policy%ROWTYPE;
BEGIN
    INSERT INTO buzz_agents_intake_key AS k (id, community_id, channel_type, provider_event_id, payload_hash, run_id)
    VALUES (p_key_id, p_community_id, p_channel_type, p_provider_event_id, p_payload_hash, p_id)
    ON CONFLICT (community_id, channel_type, provider_event_id) DO NOTHING
    RETURNING k.run_id INTO won;
    IF won IS NULL THEN
        RETURN QUERY
        SELECT k.run_id, k.payload_hash, false FROM buzz_agents_intake_key AS k
        WHERE k.community_id = p_community_id AND k.channel_type = p_channel_type
          AND k.provider_event_id = p_provider_event_id;
        RETURN;
    END IF;
    SELECT * INTO a FROM buzz_agents_policy AS p
    WHERE p.community_id = p_community_id AND p.agent_pubkey = p_agent_pubkey;
    SELECT * INTO c FROM buzz_agents_policy AS p
    WHERE p.community_id = p_community_id AND p.agent_pubkey IS NULL;
    INSERT INTO buzz_agents_run (id, community_id, agent_pubkey, state, unwinding, shadow, input, input_hash,
                                 lease_generation, attempts, max_attempts, timeout_at, max_tool_calls,
                                 tool_calls_used, max_cost, cost_used, max_lease_seconds)
    VALUES (p_id, p_community_id, p_agent_pubkey, 'pending', false,
            p_shadow OR coalesce(a.shadow, c.shadow, p_default_shadow), p_input, p_input_hash, 0, 0,
            least(p_max_attempts, coalesce(a.max_attempts, c.max_attempts, p_default_max_attempts)),
            buzz_delivery_now() + make_interval(secs => least(
                p_timeout_seconds,
                coalesce(a.max_timeout_seconds, c.max_timeout_seconds, p_default_max_timeout_seconds))),
            least(p_max_tool_calls, coalesce(a.max_tool_calls, c.max_tool_calls, p_default_max_tool_calls)), 0,
            least(p_max_cost, coalesce(a.max_cost, c.max_cost, p_default_max_cost)), 0,
            coalesce(a.max_lease_seconds, c.max_lease_seconds, p_default_max_lease_seconds));
    IF p_notify THEN
        PERFORM pg_notify('buzz_agents', p_community_id::text);
    END IF;
    RETURN QUERY SELECT p_id, p_payload_hash, true;
END
$fn$;
"""

# The signature the delegation names (AgentsConfig.buzz_delegated_functions) and the reverse drops.
ARGUMENT_TYPES = (
    "uuid, text, text, bytea, jsonb, bytea, bytea, uuid, uuid, boolean, integer, bigint, integer, integer, "
    "boolean, integer, bigint, integer, bigint, double precision, boolean"
)
DROP_INTAKE = f"DROP FUNCTION buzz_agents_intake({ARGUMENT_TYPES});"


class Migration(migrations.Migration):
    dependencies = [("buzz_agents", "0020_emit_counts_in_the_insert_trigger")]

    operations = [migrations.RunSQL(sql=INTAKE, reverse_sql=DROP_INTAKE)]
