"""The node agent as a kubelet DRA plugin: prepare and unprepare claims mirrored from Kubernetes.

:class:`KubeletDriver` is the handler :class:`~services.runtime.kubeletplugin.KubeletPlugin`
calls (the gRPC transport lives there). In Kubernetes mode kube-scheduler allocates, the
bridge mirrors the allocation into the log (:mod:`services.claims.mirroring`), and the
agent applies a claim's limits only when the kubelet prepares it:

``NodePrepareResources`` (per claim, in request order)
    1. read the ResourceClaim from the API server and check that its UID is the one the
       kubelet named (a claim deleted and recreated under the same name is another claim);
    2. wait, at most ``mirror_wait_s``, until the log holds the claim mirrored with that
       UID (:func:`~services.enforcement.preparing.judge_prepare`); the kubelet retries a
       prepare that fails, so a slow bridge costs a retry, never a wrong answer;
    3. apply the limits of this node's shares through the agent
       (:meth:`~services.enforcement.agent.Agent.carry_out` on a view of that claim: the
       same enforcers, checkpoint, lease and last-line-of-defense check as for a standalone
       claim), which reports ``LimitApplied``: the claim is Ready in the log only now;
    4. write each share's CDI spec (an MPS GPU share's is written by its enforcer; every
       other share gets a ``dracap.io/share`` spec) and answer the CDI names, one device per
       share. A claim dracap refused, or whose limit failed, gets an error with the reason.

    Preparing again answers the same devices and changes nothing: the shares are already
    ``ready`` in the log.

``NodeUnprepareResources``
    the limits of this node's shares of the claim are removed and their capacity given
    back (``LimitRemoved`` + ``CapacityReleased``, actor: this agent under its lease;
    :func:`~services.enforcement.decisions.unprepare_claim`): the claim is ``released``
    in the log. A claim the log does not hold as mirrored with that UID succeeds with
    nothing done. (The later deallocation in Kubernetes then finds nothing to release.)

Nothing of a prepared claim lives only in this process: the log says which shares a claim
has and whether their limits are applied, and the agent's checkpoint says which limits are
in force, so an agent restarted between prepare and unprepare answers both the same way.

Every look at the log is a view the agent asks the enforcement service for (the claim,
or the node's devices): the agent holds no fold. Waiting for the bridge to mirror a claim
asks again every half second, at most ``mirror_wait_s``.

Device health: :meth:`KubeletDriver.health_updates` streams this node's devices of the
driver, healthy or not as the agent last reported them (``DeviceHealthChanged``): again
after each of the agent's reports that changes them, and every ``health_interval_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Final, Protocol

from events.catalog import (
    DeviceHealthChanged,
    Event,
    ResourceSlicePublished,
    ResourceSliceWithdrawn,
)
from events.fold import ClusterState, ShareState
from events.model import ResourceClaim
from services.enforcement.agent import Agent
from services.enforcement.cdi import KIND as GPU_KIND
from services.enforcement.cdi import SHARE_KIND, CdiSpecs, build_share_spec
from services.enforcement.decisions import Task, enforce_claim, unprepare_claim
from services.enforcement.preparing import PrepareVerdict, judge_prepare
from services.enforcement.protocol import ViewAsk
from services.runtime.errors import ConflictError
from services.runtime.kube.errors import KubeApiError, NotFound
from services.runtime.kubeletplugin import (
    ClaimRef,
    DeviceHealthReport,
    Health,
    PreparedDevice,
    PrepareResult,
)

__all__ = ["ClaimReader", "KubeletDriver", "PrepareError"]

log = logging.getLogger("dracap.kubelet")

#: How long a prepare waits for the bridge to mirror the claim before it fails (retried).
MIRROR_WAIT_S: Final = 20.0
#: How often a prepare waiting for the bridge asks again.
_MIRROR_POLL_S: Final = 0.5
#: Reports of the agent that change what the health stream shows.
_DEVICES_CHANGED: Final = (DeviceHealthChanged, ResourceSlicePublished, ResourceSliceWithdrawn)
_ATTEMPTS: Final = 5  #: tries of an append that lost a race (a delete, a fence)


class PrepareError(Exception):
    """A claim cannot be prepared (the message is the kubelet's error for it)."""


class ClaimReader(Protocol):
    """Where the driver reads a ResourceClaim: the API server (``KubeApi``)."""

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim: ...


class KubeletDriver:
    """The :class:`~services.runtime.kubeletplugin.DriverHandler` of a node agent."""

    def __init__(
        self,
        agent: Agent,
        claims: ClaimReader,
        *,
        drivers: Collection[str],
        cdi_dir: CdiSpecs | None = None,
        mirror_wait_s: float = MIRROR_WAIT_S,
        health_interval_s: float = 60.0,
    ) -> None:
        self.agent = agent
        self.claims = claims
        self.drivers = frozenset(drivers)
        base = cdi_dir or CdiSpecs()
        self.gpu_specs = CdiSpecs(base.spec_dir, kind=GPU_KIND)
        self.share_specs = CdiSpecs(base.spec_dir, kind=SHARE_KIND)
        self.mirror_wait_s = mirror_wait_s
        self.health_interval_s = health_interval_s
        self._changed = asyncio.Event()
        agent.on_report(self._on_report)

    def _on_report(self, events: Sequence[Event]) -> None:
        if any(isinstance(e, _DEVICES_CHANGED) for e in events):
            self._changed.set()

    async def _claim(self, key: tuple[str, str]) -> ClusterState:
        """A view of one claim (and its shares on this node)."""
        return (await self.agent.view(ViewAsk(claims=[key]))).state()

    # -- prepare ---------------------------------------------------------------------------

    async def prepare(self, claims: list[ClaimRef]) -> dict[str, PrepareResult]:
        """``NodePrepareResources``: one result per claim UID (see the module docstring)."""
        out: dict[str, PrepareResult] = {}
        for ref in claims:
            try:
                out[ref.uid] = PrepareResult(devices=tuple(await self._prepare(ref)))
            except PrepareError as exc:
                log.warning("prepare of %s/%s refused: %s", ref.namespace, ref.name, exc)
                out[ref.uid] = PrepareResult(error=str(exc))
        return out

    async def _prepare(self, ref: ClaimRef) -> list[PreparedDevice]:
        await self._check_uid(ref)
        deadline = time.monotonic() + self.mirror_wait_s
        for _ in range(_ATTEMPTS):
            verdict = await self._verdict(ref, deadline)
            if verdict.verdict == "prepared":
                return self._devices(await self._claim((ref.namespace, ref.name)), verdict)
            if verdict.verdict != "enforce":
                raise PrepareError(verdict.reason)
            try:
                await self.agent.carry_out(
                    ViewAsk(claims=[(ref.namespace, ref.name)]), self._enforcing(ref)
                )
            except ConflictError:
                continue  # released or fenced meanwhile: look again
        raise PrepareError(f"claim {ref.namespace}/{ref.name} kept changing while prepared")

    def _enforcing(self, ref: ClaimRef) -> Callable[[ClusterState], list[Task]]:
        """What a prepare of ``ref`` asks of the agent, decided on the state it hands in."""
        agent, key = self.agent, (ref.namespace, ref.name)
        return lambda state: _one(enforce_claim(state, agent.node, key, agent.enforcing))

    async def _check_uid(self, ref: ClaimRef) -> None:
        try:
            claim = await self.claims.get_claim(ref.namespace, ref.name)
        except NotFound as exc:
            raise PrepareError(f"ResourceClaim {ref.namespace}/{ref.name} not found") from exc
        except KubeApiError as exc:
            raise PrepareError(
                f"cannot read ResourceClaim {ref.namespace}/{ref.name}: {exc}"
            ) from exc
        if claim.metadata.uid != ref.uid:
            raise PrepareError(
                f"ResourceClaim {ref.namespace}/{ref.name} has uid {claim.metadata.uid}, "
                f"the kubelet asked for {ref.uid}"
            )

    async def _verdict(self, ref: ClaimRef, deadline: float) -> PrepareVerdict:
        """The verdict, waiting until the claim is mirrored or the deadline passes."""
        while True:
            state = await self._claim((ref.namespace, ref.name))
            verdict = judge_prepare(state, self.agent.node, ref.namespace, ref.name, ref.uid)
            left = deadline - time.monotonic()
            if verdict.verdict != "wait" or left <= 0:
                return verdict
            await asyncio.sleep(min(left, _MIRROR_POLL_S))

    def _devices(self, state: ClusterState, verdict: PrepareVerdict) -> list[PreparedDevice]:
        return [self._device(state.shares[sid]) for sid in verdict.share_ids]

    def _device(self, share: ShareState) -> PreparedDevice:
        sid = share.share_id
        if self.gpu_specs.read(sid) is not None:
            name = self.gpu_specs.qualified_name(sid)
        else:
            self.share_specs.write_spec(sid, build_share_spec(sid, share.device))
            name = self.share_specs.qualified_name(sid)
        return PreparedDevice(
            request_names=(share.request,),
            pool_name=share.pool,
            device_name=share.device,
            cdi_device_ids=(name,),
        )

    # -- unprepare -------------------------------------------------------------------------

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str]:
        """``NodeUnprepareResources``: ``""`` per claim UID on success, else the error."""
        out: dict[str, str] = {}
        for ref in claims:
            try:
                await self._unprepare(ref)
                out[ref.uid] = ""
            except (PrepareError, ConflictError) as exc:
                out[ref.uid] = str(exc) or "the claim kept changing; retry"
        return out

    async def _unprepare(self, ref: ClaimRef) -> None:
        node, agent, key = self.agent.node, self.agent, (ref.namespace, ref.name)
        for _ in range(_ATTEMPTS):
            state = await self._claim(key)
            claim = state.claims.get(key)
            if claim is None or claim.source != "kubernetes" or claim.uid != ref.uid:
                return  # not ours, or not known: nothing to undo
            owned = [sid for sid in claim.share_ids if sid in state.shares]
            try:
                await agent.carry_out(
                    ViewAsk(claims=[key]), lambda state: _one(unprepare_claim(state, node, key))
                )
            except ConflictError:
                continue
            for sid in owned:
                self.share_specs.remove(sid)
            return
        raise PrepareError(f"claim {ref.namespace}/{ref.name} kept changing while unprepared")

    # -- health ----------------------------------------------------------------------------

    def health(self, state: ClusterState) -> list[DeviceHealthReport]:
        """This node's devices of the driver, as the agent last reported their health."""
        now = int(time.time())
        return [
            DeviceHealthReport(
                pool_name=dev.pool,
                device_name=dev.name,
                health="unhealthy" if dev.unhealthy else "healthy",
                last_updated_unix=now,
            )
            for (driver, _, _), dev in sorted(state.devices.items())
            if driver in self.drivers and dev.node == self.agent.node and dev.present
        ]

    async def health_updates(self) -> AsyncIterator[list[DeviceHealthReport]]:
        """The complete list at once, then again whenever a device's health changes."""
        last: list[tuple[str, str, Health]] | None = None
        while True:
            self._changed.clear()
            state = (await self.agent.view(ViewAsk(node=True))).state()
            reports = self.health(state)
            now = [(r.pool_name, r.device_name, r.health) for r in reports]
            if now != last:
                last = now
                yield reports
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.health_interval_s)


def _one(task: Task | None) -> list[Task]:
    return [task] if task is not None else []
