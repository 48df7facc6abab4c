"""The database keeps only what it checks: guards derived from the fold, read by name.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Design: up to 0004 every append also projected the claim and share state machines
into ``shares``, ``claims`` and ``node_epochs`` — a third copy of the fold, tied to
the client by positional JSON slots, written under the log's head lock although only
``dracap replay verify`` read it. From here the database holds only what protects an
invariant inside the append (:mod:`events.guards`):

* ``capacity_ledger`` (unchanged, plus ``position``: the last event that moved it);
* ``held_shares``: one row per live non-admin share with the amounts it holds; a
  release deletes it, so a duplicate release gives nothing back;
* ``device_holds`` (unchanged): one exclusive holder per dedicated device;
* ``node_epochs`` (now one epoch per node): fences older than it release nothing.

``dracap_guard(base, guards)`` applies a JSON array of guards in order; each is an
object with a ``kind`` and the fields of its :mod:`events.guards` class, read by name.
Both append paths call it: ``dracap_append_guarded`` (the one-statement path, which
also records a consumer's ``processed_messages`` as 0004's function did) and the bulk
path after its ``COPY``. A capacity that no slice published raises SQLSTATE ``DR002``;
the ledger's CHECK and the holds' key raise as before.

The upgrade moves the live non-admin shares into ``held_shares`` and the newest epoch
of each node into ``node_epochs``. The downgrade restores 0004's tables and functions
with ``shares``, ``claims`` and the old ``node_epochs`` *empty*: they were read models
of the log, and only a replay could fill them again.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from alembic import op

from migrations.roles import app_role, quote
from migrations.sqlfiles import install

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (no percent signs in these bodies: the migration driver treats them as placeholders)

TABLES = (
    """
ALTER TABLE capacity_ledger ADD COLUMN position bigint
    """,
    """
CREATE TABLE held_shares (
    share_id uuid   PRIMARY KEY,
    driver   text   NOT NULL,
    pool     text   NOT NULL,
    device   text   NOT NULL,
    node     text,
    amounts  jsonb  NOT NULL,
    position bigint NOT NULL
)
    """,
    """
CREATE INDEX held_shares_node_idx ON held_shares (node) WHERE node IS NOT NULL
    """,
    """
INSERT INTO held_shares (share_id, driver, pool, device, node, amounts, position)
SELECT share_id, driver, pool, device, node, amounts, position
  FROM shares WHERE state <> 'released' AND NOT admin_access
    """,
    """
CREATE TABLE node_fence_epochs (
    node  text   PRIMARY KEY,
    epoch bigint NOT NULL
)
    """,
    """
INSERT INTO node_fence_epochs (node, epoch)
SELECT node, greatest(lease_epoch, fenced_epoch) FROM node_epochs
    """,
)

DROPPED = (
    "DROP FUNCTION dracap_append_projected(int, text[], int[], uuid[], text[], int[], "
    "text[], int[], text[], text, text[], text[], timestamptz, jsonb[], text, jsonb, text, "
    "uuid[])",
    "DROP FUNCTION dracap_project(bigint, jsonb)",
    "DROP FUNCTION dracap_release_share(uuid, bigint)",
    "DROP FUNCTION dracap_claim_released(text, text, bigint, int, text[])",
    "DROP FUNCTION dracap_claim_ready(text, text, bigint, int)",
    "DROP TABLE shares",
    "DROP TABLE claims",
    "DROP TABLE node_epochs",
    "ALTER TABLE node_fence_epochs RENAME TO node_epochs",
    "ALTER TABLE node_epochs RENAME CONSTRAINT node_fence_epochs_pkey TO node_epochs_pkey",
)


SIGNATURES = (
    "dracap_append_guarded(int, text[], int[], uuid[], text[], int[], text[], int[], text[], "
    "text, text[], text[], timestamptz, jsonb[], text, jsonb, text, uuid[])",
    "dracap_guard(bigint, jsonb)",
    "dracap_release_held(uuid, bigint)",
)


def upgrade() -> None:
    for statement in (*TABLES, *DROPPED):
        op.execute(statement)
    for name in ("dracap_release_held", "dracap_guard", "dracap_append_guarded"):
        install(name, revision)
    role = app_role()
    if role:
        for table in ("held_shares", "node_epochs"):
            op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {quote(role)}")


def _revision(name: str) -> object:
    return importlib.import_module(f"migrations.versions.{name}")


def downgrade() -> None:
    for signature in SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    op.execute("DROP TABLE held_shares")
    op.execute("DROP TABLE node_epochs")
    op.execute("ALTER TABLE capacity_ledger DROP COLUMN position")
    first = _revision("0001_event_log")
    schema: Sequence[str] = getattr(first, "SCHEMA")  # noqa: B009
    for statement in schema:
        tables = any(f"CREATE TABLE {t} " in statement for t in ("shares", "claims", "node_epochs"))
        if tables or "CREATE INDEX shares_" in statement:
            op.execute(statement)
    role = app_role()
    if role:
        for table in ("shares", "claims", "node_epochs"):
            op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {quote(role)}")
    for name in (
        "dracap_claim_ready",
        "dracap_claim_released",
        "dracap_release_share",
        "dracap_project",
        "dracap_append_projected",
    ):
        install(name, "0004")  # dracap_lock stays: 0005 kept it
