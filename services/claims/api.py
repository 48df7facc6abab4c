"""The tenant and admin APIs: NATS micro endpoints over the live state and the event log.

Tenant endpoints listen on ``names.api("*", op)`` = ``{prefix}.api.*.claims.{op}`` for
``op`` in ``apply``, ``get``, ``list``, ``delete``, ``watch`` and ``devices`` (the
devices of the classes the namespace may use, with only the attributes those classes
allow-list: :func:`services.claims.views.tenant_device_views`). The namespace is the
subject's third token and **only** that: a manifest's ``metadata.namespace`` may be
empty or equal to it, never different (the request is refused naming the field and
nothing is recorded). The broker's subject permissions give each tenant only its own
namespace's subjects (invariant 10); this service never trusts a namespace from a
payload.

Admin endpoints listen on ``names.admin(op)`` for ``deviceclasses.apply``,
``deviceclasses.mode``, ``deviceclasses.list``, ``deviceclasses.get``,
``deviceclasses.remove``, ``slices.apply``, ``slices.get``, ``namespaces.access``,
``namespaces.get``, ``policies.set``, ``policies.list``, ``devices.list``, ``nodes.list``,
``nodes.get`` and ``nodes.fence``. The ``*.get`` reads answer ``{"objects": [...]}``, the
objects in their Kubernetes shape (all of the kind, or the one ``{"name"}`` names:
:mod:`services.claims.kubeobjects`), what ``dracap get`` prints.

Every reply is JSON (:mod:`services.claims.views`): ``{"ok": true, ...}`` or
``{"ok": false, "error": {code, field, rule, message}}`` with code ``invalid``,
``rejected``, ``not_found`` or ``conflict``. ``docs/services.md`` lists the payloads.

Writes
------
Every write is a pure decision (:func:`services.claims.admission.decide_apply`, the
others in :mod:`services.claims.adminwrites`) on the live state, asked for with
``live.fresh(SEEN)`` (every commit this process has appended or been notified of is
folded — read-your-writes — without a read when the tailed state is already there).
Tenant writes are appended with the claim stream's expected version
(:meth:`LiveState.stream_version`), so two concurrent requests about one claim cannot
both win: the loser gets ``ConflictError``, asks for ``fresh(HEAD)`` (the winner may be
another process, not announced yet) and decides again (it then sees the winner's
claim). What is recorded:

* ``apply``: :func:`services.claims.admission.decide_apply` — ``ClaimSubmitted`` plus
  ``ClaimAdmitted`` or ``ClaimRejected``, or nothing (undecodable input, wrong
  namespace, a live claim of that name). Re-applying the same spec is a no-op.
* ``delete``: an allocated (or ready, or failed but still holding) claim gets
  ``ReleaseRequested(node=...)``, which the node agent turns into ``LimitRemoved`` +
  ``CapacityReleased``; a claim without live shares gets ``ClaimWithdrawn``; a claim
  already releasing, withdrawn or released is left alone and its phase is the answer
  (a second delete, concurrent or late, finds the caller's wish done); only a claim
  that never existed is ``not_found``.
* admin writes are last-writer-wins (no expected version) and skip objects equal to
  what the log already holds, so re-applying an inventory appends nothing.
  ``slices.apply`` is ``rejected`` when a new total is below what live shares hold on
  the device (naming device, capacity, the total asked and the amount allocated):
  decided on the live state, and the same answer when the capacity ledger's CHECK
  refuses the append because a reservation won the race.
* ``deviceclasses.mode`` records ``ClassModeSet`` (a class's mode: ``consumable``,
  ``whole-device`` or ``disabled``; :func:`services.claims.adminwrites.decide_mode`) and
  ``deviceclasses.remove`` ``DeviceClassRemoved``
  (:func:`services.claims.adminwrites.decide_remove`); neither touches an allocation:
  only claims decided afterwards follow the class's new mode or find it gone.
* ``policies.set`` records ``RequestPolicyChanged`` (one device capacity, the device's
  next policy version: :func:`services.claims.adminwrites.decide_policy`), appended
  with the device stream's expected version like a tenant write, so a reservation
  committed meanwhile makes it decide again on the fresh state.
* ``nodes.fence`` records ``NodeFenced`` at the node's newest epoch with the
  operator's reason (:func:`services.claims.adminwrites.decide_fence`), appended to the
  node's ``lease:<node>`` stream at the version read: the fold and the store's
  ``fence`` guard release the node's live shares in that same append, and every later
  append of that epoch is refused. ``nodes.list`` / ``nodes.get`` read the fold and
  ``node_leases`` (lease age, epoch, boot id, taints, unknown shares).

:mod:`services.claims.adminwrites` holds the rules of delete and the admin writes.

The code is in parts, one per concern, each a class built on
:class:`~services.claims.apicore.ApiCore` (the shared state, request plumbing and the
write protocol): the tenant's reads (:mod:`services.claims.apitenant`), its writes
(:mod:`services.claims.apiwrites`), the admin endpoints (:mod:`services.claims.apiadmin`)
and watching (:mod:`services.claims.apiwatch`). :class:`ClaimsApi` puts them together and
registers the endpoints.

Requests are served concurrently (a task per request, at most ``concurrency`` at a
time); decisions serialise only on the live state's lock, and the tenant writes of
concurrent requests are committed together (:mod:`services.runtime.store.committing`), each
still with its own stream's expected version.

Watch
-----
``watch`` replies with a subject: ``{prefix}.watch.{namespace}.{name}`` for one claim,
``{prefix}.watch.{namespace}.>`` for all claims of the namespace. The API publishes a
claim's :class:`~services.claims.views.ClaimView` JSON there (core NATS, no
persistence) each time an event changes the claim or one of its shares. Watches cost
nothing on the server side (no registration, nothing to expire); a watcher reads the
current view with ``get`` after subscribing. Publication is driven by the live state,
so the live state must be tailed (``LiveState.run``; ``ClaimsApi(tail=True)`` does it
itself). Several API instances each publish every change (a watcher may see
duplicates; views are idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from nats.micro import add_service

from services.claims.admission import REJECTION_REASONS
from services.claims.apiadmin import AdminApi
from services.claims.apicore import AdminOperation, TenantOperation
from services.claims.apitenant import TenantReads
from services.claims.apiwatch import WatchApi
from services.claims.apiwrites import TenantWrites
from services.runtime.bus.flushing import flushed
from services.runtime.ground.metrics import REJECTIONS

__all__ = ["ADMIN_OPS", "TENANT_OPS", "ClaimsApi"]

log = logging.getLogger("dracap.claims")

TENANT_OPS: Final = (
    "apply",
    "get",
    "list",
    "delete",
    "watch",
    "devices",
    "reserve",
    "unreserve",
)
ADMIN_OPS: Final = (
    "deviceclasses.apply",
    "deviceclasses.mode",
    "deviceclasses.list",
    "deviceclasses.get",
    "deviceclasses.remove",
    "slices.apply",
    "slices.get",
    "namespaces.access",
    "namespaces.get",
    "policies.set",
    "policies.list",
    "devices.list",
    "nodes.list",
    "nodes.get",
    "nodes.fence",
)


class ClaimsApi(TenantWrites, TenantReads, AdminApi, WatchApi):
    """The tenant and admin endpoints of one API instance (see the module docstring)."""

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Register the micro service and its endpoints (idempotent)."""
        if self._service is not None:
            return
        for reason in REJECTION_REASONS:  # each at 0 from the start
            REJECTIONS.labels(reason=reason)
        service = await add_service(
            self.nc,
            name=f"{self.names.prefix}-claims",
            version="0.1.0",
            description="dracap claims and admin API",
            queue_group=f"{self.names.prefix}-claims",
        )
        tenant: dict[str, TenantOperation] = {
            "apply": self.apply,
            "get": self.get,
            "list": self.list_claims,
            "delete": self.delete,
            "watch": self.watch,
            "devices": self.list_devices_of,
            "reserve": self.reserve,
            "unreserve": self.unreserve,
        }
        for op, fn in tenant.items():
            await service.add_endpoint(
                name=f"claims-{op}", subject=self.names.api("*", op), handler=self._tenant(fn)
            )
        admin: dict[str, AdminOperation] = {
            "deviceclasses.apply": self.apply_classes,
            "deviceclasses.mode": self.set_class_mode,
            "deviceclasses.list": self.list_classes,
            "deviceclasses.get": self.get_classes,
            "deviceclasses.remove": self.remove_class,
            "slices.apply": self.apply_slices,
            "slices.get": self.get_slices,
            "namespaces.access": self.set_access,
            "namespaces.get": self.get_namespaces,
            "policies.set": self.set_policy,
            "policies.list": self.list_policies,
            "devices.list": self.list_devices,
            "nodes.list": self.list_nodes,
            "nodes.get": self.get_node,
            "nodes.fence": self.fence_node,
        }
        for op, afn in admin.items():
            await service.add_endpoint(
                name=f"admin-{op.replace('.', '-')}",
                subject=self.names.admin(op),
                handler=self._admin(afn),
            )
        await flushed(self.nc)
        self._service = service

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set: publish watch views (and tail, with ``tail``)."""
        await self.start()
        workers = [asyncio.ensure_future(self._publish_changes(stop))]
        if self.tail:
            workers.append(asyncio.ensure_future(self.live.run(stop)))
        try:
            await stop.wait()
        finally:
            self._wake.set()
            await self.close()
            for worker in workers:
                with contextlib.suppress(asyncio.CancelledError):
                    await worker

    async def close(self) -> None:
        """Stop the endpoints and finish the requests in flight."""
        if self._service is not None:
            await self._service.stop()
            self._service = None
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._committer.close()
        await self.selectors.close()
        self._unsubscribe()
