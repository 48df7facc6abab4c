"""Node leases with fencing epochs: acquisition, renewal, stale appends refused and logged.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06

Design (docs/reclamation.md has the long form):

* ``node_leases`` gains ``boot_id``, ``ttl_ms`` and ``renewed_at``. The guards of an
  expiry and a fence (``note_epoch``, ``fence``) also treat an epoch older than the
  node's lease as stale, as the fold does. A lease is taken by
  appending ``NodeLeaseAcquired``: its guard ``acquire`` (in ``dracap_guard``) insists
  on an epoch exactly one more than the newest of the node's lease and its expired or
  fenced epoch (``node_epochs``), or raises ``DR001`` (a conflict: somebody else took
  it first), and writes the lease row. Renewing is no event:
  ``dracap_renew_lease(node, epoch)`` moves ``expires_at`` only while the lease is
  current, unexpired and not fenced, and returns the new expiry (NULL: the lease is
  lost). It is ``SECURITY DEFINER`` and checks the session user's node binding.
* ``dracap_append_guarded`` (same arguments, one more result column ``refused``) reads
  the actor: an agent's (``agent:<node>#<epoch>``) is checked after it took the log's
  head lock, so no acquisition, expiry or fence can slip between check and commit. An
  epoch that is not the node's current lease, or that the node expired or was fenced
  at, is *refused*: instead of the batch the function appends one
  ``reclamation.append_refused`` event (to ``node:<name>``, with the agent as actor),
  marks no message as handled, and returns the node's current epoch in ``refused``;
  the store raises ``StaleEpoch``. The refusal commits with the statement, so it is in
  the log exactly once. A session of a node agent's database role must name an epoch
  (SQLSTATE ``DR004`` otherwise): every append by an agent carries it.
* The node scope of 0006 learns ``reclamation.node_lease_acquired`` (its ``node``) and
  the guard ``acquire`` (it must follow from that event, for the same node and epoch).
* A role for the reclamation service, ``dracap_reclamation``: read the log, the leases
  and the epochs, append through the function. The claims API may read the leases and
  the epochs (``dracap node list``), and so may the agents (to find their next epoch).

Its functions are ``migrations/functions/<name>/0007.sql`` (:data:`FILES` and
``dracap_append_guarded``); the downgrade installs the versions of 0005 and 0006.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.roles import app_role, quote
from migrations.sqlfiles import install

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (no percent signs in the SQL below: the migration driver treats them as placeholders)

OWNER = "dracap_owner"
RECLAMATION = "dracap_reclamation"
APPENDERS = ("dracap_claims", "dracap_reservation", "dracap_agent", RECLAMATION)
APPEND_GUARDED = (
    "dracap_append_guarded(int, text[], int[], uuid[], text[], int[], text[], int[], text[], "
    "text, text[], text[], timestamptz, jsonb[], text, jsonb, text, uuid[])"
)
RENEW = "dracap_renew_lease(text, bigint)"
STALE = "dracap_stale_epoch(text, bigint, jsonb)"

COLUMNS = """
ALTER TABLE node_leases
    ADD COLUMN boot_id    text        NOT NULL DEFAULT '',
    ADD COLUMN ttl_ms     integer     NOT NULL DEFAULT 10000 CHECK (ttl_ms > 0),
    ADD COLUMN renewed_at timestamptz NOT NULL DEFAULT now()
"""

#: The functions this revision installs, in order: ``migrations/functions/<name>/0007.sql``.
#: ``dracap_guard`` is 0005's taught the lease (the staleness of an expiry or fence also
#: counts the node's lease, as the fold does; ``acquire`` numbers and writes leases);
#: ``dracap_stale_epoch`` is the epoch the node is at when an epoch is stale for it (an
#: append that acquires that very epoch is judged by its guard instead); the node scope
#: of 0006 learns the lease (the event names its node; the guard follows from it).
FILES = (
    "dracap_guard",
    "dracap_stale_epoch",
    "dracap_renew_lease",
    "dracap_node_of",
    "dracap_check_node_scope",
)

_LEASE_TABLES = ("node_leases", "node_epochs")


def _ensure_reclamation_role() -> None:
    op.execute(
        f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{RECLAMATION}') THEN
        BEGIN
            CREATE ROLE {quote(RECLAMATION)} NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END
$$
        """
    )


def _grant_append(roles: Sequence[str]) -> None:
    op.execute(f"ALTER FUNCTION {APPEND_GUARDED} OWNER TO {OWNER}")
    op.execute(f"REVOKE EXECUTE ON FUNCTION {APPEND_GUARDED} FROM PUBLIC")
    for role in roles:
        op.execute(f"GRANT EXECUTE ON FUNCTION {APPEND_GUARDED} TO {quote(role)}")


def upgrade() -> None:
    op.execute(COLUMNS)
    for name in FILES:
        install(name, revision)
    op.execute(f"DROP FUNCTION {APPEND_GUARDED}")
    install("dracap_append_guarded", revision)
    _ensure_reclamation_role()
    for function in (STALE, RENEW):
        op.execute(f"ALTER FUNCTION {function} OWNER TO {OWNER}")
        op.execute(f"REVOKE EXECUTE ON FUNCTION {function} FROM PUBLIC")
    app = app_role()
    _grant_append([*APPENDERS, *([app] if app else [])])
    op.execute(f"GRANT EXECUTE ON FUNCTION {RENEW} TO dracap_agent")
    if app:
        op.execute(f"GRANT EXECUTE ON FUNCTION {RENEW} TO {quote(app)}")
    q = quote(RECLAMATION)
    op.execute(f"GRANT USAGE ON SCHEMA public TO {q}")
    for table in ("events", "event_log_head", "snapshots", *_LEASE_TABLES):
        op.execute(f"GRANT SELECT ON {table} TO {q}")
    for table in _LEASE_TABLES:  # the claims API lists nodes; an agent finds its next epoch
        op.execute(f"GRANT SELECT ON {table} TO dracap_claims, dracap_agent")


def downgrade() -> None:
    op.execute(
        f"""
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{RECLAMATION}') THEN
        REVOKE ALL ON events, event_log_head, snapshots, node_leases, node_epochs
          FROM {quote(RECLAMATION)};
        REVOKE USAGE ON SCHEMA public FROM {quote(RECLAMATION)};
    END IF;
END
$$
        """
    )
    for table in _LEASE_TABLES:
        op.execute(f"REVOKE SELECT ON {table} FROM dracap_claims, dracap_agent")
    op.execute(f"DROP FUNCTION {APPEND_GUARDED}")
    install("dracap_append_guarded", "0006")
    app = app_role()
    _grant_append([*(r for r in APPENDERS if r != RECLAMATION), *([app] if app else [])])
    install("dracap_check_node_scope", "0006")
    install("dracap_node_of", "0006")
    op.execute(f"DROP FUNCTION {RENEW}")
    op.execute(f"DROP FUNCTION {STALE}")
    install("dracap_guard", "0005")
    op.execute(
        "ALTER TABLE node_leases DROP COLUMN boot_id, DROP COLUMN ttl_ms, DROP COLUMN renewed_at"
    )
