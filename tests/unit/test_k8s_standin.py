"""The stand-in API server keeps the real server's contract (over raw HTTP)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from events import model
from tests.fixtures.k8s_objects import allocation, claim_body, slices
from tests.fixtures.k8s_standin import StandinApiServer

V1 = "/apis/resource.k8s.io/v1"


@pytest.fixture
async def server() -> AsyncIterator[StandinApiServer]:
    async with StandinApiServer() as standin:
        yield standin


@pytest.fixture
async def http(server: StandinApiServer) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=server.url) as session:
        yield session


async def call(
    http: aiohttp.ClientSession, method: str, path: str, body: Any = None, **kwargs: Any
) -> tuple[int, Any]:
    async with http.request(method, V1 + path, json=body, **kwargs) as response:
        return response.status, await response.json()


def slice_body(node: str = "node-a", **labels: str) -> model.JSON:
    body = model.to_builtins(slices(node, [80])[0])
    if labels:
        body["metadata"]["labels"] = labels
    return body


async def test_invalid_object_is_422_naming_the_field(http: aiohttp.ClientSession) -> None:
    body = slice_body()
    body["spec"]["pool"]["generation"] = "one"
    status, reply = await call(http, "POST", "/resourceslices", body)
    assert (status, reply["reason"]) == (422, "Invalid")
    assert [c["field"] for c in reply["details"]["causes"]] == ["spec.pool.generation"]
    body = slice_body()
    body["spec"]["devices"][0]["colour"] = "red"  # strict: unknown fields are errors
    status, reply = await call(http, "POST", "/resourceslices", body)
    assert status == 422
    assert reply["details"]["causes"][0]["field"] == "spec.devices[0]"


async def test_versions_and_server_fields(http: aiohttp.ClientSession) -> None:
    _, claim = await call(http, "POST", "/namespaces/ns/resourceclaims", claim_body("ns", "c"))
    _, made = await call(http, "POST", "/resourceslices", slice_body())
    assert int(made["metadata"]["resourceVersion"]) > int(claim["metadata"]["resourceVersion"])
    assert made["metadata"]["uid"] and made["metadata"]["creationTimestamp"]
    assert made["metadata"]["generation"] == 1
    status, same = await call(http, "PUT", f"/resourceslices/{made['metadata']['name']}", made)
    assert status == 200 and same == made  # no change: no new version
    changed = {**made, "spec": {**made["spec"], "pool": {**made["spec"]["pool"], "generation": 2}}}
    _, bumped = await call(http, "PUT", f"/resourceslices/{made['metadata']['name']}", changed)
    assert bumped["metadata"]["generation"] == 2
    status, reply = await call(http, "PUT", f"/resourceslices/{made['metadata']['name']}", changed)
    assert (status, reply["reason"]) == (409, "Conflict")  # changed carries the old version
    status, reply = await call(
        http,
        "DELETE",
        f"/resourceslices/{made['metadata']['name']}",
        {"preconditions": {"resourceVersion": made["metadata"]["resourceVersion"]}},
    )
    assert status == 409
    status, _ = await call(http, "POST", "/resourceslices", made)
    assert status == 400  # a create must not carry a resourceVersion


async def test_status_subresource(http: aiohttp.ClientSession) -> None:
    path = "/namespaces/ns/resourceclaims/c"
    body = {**claim_body("ns", "c"), "status": allocation()}
    _, made = await call(http, "POST", "/namespaces/ns/resourceclaims", body)
    assert "status" not in made  # a create drops the status
    _, with_status = await call(http, "PUT", path + "/status", {**made, "status": allocation()})
    assert with_status["status"] == allocation()
    assert with_status["metadata"]["generation"] == 1
    relabelled = {**with_status, "metadata": {**with_status["metadata"], "labels": {"x": "y"}}}
    relabelled["status"] = allocation("other")
    _, main = await call(http, "PUT", path, relabelled)
    assert main["metadata"]["labels"] == {"x": "y"}
    assert main["status"] == allocation()  # a main-resource write keeps the status
    respec = {**main, "spec": {"devices": {"requests": []}}}
    status, reply = await call(http, "PUT", path, respec)
    assert status == 422 and reply["details"]["causes"][0]["field"] == "spec"
    status, patched = await call(
        http,
        "PATCH",
        path + "/status",
        {"status": {"devices": None, "allocation": None}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert status == 200
    assert patched.get("status", {}) == {}


async def test_selectors(http: aiohttp.ClientSession) -> None:
    await call(http, "POST", "/resourceslices", slice_body("node-a", tier="fast"))
    await call(http, "POST", "/resourceslices", slice_body("node-b", tier="slow"))

    async def names(**query: str) -> list[str]:
        status, reply = await call(http, "GET", "/resourceslices", params=query)
        assert status == 200, reply
        return [o["spec"]["nodeName"] for o in reply["items"]]

    assert await names(fieldSelector="spec.nodeName=node-b") == ["node-b"]
    assert await names(fieldSelector="spec.driver=gpu.dracap.io,spec.nodeName!=node-b") == [
        "node-a"
    ]
    assert await names(labelSelector="tier in (fast,medium)") == ["node-a"]
    assert await names(labelSelector="tier!=fast") == ["node-b"]
    assert await names(labelSelector="!tier") == []
    status, _ = await call(http, "GET", "/resourceslices", params={"fieldSelector": "spec.x=1"})
    assert status == 400


async def test_exact_list_of_a_compacted_version_is_gone(
    server: StandinApiServer, http: aiohttp.ClientSession
) -> None:
    await call(http, "POST", "/resourceslices", slice_body())
    server.compact()
    await call(http, "POST", "/resourceslices", slice_body("node-b"))
    status, reply = await call(
        http,
        "GET",
        "/resourceslices",
        params={"resourceVersion": "0", "resourceVersionMatch": "Exact"},
    )
    assert (status, reply["reason"]) == (410, "Expired")
