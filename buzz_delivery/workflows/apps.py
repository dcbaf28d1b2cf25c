from django.apps import AppConfig


class WorkflowsConfig(AppConfig):
    """The workflow engine app. Its tables join the deletion catalog before the core's
    (:func:`buzz_delivery.catalog.deletion_catalog`), children first."""

    name = "buzz_delivery.workflows"
    label = "buzz_workflows"
    verbose_name = "Buzz workflows"
    default_auto_field = "django.db.models.BigAutoField"
    buzz_deletion_catalog = (
        "buzz_workflows.SentEvent",
        "buzz_workflows.Schedule",
        "buzz_workflows.Approval",
        "buzz_workflows.Step",
        "buzz_workflows.Run",
        "buzz_workflows.DefinitionVersion",
    )
    # Functions the services call as ``SELECT f(<community>, ...)``, delegated on Citus to the
    # worker that holds the community named by the argument (buzz_delivery.scaleout).
    # (With the plan-cached statements of services/cached.py, named by their p_community_id.)
    _delegated = (
        ("buzz_workflows_release_roots(uuid, uuid)", "cid"),
        ("buzz_workflows_end_run_if_active(uuid, uuid, text, text, text)", "cid"),
    )

    @property
    def buzz_delegated_functions(self) -> tuple[tuple[str, str], ...]:
        from buzz_delivery.workflows.services import cached

        plan_cached = tuple(
            (f"{s.function}({', '.join(kind for _, kind in s.params)})", "p_community_id") for s in cached.ALL
        )
        return self._delegated + plan_cached

    def ready(self) -> None:
        from buzz_delivery.workflows import checks, functions  # noqa: F401  (registers the checks, noop and echo)
        from buzz_delivery.workflows.registry import autodiscover

        autodiscover()  # every installed app's workflows.py, and BUZZ_WORKFLOWS['MODULES']
