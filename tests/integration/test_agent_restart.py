"""The node agent restarts without disturbing the limits it enforces (tc, a real kernel).

The agent runs as a **subprocess** (``python -m services.cli agent --enforcer tc``)
against real nats-server only; the relay, the claims API, a reservation worker and the
enforcement service the agent talks to run in-process on real PostgreSQL under a unique
subject prefix (as in ``test_pipeline``). The
agent's config makes discovery publish a veth interface created for the test in the
root namespace (its peer lives in a fresh namespace), so the tc enforcer gets its
device -> interface map from the ``ifName`` attribute, and claims for bandwidth become
``Ready`` through the whole stack. Then the agent is killed with SIGKILL and restarted:

* with an orphan share (an HTB class and a labelled filter no live share owns) added
  by hand: the running shares' classes are never removed (the kernel is sampled the
  whole time), no second ``LimitApplied`` is written, the orphan is removed and
  ``EnforcementReconciled`` records it;
* with the checkpoint file corrupted: it is set aside (moved, an
  ``EnforcementCheckpointSetAside`` event) and rebuilt from kernel and log.

Skipped, with the reason, without CAP_NET_ADMIN (or veth/HTB/cls_bpf).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from nats.aio.client import Client
from nats.js import JetStreamContext

from events.catalog import EnforcementCheckpointSetAside, EnforcementReconciled, LimitApplied
from events.envelopes import Envelope, node_stream
from events.state import ClusterState
from events.subjects import BusNames
from services.claims.api import ClaimsApi
from services.enforcement import checkpointing
from services.enforcement.protocol import consumer_name
from services.enforcement.tc import (
    HTB_MAJOR,
    TcEnforcer,
    candidate_minors,
    encode_program,
    parse_class_text,
)
from services.replay.verify import summary, verify
from services.reservation.service import ReservationService
from services.runtime.bus.jetstream import connect_bus, ensure_stream
from services.runtime.delivery.pulling import Puller
from services.runtime.delivery.relaying import Relay
from services.runtime.ground.settings import Settings
from services.runtime.store.livestate import HEAD, LiveState
from tests.fixtures.contexts import folded, handed
from tests.fixtures.links import (
    HostVeth,
    InProcessServices,
    agent_logs,
    kill,
    start_agent,
    vnic_config,
)

pytest_plugins = ["tests.fixtures.netns"]

DRIVER = "vnic.dracap.io"
CLASS = "bandwidth.dracap.io"
NAMESPACE = "tenant-a"


def _tc(*argv: str) -> str:
    return subprocess.run(["tc", *argv], check=True, capture_output=True, text=True).stdout


def _claim(name: str, bandwidth: str) -> bytes:
    request = {"deviceClassName": CLASS, "capacity": {"requests": {"bandwidth": bandwidth}}}
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "net", "exactly": request}]}},
    }
    return yaml.safe_dump(doc).encode()


class Node(InProcessServices):
    """The test's stack: in-process services, a veth, and the agent as a subprocess."""

    def __init__(
        self, settings: Settings, nats_url: str, nc: Client, js: JetStreamContext, tmp: Path
    ) -> None:
        super().__init__(settings)
        tag = uuid.uuid4().hex[:8]
        self.nats_url = nats_url
        self.nc = nc
        self.js = js
        self.names = BusNames(f"t{tag}")
        self.node = f"node-{tag}"
        self.iface = f"dcr{tag}"
        self.netns = f"dcrns{tag}"
        self.link = HostVeth(self.iface, self.netns, f"dcp{tag}")
        self.tmp = tmp
        self.checkpoint = tmp / "agent.checkpoint.json"
        self.config = tmp / "agent-config.yaml"
        self.agent: subprocess.Popen[bytes] | None = None
        self.starts = 0
        #: extra flags of every agent start; the interface's speed and the class policy
        self.agent_args: list[str] = []
        self.speed = "1G"
        self.policy: dict[str, Any] = {"default": "10M", "validValues": ["10M", "20M"]}
        self.tc = TcEnforcer({(DRIVER, f"{self.node}-vnic", self.iface): self.iface})

    # -- setup
    def make_link(self) -> None:
        self.link.create()

    def remove_link(self) -> None:
        self.link.remove()

    def write_config(self) -> None:
        config = vnic_config(self.node, DRIVER, self.iface, self.speed, self.policy)
        self.config.write_text(yaml.safe_dump(config))

    async def start(self) -> None:
        await ensure_stream(self.js, self.names)
        relay_store, api_store, worker_store = [await self._store() for _ in range(3)]
        self._run(Relay(handed(relay_store, self.names, js=self.js)).run)
        self.api = ClaimsApi(folded(api_store, self.names, self.nc), tail=True)
        await self.api.start()
        self._run(self.api.run)
        worker = ReservationService(folded(worker_store, self.names, js=self.js))
        self._run(worker.run)
        self.enforcement = await self._enforcement(self.nc, self.js, self.names)
        self.store = await self._store()
        self.view = LiveState(self.store)
        device_class = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": CLASS},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
        }
        await self.admin("deviceclasses.apply", yaml.safe_dump(device_class).encode())
        await self.admin("namespaces.access", {"namespace": NAMESPACE, "classes": ["*"]})

    async def close(self) -> None:
        self.kill_agent()
        await self._stop_services()
        with contextlib.suppress(Exception):
            await self.js.delete_stream(self.names.stream)

    # -- the agent subprocess
    def start_agent(self) -> None:
        self.starts += 1
        with socket.socket() as probe:  # a free port for the agent's metrics endpoint
            probe.bind(("127.0.0.1", 0))
            self.metrics_port = probe.getsockname()[1]
        self.agent = start_agent(
            self.tmp, self.starts, self.names, self.node, self.nats_url,
            "--config", str(self.config), "--checkpoint", str(self.checkpoint),
            "--metrics-port", str(self.metrics_port), *self.agent_args,
        )  # fmt: skip

    def kill_agent(self) -> None:
        kill(self.agent)
        self.agent = None

    def agent_log(self) -> str:
        return agent_logs(self.tmp)

    # -- talking to the stack
    async def admin(self, op: str, payload: bytes | dict[str, Any]) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        reply = json.loads((await self.nc.request(self.names.admin(op), body, timeout=10)).data)
        assert reply["ok"], reply

    async def apply(self, name: str, bandwidth: str) -> None:
        body = _claim(name, bandwidth)
        subject = self.names.api(NAMESPACE, "apply")
        reply = json.loads((await self.nc.request(subject, body, timeout=10)).data)
        assert reply["ok"], reply

    async def until(self, check: Callable[[ClusterState], bool], within: float = 60) -> None:
        deadline = time.monotonic() + within
        while True:
            if check(await self.view.fresh(HEAD)):
                return
            if self.agent is not None and self.agent.poll() is not None:
                raise AssertionError(f"the agent exited:\n{self.agent_log()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"condition not reached in time; {self.describe()}\nagent:\n{self.agent_log()}"
                )
            await self.store.wait_for_new(self.view.state.position, min(left, 0.2))

    def describe(self) -> str:
        """The claims and shares as the test's view has them (for a failure's message)."""
        state = self.view.state
        claims = [
            f"{c.name}={c.phase}:{','.join(c.share_ids)}"
            for (ns, _), c in sorted(state.claims.items())
            if ns == NAMESPACE
        ]
        shares = [f"{s.share_id}={s.state}" for s in state.shares.values()]
        return f"at position {state.position}: claims {claims}, shares {shares}"

    async def node_events(self) -> list[Envelope]:
        return await self.store.read_stream(node_stream(self.node))

    async def until_event(self, kind: type[Any], count: int = 1) -> list[Any]:
        found: list[Any] = []

        def seen(_: ClusterState) -> bool:
            return len(found) >= count

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = [e.event for e in await self.node_events() if isinstance(e.event, kind)]
            if seen(self.view.state):
                return found
            if self.agent is not None and self.agent.poll() is not None:
                raise AssertionError(f"the agent exited:\n{self.agent_log()}")
            await asyncio.sleep(0.1)
        raise AssertionError(f"no {kind.__name__} event; agent:\n{self.agent_log()}")

    def share_ids(self, state: ClusterState, *names: str) -> list[str]:
        out: list[str] = []
        for name in names:
            claim = state.claim(NAMESPACE, name)
            assert claim is not None
            out += claim.share_ids
        return sorted(out)


def ready(*names: str) -> Callable[[ClusterState], bool]:
    def check(state: ClusterState) -> bool:
        claims = [state.claim(NAMESPACE, n) for n in names]
        return all(c is not None and c.phase == "ready" for c in claims)

    return check


@pytest.fixture
async def node(settings: Settings, nats_url: str, tmp_path: Path) -> AsyncIterator[Node]:
    from tests.fixtures.netns import require_net_admin  # registered as a plugin above

    require_net_admin()
    settings = msgspec.structs.replace(settings, pool_max_size=4)
    nc, js = await connect_bus(nats_url)
    stack = Node(settings, nats_url, nc, js, tmp_path)
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


class KernelSampler:
    """Reads the interface's HTB classes in a loop; records any moment a class is gone."""

    def __init__(self, iface: str, minors: set[int]) -> None:
        self.iface = iface
        self.minors = minors
        self.samples = 0
        self.missing: list[set[int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            out = _tc("-j", "class", "show", "dev", self.iface)
            if out.lstrip().startswith("["):  # iproute2 >= 6.3 prints classes as JSON
                doc = json.loads(out)
                held = {int(str(c["handle"]).partition(":")[2], 16) for c in doc if "handle" in c}
            else:
                held = {c.minor for c in parse_class_text(out)}
            if not self.minors <= held:
                self.missing.append(self.minors - held)
            self.samples += 1
            time.sleep(0.01)

    def __enter__(self) -> KernelSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def add_orphan(iface: str, share_id: str, taken: set[int]) -> int:
    """An HTB class and a labelled filter for ``share_id``, as a lost agent would leave."""
    minor = next(m for m in candidate_minors(share_id) if m not in taken)
    handle = f"{HTB_MAJOR:x}:{minor:x}"
    _tc("class", "add", "dev", iface, "parent", f"{HTB_MAJOR:x}:", "classid", handle,
        "htb", "rate", "1mbit", "ceil", "1mbit")  # fmt: skip
    program = encode_program(minor << 16, 0xFFFF << 16, share_id)
    code = ",".join([str(len(program))] + [f"{c} {t} {f} {k}" for c, t, f, k in program])
    _tc("filter", "add", "dev", iface, "parent", f"{HTB_MAJOR:x}:", "protocol", "all",
        "pref", str(minor), "handle", "1", "bpf", "bytecode", code, "classid", handle)  # fmt: skip
    return minor


async def test_restart_keeps_limits_and_removes_orphans(node: Node, settings: Settings) -> None:
    await node.apply("web", "10M")
    await node.apply("db", "20M")
    await node.until(ready("web", "db"))
    # the standalone agent serves its own metrics: two limits applied, two claims ready
    # (counted once the agent's commit has returned: a moment after the log says ready)
    url = f"http://127.0.0.1:{node.metrics_port}/metrics"
    counted = f'dracap_enforcement_latency_seconds_count{{class="{CLASS}"}} 2.0'
    async with asyncio.timeout(30):
        while counted not in (text := await asyncio.to_thread(_get, url)):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    assert 'dracap_claims_total{outcome="ready"} 2.0' in text
    shares = node.share_ids(node.view.state, "web", "db")
    observed = await node.tc.observe()
    assert sorted(observed) == shares
    assert {str(observed[s].actual["bandwidth"]) for s in shares} == {"10M", "20M"}
    minors = {f.minor for f in await node.tc.filters(node.iface)}

    node.kill_agent()
    orphan = f"orphan-{uuid.uuid4().hex[:8]}"
    add_orphan(node.iface, orphan, minors)
    assert orphan in await node.tc.observe()

    with KernelSampler(node.iface, minors) as sampler:
        node.start_agent()
        (report,) = await node.until_event(EnforcementReconciled)
        await asyncio.sleep(0.5)  # the consumer's redeliveries, if any, are handled
    assert sampler.samples > 10 and sampler.missing == [], sampler.missing
    assert isinstance(report, EnforcementReconciled)
    assert report.kept == shares and report.reapplied == [] and report.failed == []
    assert report.removed_orphans == [orphan]

    after = await node.tc.observe()
    assert sorted(after) == shares  # the orphan is gone, the shares still enforced
    applied = [e.event for e in await node.node_events() if isinstance(e.event, LimitApplied)]
    assert sorted(e.share_id for e in applied) == shares  # one LimitApplied each, ever
    saved = checkpointing.load(node.checkpoint)
    assert saved.warning is None and sorted(saved.entries) == shares
    assert {e.phase for e in saved.entries.values()} == {"completed"}
    report_ok = await verify(settings, from_start=True)
    assert report_ok.ok, summary(report_ok)


async def test_a_bound_share_whose_message_was_taken_is_applied_at_reconcile(
    node: Node,
) -> None:
    """A share's ``AllocationBound`` can be taken with nothing done: while the share was
    ``unknown`` (the node's lease expired before its agent noticed; CI saw a claim
    ``allocated`` for good that way after the stream's leader hung). The agent's
    reconcile applies every ``bound`` share of its node, so the claim is still made
    ready. Here the message is taken and acknowledged by hand while the agent is away."""
    node.kill_agent()
    await node.apply("late", "10M")
    await node.until(
        lambda st: (c := st.claim(NAMESPACE, "late")) is not None and c.phase == "allocated"
    )
    durable = consumer_name(node.node)
    async with asyncio.timeout(30):  # the relay has published the claim's AllocationBound
        while (await node.js.consumer_info(node.names.stream, durable)).num_pending < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    puller = Puller(node.nc, node.names.stream, durable, batch=16, expires=5.0)
    await puller.start()
    try:
        taken = 0
        async with asyncio.timeout(30):  # every pending message taken and acknowledged
            while (await node.js.consumer_info(node.names.stream, durable)).num_pending:
                for msg in await puller.next(1.0, 16):
                    await msg.ack_sync()
                    taken += 1
        assert taken >= 1
    finally:
        await puller.stop()
    [share] = node.share_ids(node.view.state, "late")
    assert node.view.state.shares[share].state == "bound"

    node.start_agent()
    await node.until(ready("late"))
    assert share in await node.tc.observe()
    applied = [e.event for e in await node.node_events() if isinstance(e.event, LimitApplied)]
    assert [e.share_id for e in applied] == [share]


async def test_corrupt_checkpoint_is_set_aside_and_rebuilt(node: Node) -> None:
    await node.apply("web", "10M")
    await node.until(ready("web"))
    shares = node.share_ids(node.view.state, "web")
    assert sorted(checkpointing.load(node.checkpoint).entries) == shares

    node.kill_agent()
    node.checkpoint.write_bytes(b'{"version": 1, "checksum": "sha256:00", "body": {"boot')
    node.start_agent()
    (aside,) = await node.until_event(EnforcementCheckpointSetAside)
    (report,) = await node.until_event(EnforcementReconciled)

    assert isinstance(aside, EnforcementCheckpointSetAside)
    assert aside.node == node.node and aside.path == str(node.checkpoint)
    assert aside.reason == "corrupt" and aside.moved_to is not None
    moved = await asyncio.to_thread(Path(aside.moved_to).read_bytes)
    assert moved.startswith(b'{"version": 1')
    assert report.kept == shares and report.reapplied == [] and report.removed_orphans == []
    assert sorted(await node.tc.observe()) == shares
    rebuilt = checkpointing.load(node.checkpoint)
    assert rebuilt.warning is None and sorted(rebuilt.entries) == shares
    applied = [e.event for e in await node.node_events() if isinstance(e.event, LimitApplied)]
    assert [e.share_id for e in applied] == shares
