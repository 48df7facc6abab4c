"""The tc enforcer's kernel work over rtnetlink (pyroute2's message codecs), no ``tc`` process.

:class:`~services.enforcement.tc.TcEnforcer` decides *what* the kernel must hold (the
module docstring of :mod:`services.enforcement.tc`); a backend says it to the kernel.
The process backend runs ``tc`` (seven processes for a new share); this one sends the
same requests as rtnetlink messages on one socket of its own:

* **The same objects, the same bytes.** The HTB root (``dca:``, default class
  ``dca:ffff``), one HTB class per share and one ``cls_bpf`` filter per share carrying the
  *classic* BPF program of :func:`~services.enforcement.tcobjects.encode_program` (``TCA_BPF_OPS``
  and ``TCA_BPF_OPS_LEN``, the attributes ``tc filter ... bpf bytecode`` sends; no eBPF,
  no object file). The HTB parameters are the ones ``tc class replace ... htb rate R ceil
  R burst B cburst B quantum Q`` sends, rate tables (``TCA_HTB_RTAB``/``CTAB``) included,
  computed as iproute2 computes them from ``/proc/net/psched`` and cached per rate. What
  one backend writes the other reads back identically (tests/integration/test_tc_netlink.py).
* **Own nla classes.** pyroute2's ``cls_bpf`` options know only eBPF (``TCA_BPF_OPS`` as
  one u32) and its HTB class codec computes its own burst; :class:`TcMsg` and the option
  classes below define the attributes as the kernel does (``include/uapi/linux/pkt_cls.h``,
  ``pkt_sched.h``), and pyroute2 encodes the requests with them. Answers are read with
  ``struct`` (:func:`_parse`): pyroute2's generic decoder costs tens of microseconds per
  message, and a filter dump holds two messages per share.
* **Driven from asyncio.** The socket is non-blocking; requests are sent and answers
  read with the event loop's ``sock_recv`` (uvloop or asyncio), one exchange at a time
  per socket. Nothing blocks the loop and no thread is involved, except once per socket
  when ``netns`` is given: the socket is opened by a short-lived thread that enters the
  namespace (``setns``, which moves only the calling thread) and leaves it again; a
  socket keeps the namespace it was created in.
* **Interfaces by index.** A name is resolved once (``RTM_GETLINK``) and every request
  names the interface by index; an index the kernel no longer knows (``ENODEV``) is
  resolved once more and the request sent again: an interface created again under the
  same name is found, one that is gone is reported missing.
* **GETs are echoed.** A GET of one object (the root qdisc, one class) is answered by tc
  as a notification, which the kernel sends to the asker only with ``NLM_F_ECHO``; the
  requests ask for it and for the ack that ends the answer.
* **A down interface** still gets the HTB root: its root reads as the ``noop``
  placeholder, which counts as the kernel's default.
* **Errors** are :class:`~services.enforcement.tcobjects.TcError` like the process backend's:
  ``missing`` is set for ``ENODEV`` (the interface is gone), from the errno, not a text.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import os
import socket
import struct
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from pyroute2.netlink import nla, nlmsg
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from services.enforcement.tcobjects import (
    DEFAULT_MINOR,
    HTB_MAJOR,
    ClassState,
    FilterState,
    TcError,
    decode_program,
)
from services.runtime.ground.waiting import wait_for

__all__ = ["NetlinkTc", "TcMsg", "rate_table", "tick_in_usec"]

# rtnetlink message types and flags (linux/rtnetlink.h, linux/netlink.h)
RTM_GETLINK: Final = 18
RTM_NEWQDISC: Final = 36
RTM_GETQDISC: Final = 38
RTM_NEWTCLASS: Final = 40
RTM_DELTCLASS: Final = 41
RTM_GETTCLASS: Final = 42
RTM_NEWTFILTER: Final = 44
RTM_DELTFILTER: Final = 45
RTM_GETTFILTER: Final = 46
NLMSG_ERROR: Final = 2
NLMSG_DONE: Final = 3
NLM_F_REQUEST: Final = 0x1
NLM_F_ACK: Final = 0x4
NLM_F_ECHO: Final = 0x8
#: a GET of one object: tc answers it as a notification echoed to the caller, then acks
NLM_F_GET: Final = NLM_F_REQUEST | NLM_F_ACK | NLM_F_ECHO
NLM_F_DUMP: Final = 0x300
NLM_F_REPLACE: Final = 0x100
NLM_F_CREATE: Final = 0x400
NETLINK_ROUTE: Final = 0
SOL_NETLINK: Final = 270
NETLINK_EXT_ACK: Final = 11
NETLINK_GET_STRICT_CHK: Final = 12
CLONE_NEWNET: Final = 0x40000000
TC_H_ROOT: Final = 0xFFFFFFFF
ETH_P_ALL: Final = 0x0003
LINKLAYER_ETHERNET: Final = 1
HTB_MTU: Final = 1600  #: what tc's HTB assumes for the rate tables (q_htb.c)
HTB_VERSION: Final = 3
HTB_R2Q: Final = 10
TIME_UNITS_PER_SEC: Final = 1_000_000
_RECV: Final = 1 << 20
_HEADER: Final = struct.Struct("=IHHII")
_NAMES: Final = {
    RTM_GETLINK: "RTM_GETLINK",
    RTM_NEWQDISC: "RTM_NEWQDISC",
    RTM_GETQDISC: "RTM_GETQDISC",
    RTM_NEWTCLASS: "RTM_NEWTCLASS",
    RTM_DELTCLASS: "RTM_DELTCLASS",
    RTM_GETTCLASS: "RTM_GETTCLASS",
    RTM_NEWTFILTER: "RTM_NEWTFILTER",
    RTM_DELTFILTER: "RTM_DELTFILTER",
    RTM_GETTFILTER: "RTM_GETTFILTER",
}
_SOCK_FILTER: Final = struct.Struct("=HBBI")
_NLA: Final = struct.Struct("=HH")
_NLA_TYPE_MASK: Final = 0x3FFF  # without NLA_F_NESTED and NLA_F_NET_BYTEORDER
_TCMSG: Final = struct.Struct("=BBHiIII")
#: struct tc_htb_opt: two tc_ratespec (cell_log, linklayer, overhead, cell_align, mpu,
#: rate), then buffer, cbuffer, quantum, level, prio
_HTB_PARMS: Final = struct.Struct("=BBHhHIBBHhHIIIIII")
_STATS: Final = struct.Struct("=QIII")  # struct tc_stats: bytes, packets, drops, overlimits
TCA_KIND: Final = 1
TCA_OPTIONS: Final = 2
TCA_STATS: Final = 3
TCA_HTB_PARMS: Final = 1
TCA_HTB_RATE64: Final = 6
TCA_HTB_CEIL64: Final = 7
TCA_BPF_CLASSID: Final = 3
TCA_BPF_OPS: Final = 5
_ROOT_HANDLE: Final = HTB_MAJOR << 16


# -- the message codecs ----------------------------------------------------------------


class HtbQdiscOptions(nla):  # type: ignore[misc]
    """``TCA_OPTIONS`` of the HTB qdisc."""

    nla_map = (
        ("TCA_HTB_UNSPEC", "none"),
        ("TCA_HTB_PARMS", "none"),
        ("TCA_HTB_INIT", "htb_glob"),
        ("TCA_HTB_CTAB", "none"),
        ("TCA_HTB_RTAB", "none"),
        ("TCA_HTB_DIRECT_QLEN", "uint32"),
    )

    class htb_glob(nla):  # type: ignore[misc]  # noqa: N801 (pyroute2's naming)
        fields = (
            ("version", "I"),
            ("rate2quantum", "I"),
            ("defcls", "I"),
            ("debug", "I"),
            ("direct_pkts", "I"),
        )


class HtbClassOptions(nla):  # type: ignore[misc]
    """``TCA_OPTIONS`` of an HTB class (``struct tc_htb_opt`` and the rate tables)."""

    nla_map = (
        ("TCA_HTB_UNSPEC", "none"),
        ("TCA_HTB_PARMS", "htb_parms"),
        ("TCA_HTB_INIT", "none"),
        ("TCA_HTB_CTAB", "cdata"),
        ("TCA_HTB_RTAB", "cdata"),
        ("TCA_HTB_DIRECT_QLEN", "uint32"),
        ("TCA_HTB_RATE64", "uint64"),
        ("TCA_HTB_CEIL64", "uint64"),
    )

    class htb_parms(nla):  # type: ignore[misc]  # noqa: N801
        fields = (
            ("rate_cell_log", "B"),
            ("rate_linklayer", "B"),
            ("rate_overhead", "H"),
            ("rate_cell_align", "h"),
            ("rate_mpu", "H"),
            ("rate", "I"),
            ("ceil_cell_log", "B"),
            ("ceil_linklayer", "B"),
            ("ceil_overhead", "H"),
            ("ceil_cell_align", "h"),
            ("ceil_mpu", "H"),
            ("ceil", "I"),
            ("buffer", "I"),
            ("cbuffer", "I"),
            ("quantum", "I"),
            ("level", "I"),
            ("prio", "I"),
        )


class BpfFilterOptions(nla):  # type: ignore[misc]
    """``TCA_OPTIONS`` of a ``cls_bpf`` filter holding a classic BPF program."""

    nla_map = (
        ("TCA_BPF_UNSPEC", "none"),
        ("TCA_BPF_ACT", "none"),
        ("TCA_BPF_POLICE", "none"),
        ("TCA_BPF_CLASSID", "uint32"),
        ("TCA_BPF_OPS_LEN", "uint16"),
        ("TCA_BPF_OPS", "cdata"),
        ("TCA_BPF_FD", "uint32"),
        ("TCA_BPF_NAME", "asciiz"),
        ("TCA_BPF_FLAGS", "uint32"),
    )


class NoOptions(nla):  # type: ignore[misc]
    """Options of a kind dracap does not read."""

    nla_map = (("TCA_UNSPEC", "none"),)


class TcMsg(nlmsg):  # type: ignore[misc]
    """``struct tcmsg`` with the attributes dracap writes (requests are encoded by
    pyroute2 with these classes; answers are read by :func:`_parse`)."""

    prefix = "TCA_"
    fields = (
        ("family", "B"),
        ("pad1", "B"),
        ("pad2", "H"),
        ("index", "i"),
        ("handle", "I"),
        ("parent", "I"),
        ("info", "I"),
    )
    nla_map = (
        ("TCA_UNSPEC", "none"),
        ("TCA_KIND", "asciiz"),
        ("TCA_OPTIONS", "get_options"),
        ("TCA_STATS", "none"),
        ("TCA_XSTATS", "none"),
        ("TCA_RATE", "none"),
        ("TCA_FCNT", "none"),
        ("TCA_STATS2", "none"),
        ("TCA_STAB", "none"),
    )

    @staticmethod
    def get_options(self: Any, *argv: Any, **kwarg: Any) -> type:
        kind = self.get_attr("TCA_KIND")
        msg_type = self["header"]["type"]
        if kind == "htb":
            if msg_type in (RTM_NEWTCLASS, RTM_DELTCLASS, RTM_GETTCLASS):
                return HtbClassOptions
            return HtbQdiscOptions
        if kind == "bpf":
            return BpfFilterOptions
        return NoOptions


# -- HTB parameters as iproute2 computes them --------------------------------------------


@functools.cache
def tick_in_usec() -> float:
    """Kernel packet-scheduler ticks per microsecond (iproute2's ``tc_core_init``)."""
    try:
        with open("/proc/net/psched") as f:
            t2us, us2t, clock_res, _ = (int(w, 16) for w in f.read().split()[:4])
    except (OSError, ValueError):
        return 1.0
    if clock_res == 1_000_000_000:
        t2us = us2t
    return t2us / us2t * (clock_res / TIME_UNITS_PER_SEC)


def _xmittime(rate: int, size: int) -> int:
    """iproute2's ``tc_calc_xmittime``: ticks to send ``size`` bytes at ``rate`` B/s."""
    usec = int(TIME_UNITS_PER_SEC * (size / rate))
    return min(int(usec * tick_in_usec()), 0xFFFFFFFF)


def _cell_log(mtu: int = HTB_MTU) -> int:
    cell_log = 0
    while (mtu >> cell_log) > 255:
        cell_log += 1
    return cell_log


@functools.lru_cache(maxsize=1024)
def rate_table(rate: int, mtu: int = HTB_MTU) -> bytes:
    """The 256-slot rate table iproute2's ``tc_calc_rtable`` sends for ``rate`` B/s."""
    cell_log = _cell_log(mtu)
    return struct.pack("=256I", *(_xmittime(rate, (i + 1) << cell_log) for i in range(256)))


@functools.lru_cache(maxsize=1024)
def _class_options(rate: int, burst: int, quantum: int) -> tuple[Any, ...]:
    """The attributes of ``htb rate R ceil R burst B cburst B quantum Q`` (cached)."""
    buffer = _xmittime(rate, burst)
    rate32 = min(rate, 0xFFFFFFFF)
    cell_log = _cell_log()
    parms = {
        "rate_cell_log": cell_log,
        "rate_linklayer": LINKLAYER_ETHERNET,
        "rate_overhead": 0,
        "rate_cell_align": -1,
        "rate_mpu": 0,
        "rate": rate32,
        "ceil_cell_log": cell_log,
        "ceil_linklayer": LINKLAYER_ETHERNET,
        "ceil_overhead": 0,
        "ceil_cell_align": -1,
        "ceil_mpu": 0,
        "ceil": rate32,
        "buffer": buffer,
        "cbuffer": buffer,
        "quantum": quantum,
        "level": 0,
        "prio": 0,
    }
    attrs: list[tuple[str, Any]] = [("TCA_HTB_PARMS", parms)]
    if rate >= 1 << 32:
        attrs += [("TCA_HTB_RATE64", rate), ("TCA_HTB_CEIL64", rate)]
    table = rate_table(rate)
    attrs += [("TCA_HTB_RTAB", table), ("TCA_HTB_CTAB", table)]
    return tuple(attrs)


# -- network namespaces -----------------------------------------------------------------


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setns: {os.strerror(code)}")


def _socket_in(netns: str | None) -> socket.socket:
    """A non-blocking rtnetlink socket in ``netns`` (the caller's namespace if None)."""

    def open_socket() -> socket.socket:
        sock = socket.socket(
            socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE
        )
        try:
            sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
            sock.setsockopt(SOL_NETLINK, NETLINK_GET_STRICT_CHK, 1)
            sock.bind((0, 0))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    if netns is None:
        return open_socket()
    result: list[socket.socket | BaseException] = []

    def in_namespace() -> None:
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            result.append(exc)
            return
        try:
            target = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(target)
                try:
                    result.append(open_socket())
                finally:
                    _setns(own)  # this thread ends here either way
            finally:
                os.close(target)
        except BaseException as exc:
            result.append(exc)
        finally:
            os.close(own)

    thread = threading.Thread(target=in_namespace, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    (got,) = result
    if isinstance(got, BaseException):
        raise got
    return got


# -- the backend ------------------------------------------------------------------------


class NetlinkTc:
    """The kernel work of :class:`~services.enforcement.tc.TcEnforcer` over rtnetlink."""

    def __init__(self, netns: str | None = None, *, timeout: float = 10.0) -> None:
        self.netns = netns
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._closer: weakref.finalize[Any, Any] | None = None
        self._lock = asyncio.Lock()
        self._seq = 0
        self._indexes: dict[str, int] = {}

    def close(self) -> None:
        """Close the socket (a later request opens a new one)."""
        if self._closer is not None:
            self._closer()
        self._sock, self._closer = None, None

    # -- what TcEnforcer asks
    async def root(self, iface: str) -> tuple[str | None, str]:
        """The kind and handle (``"dca:"``) of the interface's root qdisc; ``None`` when
        only the kernel's built-in placeholder is there."""
        msgs = await self._tc(iface, RTM_GETQDISC, NLM_F_GET, parent=TC_H_ROOT)
        kind = msgs[0].kind if msgs else None
        if kind is None or kind == "noop":  # noop: the placeholder of a down interface
            return None, ""
        return kind, f"{msgs[0].handle >> 16:x}:"

    async def replace_root(self, iface: str) -> None:
        """``tc qdisc replace dev IFACE root handle dca: htb default ffff``."""
        init = {
            "version": HTB_VERSION,
            "rate2quantum": HTB_R2Q,
            "defcls": DEFAULT_MINOR,
            "debug": 0,
            "direct_pkts": 0,
        }
        await self._tc(
            iface,
            RTM_NEWQDISC,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
            handle=_ROOT_HANDLE,
            parent=TC_H_ROOT,
            attrs=[("TCA_KIND", "htb"), ("TCA_OPTIONS", {"attrs": [("TCA_HTB_INIT", init)]})],
        )

    async def replace_class(
        self, iface: str, minor: int, rate: int, burst: int, quantum: int
    ) -> None:
        """``tc class replace ... classid dca:MINOR htb rate R ceil R burst B ...``."""
        await self._tc(
            iface,
            RTM_NEWTCLASS,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
            handle=_ROOT_HANDLE | minor,
            parent=_ROOT_HANDLE,
            attrs=[
                ("TCA_KIND", "htb"),
                ("TCA_OPTIONS", {"attrs": list(_class_options(rate, burst, quantum))}),
            ],
        )

    async def delete_class(self, iface: str, minor: int) -> None:
        await self._tc(iface, RTM_DELTCLASS, NLM_F_REQUEST | NLM_F_ACK, handle=_ROOT_HANDLE | minor)

    async def replace_filter(
        self, iface: str, minor: int, program: Sequence[tuple[int, int, int, int]]
    ) -> None:
        """``tc filter replace ... pref MINOR handle 1 bpf bytecode ... classid dca:MINOR``."""
        ops = b"".join(_SOCK_FILTER.pack(*insn) for insn in program)
        await self._tc(
            iface,
            RTM_NEWTFILTER,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
            handle=1,
            parent=_ROOT_HANDLE,
            info=(minor << 16) | socket.htons(ETH_P_ALL),
            attrs=[
                ("TCA_KIND", "bpf"),
                (
                    "TCA_OPTIONS",
                    {
                        "attrs": [
                            ("TCA_BPF_OPS_LEN", len(program)),
                            ("TCA_BPF_OPS", ops),
                            ("TCA_BPF_CLASSID", _ROOT_HANDLE | minor),
                        ]
                    },
                ),
            ],
        )

    async def delete_filter(self, iface: str, pref: int) -> None:
        await self._tc(
            iface,
            RTM_DELTFILTER,
            NLM_F_REQUEST | NLM_F_ACK,
            parent=_ROOT_HANDLE,
            info=pref << 16,
        )

    async def filters(self, iface: str) -> list[FilterState]:
        """dracap's filters under ``dca:`` (a dump of the interface's filters)."""
        msgs = await self._tc(
            iface, RTM_GETTFILTER, NLM_F_REQUEST | NLM_F_DUMP, parent=_ROOT_HANDLE
        )
        out: list[FilterState] = []
        for msg in msgs:
            if msg.kind != "bpf" or msg.options is None:
                continue  # another kind, or the priority's head (no options), not a filter
            options = _attributes(msg.options)
            classid, ops = options.get(TCA_BPF_CLASSID), options.get(TCA_BPF_OPS)
            if classid is None or ops is None or len(classid) < 4:
                continue
            (target,) = struct.unpack_from("=I", classid)
            if target >> 16 != HTB_MAJOR:
                continue
            decoded = decode_program(list(_SOCK_FILTER.iter_unpack(ops[: len(ops) // 8 * 8])))
            if decoded is None:
                continue
            mark, mask, share_id = decoded
            out.append(FilterState(msg.info >> 16, target & 0xFFFF, mark, mask, share_id))
        return out

    async def classes(self, iface: str, *, stats: bool = False) -> list[ClassState]:
        """dracap's HTB classes on ``iface`` (with their counters)."""
        msgs = await self._tc(iface, RTM_GETTCLASS, NLM_F_REQUEST | NLM_F_DUMP)
        return [c for c in map(_class_state, msgs) if c is not None]

    async def get_class(self, iface: str, minor: int) -> list[ClassState]:
        """The one class ``dca:MINOR`` (empty when there is none)."""
        try:
            msgs = await self._tc(iface, RTM_GETTCLASS, NLM_F_GET, handle=_ROOT_HANDLE | minor)
        except TcError as exc:
            if exc.errno == errno.ENOENT:
                return []
            raise
        return [c for c in map(_class_state, msgs) if c is not None]

    # -- the socket
    async def _index(self, iface: str) -> int:
        cached = self._indexes.get(iface)
        if cached is not None:
            return cached
        msg = ifinfmsg()
        msg["family"] = socket.AF_UNSPEC
        msg["attrs"] = [("IFLA_IFNAME", iface)]
        try:
            answers = await self._request(RTM_GETLINK, NLM_F_REQUEST | NLM_F_ACK, msg)
        except TcError as exc:
            if exc.errno == errno.ENODEV:
                exc.missing = True
            raise
        index: int = struct.unpack_from("=i", answers[0], _HEADER.size + 4)[0]  # ifinfomsg
        self._indexes[iface] = index
        return index

    async def _tc(
        self,
        iface: str,
        msg_type: int,
        flags: int,
        *,
        handle: int = 0,
        parent: int = 0,
        info: int = 0,
        attrs: Sequence[tuple[str, Any]] = (),
    ) -> list[Reply]:
        for fresh in (iface not in self._indexes, True):
            msg = TcMsg()
            msg["family"] = socket.AF_UNSPEC
            msg["index"] = await self._index(iface)
            msg["handle"] = handle
            msg["parent"] = parent
            msg["info"] = info
            msg["attrs"] = list(attrs)
            try:
                return [_parse(body) for body in await self._request(msg_type, flags, msg)]
            except TcError as exc:
                if exc.errno != errno.ENODEV:
                    raise
                self._indexes.pop(iface, None)
                if fresh:
                    exc.missing = True
                    raise
                # a cached index the kernel no longer knows: the interface may have been
                # created again under the same name; resolve it once more
        raise AssertionError("unreachable")

    def _socket(self) -> socket.socket:
        if self._sock is None:
            raise RuntimeError("socket not open")
        return self._sock

    async def _open(self) -> socket.socket:
        if self._sock is None:
            if self.netns is None:
                sock = _socket_in(None)
            else:
                sock = await asyncio.to_thread(_socket_in, self.netns)
            self._sock = sock
            self._closer = weakref.finalize(self, sock.close)
        return self._sock

    async def _request(self, msg_type: int, flags: int, msg: Any) -> list[bytes]:
        msg["header"]["type"] = msg_type
        msg["header"]["flags"] = flags
        async with self._lock:
            sock = await self._open()
            self._seq = (self._seq % 0x7FFFFFFF) + 1
            seq = self._seq
            msg["header"]["sequence_number"] = seq
            msg.encode()
            what = _NAMES.get(msg_type, f"netlink request {msg_type}")
            try:
                return await wait_for(
                    self._exchange(sock, bytes(msg.data), seq, what), self.timeout
                )
            except TimeoutError as exc:
                self.close()  # answers may still arrive: a fresh socket for the next call
                raise TcError(what, f"no answer in {self.timeout}s") from exc
            except OSError as exc:
                self.close()
                raise TcError(what, str(exc), errno=exc.errno or 0) from exc

    async def _exchange(self, sock: socket.socket, data: bytes, seq: int, what: str) -> list[bytes]:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, data)
        out: list[bytes] = []
        while True:
            chunk = await loop.sock_recv(sock, _RECV)
            offset = 0
            while offset + _HEADER.size <= len(chunk):
                length, kind, _, got_seq, _ = _HEADER.unpack_from(chunk, offset)
                if length < _HEADER.size:
                    break
                body = chunk[offset : offset + length]
                offset += (length + 3) & ~3
                if got_seq != seq:
                    continue  # the late answer of an earlier exchange
                if kind == NLMSG_DONE:
                    return out
                if kind == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", body, _HEADER.size)
                    if code == 0:
                        return out
                    raise TcError(what, _error_text(body, -code), errno=-code)
                out.append(body)


def _error_text(body: bytes, code: int) -> str:
    """The errno's text, and the kernel's extended-ack message when it sent one."""
    text = os.strerror(code)
    # struct nlmsgerr: the error, the request's header, then (capped ack) the attributes
    offset = _HEADER.size + 4 + _HEADER.size
    while offset + 4 <= len(body):
        length, kind = struct.unpack_from("=HH", body, offset)
        if length < 4:
            break
        if kind == 1:  # NLMSGERR_ATTR_MSG
            text += ": " + body[offset + 4 : offset + length].rstrip(b"\0").decode(errors="replace")
            break
        offset += (length + 3) & ~3
    return text


@dataclass(frozen=True)
class Reply:
    """One tc object of a reply: the ``tcmsg`` fields and the attributes dracap reads."""

    index: int
    handle: int
    parent: int
    info: int
    kind: str | None
    options: bytes | None
    stats: bytes | None


def _attributes(data: bytes, offset: int = 0) -> dict[int, bytes]:
    """The netlink attributes of ``data`` from ``offset``, by type (flags stripped)."""
    out: dict[int, bytes] = {}
    end = len(data)
    while offset + 4 <= end:
        length, kind = _NLA.unpack_from(data, offset)
        if length < 4:
            break
        out[kind & _NLA_TYPE_MASK] = data[offset + 4 : offset + length]
        offset += (length + 3) & ~3
    return out


def _parse(body: bytes) -> Reply:
    """A tc answer (``tcmsg`` and its attributes) read with ``struct``: the replies are
    parsed here rather than by pyroute2's generic decoder, which costs tens of
    microseconds per message and a filter dump has two messages per share."""
    _, _, _, index, handle, parent, info = _TCMSG.unpack_from(body, _HEADER.size)
    attrs = _attributes(body, _HEADER.size + _TCMSG.size)
    kind = attrs.get(TCA_KIND)
    return Reply(
        index=index,
        handle=handle,
        parent=parent,
        info=info,
        kind=kind.rstrip(b"\0").decode(errors="replace") if kind is not None else None,
        options=attrs.get(TCA_OPTIONS),
        stats=attrs.get(TCA_STATS),
    )


def _class_state(msg: Reply) -> ClassState | None:
    if msg.kind != "htb" or msg.handle >> 16 != HTB_MAJOR or msg.options is None:
        return None
    options = _attributes(msg.options)
    parms = options.get(TCA_HTB_PARMS)
    if parms is None or len(parms) < _HTB_PARMS.size:
        return None
    fields = _HTB_PARMS.unpack_from(parms)
    rate, ceil = fields[5], fields[11]
    if (rate64 := options.get(TCA_HTB_RATE64)) is not None:
        (rate,) = struct.unpack_from("=Q", rate64)
    if (ceil64 := options.get(TCA_HTB_CEIL64)) is not None:
        (ceil,) = struct.unpack_from("=Q", ceil64)
    counters = (0, 0, 0, 0)
    if msg.stats is not None and len(msg.stats) >= _STATS.size:
        counters = _STATS.unpack_from(msg.stats)
    return ClassState(
        minor=msg.handle & 0xFFFF,
        rate=rate,
        ceil=ceil,
        bytes=counters[0],
        packets=counters[1],
        drops=counters[2],
        overlimits=counters[3],
    )
