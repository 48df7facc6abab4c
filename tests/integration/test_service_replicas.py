"""Two replicas of the N-active services, each its own process (issue 29, item 1).

``dracap serve`` / ``dracap reclaim`` / ``dracap audit serve`` / ``dracap usage serve``
started twice each, as a deployment at two replicas runs them — each process with its
own kind's database login (``dracap db logins``) — against the real PostgreSQL and
nats-server; the log is the judge.

* **Reservation**: two workers take waves of claims until both have allocated some
  (fair progress: neither starves), then one burst larger than the devices: no device
  is ever over its capacity in the log's fold, and ``replay verify`` is clean.
* **Enforcement, reclamation, audit and billing**: claims go apply -> Ready -> delete ->
  released through two replicas of each; every effect is in the log once (one limit
  applied and one release per share), the audit's and billing's tables equal their
  recomputation from the log (``audit verify``, ``usage verify``: a batch applied twice
  would differ), and ``replay verify`` is clean.
"""

from __future__ import annotations

import asyncio
import collections
import re
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from services.audit import verifying as audit_verifying
from services.billing import verifying as billing_verifying
from services.replay.verify import summary, verify
from services.runtime.bus.apiclient import ApiClient
from services.runtime.ground.settings import Settings
from services.runtime.ops.embedded import free_port
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import HEAD, LiveState
from tests.integration.test_db_logins import _logins
from tests.integration.test_db_logins import prefix as login_prefix  # noqa: F401 (a fixture)
from tests.integration.test_serve import NAMESPACE, Processes, _admin, _claim
from tests.integration.test_serve import _inventory as _serve_inventory

DEVICES = 8
DEVICE_GI = 40
WAVE = 6
MAX_WAVES = 25
ENDS = ("reservation.allocation_bound", "reservation.claim_unschedulable")


class Deployed(Processes):
    """The processes as deployed: each with its own kind's database login (``dracap db
    logins`` wrote them into the data directory, where each finds its own), no other
    database URL, no shared role."""

    def __init__(self, settings: Settings, nats_url: str, prefix: str, tmp: Path) -> None:
        super().__init__(settings, nats_url, prefix, tmp)
        self.env = {k: v for k, v in self.without_database().items() if k != "DRACAP_APP_ROLE"}

    def argv(self, *words: str, database: bool = True, nats: bool = True) -> list[str]:
        return super().argv(*words, database=False, nats=nats)


@pytest.fixture
async def logins(
    database_url: str,
    tmp_path: Path,
    login_prefix: str,  # noqa: F811 (test_db_logins' fixture: it drops the logins afterwards)
) -> None:
    """Each service kind's login in ``tmp_path / "d"``."""
    done = await asyncio.to_thread(_logins, tmp_path / "d", database_url, login_prefix)
    assert done.returncode == 0, done.stderr


async def _inventory(api: ApiClient, devices: int) -> None:
    device_class, rslice = _serve_inventory(devices, f"{DEVICE_GI}Gi")
    await _admin(api, "deviceclasses.apply", device_class)
    await api.admin("slices.apply", rslice)
    await api.admin("namespaces.access", {"namespace": NAMESPACE, "classes": ["*"]})


def _counter(port: int, name: str, labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def _allocated(ports: list[int], count: int) -> list[float]:
    """Each worker's ``dracap_claims_total{outcome="allocated"}``, once they add up to
    ``count`` (a worker counts a round after its commit)."""
    async with asyncio.timeout(60):
        while True:
            counts = [
                await asyncio.to_thread(_counter, p, "dracap_claims_total", 'outcome="allocated"')
                for p in ports
            ]
            assert sum(counts) <= count, f"more allocations counted than claims: {counts}"
            if sum(counts) == count:
                return counts
            await asyncio.sleep(0.05)


async def _apply(api: ApiClient, names: list[str], memory: str) -> None:
    replies = await asyncio.gather(
        *(api.claims(NAMESPACE, "apply", _claim(name, memory)) for name in names)
    )
    assert all(reply.get("ok", True) for reply in replies), replies


async def _decided(db: asyncpg.Connection, count: int, procs: Processes) -> None:
    """Until ``count`` claims have been allocated or found unschedulable."""
    query = "SELECT count(DISTINCT payload->>'name') FROM events WHERE type = ANY($1)"
    try:
        async with asyncio.timeout(90):
            while await db.fetchval(query, list(ENDS)) < count:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"claims not decided:\n{procs.logs()}") from None


async def _fold(settings: Settings) -> Any:
    async with await EventStore.open(settings) as store:
        return await LiveState(store).fresh(HEAD)


def _within_capacity(state: Any) -> None:
    assert state.devices
    for key, device in state.devices.items():
        assert device.consumed_nanos["memory"] <= device.total["memory"].nanos, key


async def test_two_reservation_processes_share_the_work_and_never_oversubscribe(
    settings: Settings, nats_url: str, tmp_path: Path, db: asyncpg.Connection, logins: None
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    procs = Deployed(settings, nats_url, prefix, tmp_path)
    ports = [free_port(), free_port()]
    await procs.start("relay", procs.argv("serve", "relay"))
    await procs.start("claims", procs.argv("serve", "claims", "--insecure"))
    for i, port in enumerate(ports):
        argv = procs.argv("serve", "reservation", "--metrics-port", str(port))
        await procs.start(f"reservation-{i}", argv)
    try:
        async with ApiClient.connect(nats_url, prefix) as api:
            await _inventory(api, DEVICES)
            applied = 0
            for wave in range(MAX_WAVES):  # until both have allocated (fair progress)
                names = [f"w{wave}-{i}" for i in range(WAVE)]
                await _apply(api, names, "1Gi")
                applied += len(names)
                await _decided(db, applied, procs)
                counts = await _allocated(ports, applied)
                if min(counts) > 0:
                    break
            assert min(counts) > 0, f"a reservation worker never allocated: {counts}"

            burst = [f"b-{i}" for i in range(DEVICES * DEVICE_GI // 4)]  # more than fits
            await _apply(api, burst, "4Gi")
            await _decided(db, applied + len(burst), procs)
    finally:
        codes = await procs.stop()
    assert all(code == 0 for code in codes.values()), (codes, procs.logs())
    state = await _fold(settings)
    _within_capacity(state)
    bound = collections.Counter(
        row[0]
        for row in await db.fetch(
            "SELECT payload->>'name' FROM events WHERE type = 'reservation.allocation_bound'"
        )
    )
    assert set(bound.values()) == {1}, "a claim allocated twice"
    unschedulable = await db.fetchval(
        "SELECT count(DISTINCT payload->>'name') FROM events "
        "WHERE type = 'reservation.claim_unschedulable'"
    )
    assert unschedulable > 0, "the burst did not contend"
    report = await verify(settings)
    assert report.ok, summary(report)


CLAIMS = 12


async def _phases(api: ApiClient, names: list[str], want: str, procs: Processes) -> None:
    try:
        async with asyncio.timeout(120):
            for name in names:
                while True:
                    view = (await api.claims(NAMESPACE, "get", {"name": name}))["claim"]
                    if view["phase"] == want:
                        break
                    await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"claims never {want}:\n{procs.logs()}") from None


async def test_two_replicas_of_each_service_have_each_effect_once(
    settings: Settings, nats_url: str, tmp_path: Path, db: asyncpg.Connection, logins: None
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    procs = Deployed(settings, nats_url, prefix, tmp_path)
    for i in range(2):
        await procs.start(f"relay-{i}", procs.argv("serve", "relay"))
        await procs.start(f"claims-{i}", procs.argv("serve", "claims", "--insecure"))
        await procs.start(f"reservation-{i}", procs.argv("serve", "reservation"))
        enforcement = procs.argv("serve", "enforcement", "--insecure")
        await procs.start(f"enforcement-{i}", enforcement)
        reclaim = procs.argv("reclaim", "--poll", "0.2", nats=False)
        await procs.start(f"reclaim-{i}", reclaim)
        for ledger in ("audit", "usage"):
            await procs.start(f"{ledger}-{i}", procs.argv(ledger, "serve"))
    agent = procs.argv(
        "agent", "--node", "node-a", "--checkpoint", "none", "--metrics-port", "0", database=False
    )
    await procs.start("agent", agent)
    names = [f"c-{i}" for i in range(CLAIMS)]
    try:
        async with ApiClient.connect(nats_url, prefix) as api:
            await _inventory(api, 2)
            await _apply(api, names, "5Gi")
            await _phases(api, names, "ready", procs)
            await asyncio.gather(
                *(api.claims(NAMESPACE, "delete", {"name": name}) for name in names)
            )
            await _phases(api, names, "released", procs)
        await _ledgers_caught_up(db, procs)
    finally:
        codes = await procs.stop()
    assert all(code == 0 for code in codes.values()), (codes, procs.logs())

    async def by_share(tag: str) -> collections.Counter[str]:
        rows = await db.fetch("SELECT payload->>'share_id' FROM events WHERE type = $1", tag)
        return collections.Counter(row[0] for row in rows)

    reserved = await by_share("reservation.capacity_reserved")
    assert len(reserved) == CLAIMS and set(reserved.values()) == {1}
    assert await by_share("enforcement.limit_applied") == reserved, "a limit applied twice"
    assert await by_share("reclamation.capacity_released") == reserved, "released twice"
    async with db.transaction(isolation="repeatable_read", readonly=True):
        assert await audit_verifying.verify(db) == []
        assert await billing_verifying.verify(db) == []
    report = await verify(settings)
    assert report.ok, summary(report)


async def _ledgers_caught_up(db: asyncpg.Connection, procs: Processes) -> None:
    """Until the audit and billing positions reach the log's head."""
    query = (
        "SELECT count(*) FROM ledger_positions, event_log_head h "
        "WHERE ledger_positions.position >= h.position"
    )
    try:
        async with asyncio.timeout(60):
            while await db.fetchval(query) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"the ledgers lag:\n{procs.logs()}") from None
