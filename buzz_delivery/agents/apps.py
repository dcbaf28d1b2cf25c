from django.apps import AppConfig


class AgentsConfig(AppConfig):
    """The agent-run app. Its tables join the deletion catalog before the engine's and the
    core's (:func:`buzz_delivery.catalog.deletion_catalog`), children first."""

    name = "buzz_delivery.agents"
    label = "buzz_agents"
    verbose_name = "Buzz agent runs"
    default_auto_field = "django.db.models.BigAutoField"
    buzz_deletion_catalog = (
        "buzz_agents.RunOutput",
        "buzz_agents.JournalEntry",
        "buzz_agents.IntakeKey",
        "buzz_agents.StepWait",
        "buzz_agents.AgentRun",
        "buzz_agents.AgentPolicy",
    )
    # Functions the services call as one statement naming the community first, delegated on Citus
    # to the worker that holds it (buzz_delivery.scaleout): intake_event's (migration 0021).
    buzz_delegated_functions = (
        (
            "buzz_agents_intake(uuid, text, text, bytea, jsonb, bytea, bytea, uuid, uuid, boolean, integer, bigint, "
            "integer, integer, boolean, integer, bigint, integer, bigint, double precision, boolean)",
            "p_community_id",
        ),
    )

    def ready(self) -> None:
        from buzz_delivery.agents import checks  # noqa: F401  (registers the system checks)
