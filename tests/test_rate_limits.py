"""Rate limits by key (issue 32, ``services/ratelimits.py``, docs/flow-control.md): at most R units
per period per declared key in a community, held in PostgreSQL by one take statement on the
database clock; ``ctx.call(..., rate_key=..., weight=...)`` waits for its units (never fails the
run), a replayed call takes none, an undeclared key is refused before anything is journaled."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import Counter

import pytest
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db import DatabaseError, connections, transaction
from django.test import override_settings

from buzz_delivery import checks
from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import Context, run_claim
from buzz_delivery.agents.services import claim_agent_runs, reap_agent_runs
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
from buzz_delivery.models import RateLimit
from buzz_delivery.services import advance_community
from buzz_delivery.services import ratelimits as rl
from buzz_delivery.testing import frozen_db_clock
from tests.agents_support import AGENT, backdate_run_lease, make_claimable, new_run


def rate_limits(**keys: dict):
    return override_settings(BUZZ_DELIVERY={"RATE_LIMITS": keys})


def window_of(at: dt.datetime, period: float) -> dt.datetime:
    return dt.datetime.fromtimestamp((at.timestamp() // period) * period, tz=dt.UTC)


def used(community, key: str) -> int | None:
    row = RateLimit.objects.filter(community_id=community.id, key=key).first()
    return None if row is None else row.used


def claim_one(community, worker: str = "w"):
    (claim,) = claim_agent_runs(community.id, [AGENT], worker_id=worker, lease_seconds=30)
    return claim


def tool(args, key):
    return {"i": args["i"], "at": time.time()}


@pytest.mark.django_db
def test_the_take_grants_up_to_the_limit_then_says_wait_by_the_database_clock(community):
    period = 60
    # Far from the application's clock: only the database's can give these answers.
    start = dt.datetime(2031, 5, 6, 7, 8, 0, tzinfo=dt.UTC)
    assert window_of(start, period) == start
    with rate_limits(api={"limit": 3, "period": period}):
        with frozen_db_clock(start + dt.timedelta(seconds=59.5)):
            outcomes = [rl.take(community.id, "api") for _ in range(4)]
            assert [type(o) for o in outcomes] == [rl.Granted] * 3 + [rl.Wait]
            assert [o.used for o in outcomes] == [1, 2, 3, 3]
            assert outcomes[0].window_start == start and outcomes[0].at == start + dt.timedelta(seconds=59.5)
            assert outcomes[3].seconds == pytest.approx(0.5)  # until the window ends, by the database
            assert isinstance(rl.take(community.id, "api", 0), rl.Granted)  # 0 units: not over the limit
        with frozen_db_clock(start + dt.timedelta(seconds=60.25)):  # the next window
            again = rl.take(community.id, "api", 2)
            assert again == rl.Granted(used=2, window_start=start + dt.timedelta(seconds=60), at=again.at)
            assert rl.take(community.id, "api", 2) == rl.Wait(
                seconds=pytest.approx(59.75), used=2, window_start=start + dt.timedelta(seconds=60)
            )
        with frozen_db_clock(start + dt.timedelta(seconds=30)):  # a take whose clock is behind the row's
            late = rl.take(community.id, "api", 1)  # counts in the row's (newer) window, never resets it
            assert late == rl.Granted(used=3, window_start=start + dt.timedelta(seconds=60), at=late.at)
            # A late take the newer window refuses waits at most a period: that window began by
            # another statement's clock, so it ends within a period of now, whatever this clock read
            # (a statement that waited on the row's lock, or a shard's clock behind another's).
            assert rl.take(community.id, "api", 1) == rl.Wait(
                seconds=period, used=3, window_start=start + dt.timedelta(seconds=60)
            )
    assert used(community, "api") == 3


@pytest.mark.django_db
def test_weights_count_units_and_a_charge_puts_the_window_over_its_limit(community):
    with rate_limits(tokens={"limit": 100, "period": 60}):
        assert isinstance(rl.take(community.id, "tokens", 60), rl.Granted)
        wait = rl.take(community.id, "tokens", 41)
        assert isinstance(wait, rl.Wait) and wait.used == 60 and 0 < wait.seconds <= 60
        assert rl.take(community.id, "tokens", 40).used == 100
        assert rl.charge(community.id, "tokens", 50).used == 150  # spent already: added whatever the limit
        assert isinstance(rl.take(community.id, "tokens", 0), rl.Wait)  # over the limit: wait for the next window
        with pytest.raises(ValidationError) as bad:
            rl.take(community.id, "tokens", 101)  # more than the limit could never be granted
        assert "weight" in bad.value.message_dict
        for weight in (-1, 1.5, True, "1"):
            with pytest.raises(ValidationError) as bad:
                rl.take(community.id, "tokens", weight)
            assert "weight" in bad.value.message_dict
    assert used(community, "tokens") == 150


@pytest.mark.django_db
def test_an_undeclared_key_is_refused_by_name_before_any_sql(community, django_assert_num_queries):
    with (
        rate_limits(openai={"limit": 5, "period": 60}),
        django_assert_num_queries(0),
        pytest.raises(ValidationError) as refused,
    ):
        rl.take(community.id, "anthropic")
    assert "anthropic" in refused.value.message_dict["rate_key"][0]
    assert not RateLimit.objects.exists()


@pytest.mark.django_db
def test_a_community_that_is_not_active_takes_nothing(community):
    advance_community(community.id, "quiescing")
    with (
        rate_limits(api={"limit": 5, "period": 60}),
        pytest.raises(DatabaseError, match="community"),
        transaction.atomic(),
    ):
        rl.take(community.id, "api")
    assert not RateLimit.objects.exists()


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ([("openai", 5)], "BUZZ_DELIVERY['RATE_LIMITS'] must be a dict"),
        ({"open ai": {"limit": 5, "period": 60}}, "['RATE_LIMITS']['open ai']"),
        ({"openai": 500}, "['RATE_LIMITS']['openai'] must be a dict"),
        ({"openai": {"limit": 0, "period": 60}}, "['RATE_LIMITS']['openai']['limit']"),
        ({"openai": {"limit": "500", "period": 60}}, "['RATE_LIMITS']['openai']['limit']"),
        ({"openai": {"limit": True, "period": 60}}, "['RATE_LIMITS']['openai']['limit']"),
        ({"openai": {"period": 60}}, "['RATE_LIMITS']['openai']['limit']"),
        ({"openai": {"limit": 5, "period": 0}}, "['RATE_LIMITS']['openai']['period']"),
        ({"openai": {"limit": 5, "period": "60"}}, "['RATE_LIMITS']['openai']['period']"),
        ({"openai": {"limit": 5}}, "['RATE_LIMITS']['openai']['period']"),
        ({"openai": {"limit": 5, "period": 60, "burst": 9}}, "['RATE_LIMITS']['openai']['burst']"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(value, field):
    with override_settings(BUZZ_DELIVERY={"RATE_LIMITS": value}):
        errors = checks.check_settings()
        assert [e.id for e in errors] == ["buzz_delivery.E033"]
        assert field in errors[0].msg
        with pytest.raises(ImproperlyConfigured, match=field.replace("[", r"\[").replace("]", r"\]")):
            rl.take("00000000-0000-0000-0000-000000000001", "openai")


def test_good_settings_pass_the_checks():
    with rate_limits(openai={"limit": 500, "period": 60}, tokens={"limit": 90_000, "period": 0.5}):
        assert checks.check_settings() == []
        assert rl.declared_rate_limits()["tokens"] == rl.RateLimitSpec(key="tokens", limit=90_000, period=0.5)


@pytest.mark.django_db(transaction=True)
def test_four_threads_hammering_one_key_never_get_more_than_the_limit_in_a_window(community):
    limit, period, seconds, threads = 20, 2.0, 5.0, 4
    grants: list[rl.Granted] = []
    waits: list[rl.Wait] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def hammer():
        try:
            start.wait()
            ends = time.monotonic() + seconds
            while time.monotonic() < ends:
                outcome = rl.take(community.id, "hammer")  # this thread's own connection
                with lock:
                    (grants if isinstance(outcome, rl.Granted) else waits).append(outcome)
                if isinstance(outcome, rl.Wait):
                    time.sleep(min(outcome.seconds, 0.01))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    with rate_limits(hammer={"limit": limit, "period": period}):
        workers = [threading.Thread(target=hammer) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
    assert errors == []
    assert len(waits) > len(grants)  # they did hammer it
    per_window = Counter(g.window_start for g in grants)
    assert max(per_window.values()) <= limit, per_window  # never more than R in a window
    windows = sorted(per_window)
    assert len(windows) >= 2
    for window in windows[1:-1]:  # a window wholly inside the run was used to its limit
        assert per_window[window] == limit, per_window
    for g in grants:  # each grant in the window of its own database clock, or in the next (a late take)
        assert window_of(g.at, period) <= g.window_start <= window_of(g.at, period) + dt.timedelta(seconds=period)
    assert all(0 <= w.seconds <= period for w in waits)
    assert {w.window_start for w in waits} <= set(windows)  # a wait only in a window that granted
    assert RateLimit.objects.get(community_id=community.id, key="hammer").used <= limit


def five_rated_calls(ctx):
    outputs = [ctx.call("tool", tool, {"i": i}, rate_key="tool", weight=1) for i in range(5)]
    return {"n": len(outputs), "waits": ctx.rate_waits}


@pytest.mark.django_db(transaction=True)
def test_a_worker_run_handler_over_the_limit_waits_and_completes(community):
    run_id = new_run(community.id)
    with rate_limits(tool={"limit": 2, "period": 1}):
        worker = AgentWorker(
            WorkerConfig(
                handler=five_rated_calls,
                agents=[AGENT],
                communities=[community.id],
                exit_when_idle=True,
                listen=False,
                poll_seconds=0.1,
                lease_seconds=15,
                worker_id="rate",
            )
        )
        started = time.monotonic()
        counts = worker.run()
        took = time.monotonic() - started
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, counts["completed"]) == ("completed", 1), (run.state, run.failure_code, counts)
    assert run.output["n"] == 5
    entries = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    assert [e.status for e in entries] == ["succeeded"] * 5
    # 5 grants at most 2 a window need 3 windows: the first and the last call are more than a
    # period apart (less the time between a grant and its call).
    made = [e.output["at"] for e in entries]
    assert made[-1] - made[0] > 1 - 0.25, made
    assert took >= 0.75


async def two_rated_calls(ctx):
    outputs = [await ctx.call("tool", tool, {"i": i}, rate_key="tool") for i in range(2)]
    return {"n": len(outputs), "waits": ctx.rate_waits}


@pytest.mark.django_db(transaction=True)
def test_the_async_worker_awaits_its_units_and_completes_every_run(community):
    run_ids = [new_run(community.id) for _ in range(3)]
    with rate_limits(tool={"limit": 2, "period": 1}):
        config = AsyncWorkerConfig(
            handler=two_rated_calls,
            agents=[AGENT],
            communities=[community.id],
            exit_when_idle=True,
            poll_seconds=0.1,
            lease_seconds=15,
            worker_id="aio-rate",
            in_flight=10,
            connections=2,
        )
        started = time.monotonic()
        counts = AsyncAgentWorker(config).run()
        took = time.monotonic() - started
    assert counts["completed"] == 3, counts
    runs = AgentRun.objects.filter(id__in=run_ids)
    assert sorted(r.state for r in runs) == ["completed"] * 3
    entries = JournalEntry.objects.filter(run_id__in=run_ids)
    assert [e.status for e in entries] == ["succeeded"] * 6
    made = sorted(e.output["at"] for e in entries)  # 6 grants at most 2 a window: 3 windows
    assert made[-1] - made[0] > 1 - 0.25, made
    assert took >= 0.75


@pytest.mark.django_db
def test_a_replayed_call_takes_no_units(community):
    run_id = new_run(community.id)
    with rate_limits(tool={"limit": 2, "period": 30}):
        ctx = Context(claim_one(community, "w1"))
        ctx.call("tool", tool, {"i": 0}, rate_key="tool")
        ctx.call("tool", tool, {"i": 1}, rate_key="tool")
        assert used(community, "tool") == 2  # the window is full; the holder 'crashes' here
        backdate_run_lease(run_id)
        reap_agent_runs()
        make_claimable(run_id)

        def again(ctx):
            outputs = [ctx.call("tool", tool, {"i": i}, rate_key="tool") for i in range(2)]
            return {"replayed": ctx.replayed, "waits": ctx.rate_waits, "n": len(outputs)}

        started = time.monotonic()
        assert run_claim(claim_one(community, "w2"), again) == "completed"
        assert time.monotonic() - started < 10  # a take would have waited for the next window
    assert AgentRun.objects.get(id=run_id).output == {"replayed": 2, "waits": 0, "n": 2}
    assert used(community, "tool") == 2


@pytest.mark.django_db
def test_an_undeclared_key_or_a_bad_weight_is_refused_before_anything_is_journaled(community):
    new_run(community.id)
    with rate_limits(tool={"limit": 2, "period": 30}):
        ctx = Context(claim_one(community))
        with pytest.raises(ValidationError) as refused:
            ctx.call("tool", tool, {"i": 0}, rate_key="not-declared")
        assert "not-declared" in refused.value.message_dict["rate_key"][0]
        for weight in (3, -1, "1", None):
            with pytest.raises(ValidationError) as refused:
                ctx.call("tool", tool, {"i": 0}, rate_key="tool", weight=weight)
            assert list(refused.value.message_dict) == ["weight"]
    assert not JournalEntry.objects.exists()
    assert not RateLimit.objects.exists()


@pytest.mark.django_db
def test_a_weight_computed_from_the_output_is_charged_after_the_call(community):
    new_run(community.id)
    with rate_limits(tokens={"limit": 100, "period": 30}):
        ctx = Context(claim_one(community))
        out = ctx.call("llm", lambda args, key: {"tokens": 150}, {}, rate_key="tokens", weight=lambda o: o["tokens"])
        assert out == {"tokens": 150}
        assert used(community, "tokens") == 150  # over the limit: the next call waits for the next window
        assert isinstance(rl.take(community.id, "tokens", 0), rl.Wait)
        (entry,) = JournalEntry.objects.filter(community_id=community.id)
        assert entry.status == "succeeded"


@pytest.mark.django_db(transaction=True)
def test_current_use_lists_each_declared_key(community):
    with rate_limits(api={"limit": 5, "period": 60}):
        rl.take(community.id, "api", 3)
        (use,) = rl.current_use()
        assert (use.community_id, use.key, use.used, use.limit) == (community.id, "api", 3, 5)
    with rate_limits(other={"limit": 5, "period": 60}):
        assert rl.current_use() == []  # a key no longer declared is not shown


def scrape() -> dict[str, dict[str, float]]:
    """rate limit families of one GET /metrics: name -> {key -> value}."""
    from django.test import Client
    from prometheus_client.parser import text_string_to_metric_families

    response = Client().get("/metrics")
    assert response.status_code == 200
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            if sample.name.startswith("buzz_rate_limit"):
                found.setdefault(sample.name, {})[sample.labels["key"]] = sample.value
    return found


def collected() -> dict[str, dict[str, float]]:
    """The rate limit families of the /metrics collector: name -> {key -> value}."""
    from buzz_delivery.metrics import BuzzCollector

    return {
        family.name: {sample.labels["key"]: sample.value for sample in family.samples}
        for family in BuzzCollector._rate_limits()
    }


@pytest.mark.django_db
def test_metrics_export_the_current_use_of_each_declared_key(community):
    from buzz_delivery.testing import CommunityFactory

    other = CommunityFactory()
    start = dt.datetime(2031, 5, 6, 7, 8, 0, tzinfo=dt.UTC)
    with rate_limits(api={"limit": 3, "period": 60}, idle={"limit": 7, "period": 1}):
        with frozen_db_clock(start + dt.timedelta(seconds=10)):
            for _ in range(3):
                rl.take(community.id, "api")
            rl.take(other.id, "api")
            found = collected()
        assert found["buzz_rate_limit_used"] == {"api": 4, "idle": 0}
        assert found["buzz_rate_limit_used_max"] == {"api": 3, "idle": 0}
        assert found["buzz_rate_limit_communities_at_limit"] == {"api": 1, "idle": 0}
        assert found["buzz_rate_limit_limit"] == {"api": 3, "idle": 7}
        assert found["buzz_rate_limit_period_seconds"] == {"api": 60, "idle": 1}
        with frozen_db_clock(start + dt.timedelta(seconds=61)):  # the window ended: nothing used now
            assert collected()["buzz_rate_limit_used"] == {"api": 0, "idle": 0}
    assert collected()["buzz_rate_limit_used"] == {}  # no key declared: no samples


@pytest.mark.django_db
def test_the_metrics_endpoint_serves_the_rate_limit_families(community):
    with rate_limits(api={"limit": 3, "period": 60}):
        rl.take(community.id, "api", 2)
        found = scrape()
    assert found["buzz_rate_limit_used"] == {"api": 2}
    assert found["buzz_rate_limit_limit"] == {"api": 3}


@pytest.mark.django_db
def test_the_admin_lists_each_window_with_its_use_and_writes_nothing(community, admin_client):
    start = dt.datetime(2031, 5, 6, 7, 8, 0, tzinfo=dt.UTC)
    with rate_limits(api={"limit": 3, "period": 60}), frozen_db_clock(start + dt.timedelta(seconds=10)):
        rl.take(community.id, "api", 2)
        rl.charge(community.id, "api", 5)
        page = admin_client.get("/admin/buzz_delivery/ratelimit/")
        assert page.status_code == 200
        text = page.content.decode()
        assert "api" in text and "7 (over)" in text
        row = RateLimit.objects.get(community_id=community.id)
        assert admin_client.get(f"/admin/buzz_delivery/ratelimit/{row.pk}/change/").status_code == 200
        assert admin_client.post("/admin/buzz_delivery/ratelimit/add/", {"key": "x"}).status_code == 403
        assert admin_client.post(f"/admin/buzz_delivery/ratelimit/{row.pk}/delete/", {"post": "yes"}).status_code == 403
    with rate_limits(api={"limit": 3, "period": 60}), frozen_db_clock(start + dt.timedelta(seconds=70)):
        assert ">0<" in admin_client.get("/admin/buzz_delivery/ratelimit/").content.decode()  # window ended
    assert RateLimit.objects.get(community_id=community.id).used == 7
