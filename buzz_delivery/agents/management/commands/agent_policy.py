"""``agent_policy set|show|clear``: the operator's policy for the agent runs of a community, or
of one agent key in it (issue 27): budgets, attempts, deadline, lease length and shadow mode,
which a caller (the gateway's accept, the services) may lower but never raise. Prints one JSON
line; exits 2 on bad arguments, 1 when the community is not active."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError, CommandParser

from buzz_delivery.agents.services.policy import clear_policy, get_policy, set_policy, settings_policy
from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.management.base import StrictOptionsCommand
from buzz_delivery.management.options import pubkey_hex


class Command(StrictOptionsCommand):
    help = (
        "Set, show or clear the agent-run policy of a community (or of one agent key in it with "
        "--agent). A field left out of `set` inherits: the agent's row, the community's row, BUZZ_AGENTS."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["set", "show", "clear"])
        parser.add_argument("--community", required=True, help="community UUID")
        parser.add_argument("--agent", type=pubkey_hex, help="agent public key, 64 hex characters")
        parser.add_argument("--max-tool-calls", type=int, help="journal entries per run (0..100000)")
        parser.add_argument("--max-cost", type=int, help="cost units per run (0..2**53-1)")
        parser.add_argument("--max-attempts", type=int, help="attempts per run (1..100)")
        parser.add_argument("--max-timeout-seconds", type=int, help="longest run deadline (1..2592000)")
        parser.add_argument("--max-lease-seconds", type=float, help="longest run lease (the core's lease bounds)")
        parser.add_argument("--shadow", choices=("on", "off"), help="on: every run is a shadow run; off: inherit")
        parser.add_argument("--by", default="", help="operator name recorded with the policy")

    def handle(self, *args: Any, **options: Any) -> None:
        community, agent = options["community"], options["agent"]
        try:
            if options["action"] == "set":
                row = set_policy(
                    community,
                    agent,
                    max_tool_calls=options["max_tool_calls"],
                    max_cost=options["max_cost"],
                    max_attempts=options["max_attempts"],
                    max_timeout_seconds=options["max_timeout_seconds"],
                    max_lease_seconds=options["max_lease_seconds"],
                    shadow=True if options["shadow"] == "on" else None,
                    updated_by=options["by"],
                )
                out: dict[str, Any] = {"policy": str(row)}
            elif options["action"] == "clear":
                out = {"cleared": clear_policy(community, agent)}
            else:
                out = {
                    "in_force": dataclasses.asdict(get_policy(community, agent)),
                    "settings": dataclasses.asdict(settings_policy()),
                }
        except ValidationError as exc:
            raise CommandError("; ".join(exc.messages), returncode=2) from exc
        except CommunityNotWritable as exc:
            raise CommandError(str(exc), returncode=1) from exc
        self.stdout.write(json.dumps(out))
