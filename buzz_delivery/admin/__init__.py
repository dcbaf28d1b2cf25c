"""The buzz_delivery admin (SPEC section 8): deliveries, communities, workflows, runs, events.

Importing this package registers every ModelAdmin with ``django.contrib.admin.site``
(Django's admin autodiscovery imports it). Modules:

- :mod:`.deliveries`: the delivery list, detail page, operator actions and dashboard URL;
- :mod:`.tenants`: communities (lifecycle action), workflows, runs, events;
- :mod:`.workers`: the live workers registry (last heartbeat, stale flag);
- :mod:`.maintenance`: the maintenance jobs (passes, last outcome, totals);
- :mod:`.ratelimits`: each rate limit key's use of its current window, per community;
- :mod:`.base`: the read-only frame and the action report; :mod:`.paginators`: counts
  without a full-table ``COUNT(*)``; :mod:`.changelist`: snapshot-free lists and a cheap
  date drill-down; :mod:`.filters`, :mod:`.search`, :mod:`.display`, :mod:`.dashboard`.
"""

from django.contrib import admin

from buzz_delivery.admin.deliveries import DeliveryAdmin
from buzz_delivery.admin.maintenance import MaintenanceRunAdmin
from buzz_delivery.admin.ratelimits import RateLimitAdmin
from buzz_delivery.admin.tenants import CommunityAdmin, EventAdmin, WorkflowAdmin, WorkflowRunAdmin
from buzz_delivery.admin.workers import WorkerRegistrationAdmin

# The admin index links to the dashboard, unless the project set its own index template.
if admin.site.index_template is None:
    admin.site.index_template = "admin/buzz_delivery/index.html"

__all__ = [
    "CommunityAdmin",
    "DeliveryAdmin",
    "EventAdmin",
    "MaintenanceRunAdmin",
    "RateLimitAdmin",
    "WorkerRegistrationAdmin",
    "WorkflowAdmin",
    "WorkflowRunAdmin",
]
