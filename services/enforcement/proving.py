"""Proving bandwidth limits: network namespaces, a traffic generator, measurements.

``dracap prove bandwidth`` (:mod:`services.commands.prove`) and the tc
integration tests use this module to show, on the machine they run on, that a share's
HTB class really delivers its rate — no more, no less — whatever its neighbours do.

Design
------
* **A lab of two namespaces.** :class:`NetnsPair` creates ``<tag>-tx`` and ``<tag>-rx``
  joined by a veth pair with TEST-NET-1 addresses (192.0.2.1 and 192.0.2.2: no packet
  ever leaves the namespaces) and deletes both on exit, veth included. The enforcer
  shapes the egress of the sender's veth (``tc -n <tag>-tx``), exactly as it would a
  node's vNIC.
* **Shares through the control plane.** :func:`prove_bandwidth` applies its claims
  through the real services it is handed (:data:`ControlPlane`; ``dracap prove``
  composes them in :func:`services.commands.prove.control_plane`: by default
  :class:`services.stack.Stack` in-process — relay, live state, claims and admin APIs, a
  reservation worker — plus one node agent for ``prove-node`` whose enforcer is the
  lab's :class:`TcEnforcer`; or only that agent, next to services already running).
  Composing services belongs to the layer above them, so the enforcement package
  imports no other service. It publishes a DeviceClass and a ResourceSlice with one
  shareable device ``veth0`` (capacity ``bandwidth``, attribute ``ifName``) through
  the admin API, applies one ResourceClaim per rate through the tenant API (pinned to
  the lab's ``ifName``), waits for each to be Ready — the agent's
  ``LimitApplied`` at level ``hard`` in the fold — and takes the mark of its ShareID
  from the enforcer (``mark_of``). At the end it deletes the claims, waits until the
  device's capacity is all free again and withdraws the device (the slice again,
  without devices).
* **Traffic.** Two small Python programs run inside the namespaces through
  ``ip netns exec``: a receiver (one TCP listener per flow, bytes counted in 100 ms bins
  of wall-clock time, plus an echo server for the probe) and a sender (one thread per
  flow; each socket sets ``SO_MARK`` to its share's mark before connecting, as the
  CNI's rule would, and writes as fast as TCP lets it: every flow saturates its class).
  The probe is a 64-byte TCP request/response every 10 ms in a class of its own; its
  round trips give the latency figure.
* **Counting what HTB counts.** HTB limits link-layer bytes (Ethernet header included).
  The receiver counts TCP payload, so its figures are scaled by ``(MTU + 14) / MSS``
  (1514/1448 with TCP timestamps): bulk segments are all full-sized. The kernel's class
  counters (``tc -s class show``) are read before and after as a cross-check, with the
  drops.
* **Figures per share**: the mean rate over the measurement window (after a 1 s
  warm-up) against the configured rate, the worst per-second deviation after the first
  second, the first-second overshoot (bytes of second one over the rate), drops, the
  mean rate alone (baseline) against the rate with every neighbour saturating
  (interference), and the probe's p50/p99 round trip. The time an ``apply`` takes to
  change a live share's rate (``tc class replace`` plus the read-back, on the agent's
  enforcer directly) is measured too, and per claim the control plane's time from the
  tenant API's ``apply`` to the claim being Ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

import msgspec

from events import model
from events.quantities import Quantity
from events.state import TERMINAL_PHASES
from services.enforcement.enforcers import ShareLimit
from services.enforcement.tc import Backend, TcEnforcer
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.ground.waiting import wait_for

__all__ = [
    "DRIVER",
    "ControlPlane",
    "Flow",
    "LoadResult",
    "NetnsPair",
    "ProbeResult",
    "ProofReport",
    "ShareFigures",
    "apply_until_ready",
    "claim_manifest",
    "device_manifests",
    "have_net_admin",
    "prove_bandwidth",
    "release_claims",
    "run_load",
]

DRIVER: Final = "net.dracap.io"
TX_ADDR: Final = "192.0.2.1"
RX_ADDR: Final = "192.0.2.2"
BIN: Final = 0.1  # seconds per receiver bin

RECEIVER: Final = r"""
import json, socket, sys, threading, time
cfg = json.loads(sys.argv[1])
t0, bin_, n = cfg["t0"], cfg["bin"], cfg["bins"]
socket.setdefaulttimeout(cfg["deadline"])
res = {}
def bulk(ls, port):
    conn, _ = ls.accept()
    bins = [0] * n
    buf = bytearray(1 << 20)
    while True:
        k = conn.recv_into(buf)
        if not k:
            break
        i = int((time.time() - t0) / bin_)
        if 0 <= i < n:
            bins[i] += k
    res[str(port)] = bins
def echo(ls):
    conn, _ = ls.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        d = conn.recv(4096)
        if not d:
            break
        conn.sendall(d)
threads = []
for port in cfg["ports"]:
    ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((cfg["addr"], port)); ls.listen(1)
    threads.append(threading.Thread(target=bulk, args=(ls, port)))
if cfg.get("echo"):
    ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((cfg["addr"], cfg["echo"])); ls.listen(1)
    threading.Thread(target=echo, args=(ls,), daemon=True).start()
for t in threads:
    t.start()
print("ready", flush=True)
for t in threads:
    t.join()
print(json.dumps(res), flush=True)
"""

SENDER: Final = r"""
import json, os, socket, struct, sys, threading, time
cfg = json.loads(sys.argv[1])
t0 = cfg["t0"]
def _fail(args):
    sys.stderr.write(f"{args.thread.name}: {args.exc_type.__name__}: {args.exc_value}\n")
    sys.stderr.flush()
    os._exit(1)
threading.excepthook = _fail
out = {"mss": {}, "rtt": []}
def until(t):
    d = t - time.time()
    if d > 0:
        time.sleep(d)
def connect(port, mark):
    s = socket.socket()
    if mark:
        s.setsockopt(socket.SOL_SOCKET, 36, struct.pack("I", mark))  # SO_MARK
    s.connect((cfg["addr"], port))
    return s
def bulk(f):
    s = connect(f["port"], f["mark"])
    out["mss"][str(f["port"])] = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
    until(t0 + f["start"])
    data = b"\0" * (256 << 10)
    end = t0 + f["stop"]
    while time.time() < end:
        s.sendall(data)
    s.close()
def probe(p):
    s = connect(p["port"], p["mark"])
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    until(t0 + p["start"])
    msg = b"x" * 64
    while time.time() < t0 + p["stop"]:
        a = time.perf_counter()
        s.sendall(msg)
        got = 0
        while got < 64:
            got += len(s.recv(64 - got))
        out["rtt"].append(time.perf_counter() - a)
        time.sleep(p["interval"])
    s.close()
ts = [threading.Thread(target=bulk, args=(f,)) for f in cfg["flows"]]
if cfg.get("probe"):
    ts.append(threading.Thread(target=probe, args=(cfg["probe"],)))
for t in ts:
    t.start()
for t in ts:
    t.join()
print(json.dumps(out), flush=True)
"""


def have_net_admin() -> str | None:
    """None when namespaces, veth and tc can be used here; else why not."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"the {tool} command (iproute2) is not installed"
    return None


async def _sh(*argv: str, check: bool = True) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {err.decode().strip()}")
    return out.decode()


class NetnsPair:
    """Two network namespaces joined by a veth pair (see the module docstring)."""

    def __init__(self, tag: str | None = None, *, mtu: int = 1500) -> None:
        self.tag = tag or "dcap" + secrets.token_hex(3)
        self.tx_ns = f"{self.tag}-tx"
        self.rx_ns = f"{self.tag}-rx"
        self.tx_if = f"{self.tag}t"[:15]
        self.rx_if = f"{self.tag}r"[:15]
        self.mtu = mtu

    async def __aenter__(self) -> NetnsPair:
        try:
            await _sh("ip", "netns", "add", self.tx_ns)
            await _sh("ip", "netns", "add", self.rx_ns)
            await _sh("ip", "link", "add", self.tx_if, "netns", self.tx_ns, "mtu", str(self.mtu),
                      "type", "veth", "peer", "name", self.rx_if, "netns", self.rx_ns,
                      "mtu", str(self.mtu))  # fmt: skip
            for ns, dev, addr in (
                (self.tx_ns, self.tx_if, TX_ADDR),
                (self.rx_ns, self.rx_if, RX_ADDR),
            ):
                await _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                await _sh("ip", "-n", ns, "link", "set", dev, "up")
                await _sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Delete both namespaces (and with them the veth pair); safe to call twice."""
        for ns in (self.tx_ns, self.rx_ns):
            await _sh("ip", "netns", "del", ns, check=False)

    def enforcer(self, *, default_rate: int = 10 * 10**9, **kwargs: Any) -> TcEnforcer:
        """A tc enforcer for the sender's veth, as device ``net.dracap.io/<tag>/veth0``."""
        return TcEnforcer(
            {(DRIVER, self.tag, "veth0"): self.tx_if},
            netns=self.tx_ns,
            default_rate=default_rate,
            **kwargs,
        )

    def limit(self, share_id: str, rate: str | Quantity, *, device: str = "veth0") -> ShareLimit:
        """A share of ``rate`` bit/s on the lab's device."""
        amount = rate if isinstance(rate, Quantity) else Quantity.parse(rate)
        return ShareLimit(
            share_id=share_id,
            driver=DRIVER,
            pool=self.tag,
            device=device,
            consumed={"bandwidth": amount},
        )


@dataclass(frozen=True)
class Flow:
    """One bulk flow: its name, the mark on its packets, when it runs (s after t0)."""

    name: str
    mark: int
    start: float
    stop: float


@dataclass
class ProbeResult:
    """Round trips of the probe flow, in seconds."""

    rtts: list[float] = field(default_factory=list)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (nearest rank), None without samples."""
        if not self.rtts:
            return None
        ordered = sorted(self.rtts)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class LoadResult:
    """Link-layer bytes per 100 ms bin of each flow (from t0), and the probe's round trips."""

    bins: dict[str, list[float]]
    probe: ProbeResult

    def rate(self, name: str, start: float, stop: float) -> float:
        """Mean link-layer bit/s of flow ``name`` between ``start`` and ``stop``."""
        b = self.bins[name][round(start / BIN) : round(stop / BIN)]
        return sum(b) * 8 / (stop - start)

    def per_second(self, name: str, start: float, stop: float) -> list[float]:
        """Bit/s of flow ``name`` in each whole second from ``start`` to ``stop``."""
        return [self.rate(name, s, s + 1.0) for s in range(math.ceil(start), math.floor(stop))]


async def run_load(
    pair: NetnsPair,
    flows: Sequence[Flow],
    *,
    probe_mark: int | None = None,
    probe_window: tuple[float, float] | None = None,
    lead: float = 0.5,
    t0: float | None = None,
) -> LoadResult:
    """Run ``flows`` (and the probe) through the pair and count what arrives.

    Times are seconds after ``t0`` (wall clock; default: ``lead`` + 0.3 s from now).
    """
    end = max([f.stop for f in flows] + [probe_window[1] if probe_window else 0.0])
    ports = {f.name: 5201 + i for i, f in enumerate(flows)}
    echo_port = 5200
    t0 = t0 if t0 is not None else time.time() + lead + 0.3
    rx_cfg = {
        "t0": t0,
        "bin": BIN,
        "bins": int(end / BIN) + 2,
        "ports": list(ports.values()),
        "addr": RX_ADDR,
        "echo": echo_port if probe_mark is not None else 0,
        "deadline": end + lead + 10,
    }
    tx_cfg: dict[str, Any] = {
        "t0": t0,
        "addr": RX_ADDR,
        "flows": [
            {"port": ports[f.name], "mark": f.mark, "start": f.start, "stop": f.stop} for f in flows
        ],
    }
    if probe_mark is not None:
        window = probe_window or (0.0, end)
        tx_cfg["probe"] = {
            "port": echo_port,
            "mark": probe_mark,
            "start": window[0],
            "stop": window[1],
            "interval": 0.01,
        }
    rx = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", pair.rx_ns, sys.executable, "-c", RECEIVER, json.dumps(rx_cfg),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    tx: asyncio.subprocess.Process | None = None
    try:
        assert rx.stdout is not None
        ready = await wait_for(rx.stdout.readline(), 10)
        if ready.strip() != b"ready":
            err = await rx.stderr.read() if rx.stderr is not None else b""
            raise RuntimeError("the receiver did not start: " + err.decode())
        tx = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", pair.tx_ns, sys.executable, "-c", SENDER, json.dumps(tx_cfg),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        tx_out, tx_err = await wait_for(tx.communicate(), end + 30)
        if tx.returncode != 0:
            raise RuntimeError("the sender failed: " + tx_err.decode())
        rx_out, rx_err = await wait_for(rx.communicate(), 30)
        if rx.returncode != 0:
            raise RuntimeError("the receiver failed: " + rx_err.decode())
    finally:
        for proc in (tx, rx):
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
    sent = json.loads(tx_out)
    received = json.loads(rx_out.decode().strip().splitlines()[-1])
    frame = pair.mtu + 14
    bins: dict[str, list[float]] = {}
    for f in flows:
        port = str(ports[f.name])
        scale = frame / int(sent["mss"][port])
        bins[f.name] = [b * scale for b in received[port]]
    return LoadResult(bins=bins, probe=ProbeResult(rtts=list(sent["rtt"])))


# -- ``dracap prove bandwidth``

NODE: Final = "prove-node"
NAMESPACE: Final = "prove"
CLASS: Final = "bandwidth.dracap.io"
WARMUP: Final = 1.0
READY_WITHIN: Final = 30.0
RELEASE_WITHIN: Final = 30.0

#: What :func:`prove_bandwidth` applies its claims through: given the lab's enforcer,
#: the services with one node agent for :data:`NODE` driving it, as a client of their
#: APIs (:func:`services.commands.prove.control_plane`).
ControlPlane: TypeAlias = Callable[[TcEnforcer], AbstractAsyncContextManager[ApiClient]]


class ShareFigures(msgspec.Struct, kw_only=True):
    """What was measured for one share (rates in bit/s, ratios as fractions)."""

    share_id: str
    claim: str  # namespace/name of the ResourceClaim that holds the share
    configured: int
    mark: int
    ready_ms: float  # claims API apply -> claim Ready (LimitApplied, level hard) in the fold
    alone: float  # mean over the window with no neighbour
    achieved: float  # mean over the window with every neighbour saturating
    accuracy: float  # achieved / configured - 1
    worst_second: float  # largest |second / configured - 1| after the first second
    first_second: float  # first second / configured (overshoot when > 1)
    kernel_rate: float  # bit/s by the class's own byte counter, loaded run
    drops: int
    interference: float  # (alone - achieved) / alone
    pushed_below: bool  # achieved fell more than 3 % below configured with neighbours


class ProofReport(msgspec.Struct, kw_only=True):
    """The whole proof: shares, the probe, the apply-time of a limit change."""

    allocation: str
    control_plane: str  # where the services ran (in-process stack / attached), the servers
    duration: float
    shares: list[ShareFigures]
    probe_rate: int
    probe_ready_ms: float
    probe_p50_ms: float | None
    probe_p99_ms: float | None
    probe_samples: int
    apply_change_ms: list[float]  # enforcer-level: tc class replace + read-back
    aggressor_rate: float  # unclassified neighbour, default class
    capacity_returned: bool  # after deleting the claims, the device's bandwidth is all free


def _bits(q: Quantity) -> int:
    return q.value()


def _encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def device_manifests(pair: NetnsPair, link: Quantity) -> tuple[bytes, bytes]:
    """The DeviceClass and the ResourceSlice (one shareable ``veth0``) of the lab, as JSON."""
    dclass = {
        "apiVersion": model.API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }
    return _encode(dclass), _slice_manifest(pair, link, generation=1)


def _slice_manifest(pair: NetnsPair, link: Quantity | None, *, generation: int) -> bytes:
    """The lab's ResourceSlice; ``link=None``: no devices (the device is withdrawn)."""
    devices = (
        [
            {
                "name": "veth0",
                "allowMultipleAllocations": True,
                "attributes": {"ifName": {"string": pair.tx_if}},
                "capacity": {"bandwidth": {"value": str(link)}},
            }
        ]
        if link is not None
        else []
    )
    return _encode(
        {
            "apiVersion": model.API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"name": f"{pair.tag}-slice"},
            "spec": {
                "driver": DRIVER,
                "nodeName": NODE,
                "pool": {"name": pair.tag, "generation": generation, "resourceSliceCount": 1},
                "devices": devices,
            },
        }
    )


def claim_manifest(pair: NetnsPair, name: str, rate: Quantity) -> bytes:
    """A ResourceClaim for ``rate`` of bandwidth on the lab's device (pinned by ifName)."""
    return _encode(
        {
            "apiVersion": model.API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "net",
                            "exactly": {
                                "deviceClassName": CLASS,
                                "selectors": [
                                    {
                                        "cel": {
                                            "expression": f'device.attributes["{DRIVER}"]'
                                            f'.ifName == "{pair.tx_if}"'
                                        }
                                    }
                                ],
                                "capacity": {"requests": {"bandwidth": str(rate)}},
                            },
                        }
                    ]
                }
            },
        }
    )


async def apply_until_ready(
    api: ApiClient, name: str, manifest: bytes, *, within: float = READY_WITHIN
) -> tuple[dict[str, Any], float]:
    """Apply a claim through the tenant API; its Ready view and ms from apply to Ready.

    The watch is subscribed before the apply, so no change is missed; a ``get`` every
    half second covers a lost publication (core NATS). Raises RuntimeError when the
    claim ends in another terminal phase, a share is not enforced ``hard``, or the
    claim is not Ready within ``within`` seconds.
    """
    async with api.claim_changes(NAMESPACE, name) as views:
        start = time.perf_counter()
        view: dict[str, Any] = (await api.claims(NAMESPACE, "apply", manifest))["claim"]
        deadline = start + within
        while not view.get("ready"):
            if view.get("phase") in TERMINAL_PHASES:
                raise RuntimeError(
                    f"claim {NAMESPACE}/{name} ended {view.get('phase')}: {view.get('reason')}"
                )
            left = deadline - time.perf_counter()
            if left <= 0:
                raise RuntimeError(
                    f"claim {NAMESPACE}/{name} not Ready within {within:g} s "
                    f"(phase {view.get('phase')})"
                )
            try:
                view = await wait_for(views.get(), min(left, 0.5))
            except TimeoutError:
                view = (await api.claims(NAMESPACE, "get", {"name": name}))["claim"]
        elapsed = (time.perf_counter() - start) * 1000
    shares = view.get("shares") or []
    if len(shares) != 1 or shares[0].get("level") != "hard":
        raise RuntimeError(f"claim {NAMESPACE}/{name} is Ready but not enforced hard: {shares}")
    return view, elapsed


async def _device_free(api: ApiClient, pool: str) -> bool:
    """Whether the lab device's bandwidth is all free (no live share holds any)."""
    for device in (await api.admin("devices.list"))["devices"]:
        if (device["driver"], device["pool"], device["device"]) == (DRIVER, pool, "veth0"):
            capacity = device["capacity"]["bandwidth"]
            return bool(Quantity.parse(capacity["consumed"]).sign() == 0 and device["shares"] == 0)
    return False


async def release_claims(
    api: ApiClient, pool: str, claims: Sequence[str], *, within: float = RELEASE_WITHIN
) -> bool:
    """Delete ``claims``; whether the device's capacity is all free again within ``within`` s."""
    for name in claims:
        with contextlib.suppress(ApiError):  # not_found: never admitted, or released
            await api.claims(NAMESPACE, "delete", {"name": name})
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await _device_free(api, pool):
            return True
        await asyncio.sleep(0.05)
    return False


def _limit_of(view: dict[str, Any]) -> ShareLimit:
    share = view["shares"][0]
    return ShareLimit(
        share_id=share["share_id"],
        driver=share["driver"],
        pool=share["pool"],
        device=share["device"],
        consumed={k: Quantity.parse(v) for k, v in share["consumed"].items()},
    )


async def prove_bandwidth(
    rates: Sequence[Quantity],
    *,
    control_plane: ControlPlane,
    services: str,
    where: str = "",
    duration: float = 10.0,
    probe_rate: Quantity | None = None,
    aggressor: bool = True,
    changes: int = 10,
    tc_backend: Backend = "netlink",
) -> ProofReport:
    """Allocate through the control plane, baseline each share alone, then all at once.

    The shares are ResourceClaims applied through the tenant API of ``control_plane``
    and made real by its node agent of :data:`NODE`, whose enforcer shapes the lab's
    veth (through ``tc_backend``). ``services`` and ``where`` describe the services and
    the servers for the report.
    """
    probe_q = probe_rate or Quantity.parse("10M")
    total = sum((_bits(r) for r in rates), _bits(probe_q))
    # The default class (unclassified traffic, the aggressor) gets what the shares leave
    # of a link twice their sum, so the neighbour saturates a class of its own.
    link = Quantity.from_int(2 * total)
    async with NetnsPair() as pair:
        enforcer = pair.enforcer(default_rate=total, backend=tc_backend)
        async with control_plane(enforcer) as api:
            dclass, rslice = device_manifests(pair, link)
            await api.admin("deviceclasses.apply", dclass)
            await api.admin("namespaces.access", {"namespace": NAMESPACE, "classes": [CLASS]})
            await api.admin("slices.apply", rslice)
            applied: list[str] = []
            withdraw = _slice_manifest(pair, None, generation=2)
            try:
                report = await _measure(
                    pair, api, enforcer, [*rates, probe_q], applied, duration, aggressor, changes
                )
            except BaseException:
                with contextlib.suppress(Exception):  # the first error is the one to see
                    await release_claims(api, pair.tag, applied, within=5.0)
                    await api.admin("slices.apply", withdraw)
                raise
            # Capacity back: delete every claim, wait for the device to be all free, then
            # withdraw the device (the slice again, without devices).
            report.capacity_returned = await release_claims(api, pair.tag, applied)
            await api.admin("slices.apply", withdraw)
            agent = f"agent of {NODE} with TcEnforcer ({tc_backend}) on {pair.tx_if}"
            report.control_plane = f"{services} + {agent}" + (f"; {where}" if where else "")
            return report


async def _measure(
    pair: NetnsPair,
    api: ApiClient,
    enforcer: TcEnforcer,
    amounts: Sequence[Quantity],
    applied: list[str],
    duration: float,
    aggressor: bool,
    changes: int,
) -> ProofReport:
    """Claims through the API (names appended to ``applied``), then the measurements."""
    limits: list[ShareLimit] = []
    ready_ms: list[float] = []
    claims: list[str] = []
    marks: dict[str, int] = {}
    for i, amount in enumerate(amounts):
        name = f"{pair.tag}-{i}" if i < len(amounts) - 1 else f"{pair.tag}-probe"
        applied.append(name)
        view, ms = await apply_until_ready(api, name, claim_manifest(pair, name, amount))
        limit = _limit_of(view)
        mark = await enforcer.mark_of(limit.share_id)
        if mark is None:
            raise RuntimeError(f"claim {name} is Ready but share {limit.share_id} has no class")
        limits.append(limit)
        ready_ms.append(ms)
        claims.append(f"{NAMESPACE}/{name}")
        marks[limit.share_id] = mark
    shares, probe = limits[:-1], limits[-1]
    span = WARMUP + duration
    alone: dict[str, LoadResult] = {}
    for limit in shares:
        alone[limit.share_id] = await run_load(
            pair, [Flow(limit.share_id, marks[limit.share_id], 0.0, span)]
        )
    flows = [Flow(s.share_id, marks[s.share_id], 0.0, span) for s in shares]
    if aggressor:
        flows.append(Flow("aggressor", 0, 0.0, span))
    t0 = time.time() + 1.0
    load = asyncio.create_task(
        run_load(pair, flows, probe_mark=marks[probe.share_id], probe_window=(WARMUP, span), t0=t0)
    )
    # The kernel's own counters over the same window, read while the load runs.
    await asyncio.sleep(max(0.0, t0 + WARMUP - time.time()))
    before = {c.minor: c for c in await enforcer.classes(pair.tx_if, stats=True)}
    await asyncio.sleep(max(0.0, t0 + span - time.time()))
    after = {c.minor: c for c in await enforcer.classes(pair.tx_if, stats=True)}
    loaded = await load
    minors = {f.share_id: f.minor for f in await enforcer.filters(pair.tx_if)}
    figures: list[ShareFigures] = []
    for i, limit in enumerate(shares):
        sid = limit.share_id
        rate = _bits(limit.consumed["bandwidth"])
        base = alone[sid].rate(sid, WARMUP, span)
        got = loaded.rate(sid, WARMUP, span)
        seconds = loaded.per_second(sid, WARMUP, span)
        c0, c1 = before[minors[sid]], after[minors[sid]]
        figures.append(
            ShareFigures(
                share_id=sid,
                claim=claims[i],
                configured=rate,
                mark=marks[sid],
                ready_ms=ready_ms[i],
                alone=base,
                achieved=got,
                accuracy=got / rate - 1,
                worst_second=max((abs(x / rate - 1) for x in seconds), default=0.0),
                first_second=loaded.rate(sid, 0.0, 1.0) / rate,
                kernel_rate=(c1.bytes - c0.bytes) * 8 / duration,
                drops=c1.drops - c0.drops,
                interference=(base - got) / base if base else 0.0,
                pushed_below=got < rate * 0.97,
            )
        )
    # Enforcer-level: the time one apply takes to change a live share's rate in the
    # kernel (the agent's own enforcer, outside the log; the last change restores it).
    change_ms: list[float] = []
    target = shares[0]
    for i in range(changes):
        amount = target.consumed["bandwidth"] * (2 if i % 2 == 0 else 1)
        changed = msgspec.structs.replace(target, consumed={**target.consumed, "bandwidth": amount})
        start = time.perf_counter()
        await enforcer.apply(changed)
        change_ms.append((time.perf_counter() - start) * 1000)
    if changes % 2:
        await enforcer.apply(target)
    p50, p99 = loaded.probe.quantile(0.5), loaded.probe.quantile(0.99)
    return ProofReport(
        allocation="control plane: claims API -> event log -> relay -> reservation worker "
        "-> node agent (TcEnforcer)",
        control_plane="",
        duration=duration,
        shares=figures,
        probe_rate=_bits(probe.consumed["bandwidth"]),
        probe_ready_ms=ready_ms[-1],
        probe_p50_ms=p50 * 1000 if p50 is not None else None,
        probe_p99_ms=p99 * 1000 if p99 is not None else None,
        probe_samples=len(loaded.probe.rtts),
        apply_change_ms=change_ms,
        aggressor_rate=loaded.rate("aggressor", WARMUP, span) if aggressor else 0.0,
        capacity_returned=False,
    )
