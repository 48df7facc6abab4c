"""The core of an append as one server-side function: one round trip under the head lock.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29

Design: every append serialises on the row lock of ``event_log_head`` from its
``UPDATE`` until ``COMMIT`` (:mod:`services.runtime.store.eventstore`). Sent as separate
statements — lock the head, read the streams' versions, insert the rows, notify —
each is a client round trip made while *every other writer waits*, and on a busy
event loop a round trip costs far more than the statement. ``dracap_append`` runs
the four in the server, in one call.

The version read follows the ``UPDATE`` that took the lock, and each plpgsql
statement takes a fresh snapshot (``READ COMMITTED``), so it sees every append
committed before the lock was granted: the check against the expected versions is
exact. A mismatch raises SQLSTATE ``DR001`` (``ConflictError`` by
:func:`services.runtime.ground.errors.map_database_error`, the stream name in the detail),
which aborts the transaction (or the caller's savepoint) with nothing written.
Streams appended with no expected version get their versions moved past the current
one. The function returns the new head and each stream's version before the append.

``SECURITY INVOKER`` (the default): it runs with the application role's own rights.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.sqlfiles import install

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


SIGNATURE = (
    "dracap_append(int, text[], int[], uuid[], text[], int[], text[], int[], text[], text, "
    "text[], text[], timestamptz, jsonb[], text)"
)


def upgrade() -> None:
    install("dracap_append", revision)


def downgrade() -> None:
    op.execute(f"DROP FUNCTION IF EXISTS {SIGNATURE}")
