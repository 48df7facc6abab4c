"""The audit and billing subscribers' own tables, and their role ``dracap_ledger``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-08

Both subscribers (``services/audit``, ``services/billing``; ``docs/audit-billing.md``)
are durable consumers of the bus that keep what they derive in tables of their own,
written in the same transaction as the messages' ``processed_messages`` rows
(``Handled.writes``, :mod:`services.runtime.delivery.consuming`), so each row exists exactly
once however often a message is delivered. None of these tables is the truth: each is
a function of the log and could be rebuilt by consuming it again.

* ``ledger_positions``: how far in the log each subscriber has applied, moved in the
  same transaction as its rows (the subscriber reads the log from there, in order:
  ``services/runtime/delivery/projecting.py``);
* ``audit_records``: one row per decision or change, keyed by its log position and a
  sequence number within the event (a fence gives a row per share it released);
* ``audit_shares``: what the audit knows of each share (namespace, claim, request,
  device, amounts, policy version), to name them on the events that carry a ShareID only;
* ``audit_nodes`` / ``billing_nodes``: each node's newest lease and fence epochs, to tell
  a stale expiry or fence (which changes nothing, as in the fold) from one that counts;
* ``billing_claims``: the DeviceClass of each request of the latest spec of a claim;
* ``billing_shares``: each share's billing state (``held``, ``unknown``, ``closed``)
  and since when;
* ``billing_usage``: amount x time per namespace, DeviceClass, capacity, hour and state
  (``held`` or ``unknown``), in the capacity's base unit times seconds, exact.

``dracap_ledger`` (both subscribers) reads the log, records handled messages and its
lag mark, and writes these tables; the claims API's role and the read-only role may
read them (the query endpoints); the app role of 0001 may do all of it (tests, and
installations without roles). The log itself stays append-only for everybody.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.roles import app_role, quote

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNER = "dracap_owner"
LEDGER = "dracap_ledger"
READERS = ("dracap_claims", "dracap_readonly")
TABLES = (
    "ledger_positions",
    "audit_records",
    "audit_shares",
    "audit_nodes",
    "billing_claims",
    "billing_shares",
    "billing_nodes",
    "billing_usage",
)

CREATE = """
CREATE TABLE ledger_positions (
    subscriber      text PRIMARY KEY,
    position        bigint NOT NULL CHECK (position >= 0)
);
CREATE TABLE audit_records (
    position        bigint      NOT NULL,
    seq             integer     NOT NULL,
    event_id        uuid        NOT NULL,
    recorded_at     timestamptz NOT NULL,
    type            text        NOT NULL,
    decision        text        NOT NULL,
    reason          text        NOT NULL DEFAULT '',
    namespace       text,
    claim           text,
    request         text,
    share_id        text,
    device          text,
    node            text,
    amounts         jsonb       NOT NULL DEFAULT '{}',
    policy_version  integer,
    actor           text        NOT NULL,
    actor_kind      text        NOT NULL,
    actor_name      text        NOT NULL,
    actor_epoch     bigint,
    PRIMARY KEY (position, seq)
);
CREATE INDEX audit_records_namespace_idx ON audit_records (namespace, position);
CREATE INDEX audit_records_time_idx ON audit_records (recorded_at);
CREATE TABLE audit_shares (
    share_id        text PRIMARY KEY,
    namespace       text    NOT NULL,
    claim           text    NOT NULL,
    request         text    NOT NULL,
    device          text    NOT NULL,
    node            text,
    amounts         jsonb   NOT NULL,
    policy_version  integer NOT NULL,
    live            boolean NOT NULL DEFAULT true
);
CREATE INDEX audit_shares_node_idx ON audit_shares (node) WHERE live;
CREATE TABLE audit_nodes (
    node            text PRIMARY KEY,
    lease_epoch     bigint NOT NULL,
    fenced_epoch    bigint NOT NULL
);
CREATE TABLE billing_nodes (
    node            text PRIMARY KEY,
    lease_epoch     bigint NOT NULL,
    fenced_epoch    bigint NOT NULL
);
CREATE TABLE billing_claims (
    namespace       text  NOT NULL,
    name            text  NOT NULL,
    classes         jsonb NOT NULL,
    PRIMARY KEY (namespace, name)
);
CREATE TABLE billing_shares (
    share_id        text PRIMARY KEY,
    namespace       text        NOT NULL,
    device_class    text        NOT NULL,
    node            text,
    amounts         jsonb       NOT NULL,
    billed          boolean     NOT NULL,
    state           text        NOT NULL CHECK (state IN ('held', 'unknown', 'closed')),
    since           timestamptz NOT NULL,
    position        bigint      NOT NULL
);
CREATE INDEX billing_shares_node_idx ON billing_shares (node) WHERE state <> 'closed';
CREATE TABLE billing_usage (
    namespace       text        NOT NULL,
    device_class    text        NOT NULL,
    capacity        text        NOT NULL,
    hour            timestamptz NOT NULL,
    state           text        NOT NULL CHECK (state IN ('held', 'unknown')),
    unit_seconds    numeric     NOT NULL CHECK (unit_seconds >= 0),
    PRIMARY KEY (namespace, device_class, capacity, hour, state)
);
"""


def _ensure_ledger_role() -> None:
    op.execute(
        f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{LEDGER}') THEN
        BEGIN
            CREATE ROLE {quote(LEDGER)} NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END
$$
        """
    )


def upgrade() -> None:
    op.execute(CREATE)
    _ensure_ledger_role()
    tables = ", ".join(TABLES)
    for table in TABLES:
        op.execute(f"ALTER TABLE {table} OWNER TO {OWNER}")
    q = quote(LEDGER)
    op.execute(f"GRANT USAGE ON SCHEMA public TO {q}")
    for table in ("events", "event_log_head", "snapshots"):
        op.execute(f"GRANT SELECT ON {table} TO {q}")
    op.execute(f"GRANT SELECT, INSERT ON processed_messages TO {q}")
    op.execute(f"GRANT SELECT, INSERT, UPDATE ON consumer_checkpoints TO {q}")
    op.execute(f"GRANT SELECT, INSERT, UPDATE ON {tables} TO {q}")
    op.execute(f"GRANT SELECT ON {tables} TO {', '.join(quote(r) for r in READERS)}")
    app = app_role()
    if app:
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {tables} TO {quote(app)}")


def downgrade() -> None:
    op.execute(
        f"""
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{LEDGER}') THEN
        REVOKE ALL ON events, event_log_head, snapshots, processed_messages,
                      consumer_checkpoints FROM {quote(LEDGER)};
        REVOKE USAGE ON SCHEMA public FROM {quote(LEDGER)};
    END IF;
END
$$
        """
    )
    for table in reversed(TABLES):
        op.execute(f"DROP TABLE {table}")
