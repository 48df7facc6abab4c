"""Read-only query endpoints on the tenant and admin subjects (audit, usage).

A subscriber that answers questions about its own tables (``services/audit``,
``services/billing``) registers one NATS micro service with two endpoints:

* the tenant's ``{prefix}.api.{namespace}.claims.{op}``: the namespace is the subject's
  third token and only that; the broker gives a tenant user its own namespace's subjects
  only, and the caller the broker stamped (``Nats-Request-Info``) must be a tenant of
  that namespace (or an operator); the query is then run *scoped* to that namespace, so
  a tenant never sees another namespace's rows whatever its payload says;
* the operator's ``{prefix}.admin.{admin_op}``: operators only, any namespace.

Replies are the API's (``{"ok": true, ...}`` / ``{"ok": false, "error": ...}``); a
:class:`QueryError` is an ``invalid`` reply naming the field and the rule.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, TypeVar

import msgspec
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Service

from events.actors import Actor
from events.model import encode_hook
from events.subjects import BusNames
from services.runtime.bus.credentials import Directory, caller_of
from services.runtime.bus.flushing import flushed
from services.runtime.bus.replies import HEADROOM, MAX_REPLY_PARTS, split

__all__ = [
    "Query",
    "QueryError",
    "admin_caller",
    "answering",
    "error_reply",
    "forbidden",
    "limited_to",
    "ok_reply",
    "send_reply",
    "serve_queries",
    "serving_queries",
    "tenant_caller",
]

log = logging.getLogger("dracap.queries")

_ENCODER: Final = msgspec.json.Encoder(enc_hook=encode_hook)

#: ``(namespace the caller is limited to, or None for an operator; payload) -> reply fields``
Query = Callable[[str | None, bytes], Awaitable[dict[str, Any]]]


class QueryError(Exception):
    """A query payload that cannot be used: an ``invalid`` reply."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


def ok_reply(**fields: Any) -> bytes:
    """``{"ok": true, **fields}`` as JSON: every dracap API's success reply."""
    return _ENCODER.encode({"ok": True, **fields})


def error_reply(
    code: str, message: str, *, field: str | None = None, rule: str | None = None
) -> bytes:
    """``{"ok": false, "error": {code, field, rule, message}}``: every API's refusal."""
    error = {"code": code, "field": field, "rule": rule, "message": message}
    return _ENCODER.encode({"ok": False, "error": error})


async def send_reply(request: Request, reply: bytes, max_payload: int) -> None:
    """Answer ``request`` with ``reply``, in parts when it is larger than the server takes
    (``max_payload``: :mod:`services.runtime.bus.replies`); too large even so: the
    ``too_large`` error."""
    messages = split(reply, max_payload)
    if messages is None:
        most = MAX_REPLY_PARTS * (max_payload - HEADROOM)
        refusal = error_reply(
            "too_large",
            f"the reply is {len(reply)} bytes, more than the {most} one reply may carry; "
            "ask for less (a namespace, a filter, --limit)",
            rule=f"at most {MAX_REPLY_PARTS} messages of the server's max_payload",
        )
        messages = [(refusal, None)]
    for data, headers in messages:
        await request.respond(data, headers=headers)


def forbidden(caller: Actor | None, what: str) -> bytes:
    """The reply to a request whose sender may not do it (or is not known)."""
    who = "an unauthenticated sender" if caller is None else str(caller)
    return error_reply(
        "forbidden",
        f"{who} may not use {what}",
        rule="the broker's identity of the sender must be allowed to",
    )


def tenant_caller(
    request: Request, known: Any, *, authenticated: bool
) -> tuple[str, Actor | None, bytes | None]:
    """A tenant request's namespace (its subject's third token), its sender, and the
    refusal to send when that sender may not act there (``None``: it may)."""
    namespace = request.subject.split(".")[2]
    caller = caller_of(request.headers, known)
    if caller is None and not authenticated:
        caller = Actor.anonymous(namespace)
    if caller is None or (caller.kind == "tenant" and caller.namespace != namespace):
        return namespace, caller, forbidden(caller, f"namespace {namespace!r}")
    return namespace, caller, None


def admin_caller(
    request: Request, known: Any, *, authenticated: bool
) -> tuple[Actor | None, bytes | None]:
    """An admin request's sender, and the refusal when it is no operator's."""
    caller = caller_of(request.headers, known)
    if caller is None and not authenticated:
        caller = Actor.anonymous(None)
    if caller is None or caller.kind not in ("operator", "anonymous"):
        return caller, forbidden(caller, "the admin API")
    return caller, None


_Limited = TypeVar("_Limited", bound=msgspec.Struct)


def limited_to(wanted: _Limited, namespace: str | None) -> _Limited:
    """A query filter (a Struct with ``namespace``) limited to the tenant ``namespace``
    (``None``: an operator's, unchanged); naming another namespace is refused."""
    if namespace is None:
        return wanted
    if getattr(wanted, "namespace", None) not in (None, namespace):
        raise QueryError("namespace", f"a tenant of {namespace} reads its own only")
    return msgspec.structs.replace(wanted, namespace=namespace)


async def _answer(request: Request, query: Query, namespace: str | None, max_payload: int) -> None:
    try:
        reply = ok_reply(**await query(namespace, request.data))
    except QueryError as exc:
        reply = error_reply("invalid", str(exc), field=exc.field, rule=exc.rule)
    except Exception as exc:
        log.exception("query on %s failed", request.subject)
        reply = error_reply("internal", f"{type(exc).__name__}: {exc}")
    await send_reply(request, reply, max_payload)


async def serve_queries(
    nc: Client,
    names: BusNames,
    *,
    service: str,
    tenant_op: str,
    admin_op: str,
    query: Query,
    directory: Directory | None,
    authenticated: bool,
) -> Service:
    """Register ``query`` on the tenant and admin subjects (see the module docstring)."""
    known = directory.index() if directory is not None else {}
    micro = await add_service(
        nc,
        name=f"{names.prefix}-{service}",
        version="0.1.0",
        description=f"dracap {service} queries",
        queue_group=f"{names.prefix}-{service}",
    )

    async def tenant(request: Request) -> None:
        namespace, _, refusal = tenant_caller(request, known, authenticated=authenticated)
        if refusal is not None:
            await request.respond(refusal)
            return
        await _answer(request, query, namespace, nc.max_payload)

    async def admin(request: Request) -> None:
        _, refusal = admin_caller(request, known, authenticated=authenticated)
        if refusal is not None:
            await request.respond(refusal)
            return
        await _answer(request, query, None, nc.max_payload)

    await micro.add_endpoint(
        name=f"{service}-tenant", subject=names.api("*", tenant_op), handler=tenant
    )
    await micro.add_endpoint(name=f"{service}-admin", subject=names.admin(admin_op), handler=admin)
    await flushed(nc)
    return micro


@contextlib.asynccontextmanager
async def answering(
    nc: Client,
    names: BusNames,
    *,
    service: str,
    query: Query,
    directory: Directory | None,
    authenticated: bool,
) -> AsyncIterator[None]:
    """``query`` answers on ``{service}`` (tenant) and ``{service}.list`` (admin) until
    the block ends."""
    micro = await serve_queries(
        nc,
        names,
        service=service,
        tenant_op=service,
        admin_op=f"{service}.list",
        query=query,
        directory=directory,
        authenticated=authenticated,
    )
    try:
        yield
    finally:
        await micro.stop()


async def serving_queries(
    run: Callable[[], Awaitable[None]],
    nc: Client | None,
    names: BusNames,
    *,
    service: str,
    query: Query,
    directory: Directory | None,
    authenticated: bool,
) -> None:
    """``await run()`` while ``query`` is :func:`answering`, when there is a connection
    ``nc`` to answer on."""
    if nc is None:
        await run()
        return
    async with answering(
        nc, names, service=service, query=query, directory=directory, authenticated=authenticated
    ):
        await run()
