"""Device health and observed use, through the agent subprocess and a real kernel.

The stack of ``test_node_loss`` (the agent a subprocess with the tc enforcer on a veth,
checking health and use every 0.3 s):

* traffic sent with a share's firewall mark goes through its HTB class; the agent sees
  the class's byte counter move and records ``ShareUsed`` once — that is what "the
  claim started" means to the not-started timeout;
* the veth is deleted: the enforcer's read-back fails, the agent records the device
  unhealthy with the reason, the claim holding a share there shows a ``DeviceHealthy``
  False condition, and a new claim is not placed there and says why.

Skipped, with the reason, without CAP_NET_ADMIN (or veth/HTB/cls_bpf).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from events import catalog as c
from events.envelopes import node_stream
from events.state import ClusterState
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.settings import Settings
from tests.integration.test_agent_restart import NAMESPACE, ready
from tests.integration.test_node_loss import Lossy, phases

pytest_plugins = ["tests.fixtures.netns"]

SO_MARK = 36


@pytest.fixture
async def node(settings: Settings, nats_url: str, tmp_path: Path) -> AsyncIterator[Lossy]:
    from tests.fixtures.netns import require_net_admin

    require_net_admin()
    settings = msgspec.structs.replace(settings, pool_max_size=4)
    nc, js = await connect_bus(nats_url)
    stack = Lossy(settings, nats_url, nc, js, tmp_path)
    stack.speed = "10G"
    stack.policy = {"default": "1G", "validValues": ["1G", "4G"]}
    stack.agent_args = ["--health-interval", "0.3"]
    try:
        stack.make_link()
        stack.write_config()
        await stack.start()
        stack.start_agent()
        await stack.until(
            lambda st: any(s.spec.node_name == stack.node for s in st.slices.values())
        )
        yield stack
    finally:
        await stack.close()
        stack.remove_link()
        await nc.close()


def _address(stack: Lossy) -> str:
    """Give the veth an address (and its peer the next one); the peer's address."""
    peer = f"dcp{stack.iface[3:]}"
    octet = int(stack.node[-2:], 16)  # keep parallel runs apart
    subprocess.run(["ip", "addr", "add", f"10.213.{octet}.1/30", "dev", stack.iface], check=True)
    subprocess.run(
        ["ip", "-n", stack.netns, "addr", "add", f"10.213.{octet}.2/30", "dev", peer], check=True
    )
    subprocess.run(["ip", "-n", stack.netns, "link", "set", peer, "up"], check=True)
    return f"10.213.{octet}.2"


def _send(address: str, mark: int, datagrams: int = 20) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, SO_MARK, struct.pack("I", mark))
        for _ in range(datagrams):
            sock.sendto(b"x" * 512, (address, 9))


async def test_traffic_through_a_share_is_recorded_as_its_use_once(node: Lossy) -> None:
    stack = node
    await stack.apply("busy", "1G")
    await stack.apply("quiet", "1G")
    await stack.until(ready("busy", "quiet"))
    [busy] = stack.share_ids(stack.view.state, "busy")
    [quiet] = stack.share_ids(stack.view.state, "quiet")
    mark = await stack.tc.mark_of(busy)
    assert mark is not None
    address = _address(stack)
    await asyncio.to_thread(_send, address, mark)
    await stack.until(lambda st: st.shares[busy].used)
    await asyncio.to_thread(_send, address, mark)  # more traffic: no second record
    await asyncio.sleep(1.0)  # three more checks of the agent
    used = await stack.events_of(node_stream(stack.node), c.ShareUsed)
    assert [e.event.share_id for e in used] == [busy]
    assert "bytes through its limit" in used[0].event.evidence
    assert not stack.view.state.shares[quiet].used
    await stack.verify_clean()


async def _claim_with_a_condition(stack: Lossy, name: str, within: float = 30.0) -> Any:
    """The claims service's view of ``name`` once it shows a condition.

    The claims service folds the health change from its own subscription, which may
    trail the test's view by a moment: ask again until it shows, within a bound.
    """
    subject = stack.names.api(NAMESPACE, "get")
    body = json.dumps({"name": name}).encode()
    deadline = asyncio.get_running_loop().time() + within
    while True:
        view = json.loads((await stack.nc.request(subject, body, timeout=10)).data)["claim"]
        if view["conditions"] or asyncio.get_running_loop().time() > deadline:
            return view
        await asyncio.sleep(0.1)


def _unhealthy(state: ClusterState) -> bool:
    return any(d.unhealthy for d in state.devices.values())


async def test_a_device_whose_interface_is_gone_is_unhealthy_and_takes_no_share(
    node: Lossy,
) -> None:
    stack = node
    await stack.apply("holder", "4G")
    await stack.until(ready("holder"))
    await asyncio.to_thread(subprocess.run, ["ip", "link", "del", stack.iface], check=True)
    await stack.until(_unhealthy)
    [change] = await stack.events_of(node_stream(stack.node), c.DeviceHealthChanged)
    assert not change.event.healthy and f"interface {stack.iface} is gone" in change.event.reason
    assert change.actor.startswith(f"agent:{stack.node}#")

    view = await _claim_with_a_condition(stack, "holder")
    [condition] = view["conditions"]
    assert (condition["type"], condition["status"]) == ("DeviceHealthy", "False")
    assert "is gone" in condition["message"] and view["shares"][0]["unhealthy"]

    await stack.apply("late", "1G")
    await stack.until(phases(late="unschedulable"))
    reason = stack.view.state.claim(NAMESPACE, "late").reason  # type: ignore[union-attr]
    assert reason is not None and "reported unhealthy by their node agent" in reason
    await stack.verify_clean()
