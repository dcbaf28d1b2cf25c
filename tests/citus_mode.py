"""Run the suite, or part of it, against a Citus cluster (SPEC section 15).

    python -m tests.citus_mode [pytest arguments]

Uses the coordinator named by ``BUZZ_CITUS_COORDINATOR_URL`` or, when the local PostgreSQL has
the Citus extension, starts a coordinator and two workers under ``BUZZ_CITUS_DIR`` (default
``/tmp/buzz-citus``). Makes ``test_buzz_citus`` on every node, migrates it, distributes it
(``manage.py distribute_tables``), then runs pytest on it with ``--reuse-db`` and
``BUZZ_CITUS_MODE=1`` (what ``tests/test_citus.py`` needs to run instead of skipping). Exits
with pytest's code, or 4 with a reason when no cluster can be had.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import citus_support

NAME = "buzz_citus"
# What runs when no test path is given: every module whose tests exercise the product on the
# cluster. Left out, with the reason: test_chaos and test_db_faults (pg_terminate_backend of
# arbitrary backends also kills the coordinator's own connections to its workers),
# test_pgbouncer (no pooler in front of the coordinator here), test_browser, test_demo (the
# demo's audit trigger writes from a shard into a coordinator table), and the few tests of
# test_hardening, test_reap_command and test_constraints that install test-only triggers inside a
# transaction or switch triggers off with pgtrigger.ignore (a session setting Citus does not
# propagate).
DEFAULT_MODULES = [
    "tests/test_citus.py",
    "tests/test_claim.py",
    "tests/test_settle.py",
    "tests/test_finish_batch.py",
    "tests/test_policy.py",
    "tests/test_commit.py",
    "tests/test_concurrency.py",
    "tests/test_write_fence.py",
    "tests/test_lifecycle.py",
    "tests/test_purge.py",
    "tests/test_reap.py",
    "tests/test_prune_command.py",
    "tests/test_worker.py",
    "tests/test_hints.py",
    "tests/test_admin.py",
    "tests/test_validation.py",
    "tests/test_bad_input_matrix.py",
    "tests/test_scale_out_rules.py",
]


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
    for command in (["migrate", "-v0"], ["distribute_tables"]):
        subprocess.run([sys.executable, "manage.py", *command], env=env, check=True)
    citus_support.immediate_community_keys(test_db)
    env.update(DATABASE_URL=citus_support.with_database(coordinator, NAME), BUZZ_CITUS_MODE="1")
    if not any(not arg.startswith("-") for arg in argv):
        argv = [*argv, *DEFAULT_MODULES]
    pytest = [sys.executable, "-m", "pytest", "--reuse-db", "-p", "no:cacheprovider", *argv]
    return subprocess.run(pytest, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
