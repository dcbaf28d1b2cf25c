"""review4: the remote workers' seconds options are bounded as every other worker's poll interval
is (e7ccbe7): ``work --renew-every 1e10`` (or ``work-runs``) was taken, and the renewer thread
died at its first wait (OverflowError, "Exception in thread gateway-renewer") while the worker
claimed on and exited 0: every lease it held would lapse. ``nan``/``0``/``-1`` renewed in a busy
loop; ``--idle-exit nan`` never exited; ``--shutdown-grace nan`` gave up every lease at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.gateway.support import ROOT


@pytest.mark.parametrize("command", ["work", "work-runs"])
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--renew-every", "1e10"),
        ("--renew-every", "nan"),
        ("--renew-every", "0"),
        ("--renew-every", "-1"),
        ("--idle-exit", "nan"),
        ("--shutdown-grace", "nan"),
        ("--wait-seconds", "inf"),
    ],
)
def test_an_out_of_bounds_seconds_option_is_refused_naming_it(tmp_path, command, option, value):
    key_file = tmp_path / "agent.key"
    key_file.write_text(os.urandom(32).hex() + "\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "buzz_delivery.gateway.client", command, "--url", "http://127.0.0.1:9/gateway/v1",
             "--key-file", str(key_file), "--handler", "json:dumps", "--idle-exit", "1", option, value],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} {option} {value}: taken, and still running after 30 s")
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert option in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(("command", "option"), [("work", "--max-deliveries"), ("work-runs", "--max-runs")])
def test_a_max_count_below_1_is_refused_naming_it_as_the_workers_constructor_refuses_it(tmp_path, command, option):
    """The constructors refuse 0 (``ValueError`` naming ``max_deliveries``/``max_runs``), so the
    command says so before it builds one, naming the option (exit 2, no traceback)."""
    key_file = tmp_path / "agent.key"
    key_file.write_text(os.urandom(32).hex() + "\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "buzz_delivery.gateway.client", command, "--url", "http://127.0.0.1:9/gateway/v1",
         "--key-file", str(key_file), "--handler", "json:dumps", "--idle-exit", "1", option, "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert f"{option} must be >= 1" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
