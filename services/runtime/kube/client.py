"""A thin typed client of the ``resource.k8s.io/v1`` API: ResourceClaims and ResourceSlices.

:class:`KubeApi` wraps ``kubernetes_asyncio`` (why that library: ``docs/kubernetes-client.md``).
The library does what is hard to get right and easy to get subtly wrong: reading a
kubeconfig (contexts, client certificates, exec plugins, token refresh), the in-cluster
service account, TLS, and building each request's path and query from the generated
``ResourceV1Api``. Everything is called with ``_preload_content=False``, so the library never
turns a reply into its own model classes: this module reads the JSON and decodes it into
dracap's msgspec models (:mod:`events.model`), and writes what
:func:`events.model.to_builtins` makes of them. ``status.devices`` and the fields of gated
features are plain JSON in those models, so nothing the server sends in a claim's status is
lost on the way through.

Errors are typed (:mod:`services.runtime.kube.errors`): the HTTP status decides the class,
client-side failures (connection refused or reset, timeouts) are :class:`Retryable`.

Watches (:meth:`KubeApi.watch_claims`, :meth:`KubeApi.watch_slices`) yield one
:class:`WatchEvent` per ADDED / MODIFIED / DELETED and a :class:`Bookmark` per BOOKMARK;
an ERROR event raises its error (a 410 in the stream is :class:`Gone`, as is a 410 reply to
the watch request itself). A stream the server ends (its ``timeoutSeconds`` ran out) simply
ends the iteration; resuming from the last resourceVersion seen is the caller's move
(:class:`~services.runtime.kube.informer.ClaimInformer` does it).

Lists follow ``continue`` tokens page by page; the list's resourceVersion is the first
page's, which the server keeps for the whole paged list.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Final, Generic, Self, TypeVar, cast

import aiohttp
import msgspec
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from events import model
from events.model import JSON, ResourceClaim, ResourceClaimStatus, ResourceSlice
from services.runtime.kube.errors import (
    KubeApiError,
    Permanent,
    Retryable,
    error_from_exception,
    error_from_status,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LIST_PAGE_SIZE",
    "WATCH_TIMEOUT_S",
    "Bookmark",
    "ConfigError",
    "KubeApi",
    "Listed",
    "WatchEvent",
    "slice_field_selector",
]

#: Total time one ordinary request may take.
DEFAULT_TIMEOUT_S: Final = 30.0
#: Server-side length of one watch request (``timeoutSeconds``); the client reads with a
#: margin on top, so a stream the server ends normally is never cut by the client first.
WATCH_TIMEOUT_S: Final = 300
_WATCH_READ_MARGIN_S: Final = 30.0
#: Objects per page of a list.
LIST_PAGE_SIZE: Final = 500
_JSON_MERGE_PATCH: Final = "application/merge-patch+json"

M = TypeVar("M", ResourceClaim, ResourceSlice)


class ConfigError(Permanent):
    """No usable kubeconfig or in-cluster service account."""


class WatchEvent(msgspec.Struct, Generic[M], frozen=True):
    """An ADDED, MODIFIED or DELETED event: the object decoded, and as the server sent it."""

    type: str
    object: M
    raw: JSON

    @property
    def resource_version(self) -> str:
        """The object's resourceVersion (for DELETED, the version of the deletion)."""
        return self.object.metadata.resource_version or ""


class Bookmark(msgspec.Struct, frozen=True):
    """A BOOKMARK: nothing changed for this watch up to ``resource_version``."""

    resource_version: str


class Listed(msgspec.Struct, Generic[M], frozen=True):
    """A list's objects, the same as the server sent them, and the version to watch from."""

    items: list[M]
    raw: list[JSON]
    resource_version: str


def slice_field_selector(*, driver: str | None = None, node: str | None = None) -> str | None:
    """``spec.driver=...,spec.nodeName=...`` (the fields the server selects slices by)."""
    parts = []
    if driver is not None:
        parts.append(f"spec.driver={driver}")
    if node is not None:
        parts.append(f"spec.nodeName={node}")
    return ",".join(parts) or None


def _decode(raw: Any, typ: type[M], *, what: str) -> M:
    if not isinstance(raw, dict):
        raise Permanent(f"{what}: the server sent {type(raw).__name__}, not an object")
    try:
        return model.convert(raw, typ)
    except (msgspec.ValidationError, ValueError) as exc:
        raise Permanent(
            f"{what}: the server sent a {typ.__name__} dracap cannot read: {exc}"
        ) from exc


def _body(obj: ResourceClaim | ResourceSlice) -> JSON:
    return model.to_builtins(obj)


class KubeApi:
    """ResourceClaims and ResourceSlices of one API server; an async context manager.

    Build it with :meth:`from_kubeconfig`, :meth:`in_cluster`, :meth:`from_environment` or
    :meth:`from_url` (tests: a plain ``http://127.0.0.1:PORT`` and an optional token),
    from inside a running event loop, and close it (``async with`` or :meth:`close`).
    """

    def __init__(self, configuration: k8s_client.Configuration) -> None:
        self._client = k8s_client.ApiClient(configuration)
        self._resource = k8s_client.ResourceV1Api(self._client)
        self.server: str = str(configuration.host)

    # --- construction ---------------------------------------------------------------

    @classmethod
    def from_url(
        cls,
        server: str,
        *,
        token: str | None = None,
        ca_file: str | None = None,
        verify_tls: bool = True,
    ) -> Self:
        """A client of ``server`` with an optional bearer token (and CA file for https)."""
        configuration = k8s_client.Configuration(host=server.rstrip("/"))
        if token is not None:
            configuration.api_key = {"BearerToken": token}
            configuration.api_key_prefix = {"BearerToken": "Bearer"}
        configuration.ssl_ca_cert = ca_file
        configuration.verify_ssl = verify_tls
        return cls(configuration)

    @classmethod
    async def from_kubeconfig(
        cls, path: str | os.PathLike[str] | None = None, *, context: str | None = None
    ) -> Self:
        """A client for ``context`` (default: the current one) of the kubeconfig at ``path``
        (default: ``$KUBECONFIG``, else ``~/.kube/config``)."""
        configuration = k8s_client.Configuration()
        try:
            await k8s_config.load_kube_config(
                config_file=None if path is None else os.fspath(path),
                context=context,
                client_configuration=configuration,
            )
        except (k8s_config.ConfigException, OSError, ValueError) as exc:
            where = path or os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise ConfigError(f"kubeconfig {where}: {exc}") from exc
        return cls(configuration)

    @classmethod
    def in_cluster(cls) -> Self:
        """A client with the pod's service account (token re-read as it rotates)."""
        configuration = k8s_client.Configuration()
        try:
            k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]  # untyped upstream
                client_configuration=configuration
            )
        except (k8s_config.ConfigException, OSError) as exc:
            raise ConfigError(f"in-cluster configuration: {exc}") from exc
        return cls(configuration)

    @classmethod
    async def from_environment(
        cls, *, kubeconfig: str | os.PathLike[str] | None = None, context: str | None = None
    ) -> Self:
        """In-cluster when running in a pod and no kubeconfig is named, else the kubeconfig."""
        if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            return cls.in_cluster()
        return await cls.from_kubeconfig(kubeconfig, context=context)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP connections."""
        await self._client.close()

    # --- requests -------------------------------------------------------------------

    async def _send(
        self,
        what: str,
        call: Callable[..., Awaitable[object]],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Call one generated API function raw; the decoded JSON body, or a typed error."""
        kwargs.setdefault("_request_timeout", DEFAULT_TIMEOUT_S)
        try:
            response = cast(
                aiohttp.ClientResponse, await call(*args, _preload_content=False, **kwargs)
            )
            async with response:
                body = await response.read()
                status = response.status
        except KubeApiError:
            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise error_from_exception(exc, what=what) from exc
        if not 200 <= status <= 299:
            raise error_from_status(status, body, what=what)
        try:
            return msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise Retryable(f"{what}: the reply is not JSON ({exc})", status=status) from exc

    async def _list(
        self, what: str, call: Callable[..., Awaitable[object]], typ: type[M], **query: Any
    ) -> Listed[M]:
        items: list[M] = []
        raws: list[JSON] = []
        version = ""
        token: str | None = None
        while True:
            page = await self._send(
                what, call, limit=LIST_PAGE_SIZE, **({"_continue": token} if token else {}), **query
            )
            meta = page.get("metadata") or {} if isinstance(page, dict) else {}
            if not version:
                version = str(meta.get("resourceVersion") or "")
            for raw in page.get("items") or []:
                items.append(_decode(raw, typ, what=what))
                raws.append(raw)
            token = meta.get("continue") or None
            if not token:
                return Listed(items=items, raw=raws, resource_version=version)

    async def _watch(
        self,
        what: str,
        call: Callable[..., Awaitable[object]],
        typ: type[M],
        resource_version: str,
        *,
        timeout_s: int,
        bookmarks: bool,
        **query: Any,
    ) -> AsyncGenerator[WatchEvent[M] | Bookmark, None]:
        timeout = aiohttp.ClientTimeout(
            sock_connect=DEFAULT_TIMEOUT_S, sock_read=timeout_s + _WATCH_READ_MARGIN_S
        )
        try:
            response = cast(
                aiohttp.ClientResponse,
                await call(
                    watch=True,
                    resource_version=resource_version,
                    allow_watch_bookmarks=bookmarks,
                    timeout_seconds=timeout_s,
                    _preload_content=False,
                    _request_timeout=timeout,
                    **query,
                ),
            )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise error_from_exception(exc, what=what) from exc
        try:
            if response.status != 200:
                try:
                    body = await response.read()
                except (TimeoutError, aiohttp.ClientError, OSError):
                    body = b""
                raise error_from_status(response.status, body, what=what)
            while True:
                try:
                    line = await response.content.readline()
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    raise error_from_exception(exc, what=what) from exc
                if not line:
                    return  # the server ended the watch
                if not line.endswith(b"\n"):
                    raise Retryable(f"{what}: the stream broke off inside an event")
                yield self._event(line, typ, what=what)
        finally:
            response.close()

    @staticmethod
    def _event(line: bytes, typ: type[M], *, what: str) -> WatchEvent[M] | Bookmark:
        try:
            event = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            raise Retryable(f"{what}: a watch event is not JSON ({exc})") from exc
        kind = event.get("type") if isinstance(event, dict) else None
        obj = event.get("object") if isinstance(event, dict) else None
        if not isinstance(obj, dict):
            raise Permanent(f"{what}: a watch event without an object")
        if kind == "ERROR":
            code = obj.get("code")
            raise error_from_status(code if isinstance(code, int) else 500, obj, what=what)
        if kind == "BOOKMARK":
            meta = obj.get("metadata") or {}
            return Bookmark(resource_version=str(meta.get("resourceVersion") or ""))
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            raise Permanent(f"{what}: unknown watch event type {kind!r}")
        return WatchEvent(type=kind, object=_decode(obj, typ, what=what), raw=obj)

    # --- ResourceClaims ---------------------------------------------------------------

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        """The claim ``namespace/name``; :class:`NotFound` when there is none."""
        raw = await self._send(
            f"GET resourceclaim {namespace}/{name}",
            self._resource.read_namespaced_resource_claim,
            name,
            namespace,
        )
        return _decode(raw, ResourceClaim, what=f"resourceclaim {namespace}/{name}")

    async def list_claims(self, *, label_selector: str | None = None) -> Listed[ResourceClaim]:
        """Every claim of every namespace, and the resourceVersion of the list."""
        query = {"label_selector": label_selector} if label_selector else {}
        return await self._list(
            "LIST resourceclaims",
            self._resource.list_resource_claim_for_all_namespaces,
            ResourceClaim,
            **query,
        )

    def watch_claims(
        self, resource_version: str, *, timeout_s: int = WATCH_TIMEOUT_S, bookmarks: bool = True
    ) -> AsyncGenerator[WatchEvent[ResourceClaim] | Bookmark, None]:
        """Claim changes of every namespace after ``resource_version``."""
        return self._watch(
            "WATCH resourceclaims",
            self._resource.list_resource_claim_for_all_namespaces,
            ResourceClaim,
            resource_version,
            timeout_s=timeout_s,
            bookmarks=bookmarks,
        )

    async def create_claim(self, claim: ResourceClaim) -> ResourceClaim:
        """Create ``claim`` in its namespace (tests and tools; a driver never creates claims)."""
        namespace = claim.metadata.namespace or "default"
        what = f"CREATE resourceclaim {namespace}/{claim.metadata.name}"
        raw = await self._send(
            what, self._resource.create_namespaced_resource_claim, namespace, _body(claim)
        )
        return _decode(raw, ResourceClaim, what=what)

    async def replace_claim_status(self, claim: ResourceClaim) -> ResourceClaim:
        """Write ``claim.status`` at ``claim.metadata.resourceVersion`` (the status subresource).

        The server changes nothing but the status; a stale resourceVersion is a
        :class:`Conflict`. Without a resourceVersion the write is unconditional.
        """
        namespace = claim.metadata.namespace or "default"
        what = f"UPDATE resourceclaim {namespace}/{claim.metadata.name} status"
        raw = await self._send(
            what,
            self._resource.replace_namespaced_resource_claim_status,
            claim.metadata.name,
            namespace,
            _body(claim),
        )
        return _decode(raw, ResourceClaim, what=what)

    async def patch_claim_status(
        self,
        namespace: str,
        name: str,
        status: ResourceClaimStatus | JSON,
        *,
        resource_version: str | None = None,
    ) -> ResourceClaim:
        """Merge ``status`` into the claim's status (JSON merge patch on the status subresource).

        Fields ``status`` leaves out are kept (a ``None`` in a plain dict removes one); lists
        are replaced whole. With ``resource_version`` the server applies the patch only at
        that version, else :class:`Conflict`.
        """
        body: JSON = {"status": status if isinstance(status, dict) else model.to_builtins(status)}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        what = f"PATCH resourceclaim {namespace}/{name} status"
        raw = await self._send(
            what,
            self._resource.patch_namespaced_resource_claim_status,
            name,
            namespace,
            body,
            _content_type=_JSON_MERGE_PATCH,
        )
        return _decode(raw, ResourceClaim, what=what)

    async def delete_claim(self, namespace: str, name: str) -> None:
        """Delete the claim (tests and tools)."""
        await self._send(
            f"DELETE resourceclaim {namespace}/{name}",
            self._resource.delete_namespaced_resource_claim,
            name,
            namespace,
        )

    # --- ResourceSlices ---------------------------------------------------------------

    async def list_slices(
        self,
        *,
        driver: str | None = None,
        node: str | None = None,
        label_selector: str | None = None,
    ) -> Listed[ResourceSlice]:
        """The slices of ``driver`` on ``node`` (each optional), and the list's resourceVersion."""
        query: dict[str, str] = {}
        fields = slice_field_selector(driver=driver, node=node)
        if fields:
            query["field_selector"] = fields
        if label_selector:
            query["label_selector"] = label_selector
        return await self._list(
            "LIST resourceslices", self._resource.list_resource_slice, ResourceSlice, **query
        )

    def watch_slices(
        self,
        resource_version: str,
        *,
        driver: str | None = None,
        node: str | None = None,
        timeout_s: int = WATCH_TIMEOUT_S,
        bookmarks: bool = True,
    ) -> AsyncGenerator[WatchEvent[ResourceSlice] | Bookmark, None]:
        """Slice changes after ``resource_version`` (of ``driver`` on ``node``, each optional)."""
        fields = slice_field_selector(driver=driver, node=node)
        return self._watch(
            "WATCH resourceslices",
            self._resource.list_resource_slice,
            ResourceSlice,
            resource_version,
            timeout_s=timeout_s,
            bookmarks=bookmarks,
            **({"field_selector": fields} if fields else {}),
        )

    async def create_slice(self, resource_slice: ResourceSlice) -> ResourceSlice:
        """Create the slice; :class:`AlreadyExists` when its name is taken."""
        what = f"CREATE resourceslice {resource_slice.metadata.name}"
        raw = await self._send(what, self._resource.create_resource_slice, _body(resource_slice))
        return _decode(raw, ResourceSlice, what=what)

    async def replace_slice(self, resource_slice: ResourceSlice) -> ResourceSlice:
        """Replace the slice at its ``metadata.resourceVersion`` (stale: :class:`Conflict`)."""
        name = resource_slice.metadata.name
        what = f"UPDATE resourceslice {name}"
        raw = await self._send(
            what, self._resource.replace_resource_slice, name, _body(resource_slice)
        )
        return _decode(raw, ResourceSlice, what=what)

    async def delete_slice(
        self, name: str, *, resource_version: str | None = None, uid: str | None = None
    ) -> None:
        """Delete the slice, only at ``resource_version`` / ``uid`` when given (else Conflict)."""
        preconditions = {
            key: value
            for key, value in (("resourceVersion", resource_version), ("uid", uid))
            if value is not None
        }
        body = {"preconditions": preconditions} if preconditions else None
        await self._send(
            f"DELETE resourceslice {name}",
            self._resource.delete_resource_slice,
            name,
            **({"body": body} if body else {}),
        )
