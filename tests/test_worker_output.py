"""What ``run_delivery_worker`` says (issue 17): a start line and its INFO lines even in a
project without ``LOGGING``, one line (no traceback) for an ordinary retry unless at DEBUG, and
a summary that counts the deliveries an ``--idle-exit`` left waiting out a retry backoff."""

from __future__ import annotations

import pytest

from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import DeliveryFactory, random32

pytestmark = pytest.mark.django_db(transaction=True)

NO_LOGGING = {"DJANGO_SETTINGS_MODULE": "tests.settings_without_logging", "BUZZ_RETRY_BACKOFF_BASE_SECONDS": "60"}


def test_a_worker_without_a_logging_config_says_it_started_and_retries_in_one_line(make_binding, start_worker):
    target = random32()
    retried = DeliveryFactory(binding=make_binding(target_pubkey=target), trigger_context={"raise": "ordinary"}).id
    worker = start_worker(target, "--idle-exit", "1", "--lease-seconds", "2", **NO_LOGGING)

    assert worker.wait() == 0

    log = worker.log()
    assert "started community=" in log and f"target={target.hex()}" in log
    assert "claimed n=1" in log  # INFO lines reach stderr without a LOGGING config
    assert log.count("handler_error delivery=") == 1
    assert "Traceback" not in log
    assert WorkflowAgentDelivery.objects.get(id=retried).status == "pending"


def test_at_debug_an_ordinary_retry_logs_its_traceback(make_binding, start_worker):
    target = random32()
    DeliveryFactory(binding=make_binding(target_pubkey=target), trigger_context={"raise": "ordinary"})
    worker = start_worker(target, "--idle-exit", "1", "--lease-seconds", "2", "-v", "2", **NO_LOGGING)

    assert worker.wait() == 0

    assert "Traceback" in worker.log()


def test_idle_exit_says_how_many_deliveries_wait_out_a_retry_backoff(make_binding, start_worker):
    target = random32()
    for _ in range(2):
        DeliveryFactory(binding=make_binding(target_pubkey=target), trigger_context={"raise": "ordinary"})
    DeliveryFactory(binding=make_binding(target_pubkey=target))
    worker = start_worker(target, "--idle-exit", "1", "--lease-seconds", "2", BUZZ_RETRY_BACKOFF_BASE_SECONDS="60")

    assert worker.wait() == 0

    summary = worker.summary()
    assert (summary["reason"], summary["retried"], summary["finished"]) == ("idle_exit", 2, 1)
    assert summary["pending_retry"] == 2
    assert "2 deliveries are pending a retry" in worker.log()
