"""The agent's inventory loop: discovery -> Publisher -> ResourceSlice events in the log.

:class:`InventoryScanner` runs :func:`~services.enforcement.discovery.discover` (in a
thread: it reads sysfs and calls NVML), hands the inventory to whoever needs it (the
enforcers' device maps, :func:`interfaces_of` and :func:`gpu_uuids_of`) and appends
what the :class:`~services.enforcement.publishing.Publisher` says changed
(``ResourceSlicePublished`` / ``ResourceSliceWithdrawn``, one slice stream each) in one
report (``publish``: the agent's, appended by the enforcement service as
``agent:<node>#<epoch>``). The publisher starts from the slices the log holds for the
node (``previous``: the agent's view of them), so a restart republishes nothing when
nothing changed. A scan that fails (a broken static
inventory file, an unreadable sysfs) is logged and skipped: what was published stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

from events.catalog import Event
from events.envelopes import stream_of
from events.model import ResourceSlice
from services.enforcement.discovery import AgentConfig, InventoryError, ScanResult, discover
from services.enforcement.publishing import Changes, Publisher
from services.runtime.ground.errors import RetryableError
from services.runtime.ground.waiting import wait_for

__all__ = ["InventoryScanner", "gpu_uuids_of", "interfaces_of"]

log = logging.getLogger("dracap.inventory")

ScanListener = Callable[[ScanResult], None]
#: Where the node's slices come from at the first scan: what the log holds for it.
Previous = Callable[[], Awaitable[Iterable[ResourceSlice]]]
#: Append the events of a scan, grouped by stream, in order.
Publish = Callable[[list[tuple[str, list[Event]]]], Awaitable[None]]


def interfaces_of(config: AgentConfig, inventory: ScanResult) -> dict[tuple[str, str, str], str]:
    """``(driver, pool, device) -> interface`` for every device with an ``ifName``."""
    out: dict[tuple[str, str, str], str] = {}
    for driver, devices in inventory.devices.items():
        pool = config.pool_for(driver)
        for device in devices:
            name = device.attributes.get("ifName")
            if name is not None and name.string:
                out[(driver, pool, device.name)] = name.string
    return out


def gpu_uuids_of(config: AgentConfig, inventory: ScanResult) -> dict[str, str]:
    """``device -> GPU UUID`` for the GPUs of the configured GPU driver."""
    out: dict[str, str] = {}
    for device in inventory.devices.get(config.gpu.driver, []):
        uuid = device.attributes.get("uuid")
        if uuid is not None and uuid.string:
            out[device.name] = uuid.string
    return out


class InventoryScanner:
    """Discovers the node's devices and publishes them (see the module docstring)."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        previous: Previous,
        publish: Publish,
        scan: Callable[[AgentConfig], ScanResult] = discover,
        listeners: list[ScanListener] | None = None,
    ) -> None:
        self.previous = previous
        self.publish = publish
        self.config = config
        self.scan = scan
        self.listeners = list(listeners or [])
        self.publisher: Publisher | None = None
        self.inventory: ScanResult | None = None
        self.scans = 0

    async def scan_once(self) -> Changes | None:
        """One scan: discover, tell the listeners, append what changed (None: skipped)."""
        if self.publisher is None:
            self.publisher = Publisher(self.config, await self.previous())
        try:
            inventory = await asyncio.to_thread(self.scan, self.config)
        except (InventoryError, OSError) as exc:
            log.warning("inventory scan skipped, keeping what was published: %s", exc)
            return None
        self.inventory = inventory
        self.scans += 1
        for listener in self.listeners:
            listener(inventory)
        changes = self.publisher.plan(inventory)
        if changes.changed:
            await self._append(changes)
            self.publisher.commit(changes)
            log.info(
                "inventory: published %d pool(s) of node %s",
                len(changes.pools),
                self.config.node_name,
            )
        return changes

    async def run(self, stop: asyncio.Event, interval: float) -> None:
        """Scan every ``interval`` s until ``stop`` is set (the first scan is the caller's)."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await wait_for(stop.wait(), interval)
            if stop.is_set():
                return
            try:
                await self.scan_once()
            except RetryableError as exc:  # the service or the bus is away: next scan
                log.warning("inventory scan not recorded: %s", exc)
            except Exception:  # nothing must end the agent: next scan
                log.exception("inventory scan failed")

    async def _append(self, changes: Changes) -> None:
        batches: list[tuple[str, list[Event]]] = []
        for event in changes.events():
            stream = stream_of(event)
            if batches and batches[-1][0] == stream:
                batches[-1][1].append(event)
            else:
                batches.append((stream, [event]))
        await self.publish(batches)
