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
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--reuse-db", "-p", "no:cacheprovider", *argv], env=env
    ).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
