"""Two more node-agent reports inside the node scope: device health and share use.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07

``reclamation.device_health_changed`` (a device of the node failing, or well again) and
``enforcement.share_used`` (traffic went through a share's limit: the claim started) are
written by node agents, for their own node (their ``node`` field), like the other
enforcement reports. The node scope of 0006/0007 (``dracap_node_of``,
``dracap_check_node_scope``) learns them; nothing else changes.
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

NODE_OF = _LEASES.NODE_OF_0007.replace(
    "'reclamation.share_confirmed', 'reclamation.node_lease_acquired' THEN",
    f"'reclamation.share_confirmed', 'reclamation.node_lease_acquired',\n         {_NEW} THEN",
)
NODE_SCOPE = _LEASES.NODE_SCOPE_0007.replace(
    "        'reclamation.node_lease_acquired',",
    f"        'reclamation.node_lease_acquired', {_NEW},",
)
assert NODE_OF.count("share_used") == 1 and NODE_SCOPE.count("share_used") == 1


def upgrade() -> None:
    op.execute(NODE_OF)
    op.execute(NODE_SCOPE)


def downgrade() -> None:
    op.execute(_LEASES.NODE_OF_0007)
    op.execute(_LEASES.NODE_SCOPE_0007)
