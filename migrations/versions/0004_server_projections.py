"""Projections in the server: an append and its projections in one call.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29

Design: an append holds the log's head lock from ``dracap_append`` to ``COMMIT``
(0003). Run from the client, each projection statement after the function is one
more round trip made under that lock, and the ``COMMIT`` another; on a busy event
loop each costs a millisecond or more while every other writer waits, so the lock,
not the database, bounded how fast the whole control plane could go.

``dracap_project(base, ops)`` applies the row changes of :mod:`events.ledger` in log
order, one by one, with the same statements as the client-side path
(:mod:`services.runtime.delivery.projecting`). ``ops`` is one JSON array; each op is
``[kind, offset, arg, ...]``, the event's position being ``base + offset`` and the
arguments those of the client-side statement, in its order. A capacity that no slice
published raises SQLSTATE ``DR002`` (``CapacityNotPublished``); the ledger's checks and
the holds' keys raise as they do for the client.

``dracap_append_projected(..., ops, consumer, processed)`` is ``dracap_append``
followed by ``dracap_project`` with the new positions. Sent as a statement of its own,
outside an explicit transaction, an append is then one round trip and its commit
happens in the server right after: the head lock is held for the server's own work
only. With a ``consumer`` it first records the ``processed`` message ids in
``processed_messages`` (before taking the head lock); if any was recorded before it
raises SQLSTATE ``DR003`` and nothing is written — a bus consumer's whole group then
commits in this one statement (:mod:`services.runtime.delivery.consuming`).

``dracap_lock(key)`` takes a session-level advisory lock and returns the log's head
read after the lock was granted: a consumer that serialises its handlers on a lock
learns in the same round trip how far its view must be folded to include every
commit of the lock's previous holder.

The statements are copied, not imported, so this revision stays as it is when the
client-side SQL changes; ``dracap replay verify`` and the tests compare both paths
with the fold.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.sqlfiles import install

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The functions this revision installs, in order: ``migrations/functions/<name>/0004.sql``.
FUNCTIONS = (
    "dracap_claim_ready",
    "dracap_claim_released",
    "dracap_release_share",
    "dracap_project",
    "dracap_append_projected",
    "dracap_lock",
)


SIGNATURES = (
    "dracap_lock(bigint)",
    "dracap_append_projected(int, text[], int[], uuid[], text[], int[], text[], int[], text[], "
    "text, text[], text[], timestamptz, jsonb[], text, jsonb, text, uuid[])",
    "dracap_project(bigint, jsonb)",
    "dracap_release_share(uuid, bigint)",
    "dracap_claim_released(text, text, bigint, int, text[])",
    "dracap_claim_ready(text, text, bigint, int)",
)


def upgrade() -> None:
    for name in FUNCTIONS:
        install(name, revision)


def downgrade() -> None:
    for signature in SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
