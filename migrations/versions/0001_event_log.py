"""The event log, its projections and the application role.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Design (see docs/event-log.md for the long form):

* ``events`` is append-only. ``position`` is assigned by the appender from the single
  row of ``event_log_head``, which every append transaction updates first and so holds
  locked until it commits. Appends are therefore serialised, positions are gap-free
  (a rolled-back append rolls the counter back too) and equal commit order, so a
  reader tailing ``position > last_seen`` never skips a late commit.
* A trigger refuses UPDATE, DELETE and TRUNCATE of ``events`` for every role, the
  owner and superusers included; the application role additionally has no such
  privileges at all.
* ``capacity_ledger`` carries one row per (device, capacity) with
  ``CHECK (allocated <= total)``: the database's own, second enforcement of the
  capacity invariant. ``device_holds`` has the device as primary key, so a second
  exclusive hold of a dedicated device is a unique violation.
* The application role (``dracap_app`` unless settings say otherwise) is created if
  it does not exist; roles are cluster-wide, so the downgrade revokes its grants but
  does not drop it (other databases of the same cluster may use it).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.roles import app_role, quote
from migrations.sqlfiles import function_sql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = (
    "event_log_head",
    "events",
    "capacity_ledger",
    "device_holds",
    "shares",
    "claims",
    "node_epochs",
    "consumer_checkpoints",
    "snapshots",
    "node_leases",
)
PROJECTIONS = TABLES[2:]

SCHEMA: tuple[str, ...] = (
    """
CREATE TABLE event_log_head (
    id       boolean PRIMARY KEY DEFAULT true CHECK (id),
    position bigint  NOT NULL CHECK (position >= 0)
)
    """,
    """
INSERT INTO event_log_head (id, position) VALUES (true, 0)
    """,
    """
CREATE TABLE events (
    position       bigint      PRIMARY KEY CHECK (position > 0),
    event_id       uuid        NOT NULL,
    stream         text        NOT NULL,
    stream_version integer     NOT NULL CHECK (stream_version > 0),
    type           text        NOT NULL,
    schema_version integer     NOT NULL CHECK (schema_version > 0),
    namespace      text,
    actor          text        NOT NULL,
    correlation_id text        NOT NULL,
    causation_id   text,
    recorded_at    timestamptz NOT NULL,
    payload        jsonb       NOT NULL,
    CONSTRAINT events_event_id_key UNIQUE (event_id),
    CONSTRAINT events_stream_version_key UNIQUE (stream, stream_version)
)
    """,
    """
CREATE INDEX events_recorded_at_idx ON events (recorded_at)
    """,
    function_sql("dracap_events_append_only", "0001"),
    """
CREATE TRIGGER events_append_only_rows BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION dracap_events_append_only()
    """,
    """
CREATE TRIGGER events_append_only_truncate BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION dracap_events_append_only()
    """,
    """
CREATE TABLE capacity_ledger (
    driver    text    NOT NULL,
    pool      text    NOT NULL,
    device    text    NOT NULL,
    capacity  text    NOT NULL,
    total     numeric NOT NULL CHECK (total >= 0),
    allocated numeric NOT NULL DEFAULT 0,
    PRIMARY KEY (driver, pool, device, capacity),
    CONSTRAINT capacity_ledger_within_total CHECK (allocated <= total),
    CONSTRAINT capacity_ledger_nonnegative CHECK (allocated >= 0)
)
    """,
    """
CREATE TABLE device_holds (
    driver    text NOT NULL,
    pool      text NOT NULL,
    device    text NOT NULL,
    share_id  uuid NOT NULL UNIQUE,
    namespace text NOT NULL,
    claim     text NOT NULL,
    PRIMARY KEY (driver, pool, device)
)
    """,
    """
CREATE TABLE shares (
    share_id           uuid    PRIMARY KEY,
    namespace          text    NOT NULL,
    claim              text    NOT NULL,
    allocation_version integer NOT NULL,
    request            text    NOT NULL,
    driver             text    NOT NULL,
    pool               text    NOT NULL,
    device             text    NOT NULL,
    node               text,
    shared             boolean NOT NULL,
    admin_access       boolean NOT NULL,
    consumed           jsonb   NOT NULL,
    policy_version     integer NOT NULL,
    amounts            jsonb   NOT NULL,
    state              text    NOT NULL,
    prior_state        text,
    level              text,
    position           bigint  NOT NULL
)
    """,
    """
CREATE INDEX shares_claim_idx ON shares (namespace, claim)
    """,
    """
CREATE INDEX shares_device_idx ON shares (driver, pool, device)
    """,
    """
CREATE TABLE claims (
    namespace          text    NOT NULL,
    name               text    NOT NULL,
    phase              text    NOT NULL,
    allocation_version integer NOT NULL DEFAULT 0,
    node               text,
    reason             text,
    position           bigint  NOT NULL,
    PRIMARY KEY (namespace, name)
)
    """,
    """
CREATE TABLE node_epochs (
    node         text   PRIMARY KEY,
    lease        text   NOT NULL DEFAULT 'live',
    lease_epoch  bigint NOT NULL DEFAULT 0,
    fenced_epoch bigint NOT NULL DEFAULT 0
)
    """,
    """
CREATE TABLE consumer_checkpoints (
    consumer   text        PRIMARY KEY,
    position   bigint      NOT NULL CHECK (position >= 0),
    updated_at timestamptz NOT NULL DEFAULT now()
)
    """,
    """
CREATE TABLE snapshots (
    position       bigint      PRIMARY KEY CHECK (position >= 0),
    schema_version integer     NOT NULL,
    payload        bytea       NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now()
)
    """,
    """
CREATE TABLE node_leases (
    node       text        PRIMARY KEY,
    epoch      bigint      NOT NULL CHECK (epoch >= 0),
    expires_at timestamptz NOT NULL
)
    """,
)


def _create_role(role: str) -> None:
    literal = role.replace("'", "''")
    op.execute(
        f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{literal}') THEN
                CREATE ROLE {quote(role)} NOLOGIN;
            END IF;
            IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
               AND NOT pg_has_role(current_user, '{literal}', 'MEMBER') THEN
                EXECUTE 'GRANT {quote(role).replace("'", "''")} TO ' || quote_ident(current_user);
            END IF;
        END
        $$;
        """
    )


def _grant(role: str) -> None:
    q = quote(role)
    op.execute(f"GRANT USAGE ON SCHEMA public TO {q}")
    op.execute(f"GRANT SELECT, INSERT ON events TO {q}")
    op.execute(f"GRANT SELECT, UPDATE ON event_log_head TO {q}")
    for table in PROJECTIONS:
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {q}")


def upgrade() -> None:
    for statement in SCHEMA:
        op.execute(statement)
    role = app_role()
    if role:
        _create_role(role)
        _grant(role)


def downgrade() -> None:
    role = app_role()
    if role:
        op.execute(
            f"DO $$ BEGIN IF EXISTS (SELECT FROM pg_roles WHERE rolname = "
            f"'{role.replace(chr(39), chr(39) * 2)}') THEN "
            f"REVOKE ALL ON {', '.join(TABLES)} FROM {quote(role)}; END IF; END $$;"
        )
    for table in reversed(TABLES):
        op.execute(f"DROP TABLE IF EXISTS {table}")
    op.execute("DROP FUNCTION IF EXISTS dracap_events_append_only()")
