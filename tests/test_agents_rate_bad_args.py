"""Both agent runtimes: a rated call with bad input (args that are not JSON) is refused with a
``ValidationError`` naming the field before its units are taken: nothing written, nothing of the
provider's window spent (house rule: bad input, a clear error naming the field, nothing written).

Before, the call took its units (waiting for them, the window full) and only then was its entry
refused for its args: the units stayed spent for a call never made."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.test import override_settings

from buzz_delivery.agents.models import JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.models import RateLimit
from buzz_delivery.services import ratelimits
from tests.agents_support import AGENT, new_run
from tests.aio_worker_support import run_in_thread

pytestmark = pytest.mark.django_db(transaction=True)

PERIOD = 86_400 * 31  # one window for the whole test
LIMITS = {"RATE_LIMITS": {"slow": {"limit": 5, "period": PERIOD}}}
SEEN: dict = {}


def tool(args, key):
    SEEN["made"] = True
    return "made"


def refused(exc: ValidationError) -> None:
    SEEN["refused"] = sorted(exc.message_dict)


def thread_handler(ctx):
    try:
        ctx.call("rated", tool, {"bad": object()}, rate_key="slow", weight=3)
    except ValidationError as exc:
        refused(exc)
    return "done"


async def async_handler(ctx):
    try:
        await ctx.call("rated", tool, {"bad": object()}, rate_key="slow", weight=3)
    except ValidationError as exc:
        refused(exc)
    return "done"


def used(community) -> int:
    return RateLimit.objects.get(community_id=community.id, key="slow").used


@pytest.mark.parametrize("runtime", ["thread", "event_loop"])
def test_a_rated_call_with_bad_args_is_refused_before_its_units_are_taken(community, runtime):
    SEEN.clear()
    with override_settings(BUZZ_DELIVERY=LIMITS):
        run_id = new_run(community.id)
        ratelimits.charge(community.id, "slow", 1)  # the window in use before the run: 1 of 5
        if runtime == "thread":
            (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
            assert run_claim(claim, thread_handler) == "completed"
        else:
            counts = run_in_thread(community, async_handler)
            assert counts.get("completed") == 1, counts
        assert SEEN == {"refused": ["args"]}, SEEN
        assert not JournalEntry.objects.filter(run_id=run_id).exists()
        assert used(community) == 1, "the units of a call refused for its args stayed spent"
