"""The Kubernetes bridge: ResourceClaims in, the log's verdicts and limits back out.

``dracap serve kubernetes-bridge`` runs it (one per cluster; it holds no state of its own).
Two loops:

Mirror (API server -> log)
    At start it lists every ResourceClaim, hands each to
    :func:`~services.claims.mirroring.decide_claim` and asks
    :func:`~services.claims.mirroring.decide_deleted` about every claim the log holds as
    mirrored and live that the list no longer has (deleted while the bridge was down).
    Then a :class:`~services.runtime.kube.informer.ClaimInformer` watches from the list's
    resourceVersion: every ADDED/MODIFIED claim goes through ``decide_claim``, every DELETED
    one through ``decide_deleted``. A dropped watch resumes from the last version seen; a
    ``410 Gone`` re-lists, and the informer hands on only what differs. Each decision is
    taken on a frozen state and appended with the claim stream's version read with it (the
    device streams take any version: the capacity guards protect them), so two bridges, or a
    decision raced by the agent, make one of them decide again. Because every rule compares
    with the log, a claim handed over twice is mirrored once.

Status (log -> API server)
    Every folded event marks the claims it touches (the same rule the claims API's watch
    uses, :class:`~services.claims.views.ClaimsTouched`). For each mirrored claim marked,
    the bridge reads the ResourceClaim and, when its entries of dracap's drivers in
    ``status.devices`` differ from :func:`~services.claims.kubeobjects.device_statuses`,
    writes them (a merge patch of the status subresource at the claim's resourceVersion;
    entries of other drivers are kept; ``409 Conflict``: read again and retry). Nothing is
    written to a claim that is no longer allocated: the API server accepts device statuses
    only for allocated devices; such a claim is decided again instead, so that one
    released after Kubernetes deallocated it is withdrawn.

The actor of every event is ``system:kubernetes-bridge``; the bridge connects to
PostgreSQL with the claims API's role.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection
from typing import Any, Final

from events.actors import Actor
from events.catalog import Event
from events.envelopes import Envelope
from events.model import ResourceClaim
from events.state import ClaimKey, ClusterState
from services.claims.kubeobjects import device_statuses
from services.claims.mirroring import (
    BRIDGE_SERVICE,
    RELEASABLE,
    SOURCE,
    Mirror,
    decide_claim,
    decide_deleted,
)
from services.claims.views import ClaimsTouched
from services.runtime.ground.context import ServiceContext
from services.runtime.ground.errors import ConflictError
from services.runtime.ground.metrics import KUBERNETES_MIRROR, KUBERNETES_STATUS_WRITES
from services.runtime.kube.client import KubeApi
from services.runtime.kube.errors import Conflict, KubeApiError, NotFound, Retryable
from services.runtime.kube.informer import Checkpoint, ClaimInformer
from services.runtime.store.appends import Batch, Metadata
from services.runtime.store.livestate import HEAD
from services.runtime.store.logandfold import LogAndFold

__all__ = ["Bridge"]

log = logging.getLogger("dracap.bridge")

_ATTEMPTS: Final = 5  #: decisions of one claim that may lose their race before it is left


class Bridge:
    """Mirrors a cluster's ResourceClaims into the log and writes their status back."""

    def __init__(
        self,
        context: ServiceContext[LogAndFold],
        api: KubeApi,
        *,
        drivers: Collection[str],
    ) -> None:
        self.store = context.stores.store
        live = self.live = context.stores.live
        self.api = api
        self.drivers = frozenset(drivers)
        self.now = context.clock.utcnow  #: the devices' status times
        self.actor = str(Actor.system(BRIDGE_SERVICE))
        self._dirty: set[ClaimKey] = set()
        self._wake = asyncio.Event()
        self.informer: ClaimInformer | None = None
        #: set once the start-up list has been mirrored (tests and readiness wait on it)
        self.synced = asyncio.Event()
        self._touched = ClaimsTouched(live.state)
        live.subscribe(self._on_fold)

    def _on_fold(self, envelope: Envelope) -> None:
        keys = self._touched(self.live.state, envelope)
        if keys:
            self._dirty.update(keys)
            self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Mirror and write status until ``stop`` is set."""
        tasks = [
            asyncio.create_task(self.live.run(stop)),
            asyncio.create_task(self._mirror_loop()),
            asyncio.create_task(self._status_loop()),
        ]
        stopping = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopping and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            stop.set()
            for task in [stopping, *tasks]:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # -- mirror ------------------------------------------------------------------------------

    async def _mirror_loop(self) -> None:
        while True:
            try:
                await self.resync()
                assert self.informer is not None
                async for event in self.informer:
                    claim = event.claim
                    if event.type == "DELETED":
                        meta = claim.metadata
                        await self.deleted(meta.namespace or "", meta.name, meta.uid)
                    else:
                        await self.mirror(claim)
            except Retryable as exc:
                log.warning("the API server is unreachable (%s); listing again", exc)
                await asyncio.sleep(1.0)

    async def resync(self) -> None:
        """List every claim, mirror each, release what was deleted; watch from there."""
        listed = await self.api.list_claims()
        present: set[ClaimKey] = set()
        for claim in listed.items:
            present.add((claim.metadata.namespace or "", claim.metadata.name))
            await self.mirror(claim)
        state = await self.live.fresh(HEAD)
        gone = [
            (key, claim.uid)
            for key, claim in state.claims.items()
            if claim.source == SOURCE and claim.phase in RELEASABLE and key not in present
        ]
        for (namespace, name), uid in gone:
            await self.deleted(namespace, name, uid)
        self.informer = ClaimInformer(
            self.api,
            resume=Checkpoint(resource_version=listed.resource_version, claims=listed.items),
        )
        self.synced.set()

    async def mirror(self, claim: ResourceClaim) -> Mirror:
        """Record what the log needs for ``claim`` as the API server has it."""
        return await self.decide(lambda state: decide_claim(state, claim, self.drivers))

    async def deleted(self, namespace: str, name: str, uid: str | None) -> Mirror:
        """Record what the log needs now that ``namespace/name`` was deleted."""
        return await self.decide(lambda state: decide_deleted(state, namespace, name, uid))

    async def decide(self, decide: Callable[[ClusterState], Mirror]) -> Mirror:
        """Decide on a frozen state and append at the claim stream's version read with it."""
        decision = Mirror(claim_stream="")
        for _ in range(_ATTEMPTS):
            await self.live.fresh(HEAD)
            async with self.live.frozen() as state:
                decision = decide(state)
                if not decision.events:
                    return decision
                version = await self.live.stream_version(decision.claim_stream)
            try:
                await self.store.append_many(
                    _batches(decision, version), Metadata(actor=self.actor)
                )
            except ConflictError:
                continue  # somebody wrote first (or a guard saw more): decide again
            KUBERNETES_MIRROR.labels(outcome=decision.outcome).inc()
            if decision.outcome != "unchanged":
                log.info("%s: %s", decision.claim_stream, decision.outcome)
            return decision
        log.error("%s kept changing while mirrored; left for the next event", decision.claim_stream)
        return decision

    # -- status ------------------------------------------------------------------------------

    async def _status_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            keys, self._dirty = sorted(self._dirty), set()
            for key in keys:
                try:
                    await self.write_status(key)
                except Conflict:
                    self._dirty.add(key)  # the claim moved: read it again
                    self._wake.set()
                except KubeApiError as exc:
                    log.warning("status of %s/%s not written: %s", key[0], key[1], exc)

    async def write_status(self, key: ClaimKey) -> bool:
        """Write ``status.devices`` of claim ``key`` if it differs; whether it wrote."""
        claim = self.live.state.claims.get(key)
        if claim is None or claim.source != SOURCE:
            return False
        try:
            current = await self.api.get_claim(*key)
        except NotFound:
            return False
        status = current.status
        if current.metadata.uid != claim.uid:
            return False
        if status is None or status.allocation is None:
            await self.mirror(current)  # released and deallocated: the record ends
            return False
        existing: list[dict[str, Any]] = [dict(e) for e in status.devices or ()]
        ours = [e for e in existing if e.get("driver") in self.drivers]
        others = [e for e in existing if e.get("driver") not in self.drivers]
        state = self.live.state
        wanted = device_statuses(state, claim, self.now(), drivers=self.drivers, previous=ours)
        if wanted == ours:
            return False
        await self.api.patch_claim_status(
            key[0],
            key[1],
            {"devices": others + wanted},
            resource_version=current.metadata.resource_version,
        )
        KUBERNETES_STATUS_WRITES.inc()
        return True


def _batches(decision: Mirror, version: int) -> list[Batch]:
    """The decision's events by stream, in order; the claim stream last, at ``version``.

    A stream appears once in an append, so the device streams' reservations go first
    (as in a reservation round) and the claim's own events, its binding included, after.
    """
    by_stream: dict[str, list[Event]] = {}
    for stream, event in decision.events:
        by_stream.setdefault(stream, []).append(event)
    claim_events = by_stream.pop(decision.claim_stream, [])
    batches = [Batch(stream, None, events) for stream, events in by_stream.items()]
    if claim_events:
        batches.append(Batch(decision.claim_stream, version, claim_events))
    return batches
