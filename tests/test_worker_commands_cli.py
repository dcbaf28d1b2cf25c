"""What a new user meets at the worker commands' edges: a bad ``--handler`` exits 2 (bad
arguments) from every worker that takes one, an option out of bounds is an argparse error naming
it, a choice names its allowed values, the summary keys a help text or a page lists are the keys
the command prints, and a worker started on a community that does not exist says so (a WARNING)
and starts all the same."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from buzz_delivery.management.commands import run_delivery_worker
from buzz_delivery.testing import random32
from buzz_delivery.workflows.management.commands import run_workflow_worker
from project.database_url import database_url
from tests.agents_support import AGENT

ROOT = Path(__file__).resolve().parent.parent
NOWHERE = "tests.test_worker_commands_cli:no_such_handler"


def _manage(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict)}
    return subprocess.run(
        [sys.executable, "manage.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


# run_agent_worker that stops when idle (were its arguments taken, it would not hang the test).
IDLE_AGENT_WORKER = ["run_agent_worker", "--agent", AGENT.hex(), "--handler", "json:dumps", "--exit-when-idle"]


# --- a bad --handler: exit 2 (bad arguments), the message names --handler ------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("run_delivery_worker", ["--community", str(uuid.uuid4()), "--target", "ab" * 32, "--handler", NOWHERE]),
        ("run_delivery_worker", ["--community", str(uuid.uuid4()), "--target", "ab" * 32, "--handler", "json"]),
        ("run_agent_worker", ["--agent", AGENT.hex(), "--handler", NOWHERE]),
        ("run_agent_worker", ["--agent", AGENT.hex(), "--handler", "no.such.module:handle"]),
    ],
)
def test_an_unimportable_handler_is_a_bad_argument_naming_the_option(command, argv):
    with pytest.raises(CommandError, match=r"^--handler: ") as refused:
        call_command(command, *argv, stdout=io.StringIO(), stderr=io.StringIO())
    assert refused.value.returncode == 2


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["run_delivery_worker", "--community", str(uuid.uuid4()), "--target", "ab" * 32, "--handler", NOWHERE],
            "--handler: cannot import",
        ),
        (["run_agent_worker", "--agent", AGENT.hex(), "--handler", NOWHERE], "--handler: cannot import"),
        (
            ["run_agent_worker", "--agent", AGENT.hex(), "--handler", "json:dumps", "--lease-seconds", "5"],
            "argument --lease-seconds: must be within ",
        ),
        (  # was capped to 1000 without a word
            ["run_agent_worker", "--agent", AGENT.hex(), "--handler", "json:dumps", "--accept-batch", "1001"],
            "argument --accept-batch: must be at most 1000, got 1001",
        ),
        (
            ["run_agent_worker", "--agent", AGENT.hex(), "--handler", "json:dumps", "--accept-batch", "0"],
            "argument --accept-batch: must be >= 1, got 0",
        ),
        (  # was unbounded: the other workers' threads are 1..256
            [*IDLE_AGENT_WORKER, "--concurrency", "257"],
            "argument --concurrency: must be at most 256, got 257",
        ),
        (  # the event-loop worker's runs in flight: 1..10000, as the delivery worker's async tasks
            [*IDLE_AGENT_WORKER, "--async", "--in-flight", "10001"],
            "argument --in-flight: must be at most 10000, got 10001",
        ),
        (
            [*IDLE_AGENT_WORKER, "--async", "--connections", "257"],
            "argument --connections: must be at most 256, got 257",
        ),
        (  # finite, but longer than a thread can wait: the thread worker died at its first idle poll
            [*IDLE_AGENT_WORKER, "--poll-seconds", "1e10"],
            "argument --poll-seconds/--poll-interval: must be at most 86400 seconds, got 1e10",
        ),
        (  # the other workers' name for it, the same option
            [*IDLE_AGENT_WORKER, "--poll-interval", "1e10"],
            "argument --poll-seconds/--poll-interval: must be at most 86400 seconds, got 1e10",
        ),
        (  # was unbounded: 1e10 overflowed a thread's wait (OverflowError), as --poll-seconds did
            [
                "run_delivery_worker",
                "--community",
                str(uuid.uuid4()),
                "--target",
                "ab" * 32,
                "--handler",
                "json:dumps",
                "--idle-exit",
                "0.2",
                "--poll-interval",
                "1e10",
            ],
            "argument --poll-interval: must be at most 86400 seconds, got 1e10",
        ),
        (
            ["run_workflow_worker", "--community", str(uuid.uuid4()), "--idle-exit", "0.2", "--poll-interval", "1e10"],
            "argument --poll-interval: must be at most 86400 seconds, got 1e10",
        ),
        (
            ["run_task_worker", "--poll-interval", "86400.5"],
            "argument --poll-interval: must be at most 86400 seconds, got 86400.5",
        ),
        (  # was refused only when the config was built (exit 1, a ValidationError)
            [*IDLE_AGENT_WORKER, "--worker-id", "   "],
            "argument --worker-id: must name it (1..200 characters), got '   '",
        ),
        (  # was taken as no --worker-id at all (host:pid)
            [*IDLE_AGENT_WORKER, "--worker-id", ""],
            "argument --worker-id: must name it (1..200 characters), got ''",
        ),
        (
            [*IDLE_AGENT_WORKER, "--worker-id", "w" * 201],
            "argument --worker-id: must be at most 200 characters, got 201",
        ),
        (  # was read as --exit-when-idle
            ["run_agent_worker", "--agent", AGENT.hex(), "--handler", "json:dumps", "--exit-when"],
            "unrecognized arguments: --exit-when",
        ),
        (
            ["agent_policy", "set", "--community", str(uuid.uuid4()), "--shadow", "maybe"],
            "argument --shadow: invalid choice: 'maybe' (choose from on, off)",
        ),
    ],
)
def test_the_process_exits_2_with_a_message_naming_the_option(argv, says):
    done = _manage(*argv)
    assert done.returncode == 2, done.stderr[-2000:]
    assert says in done.stderr.replace("'on', 'off'", "on, off"), done.stderr[-2000:]
    assert "{'" not in done.stderr and "_flag" not in done.stderr  # no ValidationError dict, no function name


@pytest.mark.django_db
@pytest.mark.parametrize("lease", ["5", "1000000"])
def test_the_agent_workers_lease_seconds_is_an_argparse_error(lease):
    with pytest.raises(CommandError, match="argument --lease-seconds: must be ") as refused:
        call_command("run_agent_worker", "--agent", AGENT.hex(), "--handler", "json:dumps", "--lease-seconds", lease)
    assert "lease_seconds:" not in str(refused.value)


@pytest.mark.django_db
def test_a_bad_agents_lease_default_names_the_setting(settings):
    settings.BUZZ_AGENTS = {"LEASE_SECONDS": 5}
    with pytest.raises(CommandError, match=r"^BUZZ_AGENTS\['LEASE_SECONDS'\] must be within") as refused:
        call_command("run_agent_worker", "--agent", AGENT.hex(), "--handler", "json:dumps")
    assert refused.value.returncode == 2


@pytest.mark.django_db
def test_shadow_names_its_allowed_values_and_off_inherits(community):
    with pytest.raises(CommandError, match=r"argument --shadow: invalid choice: 'maybe' \(choose from .*on.*off"):
        call_command("agent_policy", "set", "--community", str(community.id), "--shadow", "maybe")
    out = io.StringIO()
    call_command("agent_policy", "set", "--community", str(community.id), "--shadow", "off", stdout=out)
    call_command("agent_policy", "show", "--community", str(community.id), stdout=out)
    assert json.loads(out.getvalue().splitlines()[-1])["in_force"]["shadow"] is False
    call_command("agent_policy", "set", "--community", str(community.id), "--shadow", "on", stdout=out)
    call_command("agent_policy", "show", "--community", str(community.id), stdout=out)
    assert json.loads(out.getvalue().splitlines()[-1])["in_force"]["shadow"] is True


@pytest.mark.django_db
def test_a_bad_agent_key_says_what_a_key_is():
    with pytest.raises(CommandError, match="argument --agent: must be 64 hex characters"):
        call_command("agent_policy", "show", "--community", str(uuid.uuid4()), "--agent", "abc")


# --- the summary keys a help text or a page lists are the keys printed ---------------------------


def _help(command, name: str) -> str:
    return " ".join(command.create_parser("manage.py", name).format_help().split())


def _listed_keys(text: str) -> list[str]:
    return re.findall(r"[a-z_]+", text)


@pytest.mark.django_db(transaction=True)
def test_the_delivery_workers_help_and_page_list_the_keys_it_prints(community):
    out = io.StringIO()
    call_command(
        "run_delivery_worker", "--community", str(community.id), "--target", random32().hex(),
        "--handler", "json:dumps", "--idle-exit", "0.2", "--poll-interval", "0.1", stdout=out, stderr=io.StringIO(),
    )  # fmt: skip
    printed = list(json.loads(out.getvalue().splitlines()[-1]))
    help_text = _help(run_delivery_worker.Command(), "run_delivery_worker")
    in_help = re.search(r"Prints one JSON summary line: \{([^}]*)\}", help_text)
    assert in_help and _listed_keys(in_help.group(1)) == printed
    page = " ".join((ROOT / "docs" / "inbox.md").read_text().split())
    in_page = re.search(r"Prints one JSON line `\{([^}]*)\}`", page)
    assert in_page and _listed_keys(in_page.group(1)) == printed


@pytest.mark.django_db(transaction=True)
def test_the_workflow_workers_help_and_page_list_the_keys_it_prints(community):
    out = io.StringIO()
    call_command(
        "run_workflow_worker", "--community", str(community.id), "--idle-exit", "0.2", "--poll-interval", "0.1",
        stdout=out, stderr=io.StringIO(),
    )  # fmt: skip
    printed = list(json.loads(out.getvalue().splitlines()[-1]))
    help_text = _help(run_workflow_worker.Command(), "run_workflow_worker")
    in_help = re.search(r"Prints one JSON summary line at exit: \{([^}]*)\}", help_text)
    assert in_help and _listed_keys(in_help.group(1)) == printed
    page = " ".join((ROOT / "docs" / "workflows.md").read_text().split())
    in_page = re.search(r"Prints one JSON summary line \(`([^`]*)`", page)
    assert in_page and _listed_keys(in_page.group(1)) == printed


def test_the_agent_workers_bounds_take_their_highest_values():
    from buzz_delivery.agents.management.commands import run_agent_worker

    parser = run_agent_worker.Command().create_parser("manage.py", "run_agent_worker")
    argv = ["--handler", "json:dumps", "--agent", AGENT.hex(), "--concurrency", "256", "--in-flight", "10000"]
    parsed = parser.parse_args([*argv, "--connections", "256", "--accept-batch", "1000"])
    assert (parsed.concurrency, parsed.in_flight, parsed.connections, parsed.accept_batch) == (256, 10000, 256, 1000)


def test_the_agent_workers_documented_default_concurrency_is_its_default():
    from buzz_delivery.agents.management.commands import run_agent_worker

    parser = run_agent_worker.Command().create_parser("manage.py", "run_agent_worker")
    default = parser.parse_args(["--handler", "json:dumps", "--agent", AGENT.hex()]).concurrency
    page = (ROOT / "docs" / "agents.md").read_text()
    assert f"[--concurrency {default}]" in page


# --- the agent worker's spellings: --poll-interval as the others, --exit-when-idle not --idle-exit ---


def test_the_agent_worker_takes_poll_interval_as_poll_seconds():
    from buzz_delivery.agents.management.commands import run_agent_worker

    parser = run_agent_worker.Command().create_parser("manage.py", "run_agent_worker")
    argv = ["--handler", "json:dumps", "--agent", AGENT.hex()]
    assert parser.parse_args([*argv, "--poll-interval", "0.25"]).poll_seconds == 0.25
    assert parser.parse_args([*argv, "--poll-seconds", "0.5"]).poll_seconds == 0.5  # the old spelling
    assert parser.parse_args(argv).poll_seconds == 1.0


@pytest.mark.django_db(transaction=True)
def test_the_agent_worker_runs_with_poll_interval(community):
    out = io.StringIO()
    call_command(
        "run_agent_worker", "--community", str(community.id), "--agent", AGENT.hex(), "--handler", "json:dumps",
        "--exit-when-idle", "--poll-interval", "0.1", "--no-listen", stdout=out, stderr=io.StringIO(),
    )  # fmt: skip
    assert json.loads(out.getvalue().splitlines()[-1])["claimed"] == 0


def test_exit_when_idle_and_idle_exit_each_say_how_they_differ():
    """Not aliases: --exit-when-idle (a flag) stops at the agent worker's first empty poll,
    --idle-exit SECONDS waits that long with nothing to do. Each help names the other."""
    from buzz_delivery.agents.management.commands import run_agent_worker
    from buzz_delivery.tasks.management.commands import run_task_worker

    def squeezed(text: str) -> str:  # argparse wraps at hyphens too ("--exit-" / "when-idle")
        return "".join(text.split())

    agent = squeezed(_help(run_agent_worker.Command(), "run_agent_worker"))
    assert squeezed("Not the other workers' --idle-exit SECONDS, which waits that long with nothing to do") in agent
    for command in (run_delivery_worker, run_workflow_worker, run_task_worker):
        said = squeezed("run_agent_worker's --exit-when-idle, a flag, stops at its first empty poll instead")
        assert said in squeezed(_help(command.Command(), "x")), command.__name__


# --- a community that does not exist: a WARNING at start, and the worker starts all the same -------


def _run_worker(command: str, community: uuid.UUID) -> None:
    if command == "run_delivery_worker":
        argv = ["--community", str(community), "--target", random32().hex(), "--handler", "json:dumps",
                "--idle-exit", "0.2", "--poll-interval", "0.1"]  # fmt: skip
    elif command == "run_workflow_worker":
        argv = ["--community", str(community), "--idle-exit", "0.2", "--poll-interval", "0.1"]
    else:
        argv = ["--community", str(community), "--agent", AGENT.hex(), "--handler", "json:dumps",
                "--exit-when-idle", "--poll-seconds", "0.1", "--no-listen"]  # fmt: skip
    call_command(command, *argv, stdout=io.StringIO(), stderr=io.StringIO())  # exit 0: no CommandError


def _warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING and "community_not_found" in r.getMessage()]


@pytest.fixture
def captured(caplog):
    """caplog's records of the buzz_delivery loggers (which the project keeps from the root)."""
    logger = logging.getLogger("buzz_delivery")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


WORKERS = ["run_delivery_worker", "run_workflow_worker", "run_agent_worker"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("command", WORKERS)
def test_a_worker_on_a_community_that_does_not_exist_warns_and_starts(command, community, captured):
    _run_worker(command, community.id)
    assert _warnings(captured.records) == []  # one that exists: no warning
    missing = uuid.uuid4()
    _run_worker(command, missing)
    assert _warnings(captured.records) == [
        f"community_not_found community={missing}: no such community; the worker waits for it"
    ]


@pytest.mark.django_db(transaction=True)
def test_the_delivery_worker_warns_for_each_missing_community_of_its_pairs(community, captured):
    missing = uuid.uuid4()
    call_command(
        "run_delivery_worker", "--community", str(community.id), "--target", random32().hex(),
        "--pair", f"{missing}:{random32().hex()}", "--pair", f"{community.id}:{random32().hex()}",
        "--handler", "json:dumps", "--idle-exit", "0.2", "--poll-interval", "0.1",
        stdout=io.StringIO(), stderr=io.StringIO(),
    )  # fmt: skip
    assert _warnings(captured.records) == [
        f"community_not_found community={missing}: no such community; the worker waits for it"
    ]


def test_a_database_not_up_yet_skips_the_check_and_the_worker_starts_all_the_same():
    """The check is one read at start: a database that cannot be read then is logged and skipped
    (the worker's own loops wait for it), not a traceback that stops the worker."""
    env = {**os.environ, "DATABASE_URL": "postgres://postgres@127.0.0.1:1/nowhere"}
    done = subprocess.run(
        [
            sys.executable, "manage.py", "run_delivery_worker", "--community", str(uuid.uuid4()),
            "--target", random32().hex(), "--handler", "json:dumps", "--idle-exit", "0.5", "--poll-interval", "0.1",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "community_check_failed" in done.stderr and "Traceback" not in done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["reason"] == "idle_exit"


@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["threads", "async"])
def test_the_agent_worker_exits_when_idle_with_the_database_unreachable(mode):
    """``--exit-when-idle`` with no database: a poll that cannot claim anything is an idle poll,
    so the worker logs ``db_unavailable`` and exits 0 as the delivery and workflow workers do on
    ``--idle-exit`` (it polled on forever, and the event-loop worker stopped as an internal error)."""
    env = {**os.environ, "DATABASE_URL": "postgres://postgres@127.0.0.1:1/nowhere"}
    done = subprocess.run(
        [
            sys.executable, "manage.py", "run_agent_worker", "--agent", AGENT.hex(), "--handler", "json:dumps",
            "--exit-when-idle", "--poll-seconds", "0.1", *mode,
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "db_unavailable role=agent-worker" in done.stderr and "Traceback" not in done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert (summary["claimed"], summary["internal_errors"]) == (0, 0) and summary["db_errors"] >= 1, summary


@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["threads", "async"])
def test_the_agent_worker_waits_for_an_unreachable_database_and_stops_cleanly(mode):
    """Without ``--exit-when-idle`` a poll the database fails is counted (``db_errors``) and
    retried until a signal stops the worker (exit 0); the event-loop worker stopped at the first
    one as an internal error (exit 1)."""
    env = {**os.environ, "DATABASE_URL": "postgres://postgres@127.0.0.1:1/nowhere"}
    argv = ["run_agent_worker", "--agent", AGENT.hex(), "--handler", "json:dumps", "--poll-seconds", "0.1", *mode]
    worker = subprocess.Popen(
        [sys.executable, "manage.py", *argv, "--no-listen"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # Signalled once it has logged two failed polls, not after a fixed time: under CI's load
    # Django's start alone once took most of three seconds and the worker had polled only once.
    lines: list[str] = []
    two_failed = threading.Event()

    def read_stderr() -> None:
        assert worker.stderr is not None
        for line in worker.stderr:
            lines.append(line)
            if sum("db_unavailable role=agent-worker" in seen for seen in lines) >= 2:
                two_failed.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert two_failed.wait(60), "".join(lines)[-3000:]
        assert worker.poll() is None, "".join(lines)[-3000:]
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)  # it writes only its one-line summary to stdout
        reader.join(10)
        assert worker.stdout is not None
        out = worker.stdout.read()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    err = "".join(lines)
    assert worker.returncode == 0, err[-3000:]
    summary = json.loads(out.splitlines()[-1])
    assert summary["internal_errors"] == 0 and summary["db_errors"] >= 2, summary
