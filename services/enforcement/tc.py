"""The traffic-control enforcer: one HTB class per share makes a bandwidth share real.

Design
------
* **One HTB root per interface.** The enforcer gets, at construction, a mapping
  ``(driver, pool, device) -> interface name``. The first share on an interface puts an
  HTB qdisc at its root with handle ``dca:`` (:data:`HTB_MAJOR`) and a default class
  ``dca:ffff`` that carries every unclassified packet at ``default_rate`` (set it to
  the link's speed). An interface whose root already holds a qdisc dracap did not put
  there (anything but the kernel's defaults ``noqueue``, ``mq``, ``pfifo_fast``,
  ``fq_codel``, ``fq``, ``pfifo``) is refused, permanently: dracap does not overwrite an
  operator's shaping.
* **One class per ShareID**, directly under the root, ``rate = ceil = consumed``: a
  share never borrows, so a saturating neighbour cannot take its tokens and it cannot
  take theirs. The amount is the share's consumed capacity named ``bandwidth``
  (:data:`CAPACITY`), a Kubernetes quantity in **bits per second**: ``"50M"`` is
  50 000 000 bit/s, ``"1G"`` is 10^9 bit/s, ``"100Mi"`` is 104 857 600 bit/s. The
  kernel keeps HTB rates in bytes per second, so the rate is rounded *up* to a multiple
  of 8 bit/s; the amount reported in force is the one read back from the kernel. HTB
  counts link-layer bytes (Ethernet header included, FCS and preamble not), the same
  bytes the NIC's own counters show.
* **Burst and quantum.** ``burst = cburst = max(rate x burst_time, 2 x 64 KiB)``:
  ``burst_time`` (4 ms by default) covers the timer and softirq latency at high rates
  (1 Gbit/s moves 500 KB in 4 ms; tc's default burst of ~1.6 KB would lose tokens at
  every late wake-up and under-deliver), and the 128 KiB floor lets a GSO/TSO
  super-packet (up to 64 KiB) through a slow class (10 Mbit/s) without starving it.
  The floor is what a 10 Mbit/s class may send above its rate once, at the start
  (~0.1 s worth): the first-second overshoot. ``quantum`` only matters for classes that
  borrow, which these do not; it is set explicitly (``rate/100`` within 9014 B and
  200 000 B) so the kernel never warns about it.
* **Classification by firewall mark.** Each share gets a class minor ``m`` in
  ``0x0010..0xfeff`` and the mark ``m << mark_shift`` (``mark_shift`` = 16 by default:
  the upper 16 bits, matched under the mask ``0xffff << mark_shift``, so the lower bits
  stay free for kube-proxy's 0x4000/0x8000 marks; with Calico, whose default mark
  mask is 0xffff0000, use ``mark_shift=0``). In Kubernetes the CNI, or an
  iptables/nftables rule in the Pod's network namespace, sets that mark on the Pod's
  packets; the CDI spec exports it to the container as ``DRACAP_SHARE_MARK``
  (:data:`SHARE_MARK_ENV`, from :meth:`TcEnforcer.mark_of`). The filter is a
  ``cls_bpf`` program in *classic* BPF (no compiler, no object file: ``tc filter ...
  bpf bytecode``) that loads ``skb->mark``, masks it and compares it with the share's
  mark. cls_bpf is used rather than ``fw`` or ``u32 match mark`` because it is built
  into every kernel that runs Cilium, while ``fw`` is optional and ``u32`` silently
  *ignores* the mark when the kernel lacks ``CONFIG_CLS_U32_MARK`` (the kernel of the
  development VM has neither).
* **Stable minor, deterministic collisions.** The minor is found by linear probing from
  ``sha256(ShareID) mod N`` over the N usable minors; the first candidate not held by
  another share on *any* interface of this enforcer wins (marks are unique node-wide, so
  a Pod's mark can never select another share's class on another interface). A share
  already in force keeps its minor (it is read back from the kernel), so the same
  ShareID always maps to the same mark while it lives; only when two ShareIDs collide
  does the later one take the next free slot.
* **The kernel is the only state.** Each filter carries its ShareID: after the program's
  two ``ret`` instructions come unreachable ``ld #k`` words (length, then the UTF-8
  bytes, 4 per word), which ``tc -j filter show`` prints back. :meth:`observe` (and an
  agent that restarts) therefore needs nothing but ``tc -j class show`` and
  ``tc -j filter show``. Each share's filter has its own priority (= its minor), so it
  can be deleted alone.
* **Idempotent, keyed by ShareID.** ``apply`` reads the kernel, reuses the share's
  minor, ``tc class replace``-s the class (create or change, one command) before adding
  the filter (a filter never points at a missing class), then reads the class back and
  reports level ``hard`` with the kernel's rate. ``remove`` deletes the filter, then
  the class (HTB refuses to delete a class a filter points at). A class left without a
  filter by a crash between the two steps is adopted by the next ``apply`` that probes
  its minor.
* **Errors.** A device missing from the mapping, an interface missing from the kernel,
  a missing/zero/oversized ``bandwidth``, a foreign root qdisc or a missing ``tc``
  binary raise :class:`~services.enforcement.enforcers.PermanentEnforcementError`;
  any other failure (busy, out of memory, a timeout, a read-back that does not
  match) raises :class:`~services.enforcement.enforcers.RetryableEnforcementError`.
  A missing interface is told at the boundary (``ENODEV`` on netlink, ``Cannot find
  device`` in ``tc``'s stderr) and carried by :class:`TcError`'s ``missing``; from
  there on the error's type carries the verdict. Admin-access shares consume nothing
  and get no class (level ``none``).

**Two backends, one kernel state.** By default (``backend="netlink"``) the requests go
over an rtnetlink socket of the enforcer's own (:mod:`services.enforcement.tcnetlink`):
no process per request, the interface named by index, the share's own class read back.
``backend="tc"`` (``dracap agent --tc-backend tc``) runs ``tc`` through asyncio
subprocesses (:class:`ProcessTc`); both write the same qdisc, classes and filters and
read each other's. What the two share (the handles, the BPF program, a class and a
filter as read back, :class:`TcError`, the :class:`TcBackend` protocol) is
:mod:`services.enforcement.tcobjects`, below both: the netlink backend never imports
this module back (contract ``tc-layers``). ``netns`` names the network namespace (``tc
-n NETNS``, or a netlink socket opened in it), which is how the tests and ``dracap prove
bandwidth`` drive namespaces. ``apply`` of a share already in force costs two reads (the
filters, its own class); a new share adds the class, the filter and their read-back.
``tc -j`` output is parsed where iproute2 prints JSON; iproute2 releases before 6.3
print classes as text even with ``-j``, so class listings fall back to a text parser
(rates printed by tc are rounded to 1 kbit/s above 1 Mbit/s; when the printed rate is
what tc prints for the rate dracap set, the exact rate is taken).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, Literal

from events.catalog import EnforcementLevel
from events.quantities import Quantity
from services.enforcement.enforcers import (
    AppliedLimit,
    EnforcementError,
    PermanentEnforcementError,
    RetryableEnforcementError,
    ShareLimit,
)
from services.enforcement.tcobjects import (
    DEFAULT_MINOR,
    HTB_MAJOR,
    MAX_SHARE_ID_BYTES,
    ClassState,
    FilterState,
    TcBackend,
    TcError,
    decode_program,
    encode_program,
)
from services.runtime.ground.waiting import wait_for

__all__ = [
    "BACKENDS",
    "CAPACITY",
    "DEFAULT_MINOR",
    "HTB_MAJOR",
    "SHARE_MARK_ENV",
    "Backend",
    "ClassState",
    "FilterState",
    "ProcessTc",
    "TcBackend",
    "TcEnforcer",
    "TcError",
    "candidate_minors",
    "decode_program",
    "encode_program",
    "parse_class_text",
    "parse_rate_text",
    "sprint_rate",
]

CAPACITY: Final = "bandwidth"
SHARE_MARK_ENV: Final = "DRACAP_SHARE_MARK"
MINOR_FIRST: Final = 0x0010
MINOR_LAST: Final = 0xFEFF
MINOR_COUNT: Final = MINOR_LAST - MINOR_FIRST + 1
_U32: Final = 0xFFFFFFFF
# Kernel default root qdiscs dracap may replace; anything else belongs to someone.
REPLACEABLE_ROOTS: Final = frozenset({"noqueue", "mq", "pfifo_fast", "fq_codel", "fq", "pfifo"})

_GSO_MAX: Final = 65536
_QUANTUM_MIN: Final = 9014
_QUANTUM_MAX: Final = 200_000
_MAX_RATE_BYTES: Final = 2**64 // 8 - 1


ROOT: Final = f"{HTB_MAJOR:x}:"


def _handle(minor: int) -> str:
    return f"{ROOT}{minor:x}"


def candidate_minors(share_id: str) -> Iterator[int]:
    """The class minors ``share_id`` may take, in the order they are tried."""
    start = int.from_bytes(hashlib.sha256(share_id.encode()).digest()[:8], "big") % MINOR_COUNT
    for i in range(MINOR_COUNT):
        yield MINOR_FIRST + (start + i) % MINOR_COUNT


def sprint_rate(bytes_per_s: int) -> str:
    """The rate as ``tc`` prints it in text (iproute2's ``sprint_rate``, SI units)."""
    rate = bytes_per_s * 8
    units = ("", "K", "M", "G", "T")
    i = 0
    while i < len(units) - 1:
        if rate < 1000 or (rate % 1000 != 0 and rate < 1000 * 1000):
            break
        rate //= 1000
        i += 1
    return f"{rate}{units[i]}bit"


_RATE_TEXT: Final = re.compile(r"^(\d+(?:\.\d+)?)([KMGT]?)(i?)(bit|bps)$")


def parse_rate_text(text: str) -> int:
    """Bytes per second of a rate ``tc`` printed (``50Mbit``, ``1200bit``, ``3Kibit``)."""
    match = _RATE_TEXT.match(text)
    if match is None:
        raise ValueError(f"not a tc rate: {text!r}")
    number, prefix, iec, unit = match.groups()
    base = 1024 if iec else 1000
    scale = base ** " KMGT".index(prefix or " ")
    value = float(number) * scale if "." in number else int(number) * scale
    return int(value) // 8 if unit == "bit" else int(value)


_CLASS_HEAD: Final = re.compile(r"^class (\S+) ([0-9a-f]+):([0-9a-f]+) ")
_SENT: Final = re.compile(
    r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", re.MULTILINE
)


def parse_class_text(text: str) -> list[ClassState]:
    """HTB classes of ``tc [-s] class show`` in iproute2's text format."""
    blocks = re.split(r"^(?=class )", text, flags=re.MULTILINE)
    out: list[ClassState] = []
    for block in blocks:
        head = _CLASS_HEAD.match(block)
        if head is None or head.group(1) != "htb" or int(head.group(2), 16) != HTB_MAJOR:
            continue
        rate = re.search(r" rate (\S+)", block)
        ceil = re.search(r" ceil (\S+)", block)
        if rate is None or ceil is None:
            continue
        sent = _SENT.search(block)
        stats = [int(g) for g in sent.groups()] if sent else [0, 0, 0, 0]
        out.append(
            ClassState(
                minor=int(head.group(3), 16),
                rate=parse_rate_text(rate.group(1)),
                ceil=parse_rate_text(ceil.group(1)),
                rate_text=rate.group(1),
                bytes=stats[0],
                packets=stats[1],
                drops=stats[2],
                overlimits=stats[3],
            )
        )
    return out


def _parse_class_json(doc: Any) -> list[ClassState]:
    out: list[ClassState] = []
    for item in doc if isinstance(doc, list) else []:
        if not isinstance(item, dict) or item.get("class") != "htb":
            continue
        major, _, minor = str(item.get("handle", "")).partition(":")
        if not minor or int(major or "0", 16) != HTB_MAJOR:
            continue
        out.append(
            ClassState(
                minor=int(minor, 16),
                rate=int(item.get("rate", 0)),
                ceil=int(item.get("ceil", 0)),
                bytes=int(item.get("bytes", 0)),
                packets=int(item.get("packets", 0)),
                drops=int(item.get("drops", 0)),
                overlimits=int(item.get("overlimits", 0)),
            )
        )
    return out


def _parse_filters(doc: Any) -> list[FilterState]:
    out: list[FilterState] = []
    for item in doc if isinstance(doc, list) else []:
        options = item.get("options") if isinstance(item, dict) else None
        if item.get("kind") != "bpf" or not isinstance(options, dict):
            continue
        code = options.get("bytecode")
        flow = str(options.get("flowid", ""))
        major, _, minor = flow.partition(":")
        if not isinstance(code, dict) or not minor or int(major or "0", 16) != HTB_MAJOR:
            continue
        insns = [(int(i["code"]), int(i["jt"]), int(i["jf"]), int(i["k"])) for i in code["insns"]]
        decoded = decode_program(insns)
        if decoded is None:
            continue
        mark, mask, share_id = decoded
        out.append(FilterState(int(item["pref"]), int(minor, 16), mark, mask, share_id))
    return out


Backend = Literal["netlink", "tc"]
#: How the enforcer talks to the kernel: rtnetlink (the default) or ``tc`` processes.
BACKENDS: Final[tuple[Backend, ...]] = ("netlink", "tc")


def htb_parameters(rate: int, burst_time: float) -> tuple[int, int]:
    """``(burst, quantum)`` in bytes of a class of ``rate`` bytes per second."""
    burst = max(int(rate * burst_time), 2 * _GSO_MAX)
    quantum = min(max(rate // 100, _QUANTUM_MIN), _QUANTUM_MAX)
    return burst, quantum


class ProcessTc:
    """:class:`TcBackend` by ``tc`` processes (``tc -n NETNS`` in a namespace)."""

    def __init__(self, netns: str | None = None, *, tc: str = "tc", timeout: float = 10.0) -> None:
        self.netns = netns
        self.tc = tc
        self.timeout = timeout

    def close(self) -> None:
        pass

    async def root(self, iface: str) -> tuple[str | None, str]:
        doc = json.loads(await self._run("-j", "qdisc", "show", "dev", iface, "root") or "[]")
        root = next((q for q in doc if isinstance(q, dict) and q.get("root")), None)
        kind = (root or {}).get("kind")
        return (None if kind is None else str(kind)), str((root or {}).get("handle", ""))

    async def replace_root(self, iface: str) -> None:
        await self._run("qdisc", "replace", "dev", iface, "root", "handle", ROOT, "htb",
                        "default", f"{DEFAULT_MINOR:x}")  # fmt: skip

    async def replace_class(
        self, iface: str, minor: int, rate: int, burst: int, quantum: int
    ) -> None:
        await self._run("class", "replace", "dev", iface, "parent", ROOT, "classid",
                        _handle(minor), "htb", "rate", f"{rate}bps", "ceil", f"{rate}bps",
                        "burst", str(burst), "cburst", str(burst),
                        "quantum", str(quantum))  # fmt: skip

    async def delete_class(self, iface: str, minor: int) -> None:
        await self._run("class", "del", "dev", iface, "classid", _handle(minor))

    async def replace_filter(
        self, iface: str, minor: int, program: Sequence[tuple[int, int, int, int]]
    ) -> None:
        bytecode = ",".join([str(len(program))] + [f"{c} {t} {f} {k}" for c, t, f, k in program])
        await self._run("filter", "replace", "dev", iface, "parent", ROOT,
                        "protocol", "all", "pref", str(minor), "handle", "1", "bpf",
                        "bytecode", bytecode, "classid", _handle(minor))  # fmt: skip

    async def delete_filter(self, iface: str, pref: int) -> None:
        await self._run("filter", "del", "dev", iface, "parent", ROOT, "pref", str(pref))

    async def filters(self, iface: str) -> list[FilterState]:
        out = await self._run("-j", "filter", "show", "dev", iface, "parent", ROOT)
        return _parse_filters(json.loads(out)) if out.strip() else []

    async def classes(self, iface: str, *, stats: bool = False) -> list[ClassState]:
        args = ["-j", *(["-s"] if stats else []), "class", "show", "dev", iface]
        return _parse_classes(await self._run(*args))

    async def get_class(self, iface: str, minor: int) -> list[ClassState]:
        out = await self._run("-j", "class", "show", "dev", iface, "classid", _handle(minor))
        return _parse_classes(out)

    async def _run(self, *args: str) -> str:
        argv = [self.tc, *(["-n", self.netns] if self.netns else []), *args]
        what = " ".join(argv)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
        except FileNotFoundError as exc:
            raise PermanentEnforcementError(
                f"the tc command ({self.tc}) is not installed",
            ) from exc
        try:
            out, err = await wait_for(proc.communicate(), self.timeout)
        except TimeoutError as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise TcError(what, f"timed out after {self.timeout}s") from exc
        if proc.returncode != 0:
            text = err.decode(errors="replace")
            raise TcError(what, f"exit {proc.returncode}: {text}", missing=_missing_text(text))
        return out.decode()


def _parse_classes(out: str) -> list[ClassState]:
    if out.lstrip().startswith("["):
        return _parse_class_json(json.loads(out))
    return parse_class_text(out)


def _missing_text(text: str) -> bool:
    """Whether ``tc``'s stderr says the interface does not exist (read at the boundary)."""
    return "Cannot find device" in text or "No such device" in text or "does not exist" in text


class TcEnforcer:
    """Bandwidth shares as HTB classes steered by firewall mark (see the module docstring).

    ``backend``: ``"netlink"`` (the default, :mod:`services.enforcement.tcnetlink`) or
    ``"tc"`` (a ``tc`` process per request); both put the same objects in the kernel.
    """

    level: EnforcementLevel = "hard"

    def __init__(
        self,
        interfaces: Mapping[tuple[str, str, str], str],
        *,
        netns: str | None = None,
        capacity: str = CAPACITY,
        default_rate: int = 10 * 10**9,
        burst_time: float = 0.004,
        mark_shift: int = 16,
        backend: Backend = "netlink",
        tc: str = "tc",
        timeout: float = 10.0,
    ) -> None:
        if not 0 <= mark_shift <= 16:
            raise ValueError("mark_shift must be within 0..16")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}")
        self.interfaces = dict(interfaces)
        self.netns = netns
        self.capacity = capacity
        self.default_rate = default_rate
        self.burst_time = burst_time
        self.mark_shift = mark_shift
        self.mask = 0xFFFF << mark_shift
        self.backend = backend
        self.timeout = timeout
        self.kernel: TcBackend
        if backend == "netlink":
            from services.enforcement.tcnetlink import NetlinkTc  # pyroute2: when chosen

            self.kernel = NetlinkTc(netns, timeout=timeout)
        else:
            self.kernel = ProcessTc(netns, tc=tc, timeout=timeout)
        self._lock = asyncio.Lock()
        #: interfaces whose root HTB qdisc this enforcer put or found in place (a failed
        #: request on one forgets it: the next apply looks again)
        self._rooted: set[str] = set()

    def close(self) -> None:
        """Release the backend's socket (the enforcer stays usable: it opens a new one)."""
        self.kernel.close()

    # -- the Enforcer protocol
    async def apply(self, limit: ShareLimit) -> AppliedLimit:
        """Put the share's class and filter in place (idempotent) and read them back."""
        iface = self._interface_of(limit)
        if limit.admin_access:
            return AppliedLimit(level="none", actual={})
        rate = self._rate_of(limit)
        async with self._lock:
            assumed = iface in self._rooted
            while True:
                try:
                    return await self._apply(iface, limit.share_id, rate)
                except TcError as exc:
                    self._rooted.discard(iface)
                    if exc.missing or not assumed:
                        raise self._error(iface, exc) from exc
                    # the root this enforcer put there may be gone (the interface was
                    # created again, an operator deleted it): look once more, now
                    assumed = False

    async def remove(self, share_id: str) -> None:
        """Delete the share's filter, then its class, wherever they are (idempotent)."""
        async with self._lock:
            for iface in self._names():
                try:
                    filters = await self.filters(iface)
                    for f in filters:
                        if f.share_id == share_id:
                            await self.kernel.delete_filter(iface, f.pref)
                            with contextlib.suppress(TcError):
                                await self.kernel.delete_class(iface, f.minor)
                except TcError as exc:
                    if exc.missing:
                        continue
                    raise RetryableEnforcementError(str(exc)) from exc

    async def observe(self) -> dict[str, AppliedLimit]:
        """Every share with a class and a filter in the kernel now, with the kernel's rate."""
        out: dict[str, AppliedLimit] = {}
        for iface in self._names():
            try:
                filters = await self.filters(iface)
                classes = {c.minor: c for c in await self.classes(iface)} if filters else {}
            except TcError as exc:
                if exc.missing:
                    continue
                raise RetryableEnforcementError(str(exc)) from exc
            for f in filters:
                cls = classes.get(f.minor)
                if cls is not None:
                    out[f.share_id] = self._applied(cls)
        return out

    async def health(self) -> dict[tuple[str, str, str], str | None]:
        """Each configured device: ``None``, or why its interface cannot be read back."""
        out: dict[tuple[str, str, str], str | None] = {}
        for key, iface in sorted(self.interfaces.items()):
            try:
                await self.kernel.root(iface)
            except TcError as exc:
                out[key] = (
                    f"interface {iface} is gone"
                    if exc.missing
                    else f"tc cannot read interface {iface}: {exc.stderr.strip()[:200]}"
                )
            except PermanentEnforcementError as exc:
                out[key] = str(exc)
            else:
                out[key] = None
        return out

    async def usage(self) -> dict[str, int]:
        """Bytes sent through each share's HTB class (its filter names the share)."""
        out: dict[str, int] = {}
        for iface in self._names():
            try:
                filters = await self.filters(iface)
                if not filters:
                    continue
                sent = {c.minor: c.bytes for c in await self.classes(iface, stats=True)}
            except TcError:
                continue  # an interface that cannot be read is health's to report
            for f in filters:
                if f.minor in sent:
                    out[f.share_id] = out.get(f.share_id, 0) + sent[f.minor]
        return out

    # -- read-outs (also used by ``dracap prove bandwidth`` and the CDI side)
    async def mark_of(self, share_id: str) -> int | None:
        """The firewall mark the share's packets must carry, if its limit is in force."""
        for iface in self._names():
            with contextlib.suppress(TcError):
                for f in await self.filters(iface):
                    if f.share_id == share_id:
                        return f.mark
        return None

    async def filters(self, iface: str) -> list[FilterState]:
        """dracap's filters on ``iface``."""
        return await self.kernel.filters(iface)

    async def classes(self, iface: str, *, stats: bool = False) -> list[ClassState]:
        """dracap's HTB classes on ``iface`` (with their counters when ``stats``)."""
        return await self.kernel.classes(iface, stats=stats)

    # -- internals
    def _names(self) -> list[str]:
        return sorted(set(self.interfaces.values()))

    def _interface_of(self, limit: ShareLimit) -> str:
        iface = self.interfaces.get((limit.driver, limit.pool, limit.device))
        if iface is None:
            raise PermanentEnforcementError(
                f"no network interface is configured for device "
                f"{limit.driver}/{limit.pool}/{limit.device} on this node",
            )
        return iface

    def _rate_of(self, limit: ShareLimit) -> int:
        amount = limit.consumed.get(self.capacity)
        if amount is None or amount.sign() <= 0:
            raise PermanentEnforcementError(
                f"share {limit.share_id} has no positive {self.capacity!r} capacity "
                f"(bits per second) to enforce",
            )
        rate = -(-amount.value() // 8)  # bit/s -> byte/s, rounded up
        if rate > _MAX_RATE_BYTES:
            raise PermanentEnforcementError(
                f"{self.capacity} {amount} of share {limit.share_id} is too large for HTB",
            )
        if not 0 < len(limit.share_id.encode()) <= MAX_SHARE_ID_BYTES:
            raise PermanentEnforcementError(
                f"ShareID {limit.share_id!r} is longer than {MAX_SHARE_ID_BYTES} bytes",
            )
        return rate

    async def _replace_class(self, iface: str, minor: int, rate: int) -> None:
        burst, quantum = htb_parameters(rate, self.burst_time)
        await self.kernel.replace_class(iface, minor, rate, burst, quantum)

    async def _ensure_root(self, iface: str) -> None:
        if iface not in self._rooted:
            await self._put_root(iface)
            self._rooted.add(iface)

    async def _put_root(self, iface: str) -> None:
        kind, handle = await self.kernel.root(iface)
        if kind == "htb" and handle == ROOT:
            return
        if kind is not None and kind not in REPLACEABLE_ROOTS:
            raise PermanentEnforcementError(
                f"interface {iface} already has a root qdisc {kind} {handle} that dracap "
                f"did not create; remove it or give dracap another interface",
            )
        await self.kernel.replace_root(iface)
        await self._replace_class(iface, DEFAULT_MINOR, -(-self.default_rate // 8))

    async def _apply(self, iface: str, share_id: str, rate: int) -> AppliedLimit:
        await self._ensure_root(iface)
        mine = await self.filters(iface)
        current = next((f for f in mine if f.share_id == share_id), None)
        if current is not None and current.mark != self._mark(current.minor):
            # A filter from another mark layout: drop it, the share gets a fresh one.
            await self.kernel.delete_filter(iface, current.pref)
            current = None
        if current is None:
            minor = await self._free_minor(iface, share_id, mine)
        else:
            minor = current.minor
        # only the share's own class is read, never the interface's whole list
        held = next(iter(await self.kernel.get_class(iface, minor)), None)
        if held is None or not self._holds(held, rate):
            await self._replace_class(iface, minor, rate)
            held = None
        if current is None:
            program = encode_program(self._mark(minor), self.mask, share_id)
            await self.kernel.replace_filter(iface, minor, program)
            back = [f for f in await self.filters(iface) if f.share_id == share_id]
            if [f.minor for f in back] != [minor]:
                raise TcError("filter read-back", f"filter of {share_id} not read back")
        cls = held or next(iter(await self.kernel.get_class(iface, minor)), None)
        if cls is None or not self._holds(cls, rate):
            raise TcError("class read-back", f"class {_handle(minor)} not read back")
        return self._applied(cls, rate)

    async def _free_minor(self, iface: str, share_id: str, mine: list[FilterState]) -> int:
        taken = {f.minor for f in mine}
        for other in self._names():
            if other != iface:
                with contextlib.suppress(TcError):
                    taken |= {f.minor for f in await self.filters(other)}
        for minor in candidate_minors(share_id):
            if minor not in taken:
                return minor  # free, or a class orphaned by a crash: adopted
        raise RetryableEnforcementError(f"no free HTB class on {iface} for {share_id}")

    def _mark(self, minor: int) -> int:
        return (minor << self.mark_shift) & _U32

    @staticmethod
    def _holds(cls: ClassState, rate: int) -> bool:
        if cls.rate_text is not None:  # text output: rounded by tc
            return cls.rate_text == sprint_rate(rate)
        return cls.rate == rate and cls.ceil == rate

    def _applied(self, cls: ClassState, rate: int | None = None) -> AppliedLimit:
        held = rate if rate is not None and self._holds(cls, rate) else cls.rate
        return AppliedLimit(level="hard", actual={self.capacity: Quantity.from_int(held * 8)})

    def _error(self, iface: str, exc: TcError) -> EnforcementError:
        if exc.missing:
            return PermanentEnforcementError(
                f"network interface {iface} does not exist on this node"
                + (f" (netns {self.netns})" if self.netns else ""),
            )
        return RetryableEnforcementError(f"tc failed on {iface}: {exc}")
