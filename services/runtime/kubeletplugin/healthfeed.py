"""The latest device health list, followed once and fanned out to every watcher.

The handler offers one async iterator of complete health lists; the kubelet may open
several NodeWatchResources streams over time (it reconnects after a restart). The feed
consumes the handler's iterator in one task and keeps only the latest list with a
version number; each watcher gets the latest list at once (when there is one) and then
every newer one. A slow watcher skips lists it did not get to, which loses nothing,
since each list is complete. When the handler's iterator ends, the feed ends: watchers
get the last list they have not seen and then their stream ends too; :attr:`failure`
says whether it ended by an exception.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from services.runtime.kubeletplugin.contract import DeviceHealthReport

__all__ = ["HealthFeed"]


class HealthFeed:
    """The latest complete health list and its version; see the module docstring."""

    def __init__(self) -> None:
        self._latest: list[DeviceHealthReport] = []
        self._version = 0
        self._ended = False
        self._changed = asyncio.Condition()
        self.failure: BaseException | None = None

    async def follow(self, updates: AsyncIterator[list[DeviceHealthReport]]) -> None:
        """Publish each list of ``updates`` until it ends (an exception is re-raised)."""
        try:
            async for reports in updates:
                async with self._changed:
                    self._latest = list(reports)
                    self._version += 1
                    self._changed.notify_all()
        except Exception as exc:
            self.failure = exc
            raise
        finally:
            async with self._changed:
                self._ended = True
                self._changed.notify_all()

    async def watch(self) -> AsyncIterator[list[DeviceHealthReport]]:
        """The latest list, then each newer one, until the feed ends."""
        seen = 0
        while True:
            async with self._changed:
                await self._changed.wait_for(functools.partial(self._news_after, seen))
                if self._version == seen:
                    return
                seen, latest = self._version, self._latest
            yield latest

    def _news_after(self, seen: int) -> bool:
        return self._version > seen or self._ended
