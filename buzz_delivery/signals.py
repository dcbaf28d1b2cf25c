"""Django signals of buzz_delivery.

``deliveries_committed``: sent after the transaction that committed new deliveries
commits, with ``community_id`` (UUID), ``delivery_ids`` (list of UUID) and
``target_pubkeys`` (list of 32-byte values, same order). Like the NOTIFY wake hint it
carries only identifiers and grants nothing (SPEC section 7).
"""

from django.dispatch import Signal

deliveries_committed = Signal()
