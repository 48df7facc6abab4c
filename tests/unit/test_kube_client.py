"""KubeApi against the stand-in API server: reads, watches, status writes, typed errors."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import msgspec
import pytest

from events.model import ResourceClaimStatus
from services.runtime.ground import errors as runtime_errors
from services.runtime.kube import (
    AlreadyExists,
    Bookmark,
    Conflict,
    Gone,
    Invalid,
    KubeApi,
    NotFound,
    Permanent,
    Retryable,
    WatchEvent,
)
from tests.fixtures.k8s_objects import allocation, claim, claim_body, slices
from tests.fixtures.k8s_standin import StandinApiServer


@pytest.fixture
async def server() -> AsyncIterator[StandinApiServer]:
    async with StandinApiServer() as standin:
        yield standin


@pytest.fixture
async def api(server: StandinApiServer) -> AsyncIterator[KubeApi]:
    async with KubeApi.from_url(server.url) as client:
        yield client


async def test_list_get_and_watch_with_bookmarks(server: StandinApiServer, api: KubeApi) -> None:
    await api.create_claim(claim("team-a", "one"))
    await api.create_claim(claim("team-b", "two"))
    listed = await api.list_claims()
    assert [(c.metadata.namespace, c.metadata.name) for c in listed.items] == [
        ("team-a", "one"),
        ("team-b", "two"),
    ]
    assert listed.resource_version == str(server.store.rv)
    assert "kind" not in listed.raw[0]  # items come without kind, as from a real server
    got = await api.get_claim("team-a", "one")
    assert got.metadata.uid and got.metadata.generation == 1

    stream = api.watch_claims(listed.resource_version)
    try:
        server.store.create("resourceclaims", "team-a", claim_body("team-a", "three"))
        first = await anext(stream)
        assert isinstance(first, WatchEvent)
        assert (first.type, first.object.metadata.name) == ("ADDED", "three")
        assert first.resource_version == str(server.store.rv)
        await server.wait_for_watches(1)
        assert server.send_bookmarks() == 1
        mark = await anext(stream)
        assert mark == Bookmark(resource_version=str(server.store.rv))
    finally:
        await stream.aclose()


async def test_status_write_changes_only_the_status(api: KubeApi) -> None:
    made = await api.create_claim(claim("ns", "c"))
    status = msgspec.convert(allocation(), ResourceClaimStatus)
    written = await api.replace_claim_status(msgspec.structs.replace(made, status=status))
    assert written.status is not None and written.status.allocation is not None
    assert written.spec == made.spec
    assert written.metadata.generation == made.metadata.generation
    assert int(written.metadata.resource_version or 0) > int(made.metadata.resource_version or 0)
    patched = await api.patch_claim_status(
        "ns",
        "c",
        {"devices": [{"driver": "gpu.dracap.io", "pool": "p", "device": "gpu-0"}]},
        resource_version=written.metadata.resource_version,
    )
    assert patched.status is not None and patched.status.allocation == status.allocation
    assert patched.status.devices == [{"driver": "gpu.dracap.io", "pool": "p", "device": "gpu-0"}]


async def test_stale_status_update_is_a_conflict(api: KubeApi) -> None:
    made = await api.create_claim(claim("ns", "c"))
    status = msgspec.convert(allocation(), ResourceClaimStatus)
    await api.replace_claim_status(msgspec.structs.replace(made, status=status))
    with pytest.raises(Conflict) as caught:
        await api.replace_claim_status(msgspec.structs.replace(made, status=status))
    assert isinstance(caught.value, runtime_errors.ConflictError)
    assert caught.value.status == 409
    with pytest.raises(Conflict):
        await api.patch_claim_status(
            "ns", "c", allocation("gpu-1"), resource_version=made.metadata.resource_version
        )


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
async def test_watch_from_a_compacted_version_is_gone(gone_as_http: bool) -> None:
    async with (
        StandinApiServer(gone_as_http=gone_as_http) as server,
        KubeApi.from_url(server.url) as api,
    ):
        await api.create_claim(claim("ns", "a"))
        old = str(server.store.rv)
        await api.create_claim(claim("ns", "b"))
        server.compact()
        with pytest.raises(Gone) as caught:
            async for _ in api.watch_claims(old):
                pass
        assert caught.value.status == 410


async def test_typed_errors(api: KubeApi) -> None:
    with pytest.raises(NotFound) as missing:
        await api.get_claim("ns", "absent")
    assert isinstance(missing.value, runtime_errors.NotFound)

    first = await api.create_slice(slices("node-a", [80])[0])
    with pytest.raises(AlreadyExists):
        await api.create_slice(slices("node-a", [80])[0])

    # Gated features' fields are opaque JSON in the model; the server's schema still
    # checks them, and the 422 names the field.
    assert first.spec.devices
    device = msgspec.structs.replace(
        first.spec.devices[0], consumes_counters=[{"counterSet": "x", "counters": {}, "bogus": 1}]
    )
    broken = msgspec.structs.replace(
        first, spec=msgspec.structs.replace(first.spec, devices=[device])
    )
    with pytest.raises(Invalid) as invalid:
        await api.replace_slice(broken)
    assert [c.field for c in invalid.value.causes] == ["spec.devices[0].consumesCounters[0]"]
    assert isinstance(invalid.value, Permanent)


async def test_unreachable_server_is_retryable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with KubeApi.from_url(f"http://127.0.0.1:{port}") as api:
        with pytest.raises(Retryable) as caught:
            await api.list_claims()
    assert isinstance(caught.value, runtime_errors.RetryableError)


async def test_bearer_token() -> None:
    async with StandinApiServer(token="s3cret") as server:
        async with KubeApi.from_url(server.url) as anonymous:
            with pytest.raises(Permanent) as caught:
                await anonymous.list_claims()
            assert caught.value.status == 401
        async with KubeApi.from_url(server.url, token="s3cret") as api:
            assert (await api.list_claims()).items == []
