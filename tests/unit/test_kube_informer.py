"""ClaimInformer against the stand-in: list, watch, resume, 410 without missed or doubled events.

The consumer pulls events one at a time. While it does not pull, the informer's generator
is suspended, so "the watch is down while objects change" is made exactly: once the
consumer holds a watched (not listed) event, the watch is open; cut (or expire) it, change
objects through the store, compact the history, then pull again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from events import model
from events.model import JSON
from services.runtime.kube import Checkpoint, ClaimEvent, ClaimInformer, KubeApi
from tests.fixtures.k8s_objects import allocation, claim_body, slices
from tests.fixtures.k8s_standin import StandinApiServer, StatusError

NS = "team"


def seen(event: ClaimEvent) -> tuple[str, str, bool]:
    return (event.type, event.claim.metadata.name, event.synthesized)


async def take(events: AsyncIterator[ClaimEvent], count: int) -> list[ClaimEvent]:
    return [await anext(events) for _ in range(count)]


def create(server: StandinApiServer, name: str) -> None:
    server.store.create("resourceclaims", NS, claim_body(NS, name))


def allocate(server: StandinApiServer, name: str, device: str) -> None:
    current = server.store.get("resourceclaims", NS, name)
    server.store.replace(
        "resourceclaims", NS, name, {**current, "status": allocation(device)}, status=True
    )


def delete(server: StandinApiServer, name: str) -> None:
    server.store.delete("resourceclaims", NS, name)


async def open_watch(
    server: StandinApiServer, events: AsyncIterator[ClaimEvent], name: str = "a"
) -> None:
    """Change a claim (allocate ``name``, or create it when new) and take that watched
    event: the informer's watch is then open (and suspended until the next pull)."""
    try:
        server.store.get("resourceclaims", NS, name)
    except StatusError:
        create(server, name)
    else:
        allocate(server, name, "gpu-0")
    assert not (await anext(events)).synthesized
    await server.wait_for_watches(1)


def server_claims(server: StandinApiServer) -> dict[tuple[str, str], str]:
    items, _ = server.store.list("resourceclaims")
    return {
        (o["metadata"]["namespace"], o["metadata"]["name"]): o["metadata"]["resourceVersion"]
        for o in items
    }


def informer_claims(informer: ClaimInformer) -> dict[tuple[str, str], str]:
    return {key: c.metadata.resource_version or "" for key, c in informer.cache.items()}


@pytest.fixture
async def server() -> AsyncIterator[StandinApiServer]:
    async with StandinApiServer() as standin:
        yield standin


async def test_list_then_watch(server: StandinApiServer) -> None:
    create(server, "a")
    create(server, "b")
    async with KubeApi.from_url(server.url) as api:
        informer = ClaimInformer(api)
        events = aiter(informer)
        first = await take(events, 2)
        assert [seen(e) for e in first] == [("ADDED", "a", True), ("ADDED", "b", True)]
        allocate(server, "a", "gpu-0")
        create(server, "c")
        delete(server, "b")
        live = await take(events, 3)
        assert [seen(e) for e in live] == [
            ("MODIFIED", "a", False),
            ("ADDED", "c", False),
            ("DELETED", "b", False),
        ]
        assert live[0].claim.status is not None and live[0].raw["status"] == allocation("gpu-0")
        assert informer_claims(informer) == server_claims(server)
        assert informer.resource_version == str(server.store.rv)
        await events.aclose()


async def test_bookmarks_move_the_version(server: StandinApiServer) -> None:
    create(server, "a")
    async with KubeApi.from_url(server.url) as api:
        informer = ClaimInformer(api)
        events = aiter(informer)
        await take(events, 1)
        await open_watch(server, events)
        server.store.create("resourceslices", "", _slice_body())  # only the version moves
        assert server.send_bookmarks() == 1
        # Without the bookmark the informer would resume below the compaction and list
        # again; with it, it resumes at the bookmark and watches b's creation.
        server.compact()
        server.drop_watches()
        create(server, "b")
        assert [seen(e) for e in await take(events, 1)] == [("ADDED", "b", False)]
        await events.aclose()
    assert informer.lists == 1


async def test_resume_after_a_dropped_connection(server: StandinApiServer) -> None:
    create(server, "a")
    async with KubeApi.from_url(server.url) as api:
        informer = ClaimInformer(api)
        events = aiter(informer)
        await take(events, 1)
        await open_watch(server, events)
        assert server.drop_watches() == 1
        allocate(server, "a", "gpu-1")
        create(server, "b")
        delete(server, "a")
        after = await take(events, 3)
        assert [seen(e) for e in after] == [
            ("MODIFIED", "a", False),
            ("ADDED", "b", False),
            ("DELETED", "a", False),
        ]
        assert after[0].raw["status"] == allocation("gpu-1")
        create(server, "c")
        assert [seen(e) for e in await take(events, 1)] == [("ADDED", "c", False)]
        await events.aclose()
    assert informer.lists == 1  # resumed from the last version; never listed again
    assert informer.reconnects >= 1
    assert informer_claims(informer) == server_claims(server)


@pytest.mark.parametrize("how", ["drop", "expire", "http-410"])
async def test_gone_relists_without_missed_or_doubled_events(how: str) -> None:
    async with StandinApiServer(gone_as_http=how == "http-410") as server:
        for name in ("a", "b", "d", "e"):
            create(server, name)
        async with KubeApi.from_url(server.url) as api:
            informer = ClaimInformer(api)
            events = aiter(informer)
            await take(events, 4)
            await open_watch(server, events, "x")
            if how == "expire":
                assert server.expire_watches() == 1
            else:
                assert server.drop_watches() == 1
            # while the watch is down: change a twice, delete b, create c, replace d
            # by a new claim of the same name, leave e alone
            old_d = server.store.get("resourceclaims", NS, "d")["metadata"]["uid"]
            allocate(server, "a", "gpu-0")
            allocate(server, "a", "gpu-1")
            delete(server, "b")
            create(server, "c")
            delete(server, "d")
            create(server, "d")
            server.compact()
            missed = await take(events, 5)
            assert [seen(e) for e in missed] == [
                ("DELETED", "b", True),
                ("MODIFIED", "a", True),
                ("ADDED", "c", True),
                ("DELETED", "d", True),
                ("ADDED", "d", True),
            ]
            assert missed[1].raw["status"] == allocation("gpu-1")
            assert missed[3].claim.metadata.uid == old_d != missed[4].claim.metadata.uid
            assert informer.lists == 2
            assert informer_claims(informer) == server_claims(server)
            # nothing doubled: the next event is the next change
            delete(server, "e")
            assert [seen(e) for e in await take(events, 1)] == [("DELETED", "e", False)]
            await events.aclose()


async def test_resume_from_a_checkpoint(server: StandinApiServer) -> None:
    create(server, "a")
    create(server, "b")
    async with KubeApi.from_url(server.url) as api:
        first = ClaimInformer(api)
        events = aiter(first)
        await take(events, 2)
        allocate(server, "a", "gpu-0")
        await take(events, 1)
        checkpoint = first.checkpoint()
        await events.aclose()

        delete(server, "b")
        create(server, "c")
        second = ClaimInformer(api, resume=checkpoint)
        events = aiter(second)
        assert [seen(e) for e in await take(events, 2)] == [
            ("DELETED", "b", False),
            ("ADDED", "c", False),
        ]
        assert second.lists == 0
        await events.aclose()

        # the same checkpoint after the history is gone: the relist diffs against it
        server.compact()
        third = ClaimInformer(api, resume=checkpoint)
        events = aiter(third)
        assert [seen(e) for e in await take(events, 2)] == [
            ("DELETED", "b", True),
            ("ADDED", "c", True),
        ]
        assert third.lists == 1
        assert informer_claims(third) == server_claims(server)
        await events.aclose()


async def test_events_already_seen_are_dropped(server: StandinApiServer) -> None:
    create(server, "a")
    start = str(server.store.rv)
    allocate(server, "a", "gpu-0")
    create(server, "b")
    async with KubeApi.from_url(server.url) as api:
        listed = await api.list_claims()
        # A checkpoint holding a claim newer than its version (taken in the middle of a
        # relist): the watch from that version replays a's change, which it already has.
        holds_a = [c for c in listed.items if c.metadata.name == "a"]
        resumed = ClaimInformer(api, resume=Checkpoint(resource_version=start, claims=holds_a))
        events = aiter(resumed)
        assert [seen(e) for e in await take(events, 1)] == [("ADDED", "b", False)]
        await events.aclose()


def _slice_body() -> JSON:
    return model.to_builtins(slices("node-a", [80])[0])
