"""The hottest lease statements, each wrapped in a PL/pgSQL function so that every database
backend plans it once (issue 16).

A statement sent unprepared is parsed and planned on every run: for the claim and the settle,
planning cost as much server CPU as the execution. psycopg's prepared statements avoid that,
but they are a per-connection protocol feature that transaction-mode poolers break, and they
cannot carry the tenant context that row-level security sends in front of each statement in
the same simple query (:mod:`buzz_delivery.services.tenancy`). A PL/pgSQL function keeps its
statements' plans in the backend that runs it, whatever the client, pooler or binding, so both
modes gain. Each function runs ``SET plan_cache_mode = force_generic_plan``: the default would
plan the claim anew on every call, because a generic plan with an unknown ``LIMIT`` looks
costlier than the custom ones; ``tests/test_cached_statements.py`` pins the generic plans
(the polling index and the primary key, with stale statistics too).

The function bodies are the statements of :mod:`buzz_delivery.services.sql`, with each
``%(name)s`` renamed ``p_name``. The migration that creates them (core ``0017``) holds a frozen
copy; a test compares the database's bodies with :func:`CachedStatement.create_sql` of today's
statements, so a changed statement without a new migration fails the suite.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from buzz_delivery.services import flow, sql

_PARAM = re.compile(r"%\((\w+)\)s")
_PRELUDE_PARAM = re.compile(r"\bp_(\w+)")


@dataclass(frozen=True)
class CachedStatement:
    """One statement of :mod:`~buzz_delivery.services.sql` behind a plan-caching function.

    ``params``: ``(name, SQL type)`` in the function's argument order; every ``%(name)s`` of
    the statement must be among them. ``returns``: the function's ``RETURNS`` clause.
    ``columns``: what the call selects from the function's rows, in the order the callers read.
    """

    function: str
    statement: str
    params: tuple[tuple[str, str], ...]
    returns: str
    columns: str
    # PL/pgSQL run before the statement in the same call (``PERFORM ...;`` lines); the statement
    # then reads a snapshot taken after it (READ COMMITTED: one per statement of the function).
    prelude: str = ""

    def __post_init__(self) -> None:
        # (A prelude names the function's parameters as ``p_<name>``.)
        used = set(_PARAM.findall(self.statement)) | set(_PRELUDE_PARAM.findall(self.prelude))
        declared = {name for name, _ in self.params}
        if used != declared:
            raise ValueError(f"{self.function}: statement uses {sorted(used)}, declared {sorted(declared)}")

    @property
    def body(self) -> str:
        """The PL/pgSQL body (``prosrc``)."""
        query = _PARAM.sub(lambda m: f"p_{m.group(1)}", self.statement.strip())
        return f"\n#variable_conflict use_column\nBEGIN\n{self.prelude}    RETURN QUERY\n{query};\nEND\n"

    @property
    def call(self) -> str:
        """The statement the services send: ``SELECT columns FROM function(%(name)s::type, ...)``;
        the casts pick the function whatever the client binds."""
        args = ", ".join(f"%({name})s::{kind}" for name, kind in self.params)
        return f"SELECT {self.columns} FROM {self.function}({args}) AS d"

    @property
    def signature(self) -> str:
        """The argument list, as ``pg_get_function_identity_arguments`` prints it."""
        return ", ".join(f"p_{name} {kind}" for name, kind in self.params)

    def create_sql(self) -> str:
        """``CREATE OR REPLACE FUNCTION`` of this statement (what migration 0017 froze)."""
        return (
            f"CREATE OR REPLACE FUNCTION {self.function}({self.signature})\n"
            f"RETURNS {self.returns} LANGUAGE plpgsql VOLATILE\n"
            f"SET plan_cache_mode = force_generic_plan\nAS $fn${self.body}$fn$;"
        )


_SETTLE_PARAMS = (("status", "varchar"), ("failure_code", "varchar"), ("failure_message", "text"))

CLAIM = CachedStatement(
    function="buzz_delivery_claim_pending",
    statement=sql.claim_oldest_pending(by_id=False, by_binding=False),
    params=(
        ("community_id", "uuid"),
        ("target_pubkey", "bytea"),
        ("limit", "bigint"),
        ("lease_seconds", "float8"),
        ("holder", "text"),
    ),
    returns=sql.CLAIM_TABLE,
    columns=sql.RETURNING_CLAIM_COLUMNS,
)

# The claim of one hinted delivery (a wake hint names its id): the same claim narrowed to that
# id, so the worker's wake path is not parsed and planned anew on every hint (issue 31).
CLAIM_HINTED = CachedStatement(
    function="buzz_delivery_claim_hinted",
    statement=sql.claim_oldest_pending(by_id=True, by_binding=False),
    params=(
        ("community_id", "uuid"),
        ("target_pubkey", "bytea"),
        ("delivery_id", "uuid"),
        ("limit", "bigint"),
        ("lease_seconds", "float8"),
        ("holder", "text"),
    ),
    returns=sql.CLAIM_TABLE,
    columns=sql.RETURNING_CLAIM_COLUMNS,
)

FINISH = CachedStatement(
    function="buzz_delivery_finish_lease",
    statement=sql.FINISH_IF_CURRENT_GENERATION,
    params=(
        ("community_id", "uuid"),
        ("delivery_id", "uuid"),
        ("target_pubkey", "bytea"),
        ("lease_generation", "bigint"),
        *_SETTLE_PARAMS,
    ),
    returns="TABLE(status varchar)",
    columns="d.status",
)

FINISH_MANY = CachedStatement(
    function="buzz_delivery_finish_leases",
    statement=sql.FINISH_MANY_IF_CURRENT_GENERATION,
    params=(
        ("community_id", "uuid"),
        ("delivery_ids", "uuid[]"),
        ("lease_generations", "bigint[]"),
        ("target_pubkeys", "bytea[]"),
        *_SETTLE_PARAMS,
    ),
    returns="TABLE(id uuid, status varchar)",
    columns="d.id, d.status",
    prelude=sql.LOCK_RUNS_OF_DELIVERIES_IN_FUNCTION,
)

# The retry of one lease (back to pending, or failed on the last allowed attempt): plan-cached since
# the exhausted retry writes two tables (issue 31, stage 2), which Citus plans only inside a
# delegated function.
RETRY = CachedStatement(
    function="buzz_delivery_retry_lease",
    statement=sql.RETRY_IF_CURRENT_GENERATION,
    params=(
        ("community_id", "uuid"),
        ("delivery_id", "uuid"),
        ("target_pubkey", "bytea"),
        ("lease_generation", "bigint"),
        ("failure_message", "text"),
        ("backoff_base", "float8"),
        ("backoff_cap", "float8"),
        ("jitter", "float8"),
        ("retry_after", "float8"),
    ),
    returns="TABLE(status varchar)",
    columns="d.status",
)

# The mixed batch settle (issue 29: each row its own outcome, texts, jitter and Retry-After),
# plan-cached and taking its runs' locks in run order first, as FINISH_MANY does (issue 31).
SETTLE_MANY = CachedStatement(
    function="buzz_delivery_settle_leases",
    statement=sql.SETTLE_MANY_IF_CURRENT_GENERATION,
    params=(
        ("community_id", "uuid"),
        ("delivery_ids", "uuid[]"),
        ("lease_generations", "bigint[]"),
        ("target_pubkeys", "bytea[]"),
        ("outcomes", "varchar[]"),
        ("failure_codes", "varchar[]"),
        ("failure_messages", "text[]"),
        ("jitters", "float8[]"),
        ("retry_afters", "float8[]"),
        ("backoff_base", "float8"),
        ("backoff_cap", "float8"),
    ),
    returns="TABLE(id uuid, status varchar)",
    columns="d.id, d.status",
    prelude=sql.LOCK_RUNS_OF_DELIVERIES_IN_FUNCTION,
)

# The claim under the operator's concurrency limits (services/flow.py): the community's claim lock,
# then the claim that takes free slots; a NULL maximum is no limit of that kind. It updates the
# queue and returns the claim's row joined to the record (issue 31, stage 2: ``sql.CLAIM_TABLE``).
CLAIM_LIMITED = CachedStatement(
    function="buzz_delivery_claim_limited",
    statement=flow.claim_under_any_limits(),
    params=(
        ("community_id", "uuid"),
        ("target_pubkey", "bytea"),
        ("limit", "bigint"),
        ("lease_seconds", "float8"),
        ("holder", "text"),
        ("cap_community", "integer"),
        ("cap_target", "integer"),
        ("cap_workflow", "integer"),
    ),
    returns=sql.CLAIM_TABLE,
    columns=sql.RETURNING_CLAIM_COLUMNS,
    prelude=flow.LOCK_IN_FUNCTION,
)

ALL = (CLAIM, FINISH, FINISH_MANY, CLAIM_LIMITED, CLAIM_HINTED, SETTLE_MANY, RETRY)
