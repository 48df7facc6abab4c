"""An in-process stack on an inventory of the test's own, with a client of its API."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import yaml

from events.subjects import BusNames
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.endpoints import ServerUnavailable
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.settings import Settings
from services.stack import InventoryManifests, Stack, load_inventory, read_inventory
from tests.fixtures.logins import login_users


class Cluster(msgspec.Struct, kw_only=True):
    api: ApiClient
    flags: list[str]  #: what the CLI needs to reach it
    stack: Any = None  #: the in-process :class:`~services.stack.Stack` (its store, live state)


def namespace_and_class(namespace: str, driver: str) -> list[dict[str, Any]]:
    """A Namespace and a DeviceClass, named like its driver, selecting that driver."""
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": driver},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
        },
    ]


def node_slice(node: str, driver: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    """A ResourceSlice of ``node``'s ``devices`` (pool ``<node>-gpus``) for ``driver``."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpus"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": f"{node}-gpus", "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


#: how long the API may take to answer through every server of a NATS cluster
ANSWERED_WITHIN_S = 30.0


async def _load_once_answered(api: ApiClient, manifests: InventoryManifests) -> None:
    """``load_inventory`` once the API answers. On a cluster of nats-servers a service's
    subscription reaches the other servers over their routes a moment after it is made:
    a request through another server meanwhile finds nobody to answer (CI, 2026-12-05:
    "no dracap API answers on ….admin.devices.list" as the stack had just started)."""
    deadline = time.monotonic() + ANSWERED_WITHIN_S
    while True:
        try:
            await load_inventory(api, manifests)
            return
        except ServerUnavailable:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def running_cluster(
    settings: Settings,
    nats_url: str,
    directory: Path,
    inventory: Sequence[dict[str, Any]],
    *,
    admin_url: str | None = None,
) -> AsyncIterator[Cluster]:
    """The stack with ``inventory`` loaded (one agent per node); its stream goes after.

    ``admin_url`` (the server's administrator): every service connects as a login user of
    its own (:func:`tests.fixtures.logins.login_users`) and may append only its own job
    (migration 0011), as under ``dracap up``; else all of them as the app role."""
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:10]}")
    path = directory / "inventory.yaml"
    path.write_text(yaml.safe_dump_all(inventory))
    manifests = read_inventory([str(path)])
    settings = msgspec.structs.replace(settings, nats_url=nats_url)
    async with contextlib.AsyncExitStack() as logins:
        if admin_url is not None:
            urls = await logins.enter_async_context(login_users(settings.database_url, admin_url))
            settings = msgspec.structs.replace(settings, database_urls=urls)
        async with (
            Stack.running(settings, names, nodes=manifests.nodes, workers=1) as stack,
            ApiClient.connect(nats_url, names.prefix) as api,
        ):
            await _load_once_answered(api, manifests)
            flags = ["--nats", nats_url, "--prefix", names.prefix]
            yield Cluster(api=api, flags=flags, stack=stack)
    await _delete_stream(nats_url, names.stream)


async def _delete_stream(nats_url: str, stream: str) -> None:
    """Delete ``stream``, asking again while the servers do not answer in time: right
    after a test killed or hung a clustered server, the meta group may still be electing
    or catching up (CI, 2026-12-06: the delete's 5 s ran out in a teardown). A delete
    asked again after one that was not answered may find the stream gone: done."""
    deadline = time.monotonic() + ANSWERED_WITHIN_S
    nc, js = await connect_bus(nats_url)
    try:
        while True:
            try:
                await js.delete_stream(stream)
                return
            except nats.js.errors.NotFoundError:
                return
            except (
                nats.errors.TimeoutError,
                nats.errors.NoRespondersError,
                nats.js.errors.ServiceUnavailableError,
            ):
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.2)
    finally:
        await nc.close()
