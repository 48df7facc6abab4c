"""Liveness: every admitted claim is decided, however the claims come.

The stress test applies claims in small bursts, round after round, on a small inventory
(two 40Gi GPUs of one node), and deletes earlier claims in the same bursts: claims wait
for capacity, capacity comes back, waiting claims are planned again. A burst is one to
:data:`CHAINS` chains of requests at once, each chain one request after the other (as a
tenant's script applies several claims), so requests meet the planner at every stage of
its rounds. After each burst the test waits, with a bound, until the round has
*settled*:

* every claim applied so far is decided: ``ready`` (its agent applied the limit),
  ``unschedulable`` with a reason, or ``rejected``; once deleted, ``withdrawn`` or
  ``released``. None is left ``admitted``, ``allocated`` or ``releasing``;
* no ``unschedulable`` claim fits the capacity that is free now: a release nobody
  planned after is as much a lost wake-up as an admission nobody planned.

A round that does not settle within :data:`SETTLE_S` is a *stall*: the test records the
claims still waiting and the log's head and goes on (the next burst's planning round
decides every pending claim, so a stall heals then); it fails at the end with every
stall. Healthy rounds settle in well under a second, busy cores included.

Each stack runs as one is run for real: ``up`` is ``dracap up`` in-process
(:class:`services.stack.Stack`: one live state, tailed, shared by every service, two
reservation workers); ``serve`` gives each service a store and a tailed live state of its
own, as ``dracap serve`` runs them in separate containers (two workers); ``bare`` is one
worker on a live state nobody tails, as the integration tests' stacks run it (reads only
when asked). Each runs with and without a busy CPU (a busy-loop process on each core).

``DRACAP_LIVENESS_ROUNDS`` sets the rounds per run (hundreds for a long run);
``DRACAP_LIVENESS_SEED`` the random seed (printed with each run's summary).

Found this way, both fixed (``docs/services.md``, "Every admitted claim is decided"):
a consumer that kept its planner lock told the next group's handler a position behind
that group's messages, so the round decided without them and they were acknowledged
without effect (claims left ``admitted``, releases nobody re-planned); and a round whose
append failed still counted its unschedulable claims as tried, so they waited for the
next release although capacity was free. ``test_a_conflicted_round_tried_nothing`` below
and ``test_bus.py``'s ``test_a_kept_lock_tells_a_handler_at_least_its_messages_positions``
show each on its own, every time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import yaml

from events.envelopes import Envelope
from events.quantities import Quantity
from events.state import ClaimKey, ClusterState
from events.subjects import BusNames
from services.claims.api import ClaimsApi
from services.enforcement.agent import Agent
from services.enforcement.enforcers import NoneEnforcer
from services.reservation.service import Plan, ReservationService
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.bus.jetstream import connect_bus, ensure_stream
from services.runtime.delivery.handlers import Handled, HandlerContext
from services.runtime.delivery.relaying import Relay
from services.runtime.ground.errors import ConflictError
from services.runtime.ground.settings import Settings
from services.runtime.store.appends import Cause
from services.runtime.store.eventstore import Connection, EventStore
from services.runtime.store.livestate import HEAD, LiveState
from services.stack import Stack, load_inventory, read_inventory
from tests.fixtures.contexts import folded, handed
from tests.fixtures.links import InProcessServices
from tests.integration.cluster import namespace_and_class, node_slice
from tests.integration.waiting import state_reaches

NODE: Final = "node-a"
CLASS: Final = "gpu.dracap.io"
NAMESPACES: Final = ("tenant-a", "tenant-b")
#: amounts asked for: multiples of the step; above 40Gi no device grants (rejected)
SIZES: Final = ("5Gi", "10Gi", "10Gi", "20Gi", "20Gi", "30Gi", "45Gi")
BURST: Final = 5  #: claims applied per round (and some deleted beside them)
CHAINS: Final = 3  #: at most this many requests in flight at once
WAITING: Final = 6  #: unschedulable claims kept waiting (the oldest beyond are deleted)
ROUNDS: Final = int(os.environ.get("DRACAP_LIVENESS_ROUNDS", "60"))
SEED: Final = int(os.environ.get("DRACAP_LIVENESS_SEED", str(random.randrange(2**32))))
#: how long a round may take to settle: only bounds a failure (well below the 30 s ack
#: wait, so a stall that a redelivery would end still counts)
SETTLE_S: Final = 10.0
_DECIDED: Final = frozenset({"ready", "unschedulable", "rejected"})
_GONE: Final = frozenset({"withdrawn", "released"})

POLICY: Final = {"default": "5Gi", "validRange": {"min": "5Gi", "step": "5Gi", "max": "40Gi"}}
INVENTORY: Final[list[dict[str, Any]]] = [
    *namespace_and_class(NAMESPACES[0], CLASS),
    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACES[1]}},
    node_slice(
        NODE,
        CLASS,
        [
            {
                "name": f"gpu-{i}",
                "allowMultipleAllocations": True,
                "capacity": {"memory": {"value": "40Gi", "requestPolicy": POLICY}},
            }
            for i in range(2)
        ],
    ),
]


def claim_doc(namespace: str, name: str, memory: str) -> bytes:
    request = {"deviceClassName": CLASS, "capacity": {"requests": {"memory": memory}}}
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
    }
    return yaml.safe_dump(doc).encode()


# --- the stacks ------------------------------------------------------------------------------


class Services(InProcessServices):
    """Each service with a store and a live state of its own (``serve``, ``bare``)."""

    def __init__(
        self,
        settings: Settings,
        nc: Any,
        js: Any,
        names: BusNames,
        *,
        tail: bool,
        worker: type[ReservationService],
    ) -> None:
        super().__init__(settings)
        self.nc, self.js, self.names = nc, js, names
        self.tail = tail
        self.worker = worker
        self.workers: list[ReservationService] = []

    async def _live(self) -> LiveState:
        live = LiveState(await self._store())
        await live.fresh(HEAD)
        if self.tail:
            self._run(live.run)
        return live

    async def start(self) -> None:
        self._run(Relay(handed(await self._store(), self.names, js=self.js)).run)
        api_live = LiveState(await self._store())
        api = ClaimsApi(folded(api_live.store, self.names, self.nc, live=api_live), tail=True)
        await api.start()
        self._run(api.run)
        for i in range(2 if self.tail else 1):
            live = await self._live()
            self.workers.append(
                self.worker(folded(live.store, self.names, js=self.js, live=live), worker=i)
            )
            self._run(self.workers[-1].run)
        await self._enforcement(self.nc, self.js, self.names)
        agent = Agent(handed(None, self.names, self.nc), node=NODE, enforcer=NoneEnforcer())
        self._run(agent.run)

    async def close(self) -> None:
        await self._stop_services()


class Running(msgspec.Struct):
    api: ApiClient
    workers: list[ReservationService]  #: (``serve`` and ``bare`` only)


@contextlib.asynccontextmanager
async def running(
    kind: str,
    settings: Settings,
    nats_url: str,
    tmp: Path,
    worker: type[ReservationService] = ReservationService,
) -> AsyncIterator[Running]:
    """The stack ``kind`` (``up``, ``serve``, ``bare``) with the inventory loaded."""
    names = BusNames(f"t{uuid.uuid4().hex[:10]}")
    path = tmp / "inventory.yaml"
    path.write_text(yaml.safe_dump_all(INVENTORY))
    manifests = read_inventory([str(path)])
    settings = msgspec.structs.replace(settings, nats_url=nats_url)
    nc, js = await connect_bus(nats_url)
    try:
        if kind == "up":
            async with (
                Stack.running(settings, names, nodes=[NODE], workers=2),
                ApiClient.connect(nats_url, names.prefix) as api,
            ):
                await load_inventory(api, manifests)
                yield Running(api, [])
        else:
            await ensure_stream(js, names)
            services = Services(settings, nc, js, names, tail=kind == "serve", worker=worker)
            try:
                await services.start()
                async with ApiClient.connect(nats_url, names.prefix) as api:
                    await load_inventory(api, manifests)
                    yield Running(api, services.workers)
            finally:
                await services.close()
    finally:
        with contextlib.suppress(Exception):
            await js.delete_stream(names.stream)
        await nc.close()


@contextlib.contextmanager
def busy_cores(busy: bool) -> Iterator[None]:
    """A busy-loop process on each core while the block runs (when ``busy``)."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range((os.cpu_count() or 1) if busy else 0)
    ]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(10)


@contextlib.asynccontextmanager
async def watching(settings: Settings) -> AsyncIterator[LiveState]:
    """The test's own view of the log."""
    view = LiveState(await EventStore.open(settings))
    try:
        yield view
    finally:
        await view.store.close()


# --- what "settled" means ---------------------------------------------------------------------


def _fits_now(state: ClusterState, memory: str) -> bool:
    """Whether a claim of ``memory`` fits on a device as the state stands."""
    asked = Quantity.parse(memory).nanos
    return any(dev.free("memory").nanos >= asked for dev in state.devices.values())


def unsettled(
    state: ClusterState, asked: dict[ClaimKey, str], deleted: set[ClaimKey]
) -> dict[str, str]:
    """The claims not decided yet (``namespace/name`` -> why); empty once settled."""
    out: dict[str, str] = {}
    for key, memory in asked.items():
        claim = state.claims.get(key)
        phase = claim.phase if claim is not None else "missing"
        name = "/".join(key)
        if key in deleted:
            if phase not in _GONE:
                out[name] = f"deleted but {phase}"
        elif claim is None or phase not in _DECIDED:
            out[name] = phase
        elif phase == "unschedulable" and not claim.reason:
            out[name] = "unschedulable without a reason"
        elif phase == "unschedulable" and _fits_now(state, memory):
            out[name] = f"unschedulable although {memory} fits now"
    return out


# --- the stress test --------------------------------------------------------------------------


async def _in_turn(steps: list[Callable[[], Awaitable[None]]]) -> None:
    for step in steps:
        await step()


def _doomed(
    state: ClusterState, asked: dict[ClaimKey, str], deleted: set[ClaimKey], rng: random.Random
) -> list[ClaimKey]:
    """Claims to delete in the next burst: about half of those holding capacity (so
    capacity comes back every round) and the oldest waiting beyond :data:`WAITING`."""
    present = [k for k in asked if k not in deleted and k in state.claims]
    holding = [k for k in present if state.claims[k].phase == "ready"]
    waiting = [k for k in present if state.claims[k].phase == "unschedulable"]
    return [k for k in holding if rng.random() < 0.5] + waiting[: max(0, len(waiting) - WAITING)]


async def stress(api: ApiClient, view: LiveState, rounds: int, seed: int) -> list[str]:
    """Run ``rounds`` rounds; the stalls seen (empty: every round settled in time)."""
    rng = random.Random(seed)
    asked: dict[ClaimKey, str] = {}
    deleted: set[ClaimKey] = set()
    stalls: list[str] = []
    slowest = 0.0

    async def apply(key: ClaimKey, memory: str) -> None:
        with contextlib.suppress(ApiError):  # rejected: decided too
            await api.claims(key[0], "apply", claim_doc(*key, memory))

    async def delete(key: ClaimKey) -> None:
        await api.claims(key[0], "delete", {"name": key[1]})

    for r in range(rounds):
        new = [(rng.choice(NAMESPACES), f"c{r}-{i}") for i in range(BURST)]
        for key in new:
            asked[key] = rng.choice(SIZES)
        doomed = _doomed(await view.fresh(HEAD), asked, deleted, rng)
        deleted.update(doomed)
        # each chain deletes first, then applies (a release plans a round of its own)
        steps = [functools.partial(delete, key) for key in doomed]
        steps += [functools.partial(apply, key, asked[key]) for key in new]
        chains = rng.randint(1, CHAINS)
        started = time.monotonic()
        await asyncio.gather(*(_in_turn(steps[c::chains]) for c in range(chains)))
        while True:
            state = await view.fresh(HEAD)
            waiting = unsettled(state, asked, deleted)
            took = time.monotonic() - started
            if not waiting or took > SETTLE_S:
                break
            await view.store.wait_for_new(state.position, 0.1)
        slowest = max(slowest, took)
        if waiting:
            stalls.append(
                f"round {r}: not settled in {SETTLE_S:.0f}s at log position "
                f"{state.position}: {json.dumps(waiting, sort_keys=True)}"
            )
    phases = collections.Counter(
        c.phase for k, c in (await view.fresh(HEAD)).claims.items() if k in asked
    )
    print(
        f"{rounds} rounds, seed {seed}: {len(stalls)} stalls, slowest settled round "
        f"{slowest:.2f}s, {len(asked)} claims: {dict(sorted(phases.items()))}",
        file=sys.stderr,
    )
    return stalls


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
@pytest.mark.parametrize("kind", ["up", "serve", "bare"])
async def test_every_admitted_claim_is_decided(
    kind: str, busy: bool, settings: Settings, nats_url: str, tmp_path: Path
) -> None:
    async with watching(settings) as view, running(kind, settings, nats_url, tmp_path) as stack:
        with busy_cores(busy):
            stalls = await stress(stack.api, view, ROUNDS, SEED)
    assert not stalls, "\n".join(stalls)


# --- one interleaving, every time ------------------------------------------------------------


class DeletedWhilePlanned(ReservationService):
    """A worker whose round that places :attr:`victim` sees its tenant delete it before
    the round's append: the append conflicts and the messages are handled again."""

    victim: ClaimKey | None = None
    api: ApiClient | None = None

    async def plan(
        self, causes: Callable[[ClaimKey], Cause], connection: Connection | None = None
    ) -> Plan:
        plan = await super().plan(causes, connection)
        victim = self.victim
        if victim is not None and victim in plan.allocated and self.api is not None:
            self.victim = None
            await self.api.claims(victim[0], "delete", {"name": victim[1]})
        return plan


class ConflictsOnMessages(ReservationService):
    """A worker whose every message-driven round conflicts while :attr:`failing`: its
    planning trigger is dead-lettered (a planning round without a message still works)."""

    failing = True

    async def handle(self, ctx: HandlerContext, envs: list[Envelope]) -> Handled:
        if self.failing:
            raise ConflictError("a concurrent append got there first (forced)")
        return await super().handle(ctx, envs)


def _phases(**want: str) -> Callable[[ClusterState], bool]:
    def check(state: ClusterState) -> bool:
        return all(
            (c := state.claim(NAMESPACES[0], name)) is not None and c.phase == phase
            for name, phase in want.items()
        )

    return check


async def test_a_conflicted_round_tried_nothing(
    settings: Settings, nats_url: str, tmp_path: Path
) -> None:
    """Capacity comes back; the round gives it to the first waiting claim (``a``) and finds
    the next (``y``) unschedulable; ``a``'s tenant deletes it before the append, which
    conflicts. Handled again, the round must give ``y`` the capacity: its failed try did
    not count (else ``y`` waits for the next release with the device free)."""
    ns = NAMESPACES[0]
    async with (
        watching(settings) as view,
        running("bare", settings, nats_url, tmp_path, DeletedWhilePlanned) as stack,
    ):
        api, [worker] = stack.api, stack.workers
        assert isinstance(worker, DeletedWhilePlanned)
        for name in ("h0", "h1"):  # both GPUs full
            await api.claims(ns, "apply", claim_doc(ns, name, "40Gi"))
        await state_reaches(view, _phases(h0="ready", h1="ready"), 30)
        for name, memory in (("a", "40Gi"), ("y", "20Gi")):  # a waits first, then y
            await api.claims(ns, "apply", claim_doc(ns, name, memory))
        await state_reaches(view, _phases(a="unschedulable", y="unschedulable"), 30)
        worker.victim, worker.api = (ns, "a"), api
        await api.claims(ns, "delete", {"name": "h0"})
        await state_reaches(view, _phases(h0="released", a="withdrawn", y="ready"), 30)
        assert worker.victim is None  # the round that placed a did meet the delete


async def test_a_dead_lettered_trigger_leaves_no_claim_waiting(
    settings: Settings, nats_url: str, tmp_path: Path
) -> None:
    """The admission of ``c`` conflicts on every delivery until the consumer dead-letters
    it; the worker then plans without the message, and ``c`` is placed (before, it stayed
    ``admitted`` until some other message started a round)."""
    ns = NAMESPACES[0]
    async with (
        watching(settings) as view,
        running("bare", settings, nats_url, tmp_path, ConflictsOnMessages) as stack,
    ):
        await stack.api.claims(ns, "apply", claim_doc(ns, "c", "10Gi"))
        await state_reaches(view, _dead_lettered, 60)
        await state_reaches(view, _phases(c="ready"), 30)


def _dead_lettered(state: ClusterState) -> bool:
    return state.dead_letters > 0
