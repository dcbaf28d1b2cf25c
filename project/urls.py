from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    # The agent gateway (SPEC section 14): versioned; the next version mounts beside it.
    path("gateway/v1/", include("buzz_delivery.gateway.urls")),
]
