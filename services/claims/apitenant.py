"""The tenant's reads: ``claims.get``, ``claims.list`` and ``claims.devices``.

Each answers from the live state, fresh with everything this process has appended or
been notified of (``live.fresh(SEEN)``). A claim's view carries its allocation whole:
what the fold keeps without its configuration is read from the log
(:mod:`services.runtime.store.recorded`), and the ResourceClaim objects of ``get`` and
``list`` (``{"objects": true}``) are built from the manifests the state folded, read
while the state is held still. Withdrawn and released claims are not listed.
"""

from __future__ import annotations

import datetime
import logging
from typing import Final

import msgspec

from events.actors import Actor
from events.state import ClaimState, ClusterState
from services.claims.apicore import ApiCore, NameRequest, decode_request, not_found_reply
from services.claims.kubeobjects import resource_claim_object
from services.claims.views import claim_view, tenant_device_views
from services.runtime.bus.queries import ok_reply
from services.runtime.store import recorded
from services.runtime.store.livestate import SEEN

__all__ = ["TenantReads"]

log = logging.getLogger("dracap.claims")

_HIDDEN_FROM_LIST: Final = frozenset({"withdrawn", "released"})


class _ListRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    objects: bool = False  #: also each claim as a ResourceClaim (``dracap get -o yaml``)


class TenantReads(ApiCore):
    """The tenant endpoints that read (see the module docstring)."""

    async def get(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.get``: the view of one claim, and the claim as a ResourceClaim."""
        request: NameRequest = decode_request(data, NameRequest)
        await self.live.fresh(SEEN)
        # held still while the log is read: the manifest read is the one this state folded
        async with self.live.frozen() as state:
            claim = state.claim(namespace, request.name)
            if claim is None:
                return not_found_reply(namespace, request.name)
            key = (namespace, request.name)
            manifests = await recorded.manifests(self.store.pool, [key], state.position)
            whole = await recorded.allocations(self.store.pool, [claim])
            allocation = whole.get(claim.bound_position)
            view = claim_view(state, claim, allocation)
            now = datetime.datetime.now(datetime.UTC)
            resource = resource_claim_object(
                state,
                claim,
                msgspec.to_builtins(view),
                now,
                recorded=manifests.get(key),
                allocation=allocation,
            )
        return ok_reply(claim=view, object=resource)

    async def list_claims(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.list``: every claim of the namespace that is not gone (with
        ``{"objects": true}`` also each as a ResourceClaim)."""
        request: _ListRequest = decode_request(data, _ListRequest)
        state = await self.live.fresh(SEEN)
        if not request.objects:
            return ok_reply(claims=await self._views(state, self._listed(state, namespace)))
        # held still while the log is read: the manifests read are the ones it folded
        async with self.live.frozen() as held:
            claims = self._listed(held, namespace)
            keys = [(c.namespace, c.name) for c in claims]
            manifests = await recorded.manifests(self.store.pool, keys, held.position)
            whole = await recorded.allocations(self.store.pool, claims)
            now = datetime.datetime.now(datetime.UTC)
            views, objects = [], []
            for claim in claims:
                allocation = whole.get(claim.bound_position)
                view = claim_view(held, claim, allocation)
                views.append(view)
                objects.append(
                    resource_claim_object(
                        held,
                        claim,
                        msgspec.to_builtins(view),
                        now,
                        recorded=manifests.get((claim.namespace, claim.name)),
                        allocation=allocation,
                    )
                )
        return ok_reply(claims=views, objects=objects)

    def _listed(self, state: ClusterState, namespace: str) -> list[ClaimState]:
        """The namespace's claims a list shows (not gone), by name."""
        names = sorted(self._names.get(namespace, ()))
        found = (state.claims.get((namespace, n)) for n in names)
        return [c for c in found if c is not None and c.phase not in _HIDDEN_FROM_LIST]

    async def list_devices_of(
        self, namespace: str, data: bytes, actor: Actor | None = None
    ) -> bytes:
        """``claims.devices``: the devices the namespace may use, as a tenant sees them."""
        state = await self.live.fresh(SEEN)
        inventory = self._device_limits(state).inventory
        views = tenant_device_views(state, inventory, state.namespaces.get(namespace))
        return ok_reply(devices=views)
