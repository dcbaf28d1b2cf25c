"""A child process of the intake race: waits for a start instant, calls ``intake_event`` once
and prints its outcome as JSON. Args: community_id channel event_id payload_json agent_hex start_at."""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django

django.setup()

from buzz_delivery.agents.services import intake_event  # noqa: E402

community, channel, event_id, payload, agent, start_at = sys.argv[1:7]
while time.time() < float(start_at):
    time.sleep(0.001)
outcome = intake_event(community, channel, event_id, json.loads(payload), bytes.fromhex(agent))
print(json.dumps({"outcome": type(outcome).__name__, "run_id": str(outcome.run_id)}))
