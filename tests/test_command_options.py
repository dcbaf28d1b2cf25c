"""Every management command refuses an abbreviated or misspelled option instead of guessing."""

from __future__ import annotations

import uuid

import pytest
from django.core.management import CommandError, call_command

from buzz_delivery.models import WorkflowAgentDelivery


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("command", "args"),
    [
        ("reap_deliveries", ["--force"]),  # would have matched Django's --force-color and reaped
        ("prune_deliveries", ["--older-than", "30d", "--dry"]),
        ("purge_community", [str(uuid.uuid4()), "--dry"]),
        (
            "run_delivery_worker",
            ["--community", str(uuid.uuid4()), "--target", "ab" * 32, "--handler", "json:dumps", "--conc", "2"],
        ),
        ("run_agent_worker", ["--agent", "ab" * 32, "--handler", "json:dumps", "--exit-when", "--no-listen"]),
    ],
)
def test_an_abbreviated_option_is_refused(command, args):
    with pytest.raises(CommandError, match="unrecognized arguments"):
        call_command(command, *args)
    assert not WorkflowAgentDelivery.objects.exists()
