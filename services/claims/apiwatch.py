"""Watching claims: ``claims.watch`` and the publisher of the views it subscribes to.

``watch`` replies with a subject (:meth:`WatchApi.watch_subject`); the publisher sends
a claim's view there (core NATS) each time the live state folds an event that changes
the claim or one of its shares (:meth:`~services.claims.apicore.ApiCore._changed`
marks them, :meth:`WatchApi._publish_changes` sends them). While the database cannot
be reached, the views carry the allocations as the fold keeps them.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from events import model
from events.actors import Actor
from events.fieldchecks import DNS_SUBDOMAIN_RULE, is_dns_subdomain
from events.state import ClaimState
from services.claims.apicore import ApiCore, InvalidRequestError, decode_request
from services.claims.views import claim_view
from services.runtime.bus.queries import ok_reply
from services.runtime.ground.outages import is_unreachable, one_line
from services.runtime.store import recorded

__all__ = ["WatchApi"]

log = logging.getLogger("dracap.claims")


class _WatchRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str | None = None


class WatchApi(ApiCore):
    """The watch endpoint and the publisher of claim views (see the module docstring)."""

    async def watch(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.watch``: the subject where changes of the claim(s) are published."""
        request: _WatchRequest = decode_request(data, _WatchRequest)
        if request.name is not None and not is_dns_subdomain(request.name):
            raise InvalidRequestError("name", DNS_SUBDOMAIN_RULE, request.name)
        return ok_reply(subject=self.watch_subject(namespace, request.name))

    def watch_subject(self, namespace: str, name: str | None) -> str:
        """Where changes of ``namespace/name`` (``None``: of every claim) are published."""
        return f"{self.names.prefix}.watch.{namespace}.{name if name else '>'}"

    async def _whole_allocations(
        self, claims: list[ClaimState | None]
    ) -> dict[int, model.AllocationResult]:
        """:func:`recorded.allocations` for the watch publisher: while the database cannot
        be reached it publishes the allocations as the fold keeps them (a later ``get``
        shows them whole)."""
        try:
            return await recorded.allocations(self.store.pool, [c for c in claims if c])
        except Exception as exc:
            if not is_unreachable(exc):
                raise
            log.warning("could not read allocations for the watch: %s", one_line(exc))
            return {}

    async def _publish_changes(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._wake.wait()
            self._wake.clear()
            dirty, self._dirty = self._dirty, {}
            state = self.live.state
            whole = await self._whole_allocations([state.claims.get(key) for key in dirty])
            for key in dirty:
                claim = state.claims.get(key)
                if claim is None:
                    continue
                subject = self.watch_subject(*key)
                view = claim_view(state, claim, whole.get(claim.bound_position))
                body = msgspec.json.encode(view)
                try:
                    await self.nc.publish(subject, body)
                except Exception as exc:  # the bus is reconnecting: watchers re-read
                    log.warning("watch publish to %s failed: %s", subject, exc)
