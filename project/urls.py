from django.contrib import admin
from django.urls import include, path

from buzz_delivery.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    # Prometheus scrapes this (buzz_delivery.metrics); keep it off the public internet.
    path("metrics", metrics_view, name="metrics"),
    # The agent gateway (SPEC section 14): versioned; the next version mounts beside it.
    path("gateway/v1/", include("buzz_delivery.gateway.urls")),
]
