"""``gateway_enrollment enroll|revoke|list``: operators enroll agent keys in communities
(SPEC section 14). Prints one JSON line; exits 2 on bad arguments."""

from __future__ import annotations

import json
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.gateway import services
from buzz_delivery.gateway.models import Enrollment
from buzz_delivery.services import tenancy


def pubkey_hex(text: str) -> bytes:
    value = bytes.fromhex(text)
    if len(value) != 32:
        raise ValueError(text)
    return value


class Command(BaseCommand):
    help = "Enroll an agent key in a community, revoke it, or list a community's enrollments."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["enroll", "revoke", "list"])
        parser.add_argument("--community", required=True, help="community UUID")
        parser.add_argument("--agent", type=pubkey_hex, help="agent public key, 64 hex characters (enroll, revoke)")
        parser.add_argument("--by", default="", help="operator name recorded with an enrollment")

    def handle(self, *args: Any, **options: Any) -> None:
        action, community, agent = options["action"], options["community"], options["agent"]
        try:
            if action == "list":
                with tenancy.fleet():  # an operator's read (SPEC 13)
                    rows = list(
                        Enrollment.objects.filter(community_id=community, revoked_at__isnull=True).order_by(
                            "enrolled_at"
                        )
                    )
                out: dict[str, Any] = {"community": community, "agents": [r.agent_hex for r in rows]}
            elif agent is None:
                raise CommandError(f"{action} needs --agent", returncode=2)
            elif action == "enroll":
                result = services.enroll(community, agent, enrolled_by=options["by"])
                out = {"enrolled": str(result.enrollment_id), "created": result.created}
            else:
                out = {"revoked": services.revoke(community, agent).revoked}
        except ValidationError as exc:
            raise CommandError("; ".join(exc.messages), returncode=2) from exc
        except CommunityNotWritable as exc:
            raise CommandError(str(exc), returncode=1) from exc
        self.stdout.write(json.dumps(out))
