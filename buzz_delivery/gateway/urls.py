"""URLs of the gateway. Mount under a versioned prefix, e.g. ``path("gateway/v1/", include(...))``.

Reserved for the agent-run endpoints (``buzz_delivery.agents``, later):
``communities/<community_id>/runs/...``.
"""

from django.urls import path

from buzz_delivery.gateway import views

app_name = "buzz_gateway"

urlpatterns = [
    path("openapi.json", views.openapi, name="openapi"),
    path("me", views.me, name="me"),
    path("deliveries/claim", views.claim, name="claim"),
    path("communities/<str:community_id>/deliveries/<str:delivery_id>", views.read, name="delivery"),
    path("communities/<str:community_id>/deliveries/<str:delivery_id>/renew", views.renew, name="renew"),
    path("communities/<str:community_id>/deliveries/<str:delivery_id>/finish", views.finish, name="finish"),
]
