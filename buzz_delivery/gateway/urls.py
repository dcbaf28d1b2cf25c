"""URLs of the gateway. Mount under a versioned prefix, e.g. ``path("gateway/v1/", include(...))``.

The agent-run routes (``runs/claim``, ``communities/<c>/runs/<r>/...`` and a delivery's
``accept``) are served when ``buzz_delivery.agents`` is installed too; the workflow events
route (``communities/<c>/events``) when ``buzz_delivery.workflows`` is.
"""

from django.apps import apps
from django.urls import path

from buzz_delivery.gateway import views

app_name = "buzz_gateway"

D = "communities/<str:community_id>/deliveries/<str:delivery_id>"
R = "communities/<str:community_id>/runs/<str:run_id>"

urlpatterns = [
    path("openapi.json", views.openapi, name="openapi"),
    path("me", views.me, name="me"),
    path("deliveries/claim", views.claim, name="claim"),
    # Before the read route: "finish" and "renew" are not delivery ids.
    path("communities/<str:community_id>/deliveries/finish", views.finish_batch, name="finish-batch"),
    path("communities/<str:community_id>/deliveries/renew", views.renew_batch, name="renew-batch"),
    path(D, views.read, name="delivery"),
    path(f"{D}/renew", views.renew, name="renew"),
    path(f"{D}/finish", views.finish, name="finish"),
]


def workflows_installed() -> bool:
    """True when the workflow events endpoint is served (``buzz_delivery.workflows`` installed)."""
    return apps.is_installed("buzz_delivery.workflows")


if workflows_installed():
    from buzz_delivery.gateway import events

    urlpatterns += [path("communities/<str:community_id>/events", events.send, name="send-event")]


def agents_installed() -> bool:
    """True when the agent-run endpoints are served (``buzz_delivery.agents`` installed)."""
    return apps.is_installed("buzz_delivery.agents")


if agents_installed():
    from buzz_delivery.gateway import runs

    urlpatterns += [
        path(f"{D}/accept", runs.accept, name="accept"),
        path("runs/claim", runs.claim, name="run-claim"),
        # Before the read route: "complete" is not a run id.
        path("communities/<str:community_id>/runs/complete", runs.complete_batch, name="run-complete-batch"),
        path("communities/<str:community_id>/runs/calls", runs.call_batch, name="run-call-batch"),
        path("communities/<str:community_id>/runs/results", runs.result_batch, name="run-result-batch"),
        path("communities/<str:community_id>/runs/steps", runs.steps_batch, name="run-steps-batch"),
        path("communities/<str:community_id>/runs/heartbeat", runs.heartbeat_batch, name="run-heartbeat-batch"),
        path("communities/<str:community_id>/runs/fail", runs.fail_batch, name="run-fail-batch"),
        path(
            "communities/<str:community_id>/runs/compensations/begin",
            runs.compensation_begin_batch,
            name="run-compensation-begin-batch",
        ),
        path(
            "communities/<str:community_id>/runs/compensations/finish",
            runs.compensation_finish_batch,
            name="run-compensation-finish-batch",
        ),
        path(R, runs.read, name="run"),
        path(f"{R}/heartbeat", runs.heartbeat, name="run-heartbeat"),
        path(f"{R}/calls", runs.call, name="run-call"),
        path(f"{R}/results", runs.result, name="run-result"),
        path(f"{R}/approval", runs.approval, name="run-approval"),
        path(f"{R}/complete", runs.complete, name="run-complete"),
        path(f"{R}/emit", runs.emit, name="run-emit"),
        path(f"{R}/output", runs.output, name="run-output"),
        path(f"{R}/fail", runs.fail, name="run-fail"),
        path(f"{R}/compensations/begin", runs.compensation_begin, name="run-compensation-begin"),
        path(f"{R}/compensations/finish", runs.compensation_finish, name="run-compensation-finish"),
    ]
