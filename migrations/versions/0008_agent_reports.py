"""Two more node-agent reports inside the node scope: device health and share use.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07

``reclamation.device_health_changed`` (a device of the node failing, or well again) and
``enforcement.share_used`` (traffic went through a share's limit: the claim started) are
written by node agents, for their own node (their ``node`` field), like the other
enforcement reports. The node scope of 0006/0007 (``dracap_node_of``,
``dracap_check_node_scope``) learns them. And a report about a live share
(``LimitApplied``, ``LimitFailed``, ``LimitRemoved``, ``ShareConfirmed``, ``ShareUsed``)
now speaks for the node that holds the share in ``held_shares``, not only for the node
its payload names: an agent cannot report on another node's share.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LEASES = importlib.import_module("migrations.versions.0007_leases")
_NEW = "'reclamation.device_health_changed', 'enforcement.share_used'"

# A report about a live share speaks for the node that holds the share (``held_shares``,
# by its primary key): a node's agent cannot confirm, apply, fail or use another node's
# share by naming its own node in the payload. A share that holds nothing (admin access,
# released) is judged by the payload's node, as before.
_SHARE_REPORTS = (
    "'enforcement.limit_applied', 'enforcement.limit_failed', 'enforcement.limit_removed',\n"
    "         'reclamation.share_confirmed', 'enforcement.share_used'"
)
_HELD_NODE = f"""    WHEN {_SHARE_REPORTS} THEN
        IF (p->>'share_id') ~ '^[0-9a-fA-F-]{{36}}$' THEN
            SELECT h.node, true INTO v_other, v_found FROM held_shares h
             WHERE h.share_id = (p->>'share_id')::uuid;
            IF v_found AND v_other IS DISTINCT FROM p->>'node' THEN
                RETURN coalesce(v_other, p_bound);
            END IF;
        END IF;
        RETURN p->>'node';
"""
NODE_OF = _LEASES.NODE_OF_0007.replace(
    "    WHEN 'enforcement.limit_applied', 'enforcement.limit_failed', "
    "'enforcement.limit_removed',\n"
    "         'enforcement.reconciled', 'enforcement.checkpoint_set_aside',\n"
    "         'reclamation.share_confirmed', 'reclamation.node_lease_acquired' THEN",
    _HELD_NODE + "    WHEN 'enforcement.reconciled', 'enforcement.checkpoint_set_aside',\n"
    "         'reclamation.node_lease_acquired', 'reclamation.device_health_changed' THEN",
)
NODE_SCOPE = _LEASES.NODE_SCOPE_0007.replace(
    "        'reclamation.node_lease_acquired',",
    f"        'reclamation.node_lease_acquired', {_NEW},",
)
assert NODE_OF.count("share_used") == 1 and NODE_SCOPE.count("share_used") == 1
assert NODE_OF.count("held_shares h") == 2  # capacity_released's, and the share reports'


def upgrade() -> None:
    op.execute(NODE_OF)
    op.execute(NODE_SCOPE)


def downgrade() -> None:
    op.execute(_LEASES.NODE_OF_0007)
    op.execute(_LEASES.NODE_SCOPE_0007)
