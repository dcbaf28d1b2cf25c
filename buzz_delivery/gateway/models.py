"""Models of the agent gateway (SPEC sections 14 and 15).

- :class:`Enrollment` is community-scoped: PRIMARY KEY (community_id, id) in the database
  (migration 0001 makes it so; Django still declares ``id`` as the key), the core write fence
  trigger, every key leading with ``community_id``. It must be listed in the deletion catalog
  (:data:`buzz_delivery.gateway.CATALOG`).
- :class:`SeenEvent` is the NIP-98 replay store: not community-scoped (see its docstring).

Rows change only through :mod:`buzz_delivery.gateway.services` and
:mod:`buzz_delivery.gateway.replay`.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Length, Now
from django.db.models.lookups import Exact

from buzz_delivery import triggers
from buzz_delivery.models import CommunityScoped, new_uuid7


def _len32(field: str) -> Exact:
    return Exact(Length(field), 32)


class Enrollment(CommunityScoped):
    """An operator's permission for one agent key to act in one community through the gateway.

    ``agent_pubkey``: the agent's 32-byte public key (the deliveries' ``target_pubkey``).
    ``enrolled_by``: free text naming the operator (a user name or a command's caller); text, not
    a foreign key, so the record survives the user. ``revoked_at`` set = no longer enrolled; a
    revoked row is kept as history and a later enrollment adds a new row. At most one live
    (unrevoked) enrollment per (community, key), enforced by a partial unique index.
    """

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    agent_pubkey = models.BinaryField(max_length=32)
    enrolled_at = models.DateTimeField(db_default=Now(), editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True)
    enrolled_by = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        db_table = "buzz_gateway_enrollment"
        constraints = [
            models.UniqueConstraint(
                fields=["community", "agent_pubkey"],
                condition=Q(revoked_at__isnull=True),
                name="enrollment_one_live_per_key",
            ),
            models.CheckConstraint(condition=_len32("agent_pubkey"), name="enrollment_agent_pubkey_32_bytes"),
            models.CheckConstraint(
                condition=Q(revoked_at__isnull=True) | Q(revoked_at__gte=models.F("enrolled_at")),
                name="enrollment_revoked_after_enrolled",
            ),
        ]
        indexes = [
            # The gateway's hot lookup: the live communities of one key, across communities.
            models.Index(fields=["agent_pubkey"], condition=Q(revoked_at__isnull=True), name="enrollment_live_key_idx"),
            # Lookups by id alone (the admin); the primary key is (community_id, id).
            models.Index(fields=["id"], name="enrollment_id_idx"),
        ]
        triggers = [*triggers.write_fence()]

    def __str__(self) -> str:
        return f"{bytes(self.agent_pubkey).hex()[:12]} in {self.community_id}"

    @property
    def agent_hex(self) -> str:
        """``agent_pubkey`` as 64 lowercase hex characters."""
        return bytes(self.agent_pubkey).hex()


class SeenEvent(models.Model):
    """One NIP-98 event id the gateway accepted: each is usable once (SPEC section 14).

    Not community-scoped, on purpose: the signature is checked, and its id recorded, before the
    gateway knows which community a request concerns (a claim spans every community the key is
    enrolled in), and a replay must be refused whichever community it names. The key is the
    event id alone. ``created_at`` is the event's own timestamp: a row older than the auth window
    can never match an acceptable event again, so ``prune_gateway_replays`` deletes it.
    """

    event_id = models.BinaryField(max_length=32, primary_key=True)
    pubkey = models.BinaryField(max_length=32)
    created_at = models.DateTimeField()
    seen_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "buzz_gateway_seen_event"
        constraints = [
            models.CheckConstraint(condition=_len32("event_id"), name="seen_event_event_id_32_bytes"),
            models.CheckConstraint(condition=_len32("pubkey"), name="seen_event_pubkey_32_bytes"),
        ]
        indexes = [models.Index(fields=["created_at"], name="seen_event_created_idx")]

    def __str__(self) -> str:
        return bytes(self.event_id).hex()[:16]
