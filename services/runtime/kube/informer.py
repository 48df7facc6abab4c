"""An informer of ResourceClaims: list, then watch, with a cache and exactly-once events.

:class:`ClaimInformer` keeps a cache of every claim in the cluster and yields a
:class:`ClaimEvent` for each change it applies to that cache, so that a consumer who
applies the events in order holds the same claims as the cache — never missing a change,
never seeing one twice:

1. **List** every claim and diff the list against the cache (empty at a fresh start):
   DELETED for claims gone from the list, then ADDED / MODIFIED for new or changed ones
   (in namespace/name order, so the sequence is deterministic). A claim whose uid changed
   (deleted and created again under the same name) is a DELETED of the old one and an
   ADDED of the new. These events are ``synthesized`` (they came from a list, not a watch).
2. **Watch** from the list's resourceVersion, with bookmarks. Each event moves the cache
   and :attr:`ClaimInformer.resource_version`; a bookmark moves only the version.
3. When the stream ends (the server's timeout) or breaks (network, 5xx: ``Retryable``),
   **resume** the watch from the last version seen: nothing is listed again, nothing is
   repeated. Reconnects after failures back off (immediately, then 0.1 s doubling to 5 s;
   reset by any event or bookmark).
4. On **410 Gone** (the server no longer has history back to that version; as an HTTP
   reply or an ERROR event in the stream) go back to 1: the diff against the cache turns
   whatever happened while the watch was down into exactly the events that were missed.

Duplicates: an event whose (uid, resourceVersion) equals the cached claim's is dropped,
and so is one older than the cached claim when both versions are integers (as every real
API server's are: etcd revisions); a DELETED of a claim not in the cache (or with another
uid) is dropped too. The resourceVersion is otherwise treated as opaque.

Resuming: a consumer that checkpoints :meth:`ClaimInformer.checkpoint` (the version and the
claims it has seen, as of the last event it took) can start a new informer from it
(``ClaimInformer(api, resume=checkpoint)``): the watch resumes at that version, and if the
server has forgotten it, the relist diffs against the checkpointed claims. The cache and
the version move *before* an event is yielded, so a checkpoint taken after handling an
event includes it; one taken in the middle of a relist's events is still exact (the
version stays the old one until the relist's last event, and a later relist only emits
what the checkpointed claims lack).

Errors that are neither 410 nor retryable (401, 403, 404: no DRA API on this server) end
the iteration with that :class:`~services.runtime.kube.errors.Permanent` error; so does a
failed list.  A retryable failure of the list is retried with the same backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Final, Literal

import msgspec

from events import model
from events.model import JSON, ResourceClaim
from services.runtime.kube.client import WATCH_TIMEOUT_S, Bookmark, KubeApi, WatchEvent
from services.runtime.kube.errors import Gone, Retryable

__all__ = ["BACKOFF_S", "Checkpoint", "ClaimEvent", "ClaimInformer", "ClaimKey"]

ClaimKey = tuple[str, str]  # (namespace, name)
EventType = Literal["ADDED", "MODIFIED", "DELETED"]

#: Delays before reconnecting after consecutive failures (the last one repeats).
BACKOFF_S: Final = (0.0, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0)


class ClaimEvent(msgspec.Struct, frozen=True):
    """One change of the cache: the claim after it (for DELETED, its last state)."""

    type: EventType
    claim: ResourceClaim
    #: The claim as the server sent it (every field, also those the model lacks).
    raw: JSON
    #: True when the event was derived from a list (start, or after 410), not watched.
    synthesized: bool = False

    @property
    def key(self) -> ClaimKey:
        return key_of(self.claim)

    @property
    def resource_version(self) -> str:
        return self.claim.metadata.resource_version or ""


class Checkpoint(msgspec.Struct, frozen=True):
    """Where a consumer stands: the version to resume at and the claims it holds."""

    resource_version: str
    claims: list[ResourceClaim]


def key_of(claim: ResourceClaim) -> ClaimKey:
    return (claim.metadata.namespace or "", claim.metadata.name)


def _older(version: str, than: str) -> bool:
    """Whether ``version`` is before ``than``, when both are integers (else never)."""
    if version.isdigit() and than.isdigit():
        return int(version) < int(than)
    return False


class ClaimInformer:
    """Claims of every namespace: a cache and an async iterator of :class:`ClaimEvent`."""

    def __init__(
        self,
        api: KubeApi,
        *,
        resume: Checkpoint | None = None,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        backoff_s: Iterable[float] = BACKOFF_S,
    ) -> None:
        self._api = api
        self._watch_timeout_s = watch_timeout_s
        self._backoff = tuple(backoff_s) or (0.0,)
        self._cache: dict[ClaimKey, tuple[ResourceClaim, JSON]] = {}
        self._version: str | None = None
        if resume is not None:
            self._version = resume.resource_version or None
            for claim in resume.claims:
                self._cache[key_of(claim)] = (claim, model.to_builtins(claim))
        #: How often the informer listed (the first list included) and reconnected a watch.
        self.lists = 0
        self.reconnects = 0

    @property
    def resource_version(self) -> str:
        """The version up to which the cache is complete ("" before the first list)."""
        return self._version or ""

    @property
    def cache(self) -> Mapping[ClaimKey, ResourceClaim]:
        """The claims by (namespace, name), as of the last event yielded."""
        return {key: claim for key, (claim, _) in self._cache.items()}

    def checkpoint(self) -> Checkpoint:
        """The version and claims to resume from (see the module docstring)."""
        claims = [claim for _, (claim, _) in sorted(self._cache.items())]
        return Checkpoint(resource_version=self.resource_version, claims=claims)

    def __aiter__(self) -> AsyncIterator[ClaimEvent]:
        return self.events()

    async def events(self) -> AsyncIterator[ClaimEvent]:
        """Every change, forever (until cancelled or a permanent error)."""
        failures = 0
        need_list = self._version is None
        while True:
            try:
                if need_list:
                    async for event in self._relist():
                        yield event
                    need_list = False
                    failures = 0
                async with contextlib.aclosing(
                    self._api.watch_claims(
                        self.resource_version, timeout_s=self._watch_timeout_s, bookmarks=True
                    )
                ) as stream:
                    async for item in stream:
                        failures = 0
                        if isinstance(item, Bookmark):
                            if item.resource_version:
                                self._version = item.resource_version
                            continue
                        for event in self._apply(item):
                            yield event
            except Gone:
                need_list = True
                continue
            except Retryable:
                await self._pause(failures)
                failures += 1
            self.reconnects += 1

    async def _pause(self, failures: int) -> None:
        """Wait before the next try after ``failures`` failures in a row."""
        delay = self._backoff[min(failures, len(self._backoff) - 1)]
        if delay > 0:
            await asyncio.sleep(delay)

    def _apply(self, item: WatchEvent[ResourceClaim]) -> list[ClaimEvent]:
        """Move the cache by one watched event; the events that makes (none: a duplicate)."""
        claim = item.object
        key = key_of(claim)
        version = claim.metadata.resource_version or ""
        if version:
            self._version = version
        cached = self._cache.get(key)
        out: list[ClaimEvent] = []
        if cached is not None and cached[0].metadata.uid == claim.metadata.uid:
            old_version = cached[0].metadata.resource_version or ""
            if version == old_version or _older(version, old_version):
                return out  # seen already
        elif cached is not None:
            # Another claim under the cached name: the old one's DELETED was not seen (a
            # resume from a checkpoint older than a delete-and-create); report it now.
            del self._cache[key]
            out.append(ClaimEvent(type="DELETED", claim=cached[0], raw=cached[1], synthesized=True))
            cached = None
        if item.type == "DELETED":
            if cached is not None:
                del self._cache[key]
                out.append(ClaimEvent(type="DELETED", claim=claim, raw=item.raw))
            return out
        self._cache[key] = (claim, item.raw)
        kind: EventType = "ADDED" if cached is None else "MODIFIED"
        out.append(ClaimEvent(type=kind, claim=claim, raw=item.raw))
        return out

    async def _relist(self) -> AsyncIterator[ClaimEvent]:
        failures = 0
        while True:
            try:
                listed = await self._api.list_claims()
                break
            except Retryable:
                await self._pause(failures)
                failures += 1
        self.lists += 1
        fresh = {
            key_of(claim): (claim, raw) for claim, raw in zip(listed.items, listed.raw, strict=True)
        }
        for key in sorted(self._cache.keys() - fresh.keys()):
            gone, raw = self._cache.pop(key)
            yield ClaimEvent(type="DELETED", claim=gone, raw=raw, synthesized=True)
        for key in sorted(fresh):
            claim, raw = fresh[key]
            cached = self._cache.get(key)
            if cached is not None:
                old = cached[0].metadata
                if old.uid == claim.metadata.uid:
                    if old.resource_version == claim.metadata.resource_version:
                        continue
                    self._cache[key] = (claim, raw)
                    yield ClaimEvent(type="MODIFIED", claim=claim, raw=raw, synthesized=True)
                    continue
                del self._cache[key]
                yield ClaimEvent(type="DELETED", claim=cached[0], raw=cached[1], synthesized=True)
            self._cache[key] = (claim, raw)
            yield ClaimEvent(type="ADDED", claim=claim, raw=raw, synthesized=True)
        self._version = listed.resource_version
