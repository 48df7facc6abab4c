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

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Service

from events.actors import Actor
from events.subjects import BusNames
from services.runtime.credentials import Directory, caller_of

__all__ = ["Query", "QueryError", "error_reply", "ok_reply", "serve_queries"]

log = logging.getLogger("dracap.queries")

_ENCODER: Final = msgspec.json.Encoder()

#: ``(namespace the caller is limited to, or None for an operator; payload) -> reply fields``
Query = Callable[[str | None, bytes], Awaitable[dict[str, Any]]]


class QueryError(Exception):
    """A query payload that cannot be used: an ``invalid`` reply."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


def ok_reply(**fields: Any) -> bytes:
    return _ENCODER.encode({"ok": True, **fields})


def error_reply(
    code: str, message: str, field: str | None = None, rule: str | None = None
) -> bytes:
    error = {"code": code, "field": field, "rule": rule, "message": message}
    return _ENCODER.encode({"ok": False, "error": error})


async def _answer(request: Request, query: Query, namespace: str | None) -> None:
    try:
        reply = ok_reply(**await query(namespace, request.data))
    except QueryError as exc:
        reply = error_reply("invalid", str(exc), exc.field, exc.rule)
    except Exception as exc:
        log.exception("query on %s failed", request.subject)
        reply = error_reply("internal", f"{type(exc).__name__}: {exc}")
    await request.respond(reply)


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
        namespace = request.subject.split(".")[2]
        caller = caller_of(request.headers, known)
        if caller is None and not authenticated:
            caller = Actor.anonymous(namespace)
        if caller is None or (caller.kind == "tenant" and caller.namespace != namespace):
            who = "an unauthenticated sender" if caller is None else str(caller)
            await request.respond(
                error_reply("forbidden", f"{who} may not read namespace {namespace!r}")
            )
            return
        await _answer(request, query, namespace)

    async def admin(request: Request) -> None:
        caller = caller_of(request.headers, known)
        if caller is None and not authenticated:
            caller = Actor.anonymous(None)
        if caller is None or caller.kind not in ("operator", "anonymous"):
            who = "an unauthenticated sender" if caller is None else str(caller)
            await request.respond(error_reply("forbidden", f"{who} may not use the admin API"))
            return
        await _answer(request, query, None)

    await micro.add_endpoint(
        name=f"{service}-tenant", subject=names.api("*", tenant_op), handler=tenant
    )
    await micro.add_endpoint(name=f"{service}-admin", subject=names.admin(admin_op), handler=admin)
    await nc.flush()
    return micro
