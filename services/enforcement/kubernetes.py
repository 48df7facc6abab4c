"""The node agent in Kubernetes mode: its kubelet plugins and its ResourceSlices on the API server.

``dracap agent --kubelet-plugin`` runs, beside the agent's own loop:

* one :class:`~services.runtime.kubeletplugin.KubeletPlugin` per driver the agent serves
  (``--driver``, else the drivers of its config), each with the registration socket
  ``<registration-dir>/<driver>-reg.sock`` and the endpoint
  ``<plugins-dir>/<driver>/dra.sock``, answering through a
  :class:`~services.enforcement.kubelet.KubeletDriver`. They start only once the agent
  holds its lease and has reconciled, so the kubelet's first call meets an agent that
  knows what is in force;
* :class:`SlicePublisher`: at start and whenever the agent reports a change of this
  node's ResourceSlices (its inventory scan publishes them into the log), the API server
  is made to hold exactly those the log has, as a view of the node shows them
  (:func:`~services.runtime.kube.slices.sync_slices`: the pool's generation goes up on
  every change, never on a resync that changes nothing).
  kube-scheduler allocates from what this publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Final

from events.catalog import Event
from events.model import ResourceSlice
from events.state import ClusterState
from events.transitions import SliceChanged, events_meaning
from services.enforcement.agent import Agent
from services.enforcement.cdi import CdiSpecs
from services.enforcement.kubelet import KubeletDriver
from services.enforcement.protocol import ViewAsk
from services.runtime.ground.waiting import wait_for
from services.runtime.kube.client import KubeApi
from services.runtime.kube.errors import KubeApiError
from services.runtime.kube.slices import sync_slices
from services.runtime.kubeletplugin import KubeletPlugin

__all__ = ["SlicePublisher", "node_slices", "run_kubernetes_mode"]

log = logging.getLogger("dracap.agent.kubernetes")

#: Seconds between tries of a slice sync the API server refused or could not take.
RESYNC_S: Final = 5.0
#: The agent's reports that change this node's slices.
_SLICES_CHANGED: Final = events_meaning(SliceChanged)


def node_slices(state: ClusterState, node: str, driver: str) -> list[ResourceSlice]:
    """The slices the log holds for ``driver`` on ``node``, by name."""
    return [
        s
        for name, s in sorted(state.slices.items())
        if s.spec.driver == driver and s.spec.node_name == node
    ]


class SlicePublisher:
    """Keeps the API server's ResourceSlices of one node equal to the log's."""

    def __init__(self, agent: Agent, api: KubeApi, drivers: Collection[str]) -> None:
        self.agent = agent
        self.api = api
        self.drivers = sorted(drivers)
        self._changed = asyncio.Event()
        self._changed.set()  # one sync at start
        agent.on_report(self._on_report)
        #: the pool generation each driver's last sync left on the server
        self.generations: dict[str, int] = {}

    def _on_report(self, events: Sequence[Event]) -> None:
        if any(type(e) in _SLICES_CHANGED for e in events):
            self._changed.set()

    async def sync(self) -> None:
        """Make the server hold this node's slices of every driver, as the log has them."""
        state = (await self.agent.view(ViewAsk(node=True))).state()
        for driver in self.drivers:
            desired = node_slices(state, self.agent.node, driver)
            done = await sync_slices(self.api, driver, self.agent.node, desired)
            self.generations[driver] = done.generation
            log.info(
                "ResourceSlices of %s on %s %s generation %d",
                driver,
                self.agent.node,
                "written at" if done.changed else "in sync at",
                done.generation,
            )

    async def run(self, stop: asyncio.Event) -> None:
        """Sync at start and after every change, until ``stop``; a failure is retried."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await wait_for(self._changed.wait(), RESYNC_S)
            if stop.is_set():
                return
            if not self._changed.is_set():
                continue
            self._changed.clear()
            try:
                await self.sync()
            except KubeApiError as exc:
                log.warning("ResourceSlices not synced (%s); trying again", exc)
                self._changed.set()
                with contextlib.suppress(TimeoutError):
                    await wait_for(stop.wait(), RESYNC_S)


async def run_kubernetes_mode(
    agent: Agent,
    api: KubeApi,
    stop: asyncio.Event,
    *,
    drivers: Collection[str],
    registration_dir: Path,
    plugins_dir: Path,
    cdi: CdiSpecs,
) -> None:
    """Serve the kubelet plugins and publish slices until ``stop`` (see the module)."""
    await agent.lease.held.wait()
    plugins = [
        KubeletPlugin(
            driver,
            KubeletDriver(agent, api, drivers={driver}, cdi_dir=cdi),
            registration_dir=registration_dir,
            plugin_dir=plugins_dir / driver,
        )
        for driver in sorted(drivers)
    ]
    publisher = SlicePublisher(agent, api, drivers)
    started: list[KubeletPlugin] = []
    try:
        for plugin in plugins:
            await plugin.start()
            started.append(plugin)
            log.info("kubelet plugin %s serving at %s", plugin.driver_name, plugin.endpoint)
        await publisher.run(stop)
    finally:
        for plugin in started:
            await plugin.stop()
