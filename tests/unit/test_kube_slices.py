"""sync_slices against the stand-in: creates, replaces, deletes; bumps the pool generation
only when something changed; re-reads after a 409."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from events.model import ResourceSlice
from services.runtime.kube import KubeApi, Listed, sync_slices
from tests.fixtures.k8s_objects import DRIVER, slices
from tests.fixtures.k8s_standin import StandinApiServer


@pytest.fixture
async def server() -> AsyncIterator[StandinApiServer]:
    async with StandinApiServer() as standin:
        yield standin


def pools(listed: Listed[ResourceSlice]) -> dict[str, tuple[int, int, int]]:
    """name -> (generation, resourceSliceCount, devices)"""
    return {
        s.metadata.name: (
            s.spec.pool.generation,
            s.spec.pool.resource_slice_count,
            len(s.spec.devices or []),
        )
        for s in listed.items
    }


async def test_sync_is_idempotent_and_bumps_generations(server: StandinApiServer) -> None:
    async with KubeApi.from_url(server.url) as api:
        other = slices("node-b", [10])  # another node's pool stays as it is
        await sync_slices(api, DRIVER, "node-b", other)

        first = await sync_slices(api, DRIVER, "node-a", slices("node-a", [80, 80, 40]))
        assert first.generation == 1 and len(first.created) == 2
        mine = await api.list_slices(driver=DRIVER, node="node-a")
        assert pools(mine) == {
            f"node-a-{DRIVER}-0": (1, 2, 2),
            f"node-a-{DRIVER}-1": (1, 2, 1),
        }

        version = server.store.rv
        again = await sync_slices(api, DRIVER, "node-a", slices("node-a", [80, 80, 40]))
        assert not again.changed and again.generation == 1
        assert server.store.rv == version  # nothing written

        grown = await sync_slices(api, DRIVER, "node-a", slices("node-a", [80, 80, 48]))
        assert grown.generation == 2 and len(grown.replaced) == 2
        assert {g for g, _, _ in pools(await api.list_slices(node="node-a")).values()} == {2}

        shrunk = await sync_slices(api, DRIVER, "node-a", slices("node-a", [80]))
        assert shrunk.generation == 3 and shrunk.deleted == (f"node-a-{DRIVER}-1",)
        assert pools(await api.list_slices(driver=DRIVER, node="node-a")) == {
            f"node-a-{DRIVER}-0": (3, 1, 1)
        }

        gone = await sync_slices(api, DRIVER, "node-a", [], pool="node-a-gpu")
        assert gone.deleted == (f"node-a-{DRIVER}-0",)
        assert (await api.list_slices(node="node-a")).items == []
        assert pools(await api.list_slices(node="node-b")) == {f"node-b-{DRIVER}-0": (1, 1, 1)}


class _RacingApi(KubeApi):
    """A client after whose first slice list another writer changes a slice on the server."""

    server: StandinApiServer
    slice_name: str
    lists = 0

    async def list_slices(self, **kwargs: str | None) -> Listed[ResourceSlice]:
        listed = await super().list_slices(**kwargs)
        self.lists += 1
        if self.lists == 1:
            store = self.server.store
            current = store.get("resourceslices", "", self.slice_name)
            meta = {**current["metadata"], "labels": {"touched": "yes"}}
            store.replace("resourceslices", "", self.slice_name, {**current, "metadata": meta})
        return listed


async def test_a_conflict_reads_again(server: StandinApiServer) -> None:
    async with KubeApi.from_url(server.url) as api:
        await sync_slices(api, DRIVER, "node-a", slices("node-a", [80]))
    async with _RacingApi.from_url(server.url) as racing:
        racing.server = server
        racing.slice_name = f"node-a-{DRIVER}-0"
        synced = await sync_slices(racing, DRIVER, "node-a", slices("node-a", [40]))
        assert racing.lists == 2  # the first attempt's replace got 409
        assert synced.generation == 2
        [only] = (await racing.list_slices(node="node-a")).items
        assert only.metadata.labels is None  # the desired labels won
        assert only.spec.devices and str(only.spec.devices[0].capacity["memory"].value) == "40Gi"


async def test_desired_slices_must_be_the_nodes(server: StandinApiServer) -> None:
    async with KubeApi.from_url(server.url) as api:
        with pytest.raises(ValueError, match=r"spec\.nodeName must be node-a"):
            await sync_slices(api, DRIVER, "node-a", slices("node-b", [10]))
        with pytest.raises(ValueError, match=r"spec\.driver must be"):
            await sync_slices(api, "net.dracap.io", "node-a", slices("node-a", [10]))
    assert server.store.rv == 0
