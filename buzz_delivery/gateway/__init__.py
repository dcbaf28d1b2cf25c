"""The agent gateway (SPEC section 14): an HTTP JSON API through which a remote agent claims,
renews and settles its deliveries, authenticated by a NIP-98 event signed with its own key.

Install it next to ``buzz_delivery`` (``INSTALLED_APPS += ["buzz_delivery.gateway"]``) and mount
``buzz_delivery.gateway.urls`` under a versioned path (the example project: ``/gateway/v1/``).
See ``docs/gateway.md``.
"""

# This app's community-scoped models, children first, for the deletion catalog (SPEC section 5).
# The core's catalog (buzz_delivery.catalog) is a static tuple today: these must be registered
# there when it becomes extensible, or purge_community leaves enrollments behind.
CATALOG: tuple[str, ...] = ("buzz_gateway.Enrollment",)
