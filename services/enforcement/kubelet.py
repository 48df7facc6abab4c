"""The node agent as a kubelet DRA plugin: prepare and unprepare claims mirrored from Kubernetes.

:class:`KubeletDriver` is the handler :class:`~services.runtime.kubeletplugin.KubeletPlugin`
calls (the gRPC transport lives there). In Kubernetes mode kube-scheduler allocates, the
bridge mirrors the allocation into the log (:mod:`services.claims.mirroring`), and the
agent applies a claim's limits only when the kubelet prepares it. The kubelet calls the
plugin outside its own lock: Pods starting together on a node reach it in parallel, and
each call must succeed at the first try.

``NodePrepareResources`` (each claim of the call at once)
    1. read the ResourceClaim from the API server: the UID must be the one the kubelet
       named (a claim deleted and recreated under the same name is another claim), and
       the claim must be allocated with devices of this plugin's drivers — otherwise the
       call is answered at once with the reason (never mirrored, so never worth a wait);
    2. at the same time (the two reads run concurrently; a refusal of step 1 drops this
       one) wait, at most ``mirror_wait_s``, until the log holds the claim mirrored with that
       UID (:func:`~services.enforcement.preparing.judge_prepare`); the agent's messages
       (the bridge's ``AllocationBound`` among them) wake the wait, so it ends as soon as
       the mirror is in; a claim still not mirrored gets an error saying so, and the
       kubelet retries;
    3. join the node's writer (below), which applies the limits of this node's ``bound``
       shares (the same enforcers, checkpoint, lease and last-line-of-defense check as for
       a standalone claim) and reports ``LimitApplied``: the claim is Ready in the log
       only now;
    4. write each share's CDI spec (an MPS GPU share's is written by its enforcer; every
       other share gets a ``dracap.io/share`` spec) and answer the CDI names, one device per
       share. The specs of a round are written all at once, each on a worker thread (the
       write and its fsyncs never hold the event loop). A claim dracap refused, or whose
       limit failed, gets an error with the reason.

    Preparing again answers the same devices and changes nothing: the shares are already
    ``ready`` in the log.

``NodeUnprepareResources``
    the limits of this node's shares of the claim are removed and ``LimitRemoved``
    recorded (:func:`~services.enforcement.decisions.unprepare_claim`): the shares are
    ``bound`` again and the claim ``allocated``, its capacity still held, because
    Kubernetes still allocates it — a claim shared by Pods that come and go on one node
    is prepared again by the next Pod. The capacity comes back when Kubernetes
    deallocates the claim (the bridge mirrors ``ReleaseRequested``). A claim the log
    does not hold as mirrored with that UID succeeds with nothing done.

One writer per node. Every claim of every call joins a queue; one task takes everything
queued as a *round*: one view of the round's claims, every decision on it
(:func:`~services.enforcement.decisions.kubelet_round`: unprepares first, then prepares,
all fitting their devices together with the limits in force), the kernel work, one
report (:meth:`~services.enforcement.agent.Agent.carry_round`). The round holds the
agent's writer (:class:`~services.enforcement.agent.Writer`), which the agent's consumer,
retry sweep, health and use reports and reconcile also hold: the agent's own reports
never race each other for the node stream's version. Only an outside write (a
tenant's delete mirrored, a fence) can make the report conflict; the round's kernel
work is then undone and the round decided again on a fresh view. A claim is in a round
at most once: concurrent calls for one claim share one outcome.

Apply, then record. A limit is applied before ``LimitApplied`` is reported, and
removed before ``LimitRemoved`` is. When the report is refused, or its answer is lost,
the agent looks at the log again before the call answers and makes the kernel say what
the log says (a limit the log does not hold ready is removed, one it still holds ready
is put back). A crash between the kernel and the report is settled by the restarted
agent's reconcile (:mod:`services.enforcement.reconciling`): a ready share without its
limit gets it back, and a limit in force for a Kubernetes claim's share the log holds
only ``bound`` is removed, for the kubelet's retry to apply and record.

Nothing of a prepared claim lives only in this process: the log says which shares a claim
has and whether their limits are applied, and the agent's checkpoint says which limits are
in force, so an agent restarted between prepare and unprepare answers both the same way.

Device health: :meth:`KubeletDriver.health_updates` streams this node's devices of the
driver, healthy or not as the agent last reported them (``DeviceHealthChanged``): again
after each of the agent's reports that changes them, and every ``health_interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Final, Literal, Protocol

from events.catalog import (
    Event,
)
from events.model import ResourceClaim
from events.state import ClusterState, ShareState
from events.transitions import DeviceHealth, SliceChanged, events_meaning
from services.enforcement.agent import Agent, Round
from services.enforcement.cdi import KIND as GPU_KIND
from services.enforcement.cdi import SHARE_KIND, CdiSpecs, build_share_spec
from services.enforcement.decisions import Enforce, Failed, Task, kubelet_round
from services.enforcement.preparing import PrepareVerdict, judge_prepare
from services.enforcement.protocol import ViewAsk
from services.runtime.ground.clock import SYSTEM, Clock
from services.runtime.ground.errors import ConflictError, RetryableError
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
#: The longest a prepare waiting for the bridge goes without looking again (the agent's
#: messages wake it at once; this only bounds a wake-up that never comes).
_MIRROR_LOOK_S: Final = 2.0
#: Reports of the agent that change what the health stream shows: a device's health, or
#: a slice (the devices it lists).
_DEVICES_CHANGED: Final = events_meaning(DeviceHealth, SliceChanged)
_ATTEMPTS: Final = 5  #: rounds tried when an outside write (a delete, a fence) got in first

Kind = Literal["prepare", "unprepare"]
#: One claim's call in the writer's queue: what, and which claim (namespace, name, UID).
_Item = tuple[Kind, str, str, str]


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
        clock: Clock = SYSTEM,
    ) -> None:
        self.agent = agent
        self.claims = claims
        self.drivers = frozenset(drivers)
        base = cdi_dir or CdiSpecs()
        self.gpu_specs = CdiSpecs(base.spec_dir, kind=GPU_KIND)
        self.share_specs = CdiSpecs(base.spec_dir, kind=SHARE_KIND)
        self.mirror_wait_s = mirror_wait_s
        self.health_interval_s = health_interval_s
        self.clock = clock  #: the clock of the waits for the mirror and for health changes
        self._changed = asyncio.Event()
        self._mirrored = asyncio.Event()  #: the agent got a message: a mirror may be in
        #: calls waiting for the next round, and those of the round under way
        self._queued: dict[_Item, asyncio.Future[list[PreparedDevice]]] = {}
        self._running: dict[_Item, asyncio.Future[list[PreparedDevice]]] = {}
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self.rounds = 0  #: rounds the writer carried out (each: one view, one report)
        agent.on_report(self._on_report)
        agent.on_messages(self._on_messages)

    def _on_report(self, events: Sequence[Event]) -> None:
        if any(type(e) in _DEVICES_CHANGED for e in events):
            self._changed.set()

    def _on_messages(self, _events: Sequence[Event]) -> None:
        self._mirrored.set()

    async def _claim(self, key: tuple[str, str]) -> ClusterState:
        """A view of one claim (and its shares on this node)."""
        return (await self.agent.view(ViewAsk(claims=[key]))).state()

    # -- prepare ---------------------------------------------------------------------------

    async def prepare(self, claims: list[ClaimRef]) -> dict[str, PrepareResult]:
        """``NodePrepareResources``: one result per claim UID (see the module docstring)."""
        answers = await asyncio.gather(
            *(self._prepare(ref) for ref in claims), return_exceptions=True
        )
        out: dict[str, PrepareResult] = {}
        for ref, answer in zip(claims, answers, strict=True):
            if isinstance(answer, PrepareError | RetryableError):
                log.warning("prepare of %s/%s refused: %s", ref.namespace, ref.name, answer)
                out[ref.uid] = PrepareResult(error=str(answer))
            elif isinstance(answer, BaseException):
                raise answer
            else:
                out[ref.uid] = PrepareResult(devices=tuple(answer))
        return out

    async def _prepare(self, ref: ClaimRef) -> list[PreparedDevice]:
        verdict, state = await self._read(ref)
        if verdict.verdict == "prepared":  # again: the same devices, nothing to write
            return await self._devices(state, verdict)
        if verdict.verdict == "wait":
            raise PrepareError(
                f"{verdict.reason}; waited {self.mirror_wait_s:g}s for the bridge to mirror "
                "its allocation into dracap's log (the kubelet retries)"
            )
        if verdict.verdict == "refused":
            raise PrepareError(verdict.reason)
        return await self._submit(("prepare", ref.namespace, ref.name, ref.uid))

    async def _read(self, ref: ClaimRef) -> tuple[PrepareVerdict, ClusterState]:
        """The API server's copy and the log's view of the claim, read at once: the view
        (and its wait for the mirror) is dropped as soon as the API server's copy says
        the claim cannot be prepared here."""
        view = asyncio.ensure_future(
            self._verdict(ref, self.clock.monotonic() + self.mirror_wait_s)
        )
        try:
            await self._check_claim(ref)
            return await view
        finally:
            if not view.done():
                view.cancel()
                await asyncio.gather(view, return_exceptions=True)

    async def _check_claim(self, ref: ClaimRef) -> None:
        """The API server's copy: the UID the kubelet named, and an allocation that has
        this driver's devices (else the call is answered at once, with the reason)."""
        where = f"ResourceClaim {ref.namespace}/{ref.name}"
        try:
            claim = await self.claims.get_claim(ref.namespace, ref.name)
        except NotFound as exc:
            raise PrepareError(f"{where} not found") from exc
        except KubeApiError as exc:
            raise PrepareError(f"cannot read {where}: {exc}") from exc
        if claim.metadata.uid != ref.uid:
            raise PrepareError(
                f"{where} has uid {claim.metadata.uid}, the kubelet asked for {ref.uid}"
            )
        allocation = claim.status.allocation if claim.status is not None else None
        if allocation is None:
            raise PrepareError(f"{where} is not allocated (status.allocation is empty)")
        devices = allocation.devices
        results = (devices.results if devices is not None else None) or []
        drivers = sorted({r.driver for r in results})
        if not self.drivers.intersection(drivers):
            raise PrepareError(
                f"{where} is allocated on {', '.join(drivers) or 'no device'}, "
                f"none of them this plugin's ({', '.join(sorted(self.drivers))})"
            )

    async def _verdict(self, ref: ClaimRef, deadline: float) -> tuple[PrepareVerdict, ClusterState]:
        """The verdict and the view it was read on, waiting until the claim is mirrored or
        the deadline passes; the agent's messages (the bridge's binding among them) wake
        the wait."""
        while True:
            self._mirrored.clear()
            state = await self._claim((ref.namespace, ref.name))
            verdict = judge_prepare(state, self.agent.node, ref.namespace, ref.name, ref.uid)
            left = deadline - self.clock.monotonic()
            if verdict.verdict != "wait" or left <= 0:
                return verdict, state
            await self.clock.wait(self._mirrored, min(left, _MIRROR_LOOK_S))

    async def _devices(self, state: ClusterState, verdict: PrepareVerdict) -> list[PreparedDevice]:
        """The prepared devices of one claim, its CDI specs written (on worker threads)."""
        return (await self._devices_of([(state, verdict)]))[0]

    async def _devices_of(
        self, claims: Sequence[tuple[ClusterState, PrepareVerdict]]
    ) -> list[list[PreparedDevice]]:
        """The prepared devices of each claim; every CDI spec of them is written at once,
        each on a worker thread (a write and its fsyncs never hold the event loop)."""
        shares = [[state.shares[sid] for sid in verdict.share_ids] for state, verdict in claims]
        names = await asyncio.gather(
            *(asyncio.to_thread(self._spec, share) for group in shares for share in group)
        )
        it = iter(names)
        return [
            [
                PreparedDevice(
                    request_names=(share.request,),
                    pool_name=share.pool,
                    device_name=share.device,
                    cdi_device_ids=(next(it),),
                )
                for share in group
            ]
            for group in shares
        ]

    def _spec(self, share: ShareState) -> str:
        """The CDI name of the share's device, its spec written where dracap writes it
        (an MPS GPU share's spec is its enforcer's)."""
        sid = share.share_id
        if self.gpu_specs.read(sid) is not None:
            return self.gpu_specs.qualified_name(sid)
        self.share_specs.write_spec(sid, build_share_spec(sid, share.device))
        return self.share_specs.qualified_name(sid)

    # -- unprepare -------------------------------------------------------------------------

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str]:
        """``NodeUnprepareResources``: ``""`` per claim UID on success, else the error."""
        answers = await asyncio.gather(
            *(self._submit(("unprepare", r.namespace, r.name, r.uid)) for r in claims),
            return_exceptions=True,
        )
        out: dict[str, str] = {}
        for ref, answer in zip(claims, answers, strict=True):
            if isinstance(answer, PrepareError | RetryableError):
                out[ref.uid] = str(answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                out[ref.uid] = ""
        return out

    # -- the node's writer -----------------------------------------------------------------

    async def _submit(self, item: _Item) -> list[PreparedDevice]:
        """Queue one claim's call for the writer's next round; the same call already
        queued or under way is joined (concurrent calls of one claim are one)."""
        future = self._queued.get(item) or self._running.get(item)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._queued[item] = future
            self._wake.set()
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())
        return await asyncio.shield(future)

    async def _write(self) -> None:
        """Take everything queued as one round, until nothing is."""
        while self._queued:
            self._running, self._queued = self._queued, {}
            self._wake.clear()
            try:
                answers = await self._round(list(self._running))
            except (ConflictError, RetryableError) as exc:
                failure: Exception = (
                    exc
                    if isinstance(exc, RetryableError)
                    else PrepareError(f"the claim kept changing ({exc}); the kubelet retries")
                )
                answers = {item: failure for item in self._running}
            except Exception as exc:  # a bug: every waiting call hears of it
                log.exception("kubelet round failed")
                answers = {item: PrepareError(f"internal error: {exc}") for item in self._running}
            for item, future in self._running.items():
                if future.done():
                    continue
                answer = answers.get(item, [])
                if isinstance(answer, BaseException):
                    future.set_exception(answer)
                else:
                    future.set_result(answer)
            self._running = {}

    async def _round(self, items: list[_Item]) -> dict[_Item, list[PreparedDevice] | Exception]:
        """One view, every decision on it, the kernel work, one report (see the module)."""
        self.rounds += 1
        node = self.agent.node
        keys = sorted({(namespace, name) for _, namespace, name, _ in items})
        verdicts: dict[_Item, PrepareVerdict | None] = {}  # as the last view had them

        def decide(state: ClusterState) -> list[Task]:
            prepares: list[tuple[str, str]] = []
            unprepares: list[tuple[str, str]] = []
            verdicts.clear()
            for item in items:
                kind, namespace, name, uid = item
                if kind == "prepare":
                    verdict = judge_prepare(state, node, namespace, name, uid)
                    verdicts[item] = verdict
                    if verdict.verdict == "enforce":
                        prepares.append((namespace, name))
                else:
                    claim = state.claims.get((namespace, name))
                    mine = claim is not None and claim.source == "kubernetes"
                    if mine and claim is not None and claim.uid == uid:
                        unprepares.append((namespace, name))
            return kubelet_round(state, node, prepares, unprepares, self.agent.enforcing)

        for _ in range(_ATTEMPTS):
            try:
                done = await self.agent.carry_round(ViewAsk(claims=keys), decide)
            except ConflictError:
                continue  # an outside write (a delete, a fence) got in first: decide again
            return await self._answers(items, verdicts, done)
        raise ConflictError(f"{len(items)} claim(s) changed under {_ATTEMPTS} rounds")

    async def _answers(
        self, items: list[_Item], verdicts: dict[_Item, PrepareVerdict | None], done: Round
    ) -> dict[_Item, list[PreparedDevice] | Exception]:
        """What each call of a round gets back, from the view and the outcomes; the
        unprepared claims' CDI specs are removed, then the prepared ones' written, each
        phase all at once on worker threads."""
        state = done.state
        out: dict[_Item, list[PreparedDevice] | Exception] = {}
        tasks = {t.message: t for t in done.tasks if isinstance(t, Enforce)}
        prepared: list[tuple[_Item, PrepareVerdict]] = []
        gone: list[str] = []
        for item in items:
            kind, namespace, name, _ = item
            where = f"{namespace}/{name}"
            verdict = verdicts.get(item)
            if kind == "unprepare":
                claim = state.claims.get((namespace, name))
                gone += claim.share_ids if claim is not None else ()
                out[item] = []
                continue
            assert verdict is not None
            task = tasks.get(f"prepare:{where}")
            failure: Exception | None = None
            if verdict.verdict == "enforce" and task is not None:
                failure = self._failure(task, done)
            elif verdict.verdict != "prepared" and verdict.verdict != "enforce":
                # refused, retrying, or not mirrored any more
                failure = PrepareError(verdict.reason or f"claim {where} is {verdict.verdict}")
            if failure is not None:
                out[item] = failure
            else:
                prepared.append((item, verdict))
        # the removals first, as the round's decisions took the limits down first: a claim
        # unprepared and prepared again in one round keeps its spec
        await asyncio.gather(*(asyncio.to_thread(self.share_specs.remove, sid) for sid in gone))
        devices = await self._devices_of([(state, verdict) for _, verdict in prepared])
        for (item, _), answer in zip(prepared, devices, strict=True):
            out[item] = answer
        return out

    @staticmethod
    def _failure(task: Enforce, done: Round) -> Exception | None:
        """Why a prepare's limits are not all applied (``None``: they are)."""
        for refusal in task.refused:
            return PrepareError(refusal.reason)
        for limit in task.limits:
            outcome = done.outcomes.get(limit.share_id)
            if isinstance(outcome, Failed):
                again = " (retried)" if outcome.retryable else ""
                return PrepareError(
                    f"limit of share {limit.share_id} failed{again}: {outcome.reason}"
                )
        return None

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
            await self.clock.wait(self._changed, self.health_interval_s)
