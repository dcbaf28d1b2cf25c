"""A delivery-settling process for the engine's concurrency tests:
``python -m tests.wf_settler COMMUNITY TARGETS_HEX_COMMA SEED``.

Loops over its targets until every delivery addressed to them is terminal: claims one
(1-second leases), then finishes it, fails it, or walks away from it (its lease lapses and the
reaper, running at the same time, reclaims or exhausts it). Prints the count of settles."""

from __future__ import annotations

import os
import random
import sys
import time

import django


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    django.setup()
    from buzz_delivery import services
    from buzz_delivery.models import WorkflowAgentDelivery

    community, targets_arg, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    targets = [bytes.fromhex(t) for t in targets_arg.split(",")]
    rng = random.Random(seed)
    settled = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        open_ = WorkflowAgentDelivery.objects.filter(
            community_id=community, target_pubkey__in=targets, status__in=["pending", "claimed"]
        ).exists()
        if not open_:
            break
        for target in rng.sample(targets, len(targets)):
            claim = services.claim_delivery(community, target, lease_seconds=1)
            if claim is None:
                continue
            roll = rng.random()
            if roll < 0.15:
                continue  # walk away: the lease lapses
            outcome = "failed" if roll < 0.3 else "finished"
            if isinstance(services.finish_delivery(claim.lease, outcome), services.Settled):
                settled += 1
        time.sleep(0.05)
    print(settled)


if __name__ == "__main__":
    main()
