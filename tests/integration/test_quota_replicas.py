"""A namespace's quota is exact across claims API replicas (docs/tenancy.md).

Two replicas as deployed — each its own :class:`~services.claims.api.ClaimsApi`, event
store (connection pool), tailed live state and NATS connection, on one log — take a burst
of applies of distinct claims in a namespace with a small quota, half at each. Each
replica decides on its own fold, which learns of the other's admissions only once it
has tailed them; the database, where both replicas meet, must still let exactly the
quota in. The log is the judge: the ``ClaimAdmitted`` events of the namespace are
counted there, and every other apply is refused with the quota's reason (and records
nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import msgspec
import pytest
import yaml

from events.actors import Actor
from events.catalog import ClaimAdmitted
from events.envelopes import claim_stream
from events.subjects import BusNames
from services.claims.api import ClaimsApi
from services.runtime.bus.jetstream import connect_bus, ensure_stream
from services.runtime.ground.errors import ConflictError
from services.runtime.ground.settings import Settings
from services.runtime.store.appends import AdmissionPremise, Batch, Metadata
from services.runtime.store.eventstore import EventStore
from tests.fixtures.contexts import folded

NAMESPACE = "tenant-q"
QUOTA = 5
PER_REPLICA = 30
CLASS = "any.dracap.io"
CLASSES = f"""
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {{name: {CLASS}}}
spec: {{}}
"""


def claim_doc(name: str) -> bytes:
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": CLASS}}]}},
    }
    return yaml.safe_dump(doc).encode()


class Replicas(msgspec.Struct, kw_only=True):
    apis: list[ClaimsApi]
    names: BusNames
    nc: Any


@pytest.fixture
async def replicas(settings: Settings, nats_url: str) -> AsyncIterator[Replicas]:
    settings = msgspec.structs.replace(settings, pool_max_size=4)
    names = BusNames(f"t{uuid.uuid4().hex[:12]}")
    admin_nc, js = await connect_bus(nats_url)
    await ensure_stream(js, names)
    stop = asyncio.Event()
    stores: list[EventStore] = []
    connections = [admin_nc]
    tasks: list[asyncio.Task[None]] = []
    apis: list[ClaimsApi] = []
    try:
        for _ in range(2):
            store = await EventStore.open(settings)
            stores.append(store)
            nc, _js = await connect_bus(nats_url)
            connections.append(nc)
            api = ClaimsApi(folded(store, names, nc), tail=True)
            await api.start()
            tasks.append(asyncio.create_task(api.run(stop)))
            apis.append(api)
        yield Replicas(apis=apis, names=names, nc=admin_nc)
    finally:
        stop.set()
        done, pending = await asyncio.wait(tasks, timeout=15) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        for store in stores:
            await store.close()
        with contextlib.suppress(Exception):
            await js.delete_stream(names.stream)
        for nc in connections:
            await nc.close()
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]


async def admin(replicas: Replicas, op: str, payload: bytes | dict[str, Any]) -> None:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    reply = json.loads((await replicas.nc.request(replicas.names.admin(op), body, timeout=30)).data)
    assert reply["ok"], reply


async def test_the_quota_is_exact_across_two_replicas(
    replicas: Replicas, db: asyncpg.Connection
) -> None:
    await admin(replicas, "deviceclasses.apply", CLASSES.encode())
    access = {"namespace": NAMESPACE, "classes": ["*"], "max_claims": QUOTA}
    await admin(replicas, "namespaces.access", access)
    for api in replicas.apis:  # both know the namespace's quota before the burst
        await api.live.fresh(await db.fetchval("SELECT position FROM event_log_head"))

    applies = [
        (api, f"c{r}-{i}") for i in range(PER_REPLICA) for r, api in enumerate(replicas.apis)
    ]
    replies = await asyncio.gather(
        *(api.apply(NAMESPACE, claim_doc(name)) for api, name in applies)
    )
    decoded = [json.loads(reply) for reply in replies]
    admitted = {name for (_, name), r in zip(applies, decoded, strict=True) if r["ok"]}
    refused = [r["error"] for r in decoded if not r["ok"]]

    logged = await db.fetch(
        "SELECT payload->>'name' AS name FROM events WHERE type = 'claims.admitted' "
        "AND namespace = $1",
        NAMESPACE,
    )
    assert len(logged) == QUOTA, f"{len(logged)} admitted in the log, quota {QUOTA}"
    assert {row["name"] for row in logged} == admitted
    assert len(refused) == len(applies) - QUOTA, decoded
    for error in refused:
        assert (error["code"], error["field"]) == ("rejected", "metadata.namespace"), error
        assert f"at most {QUOTA} live claims (quota dracap.io/max-claims)" in error["message"]
    submitted = await db.fetchval(
        "SELECT count(*) FROM events WHERE type = 'claims.submitted' AND namespace = $1",
        NAMESPACE,
    )
    assert submitted == QUOTA  # a refusal by quota records nothing


# --- the premise, where the replicas meet ---------------------------------------------------


def admission(name: str, premise: AdmissionPremise | None, namespace: str = NAMESPACE) -> Batch:
    event = ClaimAdmitted(namespace=namespace, name=name)
    return Batch(claim_stream(namespace, name), 0, [event], premise=premise)


async def test_an_admission_whose_premise_broke_is_a_conflict_and_writes_nothing(
    settings: Settings,
) -> None:
    """The claims login's store: an admission of the namespace after the premise's
    position that the premise does not count fails the append; one it counts, one at or
    before its position, and another namespace's, do not."""
    claims = msgspec.structs.replace(settings, app_role="dracap_claims")
    tenant = Metadata(actor=str(Actor.anonymous(NAMESPACE)))
    async with await EventStore.open(claims) as store:
        [a] = await store.append_many([admission("a", None)], tenant)
        with pytest.raises(ConflictError) as lost:
            await store.append_many([admission("b", AdmissionPremise(NAMESPACE, 0))], tenant)
        assert lost.value.stream == f"admissions:{NAMESPACE}"
        assert "'a'" in str(lost.value) and await store.head() == a.position

        [b] = await store.append_many(
            [admission("b", AdmissionPremise(NAMESPACE, 0, ("a",)))], tenant
        )
        other = Metadata(actor=str(Actor.anonymous("tenant-other")))
        await store.append_many([admission("x", None, "tenant-other")], other)
        await store.append_many([admission("c", AdmissionPremise(NAMESPACE, b.position))], tenant)


async def test_only_the_claims_login_checks_a_premise(database_url: str) -> None:
    for role, allowed in (("dracap_claims", True), ("dracap_reservation", False)):
        connection = await asyncpg.connect(database_url, server_settings={"role": role})
        try:
            check = connection.fetchval("SELECT dracap_expect_admissions(0, '[]')")
            if allowed:
                assert await check is True
            else:
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await check
        finally:
            await connection.close()
