"""Support for the chaos and database-fault tests: fleet member processes (:mod:`.member`), the
driver (:mod:`.fleet`), the audit of their logs (:mod:`.audit`) and a private PostgreSQL server
(:mod:`.private_pg`)."""

from tests.chaos.audit import Audit, audit, fetch_rows, read_log
from tests.chaos.fleet import REPO, Fleet, database_url, private_workdir, subprocess_env
from tests.chaos.private_pg import PrivatePostgres

__all__ = [
    "REPO",
    "Audit",
    "Fleet",
    "PrivatePostgres",
    "audit",
    "database_url",
    "fetch_rows",
    "private_workdir",
    "read_log",
    "subprocess_env",
]
