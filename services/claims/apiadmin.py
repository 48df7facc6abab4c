"""The admin endpoints: classes, slices, namespace access, request policies, devices and nodes.

Admin writes are last-writer-wins (no expected version: :meth:`AdminApi._record`) and
skip objects equal to what the log already holds, except ``policies.set`` and
``nodes.fence``, which are appended at the version of the device's or the node's lease
stream they were decided on (:meth:`~services.claims.apicore.ApiCore._write_at_version`).
The reads answer from the live state (``nodes.*`` also from ``node_leases``); the
``*.get`` reads answer the objects in their Kubernetes shape
(:mod:`services.claims.kubeobjects`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

import msgspec

from events import model
from events.actors import Actor
from events.envelopes import device_stream, lease_stream, stream_of
from events.errors import ValidationError
from events.manifests import load_documents
from events.model import DeviceClass, Manifest, ResourceSlice, describe_policy
from events.state import ClusterState
from events.tenancy import NamespacePolicy, check_policy
from services.claims.adminwrites import (
    AdminWrite,
    ClassMode,
    ClassRemoval,
    NodeFence,
    PolicyChange,
    access_classes,
    decide_access,
    decide_classes,
    decide_fence,
    decide_mode,
    decide_policy,
    decide_remove,
    decide_slices,
    ledger_refusal,
)
from services.claims.admission import MAX_MANIFEST_BYTES
from services.claims.apicore import ApiCore, InvalidRequestError, decode_request, refusal_reply
from services.claims.kubeobjects import class_objects, namespace_objects, slice_objects
from services.claims.views import LeaseRow, class_views, device_views, node_views, policy_views
from services.runtime.bus.queries import error_reply, ok_reply
from services.runtime.ground.errors import CapacityExceeded
from services.runtime.store.appends import Batch, Metadata
from services.runtime.store.livestate import HEAD, SEEN

__all__ = ["AdminApi", "NodeName"]

log = logging.getLogger("dracap.claims")

#: The lease rows, their ages by the database's clock (``nodes.list``).
_LEASES: Final = """
SELECT node, epoch, boot_id, ttl_ms,
       extract(epoch FROM clock_timestamp() - renewed_at)::float8 AS renewed_ago_s,
       extract(epoch FROM expires_at - clock_timestamp())::float8 AS expires_in_s
  FROM node_leases
"""


class NodeName(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``nodes.get`` request."""

    node: str


class _ObjectsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str | None = None  #: one object; none: every object of the kind


class AdminApi(ApiCore):
    """The admin endpoints (see the module docstring)."""

    def _manifests(self, data: bytes, source: str, kind: type[Manifest]) -> list[Any]:
        if len(data) > 4 * MAX_MANIFEST_BYTES:
            raise InvalidRequestError(
                None, f"the manifests must be at most {4 * MAX_MANIFEST_BYTES} bytes"
            )
        try:
            objects = load_documents(data.decode("utf-8"), source, self.gates)
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(None, "the manifests must be UTF-8 text", str(exc)) from None
        except ValidationError as exc:
            raise InvalidRequestError(exc.field, exc.rule, exc.obj) from None
        for obj in objects:
            if not isinstance(obj, kind):
                raise InvalidRequestError(
                    "kind", f"must be {kind.__name__}, got {type(obj).__name__}"
                )
        if not objects:
            raise InvalidRequestError(None, f"no {kind.__name__} in the request")
        return objects

    async def _record(self, write: AdminWrite, actor: Actor | None) -> None:
        """Append an admin write's events, each on its own stream, last writer wins."""
        if write.events:
            batches = [Batch(stream_of(event), None, [event]) for event in write.events]
            who = actor or Actor.anonymous(None)
            await self.store.append_many(batches, Metadata(actor=str(who)))

    async def apply_classes(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``deviceclasses.apply``: record DeviceClasses that differ from the log's."""
        classes: list[DeviceClass] = self._manifests(data, "deviceclasses.apply", DeviceClass)
        write = decide_classes(await self.live.fresh(SEEN), classes)
        await self._record(write, actor)
        return ok_reply(applied=list(write.applied), unchanged=list(write.unchanged))

    async def set_class_mode(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``deviceclasses.mode``: how new claims of a class are decided (never old ones)."""
        request: ClassMode = decode_request(data, ClassMode)
        write = decide_mode(
            await self.live.fresh(SEEN), request.name, request.mode, request.min_enforcement
        )
        if write.refusal is not None:
            return refusal_reply(write.refusal)
        await self._record(write, actor)
        recorded = (await self.live.fresh(SEEN)).classes[request.name]
        return ok_reply(
            applied=list(write.applied),
            unchanged=list(write.unchanged),
            mode=recorded.mode,
            min_enforcement=recorded.min_enforcement,
        )

    async def list_classes(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``deviceclasses.list``: every class with its mode and minimum enforcement."""
        state = await self.live.fresh(SEEN)
        return ok_reply(classes=class_views(state))

    async def get_classes(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``deviceclasses.get``: DeviceClasses as recorded (``{"name"}``: one)."""
        return await self._objects(data, "DeviceClass", class_objects)

    async def get_slices(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``slices.get``: ResourceSlices as recorded (``{"name"}``: one)."""
        return await self._objects(data, "ResourceSlice", slice_objects)

    async def get_namespaces(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``namespaces.get``: each namespace's access as a Namespace (``{"name"}``: one)."""
        return await self._objects(data, "Namespace", namespace_objects)

    async def _objects(
        self,
        data: bytes,
        kind: str,
        objects_of: Callable[[ClusterState, str | None], list[dict[str, Any]]],
    ) -> bytes:
        request: _ObjectsRequest = decode_request(data, _ObjectsRequest)
        objects = objects_of(await self.live.fresh(SEEN), request.name)
        if request.name is not None and not objects:
            return error_reply("not_found", f"{kind} {request.name!r} not found", field="name")
        return ok_reply(objects=objects)

    async def remove_class(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``deviceclasses.remove``: no new claims of the class; allocated ones keep running."""
        request: ClassRemoval = decode_request(data, ClassRemoval)
        write = decide_remove(await self.live.fresh(SEEN), request.name)
        if write.refusal is not None:
            return refusal_reply(write.refusal)
        await self._record(write, actor)
        return ok_reply(applied=list(write.applied))

    async def apply_slices(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``slices.apply``: record ResourceSlices that differ from the log's.

        Rejected when a new total is below what is allocated on the device: decided on
        the live state, and again (on a state read afresh) when the capacity ledger
        refuses the append because a reservation committed in between.
        """
        slices: list[ResourceSlice] = self._manifests(data, "slices.apply", ResourceSlice)
        write = decide_slices(await self.live.fresh(SEEN), slices)
        if write.refusal is not None:
            return refusal_reply(write.refusal)
        try:
            await self._record(write, actor)
        except CapacityExceeded:
            return refusal_reply(ledger_refusal(await self.live.fresh(HEAD), write))
        return ok_reply(applied=list(write.applied), unchanged=list(write.unchanged))

    async def set_access(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``namespaces.access``: what a namespace may do (the whole record, see docs)."""
        request: NamespacePolicy = decode_request(data, NamespacePolicy)
        try:
            check_policy(request)
        except ValidationError as exc:
            raise InvalidRequestError(exc.field, exc.rule) from None
        state = await self.live.fresh(SEEN)
        write = decide_access(
            state,
            request.namespace,
            request.classes,
            request.admin_access,
            opaque_config_classes=request.opaque_config_classes,
            max_claims=request.max_claims,
            max_requests_per_claim=request.max_requests_per_claim,
        )
        await self._record(write, actor)
        recorded = msgspec.structs.replace(
            request,
            classes=access_classes(request.classes),
            opaque_config_classes=access_classes(request.opaque_config_classes),
        )
        return ok_reply(
            **msgspec.structs.asdict(recorded),
            applied=list(write.applied),
            unchanged=list(write.unchanged),
        )

    async def set_policy(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``policies.set``: a device capacity's new request policy, under a new version."""
        change: PolicyChange = decode_request(data, PolicyChange)
        stream = device_stream(change.driver, change.pool, change.device)
        who = actor or Actor.anonymous(None)

        def reply(state: ClusterState, write: AdminWrite) -> bytes:
            dev = state.device(change.driver, change.pool, change.device)
            policy = dev.policies.get(change.capacity) if dev is not None else None
            return ok_reply(
                applied=list(write.applied),
                unchanged=list(write.unchanged),
                policy_version=dev.policy_version if dev is not None else None,
                policy=describe_policy(policy),
                request_policy=model.to_builtins(policy) if policy is not None else None,
            )

        return await self._write_at_version(
            stream,
            lambda state: decide_policy(state, change, self.gates),
            who,
            "the device kept changing while its policy was set",
            reply,
        )

    async def list_policies(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``policies.list``: each device's policies and the versions its live shares hold."""
        return ok_reply(devices=policy_views(await self.live.fresh(SEEN)))

    async def list_devices(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``devices.list``: every device with its capacity, shares and tenants."""
        return ok_reply(devices=device_views(await self.live.fresh(SEEN)))

    async def _leases(self) -> dict[str, LeaseRow]:
        rows = await self.store.pool.fetch(_LEASES)
        return {r["node"]: LeaseRow(**dict(r)) for r in rows}

    async def list_nodes(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``nodes.list``: every node's lease, epoch, boot id, taints and unknown shares."""
        leases = await self._leases()
        return ok_reply(nodes=node_views(await self.live.fresh(SEEN), leases))

    async def get_node(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``nodes.get``: one node (``{"node": NAME}``)."""
        request: NodeName = decode_request(data, NodeName)
        leases = await self._leases()
        views = node_views(await self.live.fresh(SEEN), leases)
        found = [v for v in views if v.node == request.node]
        if not found:
            return error_reply("not_found", f"node: no node {request.node!r} is known")
        return ok_reply(node=found[0])

    async def fence_node(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``nodes.fence``: declare a node off; its shares are released with the record.

        Appended to the node's lease stream at the version read, so a lease taken or an
        expiry recorded meanwhile makes it decide again on the newer state.
        """
        request: NodeFence = decode_request(data, NodeFence)
        stream = lease_stream(request.node)
        who = actor or Actor.anonymous(None)

        def reply(state: ClusterState, write: AdminWrite) -> bytes:
            return ok_reply(
                applied=list(write.applied),
                unchanged=list(write.unchanged),
                epoch=state.nodes[request.node].fenced_epoch,
            )

        return await self._write_at_version(
            stream,
            lambda state: decide_fence(state, request),
            who,
            "the node's lease kept changing while fencing",
            reply,
        )
