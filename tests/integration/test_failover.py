"""A PostgreSQL failover under load: nothing acknowledged is lost (issue 29, item 3).

The in-process stack runs against a primary with a synchronous standby
(:func:`tests.fixtures.replicas.postgres_pair`), given the multi-host URL with
``target_session_attrs=read-write``. A burst of claims is applied through the claims
API; in its middle the primary is killed (SIGKILL to every process of it) and the
standby promoted, as a failover manager would. Then:

* every claim of the burst is acknowledged: the appends in flight when the primary
  died are retried through the failover (``DRACAP_FAILOVER_TIMEOUT_S``), a retried one
  at most once (by its event ids), so no client sees the failover;
* every acknowledged claim is in the promoted server's log, admitted exactly once;
* the services go on: every claim is reserved and made ready, and a claim applied after
  the failover is too; ``replay verify`` finds the promoted log sound;
* the expected failures leave no traceback in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
import yaml

from events import catalog as c
from migrations import runner as migrating
from services.replay.verify import summary, verify
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.ground.settings import Settings
from tests.fixtures.polling import until
from tests.fixtures.replicas import PostgresPair, postgres_binaries, postgres_pair
from tests.integration.cluster import Cluster, running_cluster
from tests.integration.test_policy import NAMESPACE, view_when

DRIVER = "gpu.dracap.io"
BURST = 40
CONCURRENCY = 8
#: claims acknowledged before the primary is killed
KILL_AFTER = 10
#: how long the "failover manager" takes to promote the standby after the kill
PROMOTE_AFTER_S = 1.0

pytestmark = pytest.mark.skipif(
    postgres_binaries() is None, reason="no PostgreSQL server binaries (initdb, pg_basebackup)"
)

INVENTORY: list[dict[str, Any]] = [
    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
    {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    },
    {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpus"},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-a",
            "pool": {"name": "node-a-gpus", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "allowMultipleAllocations": True,
                    "capacity": {"memory": {"value": "80Gi"}},
                }
            ],
        },
    },
]


def _claim(name: str) -> bytes:
    exactly = {"deviceClassName": DRIVER, "capacity": {"requests": {"memory": "1Gi"}}}
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }
    return yaml.safe_dump(doc).encode()


@pytest.fixture
def pair() -> Iterator[PostgresPair]:
    with postgres_pair() as started:
        yield started


@pytest.fixture
async def ha_settings(pair: PostgresPair) -> Settings:
    """Settings on the pair's multi-host URL, its database migrated."""
    pair.database = "dracap"
    admin = await asyncpg.connect(pair.server_url(pair.primary, "postgres"))
    try:
        await admin.execute("CREATE DATABASE dracap")
    finally:
        await admin.close()
    settings = Settings(
        database_url=pair.url,
        app_role="dracap_app",
        statement_timeout_ms=10_000,
        pool_min_size=1,
        pool_max_size=8,
    )
    await migrating.upgrade_async(settings)
    return settings


@pytest.fixture
async def cluster(ha_settings: Settings, nats_url: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    async with running_cluster(ha_settings, nats_url, tmp_path, INVENTORY) as running:
        running.api.timeout = 60.0  # a request may wait out the failover
        yield running


async def _burst(api: ApiClient, names: list[str], acked: list[str], errors: list[str]) -> None:
    """Apply every claim of ``names``, ``CONCURRENCY`` at a time; note each outcome."""
    slots = asyncio.Semaphore(CONCURRENCY)

    async def one(name: str) -> None:
        async with slots:
            try:
                await api.claims(NAMESPACE, "apply", _claim(name))
            except Exception as exc:
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
            else:
                acked.append(name)

    await asyncio.gather(*(one(name) for name in names))


async def _admitted_on(url: str) -> dict[str, int]:
    """Claim name -> how many ClaimAdmitted events the log at ``url`` holds for it."""
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch(
            "SELECT stream FROM events WHERE type = $1", c._TAG_BY_CLASS[c.ClaimAdmitted]
        )
    finally:
        await connection.close()
    counts: dict[str, int] = {}
    for row in rows:
        name = row["stream"].rsplit("/", 1)[-1]
        counts[name] = counts.get(name, 0) + 1
    return counts


@contextlib.contextmanager
def _tracebacks(caplog: pytest.LogCaptureFixture) -> Iterator[list[str]]:
    found: list[str] = []
    caplog.set_level(logging.INFO)
    yield found
    found += [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.exc_info is not None and r.levelno >= logging.WARNING
    ]


async def test_a_failover_mid_burst_loses_no_acknowledged_claim(
    cluster: Cluster,
    pair: PostgresPair,
    ha_settings: Settings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = cluster.api
    names = [f"burst-{i:02d}-{uuid.uuid4().hex[:6]}" for i in range(BURST)]
    acked: list[str] = []
    errors: list[str] = []
    with _tracebacks(caplog) as tracebacks:
        burst = asyncio.create_task(_burst(api, names, acked, errors))
        await until(lambda: len(acked) >= KILL_AFTER or burst.done(), 30, "the first acks")
        assert not burst.done(), "the burst ended before the failover"
        await asyncio.to_thread(pair.kill_primary)
        killed_with = len(acked)
        await asyncio.sleep(PROMOTE_AFTER_S)
        await asyncio.to_thread(pair.promote)
        await asyncio.wait_for(burst, 90)

        assert not errors, f"the failover reached a client: {errors}"
        assert killed_with < BURST, "every claim was acknowledged before the kill"
        assert sorted(acked) == sorted(names)
        promoted = pair.server_url(pair.standby, "dracap")
        admitted = await _admitted_on(promoted)
        assert {n: admitted.get(n, 0) for n in acked} == dict.fromkeys(acked, 1), (
            "every acknowledged claim is in the promoted server's log, once"
        )

        after = f"after-{uuid.uuid4().hex[:6]}"
        await api.claims(NAMESPACE, "apply", _claim(after))
        for name in [*names, after]:
            await view_when(api, name, lambda v: bool(v.get("ready")), within=60)
    assert not tracebacks, "\n".join(tracebacks)
    report = await verify(msgspec.structs.replace(ha_settings, database_url=promoted))
    assert report.ok, summary(report)


@pytest.fixture
async def short_deadline(
    ha_settings: Settings, nats_url: str, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """The stack with a 2 s failover deadline."""
    settings = msgspec.structs.replace(ha_settings, failover_timeout_s=2.0)
    async with running_cluster(settings, nats_url, tmp_path, INVENTORY) as running:
        yield running


async def test_a_failover_past_the_deadline_is_a_refusal_to_retry(
    short_deadline: Cluster, pair: PostgresPair, caplog: pytest.LogCaptureFixture
) -> None:
    api = short_deadline.api
    api.timeout = 60.0
    await api.claims(NAMESPACE, "apply", _claim("before"))
    with _tracebacks(caplog) as tracebacks:
        await asyncio.to_thread(pair.kill_primary)
        with pytest.raises(ApiError) as refused:
            await api.claims(NAMESPACE, "apply", _claim("during"))
        assert refused.value.code == "unavailable", refused.value
        await asyncio.to_thread(pair.promote)
        await api.claims(NAMESPACE, "apply", _claim("during"))  # asked again: served
        await view_when(api, "during", lambda v: bool(v.get("ready")), within=60)
    assert not tracebacks, "\n".join(tracebacks)
