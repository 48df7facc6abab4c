"""What the reclamation service records, decided on the folded log (pure).

:func:`decide_expiry` turns one lease found past its expiry into
``NodeLeaseExpired(node, epoch)`` plus one ``ShareMarkedUnknown`` per live share the
fold places on the node, in ShareID order. The fold marks every live share of the node
unknown at the expiry itself (so a share reserved after the decision is unknown as
well); the per-share events say which shares that was, for audit and for people.

:func:`fence_by_hook` is the record of a fence hook that reported the node off:
``NodeFenced`` at the epoch that expired, with the hook's command as the reason. The
fold releases every live share of the node at that event and the store's ``fence``
guard gives their capacity back in the same append.

Which lease has expired is not decided here: the service reads it from
``node_leases`` and ``node_epochs`` in one statement (the database's clock is the one
clock every lease is measured with).
"""

from __future__ import annotations

from events.catalog import Event, NodeFenced, NodeLeaseExpired, ShareMarkedUnknown
from events.fold import ClusterState

__all__ = ["decide_expiry", "fence_by_hook", "unknown_shares"]


def unknown_shares(state: ClusterState, node: str) -> list[str]:
    """The live shares of ``node`` an expiry makes unknown (sorted)."""
    held = state.nodes.get(node)
    if held is None:
        return []
    return sorted(s for s in held.live_shares if state.shares[s].state not in ("released",))


def decide_expiry(state: ClusterState, node: str, epoch: int) -> list[Event]:
    """The events of the expiry of ``node``'s lease ``epoch`` (see the module docstring)."""
    events: list[Event] = [NodeLeaseExpired(node=node, epoch=epoch)]
    events += [ShareMarkedUnknown(share_id=s, node=node) for s in unknown_shares(state, node)]
    return events


def fence_by_hook(node: str, epoch: int, command: str) -> NodeFenced:
    """The record of a fence hook that reported ``node`` off."""
    return NodeFenced(node=node, epoch=epoch, reason=f"fence hook reported the node off: {command}")
